//! Picking one element per row out of a computed value, as a sum over the row. `nll_loss` and
//! `cross_entropy` read each row's target class out of `log_softmax(x)` with a `gather`; a
//! gather is an extern call, so the log-probabilities were realized as a whole tensor just to
//! read one element of each row, and its gradient, a `scatter_add` into zeros, was an extern
//! call too. This pass rewrites
//!
//! - `gather(src, d, idx)` with one index per row (`idx` of size 1 along `d`, the other dims
//!   `src`'s) and `src` computed elementwise, into `sum_d(where(iota_d == idx, src, 0))`: every
//!   term but the picked one is an exact zero, so the sum is the picked value; the scheduler then
//!   fuses it into the kernel that computes the row (log_softmax's row kernel: max, sum of
//!   exponentials and the picked log-probability in one walk over the row);
//! - `scatter_add(zeros, d, idx, g)` with the same `idx` into `where(iota_d == idx, g, 0) + 0`
//!   (the `+ 0` makes a `-0.0` gradient `+0.0`, as adding it to zeros did), an elementwise value
//!   the backward's kernels fuse.
//!
//! An index out of range must still be an `Err` naming the gather, its dim and its size, as in
//! eager code. The rewritten gather keeps a gather of the same indices out of a zero row of the
//! source's length along `d` (a few bytes: the index check of the core's kernel, deferred to the
//! next synchronization on a GPU as eager gathers are), added to the sum. A `scatter_add` is
//! rewritten only when its indices are those of a gather checked this way, which runs first.

use kiln_compile::graph::{Graph, Node, NodeId, Op};
use kiln_core::prim::{BinaryOp, Prim, ReduceOp};
use kiln_core::DType;

use crate::ir::lower::{kind, Kind};
use crate::matchers::is_constant;

/// Whether `idx` holds one index per row of `base` along `dim`: of `base`'s rank, size 1 along
/// `dim`, `base`'s size along every other dim, int64 (as gather and scatter_add take them), on
/// `base`'s device.
fn one_per_row(base: &Node, idx: &Node, dim: usize) -> bool {
    base.shape.len() == idx.shape.len()
        && dim < base.shape.len()
        && idx.shape[dim] == 1
        && base.shape[dim] > 0
        && base
            .shape
            .iter()
            .zip(&idx.shape)
            .enumerate()
            .all(|(d, (b, i))| d == dim || b == i)
        && idx.dtype == DType::I64
        && matches!(base.dtype, DType::F32 | DType::F64)
        && base.device == idx.device
}

/// Whether a gather of `idx` out of `src` along `dim` is one the rewrite takes: one index per
/// row out of a value computed elementwise (a buffer's element is cheaper read than its row
/// walked).
fn picks_from_computed(g: &Graph, src: NodeId, idx: NodeId, dim: usize) -> bool {
    one_per_row(&g.nodes[src], &g.nodes[idx], dim) && kind(g, &g.nodes[src]) == Kind::Pointwise
}

/// Appends nodes to the rewritten graph, each on `like`'s device and grad mode.
struct Builder<'a> {
    out: &'a mut Graph,
    like: Node,
}

