//! Channels-last layout (Inductor's layout optimization for convolution networks). cuDNN's fast
//! convolutions on tensor cores read and write NHWC memory; an NCHW network pays for transposes
//! inside every convolution, or runs slower kernels. This pass rewrites a device graph that
//! convolves so that its four-dimensional values are computed in NHWC *logical* order: every
//! rank-4 value `v` whose prim has an NHWC form gets a twin, `permute(v, [0, 2, 3, 1])`, computed
//! directly (the same prim with its dims, pads, shapes mapped; a convolution's channels-last
//! form, `ConvParams::channels_last`). A realized twin is a contiguous buffer, so NHWC memory;
//! the scheduler, the code generators and the memory plan need to know nothing of layouts.
//!
//! At the edges a permute converts: a value without an NHWC form (a reshape, a random draw, a
//! graph input) is read by the twins through `permute(v, TO)`, fused as index arithmetic; a twin
//! read by a prim without an NHWC form, through `permute(twin, FROM)`. Rank-4 graph outputs are
//! given back contiguous in NCHW order, as eager computes them (a guard downstream sees the
//! strides eager would give).
//!
//! A reduction over N, H and W (batch norm's statistics) becomes, in NHWC order, a reduction over
//! the outer dims with the channels innermost: its reads are coalesced when a thread owns a
//! channel (`split_reduction.rs` and the CUDA generator's outer reductions).
//!
//! Applied to the joint graph before AOT autograd partitions it (`Backend::prepare_joint`), so
//! the activations the forward saves for the backward are the NHWC twins; and to any other device
//! graph with an NCHW convolution when it is compiled, one size of a symbolic graph included
//! (the rewrite follows the graph's structure, so all sizes are rewritten alike and their
//! kernels fit one size-generic template). `KILN_CHANNELS_LAST=0` turns it off;
//! `KILN_CHANNELS_LAST=cpu` applies it on the CPU as well (see `wanted`).

use kiln_compile::graph::{Graph, Node, NodeId, Op};
use kiln_core::prim::{Prim, FROM_CHANNELS_LAST as FROM, TO_CHANNELS_LAST as TO};
use kiln_core::Device;

/// Whether the pass rewrites graphs computing on `device`: device graphs, unless
/// `KILN_CHANNELS_LAST=0` (to measure it); CPU graphs too under `KILN_CHANNELS_LAST=cpu` (the C
/// target then runs the NHWC graphs: a check of the pass with the CPU's bitwise comparisons; no
/// faster there).
fn applies_on(device: Device) -> bool {
    match std::env::var("KILN_CHANNELS_LAST").as_deref() {
        Ok("0") => false,
        Ok("cpu") => true,
        _ => device != Device::Cpu,
    }
}

/// Whether the pass rewrites `g`: a graph with a convolution in NCHW form, on a device it applies
/// on. A graph it has rewritten has none left, so the pass never applies twice.
pub fn wanted(g: &Graph) -> bool {
    applies_on(g.device())
        && g.nodes.iter().any(|n| match &n.op {
            Op::Prim(p) => p.conv_params().is_some_and(|c| !c.channels_last),
            Op::Input(_) => false,
        })
}

/// A rank-4 shape (or per-dim list) in NHWC order.
fn to_nhwc<T: Clone>(v: &[T]) -> Vec<T> {
    TO.iter().map(|&d| v[d].clone()).collect()
}

