//! A caching allocator for large CPU buffers, and uninitialised (`empty`) tensors.
//!
//! Why: a buffer of hundreds of megabytes comes from the system as fresh pages, and the first write
//! to each page faults (measured on the dev VM: a copy into a new 256 MB buffer ran at 2.4 GB/s
//! against 74 GB/s into one already touched). A loop that drops one large output and allocates the
//! next of the same size — every compiled call, every training step — pays that on every
//! iteration. So storages of at least `MIN_BYTES` are not returned to the system when dropped: they
//! are kept (up to a byte limit, oldest evicted first) and handed to the next `Tensor::empty` of the
//! same dtype and length, whose pages are already mapped (as PyTorch's CUDA caching allocator does
//! for device memory).
//!
//! The limit is `KILN_CPU_CACHE_MB` megabytes (default 1024; 0 turns caching off). `empty_cache`
//! gives everything back to the system.

use std::collections::VecDeque;
use std::mem::MaybeUninit;
use std::sync::{Arc, Mutex, OnceLock};

use rayon::prelude::*;

use crate::storage::{CpuStorage, StorageElement};
use crate::{with_storage, DType, Result, Tensor};

/// Smaller buffers are left to malloc, whose own free lists already keep them warm.
pub const MIN_BYTES: usize = 1 << 20;

const DEFAULT_LIMIT_MB: usize = 1024;

#[derive(Default)]
struct Cache {
    /// Oldest first.
    free: VecDeque<CpuStorage>,
    bytes: usize,
    hits: u64,
    misses: u64,
}

fn cache() -> &'static Mutex<Cache> {
    static C: OnceLock<Mutex<Cache>> = OnceLock::new();
    C.get_or_init(Default::default)
}

fn lock() -> std::sync::MutexGuard<'static, Cache> {
    // the cache holds no invariant a panic could break halfway
    cache().lock().unwrap_or_else(|e| e.into_inner())
}

fn limit() -> usize {
    static L: OnceLock<usize> = OnceLock::new();
    *L.get_or_init(|| {
        std::env::var("KILN_CPU_CACHE_MB")
            .ok()
            .and_then(|v| v.trim().parse::<usize>().ok())
            .unwrap_or(DEFAULT_LIMIT_MB)
            .saturating_mul(1 << 20)
    })
}

fn bytes_of(s: &CpuStorage) -> usize {
    s.len() * s.dtype().size_in_bytes()
}

/// Frees a storage's buffer without offering it to the cache (an evicted or unwanted buffer).
fn release(mut s: CpuStorage) {
    with_storage!(&mut s, v => drop(std::mem::take(v)));
}

/// Called when a storage is dropped: keeps a large buffer for reuse. The storage is left empty.
pub(crate) fn recycle(s: &mut CpuStorage) {
    let bytes = bytes_of(s);
    if bytes < MIN_BYTES || bytes > limit() {
        return; // small (malloc keeps it warm), or caching is off, or larger than the whole cache
    }
    let dtype = s.dtype();
    let kept = std::mem::replace(s, CpuStorage::full(dtype, 0, 0.0));
    let mut evicted = Vec::new();
    {
        let mut c = lock();
        while c.bytes + bytes > limit() {
            match c.free.pop_front() {
                Some(old) => {
                    c.bytes -= bytes_of(&old);
                    evicted.push(old);
                }
                None => break,
            }
        }
        c.bytes += bytes;
        c.free.push_back(kept);
    }
    // outside the lock: freeing runs no destructor that takes it, but keep the critical section short
    evicted.into_iter().for_each(release);
}

/// A cached buffer of exactly `n` elements of `dtype`, most recently freed first. Its contents are
/// whatever its last owner left (valid values of the dtype).
fn take(dtype: DType, n: usize) -> Option<CpuStorage> {
    let mut c = lock();
    let found = c
        .free
        .iter()
        .rposition(|s| s.dtype() == dtype && s.len() == n);
    match found.and_then(|i| c.free.remove(i)) {
        Some(s) => {
            c.bytes -= bytes_of(&s);
            c.hits += 1;
            Some(s)
        }
        None => {
            c.misses += 1;
            None
        }
    }
}

/// A buffer of `n` elements of `dtype` whose values are unspecified (valid for the dtype), for a
/// writer of every element: a cached one when there is one (its pages are mapped, so the writes
/// do not fault page by page), else a fresh zeroed one (calloc's: untouched pages cost nothing
/// until written).
pub(crate) fn empty(dtype: DType, n: usize) -> CpuStorage {
    let cached = if n * dtype.size_in_bytes() >= MIN_BYTES {
        take(dtype, n)
    } else {
        None
    };
    cached.unwrap_or_else(|| CpuStorage::full(dtype, n, 0.0))
}

/// `CpuStorage::full` into a cached buffer when there is one (`empty`): a pad writing its
/// interior afterwards then does not fault page by page.
pub(crate) fn full(dtype: DType, n: usize, value: f64) -> CpuStorage {
    let mut s = empty(dtype, n);
    s.fill(value);
    s
}

/// A cached buffer of exactly `n` elements of `T` (`take`), for an eager kernel that writes every
/// element (a GEMM not reading its destination, `filled`): its output's pages are then already
/// mapped. `None` below `MIN_BYTES` or on a miss.
pub(crate) fn take_vec<T: StorageElement>(n: usize) -> Option<Vec<T>> {
    if n * std::mem::size_of::<T>() < MIN_BYTES {
        return None;
    }
    let mut s = take(T::DTYPE, n)?;
    // the emptied storage left behind is below MIN_BYTES: dropping it caches nothing
    T::view_mut(&mut s).map(std::mem::take)
}