impl Builder<'_> {
    fn push(&mut self, prim: Prim, args: Vec<NodeId>, shape: &[usize], dtype: DType) -> NodeId {
        self.out.push(Node {
            op: Op::Prim(prim),
            args,
            shape: shape.to_vec(),
            dtype,
            requires_grad: false,
            ..self.like.clone()
        })
    }

    fn zeros(&mut self, shape: &[usize], dtype: DType) -> NodeId {
        let full = Prim::Full {
            shape: shape.to_vec(),
            value: 0.0,
            dtype,
        };
        self.push(full, vec![], shape, dtype)
    }

    /// `iota_dim == expand(idx)` over `shape`: true at each row's indexed element.
    fn picked(&mut self, shape: &[usize], dim: usize, idx: NodeId) -> NodeId {
        let idx_dtype = self.out.nodes[idx].dtype;
        let n = shape[dim];
        let iota = self.push(
            Prim::Iota {
                n,
                dtype: idx_dtype,
            },
            vec![],
            &[n],
            idx_dtype,
        );
        let mut line = vec![1; shape.len()];
        line[dim] = n;
        let line = self.push(Prim::Reshape(line.clone()), vec![iota], &line, idx_dtype);
        let iota = self.push(Prim::Expand(shape.to_vec()), vec![line], shape, idx_dtype);
        let idx = self.push(Prim::Expand(shape.to_vec()), vec![idx], shape, idx_dtype);
        self.push(
            Prim::Binary(BinaryOp::Eq),
            vec![iota, idx],
            shape,
            DType::Bool,
        )
    }

    /// `gather(src, dim, idx)` as a sum over the row, plus the index check's zeros.
    fn gather(&mut self, src: NodeId, dim: usize, idx: NodeId) -> NodeId {
        let (shape, dtype) = (self.out.nodes[src].shape.clone(), self.out.nodes[src].dtype);
        let idx_shape = self.out.nodes[idx].shape.clone();
        let picked = self.picked(&shape, dim, idx);
        let zeros = self.zeros(&shape, dtype);
        let terms = self.push(Prim::Where, vec![picked, src, zeros], &shape, dtype);
        let sum = Prim::Reduce {
            op: ReduceOp::Sum,
            dims: vec![dim],
        };
        let sum = self.push(sum, vec![terms], &idx_shape, dtype);
        // the check: the same indices gathered out of a zero row as long as `src`'s
        let mut row = vec![1; shape.len()];
        row[dim] = shape[dim];
        let row = self.zeros(&row, dtype);
        let mut along = vec![1; shape.len()];
        along[dim] = idx_shape.iter().product();
        let flat = self.push(
            Prim::Reshape(along.clone()),
            vec![idx],
            &along,
            self.out.nodes[idx].dtype,
        );
        let check = self.push(Prim::Gather { dim }, vec![row, flat], &along, dtype);
        let check = self.push(
            Prim::Reshape(idx_shape.clone()),
            vec![check],
            &idx_shape,
            dtype,
        );
        self.push(
            Prim::Binary(BinaryOp::Add),
            vec![sum, check],
            &idx_shape,
            dtype,
        )
    }

    /// `scatter_add(zeros, dim, idx, g)` as `where(picked, g, 0) + 0`.
    fn scatter(
        &mut self,
        shape: &[usize],
        dtype: DType,
        dim: usize,
        idx: NodeId,
        g: NodeId,
    ) -> NodeId {
        let picked = self.picked(shape, dim, idx);
        let g = self.push(Prim::Expand(shape.to_vec()), vec![g], shape, dtype);
        let zeros = self.zeros(shape, dtype);
        let terms = self.push(Prim::Where, vec![picked, g, zeros], shape, dtype);
        self.push(
            Prim::Binary(BinaryOp::Add),
            vec![terms, zeros],
            shape,
            dtype,
        )
    }
}

