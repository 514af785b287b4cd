//! kiln's mma.sync convolutions (the template `kernels/conv_igemm.cu`; a module per kernel, built
//! by NVRTC and kept on disk like every generated kernel): channels-last f32 convolutions with
//! TF32 allowed, forward and both gradients, as implicit GEMMs on tensor cores (`mma.sync`
//! m16n8k8 fed by `cp.async`). The generated convolutions' front (`conv_generated.rs`) sends here
//! what Hopper's kernels (`conv_wgmma.rs`, `conv_wgmma_wgrad.rs`) do not take (channels not a
//! multiple of 4, strided data gradients), and on devices before compute capability 9.0
//! everything.

use std::ffi::c_void;
use std::sync::Arc;

use kiln_core::prim::ConvParams;
use kiln_core::{DType, Result};

use crate::conv::Kind;
use crate::conv_modules::{ConvKernel, SPLIT_SUM};
use crate::device::CudaDevice;

/// The template; each module appends the one kernel it instantiates (`Spec::source`).
const TEMPLATE: &str = include_str!("kernels/conv_igemm.cu");

/// Rows and columns of C a block computes, and its k step (the `.cu` file's tiles).
const BM: usize = 128;
const BK: usize = 16;
/// Tiles in flight (the `.cu` file's STAGES).
const STAGES: usize = 4;
/// k tiles a split of the sum takes at least (fewer would spend more on the partial sums).
const MIN_TILES_PER_SPLIT: usize = 8;
/// Blocks per multiprocessor a launch of fewer blocks than multiprocessors splits its sum for.
const BLOCKS_PER_SM: usize = 4;

/// The convolution's sizes and the GEMM's, passed by value (the layout of `ConvGeo` in the
/// `.cu` file).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct ConvGeo {
    n: i32,
    h: i32,
    w: i32,
    c: i32,
    k: i32,
    r: i32,
    s: i32,
    p: i32,
    q: i32,
    sh: i32,
    sw: i32,
    ph: i32,
    pw: i32,
    dh: i32,
    dw: i32,
    gm: i32,
    gn: i32,
    gk: i32,
    tiles_per_split: i32,
    chunked: i32,
}

/// The template's hash (a part of what a timed choice between kernels was made for).
pub(crate) fn template_version() -> String {
    crate::nvrtc::checksum(format!("{TEMPLATE}{SPLIT_SUM}").as_bytes())
}

/// Runs the convolution `kind` (`x`, `w`, `y` in NCHW order, as cuDNN's names them) on the
/// operands at `a` and `b` (the prim's inputs in its order, contiguous channels-last: x and w,
/// dy and w, or dy and x) into `out`. `aligned`: every address is 16-byte aligned.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch(
    dev: &Arc<CudaDevice>,
    kind: Kind,
    p: &ConvParams,
    [x, w, y]: [[usize; 4]; 3],
    a: u64,
    b: u64,
    out: u64,
    aligned: bool,
) -> Result<()> {
    let i = |v: usize| v as i32;
    let mut g = ConvGeo {
        n: i(x[0]),
        c: i(x[1]),
        h: i(x[2]),
        w: i(x[3]),
        k: i(w[0]),
        r: i(w[2]),
        s: i(w[3]),
        p: i(y[2]),
        q: i(y[3]),
        sh: i(p.stride[0]),
        sw: i(p.stride[1]),
        ph: i(p.padding[0]),
        pw: i(p.padding[1]),
        dh: i(p.dilation[0]),
        dw: i(p.dilation[1]),
        ..ConvGeo::default()
    };
    let (gm, gn, gk) = match kind {
        Kind::Forward => (y[0] * y[2] * y[3], w[0], w[1] * w[2] * w[3]),
        Kind::GradInput => (x[0] * x[2] * x[3], x[1], w[0] * w[2] * w[3]),
        Kind::GradWeight => (w[1] * w[2] * w[3], w[0], y[0] * y[2] * y[3]),
    };
    // a GEMM index's products stay under 2^31: the operands do (`eligible`), and so do the
    // GEMM's sizes, which are their dims' products
    (g.gm, g.gn, g.gk) = (i(gm), i(gn), i(gk));
    let spec = Spec::for_conv(kind, [x, w, y], aligned);
    let bn = spec.bn;
    let (mt, nt) = (gm.div_ceil(BM), gn.div_ceil(bn));
    let ktiles = gk.div_ceil(BK);
    let (splits, per_split) = split(mt * nt, ktiles, dev.sm_count as usize);
    g.tiles_per_split = i(per_split);
    // the forward and data gradient's k in channel blocks of BK (the `.cu` file's
    // `tap_channel`) where the channels they sum over allow
    let channels = match kind {
        Kind::Forward => x[1],
        Kind::GradInput => w[0],
        Kind::GradWeight => 0,
    };
    g.chunked = i32::from(channels > 0 && channels % BK == 0 && w[2] * w[3] > 1);

    let loaded = crate::conv_modules::load(dev, spec)?;
    let (conv, split_sum) = (loaded.kernel, loaded.helper);
    let threads = spec.threads();
    let total = gm * gn;
    let parts = match splits {
        1 => None,
        _ => Some(dev.alloc(splits * total, DType::F32)?),
    };
    // the weight gradient's prim takes (dy, x); its GEMM gathers A from x and B from dy
    let (mut a, mut b) = match kind {
        Kind::GradWeight => (b, a),
        _ => (a, b),
    };
    let mut dst = parts.as_ref().map_or(out, |p| p.ptr);
    let mut params: [*mut c_void; 4] = [
        (&mut g as *mut ConvGeo).cast(),
        (&mut a as *mut u64).cast(),
        (&mut b as *mut u64).cast(),
        (&mut dst as *mut u64).cast(),
    ];
    dev.launch_grid(
        conv,
        [mt as u32, nt as u32, splits as u32],
        threads,
        spec.shared_bytes() as u32,
        &mut params,
    )?;
    if let Some(parts) = parts {
        crate::conv_modules::sum_splits(dev, split_sum, &parts, out, total, splits)?;
    }
    Ok(())
}

