//! A reduction's CUDA kernel: each output element gets a thread, a warp or a block by the length
//! of what it reduces (a thread when short, or when it is an outer reduction with rows enough to
//! fill the device: its threads then read consecutive kept elements). Accumulation in the
//! accumulator type of `reduce_c` (f64 for float sums), warp shuffles, a shared-memory pass for
//! the warps of a block.

use std::fmt::Write;

use kiln_compile::graph::{Graph, NodeId};

use super::c::{reduction_parts, split_index, ty, ReductionParts};
use super::cuda::{finish, parameters, Cuda, CudaKernel};
use crate::schedule::Schedule;
use crate::split_reduction::is_outer;

/// Reduced lengths from which a warp (then a block) reduces each output element.
const WARP_FROM: usize = 32;
const BLOCK_FROM: usize = 4096;
/// An outer reduction (`split_reduction::is_outer`) has a thread per output element when it has
/// this many rows per multiprocessor.
const OUTER_ROWS_PER_SM: usize = 128;

pub(super) fn reduction(t: &Cuda, g: &Graph, sched: &Schedule, root: NodeId) -> CudaKernel {
    let ReductionParts {
        b,
        value: v,
        acc_t,
        init,
        step,
        out_offset: off,
        kept,
        reduced,
        ..
    } = reduction_parts(g, sched, root);
    let node = &g.nodes[root];
    let rows: usize = kept.iter().map(|k| k.1).product();
    let red: usize = reduced.iter().map(|k| k.1).product();
    let out_t = ty(node.dtype);
    let store = format!("out[{off}] = ({out_t})acc;");
    let accumulate = format!("{}      acc = {};\n", b.body, step("acc", &v));
    let combine = step("acc", "other");
    let mut text = b.pre.clone();
    // an outer reduction (its reduced dims lie outside a run of kept ones: channels-last
    // batch norm's per-channel sums): consecutive threads own consecutive kept elements, so
    // a warp's load is one contiguous run, where lanes over the reduced elements would read
    // a run's length apart. Given enough rows to fill the device (`split_reduction.rs` cuts
    // the reduced extent into chunks to make them).
    let outer = is_outer(&kept, &reduced) && rows >= t.sm_count as usize * OUTER_ROWS_PER_SM;
    let (grid, block) = if red < WARP_FROM || outer {
        // a thread per output element, its reduced elements in a loop nest
        let _ = writeln!(
            text,
            "  for (long long row = kbid * blockDim.x + threadIdx.x; row < {rows}; \
             row += knblk * blockDim.x) {{"
        );
        split_index(&mut text, "row", &kept, "    ", "rem");
        let _ = writeln!(text, "    {acc_t} acc = {init};");
        for &(v, n) in &reduced {
            let _ = writeln!(text, "    for (long long i{v} = 0; i{v} < {n}; i{v}++)");
        }
        let _ = writeln!(text, "    {{\n{accumulate}    }}\n    {store}\n  }}");
        (t.blocks(rows, t.cfg.block as usize), t.cfg.block)
    } else {
        // a warp (or a block) per output element: strided partial sums, then shuffles
        let per_block = red < BLOCK_FROM;
        let row_block = t.cfg.row_block;
        let (lanes, rows_per_block, block) = if per_block {
            (32, t.cfg.warp_rows as usize, t.cfg.warp_rows * 32)
        } else {
            (row_block as usize, 1, row_block)
        };
        let (first_row, lane) = if per_block {
            (
                format!("kbid * {rows_per_block} + threadIdx.x / 32"),
                "threadIdx.x % 32",
            )
        } else {
            ("kbid".to_string(), "threadIdx.x")
        };
        if !per_block {
            let _ = writeln!(text, "  __shared__ {acc_t} partial[{}];", row_block / 32);
        }
        let _ = writeln!(
            text,
            "  for (long long row = {first_row}; row < {rows}; \
             row += knblk * {rows_per_block}) {{"
        );
        split_index(&mut text, "row", &kept, "    ", "rem_row");
        let _ = writeln!(text, "    {acc_t} acc = {init};");
        let _ = writeln!(
            text,
            "    for (long long r = {lane}; r < {red}; r += {lanes}) {{"
        );
        split_index(&mut text, "r", &reduced, "      ", "rem");
        let _ = writeln!(text, "{accumulate}    }}");
        let _ = writeln!(
            text,
            "    for (int s = 16; s > 0; s >>= 1) {{ {acc_t} other = \
             __shfl_down_sync(0xffffffffu, acc, s); acc = {combine}; }}"
        );
        if per_block {
            let _ = writeln!(text, "    if ({lane} == 0) {store}");
        } else {
            let _ = writeln!(
                text,
                "    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = acc;\n    \
                 __syncthreads();\n    if (threadIdx.x < 32) {{\n      acc = threadIdx.x < \
                 {w} ? partial[threadIdx.x] : ({acc_t})({init});\n      for (int s = 16; s > \
                 0; s >>= 1) {{ {acc_t} other = __shfl_down_sync(0xffffffffu, acc, s); acc = \
                 {combine}; }}\n      if (threadIdx.x == 0) {store}\n    }}\n    \
                 __syncthreads();",
                w = row_block / 32
            );
        }
        let _ = writeln!(text, "  }}");
        (t.blocks(rows, rows_per_block), block)
    };
    let outputs = [(root, "out".to_string())];
    let text = t.narrow_index(g, b.params.iter().copied().chain([root]), rows * red, text);
    let params = parameters(&b, g, &outputs);
    finish(b.params, params, text, grid, block)
}