/// `g` with its one-per-row gathers out of computed values (and the scatter_adds of their
/// gradients) rewritten as sums and selects over the row, or `None` when there is none.
pub fn one_hot(g: &Graph) -> Option<Graph> {
    let wanted = g.nodes.iter().any(|n| match (&n.op, n.args.as_slice()) {
        (Op::Prim(Prim::Gather { dim }), &[src, idx]) => picks_from_computed(g, src, idx, *dim),
        _ => false,
    });
    if !wanted {
        return None;
    }
    let mut out = g.empty_like(g.nodes.len() + 32);
    let mut map: Vec<NodeId> = Vec::with_capacity(g.nodes.len());
    // the (rewritten graph's) index nodes whose range a check gather covers
    let mut checked: Vec<NodeId> = Vec::new();
    for node in &g.nodes {
        let args: Vec<NodeId> = node.args.iter().map(|&a| map[a]).collect();
        let rewritten = match (&node.op, args.as_slice()) {
            (Op::Prim(Prim::Gather { dim }), &[src, idx])
                if picks_from_computed(&out, src, idx, *dim) =>
            {
                checked.push(idx);
                let mut b = Builder {
                    out: &mut out,
                    like: node.clone(),
                };
                Some(b.gather(src, *dim, idx))
            }
            (Op::Prim(Prim::ScatterAdd { dim }), &[base, idx, grad])
                if checked.contains(&idx)
                    && is_constant(&out, base, 0.0)
                    && out.nodes[base].dtype == node.dtype
                    && out.nodes[grad].shape == out.nodes[idx].shape
                    && out.nodes[grad].dtype == node.dtype
                    && one_per_row(&out.nodes[base], &out.nodes[idx], *dim) =>
            {
                let mut b = Builder {
                    out: &mut out,
                    like: node.clone(),
                };
                Some(b.scatter(&node.shape, node.dtype, *dim, idx, grad))
            }
            _ => None,
        };
        map.push(match rewritten {
            Some(id) => id,
            None => out.push(Node {
                args,
                ..node.clone()
            }),
        });
    }
    out.outputs = g.outputs.iter().map(|&o| map[o]).collect();
    Some(out)
}

#[cfg(test)]
mod tests {
    use kiln_compile::backends::Interpreter;
    use kiln_compile::CompiledGraph;
    use kiln_core::prim::UnaryOp;
    use kiln_core::{Device, Tensor};

    use super::*;
    use crate::test_graphs::cpu::{input, push};

    /// An integer input of `shape` and `dtype` on the CPU.
    fn index_input(g: &mut Graph, shape: &[usize], dtype: DType) -> NodeId {
        let id = input(g, shape);
        g.nodes[id].dtype = dtype;
        id
    }

    /// `gather(exp(x), dim, idx)`, `x` of `shape`, one index per row along `dim`; and with
    /// `scatter`, `scatter_add(zeros, dim, idx, picked)` of the picked values.
    fn graph(shape: &[usize], dim: usize, dtype: DType, scatter: bool) -> Graph {
        let mut g = Graph::default();
        let x = input(&mut g, shape);
        let mut idx_shape = shape.to_vec();
        idx_shape[dim] = 1;
        let idx = index_input(&mut g, &idx_shape, dtype);
        let e = push(&mut g, Op::Prim(Prim::Unary(UnaryOp::Exp)), vec![x], shape);
        let picked = push(
            &mut g,
            Op::Prim(Prim::Gather { dim }),
            vec![e, idx],
            &idx_shape,
        );
        g.outputs = vec![picked];
        if scatter {
            let zeros = Prim::Full {
                shape: shape.to_vec(),
                value: 0.0,
                dtype: DType::F32,
            };
            let zeros = push(&mut g, Op::Prim(zeros), vec![], shape);
            let back = Op::Prim(Prim::ScatterAdd { dim });
            let back = push(&mut g, back, vec![zeros, idx, picked], shape);
            g.outputs.push(back);
        }
        g
    }

    /// Indices for `graph`'s second input: row `r`'s is `(3 r + 1) % n`, or `bad` at row 0.
    fn indices(shape: &[usize], dim: usize, dtype: DType, bad: Option<i64>) -> Tensor {
        let mut idx_shape = shape.to_vec();
        idx_shape[dim] = 1;
        let rows: usize = idx_shape.iter().product();
        let mut v: Vec<i64> = (0..rows as i64)
            .map(|r| (3 * r + 1) % shape[dim] as i64)
            .collect();
        if let Some(b) = bad {
            v[0] = b;
        }
        let t = Tensor::from_vec(v, &idx_shape).expect("indices");
        t.to_dtype(dtype).expect("cast")
    }

