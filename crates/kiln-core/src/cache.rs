//! The kiln cache folder, shared by every kernel cache (kiln-inductor's C kernels, kiln-cuda's
//! NVRTC kernels): `$KILN_CACHE_DIR`, else `~/.cache/kiln`. A fresh-cache scope (`with_root`,
//! behind kiln-inductor's `with_fresh_cache`, PyTorch's `fresh_inductor_cache`) points it at an
//! empty folder and gives the scope an id that in-memory kernel tables put in their keys, so a
//! cold compile measured inside it misses in memory and on disk alike, on every device.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// The scope in force: its folder and id.
static SCOPE: Mutex<Option<(PathBuf, u64)>> = Mutex::new(None);
/// The id of the scope in force (0: none), set with `SCOPE`: read without the lock, since
/// every convolution's plan lookup reads it (`kiln-cuda`'s `conv.rs`).
static SCOPE_ID: AtomicU64 = AtomicU64::new(0);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// The cache folder in force: the scope's, else `$KILN_CACHE_DIR`, else `~/.cache/kiln`.
pub fn cache_root() -> PathBuf {
    if let Some((d, _)) = &*SCOPE.lock().unwrap_or_else(|e| e.into_inner()) {
        return d.clone();
    }
    if let Some(d) = std::env::var_os("KILN_CACHE_DIR") {
        return PathBuf::from(d);
    }
    match std::env::var_os("HOME") {
        Some(h) => Path::new(&h).join(".cache").join("kiln"),
        None => std::env::temp_dir().join("kiln-cache"),
    }
}

/// Writes `bytes` at `path` through a temporary file beside it and a rename, so a reader (of
/// this process or another) sees the whole file or none; the folder is made if missing. Every
/// cache entry kiln writes goes through here: the temporary's name is this process's and this
/// write's alone, so concurrent writers of one entry never write into each other's file.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    static TEMP: AtomicU64 = AtomicU64::new(0);
    let dir = path
        .parent()
        .ok_or_else(|| std::io::Error::other("a cache entry has no folder"))?;
    std::fs::create_dir_all(dir)?;
    let name = path
        .file_name()
        .map_or_else(Default::default, |n| n.to_string_lossy());
    let tmp = dir.join(format!(
        ".{name}.{}.{}.tmp",
        std::process::id(),
        TEMP.fetch_add(1, Ordering::Relaxed)
    ));
    let written = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// 0 outside a fresh-cache scope, the scope's own id inside one.
pub fn scope_id() -> u64 {
    SCOPE_ID.load(Ordering::Acquire)
}

/// Puts `scope` in force, its id with it; returns the one it replaces.
fn set_scope(scope: Option<(PathBuf, u64)>) -> Option<(PathBuf, u64)> {
    let mut s = SCOPE.lock().unwrap_or_else(|e| e.into_inner());
    SCOPE_ID.store(scope.as_ref().map_or(0, |s| s.1), Ordering::Release);
    std::mem::replace(&mut *s, scope)
}

/// Runs `f` with `dir` as the cache folder and a new scope id; the previous ones come back after.
pub fn with_root<R>(dir: PathBuf, f: impl FnOnce() -> R) -> R {
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let prev = set_scope(Some((dir, id)));
    // restored on unwind too: a panicking measurement must not leave the process in the scope
    struct Restore(Option<(PathBuf, u64)>);
    impl Drop for Restore {
        fn drop(&mut self) {
            set_scope(self.0.take());
        }
    }
    let _restore = Restore(prev);
    f()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_atomic_write_makes_its_folder_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("kiln-atomic-{}", std::process::id()));
        let path = dir.join("a").join("entry.bin");
        write_atomically(&path, b"first").unwrap();
        write_atomically(&path, b"second").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"second");
        let names: Vec<_> = std::fs::read_dir(dir.join("a"))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, ["entry.bin"]);
        // a path with no folder is an error, not a panic
        assert!(write_atomically(Path::new("/"), b"x").is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_scope_changes_the_root_and_id_and_restores_them() {
        let (root, id) = (cache_root(), scope_id());
        let dir = std::env::temp_dir().join("kiln-cache-scope-test");
        let inner = with_root(dir.clone(), || {
            let nested = with_root(dir.join("n"), scope_id);
            (cache_root(), scope_id(), nested)
        });
        assert_eq!(inner.0, dir);
        assert!(inner.1 != 0 && inner.2 != 0 && inner.1 != inner.2);
        assert_eq!((cache_root(), scope_id()), (root, id));
    }
}
