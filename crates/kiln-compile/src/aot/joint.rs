//! The joint forward+backward graph. The forward graph is replayed on placeholder tensors under a
//! recorder that keeps the autograd tape (the core's per-prim VJP rules, the one definition of each
//! prim's derivative); `autograd::grad` then walks that tape, and the prims its rules apply are
//! recorded too. The result is one graph: primals and tangents in, forward outputs and gradients out.

use std::collections::HashMap;
use std::panic::Location;
use std::sync::{Arc, Mutex, Weak};

use kiln_core::autograd::{self, is_differentiable, GradModeGuard};
use kiln_core::dispatch::apply_on;
use kiln_core::intercept::{self, Deferred, Interceptor};
use kiln_core::prim::{OutMeta, Prim};
use kiln_core::{Device, Error, Result, Tensor};

use crate::fast_hash::Fast;
use crate::graph::{Graph, Node, NodeId, Op};

/// A joint graph and how its inputs and outputs line up with the forward graph's.
pub struct Joint {
    /// Inputs: the forward graph's inputs (primals), then one tangent per `diff_outputs` entry.
    /// Outputs: the forward graph's outputs, then one gradient per `grad_inputs` entry.
    pub graph: Graph,
    pub num_primals: usize,
    pub num_fwd_outputs: usize,
    /// Forward outputs that carry gradient (float, depending on an input that requires grad).
    pub diff_outputs: Vec<usize>,
    /// Primals that receive a gradient, in gradient-output order.
    pub grad_inputs: Vec<usize>,
}

/// For each node of `g`: whether its value requires grad (the dispatcher's rule, applied to the
/// graph: grad mode on when traced, a differentiable prim, an operand that requires grad).
pub fn requires_grad(g: &Graph) -> Vec<bool> {
    let mut rg = vec![false; g.nodes.len()];
    for (id, n) in g.nodes.iter().enumerate() {
        rg[id] = match &n.op {
            Op::Input(_) => n.requires_grad,
            Op::Prim(p) => n.grad_enabled && is_differentiable(p) && n.args.iter().any(|&a| rg[a]),
        };
    }
    rg
}

/// The outputs of `fwd` that carry a gradient (float, depending on an input that requires grad);
/// none for an inference graph.
pub fn diff_outputs(fwd: &Graph) -> Vec<usize> {
    let rg = requires_grad(fwd);
    fwd.outputs
        .iter()
        .enumerate()
        .filter(|(_, &o)| rg[o] && fwd.nodes[o].dtype.is_float())
        .map(|(k, _)| k)
        .collect()
}

/// Builds the joint graph of `fwd`, or `None` when no output needs a gradient (an inference graph).
pub fn build(fwd: &Graph) -> Result<Option<Joint>> {
    let diff_outputs = diff_outputs(fwd);
    if diff_outputs.is_empty() {
        return Ok(None);
    }
    // the joint graph: every forward node again, and about as many backward nodes again
    let rec = Recorder::new(2 * fwd.nodes.len());
    let _on = intercept::install(Some(rec.clone()));
    let _grad = GradModeGuard::new(true);
    let mut vals: Vec<Option<Tensor>> = vec![None; fwd.nodes.len()];
    let mut primals = vec![None; fwd.num_inputs];
    for (id, n) in fwd.nodes.iter().enumerate() {
        let v = match &n.op {
            Op::Input(i) => {
                let t = rec.placeholder(&n.shape, n.dtype, n.device, n.requires_grad);
                if n.requires_grad {
                    t.set_requires_grad(true)?;
                }
                primals[*i] = Some(t.clone());
                t
            }
            Op::Prim(p) => {
                let args: Vec<&Tensor> = n
                    .args
                    .iter()
                    .map(|&a| vals[a].as_ref().ok_or_else(|| internal("operand missing")))
                    .collect::<Result<_>>()?;
                let _mode = GradModeGuard::new(n.grad_enabled);
                apply_on(p.clone(), &args, n.device)?
            }
        };
        vals[id] = Some(v);
    }
    let primals: Vec<Tensor> = primals
        .into_iter()
        .map(|p| p.ok_or_else(|| internal("forward graph input without a node")))
        .collect::<Result<_>>()?;
    let outs: Vec<Tensor> = fwd
        .outputs
        .iter()
        .map(|&o| vals[o].clone().ok_or_else(|| internal("output missing")))
        .collect::<Result<_>>()?;
    let diff: Vec<Tensor> = diff_outputs.iter().map(|&k| outs[k].clone()).collect();
    let tangents: Vec<Option<Tensor>> = diff
        .iter()
        .map(|o| Some(rec.placeholder(o.shape(), o.dtype(), o.device(), false)))
        .collect();
    let wrt: Vec<usize> = (0..primals.len())
        .filter(|&i| primals[i].requires_grad())
        .collect();
    let wrt_tensors: Vec<Tensor> = wrt.iter().map(|&i| primals[i].clone()).collect();
    let grads = autograd::grad(&diff, &wrt_tensors, &tangents)?;
    let mut grad_inputs = Vec::new();
    let mut grad_values = Vec::new();
    for (i, g) in wrt.into_iter().zip(grads) {
        if let Some(g) = g {
            grad_inputs.push(i);
            grad_values.push(g);
        }
    }
    let mut st = rec.lock();
    let mut outputs = Vec::with_capacity(outs.len() + grad_values.len());
    for t in outs.iter().chain(&grad_values) {
        outputs.push(
            *st.known
                .get(&t.id())
                .ok_or_else(|| internal("an output was not recorded"))?,
        );
    }
    let mut graph = std::mem::take(&mut st.graph);
    graph.outputs = outputs;
    graph.rng_span = fwd.rng_span;
    // what a derivative rule computes again as the forward did (a norm's mean) is computed once
    let graph = crate::cse::cse(&graph).unwrap_or(graph);
    Ok(Some(Joint {
        graph,
        num_primals: fwd.num_inputs,
        num_fwd_outputs: fwd.outputs.len(),
        diff_outputs,
        grad_inputs,
    }))
}

