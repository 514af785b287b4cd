//! Warm starts: a compiled function's kernel units loaded while its code is still being traced.
//! A new process that finds a training step's compile on disk first spends ~10 ms recording the
//! user's code, the driver idle, then reads the plans and loads their units (DenseNet-121's: 12
//! ms, one module at a time). The units a function's compiles loaded are remembered in a small
//! manifest under the cache folder, keyed by the function's name, the mode, the device and the
//! build; when the next process starts tracing that function (`Backend::trace_starting`), a
//! thread of its own loads them (`DeviceRuntime::prefetch_units`), and `cuda_units::load` waits
//! for it before loading what is left. A manifest that no longer matches the graphs only loads
//! units nobody asks for: a unit is found by its source's hash.
//!
//! On by default (`KILN_PREFETCH_UNITS=0` turns it off): DenseNet-121's training warm start on
//! the H200, generated convolutions, 82.6 → 70.5 ms median (BENCHMARKS.md).
//!
//! The function's convolutions are remembered beside its units (a manifest of their own), and
//! the same thread readies them once the units are loaded (`conv_warmup::prepare`: the modules
//! of those on kiln's generated kernels). The compile's loads wait for the units only
//! (`wait_units`); the convolutions' warm-up, whose module loads would take turns with these,
//! waits for everything (`wait`).
//!
//! Everything is loaded before the first launch: the driver's module loads and function lookups
//! beside a running step stall it (a lookup at a kernel's first launch took up to 13 ms on the
//! H200), and a prefetch in stages, the forward's units first and the backward's beside the
//! forward's launches, showed no gain (BENCHMARKS.md, twenty-fourth and twenty-fifth sessions).

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};

use kiln_compile::prefetch::Manifest;
use kiln_compile::BackendContext;
use kiln_core::device::{runtime_for, DeviceRuntime};
use kiln_core::{profiler, Device, Tensor};

use crate::runtime::conv_warmup;

/// Whether the prefetch is on (`KILN_PREFETCH_UNITS=0` turns it off).
pub fn enabled() -> bool {
    std::env::var_os("KILN_PREFETCH_UNITS").map_or(true, |v| v != "0")
}

/// Prefetch threads still loading, counted, for `wait` and `wait_units` (which several threads
/// may call).
static RUNNING: Mutex<Running> = Mutex::new(Running { units: 0, all: 0 });
static FINISHED: Condvar = Condvar::new();

/// Prefetch threads still loading units, and still running at all (units or convolutions).
struct Running {
    units: usize,
    all: usize,
}

/// Counts a prefetch thread's phase off however it ends, a panic included.
struct Phase(fn(&mut Running) -> &mut usize);

impl Phase {
    fn start(count: fn(&mut Running) -> &mut usize) -> Phase {
        *count(&mut RUNNING.lock().unwrap_or_else(|e| e.into_inner())) += 1;
        Phase(count)
    }
}

impl Drop for Phase {
    fn drop(&mut self) {
        *(self.0)(&mut RUNNING.lock().unwrap_or_else(|e| e.into_inner())) -= 1;
        FINISHED.notify_all();
    }
}

fn units_phase(r: &mut Running) -> &mut usize {
    &mut r.units
}

fn all_phases(r: &mut Running) -> &mut usize {
    &mut r.all
}

/// Units by id, each with its kernels' names.
type UnitIds = Vec<(String, Vec<String>)>;

/// Each manifest's lines (units, convolutions) as this process has remembered them so far (a
/// function compiles several graphs: a forward and a backward, the segments around a graph
/// break).
fn remembered() -> &'static Mutex<HashMap<Manifest, Vec<String>>> {
    static R: std::sync::OnceLock<Mutex<HashMap<Manifest, Vec<String>>>> =
        std::sync::OnceLock::new();
    R.get_or_init(Default::default)
}

/// Writes `manifest` with the lines this process remembered there before and the new ones among
/// `lines`, each once, in the order they came.
fn remember_lines(manifest: &Manifest, lines: impl IntoIterator<Item = String>) {
    let text = {
        let mut all = remembered().lock().unwrap_or_else(|e| e.into_inner());
        let list = all.entry(manifest.clone()).or_default();
        for line in lines {
            if !list.contains(&line) {
                list.push(line);
            }
        }
        list.iter().map(|l| format!("{l}\n")).collect::<String>()
    };
    manifest.write(&text);
}

/// Where a function's warm start is remembered: the units its compiles loaded, and the
/// convolutions its graphs run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Manifests {
    pub units: Manifest,
    pub convs: Manifest,
}

/// Where the units and convolutions of the function `ctx` names, compiled on `device`, are
/// remembered; `None` when the prefetch is off or the device's runtime cannot name its model.
pub(crate) fn manifest(ctx: &BackendContext, device: Device) -> Option<Manifests> {
    if !enabled() || device == Device::Cpu {
        return None;
    }
    let rt = runtime_for("prefetch", device).ok()?;
    Some(manifest_under(
        &kiln_core::cache::cache_root(),
        &ctx.name,
        &ctx.mode,
        &rt.device_key(device)?,
    ))
}

