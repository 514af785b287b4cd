//! Pad and cat, as writes into views of the output: pad, and a cat input that is strided, go
//! through the elementwise copy into the window of the output where they belong; a cat's
//! contiguous inputs are copied by one kernel that takes a table of them.

use std::ffi::c_void;
use std::sync::Arc;

use kiln_core::shape::Layout;
use kiln_core::Result;

use super::elementwise::{self as ew, Scalars};
use super::{c_type, grid_for, PRELUDE};
use crate::buffer::CudaBuffer;
use crate::device::CudaDevice;

/// Constant padding: fill with `value`, then copy the input into the interior window.
pub(crate) fn pad(
    dev: &Arc<CudaDevice>,
    (x, lx): (&CudaBuffer, &Layout),
    pads: &[(usize, usize)],
    value: f64,
    out: &CudaBuffer,
    out_shape: &[usize],
) -> Result<()> {
    let full = Layout::contiguous(out_shape);
    let scalars = Scalars {
        value,
        ..Scalars::default()
    };
    ew::launch(dev, &ew::full(), &[], out, &full, scalars)?;
    let mut window = full;
    for (d, &(before, _)) in pads.iter().enumerate() {
        window = window.slice(d, before, before + lx.shape[d], 1);
    }
    ew::launch(
        dev,
        &ew::identity(),
        &[(x, lx)],
        out,
        &window,
        Scalars::default(),
    )
}

/// Concatenation along `dim`: the contiguous inputs of the output's dtype in launches of up to
/// `CAT_PER_LAUNCH` (a foreach optimizer concatenates every parameter: one launch per tensor was
/// 5 µs each), the others each copied into its slice of the output by the elementwise copy.
pub(crate) fn cat(
    dev: &Arc<CudaDevice>,
    inputs: &[(&CudaBuffer, &Layout)],
    dim: usize,
    out: &CudaBuffer,
    out_shape: &[usize],
) -> Result<()> {
    let full = Layout::contiguous(out_shape);
    // the output as [outer, width]: input i fills columns start_i .. start_i + len_i * inner
    let outer: usize = out_shape[..dim].iter().product();
    let inner: usize = out_shape[dim + 1..].iter().product();
    let mut pieces: Vec<Piece> = Vec::new();
    let mut at = 0;
    for &(b, l) in inputs {
        let len = l.shape[dim];
        if l.numel() > 0 && l.is_contiguous() && b.dtype == out.dtype {
            pieces.push(Piece {
                ptr: b.at(l.offset),
                start: (at * inner) as i64,
                width: (len * inner) as i64,
            });
        } else {
            let window = full.slice(dim, at, at + len, 1);
            ew::launch(
                dev,
                &ew::identity(),
                &[(b, l)],
                out,
                &window,
                Scalars::default(),
            )?;
        }
        at += len;
    }
    let row = (at * inner) as i64;
    for chunk in pieces.chunks(CAT_PER_LAUNCH) {
        cat_launch(dev, chunk, outer as i64, row, out)?;
    }
    Ok(())
}

/// Inputs per launch of the concatenation kernel (its table travels as a kernel argument).
const CAT_PER_LAUNCH: usize = 32;

/// One contiguous input of a concatenation: its first element, and its columns of the output.
#[derive(Clone, Copy)]
struct Piece {
    ptr: u64,
    start: i64,
    width: i64,
}

/// The kernel's table, by value (the layout must match the `Cat` struct of its source).
#[repr(C)]
#[derive(Clone, Copy)]
struct CatTable {
    src: [u64; CAT_PER_LAUNCH],
    start: [i64; CAT_PER_LAUNCH],
    width: [i64; CAT_PER_LAUNCH],
    outer: i64,
    row: i64,
}

