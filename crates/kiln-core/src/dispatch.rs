//! The single chokepoint every primitive op passes through: check the operands (`Prim::infer`),
//! execute, and record an autograd node when gradients are wanted. High-level ops never execute
//! anything themselves; they only call `apply`.
//!
//! Where a prim runs follows its operands: all on the CPU, the CPU kernels (`cpu/`); all on one
//! device, that device's registered runtime (`device.rs`). Operand-less prims (creation) run where
//! `apply_on` says. The CPU path costs one comparison more than before devices existed.

use smallvec::SmallVec;

use crate::autograd::{self, Node, SavedOutput};
use crate::device::runtime_for;
use crate::prim::{OutMeta, Prim};
use crate::shape::Layout;
use crate::storage::{CpuStorage, Storage};
use crate::{DType, Device, Error, Result, Tensor};

#[track_caller]
pub fn apply(prim: Prim, inputs: &[&Tensor]) -> Result<Tensor> {
    apply_on(prim, inputs, Device::Cpu)
}

/// `apply`, with the device a creation prim (no operands) produces its tensor on; prims with
/// operands run on their operands' device and ignore `device`.
#[track_caller]
pub fn apply_on(prim: Prim, inputs: &[&Tensor], device: Device) -> Result<Tensor> {
    // operands run where they live; a CPU operand meeting device operands (a CPU scalar, in any
    // position: `cpu_scalar ** cuda_tensor` runs on the GPU, as in PyTorch) follows them
    let device = match inputs.first() {
        Some(first) => inputs
            .iter()
            .map(|t| t.device())
            .find(|&d| d != Device::Cpu)
            .unwrap_or(first.device()),
        None => device,
    };
    // PyTorch lets a CPU scalar meet device tensors; here that is a CPU operand that reads a
    // single element (a 0-dim tensor, possibly expanded): it is copied to the device
    let mut mixed = false;
    for t in inputs.iter().filter(|t| t.device() != device) {
        if t.is_deferred() {
            // a traced value's layout is not known yet (an expanded scalar reads as contiguous):
            // its device is checked now, its size when the graph runs it (`lift_scalars`)
            if device == Device::Cpu || t.device() != Device::Cpu {
                return Err(mismatch(&prim, device, t.device()));
            }
        } else {
            liftable(&prim, t, device)?;
        }
        mixed = true;
    }
    // on the stack: every prim passes here, and a trace records thousands
    let shapes: SmallVec<[&[usize]; 4]> = inputs.iter().map(|t| t.shape()).collect();
    let dtypes: SmallVec<[DType; 4]> = inputs.iter().map(|t| t.dtype()).collect();
    let meta = prim.infer(&shapes, &dtypes)?;
    if let Some(i) = crate::intercept::current() {
        // offered before any scalar is lifted: a tracer records the CPU scalar itself (a copy
        // made now would be a stale constant on replay)
        if let Some(r) = i.apply(&prim, inputs, &meta, device) {
            let out = r?;
            if i.records_autograd() && autograd::needs_grad(&prim, inputs) {
                let saved = SavedOutput::Traced(out.downgrade());
                out.attach_grad_fn(Node::prim(prim, inputs, saved), 0);
            }
            return Ok(out);
        }
    }
    let (lifted, lifted_refs);
    let mut inputs = inputs;
    if mixed {
        lifted = lift_scalars(&prim, inputs, device)?;
        lifted_refs = lifted.iter().collect::<Vec<_>>();
        inputs = &lifted_refs;
    }
    let _span = crate::profiler::span_on(crate::profiler::Category::Op, device, || {
        crate::profiler::prim_label(&prim)
    });
    let (storage, layout) = if device == Device::Cpu {
        for t in inputs {
            t.ready(prim.name(), std::panic::Location::caller())?;
        }
        crate::cpu::execute(&prim, inputs, &meta)?
    } else {
        execute_on_device(&prim, inputs, &meta, device)?
    };
    let needs_grad = autograd::needs_grad(&prim, inputs);
    let out = Tensor::from_parts(storage, layout, meta.dtype, None);
    if !needs_grad {
        return Ok(out);
    }
    let node = Node::prim(prim, inputs, SavedOutput::Detached(out.clone()));
    Ok(out.with_grad_fn(node, 0))
}

