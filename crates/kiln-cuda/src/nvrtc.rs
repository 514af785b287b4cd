//! Kernels from generated CUDA C: compiled by NVRTC at the first use of each signature, then kept in
//! memory per device (by signature, so a hit costs one map lookup and no source text is built) and
//! on disk (by the hash of source + target + NVRTC version) under `KILN_CACHE_DIR/cuda`, with the CPU
//! kernel cache's rules: atomic writes (temporary file, then rename), a checksum beside each entry,
//! a mismatching or unloadable entry rebuilt.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cudarc::driver::{result, sys};
use kiln_core::{Device, Error, Result};

use crate::device::{cu_err, CudaDevice};

/// Every generated kernel's entry point is named this.
pub(crate) const ENTRY: &str = "k";

static COMPILES: AtomicU64 = AtomicU64::new(0);
static DISK_HITS: AtomicU64 = AtomicU64::new(0);

/// (NVRTC compilations, disk-cache hits) so far in this process.
pub fn kernel_cache_stats() -> (u64, u64) {
    (
        COMPILES.load(Ordering::Relaxed),
        DISK_HITS.load(Ordering::Relaxed),
    )
}

/// The kernel for `signature` on `dev`, generating its source with `source` on a miss.
pub(crate) fn kernel(
    dev: &Arc<CudaDevice>,
    signature: &str,
    source: impl FnOnce() -> String,
) -> Result<sys::CUfunction> {
    let mut table = dev.kernels.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(&f) = table.get(signature) {
        return Ok(f);
    }
    let src = source();
    let ptx = ptx_for(dev, signature, &src)?;
    dev.bind()?;
    let c = CString::new(ptx).map_err(|_| compile_err(signature, "PTX holds a NUL byte"))?;
    // SAFETY: `c` is NUL-terminated PTX; the module stays loaded for the process
    let module = unsafe { result::module::load_data(c.as_ptr().cast()) }
        .map_err(|e| cu_err("cuModuleLoadData", dev.ordinal, e))?;
    let name = CString::new(ENTRY).map_err(|_| compile_err(signature, "bad entry name"))?;
    let f = unsafe { result::module::get_function(module, name) }
        .map_err(|e| cu_err("cuModuleGetFunction", dev.ordinal, e))?;
    table.insert(signature.to_string(), f);
    Ok(f)
}

/// The kernels `names` of a generated translation unit (the compiler's code generator), loaded
/// once per device and source text: the module is kept by the hash of `src`.
pub(crate) fn module_kernels(
    dev: &Arc<CudaDevice>,
    src: &str,
    names: &[String],
) -> Result<Vec<sys::CUfunction>> {
    let key = format!("gen:{}", checksum(src.as_bytes()));
    let mut table = dev.kernels.lock().unwrap_or_else(|e| e.into_inner());
    let have: Option<Vec<sys::CUfunction>> = names
        .iter()
        .map(|n| table.get(&format!("{key}:{n}")).copied())
        .collect();
    if let Some(fs) = have {
        return Ok(fs);
    }
    let ptx = ptx_for(dev, &key, src)?;
    dev.bind()?;
    let c = CString::new(ptx).map_err(|_| compile_err(&key, "PTX holds a NUL byte"))?;
    // SAFETY: `c` is NUL-terminated PTX; the module stays loaded for the process
    let module = unsafe { result::module::load_data(c.as_ptr().cast()) }
        .map_err(|e| cu_err("cuModuleLoadData", dev.ordinal, e))?;
    let mut out = Vec::with_capacity(names.len());
    for n in names {
        let name = CString::new(n.as_str()).map_err(|_| compile_err(&key, "bad kernel name"))?;
        // SAFETY: the module is loaded; the name is NUL-terminated
        let f = unsafe { result::module::get_function(module, name) }
            .map_err(|e| cu_err("cuModuleGetFunction", dev.ordinal, e))?;
        table.insert(format!("{key}:{n}"), f);
        out.push(f);
    }
    Ok(out)
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
    let base = match std::env::var("KILN_CACHE_DIR") {
        Ok(d) => PathBuf::from(d),
        Err(_) => match std::env::var("HOME") {
            Ok(h) => Path::new(&h).join(".cache").join("kiln"),
            Err(_) => std::env::temp_dir().join("kiln-cache"),
        },
    };
    base.join("cuda")
}

fn checksum(bytes: &[u8]) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(bytes))
}

/// PTX for `src`: from the disk cache when a verified entry exists, else compiled and stored.
fn ptx_for(dev: &CudaDevice, signature: &str, src: &str) -> Result<String> {
    let key = checksum(format!("{src}|{}|{}", dev.arch, nvrtc_version()).as_bytes());
    let dir = cache_dir();
    let path = dir.join(format!("{key}.ptx"));
    let sum_path = dir.join(format!("{key}.ptx.xxh3"));
    if let (Ok(ptx), Ok(want)) = (std::fs::read(&path), std::fs::read_to_string(&sum_path)) {
        if checksum(&ptx) == want.trim() {
            if let Ok(s) = String::from_utf8(ptx) {
                DISK_HITS.fetch_add(1, Ordering::Relaxed);
                return Ok(s);
            }
        }
    }
    let opts = cudarc::nvrtc::CompileOptions {
        arch: Some(dev.arch),
        // no contraction into FMAs: results stay close to the CPU reference's rounding
        fmad: Some(false),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(src, opts)
        .map_err(|e| compile_err(signature, format!("{e:?}\n--- source ---\n{src}")))?
        .to_src();
    COMPILES.fetch_add(1, Ordering::Relaxed);
    // a cache that cannot be written only costs a recompile in the next process
    let _ = store(&dir, &path, &sum_path, ptx.as_bytes());
    Ok(ptx)
}

fn store(dir: &Path, path: &Path, sum_path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let tmp_sum = sum_path.with_extension(format!("tmp{}s", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::write(&tmp_sum, checksum(bytes))?;
    std::fs::rename(&tmp, path)?;
    std::fs::rename(&tmp_sum, sum_path)
}
