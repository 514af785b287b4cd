//! The caching allocator: device memory is taken from the driver in few large arenas and reused,
//! so a steady state (a training loop, repeated eager ops) makes no cuMemAlloc/cuMemFree calls,
//! and a first call makes few.
//!
//! Blocks are rounded up to size classes (512 B steps below 1 MiB, 2 MiB steps above), carved from
//! the front of an arena, and kept, when freed, in a free list per class. An arena is one driver
//! allocation, at least ARENA_MIN and growing with what the pool holds up to ARENA_MAX, or one
//! block's size where that is larger: DenseNet-121's first compiled training step took 374
//! blocks from the driver one call each, a cuMemAlloc apiece on its warm start's path. All of a
//! device's work runs on one stream in order, so a block freed by a buffer's drop may be handed to
//! the next allocation at once: any kernel that still reads the old contents was queued before any
//! kernel that writes the new ones.

use std::collections::{BTreeMap, HashMap};

use cudarc::driver::{result, sys};
use kiln_core::profiler::Category;

const SMALL_STEP: usize = 512;
const LARGE_STEP: usize = 2 << 20;
const LARGE_FROM: usize = 1 << 20;
/// The smallest arena, and the largest the pool grows one to (a larger block gets its own).
const ARENA_MIN: usize = 32 << 20;
const ARENA_MAX: usize = 1 << 30;

/// `torch.cuda.memory_stats`' headline numbers, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// In live tensors (rounded to the size class).
    pub allocated: usize,
    /// Taken from the driver: allocated, cached free blocks and the arenas' uncarved rest.
    pub reserved: usize,
    /// The most `allocated` has been since the process started (or `reset_peak`).
    pub peak_allocated: usize,
    /// cuMemAlloc calls made (stays flat in a steady state).
    pub driver_allocs: u64,
}

/// Where the pool's arenas come from: the CUDA driver, or a stand-in in the unit tests.
pub(crate) trait Driver: Default {
    /// `bytes` of device memory (the caller holds the device's context current).
    fn alloc(&mut self, bytes: usize) -> Result<sys::CUdeviceptr, String>;
    /// Gives back what `alloc` returned, once no queued work uses it.
    fn free(&mut self, ptr: sys::CUdeviceptr);
}

#[derive(Default)]
pub(crate) struct CudaDriver;

impl Driver for CudaDriver {
    fn alloc(&mut self, bytes: usize) -> Result<sys::CUdeviceptr, String> {
        let _span = kiln_core::profiler::span(Category::Memory, || "cuMemAlloc".into());
        // SAFETY: plain device allocation in the current context
        unsafe { result::malloc_sync(bytes) }.map_err(|e| format!("{e:?}"))
    }

    fn free(&mut self, ptr: sys::CUdeviceptr) {
        // SAFETY: the arena is `alloc`'s, none of its blocks is in use, the stream is idle
        let _ = unsafe { result::free_sync(ptr) };
    }
}

/// One driver allocation blocks are carved from, front to back.
struct Arena {
    size: usize,
    /// Bytes carved so far (a carved block stays the arena's, in use or on a free list).
    carved: usize,
    /// Carved blocks not on a free list: in buffers, or held by a recorded graph.
    live: usize,
}

