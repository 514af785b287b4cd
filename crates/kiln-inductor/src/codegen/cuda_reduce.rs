//! A reduction's CUDA kernel: each output element gets a thread, a warp or a block by the length
//! of what it reduces (a thread when short, or when it is an outer reduction with rows enough to
//! fill the device: its threads then read consecutive kept elements). Accumulation in the
//! accumulator type of `reduce_c` (f64 for float sums), warp shuffles, a shared-memory pass for
//! the warps of a block.

use std::fmt::Write;

use kiln_compile::graph::{Graph, NodeId};

use super::builder::ty;
use super::c::{reduce_accumulator, reduction_parts, split_index, Accumulator, ReductionParts};
use super::cuda::{finish, parameters, Cuda, CudaKernel};
use super::cuda_rows::UNROLL;
use crate::schedule::Schedule;
use crate::split_reduction::is_outer;

/// Reduced lengths from which a warp (then a block) reduces each output element.
const WARP_FROM: usize = 32;
const BLOCK_FROM: usize = 4096;
/// An outer reduction (`split_reduction::is_outer`) has a thread per output element when it has
/// this many rows per multiprocessor.
const OUTER_ROWS_PER_SM: usize = 128;

/// Shared memory a column reduction's block may take for its warps' accumulators (static
/// shared memory stops at 48 KiB), counting each at 8 bytes (the widest: `double`, `int64_t`).
const COLUMN_SHARED_BYTES: usize = 32 << 10;

/// Most rows (kept elements) per block of a column reduction; a warp covers them at `32 / cols`
/// reduced positions (its loads are runs of `4 * cols` bytes). Few rows per block make many
/// blocks: `column_rows` takes fewer where the rows would not give every multiprocessor a block.
const COLUMN_ROWS: usize = 4;

/// Positions a thread of a column reduction walks from which its walk is unrolled (by
/// `cuda_rows::UNROLL`'s count). DenseNet-121's backward sums of 128 channels over 3136 positions
/// (12 a thread) went 17 → 11 µs under ncu unrolled; a second pass over few partials a thread
/// went 5.7 → 6.8 µs.
const COLUMN_UNROLL_FROM: usize = 8;

/// Rows per block of a column reduction of `rows` rows: the most (up to `COLUMN_ROWS`, a power
/// of two) that still give each of `sm_count` multiprocessors a block. DenseNet-121's backward
/// sums 128 channels over 3136 positions, their operands computed on the way: four rows a block
/// were 32 blocks on 132 multiprocessors (46 µs under ncu), one row a block 128 blocks. A warp
/// then reads its row's elements a row apart, from L2: at these sizes the launch's width is what
/// counts, not the sectors.
fn column_rows(rows: usize, sm_count: usize) -> usize {
    let mut cols = COLUMN_ROWS;
    while cols > 1 && rows.div_ceil(cols) < sm_count {
        cols /= 2;
    }
    cols
}

/// One accumulator of a reduction kernel, with its output's C type and the names of its
/// register and output.
struct Acc {
    a: Accumulator,
    out_t: &'static str,
    reg: String,
    out: String,
}

/// `if (cond)` over `lines` (each indented and ending in a newline): on one line when there is
/// one (the text a single reduction has always had), in braces otherwise.
fn guarded(indent: &str, cond: &str, lines: &str) -> String {
    match lines.lines().count() {
        1 => format!("{indent}if ({cond}) {}\n", lines.trim()),
        _ => format!("{indent}if ({cond}) {{\n{lines}{indent}}}\n"),
    }
}

