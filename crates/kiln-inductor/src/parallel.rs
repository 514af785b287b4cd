//! Work spread over threads, as the compilers spread it: kernels dealt into translation units
//! of about equal size (the C target's `runtime/cc.rs` and the CUDA target's
//! `codegen/cuda_units.rs` build one unit per thread), and independent jobs each on a thread of
//! their own.

/// Item indices dealt into at most `bins` bins by weight: the heaviest first, each onto the
/// lightest bin so far; each bin's indices ascending (so a bin's contents, and whatever text is
/// made of it, depend on the items alone, not on how weights tied). Empty bins are dropped.
pub(crate) fn deal(weights: &[usize], bins: usize) -> Vec<Vec<usize>> {
    let n = bins.max(1);
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(weights[i]));
    let mut load = vec![0usize; n];
    let mut out: Vec<Vec<usize>> = vec![Vec::new(); n];
    for i in order {
        let lightest = (0..n).min_by_key(|&b| load[b]).unwrap_or(0);
        load[lightest] += weights[i];
        out[lightest].push(i);
    }
    out.into_iter()
        .filter(|b| !b.is_empty())
        .map(|mut b| {
            b.sort_unstable();
            b
        })
        .collect()
}

/// `f` of each item, each on a thread of its own (the calling thread for a single item),
/// results in item order; a thread's panic resumes on the caller.
pub(crate) fn map_threads<T: Send, R: Send>(items: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    if items.len() <= 1 {
        return items.into_iter().map(f).collect();
    }
    std::thread::scope(|s| {
        let f = &f;
        let threads: Vec<_> = items
            .into_iter()
            .map(|item| s.spawn(move || f(item)))
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dealing_balances_weights_and_keeps_each_item_once_in_order() {
        let bins = deal(&[9, 3, 5, 4, 7, 2], 3);
        // 9 -> a, 7 -> b, 5 -> c, 4 -> c (9), 3 -> b (10), 2 -> a (11): the first lightest wins ties
        assert_eq!(bins, vec![vec![0, 5], vec![1, 4], vec![2, 3]]);
        assert_eq!(deal(&[1, 2], 8), vec![vec![1], vec![0]], "no empty bins");
        assert_eq!(deal(&[1, 2, 3], 0), vec![vec![0, 1, 2]], "at least one bin");
    }

    #[test]
    fn mapped_threads_keep_the_order() {
        let out = map_threads((0..16).collect(), |i: u64| i * i);
        assert_eq!(out, (0..16).map(|i| i * i).collect::<Vec<_>>());
    }
}
