//! The C target's row kernels (`rows.rs` plans them): one loop nest over the rows (OpenMP on the
//! outer ones), and inside it each member's loop over the row in turn. A reduction sums the row
//! in `prim::SUM_LANES`'s order, as its own kernel and the eager kernel do, so the results stay
//! bit for bit the same; its value is held in a local that the later members read. Layer norm
//! walks each row three times while it is in cache, where three kernels walked the whole tensor
//! three times.

use std::fmt::Write;

use kiln_compile::graph::{Graph, NodeId};

use super::builder::{ty, Builder};
use super::c::{finish_outputs, loops, parallel_rows, Kernel, Nest};
use super::c_horizontal::Threads;
use super::c_sums::lane_sums;
use crate::rows::{outputs, passes, Computes, RowLoops, RowReach};
use crate::schedule::Schedule;

/// The rows this target walks: a row is a loop nest, so any reduced dims that end with the
/// innermost.
pub(crate) const REACH: RowReach = RowReach::Any;

/// The row kernel of `roots`, or `None` when they do not make one (`rows::passes`).
pub(crate) fn row_kernel(g: &Graph, sched: &Schedule, roots: &[NodeId]) -> Option<Kernel> {
    let row_loops = RowLoops::of(g, sched, roots, REACH)?;
    let reduced = &row_loops.reduced;
    let mut b = Builder::new(
        g,
        sched,
        row_loops.shape.iter().map(|&s| s as i64).collect(),
    );
    let mut text = String::new();
    passes(&mut b, g, sched, roots, &row_loops, None, |p| {
        let (k, out) = (p.k, format!("out{}", p.k));
        let acc = match &p.computes {
            Computes::Value(value) => {
                loops(&mut text, reduced, Threads::One);
                let _ = writeln!(
                    text,
                    "  {{\n{}    {out}[{}] = {value};\n  }}",
                    p.body, p.off
                );
                return;
            }
            Computes::Reduction(acc) => acc,
        };
        let (acc_t, init, step) = (acc.acc_t, &acc.init, acc.step);
        let out_t = ty(p.dtype);
        let _ = writeln!(text, "  {out_t} r{k};");
        // the order of `codegen/c.rs`'s reduction kernel, which eager's sum shares
        match (acc.lanes, reduced.split_last()) {
            (true, Some((&(last, n), outer))) => {
                lane_sums(
                    &mut text,
                    (outer, (last, n)),
                    &p.body,
                    &[("acc", acc)],
                    |_, sum| format!("  r{k} = ({out_t}){sum};\n"),
                );
            }
            _ => {
                let _ = writeln!(text, "  {{\n  {acc_t} acc = {init};");
                loops(&mut text, reduced, Threads::One);
                let _ = writeln!(
                    text,
                    "  {{\n{}    acc = {};\n  }}\n  r{k} = ({out_t})acc;\n  }}",
                    p.body,
                    step("acc", &acc.value)
                );
            }
        }
        let _ = writeln!(text, "  {out}[{}] = r{k};", p.off);
    })?;
    let rows = row_loops.rows();
    let elements = rows * row_loops.cols();
    let nest = Nest {
        outer: row_loops.kept.clone(),
        block: 1,
        // one statement under the row loops
        inner: format!("  {{\n{text}  }}\n"),
        elements,
        shareable: true,
    };
    let parallel = parallel_rows(elements, rows);
    Some(finish_outputs(b, &outputs(roots), nest, parallel))
}

#[cfg(test)]
mod tests {
    use kiln_core::{DType, Result, Tensor};

    use crate::test_graphs::{planned_kernels, C_TARGET as TARGET};

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
        let ln = planned_kernels(
            &TARGET,
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
        let sm = planned_kernels(&TARGET, |a: &[Tensor]| Ok(vec![a[0].softmax(-1)?]), &[x])?;
        assert_eq!(sm.len(), 1, "one kernel");
        Ok(())
    }

    /// Batch norm in training over NCHW: each channel is a row (N, H and W reduced, the
    /// innermost among them), so the mean, the variance and the normalization are one loop nest
    /// over the channels, shared among threads, each channel's walks in the eager sum's order.
    /// With fewer channels than `MIN_LOOP_ROWS` they stay three kernels, each parallel on its own.
    #[test]
    fn batch_norm_statistics_and_normalization_are_one_loop_nest() -> Result<()> {
        let bn = |c: usize| -> Result<Vec<(crate::codegen::c::Kernel, usize)>> {
            let x = Tensor::randn(&[4, c, 5, 7], DType::F32)?;
            planned_kernels(
                &TARGET,
                |a: &[Tensor]| Ok(vec![a[0].batch_norm(None, None, None, true, 1e-5)?]),
                &[x],
            )
        };
        let k = bn(16)?;
        assert_eq!(k.len(), 1, "one kernel");
        assert_eq!(k[0].1, 3, "mean, variance, normalized value");
        let src = &k[0].0.source;
        assert!(
            src.contains("for (int64_t i1 = 0; i1 < 16; i1++)"),
            "a row per channel\n{src}"
        );
        assert_eq!(src.matches("acc[16]").count(), 2, "{src}");
        assert_eq!(bn(8)?.len(), 3);
        Ok(())
    }
}