fn mismatch(prim: &Prim, a: Device, b: Device) -> Error {
    Error::Device {
        op: prim.name(),
        lhs: a,
        rhs: b,
        msg: "all operands must be on one device (move them with `.to(device)`)".into(),
    }
}

/// View prims re-lay the operand's buffer wherever it lives; the rest go to the device's runtime.
#[track_caller]
fn execute_on_device(
    prim: &Prim,
    inputs: &[&Tensor],
    meta: &OutMeta,
    device: Device,
) -> Result<(Storage, Layout)> {
    for t in inputs {
        t.ready(prim.name(), std::panic::Location::caller())?;
    }
    // views are re-laid over the same device buffer by the rule eager CPU execution uses
    let view = inputs.first().and_then(|t| prim.view_layout(t.layout()));
    if let Some(layout) = view {
        return Ok((inputs[0].0.storage.clone(), layout));
    }
    let buf = runtime_for(prim.name(), device)?.execute(device, prim, inputs, meta)?;
    Ok((Storage::Device(buf), Layout::contiguous(&meta.shape)))
}

/// Whether `t`, not on `device`, may be copied there for `prim`: a CPU tensor that reads a single
/// element (possibly expanded, to an empty shape too) and wants no gradient (the copy would be a
/// new leaf).
fn liftable(prim: &Prim, t: &Tensor, device: Device) -> Result<()> {
    match device != Device::Cpu
        && t.device() == Device::Cpu
        && t.reads_one_host_element()
        && !t.requires_grad()
    {
        true => Ok(()),
        false => Err(mismatch(prim, device, t.device())),
    }
}

/// Copies each single-element CPU operand to `device`, as a one-element buffer viewed with the
/// operand's shape (zero strides), except the first one the device's runtime takes as a value
/// (`takes_host_scalar`); any other CPU operand is a device mismatch.
fn lift_scalars(prim: &Prim, inputs: &[&Tensor], device: Device) -> Result<Vec<Tensor>> {
    let runtime = runtime_for(prim.name(), device)?;
    // a kept scalar may be saved for the backward: `binary_vjp` computes with it on the device
    let mut kept = false;
    inputs
        .iter()
        .map(|t| {
            if t.device() == device {
                return Ok((*t).clone());
            }
            liftable(prim, t, device)?;
            t.ready(prim.name(), std::panic::Location::caller())?;
            if !kept && runtime.takes_host_scalar(device, prim, t) {
                kept = true;
                return Ok((*t).clone());
            }
            upload_element(&*runtime, t, device)
        })
        .collect()
}

/// `t` on `device`, for a rule that computes with an operand the forward took by value (a CPU
/// scalar broadcast to the op's shape): its one element copied over and viewed with `t`'s shape
/// (zero strides), not the whole broadcast shape made and copied. Any other tensor moves as
/// `Tensor::to` moves it.
pub(crate) fn on_device(t: &Tensor, device: Device) -> Result<Tensor> {
    if t.device() == device || !t.reads_one_host_element() || t.requires_grad() {
        return t.to(device);
    }
    upload_element(&*runtime_for("to", device)?, t, device)
}

/// `t`'s one element (it reads a single one of its host storage) as a one-element buffer on
/// `device`, viewed with `t`'s shape.
fn upload_element(
    runtime: &dyn crate::device::DeviceRuntime,
    t: &Tensor,
    device: Device,
) -> Result<Tensor> {
    let l = t.layout();
    let value: CpuStorage = {
        let s = t.storage();
        crate::with_storage!(&*s, v => crate::storage::StorageElement::wrap(vec![v[l.offset]]))
    };
    let buf = runtime.upload(device, &value)?;
    let one = Layout::contiguous(&vec![1; l.rank()]);
    Ok(Tensor::from_device_buffer(buf, one.expand(&l.shape)))
}
