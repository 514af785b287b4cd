//! Row kernels, planned alike for both targets: a reduction over some dims of an operand (which
//! ones, the target's `RowReach`) and the kernels after it that walk the same rows (values of
//! that operand's shape, reductions over the same dims) reading it, as one kernel that takes a
//! row at a time through every member (`Target::rows`: `codegen/cuda_rows.rs` a warp per row,
//! `codegen/c_rows.rs` a row per loop iteration). Layer norm's mean, variance and normalization;
//! softmax's max, sum and division; on the CPU, batch norm's per channel.

use kiln_compile::graph::{Graph, NodeId, Op};
use kiln_core::prim::Prim;
use kiln_core::DType;

use crate::backend::{Planned, Target};
use crate::codegen::builder::{register_key, Builder};
use crate::codegen::c::{reduce_accumulator, Accumulator};
use crate::ir::index::Ix;
use crate::ir::lower::{linear, Kind};
use crate::runtime::plan::Alloc;
use crate::schedule::Schedule;

/// Longest row a warp's row kernel walks (layer norm over BERT-large's 1024 features, softmax
/// over 4096 positions: on a GPU 32 to 128 elements a lane).
pub(crate) const MAX_COLS: usize = 4096;

/// Which reductions open a row kernel on a target.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum RowReach {
    /// Rows of the trailing dims, 2..=`MAX_COLS` elements: a warp or a block per row
    /// (`codegen/cuda_rows.rs`).
    Trailing,
    /// Also rows of any reduced dims that include the innermost one (the walk over a row stays
    /// contiguous in its innermost loop), up to `MAX_LOOP_COLS` elements, where there are rows
    /// enough to share among threads (`codegen/c_rows.rs`): batch norm's statistics and
    /// normalization over N, H and W of each channel of an NCHW tensor, each row walked three
    /// times while it is in cache where three kernels walked the tensor three times.
    Any,
}

/// Longest row of a loop's row kernel (`RowReach::Any`): 4 MB of floats, in a core's share of
/// the last-level cache, where the row's later walks find it.
pub(crate) const MAX_LOOP_COLS: usize = 1 << 20;

/// Fewest rows of a row kernel over other than short trailing rows: every thread of a 16-core
/// host gets one, and a float sum with one output (whose order is chunked: `SUM_CHUNKED_FROM`)
/// never opens one.
pub(crate) const MIN_LOOP_ROWS: usize = 16;

/// The shape and reduced dims (ascending) of a row kernel's rows.
pub(crate) type RowDomain = (Vec<usize>, Vec<usize>);

/// The domain a row kernel walks, when `root` is a reduction that can open one on a target
/// that reaches `reach`.
pub(crate) fn row_domain(g: &Graph, root: NodeId, reach: RowReach) -> Option<RowDomain> {
    let node = &g.nodes[root];
    let Op::Prim(Prim::Reduce { dims, .. }) = &node.op else {
        return None;
    };
    let shape = g.nodes[node.args[0]].shape.clone();
    let mut reduced = dims.clone();
    reduced.sort_unstable();
    reduced.dedup();
    let (rank, d) = (shape.len(), reduced.len());
    let cols: usize = reduced.iter().map(|&v| shape[v]).product();
    let rows: usize = shape.iter().product::<usize>() / cols.max(1);
    let trailing = d > 0 && reduced == ((rank - d)..rank).collect::<Vec<_>>();
    let warp_rows = trailing && (2..=MAX_COLS).contains(&cols);
    let loop_rows = reach == RowReach::Any
        && reduced.last() == Some(&(rank - 1))
        && rows >= MIN_LOOP_ROWS
        && (2..=MAX_LOOP_COLS).contains(&cols);
    (warp_rows || loop_rows).then_some((shape, reduced))
}

/// Whether `root` can be a later member of a row kernel over `domain`: a reduction over the
/// same dims of an operand of that shape, or a generated value of that shape.
pub(crate) fn joins_rows(
    g: &Graph,
    sched: &Schedule,
    root: NodeId,
    domain: &RowDomain,
    reach: RowReach,
) -> bool {
    match sched.kinds[root] {
        Kind::Reduction => row_domain(g, root, reach).as_ref() == Some(domain),
        Kind::Pointwise | Kind::Movement => g.nodes[root].shape == domain.0,
        _ => false,
    }
}

