//! Hopper's generated weight gradient (the template `kernels/conv_wgmma_wgrad.cu`): per tap, a
//! GEMM over the output's pixels whose operands the tensor memory accelerator copies (x's windows
//! by the im2col map, dy's rows as boxes) and the warpgroup MMA multiplies, x from registers and
//! dy transposed in shared memory (TF32 wgmma reads shared operands only along the summed axis,
//! and both run along their channels). The long sum over N·P·Q is split across blocks enough to
//! fill the device twice over, and the splits' partial sums added in a fixed order
//! (`conv_split_sum`): the same inputs give the same bits.
//!
//! What it takes (`fits`): compute capability 9.0, input and output channels multiples of 4 (the
//! tensor maps' rows are 16-byte multiples), operands 16-byte aligned, and the windows the im2col
//! map can walk (`tensor_maps::im2col_fits`). The rest goes to the mma.sync kernel
//! (`conv_igemm.rs`).

use std::sync::Arc;

use kiln_core::prim::ConvParams;
use kiln_core::{DType, Result};

use crate::conv_generated::Pixels;
use crate::conv_modules::{ConvKernel, SPLIT_SUM};
use crate::conv_wgmma::{hopper_module, launch_with_maps, wgmma_tile, OperandA, HOPPER_TMA};
use crate::device::CudaDevice;
use crate::tensor_maps::CHANNELS;

const TEMPLATE: &str = include_str!("kernels/conv_wgmma_wgrad.cu");

/// Input channels a block's tile covers (two consumer warpgroups of 64: the `.cu` file's WG_BM)
/// and pixels a step of the sum takes (WG_BK).
const BM: usize = 128;
const BK: usize = 32;
/// Steps in flight.
const STAGES: usize = 4;
/// The producer's warpgroup and the two consumers'.
const THREADS: u32 = 384;
/// The tile widths (output channels) there are kernels for: the narrowest that covers the output
/// channels, or the widest in tiles.
const WIDTHS: [usize; 3] = [32, 64, 128];
/// Steps of the sum a split takes at least (fewer would spend more filling the pipeline and on
/// the partial sums than they gain).
const MIN_STEPS_PER_SPLIT: usize = 4;
/// Grids a launch fills the device with, counted in resident blocks: a sum split finer runs
/// better balanced (the prototype's 3x3 56x56 128→32: 396 µs split 16 ways, 144 blocks; 262 µs
/// split 64 ways, 576 blocks), and past two, no better (BENCHMARKS.md: one, two and four waves,
/// with at least 8, 16 or 32 steps a split, all slower over DenseNet-121's step than this).
const WAVES: usize = 2;
/// The partial sums' buffer at most: its trip through memory is paid again by `conv_split_sum`.
const MAX_PARTS_BYTES: usize = 64 << 20;

/// The launch's sizes, by value (`WgradGeo` in the `.cu` file).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct WgradGeo {
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
    m: i32,
    chunk: i32,
    splits: i32,
}

/// The template's hash (a part of what a timed choice between kernels was made for).
pub(crate) fn template_version() -> String {
    crate::nvrtc::checksum(format!("{HOPPER_TMA}{TEMPLATE}{SPLIT_SUM}").as_bytes())
}

/// Whether Hopper's kernel runs the weight gradient of `p` (`x`, `w`, `y` in NCHW order) on
/// `dev`; `aligned`: every operand's address is 16-byte aligned.
pub(crate) fn fits(
    dev: &CudaDevice,
    p: &ConvParams,
    [x, w, _]: [[usize; 4]; 3],
    aligned: bool,
) -> bool {
    dev.arch == "compute_90"
        && aligned
        && x[1] % 4 == 0
        && w[0] % 4 == 0
        && crate::tensor_maps::im2col_fits(p, w)
}

/// Runs the weight gradient of `p` (`x`, `w`, `y` in NCHW order) on dy and x (channels-last,
/// the prim's inputs in its order, their pixels where they say) into `out` (KRSC), where `fits`
/// said it fits.
pub(crate) fn launch(
    dev: &Arc<CudaDevice>,
    p: &ConvParams,
    [x, w, y]: [[usize; 4]; 3],
    dy: Pixels,
    xs: Pixels,
    out: u64,
) -> Result<()> {
    let i = |v: usize| v as i32;
    let spec = Spec::for_filter(w);
    let loaded = crate::conv_modules::load(dev, spec)?;
    let (c, k, taps) = (x[1], w[0], w[2] * w[3]);
    let m = y[0] * y[2] * y[3];
    // blocks a split: input-channel blocks x output-channel blocks x taps
    let tiles = [c.div_ceil(BM), k.div_ceil(spec.bn)];
    let blocks = tiles[0] * tiles[1] * taps;
    let total = k * c * taps;
    let target = WAVES * dev.sm_count as usize * loaded.resident;
    let (splits, chunk) = split(m.div_ceil(BK), blocks, target, total);
    let xmap = crate::tensor_maps::im2col(dev, p, x, w, xs.ptr, xs.row(c), BK)?;
    // dy as [M][K]: boxes of 32 output channels of BK pixels
    let dims = [k as u64, m as u64];
    let boxes = [CHANNELS as u32, BK as u32];
    let dymap = crate::tensor_maps::matrix(dev, dy.ptr, dims, dy.row(k), boxes)?;
    let g = WgradGeo {
        c: i(c),
        k: i(k),
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
        m: i(m),
        chunk: i(chunk * BK),
        splits: i(splits),
    };
    let parts = match splits {
        1 => None,
        _ => Some(dev.alloc(splits * total, DType::F32)?),
    };
    let dst = parts.as_ref().map_or(out, |p| p.ptr);
    let grid = [tiles[0] as u32, tiles[1] as u32, (taps * splits) as u32];
    launch_with_maps(dev, &spec, &loaded, grid, [xmap, dymap], dst, g)?;
    if let Some(parts) = parts {
        crate::conv_modules::sum_splits(dev, loaded.helper, &parts, out, total, splits)?;
    }
    Ok(())
}

