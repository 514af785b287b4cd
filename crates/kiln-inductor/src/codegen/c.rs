//! C code generation: one function per kernel, `void k_<hash>(void **args)`, taking its input buffers
//! then its output buffer. Loops are nested one per dimension so the innermost one walks contiguous
//! memory (what the C compiler vectorizes); the outer loops run in parallel under OpenMP when the
//! kernel is large enough to pay for the threads. The function name is a hash of its text, so
//! identical kernels — the same block repeated 64 times — are one kernel.

use std::fmt::Write;
use std::sync::Arc;

use kiln_compile::graph::{Graph, NodeId, Op};
use kiln_core::prim::{Prim, ReduceOp, SUM_CHUNKED_FROM};
use kiln_core::DType;

use super::builder::{ty, Builder};
use super::c_horizontal::{member_fn, Member, Threads};
use super::c_sums::{chunked_sum, lane_sums};
use super::c_trig;
use crate::ir::index::Ix;
use crate::ir::lower::{linear, reduce_c, Kind};
use crate::schedule::Schedule;

/// Elements below which a kernel runs on one thread.
pub(crate) const PARALLEL_THRESHOLD: usize = 32 * 1024;

/// Whether a kernel over `rows` kept rows (a reduction's outputs, a row kernel's rows) of
/// `elements` in all shares its rows among threads: enough work, and rows enough to share.
pub(crate) fn parallel_rows(elements: usize, rows: usize) -> bool {
    elements >= PARALLEL_THRESHOLD && rows >= 16
}

/// One generated kernel.
#[derive(Clone, Debug)]
pub struct Kernel {
    pub name: String,
    /// The full C definition.
    pub source: String,
    /// The buffers it reads, in argument order (the output comes after them).
    pub inputs: Vec<NodeId>,
    /// Its loop nest in parts, for a kernel that can run beside others in one parallel region
    /// (`codegen/c_horizontal.rs`); `None` for one that cannot (a chunked sum, a horizontal
    /// kernel, a size-generic one).
    pub(crate) member: Option<Arc<Member>>,
}

/// One loop per `(variable, extent)`, the outer ones shared among OpenMP threads as `threads`
/// says (all but the innermost collapsed into one iteration space).
pub(crate) fn loops(out: &mut String, vars: &[(usize, usize)], threads: Threads) {
    blocked_loops(out, vars, threads, 1)
}

/// `loops` with the innermost one stepping `block` elements at a time (a block of them per
/// iteration: `codegen/c_trig.rs`).
pub(crate) fn blocked_loops(
    out: &mut String,
    vars: &[(usize, usize)],
    threads: Threads,
    block: usize,
) {
    if threads != Threads::One && !vars.is_empty() {
        let collapse = if vars.len() >= 2 { vars.len() - 1 } else { 1 };
        let _ = match threads {
            Threads::Shared => writeln!(
                out,
                "  #pragma omp for collapse({collapse}) schedule(static) nowait"
            ),
            _ => writeln!(
                out,
                "  #pragma omp parallel for collapse({collapse}) schedule(static)"
            ),
        };
    }
    for (k, &(v, n)) in vars.iter().enumerate() {
        let step = match block > 1 && k + 1 == vars.len() {
            true => format!(" += {block}"),
            false => "++".into(),
        };
        let _ = writeln!(out, "  for (int64_t i{v} = 0; i{v} < {n}; i{v}{step})");
    }
}

/// A kernel's loops before they become a function: the outer (dim, extent) loops that OpenMP
/// may share, the text inside them, the iterations of the whole nest, and whether the nest can
/// be work-shared inside another function's parallel region (`Member`).
pub(super) struct Nest {
    pub(super) outer: Vec<(usize, usize)>,
    /// Elements per iteration of the innermost of `outer`: 1, or a block (`codegen/c_trig.rs`).
    pub(super) block: usize,
    pub(super) inner: String,
    pub(super) elements: usize,
    pub(super) shareable: bool,
}

