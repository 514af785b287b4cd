//! Compiles in new processes: a model's compile and first compiled call timed in a fresh process
//! against an empty kiln cache folder (cold), then in a second fresh process against the folder the
//! first one filled (warm: torch_baseline.py's `warm_disk_cache_compile`, a process-level
//! recompile that finds its kernels on disk).
//!
//! The parent runs this executable as `compile-child:KEY --device D --mode M [--quick]`, with
//! `KILN_CACHE_DIR` pointing at one temporary folder for both children. Each child builds KEY's
//! model from the workload's seed, runs it eagerly once (the CUDA context, the libraries and the
//! eager kernels are not compile time: torch's warm-up ran eagerly too), then times `kiln::compile`
//! plus the first compiled call up to the device's completion, and prints one JSON object.
//!
//! In-process cold rows (`with_fresh_cache`) redirect only the C kernel cache: NVRTC's PTX cache
//! under `KILN_CACHE_DIR/cuda` stays, so on a GPU only the new-process cold row is cold throughout.

use std::process::Command;
use std::time::Instant;

use kiln::{Device, Mode};

use crate::harness::{spinner, Ctx};
use crate::workloads::{self, BenchResult};

/// The hidden subcommand's prefix; the key after it names the model (see `child_main`).
pub const PREFIX: &str = "compile-child:";

/// One compile's time and what it built versus found on disk.
#[derive(Clone, Copy, Debug, Default)]
pub struct Measured {
    pub secs: f64,
    /// Translation units built by the C compiler / found built on disk.
    pub cc_builds: u64,
    pub cc_disk_hits: u64,
    /// CUDA kernels compiled by NVRTC / found as PTX on disk.
    pub nvrtc_builds: u64,
    pub nvrtc_disk_hits: u64,
    /// Compiles read from the compiled-graph cache on disk (AOT autograd's splits, plans).
    pub graph_disk_hits: u64,
    /// cuMemAlloc calls during the compile and first call (each a new arena of the caching
    /// allocator): what the pool's arenas from the eager warm-up could not hold.
    pub driver_allocs: u64,
    /// Seconds spent readying built kernels, summed over threads: reading cubins from the disk
    /// cache, the driver loading modules, looking functions up (under CUDA's lazy loading, what
    /// loads each function's code).
    pub load_secs: [f64; 3],
}

/// `Measured::load_secs` so far in this process (0 on the CPU).
fn load_secs(dev: Device) -> [f64; 3] {
    match dev {
        Device::Cuda(_) => {
            let (read, module, lookup) = kiln::cuda::kernel_load_times();
            [read, module, lookup].map(|d| d.as_secs_f64())
        }
        Device::Cpu => [0.0; 3],
    }
}

/// The names of `Measured::load_secs` in the child's JSON.
const LOAD_KEYS: [&str; 3] = [
    "cubin_read_secs",
    "module_load_secs",
    "function_lookup_secs",
];

/// cuMemAlloc calls made so far on `dev` (0 on the CPU).
fn driver_allocs(dev: Device) -> u64 {
    match dev {
        Device::Cuda(_) => kiln::cuda::memory_stats(dev).map_or(0, |s| s.driver_allocs),
        Device::Cpu => 0,
    }
}

fn counters() -> [u64; 5] {
    let cc = kiln::inductor::kernel_cache_stats();
    let (nvrtc, nvrtc_hits) = kiln::cuda::kernel_cache_stats();
    let graphs = kiln::compiler::disk_cache::stats().hits;
    [cc.compiles, cc.disk_hits, nvrtc, nvrtc_hits, graphs]
}

/// A measured compile longer than this prints where the process's CPU time went
/// (`proc_stats`), as does any with `KILN_BENCH_PROC` set.
const SLOW_MEASUREMENT_S: f64 = 2.0;

