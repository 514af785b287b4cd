//! Building generated C with the system compiler, and the kernel cache.
//!
//! Kernels are looked up by name (a hash of their text) in a process-wide table first, so a process
//! never compiles one kernel twice; the kernels a graph still lacks are compiled together as a few
//! translation units (one per core, when there is enough code: `units`) into shared libraries
//! cached on disk under `KILN_CACHE_DIR` (default
//! `~/.cache/kiln`), keyed by the source, the flags, the compiler's version and the CPU. Entries are
//! written atomically (temporary file, then rename) with a checksum beside them; an entry whose
//! bytes do not match it, or that fails to load, is rebuilt.

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

use kiln_core::{Error, Result};

use super::trig::FAST_TRIG;
use crate::codegen::c::Kernel;
use crate::codegen::c_sums;
use crate::codegen::c_trig;

pub type KernelFn = unsafe extern "C" fn(*const *mut c_void);

const FLAGS: &[&str] = &[
    "-O3",
    "-march=native",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c11",
    // no contraction into FMAs: results stay equal to the eager kernels'
    "-ffp-contract=off",
    // libm calls need not set errno (nothing reads it): they become pure, so the compiler hoists
    // loop-invariant ones (an optimizer's bias corrections) and vectorizes sqrt; values unchanged
    "-fno-math-errno",
    "-Wl,-z,nodelete",
];

const HEADER: &str = "#include <math.h>\n#include <stdint.h>\n#include <stdlib.h>\n\n";

/// With glibc's vector math library: `kiln_sin`/`kiln_cos` are the C library's `sin`/`cos` (same
/// symbols, so scalar calls are unchanged) declared pure and with SIMD variants, so GCC's
/// vectorizer calls libmvec's `_ZGV*_sinf` and friends on 8 or 16 lanes at a time. Under their
/// own names the calls are also not merged into one scalar `sincosf`, which GCC does to `sinf(x)`
/// and `cosf(x)` of one operand and which cannot be vectorized. libmvec is documented within
/// 4 ulp of the exact result; the scalar functions are within 1, so vectorized results may differ
/// from eager ones by a few ulp (measured on 2^24 inputs: 2 ulp in f32, 3 in f64). A pointwise
/// loop over f32 sines and cosines calls inline functions instead (`trig.rs`), and these
/// declarations only for a block holding an argument beyond their range (`codegen/c_trig.rs`).
const VECTOR_MATH: &str = "\
#define KILN_VEC __attribute__((const, nothrow, simd(\"notinbranch\")))
extern float kiln_sinf(float) __asm__(\"sinf\") KILN_VEC;
extern float kiln_cosf(float) __asm__(\"cosf\") KILN_VEC;
extern double kiln_sin(double) __asm__(\"sin\") KILN_VEC;
extern double kiln_cos(double) __asm__(\"cos\") KILN_VEC;

";

/// Without libmvec the same names are the scalar functions.
const SCALAR_MATH: &str = "\
#define kiln_sinf sinf
#define kiln_cosf cosf
#define kiln_sin sin
#define kiln_cos cos

";

pub struct Toolchain {
    cc: String,
    /// glibc's vector math library links (x86_64): see `VECTOR_MATH`.
    pub(crate) libmvec: bool,
    /// `cc --version`'s first line and the CPU model: part of every cache key.
    pub(crate) identity: String,
}

/// The C compiler (`$CC`, else `cc`), if one runs.
pub fn toolchain() -> Option<&'static Toolchain> {
    static T: OnceLock<Option<Toolchain>> = OnceLock::new();
    T.get_or_init(|| {
        // OpenMP's default is to spin after a parallel region; the core's kernels (matmul, conv)
        // run on rayon's threads right after, and spinning OpenMP threads starve them. Unless the
        // user chose, idle OpenMP threads sleep. The variable is read when libgomp loads, which is
        // after this point: kernels are only loaded once a toolchain exists.
        if std::env::var_os("OMP_WAIT_POLICY").is_none() {
            std::env::set_var("OMP_WAIT_POLICY", "PASSIVE");
        }
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let out = Command::new(&cc).arg("--version").output().ok()?;
        if !out.status.success() {
            return None;
        }
        let version = String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .unwrap_or_default()
            .to_string();
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name") || l.starts_with("flags"))
                    .map(str::to_string)
            })
            .unwrap_or_default();
        // the x86_64 vector variants' names are what GCC's `simd` attribute produces there;
        // `-print-file-name` answers without compiling anything (start-up stays fast)
        let libmvec = std::env::consts::ARCH == "x86_64"
            && std::env::var_os("KILN_NO_LIBMVEC").is_none()
            && Command::new(&cc)
                .arg("-print-file-name=libmvec.so")
                .output()
                .ok()
                .is_some_and(|o| {
                    Path::new(String::from_utf8_lossy(&o.stdout).trim()).is_absolute()
                });
        Some(Toolchain {
            cc,
            libmvec,
            identity: format!("{version}|{cpu}|{}", std::env::consts::ARCH),
        })
    })
    .as_ref()
}

/// Runs `f` with an empty kernel cache — a new, empty disk folder and no kernels loaded in memory —
/// to measure cold compiles (PyTorch's `fresh_inductor_cache`). Kernels loaded before stay usable
/// by the graphs already compiled; the folder is removed afterwards.
pub fn with_fresh_cache<R>(f: impl FnOnce() -> R) -> R {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "kiln-fresh-{}-{}",
        std::process::id(),
        N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    let saved_kernels =
        std::mem::take(&mut loaded().lock().unwrap_or_else(|e| e.into_inner()).kernels);
    kiln_compile::reset();
    // the folder of every kernel cache, the CUDA target's included (kiln-cuda keys its loaded
    // modules by the scope too)
    let out = kiln_core::cache::with_root(dir.clone(), f);
    let mut l = loaded().lock().unwrap_or_else(|e| e.into_inner());
    for (k, v) in saved_kernels {
        l.kernels.entry(k).or_insert(v);
    }
    drop(l);
    let _ = std::fs::remove_dir_all(&dir);
    out
}

/// Forgets the kernels loaded in this process (the disk cache stays): the next compile of any graph
/// goes to disk, as a new process would. For measuring warm-cache compiles.
pub fn forget_loaded_kernels() {
    loaded()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .kernels
        .clear();
    kiln_compile::reset();
}

pub fn cache_dir() -> PathBuf {
    kiln_core::cache::cache_root()
}

#[derive(Default)]
struct Loaded {
    kernels: HashMap<String, KernelFn>,
    compiles: u64,
    disk_hits: u64,
}

fn loaded() -> &'static Mutex<Loaded> {
    static L: OnceLock<Mutex<Loaded>> = OnceLock::new();
    L.get_or_init(Default::default)
}

