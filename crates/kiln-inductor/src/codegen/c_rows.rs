//! The C target's row kernels (`rows.rs` plans them): one loop nest over the rows (OpenMP on the
//! outer ones), and inside it each member's loop over the row in turn. A reduction sums the row
//! in `prim::SUM_LANES`'s order, as its own kernel and the eager kernel do, so the results stay
//! bit for bit the same; its value is held in a local that the later members read. Layer norm
//! walks each row three times while it is in cache, where three kernels walked the whole tensor
//! three times.

use std::fmt::Write;

use kiln_compile::graph::{Graph, NodeId, Op};
use kiln_core::prim::{Prim, ReduceOp};
use kiln_core::DType;

use super::c::{
    finish_outputs, fold_lanes, lane_loops, loops, ty, Builder, Kernel, Nest, PARALLEL_THRESHOLD,
};
use super::c_horizontal::Threads;
use crate::ir::index::Ix;
use crate::ir::lower::{linear, reduce_c, Kind};
use crate::rows::{joins_rows, row_domain};
use crate::schedule::Schedule;

/// The row kernel of `roots` (the first a reduction opening the domain, every later one joining
/// it), or `None` when they do not make one (a member reading another from memory).
pub(crate) fn row_kernel(g: &Graph, sched: &Schedule, roots: &[NodeId]) -> Option<Kernel> {
    let domain = row_domain(g, *roots.first()?)?;
    if !roots[1..].iter().all(|&r| joins_rows(g, sched, r, &domain)) {
        return None;
    }
    let (shape, d) = domain;
    let rank = shape.len();
    let kept: Vec<(usize, usize)> = (0..rank - d).map(|v| (v, shape[v])).collect();
    let reduced: Vec<(usize, usize)> = (rank - d..rank).map(|v| (v, shape[v])).collect();
    let mut b = Builder::new(g, sched, shape.iter().map(|&s| s as i64).collect());
    let idx: Vec<Ix> = (0..rank).map(Ix::var).collect();
    let mut text = String::new();
    for (k, &root) in roots.iter().enumerate() {
        let node = &g.nodes[root];
        let out = format!("out{k}");
        match &node.op {
            Op::Prim(Prim::Reduce { op, .. }) if sched.kinds[root] == Kind::Reduction => {
                let src = node.args[0];
                let v = b.value(src, &idx, false);
                let body = b.new_body();
                let (acc_t, init, step) = reduce_c(*op, g.nodes[src].dtype);
                let out_t = ty(node.dtype);
                let reg = format!("r{k}");
                let out_idx: Vec<Ix> = (0..rank)
                    .map(|v| match v < rank - d {
                        true => Ix::var(v),
                        false => Ix::constant(0),
                    })
                    .collect();
                let off = linear(&out_idx, &node.shape).to_c("i");
                let _ = writeln!(text, "  {out_t} {reg};");
                // the order of `codegen/c.rs`'s reduction kernel, which eager's sum shares
                let lanes =
                    *op == ReduceOp::Sum && matches!(g.nodes[src].dtype, DType::F32 | DType::F64);
                match (lanes, reduced.split_last()) {
                    (true, Some((&(last, n), outer))) => {
                        let l = kiln_core::prim::SUM_LANES;
                        let _ = writeln!(text, "  {{\n  {acc_t} acc[{l}];");
                        let _ =
                            writeln!(text, "  for (int64_t l = 0; l < {l}; l++) acc[l] = {init};");
                        loops(&mut text, outer, Threads::One);
                        let _ = writeln!(text, "  {{");
                        lane_loops(&mut text, (last, &body, &v), step, "0", &n.to_string());
                        let _ = writeln!(text, "  }}");
                        fold_lanes(&mut text, step);
                        let _ = writeln!(text, "  {reg} = ({out_t})acc[0];\n  }}");
                    }
                    _ => {
                        let _ = writeln!(text, "  {{\n  {acc_t} acc = {init};");
                        loops(&mut text, &reduced, Threads::One);
                        let _ = writeln!(
                            text,
                            "  {{\n{body}    acc = {};\n  }}\n  {reg} = ({out_t})acc;\n  }}",
                            step("acc", &v)
                        );
                    }
                }
                let _ = writeln!(text, "  {out}[{off}] = {reg};");
                b.registers.insert((root, out_idx), reg);
            }
            _ => {
                let v = b.value(root, &idx, true);
                let body = b.new_body();
                let off = linear(&idx, &shape).to_c("i");
                loops(&mut text, &reduced, Threads::One);
                let _ = writeln!(text, "  {{\n{body}    {out}[{off}] = {v};\n  }}");
            }
        }
    }
    // a member reading another one from memory could read what another row's iteration (on
    // another thread) has not written yet
    if roots.iter().any(|r| b.params.contains(r)) {
        return None;
    }
    let rows: usize = kept.iter().map(|k| k.1).product();
    let elements = rows * reduced.iter().map(|k| k.1).product::<usize>();
    let parallel = elements >= PARALLEL_THRESHOLD && rows >= 16;
    let outputs: Vec<(NodeId, String)> = roots
        .iter()
        .enumerate()
        .map(|(k, &r)| (r, format!("out{k}")))
        .collect();
    let nest = Nest {
        outer: kept,
        // one statement under the row loops
        inner: format!("  {{\n{text}  }}\n"),
        elements,
        shareable: true,
    };
    Some(finish_outputs(b, &outputs, nest, parallel))
}

#[cfg(test)]
mod tests {
    use kiln_core::{DType, Result, Tensor};

    use crate::backend::{plan_graph, Planned, C};
    use crate::codegen::c::Kernel;
    use crate::test_graphs::traced;

    fn plan(
        f: impl Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static,
        args: &[Tensor],
    ) -> Result<Vec<(Kernel, usize)>> {
        let g = traced(f, args)?;
        let g = crate::sink_expands::sink_expands(&g).unwrap_or(g);
        let c = C {
            inline_matmul: false,
            horizontal: true,
        };
        Ok(plan_graph(&c, &g)
            .into_iter()
            .filter_map(|p| match p {
                Planned::Kernel { kernel, outs } => Some((kernel, outs.len())),
                Planned::Extern { .. } => None,
            })
            .collect())
    }

    /// Layer norm on the CPU: one loop nest over the rows, the mean and the variance summed in
    /// the lane order (the eager kernel's, so results stay bitwise equal: compile_ops checks
    /// it) and held in locals, then the normalization; softmax likewise.
    #[test]
    fn layer_norm_and_softmax_are_one_loop_nest_each() -> Result<()> {
        let x = Tensor::randn(&[64, 96], DType::F32)?;
        let (w, b) = (
            Tensor::randn(&[96], DType::F32)?,
            Tensor::randn(&[96], DType::F32)?,
        );
        let ln = plan(
            |a: &[Tensor]| {
                Ok(vec![a[0].layer_norm(
                    &[96],
                    Some(&a[1]),
                    Some(&a[2]),
                    1e-5,
                )?])
            },
            &[x.clone(), w, b],
        )?;
        assert_eq!(ln.len(), 1, "one kernel");
        assert_eq!(ln[0].1, 3, "mean, variance, normalized value");
        let src = &ln[0].0.source;
        assert_eq!(
            src.matches("acc[16]").count(),
            2,
            "two lane-ordered sums\n{src}"
        );
        assert!(src.contains("r0 = ") && src.contains("r1 = "), "{src}");
        let sm = plan(|a: &[Tensor]| Ok(vec![a[0].softmax(-1)?]), &[x])?;
        assert_eq!(sm.len(), 1, "one kernel");
        Ok(())
    }
}
