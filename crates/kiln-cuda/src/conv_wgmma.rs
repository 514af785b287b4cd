//! Hopper's generated convolution (the template `kernels/conv_wgmma.cu`): the tensor memory
//! accelerator gathers the input's windows (im2col mode) and the filter into shared memory, the
//! warpgroup MMA multiplies them there. Where it fits, it runs the forwards and the stride-1 data
//! gradients that `conv_igemm.rs` would otherwise run on its mma.sync kernel: DenseNet-121's
//! forwards at batch 64 on an H200 take 4.1 ms a step on it against 8.8 ms (cuDNN 3.8), its data
//! gradients 3.25 ms against 8.8 (cuDNN 3.23); BENCHMARKS.md has the table. The grid is
//! persistent: as many blocks as the device holds, each taking output tiles in turn.
//!
//! A data gradient at stride 1 is a forward convolution (`as_forward`): of dy, with the filter
//! flipped in space and its channel axes swapped (a small kernel writes that copy at each call),
//! padded by the window's reach less the forward's padding.
//!
//! What it takes (`fits`): compute capability 9.0 (wgmma is an instruction of sm_90a only), the
//! summed channels a multiple of 4 (the tensor maps' rows are 16-byte multiples), operands 16-byte
//! aligned, strides up to 8 and windows whose padding and reach fit the im2col map's corners.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::sys;

use kiln_core::prim::ConvParams;
use kiln_core::{DType, Result};

use crate::conv::Kind;
use crate::conv_generated::Pixels;
use crate::conv_modules::ConvKernel;
use crate::device::CudaDevice;

const TEMPLATE: &str = include_str!("kernels/conv_wgmma.cu");
/// Hopper's building blocks (tensor maps, TMA copies, barriers, the MMA's operand descriptor),
/// the start of every Hopper module's text.
pub(crate) const HOPPER_TMA: &str = include_str!("kernels/hopper_tma.cu");

/// Rows of a block's tile (two consumer warpgroups of 64) and its k step: 32 f32 channels, one
/// 128-byte swizzled row (the `.cu` file's WG_BM, WG_BK).
const BM: usize = 128;
const BK: usize = 32;
/// Tiles in flight.
const STAGES: usize = 4;
/// The producer's warpgroup and the two consumers'.
const THREADS: u32 = 384;
/// The tile widths (output channels) there are kernels for (their accumulators, half the width a
/// thread, are what limits them).
const WIDTHS: [usize; 6] = [32, 64, 96, 128, 160, 192];
/// What a tile costs beyond its width, in output channels' worth: its copies of the input's
/// windows (each column tile of a row tile reads them again) and its start and write-out.
const TILE_COST: usize = 64;

/// The template's hash (a part of what a timed choice between kernels was made for).
pub(crate) fn template_version() -> String {
    crate::nvrtc::checksum(format!("{HOPPER_TMA}{TEMPLATE}").as_bytes())
}

/// The forward `launch` runs for the convolution `kind` of `p` (`x`, `w`, `y` in NCHW order)
/// where the Hopper kernel can run it on `dev` (`as_forward`); `aligned`: every operand's address
/// is 16-byte aligned. None where it cannot.
pub(crate) fn fits(
    dev: &CudaDevice,
    kind: Kind,
    p: &ConvParams,
    shapes: [[usize; 4]; 3],
    aligned: bool,
) -> Option<Forward> {
    if dev.arch != "compute_90" || !aligned {
        return None;
    }
    as_forward(kind, p, shapes)
        .filter(|(q, [x, w, _])| x[1] % 4 == 0 && crate::tensor_maps::im2col_fits(q, *w))
}

/// A forward convolution's geometry and its x, w, y shapes in NCHW order.
pub(crate) type Forward = (ConvParams, [[usize; 4]; 3]);

