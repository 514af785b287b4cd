//! `Module::to(device)`: copies every parameter and buffer to a device and installs the copies in
//! the module. Checked before anything is installed: the tree must reach through its mutable
//! visitors exactly the tensors it lists, and every copy must succeed.

use std::collections::HashMap;

use kiln_core::{Device, Error, Result, Tensor};

use crate::Module;

pub(crate) fn move_module<M: Module + ?Sized>(module: &mut M, device: Device) -> Result<()> {
    let mut listed: Vec<(String, u64)> = Vec::new();
    let mut tensors: Vec<(String, Tensor)> = Vec::new();
    module.visit("", &mut |name, t, _| {
        listed.push((name.to_string(), t.id()));
        tensors.push((name.to_string(), t.clone()));
    });
    let mut reached: Vec<(String, u64)> = Vec::new();
    module.visit_mut("", &mut |name, t, _| {
        reached.push((name.to_string(), t.id()))
    });
    if listed != reached {
        return Err(unreachable_tensors(&listed, &reached, device));
    }
    // one copy per tensor: a tied weight appears under several names but is one handle
    let mut moved: HashMap<u64, Tensor> = HashMap::new();
    for (name, t) in &tensors {
        if let std::collections::hash_map::Entry::Vacant(slot) = moved.entry(t.id()) {
            slot.insert(move_tensor(name, t, device)?);
        }
    }
    module.visit_mut("", &mut |_, t, _| {
        if let Some(m) = moved.get(&t.id()) {
            *t = m.clone();
        }
    });
    Ok(())
}

/// The copy of one tensor on `device` (the same handle when it is there already), keeping what
/// makes it a parameter: a leaf with `requires_grad`, and its gradient.
fn move_tensor(name: &str, t: &Tensor, device: Device) -> Result<Tensor> {
    if t.device() == device {
        return Ok(t.clone());
    }
    let context = |e: Error| Error::Device {
        op: "Module::to",
        lhs: t.device(),
        rhs: device,
        msg: format!(
            "moving `{name}` ({:?} {}) to {device}: {e}",
            t.shape(),
            t.dtype()
        ),
    };
    let copy = kiln_core::no_grad(|| t.detach().to_device(device)).map_err(context)?;
    if t.requires_grad() {
        copy.set_requires_grad(true).map_err(context)?;
    }
    if let Some(g) = t.grad() {
        copy.set_grad(Some(g.to_device(device).map_err(context)?));
    }
    Ok(copy)
}

fn unreachable_tensors(
    listed: &[(String, u64)],
    reached: &[(String, u64)],
    device: Device,
) -> Error {
    let names = |v: &[(String, u64)]| v.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    let (l, r) = (names(listed), names(reached));
    let missing: Vec<&String> = l.iter().filter(|n| !r.contains(n)).collect();
    let extra: Vec<&String> = r.iter().filter(|n| !l.contains(n)).collect();
    let mut msg = String::from(
        "the module lists tensors (visit_own / children) that its mutable visitors \
         (visit_own_mut / children_mut) do not reach identically, so they cannot be moved; \
         nothing was moved.",
    );
    if !missing.is_empty() {
        msg += &format!(
            " Not reached: {missing:?} (implement visit_own_mut and children_mut for the module \
             types that hold them)."
        );
    }
    if !extra.is_empty() {
        msg += &format!(" Reached but not listed: {extra:?}.");
    }
    if missing.is_empty() && extra.is_empty() {
        msg += " The names agree but their order or identity differs: list them in the same order.";
    }
    Error::Device {
        op: "Module::to",
        lhs: Device::Cpu,
        rhs: device,
        msg,
    }
}
