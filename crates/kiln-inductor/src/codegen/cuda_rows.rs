//! Row kernels on a GPU (`rows.rs` plans them): one warp per row in a single launch. Layer norm
//! is a mean, a variance reading the mean, and a normalization reading both; softmax a max, a
//! sum of exponentials reading it, and a division. As separate kernels each pass reads the row
//! from memory; here a warp owns a row and walks it once per member: the first pass reads it
//! from memory, the later ones from cache, and each reduction's result is held in a register
//! (every lane gets it from a butterfly of shuffles) where the later members read it. Member `k`
//! writes `out<k>`: a reduction one value per row (lane 0), a full-shape value at every element.
//!
//! A row of up to `rows::MAX_COLS` elements: 32 lanes take its elements a warp apart.

use std::fmt::Write;

use kiln_compile::graph::{Graph, NodeId};

use super::c::{split_index, ty, Builder};
use super::cuda::{finish, parameters, Cuda, CudaKernel};
use crate::rows::{outputs, passes, Computes, RowLoops};
use crate::schedule::Schedule;

/// The row kernel of `roots`, or `None` when they do not make one (`rows::passes`).
pub(super) fn row_kernel(
    t: &Cuda,
    g: &Graph,
    sched: &Schedule,
    roots: &[NodeId],
) -> Option<CudaKernel> {
    let loops = RowLoops::of(g, sched, roots)?;
    let (rows, cols) = (loops.rows(), loops.cols());
    let mut b = Builder::new(g, sched, loops.shape.iter().map(|&s| s as i64).collect());
    let mut members = String::new();
    passes(&mut b, g, sched, roots, &loops, |p| {
        if p.k > 0 {
            members.push_str("    __syncwarp();\n");
        }
        let (k, out) = (p.k, format!("out{}", p.k));
        let a = match &p.computes {
            Computes::Value(value) => {
                let _ = writeln!(members, "    for (int c = lane; c < {cols}; c += 32) {{");
                split_index(&mut members, "c", &loops.reduced, "      ", "rem");
                let _ = writeln!(
                    members,
                    "{}      {out}[{}] = {value};\n    }}",
                    p.body, p.off
                );
                return;
            }
            Computes::Reduction(a) => a,
        };
        let (acc_t, init, step) = (a.acc_t, &a.init, a.step);
        let acc = format!("acc{k}");
        let _ = writeln!(members, "    {acc_t} {acc} = {init};");
        let _ = writeln!(members, "    for (int c = lane; c < {cols}; c += 32) {{");
        split_index(&mut members, "c", &loops.reduced, "      ", "rem");
        let _ = writeln!(
            members,
            "{}      {acc} = {};\n    }}",
            p.body,
            step(&acc, &a.value)
        );
        // a butterfly: every lane ends with the whole row's value
        let _ = writeln!(
            members,
            "    for (int s = 16; s > 0; s >>= 1) {{ {acc_t} other = \
             __shfl_xor_sync(0xffffffffu, {acc}, s); {acc} = {}; }}",
            step(&acc, "other")
        );
        let out_t = ty(p.dtype);
        let _ = writeln!(
            members,
            "    const {out_t} r{k} = ({out_t}){acc};\n    if (lane == 0) {out}[{}] = r{k};",
            p.off
        );
    })?;
    let warps = t.cfg.warp_rows;
    let mut text = b.pre.clone();
    let _ = writeln!(
        text,
        "  const int lane = threadIdx.x % 32;\n  for (long long row = kbid * {warps} + threadIdx.x / \
         32; row < {rows}; row += knblk * {warps}) {{"
    );
    split_index(&mut text, "row", &loops.kept, "    ", "rem_row");
    text.push_str(&members);
    text.push_str("  }\n");
    let text = t.narrow_index(
        g,
        b.params.iter().copied().chain(roots.iter().copied()),
        rows * cols,
        text,
    );
    let params = parameters(&b, g, &outputs(roots));
    let grid = t.blocks(rows, warps as usize);
    Some(finish(b.params, params, text, grid, warps * 32))
}

#[cfg(test)]
mod tests {
    use kiln_core::{DType, Result, Tensor};

    use crate::codegen::cuda::Cuda;
    use crate::test_graphs::planned_kernels;

    /// Layer norm over 768 features and softmax over 128 positions: each one row kernel (a
    /// warp per row, shuffles to every lane, the later passes reading the earlier reductions
    /// from registers), where there were three kernels each.
    #[test]
    fn layer_norm_and_softmax_are_one_row_kernel_each() -> Result<()> {
        let x = Tensor::randn(&[256, 768], DType::F32)?;
        let (w, b) = (
            Tensor::randn(&[768], DType::F32)?,
            Tensor::randn(&[768], DType::F32)?,
        );
        let ln = planned_kernels(
            &Cuda::new(132),
            |a: &[Tensor]| {
                Ok(vec![a[0].layer_norm(
                    &[768],
                    Some(&a[1]),
                    Some(&a[2]),
                    1e-12,
                )?])
            },
            &[x, w, b],
        )?;
        assert_eq!(ln.len(), 1, "one kernel");
        let (k, outs) = &ln[0];
        assert_eq!(*outs, 3, "mean, variance, normalized value");
        assert!(k.source.contains("__shfl_xor_sync"));
        let s = Tensor::randn(&[32, 12, 128, 128], DType::F32)?;
        let sm = planned_kernels(
            &Cuda::new(132),
            |a: &[Tensor]| Ok(vec![a[0].softmax(-1)?]),
            &[s],
        )?;
        assert_eq!(sm.len(), 1, "one kernel");
        Ok(())
    }
}