fn manifest_under(root: &std::path::Path, name: &str, mode: &str, device_key: &str) -> Manifests {
    let settings = crate::plan_cache::build_and_settings();
    let identity: [&[u8]; 4] = [
        name.as_bytes(),
        mode.as_bytes(),
        device_key.as_bytes(),
        settings.as_bytes(),
    ];
    Manifests {
        units: Manifest::under(root, "cuda-units", &identity),
        convs: Manifest::under(root, "cuda-convs", &identity),
    }
}

/// Starts loading, on a thread of its own, the units the function `ctx` names loaded when it
/// was last compiled on the device of `args`.
pub(crate) fn start(ctx: &BackendContext, args: &[Tensor]) {
    let Some(device) = args.iter().map(Tensor::device).find(|&d| d != Device::Cpu) else {
        return;
    };
    let Some(manifest) = manifest(ctx, device) else {
        return;
    };
    if !manifest.units.first_use() {
        return;
    }
    let Ok(rt) = runtime_for("prefetch", device) else {
        return;
    };
    start_from(rt, device, &manifest);
}

/// Starts the prefetch of `manifest`'s units, then its convolutions.
fn start_from(rt: Arc<dyn DeviceRuntime>, device: Device, manifest: &Manifests) {
    let units = manifest.units.read().map(|t| parse(&t)).unwrap_or_default();
    let convs = manifest.convs.read().unwrap_or_default();
    if units.is_empty() && convs.is_empty() {
        return;
    }
    // counted here, so a `wait` right after this returns finds them
    let (all, loading) = (Phase::start(all_phases), Phase::start(units_phase));
    let _ = std::thread::Builder::new()
        .name("kiln-prefetch".into())
        .spawn(move || {
            let _all = all;
            {
                let _loading = loading;
                load_units(rt.as_ref(), device, &units);
            }
            ready(rt.as_ref(), &conv_warmup::decode(convs.lines(), device));
        });
    // a thread that did not start dropped its phases with its closure
}

/// The prefetch thread's loads of `units`; best effort: what fails here is loaded (or
/// reported) by the compile itself.
fn load_units(rt: &dyn DeviceRuntime, device: Device, units: &UnitIds) {
    if units.is_empty() {
        return;
    }
    let _span = profiler::span(profiler::Category::Compile, || {
        format!("inductor: {} units prefetched", units.len()).into()
    });
    let _ = rt.prefetch_units(device, units);
}

/// The prefetch thread's readying of `convs`.
fn ready(rt: &dyn DeviceRuntime, convs: &[conv_warmup::Conv]) {
    if convs.is_empty() {
        return;
    }
    let _span = profiler::span(profiler::Category::Compile, || {
        format!("inductor: {} convolutions readied ahead", convs.len()).into()
    });
    conv_warmup::prepare(rt, convs);
}

/// Waits until every prefetch started so far has ended, its convolutions readied: before the
/// convolutions' warm-up loads their modules (the driver loads one module at a time: two
/// threads loading at once only slow each other).
pub(crate) fn wait() {
    wait_for(all_phases);
}

/// Waits until every prefetch started so far has loaded its units: before a compile loads its
/// units (what a prefetch is loading is then found loaded, not loaded twice).
pub(crate) fn wait_units() {
    wait_for(units_phase);
}

fn wait_for(count: fn(&mut Running) -> &mut usize) {
    let mut running = RUNNING.lock().unwrap_or_else(|e| e.into_inner());
    while *count(&mut running) > 0 {
        running = FINISHED.wait(running).unwrap_or_else(|e| e.into_inner());
    }
}

/// Remembers `units` (source, kernel names), loaded on `device`, in `manifest`, with the units
/// this process remembered there before.
pub(crate) fn remember(
    manifest: &Manifest,
    rt: &Arc<dyn DeviceRuntime>,
    device: Device,
    units: &[(String, Vec<String>)],
) {
    let lines = units
        .iter()
        .filter_map(|(src, names)| Some(unit_line(&rt.unit_id(device, src)?, names)));
    remember_lines(manifest, lines);
}

/// Remembers `convs` (`conv_warmup::encode`'s lines) in `manifest`, with the convolutions this
/// process remembered there before.
pub(crate) fn remember_convs(manifest: &Manifest, convs: Vec<String>) {
    remember_lines(manifest, convs);
}

/// Runs `remember`ing work (hashing sources, writing a manifest) on a thread of its own, off
/// the compile's path to its first launch. Best effort, as the manifests themselves: where no
/// thread can be started, nothing is remembered.
pub(crate) fn off_the_path(work: impl FnOnce() + Send + 'static) {
    let _ = std::thread::Builder::new()
        .name("kiln-prefetch-memo".into())
        .spawn(work);
}