/// The NHWC form of `node`'s prim, when it has one: the prim computing `permute(v, TO)` from the
/// twins of its operands. Only rank-4 values whose operands are all rank 4.
fn nhwc_prim(g: &Graph, node: &Node) -> Option<Prim> {
    let Op::Prim(p) = &node.op else {
        return None;
    };
    if node.shape.len() != 4 || node.args.iter().any(|&a| g.nodes[a].shape.len() != 4) {
        return None;
    }
    Some(match p {
        p if p.is_elementwise() || *p == Prim::Contiguous => p.clone(),
        Prim::Expand(shape) => Prim::Expand(to_nhwc(shape)),
        Prim::Reduce { op, dims } => {
            let mut dims: Vec<usize> = dims.iter().map(|&d| FROM[d]).collect();
            dims.sort_unstable();
            Prim::Reduce { op: *op, dims }
        }
        Prim::Slice {
            dim,
            start,
            end,
            step,
        } => Prim::Slice {
            dim: FROM[*dim],
            start: *start,
            end: *end,
            step: *step,
        },
        Prim::Pad { pads, value } => Prim::Pad {
            pads: to_nhwc(pads),
            value: *value,
        },
        Prim::Cat { dim } => Prim::Cat { dim: FROM[*dim] },
        Prim::Full {
            shape,
            value,
            dtype,
        } => Prim::Full {
            shape: to_nhwc(shape),
            value: *value,
            dtype: *dtype,
        },
        // permute(permute(a, p), TO) read from a's twin permute(a, TO)
        Prim::Permute(perm) => Prim::Permute((0..4).map(|i| FROM[perm[TO[i]]]).collect()),
        Prim::Conv2d(c) if !c.channels_last => Prim::Conv2d(c.with_channels_last()),
        Prim::Conv2dGradInput {
            params,
            input_shape,
        } if !params.channels_last => Prim::Conv2dGradInput {
            params: params.with_channels_last(),
            input_shape: TO.map(|d| input_shape[d]),
        },
        Prim::Conv2dGradWeight {
            params,
            weight_shape,
        } if !params.channels_last => Prim::Conv2dGradWeight {
            params: params.with_channels_last(),
            weight_shape: TO.map(|d| weight_shape[d]),
        },
        // reshapes, random draws (their values follow the element order), gathers, matmuls
        _ => return None,
    })
}

/// The rewritten graph: what each old value became.
struct Rewrite {
    out: Graph,
    /// Per old node: its value in the original (NCHW) order, where made.
    plain: Vec<Option<NodeId>>,
    /// Per old node: its NHWC twin, where made.
    twin: Vec<Option<NodeId>>,
    /// Per old node: whether the rewrite computes it in NHWC order (its twin is its value).
    computed_nhwc: Vec<bool>,
    /// Per old node: its twin copied into dense NHWC memory, where a convolution needed it.
    dense: Vec<Option<NodeId>>,
}

impl Rewrite {
    fn permute(&mut self, of: NodeId, perm: [usize; 4]) -> NodeId {
        let n = &self.out.nodes[of];
        let node = Node {
            op: Op::Prim(Prim::Permute(perm.to_vec())),
            args: vec![of],
            shape: perm.iter().map(|&d| n.shape[d]).collect(),
            requires_grad: false,
            ..n.clone()
        };
        self.out.push(node)
    }

    /// Old node `id` in NCHW order (a permute of its twin, made once, if it has no other).
    fn plain(&mut self, id: NodeId) -> NodeId {
        if let Some(p) = self.plain[id] {
            return p;
        }
        let twin = self.twin[id].expect("every node has a plain value or a twin");
        let p = self.permute(twin, FROM);
        self.plain[id] = Some(p);
        p
    }

    /// Old node `id`'s NHWC twin (a permute of its plain value, made once, if it has no other).
    fn twin(&mut self, id: NodeId) -> NodeId {
        if let Some(t) = self.twin[id] {
            return t;
        }
        let plain = self.plain[id].expect("every node has a plain value or a twin");
        let t = self.permute(plain, TO);
        self.twin[id] = Some(t);
        t
    }

    /// Old node `id`'s twin as a convolution operand: cuDNN reads packed NHWC memory, so a twin
    /// that is only a permute of the NCHW value (a weight, the input image) is copied by a
    /// `Contiguous` of its own, made once: a generated kernel, which runs beside the others of
    /// its kind (every weight of a network in one launch), where the convolution would otherwise
    /// copy its operand eagerly, a launch each.
    fn dense_twin(&mut self, id: NodeId) -> NodeId {
        let t = self.twin(id);
        if self.computed_nhwc[id] {
            return t;
        }
        if let Some(d) = self.dense[id] {
            return d;
        }
        let node = Node {
            op: Op::Prim(Prim::Contiguous),
            args: vec![t],
            ..self.out.nodes[t].clone()
        };
        let d = self.out.push(node);
        self.dense[id] = Some(d);
        d
    }
}

/// `g` with its rank-4 values in NHWC order, or `None` when the pass does not apply (`wanted`).
pub fn channels_last(g: &Graph) -> Option<Graph> {
    wanted(g).then(|| rewrite(g))
}