/// Times `f` (a compile and its first call) until `dev` has finished the queued work, with the
/// kernel builds and disk hits it caused. With `KILN_BENCH_PROFILE=N` set, `f` runs under
/// `kiln::profile` and its N largest rows go to stderr (where the time of a compile goes; the
/// parent passes a child's stderr on); `KILN_BENCH_TRACE=PATH` saves that profile's Chrome trace
/// too (the host's timeline of the compile and first call).
pub fn measure<R>(dev: Device, f: impl FnOnce() -> kiln::Result<R>) -> kiln::Result<(R, Measured)> {
    let rows = std::env::var("KILN_BENCH_PROFILE")
        .ok()
        .map(|v| v.parse().unwrap_or(40));
    let before = counters();
    let allocs_before = driver_allocs(dev);
    let loads_before = load_secs(dev);
    let process = crate::proc_stats::Snapshot::take();
    let t = Instant::now();
    let r = match rows {
        Some(rows) => {
            // the wait for the device inside the profile, so the trace shows the host's idle
            // tail (how much of the first call's device work the compile did not overlap)
            let (r, profile) = kiln::profile(|| {
                let r = f();
                let _wait = kiln::profiler::span(kiln::profiler::Category::Compile, || {
                    "wait for the device (first call's end)".into()
                });
                kiln::core::device::synchronize(dev).map(|()| r)
            });
            eprintln!(
                "== profile: compile and first call ==\n{}",
                profile.table(rows)
            );
            if let Some(path) = std::env::var_os("KILN_BENCH_TRACE") {
                profile.save_chrome_trace(path)?;
            }
            std::hint::black_box(r??)
        }
        None => std::hint::black_box(f()?),
    };
    kiln::core::device::synchronize(dev)?;
    let secs = t.elapsed().as_secs_f64();
    if secs > SLOW_MEASUREMENT_S || std::env::var_os("KILN_BENCH_PROC").is_some() {
        eprintln!("{}", process.report("compile and first call"));
    }
    let after = counters();
    Ok((
        r,
        Measured {
            secs,
            cc_builds: after[0] - before[0],
            cc_disk_hits: after[1] - before[1],
            nvrtc_builds: after[2] - before[2],
            nvrtc_disk_hits: after[3] - before[3],
            graph_disk_hits: after[4] - before[4],
            driver_allocs: driver_allocs(dev) - allocs_before,
            load_secs: {
                let after = load_secs(dev);
                [0, 1, 2].map(|i| after[i] - loads_before[i])
            },
        },
    ))
}

/// The child's side: compile KEY's model once and print the measurement as one JSON line.
pub fn child_main(key: &str, dev: Device, mode: Mode, quick: bool) -> BenchResult {
    // a measurement scope over the parent's cache folder: nothing but that folder serves a
    // kernel (NVRTC's own cache of programs an earlier process built included), so a cold
    // compile is cold and a warm one is what kiln's disk cache gives
    let root = kiln::core::cache::cache_root();
    let m = kiln::core::cache::with_root(root, || match key {
        "resnet18" => workloads::resnet18::compile_once(dev, mode),
        k if k.starts_with("bert:") => workloads::bert::compile_once(&k[5..], dev, mode, quick),
        k if k.starts_with("train:") => workloads::train::compile_once(&k[6..], dev, mode, quick),
        k => Err(format!("{PREFIX}{k}: no such model").into()),
    })?;
    let mut row = serde_json::json!({
        "seconds": m.secs,
        "cc_builds": m.cc_builds,
        "cc_disk_hits": m.cc_disk_hits,
        "nvrtc_builds": m.nvrtc_builds,
        "nvrtc_disk_hits": m.nvrtc_disk_hits,
        "graph_disk_hits": m.graph_disk_hits,
        "driver_allocs": m.driver_allocs,
    });
    for (k, v) in LOAD_KEYS.iter().zip(m.load_secs) {
        row[*k] = v.into();
    }
    println!("{row}");
    Ok(())
}

