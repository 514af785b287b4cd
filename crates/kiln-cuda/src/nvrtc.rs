//! Kernels from generated CUDA C: compiled by NVRTC at the first use of each signature, then kept in
//! memory per device (by signature, so a hit costs one map lookup and no source text is built) and
//! on disk (by the hash of source + target + NVRTC version) under `KILN_CACHE_DIR/cuda`, with the CPU
//! kernel cache's rules: atomic writes (temporary file, then rename), a checksum beside each entry,
//! a mismatching or unloadable entry rebuilt.
//!
//! NVRTC compiles straight to the device's machine code (a CUBIN for `sm_XY`, or `sm_XYa`), which
//! is what the disk cache keeps: loading PTX instead would have the driver assemble it again in
//! every process.
//! No lock is held while NVRTC runs, so the compiler's translation units build on parallel threads.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys};
use cudarc::nvrtc::result as nvrtc;
use cudarc::nvrtc::sys as nvrtc_sys;
use kiln_core::{Device, Error, Result};

use crate::device::{cu_err, CudaDevice};

/// Every generated kernel's entry point is named this.
pub(crate) const ENTRY: &str = "k";

static COMPILES: AtomicU64 = AtomicU64::new(0);
static DISK_HITS: AtomicU64 = AtomicU64::new(0);
static COMPILE_NS: AtomicU64 = AtomicU64::new(0);
static LOAD_NS: AtomicU64 = AtomicU64::new(0);
static LOOKUP_NS: AtomicU64 = AtomicU64::new(0);
static READ_NS: AtomicU64 = AtomicU64::new(0);

/// (NVRTC compilations, disk-cache hits) so far in this process.
pub fn kernel_cache_stats() -> (u64, u64) {
    (
        COMPILES.load(Ordering::Relaxed),
        DISK_HITS.load(Ordering::Relaxed),
    )
}

/// Time spent so far in this process (summed over threads): NVRTC compiling, and the driver
/// loading modules onto devices. What a cold compile of a graph on a GPU costs, apart from the
/// compiler's own work.
pub fn kernel_compile_times() -> (Duration, Duration) {
    (
        Duration::from_nanos(COMPILE_NS.load(Ordering::Relaxed)),
        Duration::from_nanos(LOAD_NS.load(Ordering::Relaxed)),
    )
}

/// Time spent so far in this process (summed over threads) readying built kernels: reading and
/// checking cubins from the disk cache, the driver loading modules, and looking functions up in
/// them.
pub fn kernel_load_times() -> (Duration, Duration, Duration) {
    let t = |c: &AtomicU64| Duration::from_nanos(c.load(Ordering::Relaxed));
    (t(&READ_NS), t(&LOAD_NS), t(&LOOKUP_NS))
}

/// The kernel for `signature` on `dev`, generating its source with `source` on a miss.
pub(crate) fn kernel(
    dev: &Arc<CudaDevice>,
    signature: &str,
    source: impl FnOnce() -> String,
) -> Result<sys::CUfunction> {
    if let Some(&f) = dev
        .kernels
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(signature)
    {
        return Ok(f);
    }
    let module = load_module(dev, signature, &source())?;
    let f = function(dev, module, signature, ENTRY)?;
    dev.kernels
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(signature.to_string(), f);
    Ok(f)
}

/// The kernels `names` of a generated translation unit (the compiler's code generator), loaded
/// once per device and source text: the module is kept by the hash of `src`.
pub(crate) fn module_kernels(
    dev: &Arc<CudaDevice>,
    src: &str,
    names: &[String],
) -> Result<Vec<sys::CUfunction>> {
    let key = unit_key(src);
    if let Some(fs) = loaded(dev, &key, names) {
        return Ok(fs);
    }
    load_unit(dev, &key, &cubin_for(dev, &key, src)?, names)
}

