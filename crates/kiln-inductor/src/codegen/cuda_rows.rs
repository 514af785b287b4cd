//! Row kernels: reductions over the trailing dims of one shape, and the values of that shape that
//! read them, computed by one warp per row in a single launch. Layer norm is a mean, a variance
//! reading the mean, and a normalization reading both; softmax a max, a sum of exponentials
//! reading it, and a division. As separate kernels each pass reads the row from memory; here a
//! warp owns a row and walks it once per member: the first pass reads it from memory, the later
//! ones from cache, and each reduction's result is held in a register (every lane gets it from
//! a butterfly of shuffles) where the later members read it. Member `k` writes `out<k>`: a
//! reduction one value per row (lane 0), a full-shape value at every element of the row.
//!
//! A row of up to `rows::MAX_COLS` elements: 32 lanes take its elements a warp apart. Members
//! read one another only through those registers, at their own row: a group where a member
//! would read another from memory is not made. The run of kernels is `rows.rs`'s.

use std::fmt::Write;

use kiln_compile::graph::{Graph, NodeId, Op};
use kiln_core::prim::Prim;

use super::c::{ty, Builder};
use super::cuda::{finish, parameters, Cuda, CudaKernel};
use crate::ir::index::Ix;
use crate::ir::lower::{linear, reduce_c, Kind};
use crate::rows::{joins_rows, row_domain};
use crate::schedule::Schedule;

/// The row kernel of `roots` (the first a reduction opening the domain, every later one
/// joining it, in an order where each reads only earlier ones), or `None` when they do not
/// make one.
pub(super) fn row_kernel(
    t: &Cuda,
    g: &Graph,
    sched: &Schedule,
    roots: &[NodeId],
) -> Option<CudaKernel> {
    let domain = row_domain(g, *roots.first()?)?;
    if !roots[1..].iter().all(|&r| joins_rows(g, sched, r, &domain)) {
        return None;
    }
    let (shape, d) = domain;
    let rank = shape.len();
    let rows: usize = shape[..rank - d].iter().product();
    let cols: usize = shape[rank - d..].iter().product();
    let kept: Vec<(usize, usize)> = (0..rank - d).map(|v| (v, shape[v])).collect();
    let reduced: Vec<(usize, usize)> = (rank - d..rank).map(|v| (v, shape[v])).collect();
    let mut b = Builder::new(g, sched, shape.iter().map(|&s| s as i64).collect());
    let idx: Vec<Ix> = (0..rank).map(Ix::var).collect();
    let mut members = String::new();
    for (k, &root) in roots.iter().enumerate() {
        let node = &g.nodes[root];
        let out = format!("out{k}");
        if k > 0 {
            members.push_str("    __syncwarp();\n");
        }
        match &node.op {
            Op::Prim(Prim::Reduce { op, .. }) if sched.kinds[root] == Kind::Reduction => {
                let src = node.args[0];
                let v = b.value(src, &idx, false);
                let body = b.new_body();
                let (acc_t, init, step) = reduce_c(*op, g.nodes[src].dtype);
                let acc = format!("acc{k}");
                let out_t = ty(node.dtype);
                let _ = writeln!(members, "    {acc_t} {acc} = {init};");
                let _ = writeln!(members, "    for (int c = lane; c < {cols}; c += 32) {{");
                super::c::split_index(&mut members, "c", &reduced, "      ", "rem");
                let _ = writeln!(members, "{body}      {acc} = {};\n    }}", step(&acc, &v));
                // a butterfly: every lane ends with the whole row's value
                let _ = writeln!(
                    members,
                    "    for (int s = 16; s > 0; s >>= 1) {{ {acc_t} other = \
                     __shfl_xor_sync(0xffffffffu, {acc}, s); {acc} = {}; }}",
                    step(&acc, "other")
                );
                let reg = format!("r{k}");
                let out_idx: Vec<Ix> = (0..rank)
                    .map(|v| match v < rank - d {
                        true => Ix::var(v),
                        false => Ix::constant(0),
                    })
                    .collect();
                let off = linear(&out_idx, &node.shape).to_c("i");
                let _ = writeln!(
                    members,
                    "    const {out_t} {reg} = ({out_t}){acc};\n    if (lane == 0) {out}[{off}] = {reg};"
                );
                b.registers.insert((root, out_idx), reg);
            }
            _ => {
                let v = b.value(root, &idx, true);
                let body = b.new_body();
                let off = linear(&idx, &shape).to_c("i");
                let _ = writeln!(members, "    for (int c = lane; c < {cols}; c += 32) {{");
                super::c::split_index(&mut members, "c", &reduced, "      ", "rem");
                let _ = writeln!(members, "{body}      {out}[{off}] = {v};\n    }}");
            }
        }
    }
    // a member reading another one from memory (another row's reduction, a value at another
    // element) could read what another warp has not written yet
    if roots.iter().any(|r| b.params.contains(r)) {
        return None;
    }
    let warps = t.cfg.warp_rows;
    let mut text = b.pre.clone();
    let _ = writeln!(
        text,
        "  const int lane = threadIdx.x % 32;\n  for (long long row = kbid * {warps} + threadIdx.x / \
         32; row < {rows}; row += knblk * {warps}) {{"
    );
    super::c::split_index(&mut text, "row", &kept, "    ", "rem_row");
    text.push_str(&members);
    text.push_str("  }\n");
    let outputs: Vec<(NodeId, String)> = roots
        .iter()
        .enumerate()
        .map(|(k, &r)| (r, format!("out{k}")))
        .collect();
    let text = t.narrow_index(
        g,
        b.params.iter().copied().chain(roots.iter().copied()),
        rows * cols,
        text,
    );
    let params = parameters(&b, g, &outputs);
    let grid = t.blocks(rows, warps as usize);
    Some(finish(b.params, params, text, grid, warps * 32))
}

#[cfg(test)]
mod tests {
    use kiln_core::{DType, Result, Tensor};

    use crate::backend::{plan_graph, Planned};
    use crate::codegen::cuda::{Cuda, CudaKernel};
    use crate::test_graphs::traced;

    /// The CUDA plan's kernels of the graph `f` traces to on `args`, with the number of values
    /// each writes.
    fn plan(
        f: impl Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'static,
        args: &[Tensor],
    ) -> Result<Vec<(CudaKernel, usize)>> {
        let g = traced(f, args)?;
        let g = crate::sink_expands::sink_expands(&g).unwrap_or(g);
        Ok(plan_graph(&Cuda::new(132), &g)
            .into_iter()
            .filter_map(|p| match p {
                Planned::Kernel { kernel, outs } => Some((kernel, outs.len())),
                Planned::Extern { .. } => None,
            })
            .collect())
    }

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
        let ln = plan(
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
        let sm = plan(|a: &[Tensor]| Ok(vec![a[0].softmax(-1)?]), &[s])?;
        assert_eq!(sm.len(), 1, "one kernel");
        Ok(())
    }
}