    /// Along a middle dim, the last and the first: the rewrite gives the gather's values and
    /// the scatter's, bit for bit.
    #[test]
    fn sums_over_the_row_give_the_gathered_values() -> kiln_core::Result<()> {
        for (shape, dim, dtype) in [
            (&[3usize, 5, 4][..], 1usize, DType::I64),
            (&[6, 7][..], 1, DType::I64),
            (&[5, 2, 1][..], 0, DType::I64),
        ] {
            let g = graph(shape, dim, dtype, true);
            let r = one_hot(&g).expect("a gather to rewrite");
            assert!(
                !r.nodes.iter().any(|n| {
                    matches!(n.op, Op::Prim(Prim::ScatterAdd { .. }))
                        || matches!(&n.op, Op::Prim(Prim::Gather { .. }) if n.args.first().is_some_and(|&a| r.nodes[a].numel() > shape[dim]))
                }),
                "only the check gather is left"
            );
            let args = [
                Tensor::randn(shape, DType::F32)?,
                indices(shape, dim, dtype, None),
            ];
            let want = Interpreter::new(g).run(&args)?;
            let got = Interpreter::new(r).run(&args)?;
            for (w, o) in want.iter().zip(&got) {
                assert_eq!(w.shape(), o.shape());
                assert_eq!(
                    w.to_vec::<f32>()?,
                    o.to_vec::<f32>()?,
                    "{shape:?} dim {dim}"
                );
            }
        }
        Ok(())
    }

    /// An index out of range is the gather's error, naming its dim and size.
    #[test]
    fn the_check_gather_reports_a_bad_index() {
        let (shape, dim) = ([4usize, 6], 1);
        let r = one_hot(&graph(&shape, dim, DType::I64, false)).expect("a gather to rewrite");
        for bad in [6, -1] {
            let args = [
                Tensor::randn(&shape, DType::F32).expect("x"),
                indices(&shape, dim, DType::I64, Some(bad)),
            ];
            let e = Interpreter::new(r.clone()).run(&args).map(|_| ());
            let msg = e.expect_err("a bad index").to_string();
            assert!(msg.contains("gather") && msg.contains("size 6"), "{msg}");
        }
    }

    /// Left alone: a gather out of a buffer (a graph input: reading one element beats walking
    /// the row), one of several indices per row, and a scatter_add whose indices no checked
    /// gather read.
    #[test]
    fn other_gathers_and_scatters_are_left_alone() {
        let mut g = Graph::default();
        let x = input(&mut g, &[4, 6]);
        let idx = index_input(&mut g, &[4, 1], DType::I64);
        let picked = push(
            &mut g,
            Op::Prim(Prim::Gather { dim: 1 }),
            vec![x, idx],
            &[4, 1],
        );
        g.outputs = vec![picked];
        assert!(one_hot(&g).is_none(), "out of a buffer");

        let mut g = Graph::default();
        let x = input(&mut g, &[4, 6]);
        let idx = index_input(&mut g, &[4, 2], DType::I64);
        let e = push(
            &mut g,
            Op::Prim(Prim::Unary(UnaryOp::Exp)),
            vec![x],
            &[4, 6],
        );
        let picked = push(
            &mut g,
            Op::Prim(Prim::Gather { dim: 1 }),
            vec![e, idx],
            &[4, 2],
        );
        g.outputs = vec![picked];
        assert!(one_hot(&g).is_none(), "two indices per row");

        // a rewritten gather beside a scatter_add of other indices: the scatter stays
        let mut g = graph(&[4, 6], 1, DType::I64, false);
        let other = index_input(&mut g, &[4, 1], DType::I64);
        let zeros = Prim::Full {
            shape: vec![4, 6],
            value: 0.0,
            dtype: DType::F32,
        };
        let zeros = push(&mut g, Op::Prim(zeros), vec![], &[4, 6]);
        let picked = g.outputs[0];
        let back = Op::Prim(Prim::ScatterAdd { dim: 1 });
        let back = push(&mut g, back, vec![zeros, other, picked], &[4, 6]);
        g.outputs.push(back);
        let r = one_hot(&g).expect("the gather is rewritten");
        assert!(r
            .nodes
            .iter()
            .any(|n| matches!(n.op, Op::Prim(Prim::ScatterAdd { .. }))));
        assert_eq!(r.nodes[r.outputs[1]].device, Device::Cpu);
    }
}
