//! The caching allocator: device memory is taken from the driver once and reused, so a steady state
//! (a training loop, repeated eager ops) makes no cuMemAlloc/cuMemFree calls.
//!
//! Blocks are rounded up to size classes (512 B steps below 1 MiB, 2 MiB steps above) and kept, when
//! freed, in a free list per class. All of a device's work runs on one stream in order, so a block
//! freed by a buffer's drop may be handed to the next allocation at once: any kernel that still
//! reads the old contents was queued before any kernel that writes the new ones.

use std::collections::HashMap;

use cudarc::driver::{result, sys};
use kiln_core::profiler::Category;

const SMALL_STEP: usize = 512;
const LARGE_STEP: usize = 2 << 20;
const LARGE_FROM: usize = 1 << 20;

/// `torch.cuda.memory_stats`' headline numbers, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// In live tensors (rounded to the size class).
    pub allocated: usize,
    /// Taken from the driver: allocated plus cached free blocks.
    pub reserved: usize,
    /// The most `allocated` has been since the process started (or `reset_peak`).
    pub peak_allocated: usize,
    /// cuMemAlloc calls made (stays flat in a steady state).
    pub driver_allocs: u64,
}

#[derive(Default)]
pub(crate) struct Pool {
    free: HashMap<usize, Vec<sys::CUdeviceptr>>,
    pub(crate) stats: MemoryStats,
    /// The graph being recorded (`capture.rs`), whose allocations it owns.
    pub(crate) capturing: Option<u64>,
    /// Blocks allocated while a graph was recorded: its replays write them, so while the graph
    /// lives they never return to the free lists (a freed one waits for the graph's end).
    graph_blocks: HashMap<sys::CUdeviceptr, GraphBlock>,
}

struct GraphBlock {
    graph: u64,
    class: usize,
    freed: bool,
}

pub(crate) fn size_class(bytes: usize) -> usize {
    let b = bytes.max(1);
    if b < LARGE_FROM {
        b.div_ceil(SMALL_STEP) * SMALL_STEP
    } else {
        b.div_ceil(LARGE_STEP) * LARGE_STEP
    }
}

impl Pool {
    /// A block of at least `bytes` (the caller holds the device's context current).
    pub(crate) fn alloc(&mut self, bytes: usize) -> Result<(sys::CUdeviceptr, usize), String> {
        let class = size_class(bytes);
        let ptr = match self.free.get_mut(&class).and_then(|v| v.pop()) {
            Some(p) => p,
            None => {
                let _span = kiln_core::profiler::span(Category::Memory, || "cuMemAlloc".into());
                // SAFETY: plain device allocation in the current context
                let p = match unsafe { result::malloc_sync(class) } {
                    Ok(p) => p,
                    Err(_) => {
                        // out of memory: give the cached blocks back and try once more
                        self.release_cached();
                        unsafe { result::malloc_sync(class) }.map_err(|e| {
                            format!(
                                "out of device memory allocating {class} bytes ({e:?}); \
                                 {} bytes are in live tensors",
                                self.stats.allocated
                            )
                        })?
                    }
                };
                self.stats.reserved += class;
                self.stats.driver_allocs += 1;
                p
            }
        };
        self.stats.allocated += class;
        self.stats.peak_allocated = self.stats.peak_allocated.max(self.stats.allocated);
        if let Some(graph) = self.capturing {
            let block = GraphBlock {
                graph,
                class,
                freed: false,
            };
            self.graph_blocks.insert(ptr, block);
        }
        Ok((ptr, class))
    }

    pub(crate) fn free(&mut self, ptr: sys::CUdeviceptr, class: usize) {
        self.stats.allocated -= class;
        match self.graph_blocks.get_mut(&ptr) {
            Some(b) => b.freed = true,
            None => self.free.entry(class).or_default().push(ptr),
        }
    }

    /// A recorded graph ended: its freed blocks return to the free lists; its live ones go
    /// back when their buffers drop.
    pub(crate) fn release_graph(&mut self, graph: u64) {
        let mine: Vec<sys::CUdeviceptr> = self
            .graph_blocks
            .iter()
            .filter(|(_, b)| b.graph == graph)
            .map(|(&p, _)| p)
            .collect();
        for p in mine {
            if let Some(b) = self.graph_blocks.remove(&p) {
                if b.freed {
                    self.free.entry(b.class).or_default().push(p);
                }
            }
        }
    }

    /// Returns every cached free block to the driver (`torch.cuda.empty_cache`). The caller has
    /// synchronized the stream, so no queued kernel still uses them.
    pub(crate) fn release_cached(&mut self) {
        for (class, ptrs) in self.free.drain() {
            for p in ptrs {
                // SAFETY: the block is free (no buffer refers to it) and the stream is idle
                let _ = unsafe { result::free_sync(p) };
                self.stats.reserved -= class;
            }
        }
    }
}