/// The rewrite itself, whatever the graph's device.
pub(crate) fn rewrite(g: &Graph) -> Graph {
    let n = g.nodes.len();
    let mut r = Rewrite {
        out: g.empty_like(2 * n),
        plain: vec![None; n],
        twin: vec![None; n],
        computed_nhwc: vec![false; n],
        dense: vec![None; n],
    };
    for (id, node) in g.nodes.iter().enumerate() {
        match nhwc_prim(g, node) {
            Some(p) => {
                let args: Vec<NodeId> = match p.conv_params() {
                    Some(_) => node.args.iter().map(|&a| r.dense_twin(a)).collect(),
                    None => node.args.iter().map(|&a| r.twin(a)).collect(),
                };
                let t = r.out.push(Node {
                    op: Op::Prim(p),
                    args,
                    shape: to_nhwc(&node.shape),
                    ..node.clone()
                });
                r.twin[id] = Some(t);
                r.computed_nhwc[id] = true;
            }
            None => {
                let args: Vec<NodeId> = node.args.iter().map(|&a| r.plain(a)).collect();
                let p = r.out.push(Node {
                    args,
                    ..node.clone()
                });
                r.plain[id] = Some(p);
            }
        }
    }
    // a value computed in NHWC order is handed back as eager lays it out: contiguous NCHW (its
    // NCHW permute, which other readers may share, is a strided view)
    let mut contiguous: Vec<Option<NodeId>> = vec![None; n];
    for i in 0..g.outputs.len() {
        let o = g.outputs[i];
        let out = match (r.computed_nhwc[o], contiguous[o]) {
            (false, _) => r.plain(o),
            (true, Some(c)) => c,
            (true, None) => {
                let view = r.plain(o);
                let node = Node {
                    op: Op::Prim(Prim::Contiguous),
                    args: vec![view],
                    ..r.out.nodes[view].clone()
                };
                let c = r.out.push(node);
                contiguous[o] = Some(c);
                c
            }
        };
        r.out.outputs[i] = out;
    }
    r.out
}

#[cfg(test)]
mod tests {
    use kiln_compile::backends::Interpreter;
    use kiln_compile::CompiledGraph;
    use kiln_core::prim::{BinaryOp, ConvParams, ReduceOp, UnaryOp};
    use kiln_core::{DType, Tensor};

    use super::*;
    use crate::test_graphs::{input, push, sum, unary};

    /// conv → per-channel sum (keepdim) → subtract → relu → pad → slice → max-pool-like
    /// reduction → reshape: the ops a ResNet block is made of, on the graph of a device.
    fn block() -> Graph {
        let mut g = Graph::default();
        let x = input(&mut g, &[2, 3, 6, 5]);
        let w = input(&mut g, &[4, 3, 3, 3]);
        let p = ConvParams {
            stride: [1, 1],
            padding: [1, 1],
            dilation: [1, 1],
            groups: 1,
            channels_last: false,
        };
        let c = push(&mut g, Op::Prim(Prim::Conv2d(p)), vec![x, w], &[2, 4, 6, 5]);
        let s = sum(&mut g, c, &[0, 2, 3]);
        let e = push(
            &mut g,
            Op::Prim(Prim::Expand(vec![2, 4, 6, 5])),
            vec![s],
            &[2, 4, 6, 5],
        );
        let d = push(
            &mut g,
            Op::Prim(Prim::Binary(BinaryOp::Sub)),
            vec![c, e],
            &[2, 4, 6, 5],
        );
        let a = unary(&mut g, UnaryOp::Tanh, d);
        let pd = push(
            &mut g,
            Op::Prim(Prim::Pad {
                pads: vec![(0, 0), (0, 1), (1, 0), (0, 2)],
                value: 0.5,
            }),
            vec![a],
            &[2, 5, 7, 7],
        );
        let sl = push(
            &mut g,
            Op::Prim(Prim::Slice {
                dim: 2,
                start: 1,
                end: 7,
                step: 2,
            }),
            vec![pd],
            &[2, 5, 3, 7],
        );
        let m = push(
            &mut g,
            Op::Prim(Prim::Reduce {
                op: ReduceOp::Max,
                dims: vec![2, 3],
            }),
            vec![sl],
            &[2, 5, 1, 1],
        );
        let flat = push(
            &mut g,
            Op::Prim(Prim::Reshape(vec![2, 5])),
            vec![m],
            &[2, 5],
        );
        let t = push(
            &mut g,
            Op::Prim(Prim::Permute(vec![0, 2, 3, 1])),
            vec![a],
            &[2, 6, 5, 4],
        );
        // a reshape of `a` (no NHWC form) reads `a` in NCHW order, and `a` is an output too
        let a_flat = push(
            &mut g,
            Op::Prim(Prim::Reshape(vec![2, 120])),
            vec![a],
            &[2, 120],
        );
        g.outputs = vec![flat, a, t, a_flat];
        g
    }