/// The forward convolution that computes `kind` (its geometry and its x, w, y shapes in NCHW
/// order): the forward itself, or for a data gradient at stride 1 the forward of dy with the
/// flipped filter (C out of K), padded by the window's reach less the forward's padding, which
/// gives back x's size. None for the rest.
fn as_forward(kind: Kind, p: &ConvParams, [x, w, y]: [[usize; 4]; 3]) -> Option<Forward> {
    match kind {
        Kind::Forward => Some((*p, [x, w, y])),
        Kind::GradInput if p.stride == [1, 1] => {
            let mut q = *p;
            for i in 0..2 {
                q.padding[i] = ((w[2 + i] - 1) * p.dilation[i]).checked_sub(p.padding[i])?;
            }
            Some((q, [y, [w[1], w[0], w[2], w[3]], x]))
        }
        _ => None,
    }
}

/// The launch's sizes, by value (`WgmmaGeo` in the `.cu` file).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct WgmmaGeo {
    p: i32,
    q: i32,
    sh: i32,
    sw: i32,
    ph: i32,
    pw: i32,
    dh: i32,
    dw: i32,
    s: i32,
    m: i32,
    n: i32,
    cblocks: i32,
    ktiles: i32,
}

/// Runs the convolution `kind` as the forward `fits` gave for it (`fwd`) on the operands `a` and
/// `b` (the prim's inputs in its order, channels-last: x and w, or dy and w; the filter packed,
/// the other's pixels where `a` says) into `out`.
pub(crate) fn launch(
    dev: &Arc<CudaDevice>,
    kind: Kind,
    (p, [x, w, y]): Forward,
    a: Pixels,
    b: u64,
    out: u64,
) -> Result<()> {
    let i = |v: usize| v as i32;
    let spec = Spec::for_filter(w);
    let loaded = crate::conv_modules::load(dev, spec)?;
    // the data gradient's filter, flipped; dropped once the convolution is queued (the pool
    // orders its reuse on the stream)
    let flipped = match kind {
        // the prim's filter: K x C, where the forward's is C x K
        Kind::GradInput => Some(flip_filter(
            dev,
            loaded.helper,
            [w[1], w[0], w[2], w[3]],
            b,
        )?),
        _ => None,
    };
    let filter = flipped.as_ref().map_or(b, |f| f.ptr);
    let xmap = crate::tensor_maps::im2col(dev, &p, x, w, a.ptr, a.row(x[1]), BM)?;
    // the filter (KRSC) in boxes of BK channels of `bn` output channels at one tap
    let [k, c, r, s] = w.map(|d| d as u64);
    let boxes = [BK as u32, 1, 1, spec.bn as u32];
    let wmap = crate::tensor_maps::tiled(dev, filter, [c, s, r, k], boxes)?;
    let m = y[0] * y[2] * y[3];
    let cblocks = x[1].div_ceil(BK);
    let g = WgmmaGeo {
        p: i(y[2]),
        q: i(y[3]),
        sh: i(p.stride[0]),
        sw: i(p.stride[1]),
        ph: i(p.padding[0]),
        pw: i(p.padding[1]),
        dh: i(p.dilation[0]),
        dw: i(p.dilation[1]),
        s: i(w[3]),
        m: i(m),
        n: i(w[0]),
        cblocks: i(cblocks),
        ktiles: i(cblocks * w[2] * w[3]),
    };
    // persistent: as many blocks as the device holds at once, each taking output tiles in turn
    let tiles = m.div_ceil(BM) * w[0].div_ceil(spec.bn);
    let blocks = tiles.min(dev.sm_count as usize * loaded.resident);
    launch_with_maps(
        dev,
        &spec,
        &loaded,
        [blocks as u32, 1, 1],
        [xmap, wmap],
        out,
        g,
    )?;
    drop(flipped);
    Ok(())
}

