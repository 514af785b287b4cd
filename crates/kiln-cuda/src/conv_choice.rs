//! Choices between cuDNN and kiln's generated convolutions (`conv_generated.rs`), each timed once
//! with a cold L2 (`event::time_cold`) and kept for the process and on disk, so the next process
//! does not time again:
//! - max-autotune's, per convolution (`generated_wins`): both on the call's own operands, the
//!   faster kept;
//! - the default's, per compiled function (`function_choice`): all of a function's convolutions
//!   on one engine, since a warm start pays for each engine it loads.
//!
//! Where the generated kernels win is narrow but real: weight gradients of small feature maps
//! (DenseNet-121's 3x3 convolutions at 7x7 and 14x14: a third and two thirds of cuDNN's time),
//! where cuDNN's plans split the long sum less well. Elsewhere cuDNN's Hopper kernels win and
//! keep the convolution.
//!
//! A function's choice: a warm start in a new process pays for cuDNN in each convolution's plan
//! read back and, at its first execution, in the engine kernels CUDA loads lazily from cuDNN's
//! libraries (DenseNet-121's training step, 197 distinct convolutions: ~120 ms, where its step
//! runs 33 ms; kiln's kernels load with its own modules). Where a function has enough distinct
//! convolutions for that to weigh (`MIN_DISTINCT`), its convolutions are timed on both engines,
//! weighted by how often it runs each, and kiln's kernels take them all if they run them within
//! `SLACK` of cuDNN's time: DenseNet-121's (0-5% longer on the H200), not ResNet-18's (twice as
//! long; its 32 distinct convolutions are not timed at all).
//!
//! An entry lives under `<kiln cache>/conv_choice/<key>` with a checksum beside it (written as
//! the NVRTC cache's entries are); the key hashes the convolution's plan spec (a function's: its
//! convolutions and their counts), the device and the generated kernels' template, so a changed
//! template decides again.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kiln_core::device::{ConvUse, Route};
use kiln_core::{profiler, Result, Tensor};

use crate::conv_generated::ConvEngine;
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
    let entry = entry(dev, spec);
    let chosen = match read_choice(&entry) {
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
            store_choice(&entry, g);
            g
        }
    };
    DECIDED.fetch_add(1, Ordering::Relaxed);
    if chosen {
        GENERATED.fetch_add(1, Ordering::Relaxed);
    }
    Ok(chosen)
}

/// A choice read from its entry (`entry`): `true` for kiln's kernels; `None` where there is none,
/// or it does not read back whole.
fn read_choice((path, sum_path): &(PathBuf, PathBuf)) -> Option<bool> {
    match crate::nvrtc::read_verified(path, sum_path).as_deref() {
        Some(b"generated") => Some(true),
        Some(b"cudnn") => Some(false),
        _ => None,
    }
}

/// Writes a choice to its entry; a folder that cannot be written only costs the next process the
/// timing.
fn store_choice((path, sum_path): &(PathBuf, PathBuf), generated: bool) {
    let word: &[u8] = if generated { b"generated" } else { b"cudnn" };
    let _ = crate::nvrtc::store(path, sum_path, word);
}

/// Where the choice for `spec` lives (a path and its checksum's).
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

/// The fewest distinct convolutions kiln's kernels can take for a compiled function's choice to
/// time them: below it cuDNN's part of a warm start is a few milliseconds (ResNet-18's training
/// step: 32, inference: 11; the whole warm start 4-11 ms on the H200), and a cold compile would
/// spend more building kiln's kernels to time them (ResNet-18 inference's: 0.6 → 1.9 s) than a
/// warm start could win.
const MIN_DISTINCT: usize = 64;

/// How much longer than cuDNN's kiln's kernels may take over a function's convolutions, timed
/// one by one, and still take them. The timing leaves out what a step spends around them: an
/// operand that is a channel slice (DenseNet-121's concatenations) is copied for cuDNN and read in
/// place by kiln's kernels. On the H200, DenseNet-121's convolutions timed 0-5% longer on kiln's
/// kernels in four cold compiles, where its whole training step took the same time on either
/// engine (33.0-33.2 against 32.8-32.9 ms) and its warm start a third as long (46-48 against
/// 167-174 ms medians).
const SLACK: f64 = 1.10;

/// Functions decided in this process, by cache scope and entry: kiln's kernels or not. Beside
/// the disk's entries: a cache folder that cannot be written would otherwise have every compile
/// of the function time its convolutions again.
static FUNCTIONS: Mutex<Option<HashMap<String, bool>>> = Mutex::new(None);
static FUNCTIONS_TIMED: AtomicUsize = AtomicUsize::new(0);
static FUNCTIONS_GENERATED: AtomicUsize = AtomicUsize::new(0);
static FUNCTIONS_FROM_DISK: AtomicUsize = AtomicUsize::new(0);
/// The last timed function's distinct convolutions and milliseconds over it on cuDNN and on
/// kiln's kernels.
static LAST_TIMING: Mutex<Option<(usize, f64, f64)>> = Mutex::new(None);