/// Process-wide kernel cache counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelCacheStats {
    /// Kernels loaded in this process.
    pub kernels: usize,
    /// Translation units built by the C compiler.
    pub compiles: u64,
    /// Translation units found built on disk.
    pub disk_hits: u64,
}

pub fn stats() -> KernelCacheStats {
    let l = loaded().lock().unwrap_or_else(|e| e.into_inner());
    KernelCacheStats {
        kernels: l.kernels.len(),
        compiles: l.compiles,
        disk_hits: l.disk_hits,
    }
}

/// A kernel as the C compiler takes it: its symbol and its whole definition (what a plan read
/// from the disk cache keeps of a generated `Kernel`).
#[derive(Clone, Copy, Debug)]
pub struct CKernel<'a> {
    pub name: &'a str,
    pub source: &'a str,
}

impl<'a> From<&'a Kernel> for CKernel<'a> {
    fn from(k: &'a Kernel) -> Self {
        CKernel {
            name: &k.name,
            source: &k.source,
        }
    }
}

/// The full source of a translation unit holding `kernels`, for a compiler with or without
/// libmvec.
pub fn translation_unit(kernels: &[CKernel<'_>], libmvec: bool) -> String {
    let mut s = String::from(HEADER);
    s.push_str(if libmvec { VECTOR_MATH } else { SCALAR_MATH });
    // the inline sine and cosine, in the units of kernels whose loops call them
    if kernels.iter().any(|k| k.source.contains(c_trig::MARK)) {
        s.push_str(FAST_TRIG);
    }
    if kernels.iter().any(|k| k.source.contains(c_sums::FOLD_SUM)) {
        s.push_str(&c_sums::fold_sum_definition());
    }
    if kernels
        .iter()
        .any(|k| k.source.contains(c_sums::FOLD_SQDEV))
    {
        s.push_str(&c_sums::fold_sqdev_definition());
    }
    for k in kernels {
        s.push_str(k.source);
        s.push('\n');
    }
    s
}

/// Source bytes per translation unit from which a graph's missing kernels are built as several
/// units, one compiler process per core: GCC's time grows with a unit's code (a 64-layer
/// model's backward, 17 KB of C, took 0.28 s at -O3 on the 2-core machine, most of its cold
/// compile), and units of a few kilobytes each still amortize a compiler start (about 40 ms).
const UNIT_BYTES: usize = 6 << 10;
/// Most units (compiler processes) one load builds at once.
const MAX_UNITS: usize = 8;

/// `missing` dealt into units: as many as the source's size and the cores allow, the largest
/// kernels first onto the lightest unit, each unit's kernels in their original order (so a
/// unit's source, and its cache key, depend on the kernels alone).
fn units<'k>(missing: &[CKernel<'k>], cores: usize) -> Vec<Vec<CKernel<'k>>> {
    let weights: Vec<usize> = missing.iter().map(|k| k.source.len()).collect();
    let n = (weights.iter().sum::<usize>() / UNIT_BYTES).clamp(1, cores.clamp(1, MAX_UNITS));
    crate::parallel::deal(&weights, n)
        .into_iter()
        .map(|unit| unit.into_iter().map(|i| missing[i]).collect())
        .collect()
}

