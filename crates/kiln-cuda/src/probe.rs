//! Finding the CUDA libraries before cudarc opens them.
//!
//! cudarc opens each library by name on first use and panics when it cannot; kiln must instead
//! answer with an `Err` that names the library, where kiln looked and what to set. So before any
//! cudarc call, each library is opened here: first by name (the loader's own search: LD_LIBRARY_PATH,
//! the system folders), then by full path from the folders where CUDA usually lives, PyTorch's pip
//! folders (`site-packages/nvidia/*/lib`) included. A library opened by full path stays loaded, and
//! the dynamic loader then answers cudarc's open-by-name with it (it matches loaded libraries by their
//! soname), so a user with PyTorch installed needs to set nothing.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The libraries kiln's CUDA runtime needs, by the name cudarc asks the loader for.
const LIBS: &[(&str, &str)] = &[
    (
        "cuda",
        "the CUDA driver (libcuda.so, installed with the NVIDIA driver)",
    ),
    ("nvrtc", "NVRTC, CUDA's run-time compiler (libnvrtc.so)"),
    ("cublasLt", "cuBLASLt (libcublasLt.so)"),
    ("cublas", "cuBLAS (libcublas.so)"),
];

/// The outcome of probing, computed once per process.
pub(crate) fn probe() -> Result<(), String> {
    static P: OnceLock<Result<(), String>> = OnceLock::new();
    P.get_or_init(run_probe).clone()
}

fn run_probe() -> Result<(), String> {
    if std::env::var_os("KILN_CUDA_DISABLE").is_some() {
        return Err("CUDA is disabled by KILN_CUDA_DISABLE".into());
    }
    probe_libs(LIBS)
}

/// Probes `libs` (name as the loader is asked for it, description for messages).
pub(crate) fn probe_libs(libs: &[(&str, &str)]) -> Result<(), String> {
    let dirs = search_dirs();
    for &(name, what) in libs {
        let candidates = cudarc::get_lib_name_candidates(name);
        if candidates.iter().any(|c| open(Path::new(c))) {
            continue;
        }
        // not on the loader's path: try each folder by full path
        let found = dirs.iter().find_map(|d| {
            candidates
                .iter()
                .map(|c| d.join(c))
                .find(|p| p.exists() && open(p))
                .map(|p| (d.clone(), p))
        });
        match found {
            Some((dir, _)) => {
                if name == "nvrtc" {
                    // NVRTC opens its builtins library by name at compile time: load it too
                    preload_prefix(&dir, "libnvrtc-builtins");
                }
                if name == "cudnn" {
                    // cuDNN 9's libcudnn is a shim that opens its sub-libraries (cnn, ops,
                    // engines, graph) by name: load them from the same folder
                    preload_prefix(&dir, "libcudnn_");
                }
            }
            None => return Err(missing(name, what, &candidates, &dirs)),
        }
    }
    Ok(())
}

/// cuDNN, probed at the first convolution rather than at start-up (it is optional: without it
/// convolutions take the host path). Needs the base libraries, and cuDNN 9 or newer (the API
/// cudarc binds).
pub(crate) fn probe_cudnn() -> Result<(), String> {
    static P: OnceLock<Result<(), String>> = OnceLock::new();
    P.get_or_init(|| {
        probe()?;
        probe_libs(&[("cudnn", "cuDNN (libcudnn.so)")])?;
        let version = cudarc::cudnn::result::get_version();
        if version < 90000 {
            return Err(format!(
                "cuDNN {version} was found but kiln needs cuDNN 9 or newer"
            ));
        }
        Ok(())
    })
    .clone()
}

/// Opens a library and keeps it loaded for the life of the process.
fn open(p: &Path) -> bool {
    // SAFETY: CUDA's libraries have no initialisers that depend on the caller
    match unsafe { libloading::Library::new(p) } {
        Ok(lib) => {
            std::mem::forget(lib); // never unloaded: cudarc and the loader refer to it
            true
        }
        Err(_) => false,
    }
}

/// Loads every library in `dir` whose name starts with `prefix`. A library whose dependencies are
/// not loaded yet fails to open, so failures are retried while a pass still opens something.
fn preload_prefix(dir: &Path, prefix: &str) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let mut pending: Vec<PathBuf> = rd
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| e.path())
        .collect();
    pending.sort();
    loop {
        let before = pending.len();
        pending.retain(|p| !open(p));
        if pending.is_empty() || pending.len() == before {
            return;
        }
    }
}

