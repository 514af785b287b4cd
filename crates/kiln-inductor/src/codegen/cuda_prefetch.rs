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
//! Staged (`KILN_PREFETCH_STAGED=1`; off by default, since no gain was shown: `staged_on`): a
//! compile of several graphs (a training step's forward and backward) remembers its first
//! graph's units apart (`GRAPH_END`). The next start loads them first, then readies the forward
//! convolutions, then loads the rest and readies the other convolutions; its compile waits for
//! nothing (`staged`): its kernels resolve at their first launch, the first graph's after the
//! first stage (`wait_first`), the others' after all units (`cuda_pending.rs`). Unstaged, the
//! same manifest's units all load first, then all its convolutions.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
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

/// Whether a prefetch loads in stages (`KILN_PREFETCH_STAGED=1`; off by default). On the H200
/// its first launch came at 12.3 ms instead of ~14.9, but the launches then took turns with the
/// backward's module loads, and over two calls of 8 interleaved warm starts of DenseNet-121's
/// training step the medians went 49.3 → 47.5 ms and 49.6 → 50.1 ms, with runs up to 67 ms:
/// no gain shown (BENCHMARKS.md, twenty-fourth session).
fn staged_on() -> bool {
    std::env::var_os("KILN_PREFETCH_STAGED").is_some_and(|v| v == "1")
}

/// Prefetch threads still loading, counted, for `wait` and `wait_units` (which several threads
/// may call).
static RUNNING: Mutex<Running> = Mutex::new(Running {
    first: 0,
    units: 0,
    all: 0,
});
static FINISHED: Condvar = Condvar::new();
/// Whether a prefetch of this process loads in stages (`staged`).
static STAGED: AtomicBool = AtomicBool::new(false);

