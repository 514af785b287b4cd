//! Warm starts: disk-cache entries read ahead, while the function that needs them is traced.
//!
//! A new process that finds a compiled function's work on disk spends its first milliseconds
//! recording the user's code (DenseNet-121's training step: 8-10 ms on the H200's host) before
//! it knows the graph, and so the keys, of the entries it will read; then reading and decoding
//! them (AOT autograd's split, the code generator's plans: 5-10 ms there) waits for the
//! recording. Each compile therefore remembers, under the function's name, the keys it read
//! (`Recent`: AOT autograd its splits, the code generator its plans, each in a manifest of its
//! own); the next process reads those entries on threads of their own as soon as the trace
//! starts (`Prefetched::start`), all at once, and the compile takes a read-ahead value only
//! under the key it computed itself (`Prefetched::take`), so a function whose graph changed
//! reads what it needs as before and the stale read only cost a thread.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::JoinHandle;

use kiln_core::profiler;

use crate::disk_cache::{self, Count};

/// Most keys a function's manifest keeps (the newest): a function compiles a few graphs
/// (a training step's two plans, an evaluation's, segments around graph breaks, recompiles);
/// reading more ahead than that wastes threads.
const MOST_KEYS: usize = 6;

/// A small file under the cache folder in which a function's compiles leave what the
/// function's next warm start, in another process, should load ahead of need
/// (`graphs/<dir>/<hash of dir and the function's identity>.txt`): the keys of AOT autograd's
/// splits and of the code generator's plans (`Recent`), the CUDA units to load (kiln-inductor's
/// `cuda_prefetch`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Manifest {
    path: PathBuf,
}

impl Manifest {
    /// The manifest in `dir` for the function `identity` names (its name, its mode, anything
    /// else that changes what it compiles to), under the cache folder.
    pub fn new(dir: &str, identity: &[&[u8]]) -> Manifest {
        Manifest::under(&kiln_core::cache::cache_root(), dir, identity)
    }

    /// `new` under the folder `root`.
    pub fn under(root: &Path, dir: &str, identity: &[&[u8]]) -> Manifest {
        let mut parts = vec![dir.as_bytes()];
        parts.extend_from_slice(identity);
        let key = disk_cache::key(&parts);
        Manifest {
            path: root
                .join("graphs")
                .join(dir)
                .join(format!("{key:032x}.txt")),
        }
    }

    /// True the first time this process asks about this manifest (since `kiln::reset`), false
    /// after: loading ahead is for a function's first trace; a function traced on every call (a
    /// graph break) finds what it needs loaded already.
    pub fn first_use(&self) -> bool {
        let mut used = USED.lock().unwrap_or_else(|e| e.into_inner());
        if used.contains(&self.path) {
            return false;
        }
        used.push(self.path.clone());
        true
    }

    /// The manifest's text (`None` when there is none).
    pub fn read(&self) -> Option<String> {
        std::fs::read_to_string(&self.path).ok()
    }

    /// Writes `text`, unless the manifest holds it already (a warm start writes nothing). Best
    /// effort: a manifest that cannot be written only costs the next process its loading ahead.
    pub fn write(&self, text: &str) {
        if self.read().as_deref() != Some(text) {
            let _ = kiln_core::cache::write_atomically(&self.path, text.as_bytes());
        }
    }
}

/// The keys of one kind of entry a function's compiles read, one a line in a manifest of their
/// own (`graphs/<kind>-recent/`).
pub struct Recent {
    file: Manifest,
}

impl Recent {
    /// The manifest of `kind` for the function `identity` names; `None` when the disk cache is
    /// off.
    pub fn new(kind: &str, identity: &[&[u8]]) -> Option<Recent> {
        if !disk_cache::enabled() {
            return None;
        }
        Some(Recent::under(
            &kiln_core::cache::cache_root(),
            kind,
            identity,
        ))
    }

    fn under(root: &Path, kind: &str, identity: &[&[u8]]) -> Recent {
        Recent {
            file: Manifest::under(root, &format!("{kind}-recent"), identity),
        }
    }

    /// The keys to read ahead now: those remembered, at the manifest's first use in this
    /// process (`Manifest::first_use`); none after, and none when reading ahead is off
    /// (`enabled`).
    pub fn to_read_ahead(&self) -> Vec<u128> {
        if !enabled() || !self.file.first_use() {
            return Vec::new();
        }
        self.keys()
    }