/// Most kernels one row kernel runs.
const MAX_ROW_MEMBERS: usize = 6;
/// Most kernels a row kernel's run moves ahead of itself to go on past them (a loss's index
/// arithmetic between log_softmax and its pick).
const MAX_HOISTED: usize = 4;

/// Runs of consecutive kernels that walk the same rows, as one row kernel where the target
/// makes them (`Target::rows`): a reduction over the trailing dims of an operand opens a run,
/// which takes the following single-value kernels of that operand's shape (values, or
/// reductions over the same dims) while some of them read an earlier member. Layer norm's
/// mean, variance and normalization, softmax's max, sum and division: one pass over memory
/// where three kernels made three.
pub(crate) fn group_rows<T: Target>(
    t: &T,
    graph: &Graph,
    sched: &Schedule,
    planned: Vec<Planned<T::Kernel>>,
) -> Vec<Planned<T::Kernel>> {
    // A kernel writing one fresh value: that value and the kernel. Only these join a row run.
    fn single<K>(p: &Planned<K>) -> Option<(&(NodeId, Alloc), &K)> {
        match p {
            Planned::Kernel { kernel, outs } if outs.len() == 1 => match outs[0].1 {
                Alloc::InPlace(_) => None,
                _ => Some((&outs[0], kernel)),
            },
            _ => None,
        }
    }
    let mut out: Vec<Planned<T::Kernel>> = Vec::with_capacity(planned.len());
    let mut rest = planned.into_iter().peekable();
    while let Some(p) = rest.next() {
        let opener = single(&p)
            .map(|(out, _)| out.0)
            .filter(|&r| sched.kinds[r] == Kind::Reduction)
            .and_then(|r| row_domain(graph, r, t.row_reach()).map(|d| (r, d)));
        let Some((first, domain)) = opener else {
            out.push(p);
            continue;
        };
        let mut run = vec![p];
        let mut roots: Vec<NodeId> = vec![first];
        // kernels between members that read none of the run: they run before it, so the run
        // goes on past them (`hoisted`); those after the last member stay after it (`pending`)
        let (mut hoisted, mut pending) = (Vec::new(), Vec::new());
        while run.len() < MAX_ROW_MEMBERS {
            let Some(next) = rest.peek() else { break };
            let Some((&(root, _), kernel)) = single(next) else {
                break;
            };
            let reads_run = t.inputs(kernel).iter().any(|i| roots.contains(i));
            let joins = || joins_rows(graph, sched, root, &domain, t.row_reach());
            // on the C target a reduction over the same rows joins though it reads no member
            // (a norm's squared deviations beside its mean): its walk is the mean's
            // (`codegen/c_rows.rs`); a GPU's warp rows keep such a reduction apart
            let sibling = !reads_run
                && t.row_reach() == RowReach::Any
                && sched.kinds[root] == Kind::Reduction
                && joins();
            if !reads_run && !sibling && pending.len() < MAX_HOISTED {
                pending.extend(rest.next());
                continue;
            }
            // a sibling joins (checked above); a reader joins where its rows are the run's
            if !(sibling || (reads_run && joins())) {
                break;
            }
            roots.push(root);
            hoisted.append(&mut pending);
            run.extend(rest.next());
        }
        let fused = (run.len() > 1)
            .then(|| t.rows(graph, sched, &roots))
            .flatten();
        out.append(&mut hoisted);
        match fused {
            Some(kernel) => {
                let outs = run.iter().filter_map(single).map(|(&out, _)| out);
                let outs = outs.collect();
                out.push(Planned::Kernel { kernel, outs });
            }
            None => out.extend(run),
        }
        out.append(&mut pending);
    }
    out
}

/// The loops of a row kernel: its shape's kept dims (one row per index) and reduced dims (the
/// row's elements), as (loop variable, extent).
pub(crate) struct RowLoops {
    pub(crate) shape: Vec<usize>,
    pub(crate) kept: Vec<(usize, usize)>,
    pub(crate) reduced: Vec<(usize, usize)>,
}

impl RowLoops {
    /// The loops of `roots` when they make a row kernel on a target reaching `reach` (the
    /// first opening the domain, every later one joining it).
    pub(crate) fn of(
        g: &Graph,
        sched: &Schedule,
        roots: &[NodeId],
        reach: RowReach,
    ) -> Option<RowLoops> {
        let domain = row_domain(g, *roots.first()?, reach)?;
        if !roots[1..]
            .iter()
            .all(|&r| joins_rows(g, sched, r, &domain, reach))
        {
            return None;
        }
        let (shape, reduced) = domain;
        let dims = |keep: bool| {
            (0..shape.len())
                .filter(|v| reduced.contains(v) != keep)
                .map(|v| (v, shape[v]))
                .collect::<Vec<_>>()
        };
        Some(RowLoops {
            kept: dims(true),
            reduced: dims(false),
            shape,
        })
    }