/// Whether the kernels being generated serve one size: no size context is current
/// (`symbolic::context`). Under one, `codegen/template.rs` fits a kernel across sizes from its
/// text, so text that a size decides beyond its literals (a loop left out for a short run, a
/// member function named by the hash of its text) would keep the kernels apart.
pub(super) fn one_size() -> bool {
    kiln_compile::symbolic::context::current().is_none()
}

fn finish(b: Builder<'_>, root: NodeId, nest: Nest, parallel: bool) -> Kernel {
    finish_outputs(b, &[(root, "out".into())], nest, parallel)
}

/// A C kernel's arguments, each (element type, name): the input buffers `params` (`b<p>`), then
/// the outputs.
pub(super) fn kernel_args(
    g: &Graph,
    params: &[NodeId],
    outputs: &[(NodeId, String)],
) -> Vec<(&'static str, String)> {
    let inputs = params
        .iter()
        .enumerate()
        .map(|(p, &id)| (ty(g.nodes[id].dtype), format!("b{p}")));
    let outs = outputs
        .iter()
        .map(|(root, name)| (ty(g.nodes[*root].dtype), name.clone()));
    inputs.chain(outs).collect()
}

/// The C function: the input buffers, then one pointer per output (`outputs`: node, name), the
/// values computed once, then the loops (their outer ones in a parallel region when `parallel`).
pub(super) fn finish_outputs(
    b: Builder<'_>,
    outputs: &[(NodeId, String)],
    nest: Nest,
    parallel: bool,
) -> Kernel {
    let member = Member {
        args: kernel_args(b.g, &b.params, outputs),
        inputs: b.params.len(),
        pre: b.pre,
        outer: nest.outer,
        block: nest.block,
        inner: nest.inner,
        parallel,
        elements: nest.elements,
    };
    let mut text = String::new();
    member.declare(&mut text, 0, member.inputs);
    let threads = match parallel {
        true => Threads::Region,
        false => Threads::One,
    };
    member.nest(&mut text, threads);
    let hash = xxhash_rust::xxh3::xxh3_64(format!("{parallel}{text}").as_bytes());
    let name = format!("k_{hash:016x}");
    // a nest on one thread is also how a horizontal kernel runs a small member: as the same
    // member function, which a unit holding both then compiles once (a 64-layer model's eight
    // bias-gradient sums are a kernel of their own and a member of three). Not under a size
    // context: a size-generic kernel rewrites literals, which a member function named by the
    // hash of its static text must not hold
    let shared_fn = !parallel && one_size();
    let source = match shared_fn {
        false => format!("void {name}(void **args) {{\n{text}}}\n"),
        true => {
            let mut fns = Vec::new();
            let f = member_fn(&mut fns, &member, Threads::One);
            let defs: String = fns.into_iter().map(|f| f.1).collect();
            format!("{defs}void {name}(void **args) {{ {f}(args); }}\n")
        }
    };
    Kernel {
        source,
        name,
        inputs: b.params,
        member: nest.shareable.then(|| Arc::new(member)),
    }
}

/// The kernel computing realized values of one shape in one loop — one value (a pointwise chain,
/// view, pad, cat or constant), or a group: an optimizer's new moments and parameter in one pass
/// over memory, the later ones reading the earlier ones' values from registers — each into its
/// own output pointer or, where `roots` names a graph input, into that input's storage: the
/// kernel then takes no argument for the input and reads its old values through the output,
/// each element just before overwriting it (all loads of an iteration come before its stores).
/// The flag is false when that is unsound: a value reads an in-place input at another element
/// than the one written (a transpose, a shift, a broadcast).
pub fn pointwise_kernels(
    g: &Graph,
    sched: &Schedule,
    roots: &[(NodeId, Option<NodeId>)],
) -> (Kernel, bool) {
    build_pointwise(g, sched, roots)
}

