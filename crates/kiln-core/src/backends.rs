//! Process-wide switches that change what a device computes, as PyTorch's `torch.backends`
//! holds them: TF32 for f32 matmuls (`torch.backends.cuda.matmul.allow_tf32`, off by default),
//! TF32 for cuDNN's convolutions (`torch.backends.cudnn.allow_tf32`, on by default) and cuDNN's
//! benchmark mode (`torch.backends.cudnn.benchmark`, off), and kiln's own: which engine runs
//! convolutions (`GeneratedConv` or `CudnnConv` forces one; with neither, a compiled function
//! chooses and eager runs cuDNN). The CUDA runtime reads them at each call
//! (`kiln_cuda::set_allow_tf32` and friends set them here).
//!
//! A compiled function guards on them as Dynamo's global-state guard does (`fingerprint`, in
//! `kiln-compile/src/guards.rs`): a graph recorded for replay (reduce-overhead, max-autotune)
//! holds the kernels the switches chose when it was recorded, so a call after a switch changed
//! compiles anew (or takes the entry compiled under the same switches before).

use std::sync::atomic::{AtomicU64, Ordering};

/// One switch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Switch {
    MatmulTf32,
    CudnnTf32,
    CudnnBenchmark,
    /// Channels-last TF32 convolutions on kiln's generated kernels instead of cuDNN, eager and
    /// compiled (`kiln_cuda::set_conv_engine`; off by default).
    GeneratedConv,
    /// Every convolution on cuDNN, compiled functions' too (`kiln_cuda::set_conv_engine`; off by
    /// default).
    CudnnConv,
}

impl Switch {
    fn bit(self) -> u64 {
        1 << self as u64
    }
}

/// The switches' values, one bit each; cuDNN's TF32 on, as in PyTorch.
static SWITCHES: AtomicU64 = AtomicU64::new(1 << Switch::CudnnTf32 as u64);

pub fn set(switch: Switch, on: bool) {
    match on {
        true => SWITCHES.fetch_or(switch.bit(), Ordering::Relaxed),
        false => SWITCHES.fetch_and(!switch.bit(), Ordering::Relaxed),
    };
}

pub fn get(switch: Switch) -> bool {
    SWITCHES.load(Ordering::Relaxed) & switch.bit() != 0
}

/// All the switches' values: what a compiled function's guards compare.
pub fn fingerprint() -> u64 {
    SWITCHES.load(Ordering::Relaxed)
}

/// `fingerprint`'s switches that are on, in words (for a recompile's reason).
pub fn describe(fingerprint: u64) -> String {
    let on: Vec<String> = [
        Switch::MatmulTf32,
        Switch::CudnnTf32,
        Switch::CudnnBenchmark,
        Switch::GeneratedConv,
        Switch::CudnnConv,
    ]
    .into_iter()
    .filter(|s| fingerprint & s.bit() != 0)
    .map(|s| format!("{s:?}"))
    .collect();
    match on.is_empty() {
        true => "none on".into(),
        false => format!("{} on", on.join(", ")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_set_and_read_back_into_the_fingerprint() {
        let start = fingerprint();
        set(Switch::CudnnBenchmark, true);
        assert!(get(Switch::CudnnBenchmark));
        assert_ne!(fingerprint(), start);
        assert!(describe(fingerprint()).contains("CudnnBenchmark"));
        set(Switch::CudnnBenchmark, false);
        assert_eq!(fingerprint(), start);
    }
}
