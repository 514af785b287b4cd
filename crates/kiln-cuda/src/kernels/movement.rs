//! Pad and cat, as writes into views of the output: pad, and a cat input that is strided, go
//! through the elementwise copy into the window of the output where they belong; a cat's
//! contiguous inputs, and the contiguous pairs of a multi-tensor copy (`assign_many`), go
//! through one kernel that takes a table of them (`copy_rows`).

use std::ffi::c_void;
use std::sync::Arc;

use kiln_core::shape::Layout;
use kiln_core::Result;

use super::elementwise::{self as ew, Scalars};
use super::grid_for;
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
    ew::launch(dev, &ew::Op::Full, &[], out, &full, scalars)?;
    let mut window = full;
    for (d, &(before, _)) in pads.iter().enumerate() {
        window = window.slice(d, before, before + lx.shape[d], 1);
    }
    ew::launch(
        dev,
        &ew::Op::Identity,
        &[(x, lx)],
        out,
        &window,
        Scalars::default(),
    )
}

/// Concatenation along `dim`: the contiguous inputs of the output's dtype through the table copy
/// (`copy_rows`: a foreach optimizer concatenates every parameter, and one launch per tensor was
/// 5 µs each), the others each copied into its slice of the output by the elementwise copy.
pub(crate) fn cat(
    dev: &Arc<CudaDevice>,
    inputs: &[(&CudaBuffer, &Layout)],
    dim: usize,
    out: &CudaBuffer,
    out_shape: &[usize],
) -> Result<()> {
    let full = Layout::contiguous(out_shape);
    // the output as [outer, row]: input i fills columns start_i .. start_i + len_i * inner
    let outer: usize = out_shape[..dim].iter().product();
    let inner: usize = out_shape[dim + 1..].iter().product();
    let mut pieces: Vec<RowCopy> = Vec::new();
    let mut at = 0;
    for &(b, l) in inputs {
        let len = l.shape[dim];
        if l.numel() > 0 && l.is_contiguous() && b.dtype == out.dtype {
            pieces.push(RowCopy {
                dst: out.at(at * inner),
                src: b.at(l.offset),
                width: (len * inner) as i64,
            });
        } else {
            let window = full.slice(dim, at, at + len, 1);
            ew::launch(
                dev,
                &ew::Op::Identity,
                &[(b, l)],
                out,
                &window,
                Scalars::default(),
            )?;
        }
        at += len;
    }
    let rows = Rows {
        outer: outer as i64,
        stride: (at * inner) as i64,
    };
    copy_rows(dev, &pieces, rows, out.dtype.size_in_bytes())
}

/// Entries per launch of the table copy (its table travels as a kernel argument: 64 entries of
/// 24 bytes stay well under the 4 KiB every CUDA device takes).
const COPIES_PER_LAUNCH: usize = 64;

/// One contiguous source of `outer * width` elements (device addresses), copied into `outer`
/// rows of `width` elements from `dst` on (`Rows` gives their count and spacing).
#[derive(Clone, Copy)]
pub(crate) struct RowCopy {
    pub dst: u64,
    pub src: u64,
    pub width: i64,
}

/// How every entry of a table copy lays out in its destination: `outer` rows, `stride`
/// elements apart. A plain copy is one row (`Rows::ONE`); a cat's piece is a column block of
/// the output.
#[derive(Clone, Copy)]
pub(crate) struct Rows {
    pub outer: i64,
    pub stride: i64,
}

impl Rows {
    pub(crate) const ONE: Rows = Rows {
        outer: 1,
        stride: 0,
    };
}

/// The table copy's table, by value (the layout must match the `Table` struct of its source).
#[repr(C)]
#[derive(Clone, Copy)]
struct CopyTable {
    dst: [u64; COPIES_PER_LAUNCH],
    src: [u64; COPIES_PER_LAUNCH],
    width: [i64; COPIES_PER_LAUNCH],
    outer: i64,
    stride: i64,
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

/// The table copy: `copies` of elements `elem_bytes` wide, laid out as `rows` says, in launches
/// of up to `COPIES_PER_LAUNCH`. A cat's contiguous pieces, and a foreach optimizer writing every
/// parameter back after its flat update (one launch each was ~2.5 µs of host time apiece, 124
/// per ResNet-18 step). Grid row `y` is entry `y`, its blocks a grid-stride loop over the
/// entry's elements. Sources must not overlap destinations.
pub(crate) fn copy_rows(
    dev: &Arc<CudaDevice>,
    copies: &[RowCopy],
    rows: Rows,
    elem_bytes: usize,
) -> Result<()> {
    let ty = match elem_bytes {
        1 => "unsigned char",
        2 => "unsigned short",
        4 => "unsigned int",
        8 => "unsigned long long",
        b => {
            return Err(kiln_core::Error::unsupported(
                "copy",
                format!("elements of {b} bytes"),
            ))
        }
    };
    let sig = format!("copy_rows:{elem_bytes}");
    let f = crate::nvrtc::kernel(dev, &sig, || {
        format!(
            "struct Table {{ unsigned long long dst[{COPIES_PER_LAUNCH}]; unsigned long long \
             src[{COPIES_PER_LAUNCH}]; long long width[{COPIES_PER_LAUNCH}]; long long outer; \
             long long stride; }};\nextern \"C\" __global__ void k(Table t) {{\n  const int p = \
             blockIdx.y;\n  {ty}* __restrict__ out = ({ty}*)t.dst[p];\n  const {ty}* __restrict__ \
             in = (const {ty}*)t.src[p];\n  const long long w = t.width[p], n = t.outer * w;\n  \
             for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < n; e += \
             (long long)gridDim.x * blockDim.x) {{\n    const long long o = t.outer == 1 ? 0 : e \
             / w;\n    out[o * t.stride + (e - o * w)] = in[e];\n  }}\n}}\n"
        )
    })?;
    for chunk in copies.chunks(COPIES_PER_LAUNCH) {
        let mut table = CopyTable {
            dst: [0; COPIES_PER_LAUNCH],
            src: [0; COPIES_PER_LAUNCH],
            width: [0; COPIES_PER_LAUNCH],
            outer: rows.outer,
            stride: rows.stride,
        };
        for (k, c) in chunk.iter().enumerate() {
            table.dst[k] = c.dst;
            table.src[k] = c.src;
            table.width[k] = c.width;
        }
        let most = chunk.iter().map(|c| c.width).max().unwrap_or(0) * rows.outer;
        let (blocks, block) = grid_for(most as usize, dev.sm_count);
        // the entries share the machine: fewer blocks each the more entries a launch has
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