/// The body of a pointwise kernel over the shape of `roots[0]`, target-neutral: the builder (its
/// parameters and expression lines), the stores of one iteration, the outputs (node, name), and
/// whether reading the in-place inputs through the outputs is sound.
pub(crate) struct PointwiseBody<'a> {
    pub(crate) b: Builder<'a>,
    pub(crate) stores: String,
    pub(crate) outputs: Vec<(NodeId, String)>,
    pub(crate) ok: bool,
    /// The flat output offset an iteration writes, over the loop variables.
    pub(crate) written: Ix,
}

/// A residue class of a pointwise kernel's elements: along each dim of `dims` the output index
/// is `modulus · i<d> + residue`, loop variable `i<d>` running over `0..extent / modulus`
/// (`codegen/cuda_residues.rs` generates one body per class).
pub(crate) struct ResidueClass<'r> {
    pub(crate) dims: &'r [usize],
    pub(crate) modulus: i64,
    pub(crate) residues: &'r [i64],
    /// The kernel's buffer parameters, in order, which every class's body shares (a class may
    /// read fewer of them).
    pub(crate) params: &'r [NodeId],
}

/// The body of one element of a pointwise kernel, each loop variable an output index.
///
/// With `lanes`, the body is one lane `k` of a vector of four consecutive elements: loads at the
/// written offset read `<buffer>_v.v[k]` and the stores write `<output>_s.v[k]` (the CUDA target
/// loads and stores those vectors around the lanes).
pub(crate) fn pointwise_body<'a>(
    g: &'a Graph,
    sched: &'a Schedule,
    roots: &[(NodeId, Option<NodeId>)],
    lanes: bool,
) -> PointwiseBody<'a> {
    pointwise_body_in(g, sched, roots, lanes, None, None)
}

/// `pointwise_body` over one residue class of the elements (all of them without one). In a
/// class, a load at the written offset is read like any other (`Builder::lane_var`), as the
/// offset is no longer the flat vector index. `shared`: another class's body, whose per-lane
/// values this one reuses (`Builder::share_lanes_of`).
pub(crate) fn pointwise_body_in<'a>(
    g: &'a Graph,
    sched: &'a Schedule,
    roots: &[(NodeId, Option<NodeId>)],
    lanes: bool,
    class: Option<&ResidueClass<'_>>,
    shared: Option<&Builder<'_>>,
) -> PointwiseBody<'a> {
    let shape = &g.nodes[roots[0].0].shape;
    let mut ext: Vec<i64> = shape.iter().map(|&s| s as i64).collect();
    let mut idx: Vec<Ix> = (0..shape.len()).map(Ix::var).collect();
    if let Some(c) = class {
        for (&d, &r) in c.dims.iter().zip(c.residues) {
            ext[d] /= c.modulus;
            idx[d] = Ix::var(d).mul(c.modulus).add_const(r);
        }
    }
    let mut b = Builder::new(g, sched, ext);
    if let Some(c) = class {
        b.params = c.params.to_vec();
    }
    if let Some(seed) = shared {
        b.share_lanes_of(seed);
    }
    let written = linear(&idx, shape);
    // one output keeps the name `out`, so its text (and cached kernel) is what it always was
    let names: Vec<String> = match roots.len() {
        1 => vec!["out".into()],
        n => (0..n).map(|j| format!("out{j}")).collect(),
    };
    b.inplace = roots
        .iter()
        .zip(&names)
        .filter_map(|((_, input), name)| input.map(|i| (i, written.clone(), name.clone())))
        .collect();
    let off = written.to_c("i");
    if lanes {
        b.lanes_at = class.is_none().then(|| written.clone());
        // four lanes from a multiple of four share every index variable but the innermost
        let last = shape.len().checked_sub(1);
        b.lane_var = last.filter(|&v| shape[v] % 4 == 0);
    }
    let mut stores = String::new();
    for ((root, _), name) in roots.iter().zip(&names) {
        let v = b.value(*root, &idx, true);
        // a later value of the group reads this one from its register
        b.memo.insert((*root, idx.clone()), v.clone());
        match lanes {
            true => writeln!(stores, "    {name}_s.v[k] = {v};"),
            false => writeln!(stores, "    {name}[{off}] = {v};"),
        }
        .ok();
    }
    let ok = b.inplace_ok;
    let outputs: Vec<(NodeId, String)> = roots.iter().map(|r| r.0).zip(names).collect();
    PointwiseBody {
        b,
        stores,
        outputs,
        ok,
        written,
    }
}