/// For each unit (source, kernel names), its kernels where its machine code is loaded or on
/// disk, `None` where NVRTC would have to build it (`from_disk`).
pub(crate) fn built_units(
    dev: &Arc<CudaDevice>,
    units: &[(String, Vec<String>)],
) -> Result<Vec<Option<Vec<sys::CUfunction>>>> {
    let on_disk: Vec<OnDisk<'_>> = units
        .iter()
        .map(|(src, names)| OnDisk {
            key: unit_key(src),
            cubin: Cubin::OfSource(src),
            names,
        })
        .collect();
    from_disk(dev, &on_disk)
}

/// The id `prefetch_units` loads `src`'s unit by: the source's hash, then its cubin's key.
pub(crate) fn unit_id(dev: &CudaDevice, src: &str) -> String {
    format!("{} {}", checksum(src.as_bytes()), cubin_key(dev, src))
}

/// Loads the units `ids` names (from `unit_id`) from the disk cache, so that `built_units` of
/// their sources finds them loaded. An id that is malformed or whose cubin is missing or damaged
/// is skipped.
pub(crate) fn prefetch_units(dev: &Arc<CudaDevice>, ids: &[(String, Vec<String>)]) -> Result<()> {
    let hex = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_hexdigit());
    let on_disk: Vec<OnDisk<'_>> = ids
        .iter()
        .filter_map(|(id, names)| {
            let (src_hash, cubin) = id.split_once(' ')?;
            (hex(src_hash) && hex(cubin)).then(|| OnDisk {
                key: unit_key_of(src_hash),
                cubin: Cubin::Key(cubin),
                names,
            })
        })
        .collect();
    from_disk(dev, &on_disk).map(drop)
}

/// A unit to load from the disk cache: the key its kernels are kept under (`unit_key`), its
/// cubin, and its kernels' names.
struct OnDisk<'a> {
    key: String,
    cubin: Cubin<'a>,
    names: &'a [String],
}