/// A new vector of `n` elements whose chunks of `chunk` elements `write(chunk number, chunk)`
/// fills, every slot of every chunk (nothing fills the buffer before): on the threads from
/// `PAR_THRESHOLD` elements, into a cached buffer of that size when there is one (a fresh
/// buffer's first writes fault, which costs more than the loop writing them). What every eager
/// kernel that writes a whole new output (elementwise ops, strided copies) allocates with.
pub(crate) fn filled<T: StorageElement + Send + Sync>(
    n: usize,
    chunk: usize,
    write: impl Fn(usize, &mut [MaybeUninit<T>]) + Sync,
) -> Vec<T> {
    let mut out = match take_vec::<T>(n) {
        Some(mut v) => {
            // every slot is written again below; `T` is plain data, so nothing is dropped
            v.clear();
            v
        }
        None => Vec::with_capacity(n),
    };
    let slots = &mut out.spare_capacity_mut()[..n];
    let chunk = chunk.max(1);
    if n >= super::PAR_THRESHOLD {
        slots
            .par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(c, s)| write(c, s));
    } else {
        slots
            .chunks_mut(chunk)
            .enumerate()
            .for_each(|(c, s)| write(c, s));
    }
    // SAFETY: the chunks cover the first n slots, and `write` wrote every slot of its chunk
    unsafe { out.set_len(n) };
    out
}

/// Counters of the caching allocator (process-wide).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Bytes held for reuse now.
    pub cached_bytes: usize,
    /// Buffers held for reuse now.
    pub cached_buffers: usize,
    /// Large `empty` allocations and eager kernel outputs served from the cache / from the system.
    pub hits: u64,
    pub misses: u64,
}

pub fn cache_stats() -> CacheStats {
    let c = lock();
    CacheStats {
        cached_bytes: c.bytes,
        cached_buffers: c.free.len(),
        hits: c.hits,
        misses: c.misses,
    }
}

/// Returns every cached buffer to the system (`torch.cuda.empty_cache`'s CPU analog).
pub fn empty_cache() {
    let all: Vec<CpuStorage> = {
        let mut c = lock();
        c.bytes = 0;
        c.free.drain(..).collect()
    };
    all.into_iter().for_each(release);
}

impl Tensor {
    /// `torch.empty`: a contiguous tensor whose values are unspecified (but valid for the dtype) —
    /// for a producer that writes every element, such as a generated kernel. Large buffers come
    /// from the caching allocator, so their pages are already mapped.
    pub fn empty(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::from_storage(empty(dtype, shape.iter().product()), shape)
    }

    /// True when no other handle, view or weak reference reaches this tensor's storage: a buffer
    /// its holder may overwrite or hand out again without anyone observing it.
    pub fn is_sole_handle(&self) -> bool {
        Arc::strong_count(&self.0) == 1
            && Arc::weak_count(&self.0) == 0
            && match &self.0.storage {
                crate::storage::Storage::Cpu(s) => Arc::strong_count(s) == 1,
                crate::storage::Storage::Device(b) => Arc::strong_count(b) == 1,
            }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dropped_large_buffer_backs_the_next_empty_of_its_size() -> Result<()> {
        if limit() == 0 {
            return Ok(());
        }
        let n = (MIN_BYTES / 4) * 3;
        let a = Tensor::empty(&[n], DType::F32)?;
        // SAFETY: only the address is compared, nothing is read through it
        let addr = unsafe { a.data_ptr() } as usize;
        drop(a);
        let b = Tensor::empty(&[3, n / 3], DType::F32)?;
        assert_eq!(unsafe { b.data_ptr() } as usize, addr, "reused");
        // another dtype or length does not take it
        drop(b);
        let c = Tensor::empty(&[n], DType::I32)?;
        assert_ne!(unsafe { c.data_ptr() } as usize, addr);
        // small buffers are not cached
        let before = cache_stats().cached_buffers;
        drop(Tensor::zeros(&[16], DType::F32)?);
        assert_eq!(cache_stats().cached_buffers, before);
        empty_cache();
        assert_eq!(cache_stats().cached_bytes, 0);
        Ok(())
    }

    /// An eager elementwise kernel's large output comes from the cache too: a loop that drops
    /// one result and computes the next writes into pages already mapped.
    #[test]
    fn an_eager_kernel_writes_into_a_cached_buffer() -> Result<()> {
        if limit() == 0 {
            return Ok(());
        }
        let n = MIN_BYTES; // 4 MB of f32
        let x = Tensor::full(&[n], 1.5, DType::F32)?;
        let y = x.add(&x)?;
        // SAFETY: only the address is compared, nothing is read through it
        let addr = unsafe { y.data_ptr() } as usize;
        drop(y);
        let z = x.mul(&x)?;
        assert_eq!(unsafe { z.data_ptr() } as usize, addr, "reused");
        assert_eq!(z.to_vec::<f32>()?[n - 1], 2.25);
        let c = x.gt(1.0)?;
        let w = Tensor::where_(&c, &z, &x)?;
        assert_eq!(w.to_vec::<f32>()?[n / 2], 2.25);
        Ok(())
    }

    #[test]
    fn sole_handle_sees_clones_and_views() -> Result<()> {
        let t = Tensor::zeros(&[4], DType::F32)?;
        assert!(t.is_sole_handle());
        let c = t.clone();
        assert!(!t.is_sole_handle());
        drop(c);
        let v = t.reshape([2, 2])?;
        assert!(!t.is_sole_handle());
        drop(v);
        assert!(t.is_sole_handle());
        Ok(())
    }
}