/// How a launch of `blocks` blocks splits its sum of `ktiles` k tiles (blockIdx.z), on a device
/// of `sms` multiprocessors: (parts, tiles per part), no part empty. A launch of fewer blocks than
/// multiprocessors (a weight gradient's long sum over the batch) splits into enough parts for
/// `BLOCKS_PER_SM` blocks each, added up by `conv_split_sum`; a grid that fills the device already
/// is not split, since the partial sums' trip through memory costs more than the idle
/// multiprocessors of its last wave (the 1x1 28x28 forward of DenseNet-121: 117 µs split in two,
/// 71 µs whole).
fn split(blocks: usize, ktiles: usize, sms: usize) -> (usize, usize) {
    let parts = match blocks < sms {
        true => (BLOCKS_PER_SM * sms)
            .div_ceil(blocks.max(1))
            .min(ktiles / MIN_TILES_PER_SPLIT)
            .max(1),
        false => 1,
    };
    let per_split = ktiles.div_ceil(parts).max(1);
    (ktiles.div_ceil(per_split).max(1), per_split)
}

/// One kernel of the template: the convolution's kind, four-wide loads or not, the block's
/// columns (32: 4 x 1 warps, 64: 4 x 2, 128: 2 x 4; 128 rows each).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Spec {
    kind: Kind,
    vec4: bool,
    bn: usize,
}

/// Loads the kernel `launch` would run the convolution `kind` on (operands 16-byte aligned, as
/// the allocator's are), without running it.
pub(crate) fn prepare(dev: &Arc<CudaDevice>, kind: Kind, shapes: [[usize; 4]; 3]) -> Result<()> {
    crate::conv_modules::load(dev, Spec::for_conv(kind, shapes, true)).map(drop)
}

impl Spec {
    /// The kernel for the convolution `kind` (`x`, `w`, `y` in NCHW order): four-wide loads
    /// where the channels and addresses allow, the narrowest tile covering the GEMM's columns.
    fn for_conv(kind: Kind, [x, w, _]: [[usize; 4]; 3], aligned: bool) -> Spec {
        let gn = match kind {
            Kind::Forward | Kind::GradWeight => w[0],
            Kind::GradInput => x[1],
        };
        let bn = match gn {
            0..=32 => 32,
            33..=64 => 64,
            _ => 128,
        };
        let vec4 = aligned && x[1] % 4 == 0 && w[0] % 4 == 0;
        Spec { kind, vec4, bn }
    }

    fn all() -> impl Iterator<Item = Spec> {
        [Kind::Forward, Kind::GradInput, Kind::GradWeight]
            .into_iter()
            .flat_map(|kind| {
                [true, false].into_iter().flat_map(move |vec4| {
                    [32, 64, 128]
                        .into_iter()
                        .map(move |bn| Spec { kind, vec4, bn })
                })
            })
    }