    fn on_cpu(g: &Graph) -> Graph {
        let mut g = g.clone();
        for n in &mut g.nodes {
            n.device = Device::Cpu;
        }
        g
    }

    /// The rewritten graph computes what the original does (on the interpreter, on the CPU),
    /// with the convolution in its channels-last form and rank-4 outputs contiguous.
    #[test]
    fn rewritten_graph_computes_the_same_values() {
        let g = block();
        let r = channels_last(&g).expect("a graph that convolves on a device is rewritten");
        let convs: Vec<ConvParams> = r
            .nodes
            .iter()
            .filter_map(|n| match &n.op {
                Op::Prim(p) => p.conv_params(),
                _ => None,
            })
            .collect();
        assert_eq!(convs.len(), 1);
        assert!(convs[0].channels_last);
        assert!(!wanted(&r), "the pass applies once");
        assert_eq!(r.outputs.len(), g.outputs.len());
        // both run on the CPU: the interpreter computes every prim, channels-last ones included
        let x = Tensor::randn(&[2, 3, 6, 5], DType::F32).unwrap();
        let w = Tensor::randn(&[4, 3, 3, 3], DType::F32).unwrap();
        let ins = [x, w];
        let want = Interpreter::new(on_cpu(&g)).run(&ins).unwrap();
        let got = Interpreter::new(on_cpu(&r)).run(&ins).unwrap();
        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
            assert_eq!(a.shape(), b.shape(), "output {i}");
            let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
            for (u, v) in a.iter().zip(&b) {
                assert!(
                    (u - v).abs() <= 1e-5 * u.abs().max(1.0),
                    "output {i}: {u} vs {v}"
                );
            }
        }
        // the rank-4 output `a` is handed back contiguous, as eager lays it out
        assert!(got[1].is_contiguous());
    }

    /// The C target runs the rewritten graph (NHWC twins, the channels-last conv through the
    /// CPU reference, reductions over outer dims) to the same values as the original graph on
    /// the interpreter: the shared schedule and expression builder handle NHWC graphs.
    #[test]
    fn rewritten_graph_runs_on_the_c_target() {
        use kiln_compile::{Backend, BackendContext};
        let g = on_cpu(&block());
        let r = rewrite(&g);
        let x = Tensor::randn(&[2, 3, 6, 5], DType::F32).unwrap();
        let w = Tensor::randn(&[4, 3, 3, 3], DType::F32).unwrap();
        let ins = [x, w];
        let want = Interpreter::new(g).run(&ins).unwrap();
        let compiled = crate::CpuCodegen
            .compile(&r, &BackendContext::default())
            .expect("the C target compiles the NHWC graph");
        let got = compiled.run(&ins).unwrap();
        for (i, (a, b)) in want.iter().zip(&got).enumerate() {
            assert_eq!(a.shape(), b.shape(), "output {i}");
            let (a, b) = (a.to_vec::<f32>().unwrap(), b.to_vec::<f32>().unwrap());
            for (u, v) in a.iter().zip(&b) {
                assert!(
                    (u - v).abs() <= 1e-5 * u.abs().max(1.0),
                    "output {i}: {u} vs {v}"
                );
            }
        }
    }

    /// The convolution reads dense NHWC operands: the input and weight, graph inputs in NCHW
    /// order, each through a `Contiguous` of its permute (a generated copy), not the bare view
    /// the convolution would copy eagerly.
    #[test]
    fn convolution_operands_are_dense_copies() {
        let out = channels_last(&block()).expect("a device graph with a convolution");
        let conv = out
            .nodes
            .iter()
            .find(|n| matches!(&n.op, Op::Prim(p) if p.conv_params().is_some()))
            .expect("the convolution");
        for &a in &conv.args {
            let n = &out.nodes[a];
            assert!(matches!(n.op, Op::Prim(Prim::Contiguous)), "{:?}", n.op);
            assert!(matches!(
                out.nodes[n.args[0]].op,
                Op::Prim(Prim::Permute(_))
            ));
        }
    }

    #[test]
    fn cpu_graphs_and_graphs_without_convolutions_are_left_alone() {
        assert!(channels_last(&on_cpu(&block())).is_none(), "a CPU graph");
        let mut g = Graph::default();
        let x = input(&mut g, &[2, 3, 4, 4]);
        let y = unary(&mut g, UnaryOp::Exp, x);
        g.outputs = vec![y];
        assert!(channels_last(&g).is_none(), "no convolution");
    }
}