fn build_pointwise(
    g: &Graph,
    sched: &Schedule,
    roots: &[(NodeId, Option<NodeId>)],
) -> (Kernel, bool) {
    let shape = &g.nodes[roots[0].0].shape;
    let whole = pointwise_body(g, sched, roots, false);
    if let Some(k) = super::c_residues::split(g, sched, roots, &whole) {
        return (k, whole.ok);
    }
    let PointwiseBody {
        b,
        stores,
        outputs,
        ok,
        ..
    } = whole;
    let numel: usize = shape.iter().product();
    let parallel = numel >= PARALLEL_THRESHOLD;
    let outer: Vec<(usize, usize)> = shape.iter().copied().enumerate().collect();
    let blocks = outer.last().and_then(|&last| {
        c_trig::blocks(last, &b.body, &stores, &b.trig_args, !b.inplace.is_empty())
    });
    let (inner, block) = match blocks {
        Some(text) => (text, c_trig::BLOCK),
        None => (format!("  {{\n{}{stores}  }}\n", b.body), 1),
    };
    let nest = Nest {
        outer,
        block,
        inner,
        elements: numel,
        shareable: true,
    };
    (finish_outputs(b, &outputs, nest, parallel), ok)
}

/// What a reduction kernel is made of, whatever loops walk it: the builder holding the operand's
/// expression at every input index (loop variable `i<d>` per input dim) and the accumulator
/// (`Accumulator`), the output offset (in the kept dims'
/// variables), and the kept and reduced (dim, extent) lists.
pub(crate) struct ReductionParts<'a> {
    pub(crate) b: Builder<'a>,
    pub(crate) acc: Accumulator,
    pub(crate) out_offset: String,
    pub(crate) kept: Vec<(usize, usize)>,
    pub(crate) reduced: Vec<(usize, usize)>,
}

pub(crate) fn reduction_parts<'a>(
    g: &'a Graph,
    sched: &'a Schedule,
    root: NodeId,
) -> ReductionParts<'a> {
    let node = &g.nodes[root];
    debug_assert_eq!(sched.kinds[root], Kind::Reduction);
    if let Op::Prim(Prim::Matmul) = node.op {
        return matmul_parts(g, sched, root);
    }
    let Op::Prim(Prim::Reduce { dims, .. }) = &node.op else {
        unreachable!("a reduction kernel for a non-reduction (the scheduler classifies it)")
    };
    let in_shape = &g.nodes[node.args[0]].shape;
    let mut b = Builder::new(g, sched, in_shape.iter().map(|&s| s as i64).collect());
    let acc = reduce_accumulator(&mut b, g, root);
    let (kept, reduced, out_offset) = reduce_loops(in_shape, dims, &node.shape);
    ReductionParts {
        b,
        acc,
        out_offset,
        kept,
        reduced,
    }
}

/// Loops as (dim, extent) pairs, outermost first.
pub(crate) type Loops = Vec<(usize, usize)>;

/// The loops of a reduction over `dims` of an operand of `in_shape` into an output of
/// `out_shape`: the kept (dim, extent) pairs, the reduced ones, and the output offset over the
/// kept loop variables.
pub(crate) fn reduce_loops(
    in_shape: &[usize],
    dims: &[usize],
    out_shape: &[usize],
) -> (Loops, Loops, String) {
    let out_idx: Vec<Ix> = (0..in_shape.len())
        .map(|d| match dims.contains(&d) {
            true => Ix::constant(0),
            false => Ix::var(d),
        })
        .collect();
    let kept = (0..in_shape.len())
        .filter(|d| !dims.contains(d))
        .map(|d| (d, in_shape[d]))
        .collect();
    let reduced = dims.iter().map(|&d| (d, in_shape[d])).collect();
    (kept, reduced, linear(&out_idx, out_shape).to_c("i"))
}

