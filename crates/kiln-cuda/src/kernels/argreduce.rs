//! argmax / argmin along one dim as block reductions over (value, index) pairs. The CPU kernel's
//! rules hold: the first NaN wins, and among equal values the first index.

use std::ffi::c_void;
use std::fmt::Write;
use std::sync::Arc;

use kiln_core::prim::ArgReduceOp;
use kiln_core::shape::Layout;
use kiln_core::{DType, Result};

use super::{c_type, compute_type, load, Geo, PRELUDE};
use crate::buffer::CudaBuffer;
use crate::device::CudaDevice;

/// Reduces `x` along `dim` into `out` (i64, contiguous, keepdim shape).
pub(crate) fn launch(
    dev: &Arc<CudaDevice>,
    op: ArgReduceOp,
    dim: usize,
    x: &CudaBuffer,
    layout: &Layout,
    out: &CudaBuffer,
) -> Result<()> {
    // slot 0: the kept dims (the reduced one as size 1); slot 1: the reduced dim's size and stride
    let mut g = Geo::default();
    let rank = layout.rank();
    let mut nout = 1i64;
    for d in 0..rank {
        g.shape[d] = if d == dim { 1 } else { layout.shape[d] as i64 };
        g.st[0][d] = layout.strides[d] as i64;
        nout *= g.shape[d];
    }
    g.n = nout;
    g.off[0] = layout.offset as i64;
    let row = layout.shape[dim] as i64;
    g.st[1][0] = row;
    g.st[1][1] = layout.strides[dim] as i64;
    if nout == 0 {
        return Ok(());
    }
    let d = x.dtype;
    let sig = format!("arg:{op:?}:{}:r{rank}", d.tag());
    let f = crate::nvrtc::kernel(dev, &sig, || source(op, d, rank))?;
    let (mut o, mut i) = (out.ptr, x.ptr);
    let mut params: Vec<*mut c_void> = vec![
        (&mut o as *mut u64).cast(),
        (&mut i as *mut u64).cast(),
        (&mut g as *mut Geo).cast(),
    ];
    let threads = (row as usize).next_power_of_two().clamp(32, 256) as u32;
    dev.launch(
        f,
        (nout as usize).min(1 << 30) as u32,
        threads,
        0,
        &mut params,
    )
}

fn source(op: ArgReduceOp, d: DType, rank: usize) -> String {
    let v = match compute_type(d) {
        "u8" => "int",
        t => t,
    };
    let better = match op {
        ArgReduceOp::ArgMax => "va > vb",
        ArgReduceOp::ArgMin => "va < vb",
    };
    let mut s = String::from(PRELUDE);
    // (value, index) pairs; index -1 marks "no element yet"
    let _ = writeln!(
        s,
        "__device__ __forceinline__ void comb({v}& va, long long& ia, {v} vb, long long ib) {{
  if (ib < 0) return;
  bool take;
  if (ia < 0) take = true;
  else if (va != va) take = (vb != vb) && ib < ia;
  else if (vb != vb) take = true;
  else if ({better}) take = false;
  else if (vb == va) take = ib < ia;
  else take = true;
  if (take) {{ va = vb; ia = ib; }}
}}"
    );
    let _ = writeln!(
        s,
        "extern \"C\" __global__ void k(long long* __restrict__ out, const {}* __restrict__ x, Geo g) {{
  __shared__ {v} pv[32]; __shared__ long long pi[32];
  long long row = g.st[1][0], rst = g.st[1][1];
  for (long long o = blockIdx.x; o < g.n; o += gridDim.x) {{
    long long r = o, base = g.off[0];",
        c_type(d)
    );
    for k in (0..rank).rev() {
        let _ = writeln!(
            s,
            "    base += (r % g.shape[{k}]) * g.st[0][{k}]; r /= g.shape[{k}];"
        );
    }
    let _ = writeln!(
        s,
        "    {v} a = 0; long long ia = -1;
    for (long long j = threadIdx.x; j < row; j += blockDim.x) comb(a, ia, ({v}){}, j);
    for (int m = 16; m > 0; m >>= 1) {{
      {v} b = __shfl_xor_sync(0xffffffffu, a, m); long long ib = __shfl_xor_sync(0xffffffffu, ia, m);
      comb(a, ia, b, ib);
    }}
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nw = blockDim.x >> 5;
    if (lane == 0) {{ pv[warp] = a; pi[warp] = ia; }}
    __syncthreads();
    if (warp == 0) {{
      a = lane < nw ? pv[lane] : ({v})0; ia = lane < nw ? pi[lane] : -1;
      for (int m = 16; m > 0; m >>= 1) {{
        {v} b = __shfl_xor_sync(0xffffffffu, a, m); long long ib = __shfl_xor_sync(0xffffffffu, ia, m);
        comb(a, ia, b, ib);
      }}
      if (lane == 0) out[o] = ia < 0 ? 0 : ia;
    }}
    __syncthreads();
  }}
}}",
        load(d, "x[base + j * rst]")
    );
    s
}