/// Which cubin a unit's machine code is.
enum Cubin<'a> {
    /// The one built from this source (its key hashed only where the unit is not loaded yet).
    OfSource(&'a str),
    /// The one kept under this key (`cubin_key`).
    Key(&'a str),
}

/// Each unit's kernels: loaded already, or loaded now from its cubin on disk; `None` where the
/// disk has no verified cubin. The cubins are read and checked on a few threads (two file reads
/// and a hash each: DenseNet-121's 67 took ~5 ms one after the other) and loaded in order on
/// this thread as they arrive: the driver loads one module at a time, and need not wait for the
/// last read to start.
fn from_disk(
    dev: &Arc<CudaDevice>,
    units: &[OnDisk<'_>],
) -> Result<Vec<Option<Vec<sys::CUfunction>>>> {
    let mut out: Vec<Option<Vec<sys::CUfunction>>> =
        units.iter().map(|u| loaded(dev, &u.key, u.names)).collect();
    let missing: Vec<usize> = (0..units.len()).filter(|&i| out[i].is_none()).collect();
    let read = |&i: &usize| match units[i].cubin {
        Cubin::OfSource(src) => read_cubin(&cubin_key(dev, src)),
        Cubin::Key(key) => read_cubin(key),
    };
    for_each_on_threads(&missing, READ_THREADS, read, |k, image| {
        if let Some(image) = image {
            let u = &units[missing[k]];
            out[missing[k]] = Some(load_unit(dev, &u.key, &image, u.names)?);
        }
        Ok(())
    })?;
    Ok(out)
}

/// Most threads reading cubins from the disk cache at once (`built_units`).
const READ_THREADS: usize = 8;

/// `f` of each item, on at most `threads` threads (the k-th item on thread k % threads), handed
/// to `each` with its index in the items' order, each as soon as it is done: `None` for the
/// items a thread left undone (it panicked). The first error of `each` ends the walk (the
/// threads stop after their current item).
fn for_each_on_threads<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    f: impl Fn(&T) -> Option<R> + Sync,
    mut each: impl FnMut(usize, Option<R>) -> Result<()>,
) -> Result<()> {
    let threads = items.len().clamp(1, threads.max(1));
    std::thread::scope(|s| {
        let f = &f;
        // a channel a thread: its items arrive in order, and a thread that panicked closes it
        let (workers, results): (Vec<_>, Vec<_>) = (0..threads)
            .map(|t| {
                let (tx, rx) = std::sync::mpsc::channel();
                let worker = s.spawn(move || {
                    for item in items.iter().skip(t).step_by(threads) {
                        if tx.send(f(item)).is_err() {
                            return;
                        }
                    }
                });
                (worker, rx)
            })
            .unzip();
        let walked =
            (0..items.len()).try_for_each(|k| each(k, results[k % threads].recv().ok().flatten()));
        drop(results);
        // joined here, so a thread's panic stays its items' `None`
        for w in workers {
            let _ = w.join();
        }
        walked
    })
}

/// The key a unit's loaded kernels are kept under: inside a fresh-cache scope (cold-compile
/// measurements) a module loaded before is not reused.
fn unit_key(src: &str) -> String {
    unit_key_of(&checksum(src.as_bytes()))
}

/// `unit_key` of the source whose hash is `src_hash`.
fn unit_key_of(src_hash: &str) -> String {
    format!("gen:{}:{src_hash}", kiln_core::cache::scope_id())
}

/// The unit's kernels, if this process has loaded them on `dev` (under `unit_key`).
fn loaded(dev: &CudaDevice, key: &str, names: &[String]) -> Option<Vec<sys::CUfunction>> {
    let table = dev.kernels.lock().unwrap_or_else(|e| e.into_inner());
    names
        .iter()
        .map(|n| table.get(&format!("{key}:{n}")).copied())
        .collect()
}

/// Loads a unit's machine code on `dev` and looks its kernels up, keeping them under `key`.
fn load_unit(
    dev: &Arc<CudaDevice>,
    key: &str,
    image: &[u8],
    names: &[String],
) -> Result<Vec<sys::CUfunction>> {
    let module = load_image(dev, image)?;
    let fs = names
        .iter()
        .map(|n| function(dev, module, key, n))
        .collect::<Result<Vec<_>>>()?;
    let mut table = dev.kernels.lock().unwrap_or_else(|e| e.into_inner());
    for (n, &f) in names.iter().zip(&fs) {
        table.insert(format!("{key}:{n}"), f);
    }
    Ok(fs)
}

/// `src` compiled for `dev` (from the disk cache when there) and loaded; the module stays loaded
/// for the process.
fn load_module(dev: &Arc<CudaDevice>, signature: &str, src: &str) -> Result<sys::CUmodule> {
    load_image(dev, &cubin_for(dev, signature, src)?)
}

/// A CUBIN loaded on `dev`; the module stays loaded for the process.
fn load_image(dev: &Arc<CudaDevice>, image: &[u8]) -> Result<sys::CUmodule> {
    dev.bind()?;
    let start = Instant::now();
    // SAFETY: `image` is a complete CUBIN, alive for the call
    let module = unsafe { result::module::load_data(image.as_ptr().cast()) }
        .map_err(|e| cu_err("cuModuleLoadData", dev.ordinal, e))?;
    LOAD_NS.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    Ok(module)
}

fn function(
    dev: &CudaDevice,
    module: sys::CUmodule,
    signature: &str,
    name: &str,
) -> Result<sys::CUfunction> {
    let c = CString::new(name).map_err(|_| compile_err(signature, "bad kernel name"))?;
    let start = Instant::now();
    // SAFETY: the module is loaded; the name is NUL-terminated
    let f = unsafe { result::module::get_function(module, c) }
        .map_err(|e| cu_err("cuModuleGetFunction", dev.ordinal, e));
    LOOKUP_NS.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    f
}

fn compile_err(signature: &str, msg: impl std::fmt::Display) -> Error {
    Error::Device {
        op: "cuda kernel",
        lhs: Device::Cpu,
        rhs: Device::Cuda(0),
        msg: format!("generating the kernel `{signature}` failed: {msg}"),
    }
}

fn nvrtc_version() -> String {
    let (mut a, mut b) = (0, 0);
    // SAFETY: plain out-parameters; the library was opened by the probe
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut a, &mut b) };
    format!("{a}.{b}")
}

