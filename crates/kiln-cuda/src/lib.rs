//! kiln-cuda: the CUDA runtime behind `Device::Cuda(n)`.
//!
//! `init()` registers it with kiln-core (`kiln_core::device::register_runtime`); from then on
//! `tensor.to(Device::Cuda(0))` copies to the GPU and every prim on GPU tensors runs here, queued in
//! order on one stream per device: generated CUDA C compiled by NVRTC (`kernels/`, cached by
//! `nvrtc.rs`), cuBLAS for matmul (`matmul.rs`), and the host path for the prims that have no kernel
//! yet (`fallback.rs`). Memory comes from a caching allocator (`alloc.rs`).
//!
//! Nothing here needs CUDA to build: the libraries are opened at run time, after `probe.rs` has
//! checked they exist, so a machine without CUDA gets an `Err` that says what is missing and where
//! kiln looked, never a panic.

mod alloc;
mod buffer;
mod capture;
mod conv;
mod conv_choice;
mod conv_generated;
mod conv_graph;
mod conv_igemm;
mod conv_legacy;
mod conv_modules;
mod conv_plan_cache;
mod conv_wgmma;
mod conv_wgmma_wgrad;
mod device;
mod event;
mod fallback;
mod generated;
mod index_check;
mod kernels;
mod matmul;
mod matmul_lt;
mod matmul_tune;
mod nvrtc;
mod probe;
mod runtime;
mod tensor_maps;

use std::sync::Arc;

pub use alloc::MemoryStats;
pub use conv::{
    cudnn_allow_tf32, cudnn_benchmark, cudnn_fused_plans, cudnn_graph_error, cudnn_plan_counts,
    set_cudnn_allow_tf32, set_cudnn_benchmark,
};
pub use conv_choice::conv_engine_choices;
pub use conv_choice::{function_choices, last_function_timing};
pub use conv_generated::{
    conv_engine, generated_convs, hopper_convs, set_conv_engine, set_generated_conv,
    slices_read_in_place, ConvEngine,
};
pub use conv_graph::cudnn_plans_timed;
pub use conv_plan_cache::cudnn_plan_disk_hits;
pub use event::Event;
pub use fallback::host_fallbacks;
pub use matmul::{allow_tf32, set_allow_tf32};
pub use matmul_lt::{epilogue_gemms, matmul_epilogue, Epilogue};
pub use matmul_tune::{gemm_tune_disk_hits, gemms_tuned};
pub use nvrtc::{kernel_cache_stats, kernel_compile_times, kernel_load_times};

use device::CudaDevice;
use kiln_core::{Device, Error, Result};

/// Registers the CUDA runtime with kiln-core. Cheap and infallible: the libraries and the device
/// are opened at first use, and a missing library surfaces there as an `Err`.
pub fn init() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| kiln_core::device::register_runtime(Arc::new(runtime::CudaRuntime)));
}

/// Whether CUDA can be used: the libraries load and a device exists. `Err` says why not.
pub fn check() -> Result<()> {
    init();
    CudaDevice::get(0).map(|_| ())
}

/// `torch.cuda.is_available()`.
pub fn is_available() -> bool {
    check().is_ok()
}

/// `torch.cuda.device_count()` (0 when CUDA cannot be used).
pub fn device_count() -> usize {
    if crate::probe::probe().is_err() || cudarc::driver::result::init().is_err() {
        return 0;
    }
    cudarc::driver::result::device::get_count()
        .map(|n| n.max(0) as usize)
        .unwrap_or(0)
}

fn dev(device: Device) -> Result<Arc<CudaDevice>> {
    CudaDevice::get(runtime::ordinal("cuda", device)?)
}

/// `torch.cuda.get_device_capability(device)`: (major, minor).
pub fn compute_capability(device: Device) -> Result<(u32, u32)> {
    let d = dev(device)?;
    let digits = d.arch.trim_start_matches("compute_");
    let (major, minor) = digits.split_at(digits.len().saturating_sub(1));
    match (major.parse(), minor.parse()) {
        (Ok(major), Ok(minor)) => Ok((major, minor)),
        _ => Err(Error::unsupported(
            "cuda",
            format!("unreadable architecture {}", d.arch),
        )),
    }
}

/// `torch.cuda.synchronize(device)`.
pub fn synchronize(device: Device) -> Result<()> {
    dev(device)?.synchronize()
}

/// `torch.cuda.memory_stats(device)`: allocated, reserved and peak bytes of the caching allocator.
pub fn memory_stats(device: Device) -> Result<MemoryStats> {
    Ok(dev(device)?.memory_stats())
}

/// `torch.cuda.reset_peak_memory_stats(device)`.
pub fn reset_peak_memory_stats(device: Device) -> Result<()> {
    dev(device)?.reset_peak();
    Ok(())
}

/// `torch.cuda.empty_cache()`: returns the allocator's cached free blocks to the driver.
pub fn empty_cache(device: Device) -> Result<()> {
    dev(device)?.empty_cache()
}

/// `torch.cuda.profiler.start()`/`stop()`: marks the region an external profiler started with
/// `--profile-from-start off` (Nsight Compute, Nsight Systems) records, so one steady-state step
/// can be measured kernel by kernel. `on`: start, else stop.
pub fn profiler_range(device: Device, on: bool) -> Result<()> {
    let d = dev(device)?;
    d.bind()?;
    // SAFETY: the device's context is current on this thread
    let r = unsafe {
        match on {
            true => cudarc::driver::sys::cuProfilerStart(),
            false => cudarc::driver::sys::cuProfilerStop(),
        }
    };
    match r {
        cudarc::driver::sys::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(Error::unsupported(
            "cuda profiler",
            format!(
                "cuProfiler{} failed: {e:?}",
                if on { "Start" } else { "Stop" }
            ),
        )),
    }
}

/// Runs the library probe for arbitrary library names: the message a user gets when one is missing.
/// For tests (the real libraries are present on a GPU machine, so their message cannot be seen).
#[doc(hidden)]
pub fn probe_libraries(names: &[&str]) -> std::result::Result<(), String> {
    let libs: Vec<(&str, &str)> = names.iter().map(|n| (*n, *n)).collect();
    probe::probe_libs(&libs)
}

/// The error a CUDA-less machine gets, for messages that want it without touching a device.
pub fn unavailable_reason() -> Option<Error> {
    check().err()
}
