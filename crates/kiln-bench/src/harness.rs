//! What every workload shares: the report (JSON lines in torch_baseline.py's shape, plus a table),
//! the timing loop, and progress bars.

use std::hint::black_box;
use std::io::Write;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressStyle};
use kiln::{CompileOptions, Mode};

/// Settings every workload reads.
pub struct Ctx {
    /// The device's name as given (`cpu`, `cuda`, `cuda:1`), for the report.
    pub device: String,
    /// Where the workload's tensors live.
    pub dev: kiln::Device,
    pub mode: Mode,
    /// `--mode eager`: the eager rows only, no compiled variant.
    pub eager_only: bool,
    pub quick: bool,
    pub report: Report,
}

impl Ctx {
    pub fn opts(&self) -> CompileOptions {
        CompileOptions::default().mode(self.mode)
    }
    /// The variant name of a compiled run: the mode's name, as torch_baseline.py's `sincos` uses.
    pub fn mode_name(&self) -> &'static str {
        self.mode.as_str()
    }
    /// A compiled variant's name: `base` in the default mode, else `base_<mode>` (as
    /// torch_baseline.py names `full_model_reduce_overhead`).
    pub fn variant(&self, base: &str) -> String {
        match self.mode {
            Mode::Default => base.to_string(),
            m => format!("{base}_{}", m.as_str().replace('-', "_")),
        }
    }
    pub fn emit(&mut self, workload: &str, variant: &str, metric: &str, value: f64, unit: &str) {
        self.report
            .emit(workload, variant, metric, value, unit, &self.device)
    }
    pub fn timer(&self) -> Timer {
        Timer {
            quick: self.quick,
            device: self.dev,
        }
    }
    pub fn on_gpu(&self) -> bool {
        self.dev != kiln::Device::Cpu
    }

    /// With `KILN_BENCH_PROFILE` set: runs `f` once more under a synchronized profile (each op's
    /// and kernel's time is the device's) and prints the table, sorted by self time, to stderr,
    /// with the ops that took the host path. Otherwise nothing: the rows are unchanged either way,
    /// but for train_*'s `cold_compile`, which under `KILN_BENCH_PROFILE` is the process's
    /// second (a profiled cold compile runs first, to show the first-use costs).
    pub fn profile<R>(&self, label: &str, f: impl FnOnce() -> kiln::Result<R>) -> kiln::Result<()> {
        let Ok(rows) = std::env::var("KILN_BENCH_PROFILE") else {
            return Ok(());
        };
        let limit = rows.parse().unwrap_or(40);
        let before = kiln::cuda::host_fallbacks();
        let (r, profile) = kiln::profile_synchronized(f);
        r?;
        // the core's synchronize: a no-op on the CPU, where the CUDA runtime's is an error
        kiln::core::device::synchronize(self.dev)?;
        eprintln!(
            "== profile: {label} ({}) ==\n{}",
            self.device,
            profile.table(limit)
        );
        for (op, n) in kiln::cuda::host_fallbacks() {
            let was = before.iter().find(|(o, _)| *o == op).map_or(0, |(_, k)| *k);
            if n > was {
                eprintln!("host fallback: {op} x{}", n - was);
            }
        }
        Ok(())
    }

    /// With `KILN_BENCH_CUDA_RANGE` set, on a GPU: runs `f` once between `cuProfilerStart` and
    /// `cuProfilerStop`, the device synchronized on both sides, so `ncu --profile-from-start off
    /// kiln-bench ...` measures exactly one steady-state call kernel by kernel (cuDNN's and
    /// cuBLAS's kernels included, which kiln's own profiler sees only as the prim that called
    /// them). A value other than `1` keeps only the ranges whose `label` contains it (one shape
    /// of a workload that runs several). Otherwise nothing.
    pub fn cuda_range<R>(
        &self,
        label: &str,
        f: impl FnOnce() -> kiln::Result<R>,
    ) -> kiln::Result<()> {
        let Some(want) = std::env::var_os("KILN_BENCH_CUDA_RANGE") else {
            return Ok(());
        };
        let want = want.to_string_lossy();
        if !self.on_gpu() || (want != "1" && !label.contains(want.as_ref())) {
            return Ok(());
        }
        kiln::cuda::synchronize(self.dev)?;
        kiln::cuda::profiler_range(self.dev, true)?;
        let r = f();
        kiln::cuda::synchronize(self.dev)?;
        kiln::cuda::profiler_range(self.dev, false)?;
        r.map(|_| ())
    }
}