fn cache_dir() -> PathBuf {
    kiln_core::cache::cache_root().join("cuda")
}

pub(crate) fn checksum(bytes: &[u8]) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(bytes))
}

/// Builds `src` for `dev` into the disk cache, unless it is there; loads nothing (a thread that
/// prepares kernels for later makes no CUDA call).
pub(crate) fn build(dev: &CudaDevice, signature: &str, src: &str) -> Result<()> {
    if !on_disk(dev, src) {
        cubin_for(dev, signature, src)?;
    }
    Ok(())
}

/// Whether `src`'s machine code for `dev` is in the disk cache (a build would read it, not run
/// NVRTC).
pub(crate) fn on_disk(dev: &CudaDevice, src: &str) -> bool {
    cubin_paths(&cubin_key(dev, src)).0.exists()
}

/// A source that begins with this line is built for its device's arch-specific target (`sm_90a`):
/// it uses instructions of that architecture alone (wgmma), and its machine code runs nowhere
/// else.
pub(crate) const ARCH_SPECIFIC: &str = "// kiln: built for the arch-specific target\n";

/// The `sm_XY` (or `sm_XYa`) NVRTC builds `src` for on `dev`.
fn sm(dev: &CudaDevice, src: &str) -> String {
    let sm = dev.arch.replace("compute_", "sm_");
    match src.starts_with(ARCH_SPECIFIC) {
        true => sm + "a",
        false => sm,
    }
}

/// The key of `src`'s machine code for `dev` in the disk cache (`cubin_paths`).
fn cubin_key(dev: &CudaDevice, src: &str) -> String {
    cubin_key_of(src, &sm(dev, src), &nvrtc_version())
}

/// The checksum of "`src`|`sm`|`version`|cubin", hashed in parts: a unit's source is up to a
/// few hundred KB, not worth copying to hash.
fn cubin_key_of(src: &str, sm: &str, version: &str) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for part in [src, "|", sm, "|", version, "|cubin"] {
        h.update(part.as_bytes());
    }
    format!("{:032x}", h.digest128())
}

/// Where the cubin kept under `key` and its checksum are.
fn cubin_paths(key: &str) -> (PathBuf, PathBuf) {
    let dir = cache_dir();
    (
        dir.join(format!("{key}.cubin")),
        dir.join(format!("{key}.cubin.xxh3")),
    )
}

/// The cubin kept under `key` in the disk cache, where a verified entry exists.
fn read_cubin(key: &str) -> Option<Vec<u8>> {
    let start = Instant::now();
    let (path, sum_path) = cubin_paths(key);
    let image = read_verified(&path, &sum_path);
    READ_NS.fetch_add(start.elapsed().as_nanos() as u64, Ordering::Relaxed);
    let image = image?;
    DISK_HITS.fetch_add(1, Ordering::Relaxed);
    Some(image)
}