/// Copies each piece into its columns of `out` ([outer, row], contiguous): grid row `y` is piece
/// `y`, its blocks a grid-stride loop over the piece's elements.
fn cat_launch(
    dev: &Arc<CudaDevice>,
    pieces: &[Piece],
    outer: i64,
    row: i64,
    out: &CudaBuffer,
) -> Result<()> {
    let mut table = CatTable {
        src: [0; CAT_PER_LAUNCH],
        start: [0; CAT_PER_LAUNCH],
        width: [0; CAT_PER_LAUNCH],
        outer,
        row,
    };
    for (k, p) in pieces.iter().enumerate() {
        table.src[k] = p.ptr;
        table.start[k] = p.start;
        table.width[k] = p.width;
    }
    let ty = c_type(out.dtype);
    let sig = format!("cat:{}", out.dtype.tag());
    let f = crate::nvrtc::kernel(dev, &sig, || {
        format!(
            "{PRELUDE}\nstruct Cat {{ unsigned long long src[{CAT_PER_LAUNCH}]; long long \
             start[{CAT_PER_LAUNCH}]; long long width[{CAT_PER_LAUNCH}]; long long outer; long \
             long row; }};\nextern \"C\" __global__ void k({ty}* __restrict__ out, Cat t) {{\n  \
             const int p = blockIdx.y;\n  const {ty}* __restrict__ in = (const {ty}*)t.src[p];\n  \
             const long long w = t.width[p], n = t.outer * w;\n  for (long long e = blockIdx.x * \
             (long long)blockDim.x + threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) \
             {{\n    const long long o = t.outer == 1 ? 0 : e / w;\n    out[o * t.row + t.start[p] \
             + (e - o * w)] = in[e];\n  }}\n}}\n"
        )
    })?;
    let most = pieces
        .iter()
        .map(|p| (outer * p.width) as usize)
        .max()
        .unwrap_or(0);
    let (blocks, block) = grid_for(most, dev.sm_count);
    // the pieces share the machine: fewer blocks each the more pieces a launch has
    let per_piece = (dev.sm_count as usize * 32 / pieces.len()).max(dev.sm_count as usize);
    let blocks = (blocks as usize).min(per_piece).max(1) as u32;
    let mut ptr = out.ptr;
    let mut params: Vec<*mut c_void> = vec![
        (&mut ptr as *mut u64).cast(),
        (&mut table as *mut CatTable).cast(),
    ];
    dev.launch_grid(f, [blocks, pieces.len() as u32, 1], block, 0, &mut params)
}

/// Copies per launch of the multi-tensor copy (its table travels as a kernel argument: 64
/// entries of 24 bytes stay well under the 4 KiB every CUDA device takes).
const COPIES_PER_LAUNCH: usize = 64;

/// One contiguous copy of `n` elements from `src` to `dst` (device addresses).
#[derive(Clone, Copy)]
pub(crate) struct Copy1d {
    pub dst: u64,
    pub src: u64,
    pub n: i64,
}

/// The multi-tensor copy's table, by value (the layout must match the `Copies` struct of its
/// source).
#[repr(C)]
#[derive(Clone, Copy)]
struct CopyTable {
    dst: [u64; COPIES_PER_LAUNCH],
    src: [u64; COPIES_PER_LAUNCH],
    n: [i64; COPIES_PER_LAUNCH],
}

/// The device bytes `[start, end)` a tensor's elements lie in: its window where it is
/// contiguous, its whole buffer otherwise.
pub(crate) fn bytes_touched(b: &CudaBuffer, l: &Layout) -> (u64, u64) {
    let size = b.dtype.size_in_bytes() as u64;
    match l.is_contiguous() {
        true => (b.at(l.offset), b.at(l.offset) + l.numel() as u64 * size),
        false => (b.ptr, b.ptr + b.len as u64 * size),
    }
}

/// Whether copies writing the byte ranges `writes` and reading `reads` give what they would
/// one after another in any order (so one launch may run them all): no two writes overlap and
/// no read overlaps a write.
pub(crate) fn copies_commute(mut writes: Vec<(u64, u64)>, reads: &[(u64, u64)]) -> bool {
    writes.sort_unstable();
    if writes.windows(2).any(|w| w[1].0 < w[0].1) {
        return false;
    }
    // disjoint and sorted by start, so sorted by end too: the first write ending past a read's
    // start is the only one it can overlap first
    reads.iter().all(|&(start, end)| {
        let i = writes.partition_point(|w| w.1 <= start);
        writes.get(i).map_or(true, |w| w.0 >= end)
    })
}

