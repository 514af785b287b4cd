//! A graph's CUDA kernels compiled as a few translation units on parallel threads. NVRTC's time
//! grows with the source it is given, and a network's graph has tens of distinct kernels (one per
//! channel count and spatial size), so one unit for all of them puts seconds on the critical path
//! of a cold start; split across a few threads, the wall time is a few units'. Each unit still holds
//! several kernels (NVRTC has a fixed cost per program), and the split depends only on the source
//! text, so a graph compiled again finds the same units in the runtime's caches.

use std::collections::HashMap;
use std::sync::Arc;

use kiln_core::device::{DeviceKernel, DeviceRuntime};
use kiln_core::{Device, Result};

/// Fewest kernels worth a unit of their own.
const KERNELS_PER_UNIT: usize = 4;
/// Units per compile thread at most: more, smaller units balance the threads' work better (a
/// thread that drew the largest unit sets the wall time) at NVRTC's fixed cost per program.
/// DenseNet-121's training compile on 16 threads, truly cold: 9.7 s with 16 units a graph, 8.6 s
/// with 32, 7.8-8.9 s with 48 or 64.
const UNITS_PER_THREAD: usize = 2;
/// Most units per graph.
const MAX_UNITS: usize = 64;

/// How many units a graph's kernels may fill: `UNITS_PER_THREAD` per thread, or
/// `KILN_COMPILE_UNITS`.
fn unit_cap(threads: usize) -> usize {
    std::env::var("KILN_COMPILE_UNITS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(threads * UNITS_PER_THREAD)
        .clamp(1, MAX_UNITS)
}

/// One kernel to compile: its name, its `__global__` definition, and the `__device__` functions
/// it calls (name, definition).
pub(crate) struct KernelSource<'a> {
    pub name: &'a str,
    pub source: &'a str,
    pub device_fns: &'a [(String, String)],
}

/// The translation units for `kernels` (distinct names, in order): each the prelude, the device
/// functions its kernels call, and its kernels' definitions, with the names it defines. Kernels
/// are dealt to units largest first (a definition with its device functions), each to the unit
/// with the least source so far.
pub(crate) fn units(
    prelude: &str,
    kernels: &[KernelSource<'_>],
    threads: usize,
) -> Vec<(String, Vec<String>)> {
    let n = kernels
        .len()
        .div_ceil(KERNELS_PER_UNIT)
        .clamp(1, unit_cap(threads));
    // a kernel's weight is all the source it brings: a horizontal launch's definition is a
    // short dispatch over its members' device functions (ResNet-18's 16 weight copies: 2 KB of
    // definition, most of a 64 KB unit that took 1.1 s of a 1.2 s cold compile)
    let weight = |k: &KernelSource<'_>| {
        k.source.len() + k.device_fns.iter().map(|(_, d)| d.len()).sum::<usize>()
    };
    let weights: Vec<usize> = kernels.iter().map(weight).collect();
    // each unit in the graph's order: its text does not depend on how the sizes tied
    crate::parallel::deal(&weights, n)
        .into_iter()
        .map(|m| {
            let mut src = prelude.to_string();
            let mut fns: Vec<&str> = Vec::new();
            for &i in &m {
                for (name, def) in kernels[i].device_fns {
                    if !fns.contains(&name.as_str()) {
                        src.push_str(def);
                        fns.push(name);
                    }
                }
            }
            for &i in &m {
                src.push_str(kernels[i].source);
            }
            (
                src,
                m.iter().map(|&i| kernels[i].name.to_string()).collect(),
            )
        })
        .collect()
}

/// Most threads compiling at once (`KILN_COMPILE_THREADS` overrides it; the cores bound it).
/// Truly cold compiles (NVRTC's own cache bypassed) of DenseNet-121's training step on a 16-core
/// H200 host: 18.9 s with 4 threads, 9.4 s with 8, 8.1 s with 16. (An earlier measurement that
/// favoured 4 threads had its later runs served by NVRTC's cache.)
const MAX_COMPILE_THREADS: usize = 16;