/// The device's machine code for `src`: from the disk cache when a verified entry exists, else
/// compiled by NVRTC and stored.
fn cubin_for(dev: &CudaDevice, signature: &str, src: &str) -> Result<Vec<u8>> {
    let key = cubin_key(dev, src);
    if let Some(image) = read_cubin(&key) {
        return Ok(image);
    }
    // inside a fresh-cache scope (a cold-compile measurement) NVRTC's own cache is bypassed too
    let fresh = kiln_core::cache::scope_id() != 0;
    let start = Instant::now();
    let image = compile_cubin(signature, src, &sm(dev, src), fresh)?;
    let took = start.elapsed();
    COMPILE_NS.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    if log_builds() {
        // what each build cost, to compare processes whose compiles of the same graphs differ
        let bypassed = fresh && NO_CACHE_OPTION.load(Ordering::Relaxed);
        eprintln!(
            "kiln nvrtc: {} source {} bytes, {:.3} s, {} cubin bytes{}",
            &key[..12],
            src.len(),
            took.as_secs_f64(),
            image.len(),
            if bypassed {
                ", NVRTC's cache bypassed"
            } else {
                ""
            }
        );
    }
    COMPILES.fetch_add(1, Ordering::Relaxed);
    // a cache that cannot be written only costs a recompile in the next process
    let (path, sum_path) = cubin_paths(&key);
    let _ = store(&path, &sum_path, &image);
    Ok(image)
}

/// `KILN_NVRTC_LOG` set: each NVRTC build prints its source hash, size and time to stderr.
fn log_builds() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("KILN_NVRTC_LOG").is_some())
}

/// Whether this NVRTC takes `--no-cache` (12.9 and later keep their own cache of compiled
/// programs, on disk beside the driver's JIT cache); cleared the first time it is refused.
static NO_CACHE_OPTION: AtomicBool = AtomicBool::new(true);

/// NVRTC's program API, for the CUBIN (cudarc's `compile_ptx` gives PTX only). `fresh`: inside a
/// fresh-cache scope (a cold-compile measurement), NVRTC's own cache is bypassed too: left on, a
/// "cold" compile of sources some earlier process built took a tenth of a true one (DenseNet-121's
/// training units: 0.04 s of CPU each against 1.1 s).
fn compile_cubin(signature: &str, src: &str, sm: &str, fresh: bool) -> Result<Vec<u8>> {
    let no_cache = fresh && NO_CACHE_OPTION.load(Ordering::Relaxed);
    match compile_cubin_with(signature, src, sm, no_cache) {
        Err(InvalidOption) if no_cache => {
            NO_CACHE_OPTION.store(false, Ordering::Relaxed);
            compile_cubin(signature, src, sm, fresh)
        }
        r => r.map_err(|e| match e {
            InvalidOption => compile_err(signature, "NVRTC refused an option"),
            Failed(e) => e,
        }),
    }
}

enum CompileFailure {
    /// NVRTC_ERROR_INVALID_OPTION
    InvalidOption,
    Failed(Error),
}
use CompileFailure::{Failed, InvalidOption};

fn compile_cubin_with(
    signature: &str,
    src: &str,
    sm: &str,
    no_cache: bool,
) -> std::result::Result<Vec<u8>, CompileFailure> {
    let c_src =
        CString::new(src).map_err(|_| Failed(compile_err(signature, "source holds a NUL byte")))?;
    let nv = |what: &str, e: nvrtc::NvrtcError| compile_err(signature, format!("{what}: {e:?}"));
    let prog =
        nvrtc::create_program(&c_src, None).map_err(|e| Failed(nv("nvrtcCreateProgram", e)))?;
    let mut options = vec![
        format!("--gpu-architecture={sm}"),
        // no contraction into FMAs: results stay close to the CPU reference's rounding
        "--fmad=false".to_string(),
        "--std=c++17".to_string(),
    ];
    if no_cache {
        options.push("--no-cache".to_string());
    }
    // SAFETY: `prog` is a live program until destroyed below; the CUBIN buffer has the size
    // NVRTC reported
    let out = unsafe {
        match nvrtc::compile_program(prog, &options) {
            Ok(()) => {
                let mut size = 0usize;
                nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .and_then(|()| {
                        let mut image = vec![0u8; size];
                        nvrtc_sys::nvrtcGetCUBIN(prog, image.as_mut_ptr().cast())
                            .result()
                            .map(|()| image)
                    })
                    .map_err(|e| Failed(nv("nvrtcGetCUBIN", e)))
            }
            Err(nvrtc::NvrtcError(nvrtc_sys::nvrtcResult::NVRTC_ERROR_INVALID_OPTION)) => {
                Err(InvalidOption)
            }
            Err(e) => {
                let log = nvrtc::get_program_log(prog)
                    .map(|l| {
                        let bytes: Vec<u8> = l.iter().map(|&c| c as u8).collect();
                        String::from_utf8_lossy(&bytes)
                            .trim_end_matches('\0')
                            .to_string()
                    })
                    .unwrap_or_default();
                Err(Failed(compile_err(
                    signature,
                    format!("{e:?}\n{log}\n--- source ---\n{src}"),
                )))
            }
        }
    };
    // SAFETY: created above, destroyed once
    let _ = unsafe { nvrtc::destroy_program(prog) };
    out
}