/// Compiled functions' choices in this process (`function_choice`): those timed, those that
/// took kiln's kernels (timed or read back), and those read from disk.
pub fn function_choices() -> (usize, usize, usize) {
    (
        FUNCTIONS_TIMED.load(Ordering::Relaxed),
        FUNCTIONS_GENERATED.load(Ordering::Relaxed),
        FUNCTIONS_FROM_DISK.load(Ordering::Relaxed),
    )
}

/// The last function this process timed (`function_choice`): its distinct convolutions kiln's
/// kernels can take, and milliseconds over the function on cuDNN and on kiln's kernels.
pub fn last_function_timing() -> Option<(usize, f64, f64)> {
    *LAST_TIMING.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether a compiled function whose convolutions are `convs` runs them on kiln's generated
/// kernels (`Route::Generated`): what `ConvEngine` forces, else (`Auto`) what was decided for
/// the same convolutions before (in this process, or on disk), else decided now by timing each
/// convolution kiln's kernels can take on both engines (the module doc).
pub(crate) fn function_choice(dev: &Arc<CudaDevice>, convs: &[&ConvUse]) -> Result<bool> {
    match crate::conv_generated::conv_engine() {
        ConvEngine::Generated => return Ok(true),
        ConvEngine::Cudnn => return Ok(false),
        ConvEngine::Auto => {}
    }
    let takes: Vec<&ConvUse> = convs
        .iter()
        .copied()
        .filter(|c| crate::conv::generated_can_take(&c.prim, &c.shapes(), &c.dtypes()))
        .collect();
    if takes.len() < MIN_DISTINCT {
        return Ok(false);
    }
    let mut lines: Vec<String> = takes
        .iter()
        .map(|c| format!("{:?} {:?} x{}", c.prim, c.operands, c.count))
        .collect();
    lines.sort();
    let spec = format!("function\n{}", lines.join("\n"));
    let entry = entry(dev, &spec);
    // a cache scope of its own (a cold-compile measurement's) reads the disk as a new process
    let key = format!(
        "{} {}",
        kiln_core::cache::scope_id(),
        entry.0.to_string_lossy()
    );
    let memo = || FUNCTIONS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&g) = memo().get_or_insert_with(HashMap::new).get(&key) {
        return Ok(g);
    }
    let chosen = match read_choice(&entry) {
        Some(g) => {
            FUNCTIONS_FROM_DISK.fetch_add(1, Ordering::Relaxed);
            g
        }
        None => {
            let (cudnn, generated) = {
                let _span = profiler::span(profiler::Category::Compile, || {
                    format!(
                        "cuda: {} convolutions timed on cuDNN and kiln's kernels (the \
                         function's engine)",
                        takes.len()
                    )
                    .into()
                });
                time_both(dev, &takes)?
            };
            let g = generated <= SLACK * cudnn;
            *LAST_TIMING.lock().unwrap_or_else(|e| e.into_inner()) =
                Some((takes.len(), cudnn, generated));
            FUNCTIONS_TIMED.fetch_add(1, Ordering::Relaxed);
            store_choice(&entry, g);
            g
        }
    };
    if chosen {
        FUNCTIONS_GENERATED.fetch_add(1, Ordering::Relaxed);
    }
    memo().get_or_insert_with(HashMap::new).insert(key, chosen);
    Ok(chosen)
}

/// `convs` on cuDNN and on kiln's kernels, each on zeros of its operands' shapes: milliseconds
/// over the function (each convolution's best time by its count), cuDNN's then kiln's. A
/// convolution cuDNN cannot run is left out of both.
fn time_both(dev: &Arc<CudaDevice>, convs: &[&ConvUse]) -> Result<(f64, f64)> {
    let device = kiln_core::Device::Cuda(dev.ordinal);
    let (mut cudnn, mut generated) = (0.0, 0.0);
    for c in convs {
        let operands = c.zeros_on(device)?;
        let refs: Vec<&Tensor> = operands.iter().collect();
        let meta = c.prim.infer(&c.shapes(), &c.dtypes())?;
        let on = |route: Route| -> Result<bool> {
            Ok(crate::conv::run(dev, &c.prim, &refs, &meta, route)?.is_some())
        };
        // one untimed run each: plans made, kernels loaded or built
        if !(on(Route::Eager)? && on(Route::Generated)?) {
            continue;
        }
        let time = |route: Route| crate::event::time_cold(dev, 1, &mut || on(route).map(drop));
        // the best of runs taken in turns: a cold compile times these beside threads that load
        // modules, and a launch held up by the driver's lock would count as the engine's time
        // (cuDNN's, which launches more from the host, the more)
        let (mut t_cudnn, mut t_generated) = (f32::MAX, f32::MAX);
        for _ in 0..TIMED_REPS {
            t_cudnn = t_cudnn.min(time(Route::Eager)?);
            t_generated = t_generated.min(time(Route::Generated)?);
        }
        cudnn += t_cudnn as f64 * c.count as f64;
        generated += t_generated as f64 * c.count as f64;
    }
    Ok((cudnn, generated))
}
