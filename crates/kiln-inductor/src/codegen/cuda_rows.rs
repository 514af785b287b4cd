//! Row kernels on a GPU (`rows.rs` plans them): layer norm is a mean, a variance reading the
//! mean, and a normalization reading both; softmax a max, a sum of exponentials reading it, and
//! a division. As separate kernels each pass reads the row from memory; here one group of
//! threads owns a row and walks it once per member: the first pass reads it from memory, the
//! later ones from registers where each thread holds few of its elements (else from cache),
//! and each reduction's result is held in a register (every thread of the group gets it) where
//! the later members read it. Member `k` writes `out<k>`: a reduction
//! one value per row (by the group's first thread), a full-shape value at every element.
//!
//! The group is a warp (a butterfly of shuffles gives every lane the row's value) when there
//! are rows enough to fill the device, else a block: with nine rows (BERT on one 9-token
//! sentence) nine warps on two multiprocessors each walked 768 elements serially, latency-bound
//! at 17 µs a layer norm where a block per row takes a few elements a thread. A block combines
//! its warps' values through shared memory, every thread in the same order.

use std::fmt::Write;

use kiln_compile::graph::{Graph, NodeId, Op};
use kiln_core::prim::Prim;

use super::builder::{ty, Builder};
use super::c::split_index;
use super::cuda::{finish, parameters, Cuda, CudaKernel};
use crate::rows::{outputs, passes, Computes, RowLoops, RowReach};
use crate::schedule::Schedule;

/// A thread's walk over its row issues the loads of this many elements before it adds the
/// first: rolled, each iteration waited a round trip to memory for one element, since the
/// accumulation chains the iterations and the trip count depends on the thread.
pub(super) const UNROLL: &str = "#pragma unroll 8";

/// Most elements of a row a thread keeps in registers (`ROW_CACHE`): layer norm over 768
/// features on a warp keeps 24, softmax over 128 positions 4.
const MAX_CACHED: usize = 32;
/// The array a thread keeps its elements of the row's first operand in.
const ROW_CACHE: &str = "row_x";

/// Rows per multiprocessor below which a row gets a block: fewer warps than this per
/// multiprocessor leave each warp's walk unhidden.
const BLOCK_ROWS_PER_SM: usize = 4;
/// Shortest row a block is given (a warp takes shorter ones at one or two elements a lane).
const BLOCK_FROM_COLS: usize = 64;

/// Who walks a row: a warp, or a block of `threads` threads (a multiple of 32).
#[derive(Clone, Copy)]
enum Group {
    Warp,
    Block { threads: u32 },
}

impl Group {
    fn of(t: &Cuda, rows: usize, cols: usize) -> Group {
        if cols < BLOCK_FROM_COLS || rows >= BLOCK_ROWS_PER_SM * t.sm_count as usize {
            return Group::Warp;
        }
        // two elements a thread or more, at most 256 threads
        let threads = (cols.div_ceil(2).div_ceil(32) * 32).clamp(64, 256) as u32;
        Group::Block { threads }
    }

    /// The first element a thread takes and the step between its elements.
    fn walk(self) -> (&'static str, u32) {
        match self {
            Group::Warp => ("lane", 32),
            Group::Block { threads } => ("threadIdx.x", threads),
        }
    }
}

/// The rows this target walks: trailing and short, a warp's or a block's.
pub(crate) const REACH: RowReach = RowReach::Trailing;