/// The kernel computing the reductions `roots`: one, or siblings (`sibling_reductions.rs`: the
/// same operand shape, reduced dims and output shape) that share one walk over the operands, an
/// accumulator each.
pub(super) fn reduction(t: &Cuda, g: &Graph, sched: &Schedule, roots: &[NodeId]) -> CudaKernel {
    let ReductionParts {
        mut b,
        acc: first,
        out_offset: off,
        kept,
        reduced,
        ..
    } = reduction_parts(g, sched, roots[0]);
    let mut accs = vec![first];
    for &r in &roots[1..] {
        accs.push(reduce_accumulator(&mut b, g, r));
    }
    let accs: Vec<Acc> = accs
        .into_iter()
        .zip(roots)
        .enumerate()
        .map(|(k, (a, &root))| {
            // one root keeps the names a single reduction has always had (its kernel's hash)
            let (reg, out) = match roots.len() {
                1 => ("acc".to_string(), "out".to_string()),
                _ => (format!("acc{k}"), format!("out{k}")),
            };
            Acc {
                a,
                out_t: ty(g.nodes[root].dtype),
                reg,
                out,
            }
        })
        .collect();
    let rows: usize = kept.iter().map(|k| k.1).product();
    let red: usize = reduced.iter().map(|k| k.1).product();
    let each = |f: &dyn Fn(&Acc) -> String| accs.iter().map(f).collect::<String>();
    let declare =
        |indent: &str| each(&|a| format!("{indent}{} {} = {};\n", a.a.acc_t, a.reg, a.a.init));
    let store =
        |indent: &str| each(&|a| format!("{indent}{}[{off}] = ({}){};\n", a.out, a.out_t, a.reg));
    let accumulate = format!(
        "{}{}",
        b.body,
        each(&|a| format!("      {} = {};\n", a.reg, (a.a.step)(&a.reg, &a.a.value)))
    );
    // each accumulator's warp partials combined by shuffles down to the lanes `until` leaves
    // (`s > 0`: lane 0 alone)
    let shuffle = |indent: &str, until: &str| {
        each(&|a| {
            format!(
                "{indent}for (int s = 16; {until}; s >>= 1) {{ {} other = \
                 __shfl_down_sync(0xffffffffu, {r}, s); {r} = {}; }}\n",
                a.a.acc_t,
                (a.a.step)(&a.reg, "other"),
                r = a.reg
            )
        })
    };
    let mut text = b.pre.clone();
    // an outer reduction (its reduced dims lie outside a run of kept ones: channels-last
    // batch norm's per-channel sums): consecutive threads own consecutive kept elements, so
    // a warp's load is one contiguous run, where lanes over the reduced elements would read
    // a run's length apart. Given enough rows to fill the device (`split_reduction.rs` cuts
    // the reduced extent into chunks to make them).
    let outer = is_outer(&kept, &reduced) && rows >= t.sm_count as usize * OUTER_ROWS_PER_SM;
    // an outer reduction with too few rows for a thread each (the second pass of a split one:
    // 64 to 512 channels over thousands of partials): a block per `COLUMN_ROWS` consecutive
    // rows. A warp's lanes cover those rows at `32 / COLUMN_ROWS` reduced positions (each load
    // eight runs of 16 bytes), its warps further reduced positions; the accumulators meet in
    // shared memory. A warp per row read its elements a row length apart, from a few blocks.
    // Its block is the pointwise kernels' (`cfg.block`), so it joins their horizontal launches.
    let warps = t.cfg.block as usize / 32;
    let columns = is_outer(&kept, &reduced)
        && !outer
        && red >= WARP_FROM
        && rows >= COLUMN_ROWS
        && warps * 32 * 8 * accs.len() <= COLUMN_SHARED_BYTES;
    let (grid, block) = if columns {
        let cols = column_rows(rows, t.sm_count as usize);
        let depth = 32 / cols;
        for a in &accs {
            let _ = writeln!(
                text,
                "  __shared__ {} col_{}[{warps}][32];",
                a.a.acc_t, a.reg
            );
        }
        let _ = writeln!(
            text,
            "  const int lane = threadIdx.x % 32, w = threadIdx.x / 32;\n  for (long long row0 = \
             kbid * {cols}; row0 < {rows}; row0 += knblk * {cols}) {{\n    const long long row = \
             row0 + lane % {cols};"
        );
        // the kept variables of a row past the end are computed but never used to load or store
        split_index(&mut text, "row", &kept, "    ", "rem_row");
        text.push_str(&declare("    "));
        // unrolled where a thread walks many positions: the block is one of few on its
        // multiprocessor, and a rolled walk waited a round trip to memory for each position
        // (`cuda_rows::UNROLL`); a short walk only gained the unrolled loop's remainder
        let step = warps * depth;
        let unroll = match red.div_ceil(step) >= COLUMN_UNROLL_FROM {
            true => format!("{UNROLL}\n      "),
            false => String::new(),
        };
        let _ = writeln!(
            text,
            "    if (row < {rows}) {{\n      {unroll}for (long long r = w * {depth} + lane / \
             {cols}; r < {red}; r += {step}) {{"
        );
        split_index(&mut text, "r", &reduced, "        ", "rem");
        let _ = writeln!(text, "{accumulate}      }}\n    }}");
        text.push_str(&each(&|a| {
            format!("    col_{r}[w][lane] = {r};\n", r = a.reg)
        }));
        // the first warp sums the block's partials in a fixed order: each lane its position's
        // over the warps, then shuffles down to the lanes that own the rows (a thread per row
        // walking all 32 / cols positions of every warp made a serial chain of 256 shared-memory
        // adds at one row a block)
        let _ = writeln!(text, "    __syncthreads();\n    if (w == 0) {{");
        text.push_str(&declare("      "));
        let _ = writeln!(text, "      for (int k = 0; k < {warps}; k++) {{");
        text.push_str(&each(&|a| {
            let other = format!("col_{}[k][lane]", a.reg);
            format!("        {} = {};\n", a.reg, (a.a.step)(&a.reg, &other))
        }));
        let _ = writeln!(text, "      }}");
        text.push_str(&shuffle("      ", &format!("s >= {cols}")));
        text.push_str(&guarded(
            "      ",
            &format!("lane < {cols} && row < {rows}"),
            &store("        "),
        ));
        let _ = writeln!(text, "    }}\n    __syncthreads();\n  }}");
        (t.blocks(rows, cols), t.cfg.block)
    } else if red < WARP_FROM || outer {
        // a thread per output element, its reduced elements in a loop nest
        let _ = writeln!(
            text,
            "  for (long long row = kbid * blockDim.x + threadIdx.x; row < {rows}; \
             row += knblk * blockDim.x) {{"
        );
        split_index(&mut text, "row", &kept, "    ", "rem");
        text.push_str(&declare("    "));
        for &(v, n) in &reduced {
            let _ = writeln!(text, "    for (long long i{v} = 0; i{v} < {n}; i{v}++)");
        }
        let _ = write!(text, "    {{\n{accumulate}    }}\n{}  }}\n", store("    "));
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
        let warps = row_block / 32;
        let partial = |a: &Acc| match roots.len() {
            1 => "partial".to_string(),
            _ => format!("partial_{}", a.reg),
        };
        if !per_block {
            text.push_str(&each(&|a| {
                format!("  __shared__ {} {}[{warps}];\n", a.a.acc_t, partial(a))
            }));
        }
        let _ = writeln!(
            text,
            "  for (long long row = {first_row}; row < {rows}; \
             row += knblk * {rows_per_block}) {{"
        );
        split_index(&mut text, "row", &kept, "    ", "rem_row");
        text.push_str(&declare("    "));
        let _ = writeln!(
            text,
            "    for (long long r = {lane}; r < {red}; r += {lanes}) {{"
        );
        split_index(&mut text, "r", &reduced, "      ", "rem");
        let _ = writeln!(text, "{accumulate}    }}");
        text.push_str(&shuffle("    ", "s > 0"));
        if per_block {
            text.push_str(&guarded("    ", &format!("{lane} == 0"), &store("      ")));
        } else {
            let publish =
                each(&|a| format!("      {}[threadIdx.x / 32] = {};\n", partial(a), a.reg));
            text.push_str(&guarded("    ", "threadIdx.x % 32 == 0", &publish));
            let _ = writeln!(text, "    __syncthreads();\n    if (threadIdx.x < 32) {{");
            text.push_str(&each(&|a| {
                format!(
                    "      {} = threadIdx.x < {warps} ? {}[threadIdx.x] : ({})({});\n",
                    a.reg,
                    partial(a),
                    a.a.acc_t,
                    a.a.init
                )
            }));
            text.push_str(&shuffle("      ", "s > 0"));
            text.push_str(&guarded("      ", "threadIdx.x == 0", &store("        ")));
            let _ = writeln!(text, "    }}\n    __syncthreads();");
        }
        let _ = writeln!(text, "  }}");
        (t.blocks(rows, rows_per_block), block)
    };
    let outputs: Vec<(NodeId, String)> = accs
        .iter()
        .zip(roots)
        .map(|(a, &r)| (r, a.out.clone()))
        .collect();
    let text = t.narrow_index(
        g,
        b.params.iter().copied().chain(roots.iter().copied()),
        rows * red,
        text,
    );
    let params = parameters(&b, g, &outputs);
    finish(b.params, params, text, grid, block)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{plan_graph, Planned};
    use crate::test_graphs::{input, push};
    use kiln_compile::graph::Op;
    use kiln_core::prim::{Prim, ReduceOp};

    /// A column reduction's block walks its reduced positions unrolled where a thread walks
    /// many, so that it has several loads in flight: its blocks are few per multiprocessor, too
    /// few to hide the round trips of a rolled walk. A short walk stays rolled.
    #[test]
    fn column_reductions_unroll_long_walks() {
        // 100 rows, a block each: 8 warps walk 256 positions at a time; 4096 positions are 16
        // a thread, 512 two
        for (positions, unrolled) in [(4096, true), (512, false)] {
            let mut g = Graph::default();
            let m = input(&mut g, &[positions, 100]);
            let sum = Op::Prim(Prim::Reduce {
                op: ReduceOp::Sum,
                dims: vec![0],
            });
            let s = push(&mut g, sum, vec![m], &[1, 100]);
            g.outputs.push(s);
            let kernels: Vec<String> = plan_graph(&Cuda::new(132), &g)
                .into_iter()
                .filter_map(|p| match p {
                    Planned::Kernel { kernel, .. } => Some(kernel.source),
                    _ => None,
                })
                .collect();
            assert_eq!(kernels.len(), 1);
            let src = &kernels[0];
            assert!(src.contains("col_acc"), "not a column reduction:\n{src}");
            let walk = src
                .find(" r = w * ")
                .and_then(|i| src[..i].rfind("for ("))
                .expect("the reduced walk");
            let line = src[..walk].rfind('\n').map_or(0, |i| i + 1);
            let before = src[..line].trim_end().lines().last().unwrap_or("").trim();
            assert_eq!(before == UNROLL, unrolled, "{positions} positions:\n{src}");
        }
    }

    #[test]
    fn column_reductions_take_fewer_rows_a_block_where_blocks_are_few() {
        // on an H200's 132 multiprocessors
        assert_eq!(column_rows(128, 132), 1);
        assert_eq!(column_rows(300, 132), 2);
        assert_eq!(column_rows(528, 132), 4);
        assert_eq!(column_rows(4096, 132), COLUMN_ROWS);
        assert_eq!(column_rows(4, 132), 1);
    }
}