/// The bytes `store` wrote at `path`, if the checksum beside them (at `sum_path`) holds: every
/// disk cache of this crate (cubins, cuDNN plans, GEMM and convolution choices) reads through it.
pub(crate) fn read_verified(path: &Path, sum_path: &Path) -> Option<Vec<u8>> {
    let bytes = std::fs::read(path).ok()?;
    let want = std::fs::read_to_string(sum_path).ok()?;
    (checksum(&bytes) == want.trim()).then_some(bytes)
}

/// Writes `bytes` at `path` and their checksum at `sum_path`, each through a temporary file and a
/// rename, so a reader sees a whole entry or none; the folder is made if missing.
pub(crate) fn store(path: &Path, sum_path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    kiln_core::cache::write_atomically(path, bytes)?;
    kiln_core::cache::write_atomically(sum_path, checksum(bytes).as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key hashed in parts is the checksum of the whole text: cubins on disk keep their keys.
    #[test]
    fn a_cubin_key_is_the_checksum_of_its_parts_joined() {
        let src = "extern \"C\" __global__ void k() {}\n".repeat(1000);
        assert_eq!(
            cubin_key_of(&src, "sm_90a", "13.0"),
            checksum(format!("{src}|sm_90a|13.0|cubin").as_bytes())
        );
    }

    /// Results come in the items' order for any count of items and threads, and a thread that
    /// panics leaves `None` for the items it had not done.
    #[test]
    fn for_each_on_threads_keeps_the_order() {
        let collect = |items: &[usize], threads, f: &(dyn Fn(&usize) -> Option<usize> + Sync)| {
            let mut out = Vec::new();
            for_each_on_threads(items, threads, f, |k, r| {
                assert_eq!(k, out.len(), "in order");
                out.push(r);
                Ok(())
            })
            .unwrap();
            out
        };
        for n in [0usize, 1, 2, 7, 8, 9, 67] {
            let items: Vec<usize> = (0..n).collect();
            for threads in [0usize, 1, 3, 8, 100] {
                let out = collect(&items, threads, &|&i| Some(i * 10));
                let want: Vec<Option<usize>> = (0..n).map(|i| Some(i * 10)).collect();
                assert_eq!(out, want, "{n} items on {threads} threads");
            }
        }
        let items: Vec<usize> = (0..9).collect();
        let out = collect(&items, 3, &|&i| {
            if i == 4 {
                panic!("a reader failed");
            }
            Some(i)
        });
        // item 4 was thread 1's second (items 1, 4, 7): 4 and 7 are lost, the rest kept
        let want: Vec<Option<usize>> = (0..9).map(|i| (i != 4 && i != 7).then_some(i)).collect();
        assert_eq!(out, want);
        // an error of `each` ends the walk and is returned
        let mut seen = 0;
        let r = for_each_on_threads(
            &items,
            3,
            |&i| Some(i),
            |k, _| {
                seen += 1;
                match k {
                    2 => Err(kiln_core::Error::arg("test", "stop")),
                    _ => Ok(()),
                }
            },
        );
        assert!(r.is_err());
        assert_eq!(seen, 3);
    }
}