    fn warps(&self) -> (usize, usize) {
        match self.bn {
            32 => (4, 1),
            64 => (4, 2),
            _ => (2, 4),
        }
    }
}

impl ConvKernel for Spec {
    const FAMILY: &'static str = "conv_igemm";

    fn code(&self) -> u32 {
        let kind = match self.kind {
            Kind::Forward => 0,
            Kind::GradInput => 1,
            Kind::GradWeight => 2,
        };
        kind << 16 | u32::from(self.vec4) << 12 | self.bn as u32
    }

    fn name(&self) -> String {
        let kind = match self.kind {
            Kind::Forward => "fwd",
            Kind::GradInput => "dgrad",
            Kind::GradWeight => "wgrad",
        };
        format!(
            "conv_{kind}_v{}_n{}",
            if self.vec4 { 4 } else { 1 },
            self.bn
        )
    }

    /// Dynamic shared memory of a block: STAGES buffers of each operand's tile (the `.cu`
    /// file's `Smem`: k-major [rows][BK + 4], row-major [BK][rows + 8]).
    fn shared_bytes(&self) -> usize {
        let words = |k_major: bool, rows: usize| match k_major {
            true => rows * (BK + 4),
            false => BK * (rows + 8),
        };
        let (a_k_major, b_k_major) = match self.kind {
            Kind::Forward => (true, true),
            Kind::GradInput => (true, false),
            Kind::GradWeight => (false, false),
        };
        STAGES * (words(a_k_major, BM) + words(b_k_major, self.bn)) * 4
    }

    fn source(&self) -> String {
        let (a, b, transposed) = match self.kind {
            Kind::Forward => ("FwdA", "FwdB", false),
            Kind::GradInput => ("DgradA", "DgradB", false),
            Kind::GradWeight => ("WgradA", "WgradB", true),
        };
        let (wm, wn) = self.warps();
        format!(
            "{TEMPLATE}\n{SPLIT_SUM}\nCONV_KERNEL({}, {a}, {b}, {}, {BM}, {}, {wm}, {wn}, {transposed})\n",
            self.name(),
            if self.vec4 { 4 } else { 1 },
            self.bn
        )
    }

    fn threads(&self) -> u32 {
        let (wm, wn) = self.warps();
        (wm * wn * 32) as u32
    }

    fn helper(&self) -> Option<&'static str> {
        Some("conv_split_sum")
    }

    fn siblings(_: &CudaDevice) -> Vec<Self> {
        Spec::all().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kernel of the template has a name of its own, a source that instantiates it, and
    /// shared memory for two blocks per multiprocessor (its launch bounds ask for two; Hopper
    /// has 227 KiB a multiprocessor).
    #[test]
    fn kernels_are_named_and_fit_two_blocks_per_multiprocessor() {
        let specs: Vec<Spec> = Spec::all().collect();
        assert_eq!(specs.len(), 18);
        let mut names: Vec<String> = specs.iter().map(Spec::name).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), 18);
        for s in &specs {
            assert!(s.source().contains(&format!("CONV_KERNEL({}, ", s.name())));
            assert!(
                2 * s.shared_bytes() <= 227 << 10,
                "{s:?}: {}",
                s.shared_bytes()
            );
        }
        // four stages of two k-major 128 x (16 + 4) tiles of floats
        let fwd = Spec {
            kind: Kind::Forward,
            vec4: true,
            bn: 128,
        };
        assert_eq!(fwd.shared_bytes(), 80 << 10);
    }

    /// A grid that fills the device is one part; a short one is split into parts of at least
    /// `MIN_TILES_PER_SPLIT` tiles, none empty, covering every tile.
    #[test]
    fn sums_split_only_for_grids_short_of_the_device() {
        assert_eq!(split(392, 20, 132), (1, 20));
        // DenseNet-121's stem weight gradient: 2 blocks, 50176 tiles; 264 parts asked for, 191
        // tiles each, so 263 parts
        let (parts, per) = split(2, 50176, 132);
        assert_eq!((parts, per), (263, 191));
        assert!(per * parts >= 50176 && per * (parts - 1) < 50176);
        // too few tiles to split further
        assert_eq!(split(4, 20, 132), (2, 10));
        assert_eq!(split(4, 7, 132), (1, 7));
        for (blocks, ktiles) in [(1, 1), (3, 100), (131, 4096), (1, 0)] {
            let (parts, per) = split(blocks, ktiles, 132);
            assert!(parts >= 1 && per >= 1);
            assert!(per * parts >= ktiles && per * (parts - 1) < ktiles.max(1));
        }
    }
}