    pub(crate) fn rows(&self) -> usize {
        self.kept.iter().map(|k| k.1).product()
    }

    pub(crate) fn cols(&self) -> usize {
        self.reduced.iter().map(|k| k.1).product()
    }
}

/// One member's pass over a row, for a target to wrap in its loops: the loop body's lines
/// (`body`), what they compute, and the output offset (`off`) it is stored at — one value per
/// row for a reduction, every element for a value.
#[derive(Clone)]
pub(crate) struct Pass {
    /// The member's index: it writes `out<k>`, a reduction holds its result in `r<k>`.
    pub(crate) k: usize,
    pub(crate) body: String,
    pub(crate) computes: Computes,
    pub(crate) off: String,
    /// The member's dtype.
    pub(crate) dtype: DType,
}

/// What a member computes at each element of the row: a value to store there, or a reduction's
/// accumulation.
#[derive(Clone)]
pub(crate) enum Computes {
    Value(String),
    Reduction(Accumulator),
}

/// Builds each member's pass in order with `b` (a builder over `loops.shape`), handing each to
/// `emit`; a reduction's later readers read it from `r<k>` at the row. With `cache` (a C array
/// expression over the walk's iteration, e.g. `row_x[it]`), when the first member is a
/// reduction, the later members read its operand from that array, which the emitter fills
/// during the first pass: the row is loaded and its fused producers computed once, not once per
/// member. `None` when a member would read another from memory (at another row or element:
/// another warp's or thread's work, not written yet).
pub(crate) fn passes(
    b: &mut Builder<'_>,
    g: &Graph,
    sched: &Schedule,
    roots: &[NodeId],
    loops: &RowLoops,
    cache: Option<&str>,
    mut emit: impl FnMut(&Pass),
) -> Option<()> {
    let rank = loops.shape.len();
    let idx: Vec<Ix> = (0..rank).map(Ix::var).collect();
    let row: Vec<Ix> = (0..rank)
        .map(|v| match loops.kept.iter().any(|k| k.0 == v) {
            true => Ix::var(v),
            false => Ix::constant(0),
        })
        .collect();
    for (k, &root) in roots.iter().enumerate() {
        let node = &g.nodes[root];
        let pass = match &node.op {
            Op::Prim(Prim::Reduce { .. }) if sched.kinds[root] == Kind::Reduction => {
                let acc = reduce_accumulator(b, g, root);
                Pass {
                    k,
                    body: b.new_body(),
                    computes: Computes::Reduction(acc),
                    off: linear(&row, &node.shape).to_c("i"),
                    dtype: node.dtype,
                }
            }
            _ => {
                let value = b.value(root, &idx, true);
                Pass {
                    k,
                    body: b.new_body(),
                    computes: Computes::Value(value),
                    off: linear(&idx, &loops.shape).to_c("i"),
                    dtype: node.dtype,
                }
            }
        };
        emit(&pass);
        // a later member reading this value computes it again (its operands are in registers
        // or loaded anyway) rather than loading what this kernel's other threads may not
        // have written yet: log_softmax's `x - max`, kept for the backward, read by the sum
        if matches!(pass.computes, Computes::Value(_)) && sched.kinds[root] == Kind::Pointwise {
            b.recompute.push(root);
        }
        if matches!(pass.computes, Computes::Reduction(_)) {
            b.registers
                .insert(register_key(root, &row, &node.shape), format!("r{k}"));
            if let (0, Some(cache)) = (k, cache) {
                let src = node.args[0];
                let key = register_key(src, &idx, &g.nodes[src].shape);
                b.registers.insert(key, cache.to_string());
            }
        }
    }
    (!roots.iter().any(|r| b.params.contains(r))).then_some(())
}

/// The outputs of a row kernel: member `k` writes `out<k>`.
pub(crate) fn outputs(roots: &[NodeId]) -> Vec<(NodeId, String)> {
    roots
        .iter()
        .enumerate()
        .map(|(k, &r)| (r, format!("out{k}")))
        .collect()
}