/// The row kernel of `roots`, or `None` when they do not make one (`rows::passes`).
pub(super) fn row_kernel(
    t: &Cuda,
    g: &Graph,
    sched: &Schedule,
    roots: &[NodeId],
) -> Option<CudaKernel> {
    let loops = RowLoops::of(g, sched, roots, REACH)?;
    let (rows, cols) = (loops.rows(), loops.cols());
    let group = Group::of(t, rows, cols);
    let (first, stride) = group.walk();
    let mut b = Builder::new(g, sched, loops.shape.iter().map(|&s| s as i64).collect());
    let mut members = String::new();
    let mut shared = String::new();
    // Each thread keeps its elements of the first reduction's operand in registers when they
    // are few and the same count for every thread: layer norm's mean, variance and
    // normalization then load the row and recompute its fused producers (a residual add, a
    // bias) once instead of three times. The walk counts iterations so the array is indexed by
    // constants once unrolled.
    let per_thread = cols / stride as usize;
    let cached = match &g.nodes[roots[0]].op {
        Op::Prim(Prim::Reduce { .. }) => {
            cols % stride as usize == 0 && (1..=MAX_CACHED).contains(&per_thread)
        }
        _ => false,
    };
    let walk = match cached {
        true => format!(
            "    #pragma unroll\n    for (int it = 0; it < {per_thread}; it++) {{\n      const int c \
             = {first} + it * {stride};"
        ),
        false => format!("    {UNROLL}\n    for (int c = {first}; c < {cols}; c += {stride}) {{"),
    };
    if cached {
        let src = g.nodes[roots[0]].args[0];
        let _ = writeln!(
            members,
            "    {} {ROW_CACHE}[{per_thread}];",
            ty(g.nodes[src].dtype)
        );
    }
    let cache = format!("{ROW_CACHE}[it]");
    let cache = cached.then_some(cache.as_str());
    passes(&mut b, g, sched, roots, &loops, cache, |p| {
        if p.k > 0 && matches!(group, Group::Warp) {
            members.push_str("    __syncwarp();\n");
        }
        let (k, out) = (p.k, format!("out{}", p.k));
        let a = match &p.computes {
            Computes::Value(value) => {
                let _ = writeln!(members, "{walk}");
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
        let _ = writeln!(members, "    {acc_t} {acc} = {init};\n{walk}");
        split_index(&mut members, "c", &loops.reduced, "      ", "rem");
        // the first pass keeps the operand for the later ones
        let keep = match (k, cached) {
            (0, true) => format!("      {ROW_CACHE}[it] = {};\n", a.value),
            _ => String::new(),
        };
        let _ = writeln!(
            members,
            "{}{keep}      {acc} = {};\n    }}",
            p.body,
            step(&acc, &a.value)
        );
        // a butterfly: every lane ends with its warp's value
        let _ = writeln!(
            members,
            "    for (int s = 16; s > 0; s >>= 1) {{ {acc_t} other = \
             __shfl_xor_sync(0xffffffffu, {acc}, s); {acc} = {}; }}",
            step(&acc, "other")
        );
        if let Group::Block { threads } = group {
            let warps = threads / 32;
            // the warps' values through shared memory, combined in warp order by every thread
            let part = format!("part{k}");
            let _ = writeln!(shared, "  __shared__ {acc_t} {part}[{warps}];");
            let _ = writeln!(
                members,
                "    if (lane == 0) {part}[threadIdx.x / 32] = {acc};\n    __syncthreads();\n    \
                 {acc} = {part}[0];\n    for (int w = 1; w < {warps}; w++) {acc} = {};",
                step(&acc, &format!("{part}[w]"))
            );
        }
        let out_t = ty(p.dtype);
        let leader = match group {
            Group::Warp => "lane == 0",
            Group::Block { .. } => "threadIdx.x == 0",
        };
        let _ = writeln!(
            members,
            "    const {out_t} r{k} = ({out_t}){acc};\n    if ({leader}) {out}[{}] = r{k};",
            p.off
        );
    })?;
    let mut text = b.pre.clone();
    text.push_str(&shared);
    text.push_str("  const int lane = threadIdx.x % 32;\n");
    let (grid, block) = match group {
        Group::Warp => {
            let warps = t.cfg.warp_rows;
            let _ = writeln!(
                text,
                "  for (long long row = kbid * {warps} + threadIdx.x / 32; row < {rows}; \
                 row += knblk * {warps}) {{"
            );
            (t.blocks(rows, warps as usize), warps * 32)
        }
        Group::Block { threads } => {
            let _ = writeln!(
                text,
                "  for (long long row = kbid; row < {rows}; row += knblk) {{"
            );
            (t.blocks(rows, 1), threads)
        }
    };
    split_index(&mut text, "row", &loops.kept, "    ", "rem_row");
    text.push_str(&members);
    if matches!(group, Group::Block { .. }) {
        // the next row's partial values overwrite this row's only after every thread read them
        text.push_str("    __syncthreads();\n");
    }
    text.push_str("  }\n");
    let text = t.narrow_index(
        g,
        b.params.iter().copied().chain(roots.iter().copied()),
        rows * cols,
        text,
    );
    let params = parameters(&b, g, &outputs(roots));
    Some(finish(b.params, params, text, grid, block))
}

#[cfg(test)]
mod tests {
    use kiln_core::{DType, Result, Tensor};

    use crate::codegen::cuda::Cuda;
    use crate::test_graphs::planned_kernels;

    /// Layer norm over 768 features and softmax over 128 positions: each one row kernel (a
    /// warp per row, shuffles to every lane, the later passes reading the earlier reductions
    /// and the row itself from registers), where there were three kernels each.
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
        assert!(
            k.source.contains("__syncthreads") && k.block == 256,
            "256 rows on 132 multiprocessors: a block per row"
        );
        // three features a thread, kept in registers for the variance and the normalization
        assert!(k.source.contains("row_x[3]") && k.source.matches("row_x[it]").count() == 3);
        let s = Tensor::randn(&[32, 12, 128, 128], DType::F32)?;
        let sm = planned_kernels(
            &Cuda::new(132),
            |a: &[Tensor]| Ok(vec![a[0].softmax(-1)?]),
            &[s],
        )?;
        assert_eq!(sm.len(), 1, "one kernel");
        assert!(
            !sm[0].0.source.contains("__syncthreads"),
            "49152 rows: a warp per row"
        );
        assert!(sm[0].0.source.contains("row_x[4]"), "four positions a lane");
        Ok(())
    }
}
