//! The C target's sibling reductions (`sibling_reductions.rs` groups them): float sums over the
//! same operand shape and dims, computed in one walk over their operands with a lane array each.
//! Every sum keeps `prim::SUM_LANES`'s order — the order of its own kernel and of the eager
//! kernel — so results stay bit for bit what the separate kernels gave. Batch norm's backward is
//! the case: its two or three per-channel sums read the same gradient and activation, and as
//! separate loops each walked both.

use kiln_compile::graph::{Graph, NodeId, Op};
use kiln_core::prim::{Prim, SUM_CHUNKED_FROM};

use super::builder::{ty, Builder};
use super::c::{
    finish_outputs, parallel_rows, reduce_accumulator, reduce_loops, Accumulator, Kernel, Nest,
};
use super::c_sums::lane_sums;
use crate::rows::outputs;
use crate::schedule::Schedule;

/// The kernel computing the sibling reductions `roots` (one operand shape, reduced dims and
/// output shape), or `None` unless every one is a lane-ordered float sum over rows that a single
/// kernel sums without chunking (a single long row is chunked across threads: kept apart).
pub(crate) fn sibling_kernel(g: &Graph, sched: &Schedule, roots: &[NodeId]) -> Option<Kernel> {
    let first = &g.nodes[*roots.first()?];
    let Op::Prim(Prim::Reduce { dims, .. }) = &first.op else {
        return None;
    };
    let in_shape = &g.nodes[first.args[0]].shape;
    let mut b = Builder::new(g, sched, in_shape.iter().map(|&s| s as i64).collect());
    let accs: Vec<_> = roots
        .iter()
        .map(|&r| reduce_accumulator(&mut b, g, r))
        .collect();
    if !accs.iter().all(|a| a.lanes) {
        return None;
    }
    let (kept, reduced, off) = reduce_loops(in_shape, dims, &first.shape);
    let rows: usize = kept.iter().map(|k| k.1).product();
    let red: usize = reduced.iter().map(|k| k.1).product();
    let (&(d, n), outer) = reduced.split_last()?;
    if rows == 1 && red >= SUM_CHUNKED_FROM {
        return None;
    }
    let names: Vec<String> = (0..roots.len()).map(|k| format!("acc{k}")).collect();
    let sums: Vec<(&str, &Accumulator)> = names.iter().map(String::as_str).zip(&accs).collect();
    let mut text = String::new();
    lane_sums(&mut text, (outer, (d, n)), &b.body, &sums, |k, sum| {
        format!(
            "  out{k}[{off}] = ({}){sum};\n",
            ty(g.nodes[roots[k]].dtype)
        )
    });
    let numel = rows * red;
    let nest = Nest {
        outer: kept,
        block: 1,
        inner: text,
        elements: numel,
        shareable: true,
    };
    let parallel = parallel_rows(numel, rows);
    Some(finish_outputs(b, &outputs(roots), nest, parallel))
}

#[cfg(test)]
mod tests {
    use kiln_core::prim::SUM_CHUNKED_FROM;
    use kiln_core::{DType, Result, Tensor};

    use crate::test_graphs::{planned_kernels, C_TARGET as TARGET};

    /// Per-channel sums of two products of the same activation and gradient (batch norm's
    /// backward): one kernel, one walk, a lane array per sum; a single long row is summed in
    /// chunks across threads, so its sums stay kernels of their own. (compile_ops checks that the
    /// results equal eager's bit for bit.)
    #[test]
    fn sums_over_the_same_loops_share_one_walk() -> Result<()> {
        let x = Tensor::randn(&[4, 8, 16, 16], DType::F32)?;
        let g = Tensor::randn(&[4, 8, 16, 16], DType::F32)?;
        let sums = |a: &[Tensor]| {
            Ok(vec![
                a[1].sum(&[0, 2, 3], false)?,
                a[0].mul(&a[1])?.sum(&[0, 2, 3], false)?,
            ])
        };
        let ks = planned_kernels(&TARGET, sums, &[x, g])?;
        assert_eq!(ks.len(), 1, "one kernel");
        assert_eq!(ks[0].1, 2, "both sums");
        let src = &ks[0].0.source;
        assert!(
            src.contains("acc0[16]") && src.contains("acc1[16]"),
            "{src}"
        );
        assert_eq!(
            src.matches("#pragma omp simd").count(),
            1,
            "one walk\n{src}"
        );
        let n = SUM_CHUNKED_FROM;
        let (x, g) = (
            Tensor::randn(&[n], DType::F32)?,
            Tensor::randn(&[n], DType::F32)?,
        );
        let long = planned_kernels(
            &TARGET,
            |a: &[Tensor]| {
                Ok(vec![
                    a[1].sum(&[0], false)?,
                    a[0].mul(&a[1])?.sum(&[0], false)?,
                ])
            },
            &[x, g],
        )?;
        assert_eq!(long.iter().map(|k| k.1).sum::<usize>(), 2);
        assert!(
            long.iter().all(|k| !k.0.source.contains("acc1[16]")),
            "a chunked row summed with a sibling"
        );
        Ok(())
    }
}
