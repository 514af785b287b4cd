//! The CUDA target's vector loops: four consecutive elements of a pointwise kernel's innermost
//! dim per iteration, read and written as 16-byte vectors where every buffer is aligned for
//! them (a scalar loop after takes the rest), each lane's body built in lane mode
//! (`Builder::lane_var`); and the per-lane values a thread computes once before its loop when
//! the grid-stride step keeps its innermost index (`hoisted_lanes`).

use std::fmt::Write;

use kiln_compile::graph::Graph;
use kiln_core::DType;

use super::builder::{ty, VectorRead};
use super::c::{one_size, split_index, split_index_as, PointwiseBody};
use super::cuda::Cuda;

/// The test that every buffer `bodies` read or write as vectors is aligned to its vector's size:
/// each buffer once (an in-place output is also read as a vector).
pub(super) fn aligned_test(g: &Graph, bodies: &[PointwiseBody<'_>]) -> String {
    let mut vectors: Vec<(String, DType)> = Vec::new();
    for b in bodies {
        let read = b.b.vector_reads.iter().map(|r| (&r.buf, r.dtype));
        let written = b.outputs.iter().map(|(root, n)| (n, g.nodes[*root].dtype));
        for (name, d) in read.chain(written) {
            if !vectors.iter().any(|(n, _)| n == name) {
                vectors.push((name.clone(), d));
            }
        }
    }
    vectors
        .iter()
        .map(|(name, d)| {
            format!(
                "(unsigned long long){name} % {} == 0",
                4 * d.size_in_bytes()
            )
        })
        .collect::<Vec<_>>()
        .join(" && ")
}

/// The vector reads of `lanes` (but those `hoisted_lanes` read for the body `hoisted` before the
/// loop) and the output vectors its lanes fill.
pub(super) fn vector_reads(
    text: &mut String,
    g: &Graph,
    lanes: &PointwiseBody<'_>,
    hoisted: Option<&PointwiseBody<'_>>,
) {
    let before = |r: &VectorRead| {
        let read = |h: &PointwiseBody<'_>| h.b.vector_reads.iter().any(|x| x.fixed && x == r);
        r.fixed && hoisted.is_some_and(read)
    };
    for r in lanes.b.vector_reads.iter().filter(|r| !before(r)) {
        vector_read(text, r, "      ");
    }
    for (root, name) in &lanes.outputs {
        let _ = writeln!(
            text,
            "      kiln_v4<{}> {name}_s;",
            ty(g.nodes[*root].dtype)
        );
    }
}

/// The line loading vector `r`.
fn vector_read(text: &mut String, r: &VectorRead, indent: &str) {
    let t = ty(r.dtype);
    let _ = writeln!(
        text,
        "{indent}const kiln_v4<{t}> {} = ((const kiln_v4<{t}> *){})[{}];",
        r.name, r.buf, r.at
    );
}

/// A vector loop whose threads keep their lane variable from one iteration to the next: the
/// innermost extent, and whether a block's `4 * block` elements alone are a multiple of it (else
/// the whole grid-stride step is).
#[derive(Clone, Copy)]
pub(super) struct Fixed {
    pub(super) extent: usize,
    by_block: bool,
}

/// The innermost extent of `lanes` when it has per-lane values to compute once per thread
/// (`hoisted_lanes`) and is the lane variable; `None` otherwise, and in a size-generic kernel,
/// whose text is fitted across sizes (`codegen/template.rs`): whether a step keeps the lane
/// variable depends on the size.
fn lane_extent(lanes: &PointwiseBody<'_>, vars: &[(usize, usize)]) -> Option<usize> {
    if !one_size() {
        return None;
    }
    let v = lanes.b.lane_var?;
    let &(last, extent) = vars.last()?;
    (last == v && extent > 0 && !lanes.b.lane_temps.is_empty()).then_some(extent)
}

/// Whether a thread's lane variable stays the same from one iteration of its grid-stride loop to
/// the next, so `lanes`' per-lane values are computed once per thread (`hoisted_lanes`): the
/// loop's step of `4 * block * grid` elements is a multiple of the innermost extent. The kernel
/// tests the step when it runs (a horizontal launch's blocks are its own).
pub(super) fn fixed_lanes(
    lanes: &PointwiseBody<'_>,
    vars: &[(usize, usize)],
    block: u32,
    grid: u32,
) -> Option<Fixed> {
    let extent = lane_extent(lanes, vars)?;
    let per_block = 4 * block as usize;
    let by_block = per_block % extent == 0;
    (by_block || (per_block * grid as usize) % extent == 0).then_some(Fixed { extent, by_block })
}

/// The grid of `cuda`'s vector loop over the `numel` elements of `lanes`.
///
/// Where `lanes` has per-lane values a thread computes once before its loop (`hoisted_lanes`: a
/// normalization's per-channel scale and shift), a few waves of blocks that loop
/// (`Cuda::blocks`), fewer by less than the extent's share so that the grid-stride step is a
/// multiple of the innermost extent (`fixed_lanes`) where the block alone is not (a
/// channels-last tensor of 96 or 160 channels, where 1024 elements a block are not a whole
/// number of rows). Only a full grid — one whose threads loop — is trimmed.
///
/// Otherwise a thread per vector of four, as many blocks as that takes: a thread that runs its
/// body once keeps no loop state and leaves no tail of blocks still looping. On the H200, sin+cos
/// over 2^26 floats went from 138.0 to 132.4 µs. Kernels with hoisted values lost by it
/// (DenseNet-121's training step 34.9 → 37.6 ms, ResNet-18's 7.8 → 8.1 ms, each lane computing
/// its channel's values again): BENCHMARKS.md, "A thread per vector".
pub(super) fn lane_grid(
    cuda: &Cuda,
    lanes: &PointwiseBody<'_>,
    vars: &[(usize, usize)],
    numel: usize,
) -> u32 {
    let (vectors, block) = (numel.div_ceil(4), cuda.cfg.block);
    let Some(extent) = lane_extent(lanes, vars) else {
        return vectors.div_ceil(block as usize).clamp(1, MAX_GRID) as u32;
    };
    let grid = cuda.blocks(vectors, block as usize);
    let full = vectors.div_ceil(block as usize) > grid as usize;
    if !full {
        return grid;
    }
    let per_block = 4 * block as usize;
    let mut a = extent;
    let mut b = per_block;
    while b != 0 {
        (a, b) = (b, a % b);
    }
    // the grid must be a multiple of this many blocks
    let step = (extent / a) as u32;
    if step <= 1 || step > grid / 2 {
        return grid;
    }
    grid - grid % step
}

/// Blocks a one-dimensional launch may have (`gridDim.x`); past it the threads loop.
const MAX_GRID: usize = i32::MAX as usize;

/// What a vector loop over `fixed` lanes adds to its alignment test: the launch's block (or its
/// whole grid) keeps the lane variable fixed.
pub(super) fn fixed_test(fixed: Option<Fixed>) -> String {
    match fixed {
        Some(Fixed {
            extent,
            by_block: true,
        }) => format!(" && (blockDim.x * 4) % {extent} == 0"),
        Some(Fixed { extent, .. }) => format!(" && (stride * 4) % {extent} == 0"),
        None => String::new(),
    }
}

/// The per-lane values of `lanes` (`Builder::lane_pre`) computed once per thread, before its
/// grid-stride loop (`fixed_lanes` says the lane variable does not move): lane 0's lane
/// variable from the thread's first vector, the vectors read at it alone, and each per-lane
/// value of the four lanes into an array the loop's lanes read back (`lane_values`). A
/// per-channel statistic's `1/sqrt(var + eps)` then costs a thread one computation instead of
/// one per element.
pub(super) fn hoisted_lanes(text: &mut String, lanes: &PointwiseBody<'_>, extent: usize) {
    let Some(v) = lanes.b.lane_var else { return };
    let _ = writeln!(text, "    const long long i{v}_l0 = (e0 * 4) % {extent};");
    for r in lanes.b.vector_reads.iter().filter(|r| r.fixed) {
        vector_read(text, r, "    ");
    }
    for (name, d) in &lanes.b.lane_temps {
        let _ = writeln!(text, "    {} {name}_h[4];", ty(*d));
    }
    text.push_str("    #pragma unroll\n    for (int k = 0; k < 4; k++) {\n");
    text.push_str(&lanes.b.lane_pre);
    for (name, _) in &lanes.b.lane_temps {
        let _ = writeln!(text, "    {name}_h[k] = {name};");
    }
    text.push_str("    }\n");
}

/// The per-lane values at the start of lane `k`'s body: read back from `hoisted_lanes`'
/// arrays, or computed there when the lane variable moves.
pub(super) fn lane_values(text: &mut String, lanes: &PointwiseBody<'_>, hoisted: bool) {
    if !hoisted {
        text.push_str(&lanes.b.lane_pre);
        return;
    }
    for (name, d) in &lanes.b.lane_temps {
        let _ = writeln!(text, "      const {} {name} = {name}_h[k];", ty(*d));
    }
}

/// The loop over four-element vectors of a pointwise kernel in lane mode (`lanes`), taken when
/// every vector pointer is aligned to its vector's size; it leaves `e0` at the first element it
/// did not cover, for the scalar loop after it.
pub(super) fn vector_loop(
    text: &mut String,
    g: &Graph,
    lanes: &PointwiseBody<'_>,
    vars: &[(usize, usize)],
    numel: usize,
    (block, grid): (u32, u32),
) {
    let aligned = aligned_test(g, std::slice::from_ref(lanes));
    let nvec = numel / 4;
    let fixed = fixed_lanes(lanes, vars, block, grid);
    let _ = writeln!(text, "  if ({aligned}{}) {{", fixed_test(fixed));
    if let Some(f) = fixed {
        hoisted_lanes(text, lanes, f.extent);
    }
    let _ = writeln!(
        text,
        "    for (long long q = e0; q < {nvec}; q += stride) {{"
    );
    // lane 0's index variables, where the lanes share all but the innermost (`Builder::lane_var`)
    if let Some(v) = lanes.b.lane_var {
        let name = |w: usize| match w == v {
            true => format!("i{w}_l0"),
            false => format!("i{w}"),
        };
        split_index_as(text, "q * 4", vars, "      ", "rem", name);
    }
    vector_reads(text, g, lanes, fixed.map(|_| lanes));
    let _ = writeln!(
        text,
        "      #pragma unroll\n      for (int k = 0; k < 4; k++) {{\n      const long long e = \
         q * 4 + k;"
    );
    match lanes.b.lane_var {
        Some(v) => {
            let _ = writeln!(text, "      const long long i{v} = i{v}_l0 + k;");
        }
        None => split_index(text, "e", vars, "      ", "rem"),
    }
    lane_values(text, lanes, fixed.is_some());
    text.push_str(&lanes.b.body);
    text.push_str(&lanes.stores);
    let _ = writeln!(text, "      }}");
    for (root, name) in &lanes.outputs {
        let t = ty(g.nodes[*root].dtype);
        let _ = writeln!(text, "      ((kiln_v4<{t}> *){name})[q] = {name}_s;");
    }
    let _ = writeln!(
        text,
        "    }}\n    e0 = {} + (long long)kbid * blockDim.x + threadIdx.x;\n  }}",
        nvec * 4
    );
}