/// Loads the kernel `launch` would run the weight gradient with filter `w` on, without running it.
pub(crate) fn prepare(dev: &Arc<CudaDevice>, w: [usize; 4]) -> Result<()> {
    crate::conv_modules::load(dev, Spec::for_filter(w)).map(drop)
}

/// How the sum over `steps` steps of BK pixels splits: (splits, steps a split), for a grid of
/// `blocks` blocks a split, so the launch has about `target` blocks, no split has fewer than
/// MIN_STEPS_PER_SPLIT steps or is empty, and the partial sums of `total` values each stay
/// within MAX_PARTS_BYTES.
fn split(steps: usize, blocks: usize, target: usize, total: usize) -> (usize, usize) {
    let most = (MAX_PARTS_BYTES / (4 * total.max(1))).max(1);
    let want = target
        .div_ceil(blocks.max(1))
        .min(steps / MIN_STEPS_PER_SPLIT)
        .min(most)
        .max(1);
    let per_split = steps.div_ceil(want).max(1);
    (steps.div_ceil(per_split).max(1), per_split)
}

/// One kernel of the template: its tile's width in output channels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Spec {
    bn: usize,
}

impl Spec {
    /// The kernel for a weight gradient with filter `w` (NCHW order): the narrowest width that
    /// covers its output channels, else the widest.
    fn for_filter(w: [usize; 4]) -> Spec {
        let widest = WIDTHS[WIDTHS.len() - 1];
        Spec {
            bn: WIDTHS.into_iter().find(|&bn| w[0] <= bn).unwrap_or(widest),
        }
    }
}

impl ConvKernel for Spec {
    const FAMILY: &'static str = "conv_wgmma_wgrad";

    fn code(&self) -> u32 {
        self.bn as u32
    }

    fn name(&self) -> String {
        format!("conv_wgmma_wgrad_n{}", self.bn)
    }

    /// STAGES steps of each operand, dy's two transposed copies, room to align them to 1024
    /// bytes, and two barriers a stage.
    fn shared_bytes(&self) -> usize {
        (STAGES * (BM + self.bn) + 2 * self.bn) * BK * 4 + 1024 + 2 * STAGES * 8
    }

    fn threads(&self) -> u32 {
        THREADS
    }

    fn source(&self) -> String {
        let kernel = format!("CONV_WGRAD_KERNEL({}, {}, {STAGES})", self.name(), self.bn);
        let mma = wgmma_tile(self.bn, OperandA::Registers);
        hopper_module(TEMPLATE, &[&mma, SPLIT_SUM, &kernel])
    }

    fn helper(&self) -> Option<&'static str> {
        Some("conv_split_sum")
    }

    fn siblings(_: &CudaDevice) -> Vec<Self> {
        WIDTHS.map(|bn| Spec { bn }).to_vec()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sum splits into about `target` blocks' worth of parts, never into parts shorter than
    /// MIN_STEPS_PER_SPLIT steps, never into an empty part, and never past MAX_PARTS_BYTES of
    /// partial sums; every step is in exactly one part.
    #[test]
    fn sums_split_to_fill_the_device_within_bounds() {
        // DenseNet-121's 3x3 56x56 128->32 at batch 64: 6272 steps, 9 taps a split
        let (parts, per) = split(6272, 9, 264, 32 * 128 * 9);
        assert_eq!((parts, per), (30, 210));
        // a short sum: parts of MIN_STEPS_PER_SPLIT steps
        assert_eq!(split(98, 9, 528, 32 * 128 * 9), (20, 5));
        assert_eq!(split(3, 9, 528, 100), (1, 3));
        // a grid that fills the device alone is not split
        assert_eq!(split(1000, 600, 528, 100), (1, 1000));
        // a large filter: the partial sums' bytes bound the parts
        let total = 1024 * 512;
        let (parts, _) = split(392, 32, 10_000, total);
        assert!(
            parts * total * 4 <= MAX_PARTS_BYTES && parts > 16,
            "{parts}"
        );
        for steps in [1, 2, 7, 31, 100, 4097] {
            for blocks in [1, 9, 32, 300] {
                let (parts, per) = split(steps, blocks, 264, 4096);
                assert!(parts >= 1 && per >= 1);
                assert!(parts == 1 || per >= MIN_STEPS_PER_SPLIT, "{steps} {blocks}");
                // every part has a step, and the parts cover the sum
                assert!((parts - 1) * per < steps && parts * per >= steps);
            }
        }
    }

    /// Each width's module instantiates its kernel with the register-A MMA, and its shared
    /// memory fits a Hopper multiprocessor (227 KiB).
    #[test]
    fn each_width_fits_a_multiprocessor() {
        for spec in WIDTHS.map(|bn| Spec { bn }) {
            let src = spec.source();
            assert!(src.starts_with(crate::nvrtc::ARCH_SPECIFIC));
            assert!(src.contains(&format!("CONV_WGRAD_KERNEL({}, ", spec.name())));
            assert!(src.contains(&format!("wgmma_tile_ra<{}>", spec.bn)));
            assert!(src.contains("conv_split_sum"));
            assert!(spec.shared_bytes() <= 227 << 10, "{spec:?}");
        }
        assert_eq!(Spec::for_filter([32, 8, 3, 3]).bn, 32);
        assert_eq!(Spec::for_filter([40, 8, 3, 3]).bn, 64);
        assert_eq!(Spec::for_filter([512, 8, 1, 1]).bn, 128);
    }
}
