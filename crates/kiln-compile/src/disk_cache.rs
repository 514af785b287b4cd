//! The compiled-graph cache on disk (PyTorch's FX graph cache and AOTAutograd cache): what a
//! compiler derived from a captured graph — AOT autograd's forward and backward graphs, a code
//! generator's planned steps and kernel sources — kept under the kiln cache folder
//! (`kiln_core::cache::cache_root()/graphs/<kind>/<key>.bin`), so a new process that captures
//! the same graph skips the work. The kernels themselves stay in their own caches (compiled C
//! libraries, NVRTC's cubins), which the stored sources hit.
//!
//! Rules, as for every kiln cache: written atomically (a temporary file, then a rename); each
//! entry starts with a magic word and a checksum of its payload, and an entry that fails either
//! is removed and counts as a miss (then rebuilt and stored again). A key covers everything the
//! stored result depends on: the graph's bytes (`codec::graph_bytes`, random seeds left out), the
//! compiler's build id (a hash of its sources: a rebuilt compiler never reads an older one's
//! entries) and its options. `KILN_GRAPH_CACHE=0` turns the cache off; `KILN_LOGS=graph_cache`
//! prints each read and write.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use xxhash_rust::xxh3::{xxh3_128, Xxh3};

use crate::logs::{self, Channel};

const MAGIC: &[u8; 8] = b"KILNGRF1";

static HITS: AtomicU64 = AtomicU64::new(0);
static MISSES: AtomicU64 = AtomicU64::new(0);
static STORES: AtomicU64 = AtomicU64::new(0);
static DAMAGED: AtomicU64 = AtomicU64::new(0);

/// Counters since the process started (all kinds together).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DiskCacheStats {
    pub hits: u64,
    pub misses: u64,
    pub stores: u64,
    /// Entries found damaged (removed; each also counts as a miss).
    pub damaged: u64,
}

pub fn stats() -> DiskCacheStats {
    DiskCacheStats {
        hits: HITS.load(Ordering::Relaxed),
        misses: MISSES.load(Ordering::Relaxed),
        stores: STORES.load(Ordering::Relaxed),
        damaged: DAMAGED.load(Ordering::Relaxed),
    }
}

/// Whether the cache is on (`KILN_GRAPH_CACHE=0` turns it off).
pub fn enabled() -> bool {
    std::env::var_os("KILN_GRAPH_CACHE").map_or(true, |v| v != "0")
}

