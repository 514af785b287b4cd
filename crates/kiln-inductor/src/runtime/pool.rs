//! The intermediate buffers of one compiled graph, kept between its calls.
//!
//! A call takes the whole pool at its start and gives it back at its end, so two threads calling
//! the same compiled function never share a buffer: the second finds the pool empty and allocates
//! its own (which it may leave behind for the next call). Within a call a buffer is handed out
//! again once no handle reaches it — the executor drops each value after its last reader, so that
//! is liveness, and views made by the core hold the storage too, so a buffer a live view looks at
//! is never overwritten. A buffer that is still reachable when the call ends has escaped to the
//! caller (an output that views it): it leaves the pool and belongs to the caller.

use std::cell::Cell;
use std::sync::Mutex;

use kiln_core::{DType, Device, Result, Tensor};

/// Counters of the executor on the calling thread (tests read them around a call).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExecStats {
    /// Compiled-graph runs.
    pub calls: u64,
    /// Bytes of new buffers the executor asked for (outputs, and pooled buffers not yet pooled).
    pub allocated_bytes: u64,
    /// Bytes of kernel outputs written into a pooled buffer another value used before.
    pub reused_bytes: u64,
    /// Bytes written straight into a mutated input's storage.
    pub inplace_bytes: u64,
    /// In-place writes that had to go through a copy instead (the input overlapped another input,
    /// or was not contiguous).
    pub inplace_fallbacks: u64,
    /// Calls answered by replaying a recorded device graph (reduce-overhead).
    pub graph_replays: u64,
    /// Bytes of replayed graphs' inputs copied into their recordings' buffers (inputs read in
    /// place — captured tensors, other recordings' outputs — are not counted).
    pub replay_copied_bytes: u64,
    /// Generated kernels launched (a horizontal kernel counts once: `horizontal.rs`).
    pub kernel_launches: u64,
    /// Generated kernels whose launch shape max-autotune timed (`runtime/autotune.rs`).
    pub kernels_tuned: u64,
    /// Generated kernels whose launch shape max-autotune read from a choice kept on disk
    /// instead of timing them (counted when the graph is compiled).
    pub tuning_hits: u64,
}

thread_local! {
    static STATS: Cell<ExecStats> = Cell::new(ExecStats::default());
}

/// This thread's executor counters.
pub fn stats() -> ExecStats {
    STATS.with(Cell::get)
}

pub(crate) fn count(f: impl FnOnce(&mut ExecStats)) {
    STATS.with(|s| {
        let mut v = s.get();
        f(&mut v);
        s.set(v);
    });
}

pub(crate) fn nbytes(shape: &[usize], dtype: DType) -> u64 {
    (shape.iter().product::<usize>() * dtype.size_in_bytes()) as u64
}

/// A new buffer on `device` for a kernel to fill (every element is written).
pub(crate) fn fresh(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
    count(|s| s.allocated_bytes += nbytes(shape, dtype));
    Tensor::empty_on(shape, dtype, device)
}

#[derive(Default)]
pub struct BufferPool {
    free: Mutex<Vec<Tensor>>,
}

impl BufferPool {
    /// The pool's buffers for one call (empty when another call holds them).
    pub fn take(&self) -> CallBuffers<'_> {
        let slots = std::mem::take(&mut *self.free.lock().unwrap_or_else(|e| e.into_inner()));
        CallBuffers { pool: self, slots }
    }
}

/// The buffers one call draws from; returned to the pool when dropped (also on error).
pub struct CallBuffers<'a> {
    pool: &'a BufferPool,
    slots: Vec<Tensor>,
}

impl CallBuffers<'_> {
    /// A buffer of `shape` and `dtype` on `device` no live value uses.
    pub fn get(&mut self, shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let free = |t: &Tensor| {
            t.dtype() == dtype && t.numel() == n && t.device() == device && t.is_sole_handle()
        };
        let hit = self
            .slots
            .iter()
            .position(|t| free(t) && t.shape() == shape)
            .or_else(|| self.slots.iter().position(free));
        if let Some(i) = hit {
            count(|s| s.reused_bytes += nbytes(shape, dtype));
            let t = &self.slots[i];
            return if t.shape() == shape {
                Ok(t.clone())
            } else {
                t.reshape(shape) // a view: it holds the storage as long as the value lives
            };
        }
        let t = fresh(shape, dtype, device)?;
        self.slots.push(t.clone());
        Ok(t)
    }
}

impl Drop for CallBuffers<'_> {
    fn drop(&mut self) {
        // a buffer still reachable has escaped (a view of it was returned): it is the caller's now
        let slots: Vec<Tensor> = std::mem::take(&mut self.slots)
            .into_iter()
            .filter(Tensor::is_sole_handle)
            .collect();
        let mut free = self.pool.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.is_empty() {
            *free = slots;
        }
        // else a concurrent call returned its buffers first; these go back to the allocator
    }
}