/// Many contiguous copies of elements `elem_bytes` wide, in launches of up to
/// `COPIES_PER_LAUNCH`: a foreach optimizer writes every parameter back after its flat update (one
/// launch each was ~2.5 µs of host time apiece, 124 per ResNet-18 step). Grid row `y` is copy `y`,
/// its blocks a grid-stride loop over the elements. Sources must not overlap destinations.
pub(crate) fn copy_many(dev: &Arc<CudaDevice>, copies: &[Copy1d], elem_bytes: usize) -> Result<()> {
    let ty = match elem_bytes {
        1 => "unsigned char",
        2 => "unsigned short",
        4 => "unsigned int",
        8 => "unsigned long long",
        b => {
            return Err(kiln_core::Error::unsupported(
                "assign_many",
                format!("elements of {b} bytes"),
            ))
        }
    };
    let sig = format!("copy_many:{elem_bytes}");
    let f = crate::nvrtc::kernel(dev, &sig, || {
        format!(
            "struct Copies {{ unsigned long long dst[{COPIES_PER_LAUNCH}]; unsigned long long \
             src[{COPIES_PER_LAUNCH}]; long long n[{COPIES_PER_LAUNCH}]; }};\nextern \"C\" \
             __global__ void k(Copies t) {{\n  const int p = blockIdx.y;\n  {ty}* __restrict__ out \
             = ({ty}*)t.dst[p];\n  const {ty}* __restrict__ in = (const {ty}*)t.src[p];\n  const \
             long long n = t.n[p];\n  for (long long e = blockIdx.x * (long long)blockDim.x + \
             threadIdx.x; e < n; e += (long long)gridDim.x * blockDim.x) out[e] = in[e];\n}}\n"
        )
    })?;
    for chunk in copies.chunks(COPIES_PER_LAUNCH) {
        let mut table = CopyTable {
            dst: [0; COPIES_PER_LAUNCH],
            src: [0; COPIES_PER_LAUNCH],
            n: [0; COPIES_PER_LAUNCH],
        };
        for (k, c) in chunk.iter().enumerate() {
            table.dst[k] = c.dst;
            table.src[k] = c.src;
            table.n[k] = c.n;
        }
        let most = chunk.iter().map(|c| c.n as usize).max().unwrap_or(0);
        let (blocks, block) = grid_for(most, dev.sm_count);
        // the copies share the machine: fewer blocks each the more copies a launch has
        let per_copy = (dev.sm_count as usize * 32 / chunk.len()).max(dev.sm_count as usize);
        let blocks = (blocks as usize).min(per_copy).max(1) as u32;
        let mut params: Vec<*mut c_void> = vec![(&mut table as *mut CopyTable).cast()];
        dev.launch_grid(f, [blocks, chunk.len() as u32, 1], block, 0, &mut params)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::copies_commute;

    #[test]
    fn copies_commute_only_without_overlaps() {
        // disjoint windows of one buffer, read from elsewhere: one launch
        let writes = vec![(200, 300), (0, 100), (100, 200)];
        assert!(copies_commute(writes.clone(), &[(1000, 1300), (300, 400)]));
        // a read of a window another copy writes (b <- a, a <- s): in order
        assert!(!copies_commute(writes.clone(), &[(150, 160)]));
        assert!(!copies_commute(writes.clone(), &[(50, 1000)]));
        // overlapping writes (the later must win)
        assert!(!copies_commute(vec![(0, 256), (144, 400)], &[]));
        // touching ends do not overlap
        assert!(copies_commute(vec![(0, 100)], &[(100, 200), (0, 0)]));
        assert!(copies_commute(Vec::new(), &[(0, 10)]));
    }
}