/// The key of a record: a hash of its parts, each length-prefixed (so parts never run together).
pub fn key(parts: &[&[u8]]) -> u128 {
    let mut h = Xxh3::new();
    for p in parts {
        h.update(&(p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h.digest128()
}

fn path(kind: &str, key: u128) -> PathBuf {
    kiln_core::cache::cache_root()
        .join("graphs")
        .join(kind)
        .join(format!("{key:032x}.bin"))
}

/// The payload stored under (`kind`, `key`), or `None` (absent, damaged: then removed).
pub fn load(kind: &str, key: u128) -> Option<Vec<u8>> {
    read(kind, key, Count::Now)
}

/// Whether a read counts its hit or miss now, or leaves it to whoever takes what it read
/// (`count_taken`): a read ahead of need (`prefetch.rs`) may never be used. Damage is counted
/// (and the entry removed) at once either way.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Count {
    Now,
    WhenTaken,
}

impl Count {
    /// Adds one to `counter` if this read counts now.
    fn add(self, counter: &AtomicU64) {
        if self == Count::Now {
            counter.fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn read(kind: &str, key: u128, count: Count) -> Option<Vec<u8>> {
    let file = path(kind, key);
    let Ok(mut bytes) = std::fs::read(&file) else {
        count.add(&MISSES);
        logs::emit(Channel::GraphCache, || {
            format!("{kind} miss {}", file.display())
        });
        return None;
    };
    if !intact(&bytes) {
        forget_damaged(kind, key, count);
        return None;
    }
    // the payload in place: a plan holding a large graph's kernel sources is megabytes
    bytes.drain(..HEADER);
    count.add(&HITS);
    logs::emit(Channel::GraphCache, || {
        format!("{kind} hit {} ({} bytes)", file.display(), bytes.len())
    });
    Some(bytes)
}

/// Counts the hit (`found`) or miss of a value read with `Count::WhenTaken`, as it is taken.
pub fn count_taken(found: bool) {
    match found {
        true => HITS.fetch_add(1, Ordering::Relaxed),
        false => MISSES.fetch_add(1, Ordering::Relaxed),
    };
}

/// The record stored under (`kind`, `key`) as `decode` reads its payload, or `None` (absent,
/// damaged, or a payload `decode` rejects: then removed as damaged); its hit or miss counted as
/// `count` says (`Count::WhenTaken` for a read ahead of need, so the counters say what compiles
/// used).
pub fn load_decoded<T>(
    kind: &str,
    key: u128,
    decode: impl FnOnce(&[u8]) -> Option<T>,
    count: Count,
) -> Option<T> {
    let bytes = read(kind, key, count)?;
    let value = decode(&bytes);
    if value.is_none() {
        forget_damaged(kind, key, count);
    }
    value
}

/// Removes an entry whose payload could not be used (a bad checksum here, or a payload its
/// reader rejects: `read` counted a hit for it), counting it as damaged, and as a miss unless
/// its taker counts that.
fn forget_damaged(kind: &str, key: u128, count: Count) {
    let file = path(kind, key);
    logs::emit(Channel::GraphCache, || {
        format!("{kind} damaged, removed: {}", file.display())
    });
    let _ = std::fs::remove_file(file);
    DAMAGED.fetch_add(1, Ordering::Relaxed);
    count.add(&MISSES);
}

/// Bytes before a record's payload: the magic word, then the payload's checksum.
const HEADER: usize = MAGIC.len() + 16;

/// Whether a file's magic word and checksum hold.
fn intact(bytes: &[u8]) -> bool {
    let Some(rest) = bytes.strip_prefix(MAGIC) else {
        return false;
    };
    let Some((sum, payload)) = rest.split_at_checked(16) else {
        return false;
    };
    sum.try_into()
        .is_ok_and(|sum| u128::from_le_bytes(sum) == xxh3_128(payload))
}

/// Stores `payload` under (`kind`, `key`). Best effort: a cache that cannot be written leaves
/// compiles as they were.
pub fn store(kind: &str, key: u128, payload: &[u8]) {
    let file = path(kind, key);
    let mut bytes = Vec::with_capacity(HEADER + payload.len());
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&xxh3_128(payload).to_le_bytes());
    bytes.extend_from_slice(payload);
    if kiln_core::cache::write_atomically(&file, &bytes).is_ok() {
        STORES.fetch_add(1, Ordering::Relaxed);
        logs::emit(Channel::GraphCache, || {
            format!("{kind} stored {} ({} bytes)", file.display(), payload.len())
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_entry_reads_back_and_a_damaged_one_is_removed() {
        let dir = std::env::temp_dir().join(format!("kiln-disk-cache-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        kiln_core::cache::with_root(dir.clone(), || {
            let k = key(&[b"test", b"graph bytes"]);
            assert_ne!(
                k,
                key(&[b"testgraph", b" bytes"]),
                "parts must not run together"
            );
            assert_eq!(load("t", k), None);
            store("t", k, b"payload");
            assert_eq!(load("t", k).as_deref(), Some(&b"payload"[..]));
            // flip a payload byte: the checksum fails, the entry is gone
            let file = path("t", k);
            let mut bytes = std::fs::read(&file).unwrap();
            let last = bytes.len() - 1;
            bytes[last] ^= 1;
            std::fs::write(&file, &bytes).unwrap();
            let before = stats().damaged;
            assert_eq!(load("t", k), None);
            assert!(stats().damaged > before);
            assert!(!file.exists());
            // a truncated header is a miss too
            std::fs::write(&file, &MAGIC[..5]).unwrap();
            assert_eq!(load("t", k), None);
        });
        let _ = std::fs::remove_dir_all(&dir);
    }
}