    /// The keys remembered, the newest first (none when there is no manifest).
    pub fn keys(&self) -> Vec<u128> {
        self.file
            .read()
            .map(|text| parse(&text))
            .unwrap_or_default()
    }

    /// Remembers `key` (`remember_all`). Best effort: a manifest that cannot be written only
    /// costs the next process its read-ahead.
    pub fn remember(&self, key: u128) {
        self.remember_all(&[key]);
    }

    /// Remembers `keys`, used together (a training step's two plans): a manifest that lists
    /// them all already is left as it is (a warm start writes nothing); else they go first, in
    /// their order, and the oldest fall off past `MOST_KEYS`.
    pub fn remember_all(&self, new: &[u128]) {
        // one process's writers of one manifest in turn (a function compiled on two threads)
        static LOCK: Mutex<()> = Mutex::new(());
        let _turn = LOCK.lock().unwrap_or_else(|e| e.into_inner());
        let mut keys = self.keys();
        if new.iter().all(|k| keys.contains(k)) {
            return;
        }
        keys.retain(|k| !new.contains(k));
        keys.splice(0..0, new.iter().copied());
        keys.truncate(MOST_KEYS);
        let text: String = keys.iter().map(|k| format!("{k:032x}\n")).collect();
        self.file.write(&text);
    }
}

static TAKEN: AtomicU64 = AtomicU64::new(0);

/// Disk-cache records compiles took from a read-ahead (`Prefetched::take_or_load`) since the
/// process started.
pub fn taken() -> u64 {
    TAKEN.load(Ordering::Relaxed)
}

/// Whether reading ahead is on (`KILN_READ_AHEAD=0` turns it off: each compile then reads what
/// it needs once it knows its keys; the manifests are still kept).
pub fn enabled() -> bool {
    std::env::var_os("KILN_READ_AHEAD").map_or(true, |v| v != "0")
}

/// Manifests `Manifest::first_use` answered.
static USED: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

/// Forgets which manifests were used (`kiln::reset`: the next trace of each function loads
/// ahead again, as a new process would).
pub(crate) fn forget_uses() {
    USED.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

fn parse(text: &str) -> Vec<u128> {
    text.lines()
        .filter_map(|line| u128::from_str_radix(line.trim(), 16).ok())
        .take(MOST_KEYS)
        .collect()
}

/// Values read ahead on threads of their own, each under its key and the function it was read
/// for. A value nobody takes is dropped when its function's compile ends (`discard`).
pub struct Prefetched<T> {
    pending: OnceLock<Mutex<HashMap<u128, Pending<T>>>>,
}

struct Pending<T> {
    function: String,
    thread: JoinHandle<Option<T>>,
}

impl<T: Send + 'static> Prefetched<T> {
    pub const fn new() -> Self {
        Prefetched {
            pending: OnceLock::new(),
        }
    }

    fn pending(&self) -> std::sync::MutexGuard<'_, HashMap<u128, Pending<T>>> {
        self.pending
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Starts `read` on a thread of its own for `function`, unless `key` is read or being read
    /// already. A thread that cannot be started reads nothing (the compile reads it itself).
    pub fn start(
        &self,
        function: &str,
        key: u128,
        read: impl FnOnce() -> Option<T> + Send + 'static,
    ) {
        let mut pending = self.pending();
        if pending.contains_key(&key) {
            return;
        }
        let thread = std::thread::Builder::new()
            .name("kiln-read-ahead".into())
            .spawn(read);
        if let Ok(thread) = thread {
            let function = function.to_string();
            pending.insert(key, Pending { function, thread });
        }
    }

    /// What the read ahead under `key` found (waiting for its thread), or `None` when there
    /// was none (never started, or its thread panicked): then the caller reads it itself.
    pub fn take(&self, key: u128) -> Option<Option<T>> {
        let pending = self.pending().remove(&key)?;
        pending.thread.join().ok()
    }

    /// Starts reading ahead the record stored under (`kind`, `key`) as `decode` reads it
    /// (`disk_cache::load_decoded`, counted only when taken), for `function`.
    pub fn start_disk(
        &self,
        function: &str,
        kind: &'static str,
        key: u128,
        decode: fn(&[u8]) -> Option<T>,
    ) {
        self.start(function, key, move || {
            let _span = profiler::span(profiler::Category::Compile, || {
                format!("{kind} read ahead from the disk cache").into()
            });
            disk_cache::load_decoded(kind, key, decode, Count::WhenTaken)
        });
    }

    /// The record stored under (`kind`, `key`): the one read ahead (its hit or miss counted
    /// now), else read now (`disk_cache::load_decoded`).
    pub fn take_or_load(&self, kind: &str, key: u128, decode: fn(&[u8]) -> Option<T>) -> Option<T> {
        match self.take(key) {
            Some(found) => {
                disk_cache::count_taken(found.is_some());
                if found.is_some() {
                    TAKEN.fetch_add(1, Ordering::Relaxed);
                }
                found
            }
            None => disk_cache::load_decoded(kind, key, decode, Count::Now),
        }
    }

    /// Drops what was read ahead for `function` and not taken (its graph changed since the
    /// keys were remembered). Threads still reading finish on their own.
    pub fn discard(&self, function: &str) {
        self.pending().retain(|_, p| p.function != function);
    }
}

