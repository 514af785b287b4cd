//! `mark_dynamic` / `mark_static`: per-tensor marks on dimensions, read when a compiled function
//! first traces with that tensor as an argument (as torch._dynamo's marks live on the tensor).

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use kiln_core::{Error, Result, Tensor, WeakTensor};

#[derive(Default)]
struct Marks {
    tensor: Option<WeakTensor>,
    dynamic: Vec<usize>,
    fixed: Vec<usize>,
}

fn marks() -> &'static Mutex<HashMap<u64, Marks>> {
    static M: OnceLock<Mutex<HashMap<u64, Marks>>> = OnceLock::new();
    M.get_or_init(Default::default)
}

fn mark(t: &Tensor, dim: usize, dynamic: bool) -> Result<()> {
    if dim >= t.shape().len() {
        return Err(Error::arg(
            if dynamic {
                "mark_dynamic"
            } else {
                "mark_static"
            },
            format!(
                "dim {dim} is out of range for a tensor of shape {:?}",
                t.shape()
            ),
        ));
    }
    let mut m = marks().lock().unwrap_or_else(|e| e.into_inner());
    // forget marks of dropped tensors (ids are never reused, so this is only about memory)
    m.retain(|_, v| v.tensor.as_ref().is_some_and(|w| w.upgrade().is_some()));
    let e = m.entry(t.id()).or_default();
    e.tensor = Some(t.downgrade());
    let (add, remove) = if dynamic {
        (&mut e.dynamic, &mut e.fixed)
    } else {
        (&mut e.fixed, &mut e.dynamic)
    };
    remove.retain(|&d| d != dim);
    if !add.contains(&dim) {
        add.push(dim);
    }
    Ok(())
}

/// `torch._dynamo.mark_dynamic(t, dim)`: a compiled function first traced with `t` as an argument
/// compiles `dim` as a symbol at once (sizes 0 and 1 excepted: they are always specialised).
pub fn mark_dynamic(t: &Tensor, dim: usize) -> Result<()> {
    mark(t, dim, true)
}

/// `torch._dynamo.mark_static(t, dim)`: `dim` of `t` is never made symbolic; a new size of it is a
/// new compiled entry.
pub fn mark_static(t: &Tensor, dim: usize) -> Result<()> {
    mark(t, dim, false)
}

/// (dynamic dims, static dims) marked on `t`.
pub(crate) fn marks_of(t: &Tensor) -> (Vec<usize>, Vec<usize>) {
    let m = marks().lock().unwrap_or_else(|e| e.into_inner());
    match m.get(&t.id()) {
        Some(v) => (v.dynamic.clone(), v.fixed.clone()),
        None => (vec![], vec![]),
    }
}
