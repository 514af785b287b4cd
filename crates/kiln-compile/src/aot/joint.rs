//! The joint forward+backward graph. The forward graph is replayed on placeholder tensors under a
//! recorder that keeps the autograd tape (the core's per-prim VJP rules, the one definition of each
//! prim's derivative); `autograd::grad` then walks that tape, and the prims its rules apply are
//! recorded too. The result is one graph: primals and tangents in, forward outputs and gradients out.

use kiln_core::autograd::{self, is_differentiable, GradModeGuard};
use kiln_core::dispatch::apply_on;
use kiln_core::intercept;
use kiln_core::{Error, Result, Tensor};

use crate::graph::{Graph, Op};
use crate::record::Recorder;

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
    let rec = Recorder::new(Graph::default(), 2 * fwd.nodes.len(), true, "aot autograd");
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
    let outputs = outs
        .iter()
        .chain(&grad_values)
        .map(|t| rec.node_of(t))
        .collect::<Result<Vec<_>>>()?;
    let mut graph = rec.take();
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
    crate::record::internal("aot autograd", msg)
}
