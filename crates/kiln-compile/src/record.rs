//! Tensor code recorded as graph nodes: an `Interceptor` that, while installed, turns every prim
//! the code applies into a node of the graph it holds and returns deferred tensors standing for
//! them. AOT autograd records its joint graph with it (the autograd tape kept, so the core's VJP
//! rules record the backward); a graph rewrite records an op's tensor-level definition in other
//! prims with `splice`, rather than writing those prims out a second time.

use std::collections::HashMap;
use std::panic::Location;
use std::sync::{Arc, Mutex, Weak};

use kiln_core::autograd::GradModeGuard;
use kiln_core::intercept::{self, Deferred, Interceptor};
use kiln_core::prim::{OutMeta, Prim};
use kiln_core::{DType, Device, Error, Result, Tensor};

use crate::fast_hash::Fast;
use crate::graph::{Graph, Node, NodeId, Op};

#[derive(Default)]
struct RecState {
    graph: Graph,
    /// Tensor id -> the node that holds it.
    known: HashMap<u64, NodeId, Fast>,
}

/// Records every prim applied while it is installed into its graph.
pub(crate) struct Recorder {
    me: Weak<Recorder>,
    state: Mutex<RecState>,
    /// Whether the dispatcher keeps the autograd tape on the tensors it returns.
    tape: bool,
    /// Who records, for errors ("aot autograd").
    what: &'static str,
}

impl Recorder {
    /// A recorder appending to `graph` (which keeps its nodes, inputs and outputs), with room for
    /// `more` nodes (a hint).
    pub(crate) fn new(mut graph: Graph, more: usize, tape: bool, what: &'static str) -> Arc<Self> {
        graph.nodes.reserve(more);
        let mut known = HashMap::default();
        known.reserve(more);
        Arc::new_cyclic(|me| Recorder {
            me: me.clone(),
            state: Mutex::new(RecState { graph, known }),
            tape,
            what,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RecState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn deferred(&self, shape: &[usize], dtype: DType, device: Device) -> Option<Tensor> {
        let me: Arc<dyn Deferred> = self.me.upgrade()?;
        Some(Tensor::deferred(shape, dtype, device, me))
    }

    /// A new graph input (a primal or a tangent).
    pub(crate) fn placeholder(
        self: &Arc<Self>,
        shape: &[usize],
        dtype: DType,
        device: Device,
        requires_grad: bool,
    ) -> Tensor {
        let id = self
            .lock()
            .graph
            .push_input(shape, dtype, device, requires_grad);
        self.bind(id)
    }

    /// A tensor standing for the value of node `id`, which the graph already has.
    fn bind(self: &Arc<Self>, id: NodeId) -> Tensor {
        let me: Arc<dyn Deferred> = self.clone();
        let mut st = self.lock();
        let n = &st.graph.nodes[id];
        let t = Tensor::deferred(&n.shape, n.dtype, n.device, me);
        st.known.insert(t.id(), id);
        t
    }

    /// The node that holds `t`'s value.
    pub(crate) fn node_of(&self, t: &Tensor) -> Result<NodeId> {
        self.lock()
            .known
            .get(&t.id())
            .copied()
            .ok_or_else(|| internal(self.what, "a result was not recorded"))
    }

    /// The graph recorded so far; the recorder is left empty.
    pub(crate) fn take(&self) -> Graph {
        let mut st = self.lock();
        st.known.clear();
        std::mem::take(&mut st.graph)
    }
}

/// Appends to `g` the nodes `f` applies to `args`' values and returns the nodes of what it
/// returns: an op written in other prims by its tensor-level definition (the one eager devices
/// run), not by hand. The new nodes take `grad_enabled` from `grad_enabled` (the grad mode `f`
/// runs under) and no autograd tape. `g` is unchanged when `f` fails.
pub fn splice(
    g: &mut Graph,
    args: &[NodeId],
    grad_enabled: bool,
    f: impl FnOnce(&[Tensor]) -> Result<Vec<Tensor>>,
) -> Result<Vec<NodeId>> {
    let before = g.nodes.len();
    let rec = Recorder::new(std::mem::take(g), 16, false, "graph rewrite");
    let ran = {
        let _on = intercept::install(Some(rec.clone()));
        let _mode = GradModeGuard::new(grad_enabled);
        let vals: Vec<Tensor> = args.iter().map(|&a| rec.bind(a)).collect();
        f(&vals).and_then(|outs| outs.iter().map(|t| rec.node_of(t)).collect())
    };
    *g = rec.take();
    if ran.is_err() {
        g.nodes.truncate(before);
    }
    ran
}

pub(crate) fn internal(what: &'static str, msg: &str) -> Error {
    Error::arg(what, format!("internal error recording a graph: {msg}"))
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
                        op: self.what,
                        msg: format!(
                            "`{}` read a tensor that is not part of the graph being recorded",
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
            op: self.what,
            msg: "an in-place write while a graph is being recorded".into(),
        }))
    }

    fn records_autograd(&self) -> bool {
        self.tape
    }
}

impl Deferred for Recorder {
    fn force(&self, _: &Tensor, why: &'static str, at: &'static Location<'static>) -> Result<()> {
        Err(Error::Unsupported {
            op: self.what,
            msg: format!(
                "`{why}` at {}:{} reads values while a graph is being recorded",
                at.file(),
                at.line()
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use kiln_core::prim::{BinaryOp, Prim};
    use kiln_core::{DType, Device, Result};

    use crate::graph::{Graph, Op};

    fn input(g: &mut Graph, shape: &[usize]) -> usize {
        g.push_input(shape, DType::F32, Device::Cpu, false)
    }

    /// Spliced tensor code becomes nodes over the given operands, in the grad mode asked for.
    #[test]
    fn splice_records_tensor_code_over_existing_nodes() -> Result<()> {
        let mut g = Graph::default();
        let a = input(&mut g, &[2, 3]);
        let b = input(&mut g, &[3]);
        let out = super::splice(&mut g, &[a, b], true, |v| Ok(vec![v[0].mul(&v[1])?]))?;
        assert_eq!(out.len(), 1);
        let n = &g.nodes[out[0]];
        assert!(matches!(n.op, Op::Prim(Prim::Binary(BinaryOp::Mul))));
        assert_eq!(n.shape, [2, 3]);
        assert!(n.grad_enabled);
        // the product reads `a` itself and `b` through the nodes of its broadcast
        assert_eq!(n.args[0], a);
        let mut from = n.args[1];
        while let Op::Prim(_) = g.nodes[from].op {
            assert_eq!(g.nodes[from].args.len(), 1);
            from = g.nodes[from].args[0];
        }
        assert_eq!(from, b);
        Ok(())
    }

    /// A failing body (here: reading values of a recorded tensor) leaves the graph as it was.
    #[test]
    fn a_failed_splice_leaves_the_graph_unchanged() -> Result<()> {
        let mut g = Graph::default();
        let a = input(&mut g, &[4]);
        let err = super::splice(&mut g, &[a], false, |v| {
            let s = v[0].sum(&[], false)?;
            let _ = s.item::<f32>()?;
            Ok(vec![s])
        });
        let msg = format!("{}", err.expect_err("reading a value while recording"));
        assert!(msg.contains("graph rewrite"), "{msg}");
        assert_eq!(g.nodes.len(), 1);
        assert_eq!(g.num_inputs, 1);
        Ok(())
    }
}