pub struct Row {
    pub workload: String,
    pub variant: String,
    pub metric: String,
    pub value: f64,
    pub unit: String,
    pub device: String,
}

#[derive(Default)]
pub struct Report {
    pub rows: Vec<Row>,
}

/// torch_baseline.py rounds values to 4 decimals; so do we, except that values under 0.01 keep 4
/// significant digits (a difference of 3e-7 must not print as 0).
fn round4(v: f64) -> f64 {
    if !v.is_finite() || v == 0.0 {
        return v;
    }
    if v.abs() >= 0.01 {
        return (v * 1e4).round() / 1e4;
    }
    let scale = 10f64.powi(3 - v.abs().log10().floor() as i32);
    (v * scale).round() / scale
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"?\"".into())
}

/// A JSON number as Python's `json.dumps` writes a float (`1.0`, `0.0123`); `null` when not finite.
fn json_num(v: f64) -> String {
    serde_json::Number::from_f64(v)
        .map(|n| serde_json::Value::Number(n).to_string())
        .unwrap_or_else(|| "null".into())
}

impl Row {
    /// One line, keys in torch_baseline.py's order (serde_json's map would sort them) with `device` last.
    pub fn to_json(&self) -> String {
        format!(
            "{{\"workload\": {}, \"variant\": {}, \"metric\": {}, \"value\": {}, \"unit\": {}, \"device\": {}}}",
            json_str(&self.workload),
            json_str(&self.variant),
            json_str(&self.metric),
            json_num(self.value),
            json_str(&self.unit),
            json_str(&self.device)
        )
    }
}

impl Report {
    pub fn emit(
        &mut self,
        workload: &str,
        variant: &str,
        metric: &str,
        value: f64,
        unit: &str,
        device: &str,
    ) {
        let row = Row {
            workload: workload.into(),
            variant: variant.into(),
            metric: metric.into(),
            value: round4(value),
            unit: unit.into(),
            device: device.into(),
        };
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "{}", row.to_json());
        let _ = out.flush();
        self.rows.push(row);
    }

    /// A workload that failed: one line naming it and the error (torch_baseline.py does the same).
    pub fn error(&mut self, workload: &str, err: &str) {
        let e: String = err.chars().take(300).collect();
        println!(
            "{{\"workload\": {}, \"error\": {}}}",
            json_str(workload),
            json_str(&e)
        );
    }

    /// The human-readable table, torch_baseline.py's layout plus the device column.
    pub fn table(&self) -> String {
        let mut s = format!(
            "{:<26} {:<30} {:<34} {:>16} {:<8} {}\n",
            "workload", "variant", "metric", "value", "unit", "device"
        );
        s.push_str(&"-".repeat(126));
        s.push('\n');
        for r in &self.rows {
            s.push_str(&format!(
                "{:<26} {:<30} {:<34} {:>16} {:<8} {}\n",
                r.workload,
                r.variant,
                r.metric,
                fmt_value(r.value),
                r.unit,
                r.device
            ));
        }
        s
    }
}

fn fmt_value(v: f64) -> String {
    match v.abs() {
        a if a != 0.0 && a < 0.01 => format!("{v:.3e}"),
        _ => format!("{v:.4}"),
    }
}

/// A spinner on stderr for work that takes seconds and has no natural count.
pub fn spinner(msg: impl Into<String>) -> ProgressBar {
    let pb = ProgressBar::new_spinner();
    pb.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
    );
    pb.set_message(msg.into());
    pb.enable_steady_tick(Duration::from_millis(120));
    pb
}

