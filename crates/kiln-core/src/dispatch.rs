//! The single chokepoint every primitive op passes through: check the operands (`Prim::infer`),
//! execute, and record an autograd node when gradients are wanted. High-level ops never execute
//! anything themselves; they only call `apply`.

use crate::autograd::{self, Node, SavedOutput};
use crate::prim::Prim;
use crate::{Error, Result, Tensor};

#[track_caller]
pub fn apply(prim: Prim, inputs: &[&Tensor]) -> Result<Tensor> {
    if let Some(first) = inputs.first() {
        if let Some(other) = inputs.iter().find(|t| t.device() != first.device()) {
            return Err(Error::Device {
                op: prim.name(),
                lhs: first.device(),
                rhs: other.device(),
                msg: "all operands must be on one device".into(),
            });
        }
    }
    let shapes: Vec<&[usize]> = inputs.iter().map(|t| t.shape()).collect();
    let dtypes: Vec<_> = inputs.iter().map(|t| t.dtype()).collect();
    let meta = prim.infer(&shapes, &dtypes)?;
    if let Some(i) = crate::intercept::current() {
        if let Some(r) = i.apply(&prim, inputs, &meta) {
            let out = r?;
            if i.records_autograd() && autograd::needs_grad(&prim, inputs) {
                let saved = SavedOutput::Traced(out.downgrade());
                out.attach_grad_fn(Node::prim(prim, inputs, saved), 0);
            }
            return Ok(out);
        }
    }
    let _span = crate::profiler::span(crate::profiler::Category::Op, || {
        crate::profiler::prim_label(&prim)
    });
    for t in inputs {
        t.ready(prim.name(), std::panic::Location::caller())?;
    }
    let (storage, layout) = crate::cpu::execute(&prim, inputs, &meta)?;
    let needs_grad = autograd::needs_grad(&prim, inputs);
    let out = Tensor::from_parts(storage, layout, meta.dtype, None);
    if !needs_grad {
        return Ok(out);
    }
    let node = Node::prim(prim, inputs, SavedOutput::Detached(out.clone()));
    Ok(out.with_grad_fn(node, 0))
}
