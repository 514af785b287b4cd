//! Size-generic CUDA kernels for symbolic graphs. Each size of a symbolic graph is planned and
//! generated as a static graph (cheap: no NVRTC); under a size context
//! (`kiln_compile::symbolic::context`) each kernel then goes through `codegen/template.rs`, which
//! answers a kernel over `long long` size parameters wherever one instantiates to this size's text
//! (the soundness rule: exactly that text's literals at these sizes). The launch grid is not part
//! of the text: it is the static kernel's, computed for this size by the planning, and correct for
//! the size-generic kernel too because every kernel is a grid-stride loop reading its block count
//! from `gridDim`.
//!
//! The size-generic kernels are compiled as translation units of their own, dealt by their own
//! sources only: once every kernel has its template, a new size builds the same units, which the
//! runtime's caches answer without NVRTC (the static kernels' units would change with every size).

use kiln_compile::graph::Graph;
use kiln_compile::symbolic::context::SizeContext;

use crate::backend::Planned;
use crate::codegen::c::Kernel;
use crate::codegen::cuda::CudaKernel;
use crate::codegen::cuda_units::{self, KernelSource};
use crate::codegen::template::{self, SizeArgs};

/// A planned kernel as it is compiled: its name and source (size-generic where a template
/// instantiates at these sizes), the device functions it calls, and its size arguments (empty for
/// a static kernel).
#[derive(Clone)]
pub(crate) struct Resolved {
    pub name: String,
    pub source: String,
    pub device_fns: Vec<(String, String)>,
    pub sizes: Vec<i64>,
}

impl Resolved {
    pub(crate) fn of(k: &CudaKernel) -> Self {
        Resolved {
            name: k.name.clone(),
            source: k.source.clone(),
            device_fns: k.device_fns.clone(),
            sizes: Vec::new(),
        }
    }
}

/// The planned kernels of `graph`, in order, as compiled at the sizes of `ctx` (each kernel itself
/// without one).
pub(crate) fn resolve(
    graph: &Graph,
    planned: &[Planned<CudaKernel>],
    ctx: Option<&SizeContext>,
) -> Vec<Resolved> {
    let kernels: Vec<&CudaKernel> = planned
        .iter()
        .filter_map(|p| match p {
            Planned::Kernel { kernel, .. } => Some(kernel),
            Planned::Extern { .. } => None,
        })
        .collect();
    let count = kernels.len();
    kernels
        .into_iter()
        .enumerate()
        .map(|(i, k)| match ctx {
            // a horizontal kernel's members are device functions the template does not see:
            // kept static (the planning makes none under a size context)
            Some(ctx) if k.device_fns.is_empty() => {
                let text = Kernel {
                    name: k.name.clone(),
                    source: k.source.clone(),
                    inputs: Vec::new(),
                    member: None,
                };
                let place = template::place(graph.nodes.len(), count, i);
                let (t, sizes) = template::resolve(ctx, place, &text, SizeArgs::Params);
                Resolved {
                    name: t.name,
                    source: t.source,
                    device_fns: Vec::new(),
                    sizes,
                }
            }
            _ => Resolved::of(k),
        })
        .collect()
}

/// The translation units for `kernels` (`cuda_units::units`): the size-generic kernels' units,
/// then the static ones', each kernel once.
pub(crate) fn units(
    prelude: &str,
    kernels: &[Resolved],
    threads: usize,
) -> Vec<(String, Vec<String>)> {
    let part = |generic: bool| {
        let mut out: Vec<KernelSource<'_>> = Vec::new();
        for k in kernels.iter().filter(|k| k.sizes.is_empty() != generic) {
            if !out.iter().any(|o| o.name == k.name) {
                out.push(KernelSource {
                    name: &k.name,
                    source: &k.source,
                    device_fns: &k.device_fns,
                });
            }
        }
        out
    };
    let (generic, fixed) = (part(true), part(false));
    let mut units = Vec::new();
    if !generic.is_empty() {
        units.extend(cuda_units::units(prelude, &generic, threads));
    }
    if !fixed.is_empty() {
        units.extend(cuda_units::units(prelude, &fixed, threads));
    }
    units
}

#[cfg(test)]
mod tests {
    use kiln_compile::graph::Op;
    use kiln_core::prim::{BinaryOp, Prim, ReduceOp, UnaryOp};

    use super::*;
    use crate::backend::plan_graph;
    use crate::codegen::cuda::Cuda;
    use crate::test_graphs::push;