/// A bar on stderr over `n` units of work.
pub fn bar(n: u64, msg: impl Into<String>) -> ProgressBar {
    let pb = ProgressBar::new(n);
    pb.set_style(
        ProgressStyle::with_template("{msg:40} {bar:30} {pos}/{len} [{elapsed}]")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    pb.set_message(msg.into());
    pb
}

/// Times `f` once (a compile plus its first call), with a spinner.
pub fn once<R>(msg: &str, f: impl FnOnce() -> R) -> (R, Duration) {
    let pb = spinner(msg.to_string());
    let t = Instant::now();
    let r = black_box(f());
    let d = t.elapsed();
    pb.finish_and_clear();
    (r, d)
}

/// The result of one timed measurement.
#[derive(Clone, Copy, Debug)]
pub struct Timing {
    /// Median over runs of the mean time per call within a run.
    pub median: Duration,
}

impl Timing {
    pub fn us(&self) -> f64 {
        self.median.as_secs_f64() * 1e6
    }
    pub fn ms(&self) -> f64 {
        self.median.as_secs_f64() * 1e3
    }
    pub fn s(&self) -> f64 {
        self.median.as_secs_f64()
    }
}

/// The timing loop: warm up, calibrate how many calls fill a run, then take the median of several
/// runs' mean per-call time (torch_baseline.py's `bench_ms` takes the median of 5 batches).
pub struct Timer {
    pub quick: bool,
    /// Waited for at the end of every timed run (work queued on a GPU counts when it finishes).
    pub device: kiln::Device,
}

impl Timer {
    /// Waits for the device's queued work (a timing error would only make the GPU look faster:
    /// a failed wait is reported and the run continues).
    fn sync(&self) {
        if let Err(e) = kiln::core::device::synchronize(self.device) {
            eprintln!("kiln-bench: synchronize {}: {e}", self.device);
        }
    }

    /// How long one run should last, and how many runs.
    fn plan(&self) -> (Duration, usize) {
        match self.quick {
            true => (Duration::from_millis(60), 3),
            false => (Duration::from_millis(300), 5),
        }
    }

    /// Times `f`, an operation whose result is kept alive through `black_box` (nothing is timed
    /// that the optimizer could remove). Errors from `f` stop the measurement.
    pub fn time<R, E>(&self, msg: &str, f: impl FnMut() -> Result<R, E>) -> Result<Timing, E> {
        Ok(self.time_keep(msg, f)?.0)
    }

    /// `time`, also returning the last call's result (to check it without another call).
    /// Under `--quick` a call that takes over 2 s (after one warm-up call) is timed once.
    pub fn time_keep<R, E>(
        &self,
        msg: &str,
        mut f: impl FnMut() -> Result<R, E>,
    ) -> Result<(Timing, R), E> {
        let (run_len, mut runs) = self.plan();
        // warm-up: one call, a second unless the first took over a second, and more until a
        // quarter of a run's length has passed
        let warm = Instant::now();
        let mut warm_calls = 0u32;
        let mut last = Duration::MAX;
        let mut result;
        loop {
            let t = Instant::now();
            result = black_box(f()?);
            self.sync();
            last = last.min(t.elapsed());
            warm_calls += 1;
            let more = (warm_calls < 2 && warm.elapsed() < Duration::from_secs(1))
                || (warm.elapsed() < run_len / 4 && warm_calls < 1000);
            if !more {
                break;
            }
        }
        if self.quick && last > Duration::from_secs(2) {
            return Ok((Timing { median: last }, result));
        }
        let per_call = last.max(Duration::from_nanos(20));
        // calls of seconds each: fewer runs, within a budget per measurement (at least one)
        let budget = if self.quick { 4.0 } else { 30.0 };
        runs = runs.min(((budget / per_call.as_secs_f64()) as usize).max(1));
        let iters =
            ((run_len.as_secs_f64() / per_call.as_secs_f64()).ceil() as usize).clamp(1, 1_000_000);
        let pb = bar((runs * iters) as u64, msg.to_string());
        pb.set_draw_target(
            match per_call * (runs * iters) as u32 > Duration::from_millis(500) {
                true => indicatif::ProgressDrawTarget::stderr(),
                false => indicatif::ProgressDrawTarget::hidden(),
            },
        );
        let mut times = Vec::with_capacity(runs);
        for _ in 0..runs {
            let t = Instant::now();
            for _ in 0..iters {
                result = black_box(f()?);
            }
            self.sync();
            times.push(t.elapsed() / iters as u32);
            pb.inc(iters as u64);
        }
        pb.finish_and_clear();
        times.sort();
        let median = times[times.len() / 2];
        Ok((Timing { median }, result))
    }
}

/// max |a − b| over every element (a compiled result against eager's; on the host, in f64).
pub fn max_abs_diff(a: &kiln::Tensor, b: &kiln::Tensor) -> kiln::Result<f64> {
    let (a, b) = (a.to_vec_f64()?, b.to_vec_f64()?);
    Ok(a.iter()
        .zip(&b)
        .fold(0.0f64, |m, (p, q)| m.max((p - q).abs())))
}