fn internal(msg: &str) -> Error {
    Error::arg(
        "aot autograd",
        format!("internal error building the joint graph: {msg}"),
    )
}

#[derive(Default)]
struct RecState {
    graph: Graph,
    /// Tensor id -> the joint node that holds it.
    known: HashMap<u64, NodeId, Fast>,
}

/// Records every prim into the joint graph; unlike the capture tracer it asks the dispatcher to keep
/// the autograd tape on the deferred tensors it returns.
struct Recorder {
    me: Weak<Recorder>,
    state: Mutex<RecState>,
}

impl Recorder {
    /// A recorder with room for `nodes` nodes (a hint).
    fn new(nodes: usize) -> Arc<Recorder> {
        let mut state = RecState::default();
        state.graph.nodes.reserve(nodes);
        state.known.reserve(nodes);
        Arc::new_cyclic(|me| Recorder {
            me: me.clone(),
            state: Mutex::new(state),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RecState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn deferred(&self, shape: &[usize], dtype: kiln_core::DType, device: Device) -> Option<Tensor> {
        let me: Arc<dyn Deferred> = self.me.upgrade()?;
        Some(Tensor::deferred(shape, dtype, device, me))
    }

    /// A new graph input (a primal or a tangent).
    fn placeholder(
        self: &Arc<Self>,
        shape: &[usize],
        dtype: kiln_core::DType,
        device: Device,
        requires_grad: bool,
    ) -> Tensor {
        let me: Arc<dyn Deferred> = self.clone();
        let t = Tensor::deferred(shape, dtype, device, me);
        let mut st = self.lock();
        let i = st.graph.num_inputs;
        st.graph.num_inputs += 1;
        let id = st.graph.push(Node {
            op: Op::Input(i),
            args: vec![],
            shape: shape.to_vec(),
            dtype,
            grad_enabled: false,
            requires_grad,
            device,
        });
        st.known.insert(t.id(), id);
        t
    }
}

impl Interceptor for Recorder {
    fn apply(
        &self,
        prim: &Prim,
        inputs: &[&Tensor],
        meta: &OutMeta,
        device: Device,
    ) -> Option<Result<Tensor>> {
        // made before taking the lock, so one lock covers the operands' lookups, the new node
        // and its id
        let out = self.deferred(&meta.shape, meta.dtype, device)?;
        let mut st = self.lock();
        let mut args = Vec::with_capacity(inputs.len());
        for t in inputs {
            match st.known.get(&t.id()) {
                Some(&id) => args.push(id),
                None => {
                    return Some(Err(Error::Unsupported {
                        op: "aot autograd",
                        msg: format!(
                            "a backward rule of `{}` read a tensor that is not part of the graph",
                            prim.name()
                        ),
                    }))
                }
            }
        }
        let id = st.graph.push(Node {
            op: Op::Prim(prim.clone()),
            args,
            shape: meta.shape.clone(),
            dtype: meta.dtype,
            grad_enabled: kiln_core::autograd::is_grad_enabled(),
            requires_grad: false,
            device,
        });
        st.known.insert(out.id(), id);
        Some(Ok(out))
    }

    fn assign(&self, _: &Tensor, _: &Tensor) -> Option<Result<()>> {
        Some(Err(Error::Unsupported {
            op: "aot autograd",
            msg: "an in-place write while building the backward graph".into(),
        }))
    }

    fn records_autograd(&self) -> bool {
        true
    }
}

impl Deferred for Recorder {
    fn force(&self, _: &Tensor, why: &'static str, at: &'static Location<'static>) -> Result<()> {
        Err(Error::Unsupported {
            op: "aot autograd",
            msg: format!(
                "`{why}` at {}:{} reads values while the backward graph is being built",
                at.file(),
                at.line()
            ),
        })
    }
}
