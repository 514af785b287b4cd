//! glibc's malloc, set once for a compile's warm start (`tune_malloc`).
//!
//! A warm start traces the user's code on one thread while others read the compiled graphs and
//! kernels ahead from the disk cache. Each of those threads allocates in an arena of its own,
//! new to the process, and glibc grows such an arena a page at a time, one `mprotect` a page:
//! decoding a training step's graphs took ~850 of them on three threads (strace, CPU warm start
//! of DenseNet-121). Each takes the process's memory-map lock for writing, so every other
//! thread's page faults (the trace's, the driver's module loads) wait for it. With a pad, an
//! arena grows by the pad at a time: 21-22 `mprotect`s in that warm start with a pad of 8 or 64
//! MiB (132 with 1 MiB). With 64 MiB, DenseNet-121's training warm start on the H200 went from a
//! median of 48.6 to 46.3 ms and from 48.5 to 45.8 ms in two calls (8 interleaved runs each),
//! its driver work from 6.8 to 5.0 ms of module loads; on a busier machine the pad alone
//! (`MALLOC_TOP_PAD_`) took the median from 59.1 to 49.3 ms (BENCHMARKS.md).
//!
//! The pad is 8 MiB, not the 64 MiB measured on the GPU: an arena keeps up to a pad of memory it
//! touched after its blocks are freed (eight threads that each allocated and freed 64 MiB in 1
//! MiB blocks left 512 MB resident with a 64 MiB pad, 64 MB with 8 MiB, 1 MB without), and 8 MiB
//! already grows each of a warm start's arenas in one step (the strace counts above).
//!
//! Setting the pad turns off glibc's dynamic mmap threshold, which otherwise rises (up to 32
//! MiB) as large blocks are freed; it is set to that ceiling here, so blocks below 32 MiB keep
//! coming from the arenas, as they would once the dynamic threshold had risen.
//!
//! Process-wide, so it is done once, and not at all where the user chose otherwise: with
//! `MALLOC_TOP_PAD_` or `MALLOC_MMAP_THRESHOLD_` in the environment, or `KILN_MALLOC=0`.
//! Elsewhere than glibc on Linux it does nothing.

use std::sync::Once;

/// The pad an arena grows by.
const TOP_PAD: i32 = 8 << 20;
/// Blocks from this size on are mapped on their own (glibc's dynamic threshold's ceiling).
const MMAP_THRESHOLD: i32 = 32 << 20;

/// Whether `tune_malloc` changes anything, given the environment: not when the user set glibc's
/// own variables for these, or `KILN_MALLOC=0`.
fn wanted(var: impl Fn(&str) -> Option<std::ffi::OsString>) -> bool {
    var("KILN_MALLOC").map_or(true, |v| v != "0")
        && var("MALLOC_TOP_PAD_").is_none()
        && var("MALLOC_MMAP_THRESHOLD_").is_none()
}

/// Sets glibc's top pad and mmap threshold (see the module's comment), once per process.
pub fn tune_malloc() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if wanted(|k| std::env::var_os(k)) {
            set();
        }
    });
}

/// Sets both parameters (glibc 2.36's `mallopt` answers 1 whatever it is given, so its answer
/// says nothing: the tests look at the arenas instead).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set() {
    // glibc's <malloc.h>
    const M_TOP_PAD: i32 = -2;
    const M_MMAP_THRESHOLD: i32 = -3;
    extern "C" {
        fn mallopt(param: i32, value: i32) -> i32;
    }
    // SAFETY: mallopt takes two ints and changes allocator parameters only; glibc serializes it
    // with the arenas' locks
    unsafe {
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        mallopt(M_TOP_PAD, TOP_PAD);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set() {}

#[cfg(test)]
mod tests {
    use super::*;

    /// The user's own settings, and `KILN_MALLOC=0`, leave malloc alone.
    #[test]
    fn only_where_the_user_set_nothing() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(name, _)| *name == k)
                    .map(|(_, v)| std::ffi::OsString::from(v))
            }
        };
        assert!(wanted(env(&[])));
        assert!(wanted(env(&[("KILN_MALLOC", "1")])));
        assert!(!wanted(env(&[("KILN_MALLOC", "0")])));
        assert!(!wanted(env(&[("MALLOC_TOP_PAD_", "0")])));
        assert!(!wanted(env(&[("MALLOC_MMAP_THRESHOLD_", "131072")])));
    }

    /// With the settings, a thread's 2 MiB block comes from an arena grown by the pad (its
    /// mapping in /proc/self/maps spans at least the pad); without them glibc maps such a
    /// block on its own (2 MiB and a page), or grows an arena by the block and 128 KiB.
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn a_thread_s_arena_grows_by_the_pad() {
        set();
        let span = std::thread::spawn(|| {
            let block = vec![1u8; 2 << 20];
            mapping_span(block.as_ptr() as usize)
        })
        .join()
        .unwrap();
        assert!(
            span >= TOP_PAD as usize,
            "the block's mapping spans {span} bytes"
        );
    }

    /// The size of the mapping of this process that holds `address` (0 if none).
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn mapping_span(address: usize) -> usize {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines()
            .filter_map(|l| {
                let (start, end) = l.split_whitespace().next()?.split_once('-')?;
                let start = usize::from_str_radix(start, 16).ok()?;
                let end = usize::from_str_radix(end, 16).ok()?;
                (start <= address && address < end).then_some(end - start)
            })
            .next()
            .unwrap_or(0)
    }
}