/// Queues `spec`'s kernel (loaded as `loaded`) on `grid` with the parameters both Hopper
/// families take: two tensor maps, the output's address and the launch's geometry (`G`, the
/// `.cu` file's struct, by value).
pub(crate) fn launch_with_maps<K: ConvKernel, G>(
    dev: &CudaDevice,
    spec: &K,
    loaded: &crate::conv_modules::Loaded,
    grid: [u32; 3],
    maps: [sys::CUtensorMap; 2],
    out: u64,
    geo: G,
) -> Result<()> {
    let ([mut a, mut b], mut out, mut geo) = (maps, out, geo);
    let mut params: [*mut c_void; 4] = [
        (&mut a as *mut sys::CUtensorMap).cast(),
        (&mut b as *mut sys::CUtensorMap).cast(),
        (&mut out as *mut u64).cast(),
        (&mut geo as *mut G).cast(),
    ];
    dev.launch_grid(
        loaded.kernel,
        grid,
        spec.threads(),
        spec.shared_bytes() as u32,
        &mut params,
    )
}

/// Loads the kernel `launch` would run the forward `fwd` on, without running it.
pub(crate) fn prepare(dev: &Arc<CudaDevice>, (_, [_, w, _]): Forward) -> Result<()> {
    crate::conv_modules::load(dev, Spec::for_filter(w)).map(drop)
}

/// The filter `w` (KRSC at `wp`; its shape in NCHW order) flipped in space with its channel
/// axes swapped (CRSK), by the module's `conv_flip_filter`.
fn flip_filter(
    dev: &Arc<CudaDevice>,
    f: sys::CUfunction,
    w: [usize; 4],
    wp: u64,
) -> Result<crate::buffer::CudaBuffer> {
    let total = w.iter().product::<usize>();
    let flipped = dev.alloc(total, DType::F32)?;
    let (mut src, mut dst) = (wp, flipped.ptr);
    let [mut k, mut c, mut r, mut s] = w.map(|d| d as i32);
    let mut params: [*mut c_void; 6] = [
        (&mut src as *mut u64).cast(),
        (&mut dst as *mut u64).cast(),
        (&mut k as *mut i32).cast(),
        (&mut r as *mut i32).cast(),
        (&mut s as *mut i32).cast(),
        (&mut c as *mut i32).cast(),
    ];
    let blocks = total.div_ceil(256).min(4096) as u32;
    dev.launch(f, blocks, 256, 0, &mut params)?;
    Ok(flipped)
}

/// One kernel of the template: its tile's width in output channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Spec {
    bn: usize,
}

impl Spec {
    /// The kernel for a forward with filter `w` (NCHW order): the width whose tiles cover its
    /// output channels at the least cost (`TILE_COST` a tile beyond its width), the narrower of
    /// two that cost the same. Up to 192 channels that is the narrowest width covering them in
    /// one tile; past it, 320 channels take two tiles of 160 (not three of 128), 768 four of 192.
    fn for_filter(w: [usize; 4]) -> Spec {
        let cost = |bn: usize| w[0].div_ceil(bn) * (bn + TILE_COST);
        let bn = WIDTHS
            .into_iter()
            .min_by_key(|&bn| (cost(bn), bn))
            .unwrap_or(WIDTHS[0]);
        Spec { bn }
    }
}

impl ConvKernel for Spec {
    const FAMILY: &'static str = "conv_wgmma";

    fn code(&self) -> u32 {
        self.bn as u32
    }

    fn name(&self) -> String {
        format!("conv_wgmma_n{}", self.bn)
    }

    /// STAGES tiles of each operand, room to align them to 1024 bytes, and two barriers a stage.
    fn shared_bytes(&self) -> usize {
        STAGES * (BM + self.bn) * BK * 4 + 1024 + 2 * STAGES * 8
    }

    fn threads(&self) -> u32 {
        THREADS
    }

    fn source(&self) -> String {
        let kernel = format!("CONV_WGMMA_KERNEL({}, {}, {STAGES})", self.name(), self.bn);
        hopper_module(TEMPLATE, &[&wgmma_tile(self.bn, OperandA::Shared), &kernel])
    }

    fn helper(&self) -> Option<&'static str> {
        Some("conv_flip_filter")
    }

    fn siblings(_: &CudaDevice) -> Vec<Self> {
        WIDTHS.map(|bn| Spec { bn }).to_vec()
    }
}

