//! gather and scatter_add along one dim. Index values are checked on the device: an index out of
//! range is skipped and recorded in the device's index-check flag (`index_check.rs`), which the next
//! synchronization reads and reports as the op's `Err`; a call itself never waits for the device.
//! scatter_add accumulates with atomics: for floats the order of additions, and so the rounding,
//! can differ from the CPU's sequential loop.

use std::ffi::c_void;
use std::fmt::Write;
use std::sync::Arc;

use kiln_core::shape::Layout;
use kiln_core::{DType, Error, Result};

use super::elementwise::{self as ew, Scalars};
use super::{c_type, Geo, PRELUDE};
use crate::buffer::CudaBuffer;
use crate::device::CudaDevice;

/// Whether scatter_add has an atomic add for `d` here (others take the host path).
pub(crate) fn scatter_supported(d: DType) -> bool {
    matches!(d, DType::F32 | DType::F64 | DType::I32 | DType::I64)
}

/// out[p] = x[p with coordinate `dim` replaced by index[p]]; `out` has the index's shape.
pub(crate) fn gather(
    dev: &Arc<CudaDevice>,
    (x, lx): (&CudaBuffer, &Layout),
    (idx, li): (&CudaBuffer, &Layout),
    dim: usize,
    out: &CudaBuffer,
) -> Result<()> {
    let mut g = geo(li);
    for (d, &s) in lx.strides.iter().enumerate() {
        g.st[1][d] = s as i64;
    }
    g.off[1] = lx.offset as i64;
    run(
        dev,
        "gather",
        x.dtype,
        dim,
        &mut g,
        lx.shape[dim],
        out.ptr,
        idx.ptr,
        x.ptr,
    )
}

/// out = x; out[p with coordinate `dim` replaced by index[p]] += src[p].
pub(crate) fn scatter_add(
    dev: &Arc<CudaDevice>,
    (x, lx): (&CudaBuffer, &Layout),
    (idx, li): (&CudaBuffer, &Layout),
    (src, ls): (&CudaBuffer, &Layout),
    dim: usize,
    out: &CudaBuffer,
) -> Result<()> {
    let full = Layout::contiguous(&lx.shape);
    ew::launch(
        dev,
        &ew::Op::Identity,
        &[(x, lx)],
        out,
        &full,
        Scalars::default(),
    )?;
    let mut g = geo(li);
    for (d, &s) in ls.strides.iter().enumerate() {
        g.st[1][d] = s as i64;
    }
    g.off[1] = ls.offset as i64;
    for (d, &s) in full.strides.iter().enumerate() {
        g.st[3][d] = s as i64;
    }
    run(
        dev,
        "scatter",
        x.dtype,
        dim,
        &mut g,
        lx.shape[dim],
        out.ptr,
        idx.ptr,
        src.ptr,
    )
}

fn geo(li: &Layout) -> Geo {
    let mut g = Geo {
        n: li.numel() as i64,
        off: [li.offset as i64, 0, 0, 0],
        ..Geo::default()
    };
    for d in 0..li.rank() {
        g.shape[d] = li.shape[d] as i64;
        g.st[0][d] = li.strides[d] as i64;
    }
    g
}

#[allow(clippy::too_many_arguments)]
fn run(
    dev: &Arc<CudaDevice>,
    mode: &'static str,
    d: DType,
    dim: usize,
    g: &mut Geo,
    dim_size: usize,
    out: u64,
    idx: u64,
    data: u64,
) -> Result<()> {
    let n = g.n as usize;
    if n == 0 {
        return Ok(());
    }
    let rank = (0..8)
        .rposition(|k| g.shape[k] != 0)
        .map_or(0, |k| k + 1)
        .max(dim + 1);
    let sig = format!("{mode}:{}:r{rank}:d{dim}", d.tag());
    let f = crate::nvrtc::kernel(dev, &sig, || source(mode, d, rank, dim))?;
    let op = if mode == "gather" {
        "gather"
    } else {
        "scatter_add"
    };
    let id = match dev.checks.register(op, dim, dim_size) {
        Some(id) => id,
        None => {
            // many launches without a synchronization: settle the ones so far first
            dev.synchronize()?;
            dev.checks
                .register(op, dim, dim_size)
                .ok_or_else(|| Error::index(op, "index-check table full after a synchronization"))?
        }
    };
    let (mut o, mut i, mut x, mut fl) = (out, idx, data, dev.checks.device_ptr);
    let mut ds = dim_size as i64;
    let mut launch = id;
    let mut params: Vec<*mut c_void> = vec![
        (&mut o as *mut u64).cast(),
        (&mut i as *mut u64).cast(),
        (&mut x as *mut u64).cast(),
        (g as *mut Geo).cast(),
        (&mut ds as *mut i64).cast(),
        (&mut fl as *mut u64).cast(),
        (&mut launch as *mut i32).cast(),
    ];
    let (grid, block) = super::grid_for(n, dev.sm_count);
    dev.launch(f, grid, block, 0, &mut params)
}

fn source(mode: &str, d: DType, rank: usize, dim: usize) -> String {
    let t = c_type(d);
    let mut s = String::from(PRELUDE);
    let _ = writeln!(
        s,
        "extern \"C\" __global__ void k({t}* __restrict__ out, const long long* __restrict__ idx, const {t}* __restrict__ data, Geo g, long long dsize, int* bad, int launch) {{
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < g.n; i += (long long)gridDim.x * blockDim.x) {{
    long long r = i, oi = g.off[0], od = g.off[1], oo = 0;"
    );
    for k in (0..rank).rev() {
        let _ = write!(
            s,
            "    {{ long long c = r % g.shape[{k}]; r /= g.shape[{k}]; oi += c * g.st[0][{k}];"
        );
        if mode == "gather" {
            if k != dim {
                let _ = write!(s, " od += c * g.st[1][{k}];");
            }
        } else {
            let _ = write!(s, " od += c * g.st[1][{k}];");
            if k != dim {
                let _ = write!(s, " oo += c * g.st[3][{k}];");
            }
        }
        s.push_str(" }\n");
    }
    s.push_str(
        // the first failing launch since the last synchronization is the one reported
        "    long long j = idx[oi];\n    if (j < 0 || j >= dsize) { atomicCAS(bad, 0, launch); continue; }\n",
    );
    if mode == "gather" {
        let _ = writeln!(s, "    out[i] = data[od + j * g.st[1][{dim}]];");
    } else {
        let _ = writeln!(s, "    oo += j * g.st[3][{dim}];");
        let add = match d {
            DType::I64 => "atomicAdd((unsigned long long*)&out[oo], (unsigned long long)data[od]);",
            _ => "atomicAdd(&out[oo], data[od]);",
        };
        let _ = writeln!(s, "    {add}");
    }
    s.push_str("  }\n}\n");
    s
}