/// Variables a child needs besides the cache folder (e.g. where model weights are).
pub type ChildEnv<'a> = &'a [(&'a str, std::ffi::OsString)];

/// Runs a child process of this benchmark (its spinner `pb` cleared when it ends) and reads the
/// last JSON line it printed; a child that fails is an error with its stderr. `label` names it.
pub fn child_result(
    label: &str,
    mut cmd: Command,
    pb: indicatif::ProgressBar,
) -> BenchResult<serde_json::Value> {
    let out = cmd.output()?;
    pb.finish_and_clear();
    if std::env::var_os("KILN_BENCH_PROFILE").is_some() {
        // the child's profile (`measure`)
        eprintln!("== {label} ==\n{}", String::from_utf8_lossy(&out.stderr));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        return Err(format!(
            "{label} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )
        .into());
    }
    stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .ok_or_else(|| format!("{label}: no result in its output {stdout:?}").into())
}

/// Runs one child against `cache` and reads its measurement.
fn run_child(
    ctx: &Ctx,
    key: &str,
    cache: &std::path::Path,
    env: ChildEnv,
    what: &str,
) -> BenchResult<Measured> {
    let exe = std::env::current_exe()?;
    let pb = spinner(format!("{key}: {what} compile (new process)"));
    let mut cmd = Command::new(exe);
    cmd.arg(format!("{PREFIX}{key}"))
        .args(["--device", &ctx.device, "--mode", ctx.mode.as_str()])
        .env("KILN_CACHE_DIR", cache)
        // the child's rows go to its stdout only, never into $OUT/results.jsonl
        .env_remove("OUT")
        .envs(env.iter().map(|(k, v)| (k, v)));
    if ctx.quick {
        cmd.arg("--quick");
    }
    let v = child_result(&format!("{PREFIX}{key} ({what})"), cmd, pb)?;
    let count = |k: &str| v.get(k).and_then(|x| x.as_u64()).unwrap_or(0);
    Ok(Measured {
        secs: v
            .get("seconds")
            .and_then(|x| x.as_f64())
            .ok_or_else(|| format!("{PREFIX}{key}: no \"seconds\" in {v}"))?,
        cc_builds: count("cc_builds"),
        cc_disk_hits: count("cc_disk_hits"),
        nvrtc_builds: count("nvrtc_builds"),
        nvrtc_disk_hits: count("nvrtc_disk_hits"),
        graph_disk_hits: count("graph_disk_hits"),
        driver_allocs: count("driver_allocs"),
        load_secs: LOAD_KEYS.map(|k| v.get(k).and_then(|x| x.as_f64()).unwrap_or(0.0)),
    })
}

/// A temporary kiln cache folder, removed on drop.
struct TempCache(std::path::PathBuf);

impl Drop for TempCache {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The cold and warm new-process compiles of KEY's model, as rows of `workload`/`variant`:
/// `cold_compile_new_process`, `warm_disk_cache_compile` and the kernels each built.
pub fn emit_new_process_compiles(
    ctx: &mut Ctx,
    workload: &str,
    variant: &str,
    key: &str,
    env: ChildEnv,
) -> BenchResult {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let cache = TempCache(
        std::env::temp_dir().join(format!("kiln-bench-cache-{}-{nanos}", std::process::id())),
    );
    std::fs::create_dir_all(&cache.0)?;
    let cold = run_child(ctx, key, &cache.0, env, "cold")?;
    let warm = run_child(ctx, key, &cache.0, env, "warm")?;
    for (m, secs_metric, prefix) in [
        (cold, "cold_compile_new_process", "cold"),
        (warm, "warm_disk_cache_compile", "warm"),
    ] {
        ctx.emit(workload, variant, secs_metric, m.secs, "s");
        ctx.emit(
            workload,
            variant,
            &format!("{prefix}_cc_builds"),
            m.cc_builds as f64,
            "count",
        );
        if ctx.on_gpu() {
            ctx.emit(
                workload,
                variant,
                &format!("{prefix}_nvrtc_builds"),
                m.nvrtc_builds as f64,
                "count",
            );
            // device memory the compile and first call took from the driver
            ctx.emit(
                workload,
                variant,
                &format!("{prefix}_driver_allocs"),
                m.driver_allocs as f64,
                "count",
            );
        }
        // compiles read from the compiled-graph cache (AOT splits, plans): none cold
        ctx.emit(
            workload,
            variant,
            &format!("{prefix}_graph_disk_hits"),
            m.graph_disk_hits as f64,
            "count",
        );
    }
    Ok(())
}