/// A `Reduce`'s accumulator, built with `b` (whose loop variables `i<d>` walk the operand):
/// the operand's expression at every input index, the accumulator's C type, initial value and
/// step. A kernel computing sibling reductions (`sibling_reductions.rs`) builds each sibling's
/// from the same builder, so what they share, their loads first, is computed once.
pub(crate) fn reduce_accumulator(b: &mut Builder<'_>, g: &Graph, root: NodeId) -> Accumulator {
    let node = &g.nodes[root];
    let Op::Prim(Prim::Reduce { op, dims }) = &node.op else {
        unreachable!(
            "a Reduce's accumulator for a {:?} (the scheduler classifies it)",
            node.op
        )
    };
    let src = node.args[0];
    let dtype = g.nodes[src].dtype;
    let idx: Vec<Ix> = (0..g.nodes[src].shape.len()).map(Ix::var).collect();
    let value = b.value(src, &idx, false);
    let (acc_t, init, step) = reduce_c(*op, dtype);
    Accumulator {
        value,
        acc_t,
        init,
        step,
        lanes: matches!(op, ReduceOp::Sum | ReduceOp::SumSqDev)
            && matches!(dtype, DType::F32 | DType::F64)
            && !dims.is_empty(),
        sqdev: *op == ReduceOp::SumSqDev,
    }
}

/// What a reduction accumulates: the operand's expression `value`, the accumulator's C type,
/// initial value and combine step `acc = step(acc, v)`.
#[derive(Clone)]
pub(crate) struct Accumulator {
    pub(crate) value: String,
    pub(crate) acc_t: &'static str,
    pub(crate) init: String,
    pub(crate) step: fn(&str, &str) -> String,
    /// A float sum: on the CPU it follows `prim::SUM_LANES`'s summation order (the eager
    /// kernel's), not one sequential accumulator.
    pub(crate) lanes: bool,
    /// Squared deviations (`ReduceOp::SumSqDev`): each lane holds Welford's moments
    /// (`prim::SqDevState`), not a sum; always in lanes.
    pub(crate) sqdev: bool,
}

/// A small matmul `[B,M,K] x [B,K,N]` as a sum over the loop space `[B,M,N,K]` (variables
/// `i0..i3`, k reduced) of `a[i0,i1,i3] * b[i0,i3,i2]`: each operand read through its index
/// expression, so its views and pointwise producers are evaluated in the load, never
/// materialized. The product is taken in double (exact for f32 operands) and summed in a double
/// accumulator, as `Reduce(sum)` is in generated and eager code alike; the result is rounded once.
fn matmul_parts<'a>(g: &'a Graph, sched: &'a Schedule, root: NodeId) -> ReductionParts<'a> {
    let node = &g.nodes[root];
    let (a, bm) = (node.args[0], node.args[1]);
    let (bs, m, k) = (
        g.nodes[a].shape[0],
        g.nodes[a].shape[1],
        g.nodes[a].shape[2],
    );
    let n = g.nodes[bm].shape[2];
    let space = [bs, m, n, k];
    let mut b = Builder::new(g, sched, space.iter().map(|&s| s as i64).collect());
    let x = b.value(a, &[Ix::var(0), Ix::var(1), Ix::var(3)], false);
    let y = b.value(bm, &[Ix::var(0), Ix::var(3), Ix::var(2)], false);
    let value = b.temp_of(DType::F64, format!("(double){x} * (double){y}"), &[&x, &y]);
    let (acc_t, init, step) = reduce_c(ReduceOp::Sum, node.dtype);
    let out_idx = [Ix::var(0), Ix::var(1), Ix::var(2)];
    ReductionParts {
        b,
        acc: Accumulator {
            value,
            acc_t,
            init,
            step,
            // the extern gemm's order: one sequential accumulator per output
            lanes: false,
            sqdev: false,
        },
        out_offset: linear(&out_idx, &node.shape).to_c("i"),
        kept: vec![(0, bs), (1, m), (2, n)],
        reduced: vec![(3, k)],
    }
}