/// How many threads build units at most: `MAX_COMPILE_THREADS` (or `KILN_COMPILE_THREADS`),
/// bounded by the cores. A graph's kernels are dealt into units for this many threads
/// (`units`' `threads`).
pub(crate) fn max_threads() -> usize {
    let cap = std::env::var("KILN_COMPILE_THREADS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|&n| n > 0)
        .unwrap_or(MAX_COMPILE_THREADS);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    cap.min(cores).max(1)
}

fn compile_threads(units: usize) -> usize {
    units.min(max_threads()).max(1)
}

/// Compiles and loads `units` on `device`. Units whose machine code is already built (a warm
/// start's: on disk) are loaded first (`DeviceRuntime::load_built_units`: kiln-cuda reads them
/// on a few threads and loads them on this one). The driver loads one module at a time: 16
/// threads each loading units spent 180-230 ms summed waiting for it, and DenseNet-121's 56
/// units took 16-18 ms; loaded this way, 12 ms (on the H200, 2026-11-29). The rest are built by
/// a few threads that take them in order, largest work first as `units` dealt them.
pub(crate) fn load(
    rt: &Arc<dyn DeviceRuntime>,
    device: Device,
    units: &[(String, Vec<String>)],
) -> Result<HashMap<String, Arc<dyn DeviceKernel>>> {
    // units a prefetch is loading are found loaded, not loaded twice
    super::cuda_prefetch::wait_units();
    let mut out = HashMap::new();
    let mut to_build: Vec<&(String, Vec<String>)> = Vec::new();
    for (unit, built) in units.iter().zip(rt.load_built_units(device, units)?) {
        match built {
            Some(kernels) => out.extend(unit.1.iter().cloned().zip(kernels)),
            None => to_build.push(unit),
        }
    }
    let threads = compile_threads(to_build.len());
    let next = std::sync::atomic::AtomicUsize::new(0);
    // each unit's kernels, or its error; empty if its thread panicked
    type Slot = std::sync::Mutex<Option<Result<Vec<Arc<dyn DeviceKernel>>>>>;
    let slots: Vec<Slot> = to_build.iter().map(|_| Slot::new(None)).collect();
    let work = || loop {
        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let Some((src, names)) = to_build.get(i) else {
            break;
        };
        let r = rt.load_kernels(device, src, names);
        *slots[i].lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
    };
    match threads {
        _ if to_build.is_empty() => {}
        1 => work(),
        _ => std::thread::scope(|s| {
            let handles: Vec<_> = (0..threads).map(|_| s.spawn(work)).collect();
            // a panicked thread leaves its unit's slot empty: reported below as an error
            for h in handles {
                let _ = h.join();
            }
        }),
    }
    for ((_, names), slot) in to_build.iter().zip(slots) {
        let kernels = slot
            .into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .ok_or_else(|| {
                kiln_core::Error::arg("kiln backend", "a thread compiling CUDA kernels panicked")
            })??;
        out.extend(names.iter().cloned().zip(kernels));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::test_runtime::{unit, Units};

    /// Units already built are taken from `load_built_units` in one call and never compiled;
    /// only the others reach `load_kernels`; every kernel of every unit comes back by name.
    #[test]
    fn built_units_skip_the_compiler_threads() {
        let units = vec![
            unit("BUILT a", &["a0", "a1"]),
            unit("fresh b", &["b0"]),
            unit("BUILT c", &["c0"]),
            unit("fresh d", &["d0", "d1"]),
        ];
        let runtime = Arc::new(Units::default());
        let rt: Arc<dyn DeviceRuntime> = runtime.clone();
        let loaded = load(&rt, Device::Cuda(0), &units).unwrap();
        let mut names: Vec<&String> = loaded.keys().collect();
        names.sort();
        assert_eq!(names, ["a0", "a1", "b0", "c0", "d0", "d1"]);
        assert_eq!(*runtime.built_asked.lock().unwrap(), 1);
        let mut compiled = runtime.compiled.lock().unwrap().clone();
        compiled.sort();
        assert_eq!(compiled, ["fresh b", "fresh d"]);
        // a warm start: nothing compiled
        let warm = vec![unit("BUILT a", &["a0", "a1"]), unit("BUILT c", &["c0"])];
        let runtime = Arc::new(Units::default());
        let rt: Arc<dyn DeviceRuntime> = runtime.clone();
        assert_eq!(load(&rt, Device::Cuda(0), &warm).unwrap().len(), 3);
        assert!(runtime.compiled.lock().unwrap().is_empty());
    }

    /// A unit the compiler fails on is the load's error, built units beside it or not.
    #[test]
    fn a_failed_build_is_the_loads_error() {
        let units = vec![unit("BUILT a", &["a0"]), unit("BROKEN b", &["b0"])];
        let rt: Arc<dyn DeviceRuntime> = Arc::new(Units::default());
        let e = load(&rt, Device::Cuda(0), &units)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("NVRTC refused it"), "{e}");
    }

    fn kernel(name: &str, len: usize, fns: &[(String, String)]) -> Owned {
        let body = format!("__global__ void {name}() {{ /*{}*/ }}\n", "x".repeat(len));
        (name.to_string(), body, fns.to_vec())
    }

    type Owned = (String, String, Vec<(String, String)>);

    fn sources(owned: &[Owned]) -> Vec<KernelSource<'_>> {
        owned
            .iter()
            .map(|(n, s, d)| KernelSource {
                name: n,
                source: s,
                device_fns: d,
            })
            .collect()
    }

    /// A horizontal launch weighs what its device functions weigh: a short definition over 4
    /// KB of members gets a unit of its own among eight 1 KB kernels (dealt by its definition
    /// alone, it joined two of them in the largest unit).
    #[test]
    fn a_launch_weighs_its_device_functions() {
        let big = vec![(
            "members".to_string(),
            format!("__device__ void members() {{ /*{}*/ }}\n", "y".repeat(4000)),
        )];
        let mut owned: Vec<_> = (0..8)
            .map(|i| kernel(&format!("k{i}"), 1000, &[]))
            .collect();
        owned.push(kernel("side_by_side", 10, &big));
        let ks = sources(&owned);
        let us = units("P", &ks, 16);
        assert_eq!(us.len(), 3);
        let alone = us.iter().find(|u| u.1.iter().any(|n| n == "side_by_side"));
        assert_eq!(
            alone.map(|u| u.1.len()),
            Some(1),
            "{:?}",
            us.iter().map(|u| &u.1).collect::<Vec<_>>()
        );
    }

    /// Every kernel lands in exactly one unit, with the device functions it calls and without
    /// the others'; units are balanced by source size and split only for enough kernels.
    #[test]
    fn kernels_are_dealt_to_balanced_units_with_their_device_functions() {
        let f = vec![("d1".to_string(), "__device__ void d1() {}\n".to_string())];
        let owned: Vec<_> = (0..12)
            .map(|i| {
                kernel(
                    &format!("k{i}"),
                    100 * (i % 3 + 1),
                    if i == 5 { &f } else { &[] },
                )
            })
            .collect();
        let ks = sources(&owned);
        let us = units("PRELUDE\n", &ks, 16);
        assert_eq!(us.len(), 3, "12 kernels, 4 per unit");
        let mut seen: Vec<&String> = us.iter().flat_map(|u| &u.1).collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen.len(), 12);
        for (src, names) in &us {
            assert!(src.starts_with("PRELUDE\n"));
            assert_eq!(
                src.contains("d1()"),
                names.iter().any(|n| n == "k5"),
                "{names:?}"
            );
        }
        let lens: Vec<usize> = us.iter().map(|u| u.0.len()).collect();
        let (lo, hi) = (lens.iter().min().unwrap(), lens.iter().max().unwrap());
        assert!(hi - lo <= 400, "unbalanced units: {lens:?}");
        assert_eq!(units("P", &ks[..3], 16).len(), 1, "few kernels: one unit");
        assert_eq!(
            units("P", &ks, 1).len(),
            UNITS_PER_THREAD,
            "one thread: its share of units"
        );
    }
}
