//! AOT autograd's result on disk (PyTorch's AOTAutogradCache): the forward and backward graphs a
//! captured graph splits into, with what the run-time pair needs to wire them, keyed by the
//! captured graph and the inner backend's `cache_id` (whose `prepare_joint` rewrote the joint
//! graph). A new process that captures the same training step skips the joint graph's tracing
//! and the min-cut (DenseNet-121's: 25-35 ms on the GPU machine's host).

use crate::codec::{self, Reader, Seeds, Writer};
use crate::disk_cache;
use crate::graph::Graph;
use crate::prefetch::Prefetched;

const KIND: &str = "aot";

/// What AOT autograd derives from a graph that needs a backward.
#[derive(Clone, Debug, PartialEq)]
pub struct Split {
    /// Inputs: the primals. Outputs: the forward outputs, then the saved values.
    pub forward: Graph,
    /// Inputs: the saved values, then the tangents. Outputs: the gradients.
    pub backward: Graph,
    pub num_fwd_outputs: usize,
    pub num_saved: usize,
    pub saved_bytes: usize,
    /// Forward outputs that carry gradient.
    pub diff_outputs: Vec<usize>,
    /// Primals that receive a gradient, in gradient-output order.
    pub grad_inputs: Vec<usize>,
}

/// The key of `graph`'s split under an inner backend with cache id `id`.
pub fn key(graph: &Graph, id: &str) -> u128 {
    disk_cache::key(&[
        KIND.as_bytes(),
        id.as_bytes(),
        &crate::cache::structure_bytes(graph),
    ])
}

/// Splits read ahead while their functions are traced (`prefetch.rs`), by key.
static READ_AHEAD: Prefetched<Split> = Prefetched::new();

/// The split stored under `key`: the one read ahead, else read now.
pub fn load(key: u128) -> Option<Split> {
    READ_AHEAD.take_or_load(KIND, key, decode)
}

/// Starts reading the split stored under `key` on a thread of its own for the function
/// `function`.
pub fn read_ahead(function: &str, key: u128) {
    READ_AHEAD.start_disk(function, KIND, key, decode);
}

/// Drops the splits read ahead for `function` that no compile took.
pub fn discard_read_ahead(function: &str) {
    READ_AHEAD.discard(function);
}

pub fn store(key: u128, split: &Split) {
    disk_cache::store(KIND, key, &encode(split));
}

fn encode(s: &Split) -> Vec<u8> {
    let mut w = Writer::default();
    codec::graph(&mut w, &s.forward, Seeds::Keep);
    codec::graph(&mut w, &s.backward, Seeds::Keep);
    w.usize(s.num_fwd_outputs);
    w.usize(s.num_saved);
    w.usize(s.saved_bytes);
    w.usizes(&s.diff_outputs);
    w.usizes(&s.grad_inputs);
    w.bytes
}

fn decode(bytes: &[u8]) -> Option<Split> {
    let mut r = Reader::new(bytes);
    let s = Split {
        forward: codec::read_graph(&mut r)?,
        backward: codec::read_graph(&mut r)?,
        num_fwd_outputs: r.usize()?,
        num_saved: r.usize()?,
        saved_bytes: r.usize()?,
        diff_outputs: r.usizes()?,
        grad_inputs: r.usizes()?,
    };
    // the run-time pair indexes outputs and inputs with these
    let consistent = r.done()
        && s.forward.outputs.len() == s.num_fwd_outputs + s.num_saved
        && s.diff_outputs.iter().all(|&k| k < s.num_fwd_outputs)
        && s.grad_inputs.iter().all(|&i| i < s.forward.num_inputs)
        && s.backward.num_inputs == s.num_saved + s.diff_outputs.len()
        && s.backward.outputs.len() == s.grad_inputs.len();
    consistent.then_some(s)
}