impl<T: Send + 'static> Default for Prefetched<T> {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manifest_keeps_the_most_recent_keys_first_each_once() {
        let dir = std::env::temp_dir().join(format!("kiln-recent-{}", std::process::id()));
        let recent = Recent::under(&dir, "t", &[b"DenseNet", b"default"]);
        assert_eq!(recent.keys(), Vec::<u128>::new());
        for k in [1u128, 2, 1, 3, 4, 5, 5, 6, 7] {
            recent.remember(k);
        }
        // new keys first, each once, at most MOST_KEYS (6); a key listed already stays where
        // it is (a warm start writes nothing), so key 1 fell off
        assert_eq!(recent.keys(), vec![7, 6, 5, 4, 3, 2]);
        // keys used together: listed already, nothing changes; else first, in their order
        recent.remember_all(&[3, 6]);
        assert_eq!(recent.keys(), vec![7, 6, 5, 4, 3, 2]);
        recent.remember_all(&[1, 5]);
        assert_eq!(recent.keys(), vec![1, 5, 7, 6, 4, 3]);
        // another identity is another manifest
        assert_eq!(Recent::under(&dir, "t", &[b"ResNet"]).keys(), vec![]);
        assert_ne!(
            recent.file,
            Recent::under(&dir, "u", &[b"DenseNet", b"default"]).file
        );
        // damaged lines are skipped
        std::fs::write(&recent.file.path, "zz\n7\n\n8\n").unwrap();
        assert_eq!(recent.keys(), vec![7, 8]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_manifest_is_used_once_until_a_reset_and_reads_back_what_was_written() {
        let dir = std::env::temp_dir().join(format!("kiln-manifest-{}", std::process::id()));
        let m = Manifest::under(&dir, "t", &[b"DenseNet"]);
        assert_ne!(m, Manifest::under(&dir, "t", &[b"ResNet"]));
        assert_eq!(m.read(), None);
        m.write("a\n");
        m.write("a\n"); // unchanged: left as it is
        assert_eq!(m.read().as_deref(), Some("a\n"));
        assert!(m.path.starts_with(dir.join("graphs").join("t")));
        assert!(m.first_use());
        assert!(!m.first_use());
        forget_uses();
        assert!(m.first_use());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_value_is_taken_once_under_its_key_and_the_rest_discarded() {
        let ahead = Prefetched::<u32>::new();
        ahead.start("f", 1, || Some(10));
        ahead.start("f", 1, || Some(11)); // already started: not read again
        ahead.start("f", 2, || Some(20));
        ahead.start("g", 3, || Some(30));
        assert_eq!(ahead.take(9), None);
        assert_eq!(ahead.take(1), Some(Some(10)));
        assert_eq!(ahead.take(1), None);
        ahead.discard("f");
        assert_eq!(ahead.take(2), None);
        assert_eq!(ahead.take(3), Some(Some(30)));
        // a read that found nothing says so; one that panicked is one never made
        ahead.start("f", 4, || None);
        assert_eq!(ahead.take(4), Some(None));
        ahead.start("f", 5, || panic!("damaged"));
        assert_eq!(ahead.take(5), None);
    }
}