/// One unit's library: from disk, else built. `true` with it when it was built.
fn unit_library(tc: &Toolchain, kernels: &[CKernel<'_>]) -> Result<(libloading::Library, bool)> {
    let src = translation_unit(kernels, tc.libmvec);
    crate::log_output_code(&src);
    let key = xxhash_rust::xxh3::xxh3_128(
        format!("{src}|{}|{}", FLAGS.join(" "), tc.identity).as_bytes(),
    );
    let dir = cache_dir();
    std::fs::create_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
    let lib_path = dir.join(format!("{key:032x}.so"));
    if let Some(lib) = open(&lib_path) {
        return Ok((lib, false));
    }
    // absent or damaged: build it
    let _ = std::fs::remove_file(&lib_path);
    build(tc, &src, &dir, &lib_path)?;
    let lib = open(&lib_path).ok_or_else(|| {
        Error::arg(
            "kiln backend",
            format!("cannot load {}", lib_path.display()),
        )
    })?;
    Ok((lib, true))
}

/// Function pointers for `kernels`, compiling (or loading from disk) those not loaded yet: in
/// several units built in parallel where there is enough code (`units`). The kernel table stays
/// locked meanwhile, so no two loads build one kernel.
pub fn load(tc: &Toolchain, kernels: &[CKernel<'_>]) -> Result<Vec<KernelFn>> {
    let mut l = loaded().lock().unwrap_or_else(|e| e.into_inner());
    let mut missing: Vec<CKernel<'_>> = Vec::new();
    for &k in kernels {
        if !l.kernels.contains_key(k.name) && !missing.iter().any(|m| m.name == k.name) {
            missing.push(k);
        }
    }
    if !missing.is_empty() {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let groups = units(&missing, cores);
        let libs = crate::parallel::map_threads(groups.iter().collect(), |g| unit_library(tc, g));
        for (lib, group) in libs.into_iter().zip(&groups) {
            let (lib, built) = lib?;
            match built {
                true => l.compiles += 1,
                false => l.disk_hits += 1,
            }
            for k in group {
                // SAFETY: the symbol was generated with exactly this signature
                let f: KernelFn = unsafe {
                    *lib.get::<KernelFn>(k.name.as_bytes()).map_err(|e| {
                        Error::arg(
                            "kiln backend",
                            format!("a built unit lacks kernel {}: {e}", k.name),
                        )
                    })?
                };
                l.kernels.insert(k.name.to_string(), f);
            }
            // OpenMP libraries must never be unloaded: the library lives for the process
            std::mem::forget(lib);
        }
    }
    kernels
        .iter()
        .map(|k| {
            l.kernels.get(k.name).copied().ok_or_else(|| {
                Error::arg("kiln backend", format!("kernel {} was not loaded", k.name))
            })
        })
        .collect()
}

fn checksum_path(lib: &Path) -> PathBuf {
    lib.with_extension("so.xxh3")
}

fn file_checksum(path: &Path) -> Option<String> {
    let bytes = std::fs::read(path).ok()?;
    Some(format!("{:032x}", xxhash_rust::xxh3::xxh3_128(&bytes)))
}

/// Loads a cached library whose bytes match the checksum written beside it when it was built.
fn open(path: &Path) -> Option<libloading::Library> {
    let want = std::fs::read_to_string(checksum_path(path)).ok()?;
    if file_checksum(path)? != want.trim() {
        return None; // truncated, overwritten, or half-written by a crashed build
    }
    // SAFETY: the library is one kiln built; its initialisers are the C runtime's and OpenMP's
    unsafe { libloading::Library::new(path).ok() }
}

fn io_err(p: &Path, e: std::io::Error) -> Error {
    Error::arg("kiln backend", format!("{}: {e}", p.display()))
}

fn build(tc: &Toolchain, src: &str, dir: &Path, lib_path: &Path) -> Result<()> {
    let stem = lib_path
        .file_stem()
        .and_then(|s| s.to_str())
        .unwrap_or("kernels");
    // a process builds a unit once (`load` holds the kernel table): the process id keeps two
    // processes building the same unit apart
    let tmp = format!("{stem}.tmp{}", std::process::id());
    let c_path = dir.join(format!("{stem}.c"));
    let tmp_c = dir.join(format!("{tmp}.c"));
    let tmp_so = dir.join(format!("{tmp}.so"));
    std::fs::write(&tmp_c, src).map_err(|e| io_err(&tmp_c, e))?;
    let out = Command::new(&tc.cc)
        .args(FLAGS)
        .arg("-o")
        .arg(&tmp_so)
        .arg(&tmp_c)
        .args(tc.libmvec.then_some("-lmvec"))
        .arg("-lm")
        .output()
        .map_err(|e| Error::arg("kiln backend", format!("running {}: {e}", tc.cc)))?;
    if !out.status.success() {
        let _ = std::fs::remove_file(&tmp_so);
        return Err(Error::arg(
            "kiln backend",
            format!(
                "the C compiler rejected generated code ({}):\n{}",
                tmp_c.display(),
                String::from_utf8_lossy(&out.stderr)
            ),
        ));
    }
    let sum = file_checksum(&tmp_so)
        .ok_or_else(|| Error::arg("kiln backend", format!("cannot read {}", tmp_so.display())))?;
    let tmp_sum = dir.join(format!("{tmp}.so.xxh3"));
    std::fs::write(&tmp_sum, sum).map_err(|e| io_err(&tmp_sum, e))?;
    std::fs::rename(&tmp_c, &c_path).map_err(|e| io_err(&c_path, e))?;
    std::fs::rename(&tmp_so, lib_path).map_err(|e| io_err(lib_path, e))?;
    let sum_path = checksum_path(lib_path);
    std::fs::rename(&tmp_sum, &sum_path).map_err(|e| io_err(&sum_path, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(name: &str, bytes: usize) -> Kernel {
        Kernel {
            name: name.into(),
            source: "x".repeat(bytes),
            inputs: Vec::new(),
            member: None,
        }
    }

    #[test]
    fn units_split_large_sources_over_the_cores_keeping_each_kernel_once_in_order() {
        let ks: Vec<Kernel> = [9000, 300, 5000, 4000, 7000, 200]
            .iter()
            .enumerate()
            .map(|(i, &b)| kernel(&format!("k{i}"), b))
            .collect();
        let refs: Vec<CKernel<'_>> = ks.iter().map(CKernel::from).collect();
        let names = |u: &[Vec<CKernel<'_>>]| -> Vec<Vec<String>> {
            u.iter()
                .map(|g| g.iter().map(|k| k.name.to_string()).collect())
                .collect()
        };
        // one core, or little code: one unit, in order
        assert_eq!(
            names(&units(&refs, 1)),
            vec![vec!["k0", "k1", "k2", "k3", "k4", "k5"]]
        );
        assert_eq!(units(&refs[..2], 16).len(), 1);
        // 25.5 KB over 16 cores: 4 units (6 KB each at least), each kernel once, in order
        let four = units(&refs, 16);
        assert_eq!(four.len(), 4);
        let mut all: Vec<String> = names(&four).concat();
        all.sort();
        assert_eq!(all, ["k0", "k1", "k2", "k3", "k4", "k5"]);
        for g in names(&four) {
            let mut sorted = g.clone();
            sorted.sort();
            assert_eq!(g, sorted, "a unit keeps the kernels' order");
        }
        // the same kernels give the same units
        assert_eq!(names(&units(&refs, 16)), names(&four));
    }
}