/// A unit's line: its id, a tab, its kernels' names separated by spaces.
fn unit_line(id: &str, names: &[String]) -> String {
    format!("{id}\t{}", names.join(" "))
}

/// A units manifest's units; damaged lines (an earlier build's, too) are skipped.
fn parse(text: &str) -> UnitIds {
    text.lines()
        .filter_map(|line| {
            let (id, names) = line.split_once('\t')?;
            let names: Vec<String> = names.split_whitespace().map(str::to_string).collect();
            (!id.is_empty() && !names.is_empty()).then(|| (id.to_string(), names))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::test_runtime::{unit, Units};

    /// A cache folder of the test's own, removed when dropped.
    struct Folder(std::path::PathBuf);

    impl Folder {
        fn new(tag: &str) -> Folder {
            let name = format!("kiln-{tag}-{}", std::process::id());
            Folder(std::env::temp_dir().join(name))
        }
    }

    impl Drop for Folder {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// What one process's compiles remember (accumulated, each unit and each convolution once)
    /// is what the next process's trace start hands the runtime to load, ids and kernel names
    /// alike, then the convolutions to ready, once the units are loaded.
    #[test]
    fn remembered_units_are_prefetched_by_the_next_start() {
        let dir = Folder::new("prefetch");
        let path = manifest_under(&dir.0, "DenseNet", "default", "H200");
        let runtime = Arc::new(Units::default());
        let rt: Arc<dyn DeviceRuntime> = runtime.clone();
        let device = Device::Cuda(0);
        remember(
            &path.units,
            &rt,
            device,
            &[unit("src a", &["a0", "a1"]), unit("src b", &["b0"])],
        );
        remember(
            &path.units,
            &rt,
            device,
            &[unit("src b", &["b0"]), unit("src c", &["c0"])],
        );
        let conv = |n: usize| conv_warmup::Conv::of(&[&[n, 8, 8, 16], &[32, 3, 3, 16]], device);
        remember_convs(&path.convs, conv_warmup::encode(&[conv(1), conv(2)]));
        let on_generated = conv(3).on_generated();
        remember_convs(&path.convs, conv_warmup::encode(&[conv(2), on_generated]));
        start_from(rt.clone(), device, &path);
        wait();
        let got = runtime.prefetched.lock().unwrap().clone();
        let want = vec![
            unit("id:src a", &["a0", "a1"]),
            unit("id:src b", &["b0"]),
            unit("id:src c", &["c0"]),
        ];
        assert_eq!(got, want);
        // each convolution readied, by its batch size, with the units loaded by then and the
        // engine its function chose
        let readied: Vec<(usize, usize, bool)> = runtime
            .prepared
            .lock()
            .unwrap()
            .iter()
            .map(|(shapes, units, generated)| (shapes[0][0], *units, *generated))
            .collect();
        assert_eq!(readied, vec![(1, 3, false), (2, 3, false), (3, 3, true)]);
        // no manifest: nothing started
        start_from(
            rt,
            device,
            &manifest_under(&dir.0, "ResNet", "default", "H200"),
        );
        wait();
        assert_eq!(runtime.prefetched.lock().unwrap().len(), 3);
    }

    #[test]
    fn manifests_read_back_what_was_written() {
        let units = vec![
            (
                "aa11 bb22".to_string(),
                vec!["k_1".to_string(), "kl_2".to_string()],
            ),
            ("cc33 dd44".to_string(), vec!["k_3".to_string()]),
        ];
        let text: String = units
            .iter()
            .map(|(id, names)| unit_line(id, names) + "\n")
            .collect();
        assert_eq!(parse(&text), units);
        // damaged lines are skipped, the rest kept
        let text = "aa11 bb22\tk_1 kl_2\nno tab here\n\tk_9\ncc33 dd44\t\ncc33 dd44\tk_3\n";
        assert_eq!(parse(text), units);
    }

    #[test]
    fn a_manifest_is_keyed_by_function_mode_and_device() {
        let root = std::path::Path::new("/cache");
        let p = |n, m, d| manifest_under(root, n, m, d);
        let base = p("DenseNet", "default", "H200 compute_90 132sm");
        assert_ne!(base, p("ResNet", "default", "H200 compute_90 132sm"));
        assert_ne!(
            base,
            p("DenseNet", "reduce-overhead", "H200 compute_90 132sm")
        );
        assert_ne!(base, p("DenseNet", "default", "H100 compute_90 132sm"));
        assert_eq!(base, p("DenseNet", "default", "H200 compute_90 132sm"));
        assert_ne!(base.units, base.convs);
        assert_eq!(
            base.units,
            Manifest::under(
                root,
                "cuda-units",
                &[
                    b"DenseNet",
                    b"default",
                    b"H200 compute_90 132sm",
                    crate::plan_cache::build_and_settings().as_bytes()
                ]
            )
        );
    }
}