/// A Hopper module's text: built for the arch-specific target (`nvrtc::ARCH_SPECIFIC`: wgmma is
/// an sm_90a instruction), Hopper's building blocks (`HOPPER_TMA`), the kernel's `template`,
/// then `parts` (its MMA's text, helpers, the line instantiating it), a line each.
pub(crate) fn hopper_module(template: &str, parts: &[&str]) -> String {
    let mut s = format!("{}{HOPPER_TMA}{template}", crate::nvrtc::ARCH_SPECIFIC);
    for part in parts {
        s.push('\n');
        s.push_str(part);
    }
    s.push('\n');
    s
}

/// Where the MMA's A operand comes from: shared memory (a descriptor, as B's) or registers (four
/// TF32 values a thread, `conv_wgmma_wgrad.cu`'s transposed operand).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OperandA {
    Shared,
    Registers,
}

/// The MMA of a k step of 8 for a tile `bn` wide (`wgmma_tile<bn>`, or `wgmma_tile_ra<bn>` with A
/// from registers): its accumulators (bn / 2 a thread) are listed in the instruction, so each
/// width has its own text.
pub(crate) fn wgmma_tile(bn: usize, a_from: OperandA) -> String {
    let regs = bn / 2;
    let numbered = |range: std::ops::Range<usize>| {
        range
            .map(|i| format!("%{i}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    let list = numbered(0..regs);
    let outs = (0..regs)
        .map(|i| format!("\"+f\"(d[{i}])"))
        .collect::<Vec<_>>()
        .join(", ");
    // the asm's operands: the accumulators, then a (one or four), b and the constant 1 scale-d
    // is set from
    let (name, a_param, a_text, a_ins, a_count) = match a_from {
        OperandA::Shared => (
            "wgmma_tile",
            "unsigned long long a",
            format!("%{regs}"),
            "\"l\"(a)".to_string(),
            1,
        ),
        OperandA::Registers => (
            "wgmma_tile_ra",
            "const unsigned* a",
            format!("{{{}}}", numbered(regs..regs + 4)),
            (0..4)
                .map(|i| format!("\"r\"(a[{i}])"))
                .collect::<Vec<_>>()
                .join(", "),
            4,
        ),
    };
    let (b, one) = (regs + a_count, regs + a_count + 1);
    let head = format!(
        "template <> __device__ __forceinline__ void {name}<{bn}>(float* d, {a_param}, \
         unsigned long long b) {{\n"
    );
    let ptx = format!(
        "  asm volatile(\"{{\\n.reg .pred acc;\\nsetp.ne.b32 acc, %{one}, 0;\\n\"\n    \
         \"wgmma.mma_async.sync.aligned.m64n{bn}k8.f32.tf32.tf32 {{{list}}}, {a_text}, %{b}, \
         acc, 1, 1;\\n}}\\n\"\n"
    );
    format!("{head}{ptx}    : {outs}\n    : {a_ins}, \"l\"(b), \"r\"(1));\n}}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(stride: usize, padding: [usize; 2], dilation: [usize; 2]) -> ConvParams {
        ConvParams {
            stride: [stride; 2],
            padding,
            dilation,
            groups: 1,
            channels_last: true,
        }
    }

    /// The size of a convolution's output along one axis; None where the window does not fit.
    fn out(size: usize, pad: usize, reach: usize, stride: usize) -> Option<usize> {
        Some((size + 2 * pad).checked_sub(reach + 1)? / stride + 1)
    }

    /// A forward is itself; a stride-1 data gradient is the forward of dy (K channels) with a
    /// C x K filter whose padding gives back x's size on both axes, for every kernel size,
    /// dilation and padding up to the window's reach; a strided one, or one padded past the
    /// reach, is not one.
    #[test]
    fn a_data_gradient_at_stride_1_is_a_forward_of_the_output_gradient() {
        let x = [2, 12, 9, 7];
        for (r, s) in [(1, 1), (3, 3), (5, 3), (1, 7)] {
            for dil in [[1, 1], [2, 1], [1, 3]] {
                let reach = [(r - 1) * dil[0], (s - 1) * dil[1]];
                for ph in 0..=reach[0] {
                    for pw in 0..=reach[1] {
                        let p = params(1, [ph, pw], dil);
                        let (h, w) = (x[2], x[3]);
                        let (Some(oh), Some(ow)) =
                            (out(h, ph, reach[0], 1), out(w, pw, reach[1], 1))
                        else {
                            continue;
                        };
                        let y = [2, 20, oh, ow];
                        let shapes = [x, [20, 12, r, s], y];
                        let (f, [fx, fw, fy]) = as_forward(Kind::Forward, &p, shapes).unwrap();
                        assert_eq!((f, [fx, fw, fy]), (p, shapes));
                        let (q, [dx, dw, dy]) = as_forward(Kind::GradInput, &p, shapes).unwrap();
                        assert_eq!((dx, dw, dy), (y, [12, 20, r, s], x));
                        assert_eq!((q.stride, q.dilation), ([1, 1], dil));
                        // the forward's output is x again
                        let back = [0, 1].map(|i| out(dx[2 + i], q.padding[i], reach[i], 1));
                        assert_eq!(back, [Some(h), Some(w)], "{p:?} {r}x{s}");
                    }
                }
                if reach[0] > 0 {
                    let p = params(1, [reach[0] + 1, 0], dil);
                    assert!(as_forward(Kind::GradInput, &p, [x, [20, 12, r, s], x]).is_none());
                }
            }
        }
        let strided = params(2, [1, 1], [1, 1]);
        let shapes = [x, [20, 12, 3, 3], [2, 20, 5, 4]];
        assert!(as_forward(Kind::GradInput, &strided, shapes).is_none());
        assert!(as_forward(Kind::GradWeight, &params(1, [1, 1], [1, 1]), shapes).is_none());
    }

    /// Each width's MMA lists its accumulators once, in order, and the operands after them; the
    /// kernels' shared memory fits a Hopper multiprocessor (227 KiB).
    #[test]
    fn each_width_lists_its_accumulators() {
        for spec in WIDTHS.map(|bn| Spec { bn }) {
            let text = wgmma_tile(spec.bn, OperandA::Shared);
            let regs = spec.bn / 2;
            assert!(text.contains(&format!("m64n{}k8", spec.bn)));
            assert!(text.contains(&format!("\"+f\"(d[{}])", regs - 1)));
            assert!(!text.contains(&format!("d[{regs}]")));
            assert!(text.contains(&format!("%{}, %{}, acc", regs, regs + 1)));
            assert!(text.contains(&format!("setp.ne.b32 acc, %{}, 0", regs + 2)));
            assert!(spec.shared_bytes() <= 227 << 10, "{spec:?}");
            let src = spec.source();
            assert!(src.starts_with(crate::nvrtc::ARCH_SPECIFIC));
            assert!(src.contains(&format!("CONV_WGMMA_KERNEL({}, ", spec.name())));
        }
    }

    /// Up to the widest kernel, a convolution takes the narrowest width that covers its output
    /// channels in one tile; past it, the widths that cover them in the fewest tiles for the
    /// least waste.
    #[test]
    fn output_channels_choose_the_tile_width() {
        let width = |k: usize| Spec::for_filter([k, 8, 3, 3]).bn;
        for k in 1..=192 {
            let narrowest = WIDTHS.into_iter().find(|&bn| k <= bn).unwrap();
            assert_eq!(width(k), narrowest, "{k} channels");
        }
        let wide = [
            (200, 128),
            (256, 128),
            (320, 160),
            (512, 128),
            (640, 160),
            (768, 192),
        ];
        for (k, bn) in wide {
            assert_eq!(width(k), bn, "{k} channels");
        }
        assert_eq!(width(1024), 128);
    }
}
