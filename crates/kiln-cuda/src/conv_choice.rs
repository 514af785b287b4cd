//! max-autotune's choice, per convolution, between cuDNN's plan and kiln's generated kernel
//! (`conv_generated.rs`): both timed on the call's own operands with a cold L2
//! (`event::time_cold`), the faster kept for the process and on disk, so the next process does
//! not time again.
//!
//! Where the generated kernels win is narrow but real: weight gradients of small feature maps
//! (DenseNet-121's 3x3 convolutions at 7x7 and 14x14: a third and two thirds of cuDNN's time),
//! where cuDNN's plans split the long sum less well. Elsewhere cuDNN's Hopper kernels win and
//! keep the convolution.
//!
//! An entry lives under `<kiln cache>/conv_choice/<key>` with a checksum beside it (written as
//! the NVRTC cache's entries are); the key hashes the convolution's plan spec, the device and the
//! generated kernels' template, so a changed template decides again.

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use kiln_core::Result;

use crate::device::CudaDevice;

static DECIDED: AtomicUsize = AtomicUsize::new(0);
static GENERATED: AtomicUsize = AtomicUsize::new(0);
static DISK_HITS: AtomicUsize = AtomicUsize::new(0);

/// Convolutions max-autotune decided in this process (timed or read from disk), those that went
/// to the generated kernel, and those read from disk.
pub fn conv_engine_choices() -> (usize, usize, usize) {
    (
        DECIDED.load(Ordering::Relaxed),
        GENERATED.load(Ordering::Relaxed),
        DISK_HITS.load(Ordering::Relaxed),
    )
}

/// Timed runs of each side, after one untimed run (which loads its kernels).
const TIMED_REPS: usize = 3;

/// Whether the generated kernel runs the convolution `spec` (its plan spec, in words) rather
/// than cuDNN's plan: `plan` and `generated` each run it once on the call's operands.
pub(crate) fn generated_wins(
    dev: &Arc<CudaDevice>,
    spec: &str,
    plan: &mut dyn FnMut() -> Result<()>,
    generated: &mut dyn FnMut() -> Result<()>,
) -> Result<bool> {
    let (path, sum_path) = entry(dev, spec);
    let stored = crate::nvrtc::read_verified(&path, &sum_path);
    let chosen = match stored.as_deref() {
        Some(b"generated") => Some(true),
        Some(b"cudnn") => Some(false),
        _ => None,
    };
    let chosen = match chosen {
        Some(g) => {
            DISK_HITS.fetch_add(1, Ordering::Relaxed);
            g
        }
        None => {
            plan()?;
            generated()?;
            let t_plan = crate::event::time_cold(dev, TIMED_REPS, plan)?;
            let t_generated = crate::event::time_cold(dev, TIMED_REPS, generated)?;
            let g = t_generated < t_plan;
            let word: &[u8] = if g { b"generated" } else { b"cudnn" };
            // a folder that cannot be written only costs the next process the timing
            let _ = crate::nvrtc::store(&path, &sum_path, word);
            g
        }
    };
    DECIDED.fetch_add(1, Ordering::Relaxed);
    if chosen {
        GENERATED.fetch_add(1, Ordering::Relaxed);
    }
    Ok(chosen)
}

fn entry(dev: &CudaDevice, spec: &str) -> (PathBuf, PathBuf) {
    let key = crate::nvrtc::checksum(
        format!(
            "{spec}|{} {}|{}",
            dev.name,
            dev.arch,
            crate::conv_generated::template_version()
        )
        .as_bytes(),
    );
    let dir = kiln_core::cache::cache_root().join("conv_choice");
    (dir.join(&key), dir.join(format!("{key}.xxh3")))
}