    /// A softmax-like graph over rows of 512 at `n` rows: a pointwise chain (vector loads: at
    /// least 4096 elements), a row reduction (a warp per row), and a broadcast back.
    fn graph(n: usize) -> Graph {
        let mut g = Graph::default();
        let (x, y) = (
            push(&mut g, Op::Input(0), vec![], &[n, 512]),
            push(&mut g, Op::Input(1), vec![], &[n, 512]),
        );
        g.num_inputs = 2;
        let m = push(
            &mut g,
            Op::Prim(Prim::Binary(BinaryOp::Mul)),
            vec![x, y],
            &[n, 512],
        );
        let e = push(
            &mut g,
            Op::Prim(Prim::Unary(UnaryOp::Exp)),
            vec![m],
            &[n, 512],
        );
        let sum = Prim::Reduce {
            op: ReduceOp::Sum,
            dims: vec![1],
        };
        let s = push(&mut g, Op::Prim(sum), vec![e], &[n]);
        let r = push(
            &mut g,
            Op::Prim(Prim::Reshape(vec![n, 1])),
            vec![s],
            &[n, 1],
        );
        let b = push(
            &mut g,
            Op::Prim(Prim::Expand(vec![n, 512])),
            vec![r],
            &[n, 512],
        );
        let d = push(
            &mut g,
            Op::Prim(Prim::Binary(BinaryOp::Div)),
            vec![e, b],
            &[n, 512],
        );
        g.outputs = vec![d, s];
        g
    }

    /// A translation unit: its source and the kernels it defines.
    type Unit = (String, Vec<String>);

    /// (static kernel sources, resolved kernels, units) of `graph(n)` at size `n`.
    fn at(n: usize) -> (Vec<String>, Vec<Resolved>, Vec<Unit>) {
        let g = graph(n);
        let planned = plan_graph(
            &Cuda {
                horizontal: false,
                ..Cuda::new(4)
            },
            &g,
        );
        let ctx = SizeContext {
            graph_id: u64::MAX - 2, // no symbolic graph of a real compile has this id
            values: vec![n as i64],
        };
        let resolved = resolve(&g, &planned, Some(&ctx));
        let sources = planned
            .iter()
            .filter_map(|p| match p {
                Planned::Kernel { kernel, .. } => Some(kernel.source.clone()),
                Planned::Extern { .. } => None,
            })
            .collect();
        let units = units("PRELUDE\n", &resolved, 4);
        (sources, resolved, units)
    }

    /// The first size gets static kernels; from the second on every kernel is one size-generic
    /// kernel taking the size as a parameter, and from then on the units NVRTC would build are
    /// the same text at every size (the runtime's caches answer them).
    #[test]
    fn a_symbolic_graph_at_new_sizes_compiles_to_the_same_size_generic_units() {
        let (_, first, first_units) = at(8);
        assert!(
            first
                .iter()
                .all(|k| k.sizes.is_empty() && k.name.starts_with("k_")),
            "the first size has no template yet"
        );
        assert!(first_units
            .iter()
            .all(|(src, _)| src.starts_with("PRELUDE\n")));
        let (static12, generic, units12) = at(12);
        assert!(generic.len() >= 2, "a pointwise and a reduction kernel");
        for k in &generic {
            assert_eq!(k.sizes, vec![12], "{}", k.source);
            assert!(k.name.starts_with("ks_"), "{}", k.name);
            // the size is a kernel parameter read by value, the helpers are device code
            assert!(k.source.contains(", const long long s0)"), "{}", k.source);
            assert!(k.source.contains("static inline __device__ int64_t kiln_"));
            assert!(!k.source.contains("args["), "{}", k.source);
        }
        // the vector loop's bound (numel / 4) is among the fitted literals
        assert!(
            generic.iter().any(|k| k.source.contains("kiln_v4")
                && k.source.contains("q < (")
                && k.source.contains("s0")),
            "no size-generic vector loop"
        );
        for n in [20usize, 28, 17] {
            let (statics, resolved, units) = at(n);
            assert_ne!(statics, static12, "size {n}: the static text differs");
            let names: Vec<&str> = resolved.iter().map(|k| k.name.as_str()).collect();
            let want: Vec<&str> = generic.iter().map(|k| k.name.as_str()).collect();
            assert_eq!(names, want, "size {n}");
            assert!(resolved.iter().all(|k| k.sizes == vec![n as i64]));
            assert_eq!(units, units12, "size {n}: other units than at 12");
        }
    }
}