fn missing(name: &str, what: &str, candidates: &[String], dirs: &[PathBuf]) -> String {
    let looked: Vec<String> = dirs.iter().map(|d| d.display().to_string()).collect();
    let nvidia: Vec<&String> = looked.iter().filter(|d| d.contains("nvidia")).collect();
    let hint = if nvidia.is_empty() {
        "install the NVIDIA driver and the CUDA toolkit (or `pip install torch`, whose nvidia-* \
         packages carry the libraries), then set LD_LIBRARY_PATH to the folder holding the library, \
         or KILN_CUDA_LIB_DIR to it"
            .to_string()
    } else {
        format!(
            "the pip folders kiln found do not hold it; set LD_LIBRARY_PATH (or KILN_CUDA_LIB_DIR) \
             to the folder that does, e.g. LD_LIBRARY_PATH={}",
            nvidia
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(":")
        )
    };
    format!(
        "CUDA is not available: {what} was not found. kiln asked the dynamic loader for {} \
         (LD_LIBRARY_PATH={}) and looked in [{}]. To fix: {hint}.",
        candidates
            .iter()
            .take(4)
            .cloned()
            .collect::<Vec<_>>()
            .join(", "),
        std::env::var("LD_LIBRARY_PATH").unwrap_or_else(|_| "<unset>".into()),
        looked.join(", "),
    ) + if name == "cuda" {
        " (libcuda comes with the GPU driver: a machine without an NVIDIA GPU has none)"
    } else {
        ""
    }
}

/// Folders that commonly hold CUDA libraries, existing ones only, most specific first.
fn search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for var in ["KILN_CUDA_LIB_DIR", "CUDA_HOME", "CUDA_PATH"] {
        if let Some(v) = std::env::var_os(var) {
            let p = PathBuf::from(v);
            dirs.push(p.join("lib64"));
            dirs.push(p.join("lib"));
            dirs.push(p);
        }
    }
    dirs.push("/usr/local/cuda/lib64".into());
    dirs.push("/usr/local/nvidia/lib64".into());
    dirs.push("/usr/lib/x86_64-linux-gnu".into());
    for sp in site_packages() {
        // PyTorch's wheels: site-packages/nvidia/<component>/lib (cu13 wheels: nvidia/cu13/lib)
        if let Ok(rd) = std::fs::read_dir(sp.join("nvidia")) {
            let mut found: Vec<PathBuf> = rd
                .flatten()
                .map(|e| e.path().join("lib"))
                .filter(|p| p.is_dir())
                .collect();
            found.sort();
            dirs.extend(found);
        }
    }
    let mut seen = std::collections::HashSet::new();
    dirs.retain(|d| d.is_dir() && seen.insert(d.clone()));
    dirs
}

/// Python site-packages folders: the active virtual environment's, common install prefixes, and
/// (only when those hold nothing) the ones `python3` reports.
fn site_packages() -> Vec<PathBuf> {
    let mut roots: Vec<PathBuf> = Vec::new();
    if let Some(v) = std::env::var_os("VIRTUAL_ENV") {
        roots.push(PathBuf::from(v).join("lib"));
    }
    if let Some(h) = std::env::var_os("HOME") {
        roots.push(PathBuf::from(h).join(".local/lib"));
    }
    roots.push("/usr/local/lib".into());
    roots.push("/usr/lib".into());
    roots.push("/opt/conda/lib".into());
    if let Ok(rd) = std::fs::read_dir("/opt") {
        roots.extend(rd.flatten().map(|e| e.path().join(".venv/lib")));
    }
    let mut out = Vec::new();
    for r in roots {
        if let Ok(rd) = std::fs::read_dir(&r) {
            for e in rd.flatten() {
                if e.file_name().to_string_lossy().starts_with("python3") {
                    out.push(e.path().join("site-packages"));
                    out.push(e.path().join("dist-packages"));
                }
            }
        }
    }
    out.retain(|p| p.join("nvidia").is_dir());
    if out.is_empty() {
        out = python_site_packages();
    }
    out
}

fn python_site_packages() -> Vec<PathBuf> {
    let script =
        "import site,sys;print('\\n'.join(site.getsitepackages()+[site.getusersitepackages()]))";
    match std::process::Command::new("python3")
        .args(["-c", script])
        .output()
    {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(PathBuf::from)
            .collect(),
        _ => Vec::new(),
    }
}
