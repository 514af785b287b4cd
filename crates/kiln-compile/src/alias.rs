//! Writes through views, made functional.
//!
//! In eager mode `x.narrow(0, 1, 2).assign(y)` changes `x`, and every other view of `x` sees the
//! change because they share storage. A traced graph has no storage, only immutable values, so
//! the tracer keeps the eager aliasing on the side: which traced tensors are views of which root
//! (an argument, a captured tensor or a traced value), through which chain of view prims. A write
//! through a view becomes a new value of the root, `where(mask, gather(src, pos), root)`, where
//! `pos` and `mask` are constant index maps computed once at trace time from the chain; every
//! other live view of that root is then re-derived from the new value, as eager reads through the
//! shared storage would see it. A root that is an argument or captured tensor gets the new value
//! written back after each call, like any other input mutation.

use std::collections::HashMap;

use kiln_core::intercept;
use kiln_core::prim::Prim;
use kiln_core::shape::Layout;
use kiln_core::{DType, Error, Result, Tensor, WeakTensor};

use crate::fast_hash::Fast;

/// The tensor whose storage a view reads.
#[derive(Clone)]
pub(crate) enum Root {
    /// A real tensor (an argument or a captured tensor): writes must reach it after the call.
    Real(Tensor),
    /// A value traced in this segment, by tensor id.
    Traced(u64),
}

impl Root {
    pub(crate) fn id(&self) -> u64 {
        match self {
            Root::Real(t) => t.id(),
            Root::Traced(id) => *id,
        }
    }
}

/// A traced tensor that eager execution would have made a view of `root`.
#[derive(Clone)]
pub(crate) struct ViewOf {
    pub root: Root,
    /// The view prims from the root to this tensor, in order.
    pub chain: Vec<Prim>,
    /// This tensor's layout over the root's storage, as eager execution would have it.
    pub layout: Layout,
    pub tensor: WeakTensor,
    /// Whether this is a view at all depended on a real root's exact strides (a reshape of a view
    /// of a strided argument); the guards pin only contiguity.
    pub stride_dependent: bool,
}

/// The views traced in one segment, by tensor id (with the fast hasher: a trace records one per
/// view prim, and `of_root`'s order, which orders re-derived views in the graph, does not then
/// depend on a per-process hash seed).
#[derive(Default)]
pub(crate) struct Views(HashMap<u64, ViewOf, Fast>);

impl Views {
    pub(crate) fn get(&self, id: u64) -> Option<&ViewOf> {
        self.0.get(&id)
    }

    /// The layout `t` would have in eager mode: a view's computed layout, else `t`'s own: a
    /// traced value's is its fresh contiguous buffer's (`Tensor::deferred` lays it out so), a
    /// real tensor's is its actual layout.
    fn eager_layout<'a>(&'a self, t: &'a Tensor) -> &'a Layout {
        match self.0.get(&t.id()) {
            Some(v) => &v.layout,
            None => {
                debug_assert!(!t.is_deferred() || t.is_contiguous() && t.offset() == 0);
                t.layout()
            }
        }
    }

    /// Notes that `out = prim(input)` was traced; remembers it if eager execution would have made
    /// `out` a view.
    pub(crate) fn record(&mut self, prim: &Prim, input: &Tensor, out: &Tensor) {
        let Some(layout) = prim.view_layout(self.eager_layout(input)) else {
            return;
        };
        let (root, parent, inherited) = match self.0.get(&input.id()) {
            Some(v) => (v.root.clone(), &v.chain[..], v.stride_dependent),
            None if input.is_deferred() => (Root::Traced(input.id()), &[][..], false),
            None => (Root::Real(input.clone()), &[][..], false),
        };
        // one allocation, of the final length
        let mut chain = Vec::with_capacity(parent.len() + 1);
        chain.extend_from_slice(parent);
        // views of a contiguous root follow from its shape, which the guards pin
        let stride_dependent = inherited
            || matches!(prim, Prim::Reshape(_))
                && matches!(&root, Root::Real(t) if !t.is_contiguous());
        chain.push(prim.clone());
        self.0.insert(
            out.id(),
            ViewOf {
                root,
                chain,
                layout,
                tensor: out.downgrade(),
                stride_dependent,
            },
        );
    }

    /// The live views of `root_id`, by tensor id. Dead ones are forgotten.
    pub(crate) fn of_root(&mut self, root_id: u64) -> Vec<(u64, ViewOf)> {
        self.0.retain(|_, v| v.tensor.upgrade().is_some());
        self.0
            .iter()
            .filter(|(_, v)| v.root.id() == root_id)
            .map(|(&id, v)| (id, v.clone()))
            .collect()
    }
}

/// For a write through the view `chain` of a root of `root_shape`: `pos[i]`, the index into the
/// flattened written values that lands on the root's flat element `i`, and `mask[i]`, whether
/// any does. `None` when the view is empty (the write changes nothing).
pub(crate) fn scatter_maps(
    root_shape: &[usize],
    chain: &[Prim],
) -> Result<Option<(Tensor, Tensor)>> {
    let n: usize = root_shape.iter().product();
    // computed eagerly, outside the trace: these are constants of the graph
    let _off = intercept::install(None);
    let mut idx = Tensor::arange(0.0, n as f64, 1.0, DType::I64)?.reshape(root_shape)?;
    for p in chain {
        idx = kiln_core::dispatch::apply(p.clone(), &[&idx])?;
    }
    let flat: Vec<i64> = idx.contiguous()?.to_vec()?;
    if flat.is_empty() {
        return Ok(None);
    }
    let mut pos = vec![0i64; n];
    let mut mask = vec![false; n];
    for (k, &i) in flat.iter().enumerate() {
        let i = i as usize;
        if mask[i] {
            return Err(Error::Unsupported {
                op: "assign",
                msg: format!(
                    "writing into a view of shape {:?} whose elements overlap in memory (an \
                     expanded view of a {root_shape:?} tensor); PyTorch refuses this too",
                    idx.shape()
                ),
            });
        }
        pos[i] = k as i64;
        mask[i] = true;
    }
    Ok(Some((
        Tensor::from_vec(pos, &[n])?,
        Tensor::from_vec(mask, &[n])?,
    )))
}
