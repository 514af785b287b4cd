//! The C target's row kernels (`rows.rs` plans them): one loop nest over the rows (OpenMP on the
//! outer ones), and inside it each member's loop over the row in turn. A reduction sums the row
//! in `prim::SUM_LANES`'s order, as its own kernel and the eager kernel do, so the results stay
//! bit for bit the same; its value is held in a local that the later members read. Reductions
//! that read none of each other share one walk (`lane_walk`): layer norm walks each row twice
//! while it is in cache — its mean and squared deviations, then the normalization — where
//! three kernels walked the whole tensor three times.

use std::fmt::Write;

use kiln_compile::graph::{Graph, NodeId};

use super::builder::{ty, Builder};
use super::c::{finish_outputs, loops, parallel_rows, Accumulator, Kernel, Nest};
use super::c_horizontal::Threads;
use super::c_sums::lane_sums;
use crate::rows::{outputs, passes, Computes, Pass, RowLoops, RowReach};
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
    // reductions in lanes that read none of each other, waiting to share one walk
    let mut walk: Vec<Pass> = Vec::new();
    passes(&mut b, g, sched, roots, &row_loops, None, |p| {
        let lanes = matches!(&p.computes, Computes::Reduction(acc) if acc.lanes);
        let value = match &p.computes {
            Computes::Reduction(acc) => &acc.value,
            Computes::Value(value) => value,
        };
        let reads_walk = walk.iter().any(|w| {
            let r = format!("r{}", w.k);
            mentions(&p.body, &r) || mentions(value, &r)
        });
        if !lanes || reads_walk {
            lane_walk(&mut text, reduced, &std::mem::take(&mut walk));
        }
        if lanes {
            walk.push(p.clone());
            return;
        }
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
        // a reduction with one accumulator walked in order (max, min)
        let (acc_t, init, step) = (acc.acc_t, &acc.init, acc.step);
        let out_t = ty(p.dtype);
        let _ = writeln!(text, "  {out_t} r{k};\n  {{\n  {acc_t} acc = {init};");
        loops(&mut text, reduced, Threads::One);
        let _ = writeln!(
            text,
            "  {{\n{}    acc = {};\n  }}\n  r{k} = ({out_t})acc;\n  }}\n  {out}[{}] = r{k};",
            p.body,
            step("acc", &acc.value),
            p.off
        );
    })?;
    lane_walk(&mut text, reduced, &walk);
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

/// The reductions `walk` (each in lanes, none reading another) in one walk over the row in the
/// order of `codegen/c.rs`'s reduction kernel, which the eager kernels share: each result held
/// in `r<k>` for the later members and stored to `out<k>`. A norm's mean and squared deviations
/// read the row once.
fn lane_walk(text: &mut String, reduced: &[(usize, usize)], walk: &[Pass]) {
    let Some(((last, n), outer)) = reduced.split_last().map(|(l, o)| (*l, o)) else {
        return;
    };
    let accs: Vec<(String, &Accumulator)> = walk
        .iter()
        .filter_map(|p| match &p.computes {
            Computes::Reduction(acc) => Some((format!("acc{}", p.k), acc)),
            Computes::Value(_) => None,
        })
        .collect();
    if accs.is_empty() {
        return;
    }
    for p in walk {
        let _ = writeln!(text, "  {} r{};", ty(p.dtype), p.k);
    }
    let body: String = walk.iter().map(|p| p.body.as_str()).collect();
    let sums: Vec<(&str, &Accumulator)> = accs.iter().map(|(n, a)| (n.as_str(), *a)).collect();
    lane_sums(text, (outer, (last, n)), &body, &sums, |i, sum| {
        let p = &walk[i];
        format!("  r{} = ({}){sum};\n", p.k, ty(p.dtype))
    });
    for p in walk {
        let _ = writeln!(text, "  out{k}[{}] = r{k};", p.off, k = p.k);
    }
}

/// Whether the C text `text` names the identifier `ident` (not as part of a longer name).
fn mentions(text: &str, ident: &str) -> bool {
    let word = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.match_indices(ident).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + ident.len()..].chars().next();
        !before.is_some_and(word) && !after.is_some_and(word)
    })
}

#[cfg(test)]
mod tests {
    use kiln_core::{DType, Result, Tensor};

    use crate::test_graphs::{planned_kernels, C_TARGET as TARGET};

    /// Layer norm on the CPU: one loop nest over the rows, the mean and the squared deviations
    /// (Welford's) in the lane order (the eager kernel's, so results stay bitwise equal:
    /// compile_ops checks it) in one walk, held in locals, then the normalization; softmax
    /// likewise (its sum reads its max: two walks).
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
        // the mean's sum and the squared deviations (Welford's lanes) in one walk over the row
        assert!(
            src.contains("kiln_fold_sum(acc0)")
                && src
                    .contains("kiln_fold_sqdev(&acc1_g, acc1_m, acc1, acc1_tn, acc1_tm, acc1_tq)"),
            "a lane-ordered sum and squared deviations\n{src}"
        );
        assert_eq!(
            src.matches("#pragma omp simd").count(),
            1,
            "one walk\n{src}"
        );
        assert!(src.contains("r0 = ") && src.contains("r1 = "), "{src}");
        let sm = planned_kernels(&TARGET, |a: &[Tensor]| Ok(vec![a[0].softmax(-1)?]), &[x])?;
        assert_eq!(sm.len(), 1, "one kernel");
        Ok(())
    }

    /// Batch norm in training over NCHW: each channel is a row (N, H and W reduced, the
    /// innermost among them), so the mean, the variance and the normalization are one loop nest
    /// over the channels, shared among threads, each channel's walks in the eager sum's order.
    /// With fewer channels than `MIN_LOOP_ROWS` the statistics are one sibling kernel.
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
        assert!(
            src.contains("kiln_fold_sqdev(&acc1_g, acc1_m, acc1, acc1_tn, acc1_tm, acc1_tq)"),
            "{src}"
        );
        // one lane walk (its tail loop) for both statistics
        assert_eq!(src.matches("c + l <").count(), 1, "one walk\n{src}");
        // too few channels for a row kernel: the mean and the squared deviations are sibling
        // reductions (one walk, `c_siblings.rs`), the normalization a kernel of its own
        assert_eq!(bn(8)?.len(), 2);
        Ok(())
    }
}