/// Prefetch threads still in their first stage (the first graph's units and the forward
/// convolutions), still loading units, and still running at all (units or convolutions).
struct Running {
    first: usize,
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

fn first_phase(r: &mut Running) -> &mut usize {
    &mut r.first
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
    start_from(rt, device, &manifest, staged_on());
}

/// Starts the prefetch of `manifest`'s units and convolutions: in stages where `stages` allows
/// it and the manifest remembered a first graph's units apart, else all units, then all
/// convolutions.
fn start_from(rt: Arc<dyn DeviceRuntime>, device: Device, manifest: &Manifests, stages: bool) {
    let (mut first, mut rest) = manifest.units.read().map(|t| parse(&t)).unwrap_or_default();
    let convs = manifest.convs.read().unwrap_or_default();
    if first.is_empty() && rest.is_empty() && convs.is_empty() {
        return;
    }
    let staged = stages && !rest.is_empty();
    if !staged {
        first.append(&mut rest);
    }
    if staged {
        STAGED.store(true, Ordering::Relaxed);
    }
    // counted here, so a `wait` right after this returns finds them
    let phases = (
        Phase::start(all_phases),
        Phase::start(units_phase),
        Phase::start(first_phase),
    );
    let _ = std::thread::Builder::new()
        .name("kiln-prefetch".into())
        .spawn(move || {
            let (_all, loading, first_stage) = phases;
            let decode = || conv_warmup::decode(convs.lines(), device);
            // the convolutions readied after every unit
            let mut later = None;
            {
                let _loading = loading;
                {
                    let _first_stage = first_stage;
                    load_units(rt.as_ref(), device, &first, staged);
                    if staged {
                        // the forward's convolutions before the other graphs' units
                        let (forward, others): (Vec<_>, Vec<_>) =
                            decode().into_iter().partition(|c| c.is_forward());
                        ready(rt.as_ref(), &forward);
                        later = Some(others);
                    }
                }
                load_units(rt.as_ref(), device, &rest, staged);
            }
            ready(rt.as_ref(), &later.unwrap_or_else(decode));
        });
    // a thread that did not start dropped its phases with its closure
}

/// The prefetch thread's loads of `units`; best effort: what fails here is loaded (or
/// reported) by the compile itself.
fn load_units(rt: &dyn DeviceRuntime, device: Device, units: &UnitIds, staged: bool) {
    if units.is_empty() {
        return;
    }
    let _span = profiler::span(profiler::Category::Compile, || {
        let stage = if staged { " (a stage)" } else { "" };
        format!("inductor: {} units prefetched{stage}", units.len()).into()
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

/// Whether a prefetch of this process loads in stages (its manifest remembered a first graph's
/// units apart): a compile then waits for nothing, its kernels resolving at their first launch
/// (`cuda_pending.rs`), and its convolution warm-up readies the first graph's alone.
pub(crate) fn staged() -> bool {
    STAGED.load(Ordering::Relaxed)
}

/// Waits until every prefetch started so far has passed its first stage: the first graph's
/// units loaded and the forward convolutions readied.
pub(crate) fn wait_first() {
    wait_for(first_phase);
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
/// this process remembered there before: those of the compile's first graph (`first`) first,
/// then, where a compile had several graphs, `GRAPH_END` and the others'.
pub(crate) fn remember(
    manifest: &Manifest,
    rt: &Arc<dyn DeviceRuntime>,
    device: Device,
    units: &[(String, Vec<String>)],
    first: &[bool],
) {
    let (mut lines, mut others) = (Vec::new(), Vec::new());
    for ((src, names), &is_first) in units.iter().zip(first) {
        if let Some(id) = rt.unit_id(device, src) {
            let group = if is_first { &mut lines } else { &mut others };
            group.push(unit_line(&id, names));
        }
    }
    if !others.is_empty() {
        lines.push(GRAPH_END.to_string());
    }
    remember_lines(manifest, lines.into_iter().chain(others));
}

/// The line of a units manifest that ends the first graph's units.
const GRAPH_END: &str = "-";

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

/// A units manifest's units: the first graph's, and the others' (after `GRAPH_END`; none
/// where the manifest has no such line).
fn parse(text: &str) -> (UnitIds, UnitIds) {
    let (mut first, mut rest) = (UnitIds::new(), UnitIds::new());
    let mut group = &mut first;
    for line in text.lines() {
        if line == GRAPH_END {
            group = &mut rest;
            continue;
        }
        let Some((id, names)) = line.split_once('\t') else {
            continue;
        };
        let names: Vec<String> = names.split_whitespace().map(str::to_string).collect();
        if !id.is_empty() && !names.is_empty() {
            group.push((id.to_string(), names));
        }
    }
    (first, rest)
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

    /// A runtime with no device, and the same as the trait object the prefetch takes.
    fn no_device() -> (Arc<Units>, Arc<dyn DeviceRuntime>) {
        let runtime = Arc::new(Units::default());
        (runtime.clone(), runtime)
    }

    /// Each convolution `runtime` readied, by its batch size, with the units loaded by then.
    fn readied(runtime: &Units) -> Vec<(usize, usize)> {
        let prepared = runtime.prepared.lock().unwrap();
        prepared
            .iter()
            .map(|(shapes, units)| (shapes[0][0], *units))
            .collect()
    }

    /// What one process's compiles remember (accumulated, each unit and each convolution once)
    /// is what the next process's trace start hands the runtime to load, ids and kernel names
    /// alike, then the convolutions to ready, once the units are loaded.
    #[test]
    fn remembered_units_are_prefetched_by_the_next_start() {
        let dir = Folder::new("prefetch");
        let path = manifest_under(&dir.0, "DenseNet", "default", "H200");
        let (runtime, rt) = no_device();
        let device = Device::Cuda(0);
        remember(
            &path.units,
            &rt,
            device,
            &[unit("src a", &["a0", "a1"]), unit("src b", &["b0"])],
            &[true, true],
        );
        remember(
            &path.units,
            &rt,
            device,
            &[unit("src b", &["b0"]), unit("src c", &["c0"])],
            &[true, true],
        );
        let conv = |n: usize| conv_warmup::Conv::of(&[&[n, 8, 8, 16], &[32, 3, 3, 16]], device);
        remember_convs(&path.convs, conv_warmup::encode(&[conv(1), conv(2)]));
        remember_convs(&path.convs, conv_warmup::encode(&[conv(2), conv(3)]));
        start_from(rt.clone(), device, &path, false);
        wait();
        let got = runtime.prefetched.lock().unwrap().clone();
        let want = vec![
            unit("id:src a", &["a0", "a1"]),
            unit("id:src b", &["b0"]),
            unit("id:src c", &["c0"]),
        ];
        assert_eq!(got, want);
        assert_eq!(readied(&runtime), vec![(1, 3), (2, 3), (3, 3)]);
        // no manifest: nothing started
        start_from(
            rt,
            device,
            &manifest_under(&dir.0, "ResNet", "default", "H200"),
            false,
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
        assert_eq!(parse(&text), (units.clone(), vec![]));
        // damaged lines are skipped, the rest kept
        let text = "aa11 bb22\tk_1 kl_2\nno tab here\n\tk_9\ncc33 dd44\t\ncc33 dd44\tk_3\n";
        assert_eq!(parse(text), (units.clone(), vec![]));
        // the first graph's units, then the others'
        let text = format!("aa11 bb22\tk_1 kl_2\n{GRAPH_END}\ncc33 dd44\tk_3\n");
        assert_eq!(parse(&text), (units[..1].to_vec(), units[1..].to_vec()));
        let text = format!("{GRAPH_END}\ncc33 dd44\tk_3\n");
        assert_eq!(parse(&text), (vec![], units[1..].to_vec()));
    }

    /// A compile of several graphs remembers its first graph's units apart; the next start, in
    /// stages, loads them first, readies the forward convolutions, then loads the other units
    /// and readies the gradients' convolutions, and says it is staged. Unstaged, it loads the
    /// units, then readies the convolutions, as a manifest without the split.
    #[test]
    fn a_staged_prefetch_loads_the_first_graph_and_its_convolutions_first() {
        let dir = Folder::new("staged");
        let path = manifest_under(&dir.0, "DenseNet", "default", "H200");
        let (runtime, rt) = no_device();
        let device = Device::Cuda(0);
        let units = [
            unit("src a", &["a0"]),
            unit("src b", &["b0"]),
            unit("src c", &["c0", "c1"]),
        ];
        remember(&path.units, &rt, device, &units, &[true, false, true]);
        let forward = |n: usize| conv_warmup::Conv::of(&[&[n, 8, 8, 16], &[32, 3, 3, 16]], device);
        let gradient =
            conv_warmup::Conv::data_gradient_of(&[&[2, 8, 8, 32], &[32, 3, 3, 16]], device);
        remember_convs(
            &path.convs,
            conv_warmup::encode(&[forward(1), gradient, forward(3)]),
        );
        start_from(rt.clone(), device, &path, true);
        assert!(staged());
        wait();
        let got = runtime.prefetched.lock().unwrap().clone();
        let want = vec![
            unit("id:src a", &["a0"]),
            unit("id:src c", &["c0", "c1"]),
            unit("id:src b", &["b0"]),
        ];
        assert_eq!(got, want);
        // the forward convolutions once the first graph's two units are loaded, the gradient
        // once all three are
        assert_eq!(readied(&runtime), vec![(1, 2), (3, 2), (2, 3)]);
        // unstaged, the same manifest: every unit in its order, then every convolution
        let (runtime, rt) = no_device();
        start_from(rt, device, &path, false);
        wait();
        assert_eq!(*runtime.prefetched.lock().unwrap(), want);
        assert_eq!(readied(&runtime), vec![(1, 3), (2, 3), (3, 3)]);
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