/// The kernel of a reduction: outer loops over the kept dims, inner loops over the reduced ones,
/// the operand's pointwise producers evaluated inside the inner loop.
pub fn reduction_kernel(g: &Graph, sched: &Schedule, root: NodeId) -> Kernel {
    let ReductionParts {
        b,
        acc,
        out_offset: off,
        kept,
        reduced,
    } = reduction_parts(g, sched, root);
    let (v, acc_t, init, step) = (&acc.value, acc.acc_t, &acc.init, acc.step);
    let node = &g.nodes[root];
    let numel: usize = kept.iter().chain(&reduced).map(|d| d.1).product();
    let parallel = parallel_rows(numel, kept.iter().map(|k| k.1).product());
    // the text inside the loops over the kept dims
    let mut text = String::new();
    let mut shareable = true;
    let rows: usize = kept.iter().map(|k| k.1).product();
    let red: usize = reduced.iter().map(|k| k.1).product();
    match (acc.lanes, reduced.split_last()) {
        (true, Some((&(d, n), outer))) if rows == 1 && red >= SUM_CHUNKED_FROM => {
            // its chunks run in a parallel region of its own (`chunked_sum`)
            shareable = false;
            chunked_sum(&mut text, (&b.body, &acc), (d, n), outer);
            let _ = writeln!(text, "  out[{off}] = ({})total;\n  }}", ty(node.dtype));
        }
        (true, Some((&(d, n), outer))) => {
            let out_t = ty(node.dtype);
            lane_sums(
                &mut text,
                (outer, (d, n)),
                &b.body,
                &[("acc", &acc)],
                |_, sum| format!("  out[{off}] = ({out_t}){sum};\n"),
            );
        }
        _ => {
            let _ = writeln!(
                text,
                "  {{
  {acc_t} acc = {init};"
            );
            loops(&mut text, &reduced, Threads::One);
            let _ = writeln!(
                text,
                "  {{
{}    acc = {};
  }}",
                b.body,
                step("acc", v)
            );
            let _ = writeln!(
                text,
                "  out[{off}] = ({})acc;
  }}",
                ty(node.dtype)
            );
        }
    }
    let nest = Nest {
        outer: kept,
        block: 1,
        inner: text,
        elements: numel,
        shareable,
    };
    finish(b, root, nest, parallel)
}

/// `const long long i<d> = ...;` for each (dim, extent) of `vars`, splitting the flat index
/// `flat` (row-major over `vars`) through the scratch variable `rem` (C and CUDA C alike).
pub(crate) fn split_index(
    out: &mut String,
    flat: &str,
    vars: &[(usize, usize)],
    indent: &str,
    rem: &str,
) {
    split_index_as(out, flat, vars, indent, rem, |v| format!("i{v}"))
}

/// `split_index`, loop variable `v` named `name(v)`.
pub(crate) fn split_index_as(
    out: &mut String,
    flat: &str,
    vars: &[(usize, usize)],
    indent: &str,
    rem: &str,
    name: impl Fn(usize) -> String,
) {
    let _ = writeln!(out, "{indent}long long {rem} = {flat};");
    for (k, &(v, n)) in vars.iter().enumerate().rev() {
        let i = name(v);
        if k == 0 {
            let _ = writeln!(out, "{indent}const long long {i} = {rem};");
        } else {
            let _ = writeln!(
                out,
                "{indent}const long long {i} = {rem} % {n}; {rem} /= {n};"
            );
        }
    }
}