#[derive(Default)]
pub(crate) struct Pool<D: Driver = CudaDriver> {
    driver: D,
    /// By base address, so a block finds its arena.
    arenas: BTreeMap<sys::CUdeviceptr, Arena>,
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

impl<D: Driver> Pool<D> {
    /// A block of at least `bytes` (the caller holds the device's context current).
    pub(crate) fn alloc(&mut self, bytes: usize) -> Result<(sys::CUdeviceptr, usize), String> {
        let class = size_class(bytes);
        let ptr = match self.free.get_mut(&class).and_then(|v| v.pop()) {
            Some(p) => p,
            None => self.carve(class)?,
        };
        if let Some(a) = self.arena_of(ptr) {
            a.live += 1;
        }
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
            None => self.cache(ptr, class),
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
                    self.cache(p, b.class);
                }
            }
        }
    }

    /// Returns every arena with no live block to the driver, its cached blocks with it
    /// (`torch.cuda.empty_cache`; an arena with a block in use stays whole, as a PyTorch segment
    /// does). The caller has synchronized the stream, so no queued kernel still uses them.
    pub(crate) fn release_cached(&mut self) {
        let idle: Vec<(sys::CUdeviceptr, usize)> = self
            .arenas
            .iter()
            .filter(|(_, a)| a.live == 0)
            .map(|(&base, a)| (base, a.size))
            .collect();
        if idle.is_empty() {
            return;
        }
        let in_idle = |p: sys::CUdeviceptr| {
            idle.iter()
                .any(|&(base, size)| p >= base && p < base + size as u64)
        };
        for ptrs in self.free.values_mut() {
            ptrs.retain(|&p| !in_idle(p));
        }
        self.free.retain(|_, ptrs| !ptrs.is_empty());
        for (base, size) in idle {
            self.arenas.remove(&base);
            self.driver.free(base);
            self.stats.reserved -= size;
        }
    }

    /// A freed block back on its class's free list.
    fn cache(&mut self, ptr: sys::CUdeviceptr, class: usize) {
        if let Some(a) = self.arena_of(ptr) {
            a.live -= 1;
        }
        self.free.entry(class).or_default().push(ptr);
    }

    /// The arena a block was carved from (every block the pool hands out is, and an arena stays
    /// while any of its blocks is live).
    fn arena_of(&mut self, ptr: sys::CUdeviceptr) -> Option<&mut Arena> {
        let found = self.arenas.range_mut(..=ptr).next_back();
        debug_assert!(found.is_some(), "a device block outside the pool's arenas");
        found.map(|(_, a)| a)
    }

    /// A new block of `class` bytes from the first arena with room, or from a new arena.
    fn carve(&mut self, class: usize) -> Result<sys::CUdeviceptr, String> {
        if let Some((base, a)) = self
            .arenas
            .iter_mut()
            .find(|(_, a)| a.size - a.carved >= class)
        {
            let p = base + a.carved as u64;
            a.carved += class;
            return Ok(p);
        }
        let grown = self.stats.reserved.clamp(ARENA_MIN, ARENA_MAX);
        let size = grown.max(class).div_ceil(LARGE_STEP) * LARGE_STEP;
        let (base, size) = match self.driver.alloc(size) {
            Ok(base) => (base, size),
            Err(_) => {
                // out of memory: give the idle arenas back, then take just this block
                self.release_cached();
                let base = self.driver.alloc(class).map_err(|e| {
                    format!(
                        "out of device memory allocating {class} bytes ({e}); {} bytes are in \
                         live tensors, {} reserved",
                        self.stats.allocated, self.stats.reserved
                    )
                })?;
                (base, class)
            }
        };
        let arena = Arena {
            size,
            carved: class,
            live: 0,
        };
        self.arenas.insert(base, arena);
        self.stats.reserved += size;
        self.stats.driver_allocs += 1;
        Ok(base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Addresses from a counter; out of memory past `capacity` bytes held at once.
    #[derive(Default)]
    struct FakeDriver {
        next: sys::CUdeviceptr,
        held: HashMap<sys::CUdeviceptr, usize>,
        capacity: Option<usize>,
    }

    impl Driver for FakeDriver {
        fn alloc(&mut self, bytes: usize) -> Result<sys::CUdeviceptr, String> {
            let held: usize = self.held.values().sum();
            if self.capacity.is_some_and(|c| held + bytes > c) {
                return Err("CUDA_ERROR_OUT_OF_MEMORY".into());
            }
            // a gap between allocations, so a block past its arena's end would show
            let base = (1 << 40) + self.next;
            self.next += bytes as u64 + (1 << 20);
            self.held.insert(base, bytes);
            Ok(base)
        }

        fn free(&mut self, ptr: sys::CUdeviceptr) {
            assert!(
                self.held.remove(&ptr).is_some(),
                "freed twice or never held"
            );
        }
    }

    /// Every live block lies inside a driver allocation the pool holds, none overlapping another.
    fn assert_disjoint(pool: &Pool<FakeDriver>, live: &[(sys::CUdeviceptr, usize)]) {
        let mut spans: Vec<_> = live.to_vec();
        spans.sort();
        for w in spans.windows(2) {
            assert!(w[0].0 + w[0].1 as u64 <= w[1].0, "blocks overlap: {w:?}");
        }
        for &(p, class) in live {
            let inside = pool
                .driver
                .held
                .iter()
                .any(|(&b, &size)| p >= b && p + class as u64 <= b + size as u64);
            assert!(
                inside,
                "block {p:#x} of {class} bytes outside the driver's memory"
            );
        }
    }

    /// Hundreds of blocks of many sizes (a training step's first call) take a handful of driver
    /// allocations; they never overlap; the stats add up.
    #[test]
    fn a_first_step_takes_few_driver_allocations() {
        let mut pool = Pool::<FakeDriver>::default();
        let mut live = Vec::new();
        for i in 0..400usize {
            let bytes = match i % 4 {
                0 => 4 << 10,
                1 => (i + 1) * 1000,
                2 => (i % 37 + 1) << 20,
                _ => 100 << 20,
            };
            live.push(pool.alloc(bytes).unwrap());
        }
        assert_disjoint(&pool, &live);
        assert!(pool.stats.driver_allocs <= 40, "{:?}", pool.stats);
        let allocated: usize = live.iter().map(|b| b.1).sum();
        assert_eq!(pool.stats.allocated, allocated);
        assert!(pool.stats.reserved >= allocated);
        assert_eq!(
            pool.stats.reserved,
            pool.driver.held.values().sum::<usize>()
        );
    }

    /// A freed block serves the next request of its class without the driver; a steady state
    /// of allocations and frees makes no driver call.
    #[test]
    fn freed_blocks_are_reused_by_their_class() {
        let mut pool = Pool::<FakeDriver>::default();
        let (a, class) = pool.alloc(3000).unwrap();
        pool.free(a, class);
        let allocs = pool.stats.driver_allocs;
        for _ in 0..100 {
            let (b, c) = pool.alloc(2600).unwrap();
            assert_eq!((b, c), (a, class));
            let (d, e) = pool.alloc(5 << 20).unwrap();
            pool.free(b, c);
            pool.free(d, e);
        }
        assert_eq!(pool.stats.driver_allocs, allocs);
        assert_eq!(pool.stats.allocated, 0);
    }

    /// `release_cached` gives back the arenas none of whose blocks is live, and only those; a
    /// block of a released arena is never handed out again.
    #[test]
    fn empty_cache_returns_idle_arenas_only() {
        let mut pool = Pool::<FakeDriver>::default();
        // one block larger than ARENA_MAX: an arena of its own
        let big = pool.alloc(ARENA_MAX + (4 << 20)).unwrap();
        let small: Vec<_> = (0..10).map(|_| pool.alloc(1 << 20).unwrap()).collect();
        assert_eq!(pool.arenas.len(), 2);
        pool.free(big.0, big.1);
        for &(p, c) in &small[1..] {
            pool.free(p, c);
        }
        pool.release_cached();
        // the big block's arena went; the small blocks' stays (one is live)
        assert_eq!(pool.arenas.len(), 1);
        assert_eq!(pool.driver.held.len(), 1);
        assert_eq!(
            pool.stats.reserved,
            pool.driver.held.values().sum::<usize>()
        );
        let again = pool.alloc(ARENA_MAX + (4 << 20)).unwrap();
        assert_disjoint(&pool, &[again, small[0]]);
        pool.free(again.0, again.1);
        pool.free(small[0].0, small[0].1);
        pool.release_cached();
        assert_eq!(pool.stats.reserved, 0);
        assert!(pool.driver.held.is_empty() && pool.free.is_empty());
    }

    /// A recorded graph's blocks stay out of the free lists (and keep their arena) until the
    /// graph is released.
    #[test]
    fn a_graphs_blocks_wait_for_its_release() {
        let mut pool = Pool::<FakeDriver> {
            capturing: Some(7),
            ..Pool::default()
        };
        let (p, class) = pool.alloc(8192).unwrap();
        pool.capturing = None;
        pool.free(p, class);
        let (q, _) = pool.alloc(8192).unwrap();
        assert_ne!(
            p, q,
            "a graph's freed block was handed out while the graph lives"
        );
        pool.release_cached();
        assert_eq!(
            pool.arenas.len(),
            1,
            "an arena with a graph's block was released"
        );
        pool.release_graph(7);
        assert_eq!(pool.alloc(8192).unwrap().0, p);
    }

    /// Out of memory for a new arena, the pool gives back its idle arenas and takes just the
    /// block; past that, a clear error.
    #[test]
    fn out_of_memory_falls_back_to_the_block_alone() {
        let mut pool = Pool::<FakeDriver>::default();
        pool.driver.capacity = Some(ARENA_MIN + (8 << 20));
        let a = pool.alloc(2 << 20).unwrap();
        pool.free(a.0, a.1);
        // no room left in the first arena; a second does not fit beside it
        let b = pool.alloc(36 << 20).unwrap();
        assert_eq!(b.1, 36 << 20);
        assert_eq!(pool.arenas.len(), 1, "the idle arena was given back");
        assert_eq!(pool.stats.reserved, 36 << 20);
        let err = pool.alloc(100 << 20).unwrap_err();
        assert!(err.contains("out of device memory allocating"), "{err}");
        assert_eq!(
            pool.arenas.len(),
            1,
            "an arena with a live block was given back"
        );
    }
}
