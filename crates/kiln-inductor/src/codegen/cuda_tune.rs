//! The candidates max-autotune times for each kernel of a graph: the graph planned again under
//! each launch shape of `TuneConfig::candidates`, each kernel of the default plan matched with
//! the kernel of another plan that computes the same values from the same arguments (same
//! outputs, written to the same places, same inputs in the same order), so any of them can be
//! launched on the step's buffers. A kernel whose choice is already on disk gets only that one
//! (`runtime/autotune.rs`).

use kiln_compile::graph::{Graph, NodeId};

use crate::backend::{plan_graph, Planned};
use crate::codegen::cuda::{Cuda, CudaKernel, TuneConfig};
use crate::runtime::autotune::{self, Choice};
use crate::runtime::plan::Alloc;
use crate::runtime::pool;

/// A kernel of a plan, with where it writes.
type PlannedKernel = (Vec<(NodeId, Alloc)>, CudaKernel);

/// The kernels each step of `planned` (the default plan) may launch: `None` to launch the
/// planned kernel (no other shape, or the default chosen before); `Some` with one kernel, the
/// shape chosen before; `Some` with several, the default first, to time at the first launch.
pub(crate) fn candidates(
    graph: &Graph,
    base: &Cuda,
    planned: &[Planned<CudaKernel>],
    device_key: Option<&str>,
) -> Vec<Option<Vec<CudaKernel>>> {
    let others: Vec<Vec<PlannedKernel>> = TuneConfig::candidates()
        .into_iter()
        .skip(1)
        .filter(TuneConfig::valid)
        .map(|cfg| {
            let target = Cuda {
                sm_count: base.sm_count,
                inline_matmul: base.inline_matmul,
                horizontal: base.horizontal,
                cfg,
                shared_per_block: base.shared_per_block,
                int_index: base.int_index,
            };
            plan_graph(&target, graph)
                .into_iter()
                .filter_map(|p| match p {
                    Planned::Kernel { kernel, outs } => Some((outs, kernel)),
                    Planned::Extern { .. } => None,
                })
                .collect()
        })
        .collect();
    planned
        .iter()
        .map(|p| {
            let Planned::Kernel { kernel, outs } = p else {
                return None;
            };
            let mut all = vec![kernel.clone()];
            for plan in &others {
                let same = plan
                    .iter()
                    .find(|(o, k)| o == outs && k.inputs == kernel.inputs);
                if let Some((_, k)) = same {
                    if !all.iter().any(|a| choice(a) == choice(k)) {
                        all.push(k.clone());
                    }
                }
            }
            if all.len() == 1 {
                return None;
            }
            let choices: Vec<Choice> = all.iter().map(choice).collect();
            match autotune::persisted(device_key, &kernel.name, &choices) {
                Some(i) => {
                    pool::count(|s| s.tuning_hits += 1);
                    (i > 0).then(|| vec![all.swap_remove(i)])
                }
                None => Some(all),
            }
        })
        .collect()
}

fn choice(k: &CudaKernel) -> Choice {
    Choice {
        name: k.name.clone(),
        grid: k.grid,
        block: k.block,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codegen::cuda::tests::sample_graph;

    fn kernels(planned: &[Planned<CudaKernel>]) -> Vec<&CudaKernel> {
        planned
            .iter()
            .filter_map(|p| match p {
                Planned::Kernel { kernel, .. } => Some(kernel),
                Planned::Extern { .. } => None,
            })
            .collect()
    }

    /// Every kernel of the sample gets the other shapes, default first, each reading the same
    /// inputs; a choice on disk narrows a kernel to it and counts a hit, a choice of the default
    /// launches the planned kernel.
    #[test]
    fn each_kernel_gets_its_shapes_and_a_persisted_choice_replaces_them() {
        let g = sample_graph();
        let planned = plan_graph(&Cuda::new(132), &g);
        let defaults = kernels(&planned);
        let all = candidates(&g, &Cuda::new(132), &planned, None);
        assert_eq!(all.len(), planned.len());
        for (k, c) in defaults.iter().zip(&all) {
            let c = c.as_ref().expect("every sample kernel has other shapes");
            assert!(c.len() > 2, "{} has {} shapes", k.name, c.len());
            assert_eq!(c[0].name, k.name);
            assert!(c.iter().all(|o| o.inputs == k.inputs));
            let distinct: std::collections::HashSet<_> = c.iter().map(choice).collect();
            assert_eq!(distinct.len(), c.len());
        }
        let dir = std::env::temp_dir().join(format!("kiln-cuda-tune-test-{}", std::process::id()));
        let _root = autotune::tests::CACHE_ROOT
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let _ = std::fs::remove_dir_all(&dir);
        kiln_core::cache::with_root(dir.clone(), || {
            let key = "Test GPU";
            let first = all[0].as_ref().expect("shapes");
            let second = all[1].as_ref().expect("shapes");
            let f = autotune::choice_file(key, &first[0].name);
            autotune::write_choice(&f, key, &choice(&first[2]), &[]).expect("write");
            let f = autotune::choice_file(key, &second[0].name);
            autotune::write_choice(&f, key, &choice(&second[0]), &[]).expect("write");
            let before = pool::stats().tuning_hits;
            let again = candidates(&g, &Cuda::new(132), &planned, Some(key));
            assert_eq!(pool::stats().tuning_hits - before, 2);
            let one = again[0].as_ref().expect("the chosen shape");
            assert_eq!(one.len(), 1);
            assert_eq!(choice(&one[0]), choice(&first[2]));
            assert!(
                again[1].is_none(),
                "the default was chosen: the planned kernel"
            );
            assert!(
                again[2].as_ref().is_some_and(|c| c.len() > 2),
                "not chosen yet"
            );
        });
        let _ = std::fs::remove_dir_all(&dir);
    }
}
