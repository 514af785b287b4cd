//! The scheduler: decides which values become buffers (are *realized*) and which are inlined into
//! the kernels that read them — that choice is the fusion. A pointwise or view value read once is
//! computed inside its reader's loop (vertical fusion, and elementwise producers fused into
//! reductions); graph outputs, reductions and the operands of extern ops are realized. A value
//! read by several kernels is realized unless recomputing it in each costs less than its buffer:
//! a short chain (softmax's exp), a chain whose loads are one or two large buffers its readers
//! would load anyway ("lean": batch norm's backward, judged by `leaves_of` and `inlined_ops`), or
//! a pad read only through a pooling's windows. A large value broadcast to many times its size
//! is realized past a short chain, read or not by several kernels: inlined, it would be computed
//! again for every copy (a reduction over an outer product). Every realized value becomes one
//! step: a generated kernel or an extern call.
//!
//! A small matmul the target generates (`Target::inline_matmul`) is a reduction like any other:
//! its operands' pointwise producers are computed inside its loads (an operand element is read
//! once per output it contributes to, so a producer chain longer than the target's
//! `MatmulFusion::operand_ops` is realized instead), and its pointwise readers inline it as a
//! buffer load.

use kiln_compile::graph::{Graph, NodeId, Op};
use kiln_core::prim::Prim;
use kiln_core::shape::Layout;

use crate::ir::lower::{kind_with, Kind, MatmulDims};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// A generated loop nest computing `node` into a buffer (which one: `runtime/plan.rs`).
    Kernel { node: NodeId },
    /// `node` through the core's kernels (matmul, conv, gather, random, views of buffers, ...).
    Extern { node: NodeId },
}

impl Step {
    /// The value the step computes.
    pub fn node(&self) -> NodeId {
        match self {
            Step::Kernel { node } | Step::Extern { node } => *node,
        }
    }
}

/// Longest pointwise chain inlined into several readers instead of realized.
const MAX_RECOMPUTE_OPS: usize = 4;
/// Most readers a shared pointwise chain is inlined into.
const MAX_RECOMPUTE_USERS: usize = 3;
/// Most ops at its size a chain over one or two large buffers (`leaves_of`) is recomputed with
/// by its readers: each reader then loads no more than it would load from the chain's buffer,
/// so recomputing saves the buffer's write and read whatever the chain's length, up to what
/// the arithmetic costs (batch norm's backward: the ReLU mask, scale and shift recomputed from
/// the convolution's output in each of its three passes, where it wrote four full tensors).
const MAX_LEAN_RECOMPUTE_OPS: usize = 16;
/// Most ops on small (per-channel) values a lean chain's readers recompute per element with it
/// (a variance's `1/sqrt(v + eps)`: 4).
const MAX_LEAN_SMALL_OPS: usize = 8;
/// Most readers a chain over one large buffer is recomputed in (each loads that buffer where it
/// would load the chain's).
const MAX_LEAN_USERS_ONE: usize = 8;
/// Most readers a chain over two large buffers is recomputed in: 2 loads per reader against a
/// write, 2 loads and 1 load per reader realized, even at 3.
const MAX_LEAN_USERS_TWO: usize = 3;
/// A buffer counts as large for a value reading it when it has at least this fraction
/// (1/`LARGE_FRACTION`) of the value's elements: a per-channel statistic broadcast over an
/// activation stays in cache and costs its readers nothing.
const LARGE_FRACTION: usize = 8;
/// Large buffers a value's computation loads, up to `MAX_LEAVES` (then `None`: many).
type Leaves = Option<Vec<NodeId>>;
const MAX_LEAVES: usize = 4;
/// Longest chain a padded value read only through windows is recomputed with, counting ops at
/// its size (training's batch norm and ReLU before a max-pool: subtract, scale, shift, compare,
/// select), besides at most `MAX_LEAN_SMALL_OPS` per-channel ones (the variance's
/// `1/sqrt(v + eps)`).
const MAX_WINDOW_RECOMPUTE_OPS: usize = 8;
/// A value of at least `BROADCAST_REALIZE_FROM` elements broadcast to `BROADCAST_REALIZE_FACTOR`
/// times its size or more is realized when its chain is longer than `MAX_RECOMPUTE_OPS`: inlined,
/// it would be recomputed at every copy. Per-channel and per-row statistics (batch norm's, layer
/// norm's: at most a few thousand values) stay inlined into the loops they are broadcast over.
const BROADCAST_REALIZE_FROM: usize = 1 << 14;
const BROADCAST_REALIZE_FACTOR: usize = 8;
/// A scalar (one element) broadcast to `SCALAR_REALIZE_FACTOR` elements or more is realized
/// when its chain holds `SCALAR_REALIZE_OPS` ops or more. Inlined, it is an invariant of its
/// reader's loop: computed once per call on the CPU, but once per thread on a GPU, before the
/// thread's loads — Adam's bias corrections (two `pow`s in f64 of the step count) in each of the
/// 2.6 million threads of a 10 × 1024² update cost 94 against 76 µs with the two scalars read
/// from memory (H200, one member kernel in nvcc). A per-channel value is no invariant (each
/// element computes its own channel's), so it is left to the rules above.
const SCALAR_REALIZE_FACTOR: usize = 1 << 16;
const SCALAR_REALIZE_OPS: usize = 3;
/// How a target generates small matmuls (`Target::inline_matmul`, `Target::matmul_operand_ops`).
pub struct MatmulFusion<'a> {
    /// Which matmuls are generated (the others stay extern calls).
    pub inline: &'a dyn Fn(MatmulDims) -> bool,
    /// Longest pointwise chain a generated matmul computes inside its operand loads (each
    /// element of an operand is recomputed once per output it meets); longer chains are realized.
    pub operand_ops: usize,
}

impl MatmulFusion<'_> {
    /// Every matmul extern.
    pub const NONE: MatmulFusion<'static> = MatmulFusion {
        inline: &|_| false,
        operand_ops: 0,
    };
}

pub struct Schedule {
    pub kinds: Vec<Kind>,
    pub realized: Vec<bool>,
    pub steps: Vec<Step>,
}

fn is_cat(g: &Graph, id: NodeId) -> bool {
    matches!(g.nodes[id].op, Op::Prim(Prim::Cat { .. }))
}

fn is_pad_or_cat(g: &Graph, id: NodeId) -> bool {
    matches!(
        g.nodes[id].op,
        Op::Prim(Prim::Pad { .. }) | Op::Prim(Prim::Cat { .. })
    )
}

/// A movement the core makes without a copy: everything but pad, cat and `Contiguous`. A
/// realized `Contiguous` is a copy: a generated kernel, which its readers may fuse and which
/// runs beside other independent kernels (the permuted weights of a channels-last network's
/// convolutions: a launch per weight as eager copies, one for all of them generated).
fn is_view(g: &Graph, kinds: &[Kind], id: NodeId) -> bool {
    kinds[id] == Kind::Movement
        && !is_pad_or_cat(g, id)
        && !matches!(g.nodes[id].op, Op::Prim(Prim::Contiguous))
}

/// Realizes the value a chain of views starting at `id` looks at (the views stay index maps over
/// its buffer), and returns it.
fn realize_below_views(g: &Graph, kinds: &[Kind], realized: &mut [bool], mut id: NodeId) -> NodeId {
    while is_view(g, kinds, id) && !realized[id] && g.nodes[id].args.len() == 1 {
        id = g.nodes[id].args[0];
    }
    realized[id] = true;
    id
}

/// The large buffers node `id` loads when a reader inlines it: its realized operands holding at
/// least 1/`LARGE_FRACTION` of its elements, and what its inlined operands load.
fn leaves_of(g: &Graph, realized: &[bool], leaves: &[Leaves], id: NodeId) -> Leaves {
    let numel = |i: NodeId| g.nodes[i].numel();
    let mut out: Vec<NodeId> = Vec::new();
    for &a in &g.nodes[id].args {
        if realized[a] {
            if numel(a) * LARGE_FRACTION >= numel(id) && !out.contains(&a) {
                out.push(a);
            }
            continue;
        }
        for &l in leaves[a].as_ref()? {
            if numel(l) * LARGE_FRACTION >= numel(id) && !out.contains(&l) {
                out.push(l);
            }
        }
    }
    (out.len() <= MAX_LEAVES).then_some(out)
}

/// The pointwise ops a reader of `id` computes per element when it inlines `id` (each once, as
/// the generated code computes a shared subexpression once), and of those the ones on values of
/// `id`'s size (not per-channel values). Counting stops past what a lean chain may hold.
fn inlined_ops(g: &Graph, kinds: &[Kind], realized: &[bool], id: NodeId) -> (usize, usize) {
    let numel = |i: NodeId| g.nodes[i].numel();
    let mut seen = vec![id];
    let mut stack = vec![id];
    let (mut all, mut large) = (0, 0);
    while let Some(v) = stack.pop() {
        if kinds[v] == Kind::Pointwise {
            all += 1;
            large += usize::from(numel(v) * LARGE_FRACTION >= numel(id));
            if all > MAX_LEAN_RECOMPUTE_OPS + MAX_LEAN_SMALL_OPS {
                break;
            }
        }
        for &a in &g.nodes[v].args {
            if !realized[a] && !seen.contains(&a) {
                seen.push(a);
                stack.push(a);
            }
        }
    }
    (all, large)
}

/// What decides whether a value read by several kernels is recomputed by each: its readers
/// (`users`), the ops a reader recomputes counted as a tree (`cost`), the large buffers it
/// loads (`leaves_of`; `None`: many), and whether it is a pad read only through windows.
struct SharedReads {
    users: usize,
    cost: usize,
    large_buffers: Option<usize>,
    windows: bool,
}

/// Whether the shared value `id` is recomputed by each of its readers instead of realized:
/// - a pad read only through windows (a pooling's), up to `MAX_WINDOW_RECOMPUTE_OPS` ops at its
///   size: its readers are one kernel's loads of overlapping windows, which the cache serves,
///   where a realized pad costs a write and a read of the padded tensor (ResNet-18's stem: 53
///   MB);
/// - a short chain read by a few kernels (softmax's exp is computed by the sum and by the
///   division: no buffer written and read back);
/// - a lean chain: over one or two large buffers, whose readers load no more than they would
///   load from its buffer. A chain of per-channel ops alone (no op at its size) is better
///   realized, a small buffer, than recomputed at every element of its readers.
///
/// Either of the last two with at most `MAX_LEAN_SMALL_OPS` per-channel ops.
fn recomputed_by_readers(
    g: &Graph,
    kinds: &[Kind],
    realized: &[bool],
    id: NodeId,
    r: SharedReads,
) -> bool {
    let ops_within = |large_ops: std::ops::RangeInclusive<usize>| {
        let (all, large) = inlined_ops(g, kinds, realized, id);
        large_ops.contains(&large) && all - large <= MAX_LEAN_SMALL_OPS
    };
    if r.windows {
        return ops_within(0..=MAX_WINDOW_RECOMPUTE_OPS);
    }
    if r.cost <= MAX_RECOMPUTE_OPS && r.users <= MAX_RECOMPUTE_USERS {
        return true;
    }
    let most_users = match r.large_buffers {
        Some(0 | 1) => MAX_LEAN_USERS_ONE,
        Some(2) => MAX_LEAN_USERS_TWO,
        _ => return false,
    };
    r.users <= most_users && ops_within(1..=MAX_LEAN_RECOMPUTE_OPS)
}

/// Whether view `id` is still a view of its operand's buffer, the operand being a view of a
/// buffer (`cheap`, its layout over that buffer in `layouts`) or realized (contiguous): a
/// reshape of a permuted buffer is not (the core would copy it, an eager strided copy: BERT's
/// heads merged after attention, 12.7 us a layer, where a generated copy takes 7). Records its
/// own layout in `layouts`. True where the operand's layout is unknown (a constant's broadcast).
fn composes_as_view(g: &Graph, cheap: &[bool], layouts: &mut [Option<Layout>], id: NodeId) -> bool {
    let node = &g.nodes[id];
    let (Op::Prim(p), &[a]) = (&node.op, node.args.as_slice()) else {
        return true;
    };
    let below = match cheap[a] {
        true => layouts[a].clone(),
        false => Some(Layout::contiguous(&g.nodes[a].shape)),
    };
    let Some(below) = below else {
        return true;
    };
    match p.view_layout(&below) {
        Some(l) => {
            layouts[id] = Some(l);
            true
        }
        None => false,
    }
}

/// The schedule of `g`, with small matmuls generated as `mm` says.
pub fn schedule(g: &Graph, mm: &MatmulFusion<'_>) -> Schedule {
    let n = g.nodes.len();
    let kinds: Vec<Kind> = g
        .nodes
        .iter()
        .map(|node| kind_with(g, node, mm.inline))
        .collect();
    let mut users = vec![0usize; n];
    // read only through slices (a pooling's windows over a padded value)
    let mut only_windows = vec![true; n];
    let mut must_realize = vec![false; n];
    for &o in &g.outputs {
        must_realize[o] = true;
    }
    for (id, node) in g.nodes.iter().enumerate() {
        for &a in &node.args {
            users[a] += 1;
            only_windows[a] &= matches!(node.op, Op::Prim(Prim::Slice { .. }));
            // extern ops take tensors; cat reads each operand under a bounds check at every
            // element (a pad evaluates its operand once per element, at the index held inside
            // the operand: fused like any other read)
            if kinds[id] == Kind::Extern || is_cat(g, id) {
                must_realize[a] = true;
            }
        }
    }
    let mut realized = vec![false; n];
    // each view of a buffer: its layout over that buffer (`composes_as_view`)
    let mut layouts: Vec<Option<Layout>> = vec![None; n];
    // costly scalars realized for their broadcast: computed as early as what they read allows
    let mut early = vec![false; n];
    // a view of a buffer, or a constant: free to inline however many readers it has
    let mut cheap = vec![false; n];
    // pointwise ops a reader recomputes when it inlines the value
    let mut cost = vec![0usize; n];
    // large buffers a reader loads when it inlines the value
    let mut leaves: Vec<Leaves> = vec![Some(Vec::new()); n];
    for (id, node) in g.nodes.iter().enumerate() {
        realized[id] = match kinds[id] {
            Kind::Input | Kind::Extern | Kind::Reduction => true,
            Kind::Constant => must_realize[id],
            Kind::Pointwise | Kind::Movement => {
                // a view whose operand, realized, it still views (not a reshape of a permuted
                // buffer, which the core would copy)
                let is_view =
                    is_view(g, &kinds, id) && composes_as_view(g, &cheap, &mut layouts, id);
                if is_view && must_realize[id] {
                    // realize what the view looks at and keep the view a view: the kernel then
                    // has the producer's shape, the same in every block that reshapes it
                    for &a in &node.args {
                        realized[a] = true;
                    }
                }
                let view_of_buffer = is_view && node.args.iter().all(|&a| realized[a] || cheap[a]);
                cheap[id] = view_of_buffer;
                let own = usize::from(kinds[id] == Kind::Pointwise);
                cost[id] = own
                    + node
                        .args
                        .iter()
                        .filter(|&&a| !realized[a])
                        .map(|&a| cost[a])
                        .sum::<usize>();
                leaves[id] = leaves_of(g, &realized, &leaves, id);
                let shared = users[id] >= 2 && !view_of_buffer;
                let recompute = shared && {
                    let reads = SharedReads {
                        users: users[id],
                        cost: cost[id],
                        large_buffers: leaves[id].as_ref().map(Vec::len),
                        // a padded value read only through windows (max-pool's nine)
                        windows: only_windows[id] && matches!(node.op, Op::Prim(Prim::Pad { .. })),
                    };
                    recomputed_by_readers(g, &kinds, &realized, id, reads)
                };
                if shared && !recompute && matches!(node.op, Op::Prim(Prim::Expand(_))) {
                    // a broadcast read by several kernels: what it broadcasts is realized (a
                    // per-channel value, not a tensor of its copies) and it stays a view
                    for &a in &node.args {
                        realize_below_views(g, &kinds, &mut realized, a);
                    }
                    cheap[id] = true;
                    cost[id] = 0;
                    false
                } else {
                    must_realize[id] || (shared && !recompute)
                }
            }
        };
        if kinds[id] == Kind::Constant {
            cheap[id] = true;
        }
        if let Op::Prim(Prim::Expand(_)) = node.op {
            // a large value broadcast to many times its size (a reduction over an outer
            // product: numpy_fn's 640 x 640 per row) is recomputed at every copy when inlined:
            // past a short chain, compute it once
            let a = node.args[0];
            let numel = |i: NodeId| g.nodes[i].numel();
            let factor = numel(id) / numel(a).max(1);
            let large_chain = numel(a) >= BROADCAST_REALIZE_FROM
                && factor >= BROADCAST_REALIZE_FACTOR
                && cost[a] > MAX_RECOMPUTE_OPS;
            // a costly scalar broadcast over a large tensor: compute it once
            let costly_scalars =
                numel(a) == 1 && factor >= SCALAR_REALIZE_FACTOR && cost[a] >= SCALAR_REALIZE_OPS;
            if !realized[a] && (large_chain || costly_scalars) {
                let r = realize_below_views(g, &kinds, &mut realized, a);
                cost[id] = 0;
                early[r] |= costly_scalars;
            }
        }
        if matches!(node.op, Op::Prim(Prim::Matmul)) && kinds[id] == Kind::Reduction {
            for &a in &node.args {
                if !realized[a] && cost[a] > mm.operand_ops {
                    realize_below_views(g, &kinds, &mut realized, a);
                }
            }
        }
    }
    // a realized view of a buffer is made by the core as a view (no copy), and so are the views
    // it is a view of: realize that chain too
    for id in (0..n).rev() {
        if realized[id] && cheap[id] && kinds[id] == Kind::Movement {
            for &a in &g.nodes[id].args {
                realized[a] = true;
            }
        }
    }
    let steps = (0..n)
        .filter(|&id| realized[id] && kinds[id] != Kind::Input)
        .map(|id| {
            let view_of_buffer = kinds[id] == Kind::Movement && cheap[id];
            if kinds[id] == Kind::Extern || view_of_buffer {
                // a view of a buffer stays a view (no copy): the core makes it
                Step::Extern { node: id }
            } else {
                Step::Kernel { node: id }
            }
        })
        .collect();
    let steps = hoist_early(g, &realized, &early, steps);
    Schedule {
        kinds,
        realized,
        steps,
    }
}

/// `steps` with each `early` step moved up to just after the last step it reads (through the
/// values its kernel inlines): traced after the large updates it feeds (Adam's bias corrections
/// come after its moments), such a scalar would otherwise sit between them and split a run of
/// same-shaped updates that `backend::group` makes one loop. Moving a step earlier keeps every
/// read after the step that produces it, and in-place writes are planned on the new order.
fn hoist_early(g: &Graph, realized: &[bool], early: &[bool], steps: Vec<Step>) -> Vec<Step> {
    if !early.iter().any(|&e| e) {
        return steps;
    }
    // the realized values a step's kernel reads: its args, through the ones it inlines
    let reads = |id: NodeId| {
        let (mut out, mut todo, mut seen) = (Vec::new(), g.nodes[id].args.clone(), Vec::new());
        while let Some(a) = todo.pop() {
            if seen.contains(&a) {
                continue;
            }
            seen.push(a);
            match realized[a] {
                true => out.push(a),
                false => todo.extend(g.nodes[a].args.iter().copied()),
            }
        }
        out
    };
    let mut order: Vec<Step> = Vec::with_capacity(steps.len());
    for s in steps {
        let id = s.node();
        if !early[id] {
            order.push(s);
            continue;
        }
        let deps = reads(id);
        let at = order
            .iter()
            .rposition(|st| deps.contains(&st.node()))
            .map_or(0, |p| p + 1);
        // after the early steps already placed there (their relative order kept)
        let at = at + order[at..].iter().take_while(|st| early[st.node()]).count();
        order.insert(at, s);
    }
    order
}

#[cfg(test)]
mod tests {

    use kiln_core::prim::{BinaryOp, UnaryOp};

    use super::*;
    use crate::backend::{schedule_for, C};
    use crate::codegen::cuda::Cuda;
    use crate::test_graphs::cpu::{input, push};
    use crate::test_graphs::{expand, sum, unary};

    /// `tanh` applied `ops` times to x [1,m,k], @ w [1,n,k] transposed, + bias: (graph, the
    /// chain's last node, the matmul).
    fn linear(m: usize, k: usize, n: usize, ops: usize) -> (Graph, NodeId, NodeId) {
        let mut g = Graph::default();
        let mut x = input(&mut g, &[1, m, k]);
        for _ in 0..ops {
            x = unary(&mut g, UnaryOp::Tanh, x);
        }
        let w = input(&mut g, &[1, n, k]);
        let wt = push(
            &mut g,
            Op::Prim(Prim::Permute(vec![0, 2, 1])),
            vec![w],
            &[1, k, n],
        );
        let mm = push(&mut g, Op::Prim(Prim::Matmul), vec![x, wt], &[1, m, n]);
        let b = input(&mut g, &[1, m, n]);
        let y = push(
            &mut g,
            Op::Prim(Prim::Binary(BinaryOp::Add)),
            vec![mm, b],
            &[1, m, n],
        );
        g.outputs = vec![y];
        (g, x, mm)
    }

    /// `ops` tanh applied to a new input of `shape`, then reshaped to `to` and expanded to
    /// `wide`: (the chain's last node, the expand).
    fn broadcast_chain(
        g: &mut Graph,
        shape: &[usize],
        ops: usize,
        to: &[usize],
        wide: &[usize],
    ) -> (NodeId, NodeId) {
        let mut x = input(g, shape);
        for _ in 0..ops {
            x = unary(g, UnaryOp::Tanh, x);
        }
        let r = push(g, Op::Prim(Prim::Reshape(to.to_vec())), vec![x], to);
        let e = expand(g, r, wide);
        (x, e)
    }

    /// Adam's shape: an update of a large value, then a costly scalar (three ops on a step
    /// count) broadcast into a second update. The scalar is realized, and its step moves before
    /// the first update, so the two updates stay consecutive (one grouped loop); a cheaper
    /// scalar stays inlined.
    #[test]
    fn costly_scalars_broadcast_over_large_updates_are_computed_first() {
        let wide = [512, 512];
        for (ops, realized) in [(SCALAR_REALIZE_OPS, true), (SCALAR_REALIZE_OPS - 1, false)] {
            let mut g = Graph::default();
            let a = input(&mut g, &wide);
            let two = unary(&mut g, UnaryOp::Exp, a);
            let (chain, e) = broadcast_chain(&mut g, &[], ops, &[1, 1], &wide);
            let y = push(
                &mut g,
                Op::Prim(Prim::Binary(BinaryOp::Mul)),
                vec![two, e],
                &wide,
            );
            g.outputs = vec![two, y];
            let s = schedule(&g, &MatmulFusion::NONE);
            assert_eq!(s.realized[chain], realized, "{ops} ops");
            let order: Vec<NodeId> = s.steps.iter().map(Step::node).collect();
            let want = match realized {
                true => vec![chain, two, y],
                false => vec![two, y],
            };
            assert_eq!(order, want, "{ops} ops");
        }
    }

    /// numpy_fn's shape: a sum over an outer product of two [rows, 40] values per row. A chain
    /// longer than `MAX_RECOMPUTE_OPS` broadcast 40-fold is realized (inlined, the reduction
    /// recomputed it 40 times per element); a short chain, a small (per-channel) one and a
    /// chain broadcast 4-fold stay inlined.
    #[test]
    fn long_chains_broadcast_many_times_are_computed_once() {
        let rows = 512;
        let wide = [rows, 40, 40];
        for (ops, realized) in [(MAX_RECOMPUTE_OPS + 1, true), (MAX_RECOMPUTE_OPS, false)] {
            let mut g = Graph::default();
            let (xn, xe) = broadcast_chain(&mut g, &[rows, 40], ops, &[rows, 40, 1], &wide);
            let (yn, ye) = broadcast_chain(&mut g, &[rows, 40], ops, &[rows, 1, 40], &wide);
            let prod = push(
                &mut g,
                Op::Prim(Prim::Binary(BinaryOp::Mul)),
                vec![xe, ye],
                &wide,
            );
            g.outputs = vec![sum(&mut g, prod, &[1, 2])];
            let s = schedule(&g, &MatmulFusion::NONE);
            assert_eq!(
                (s.realized[xn], s.realized[yn]),
                (realized, realized),
                "{ops} ops"
            );
        }
        // per-channel (64 values over [256, 64]) and 4-fold ([4096, 4] over [4096, 4, 4])
        for (shape, to, wide) in [
            (vec![64], vec![1, 64], vec![256, 64]),
            (vec![1 << 12, 4], vec![1 << 12, 4, 1], vec![1 << 12, 4, 4]),
        ] {
            let mut g = Graph::default();
            let (chain, e) = broadcast_chain(&mut g, &shape, MAX_RECOMPUTE_OPS + 2, &to, &wide);
            let other = input(&mut g, &wide);
            let y = push(
                &mut g,
                Op::Prim(Prim::Binary(BinaryOp::Mul)),
                vec![e, other],
                &wide,
            );
            g.outputs = vec![y];
            let s = schedule(&g, &MatmulFusion::NONE);
            assert!(!s.realized[chain], "{shape:?} over {wide:?}");
        }
    }

    #[test]
    fn small_matmuls_are_reductions_and_large_ones_extern() {
        let cuda = Cuda::new(2);
        // 10x10x10: generated on both targets, the transposed weight read through its index
        // map (not realized), the bias add a separate pointwise kernel reading the matmul
        let (g, chain, mm) = linear(10, 10, 10, 1);
        for s in [
            schedule_for(
                &C {
                    inline_matmul: true,
                    horizontal: true,
                },
                &g,
            ),
            schedule_for(&cuda, &g),
        ] {
            assert_eq!(s.kinds[mm], Kind::Reduction);
            assert!(s.steps.contains(&Step::Kernel { node: mm }));
            assert!(
                !s.realized[chain],
                "a one-op producer is computed in the loads"
            );
            assert!(s.steps.iter().all(|st| matches!(st, Step::Kernel { .. })));
        }
        // without inlining (the default of a target): extern, operands realized
        let s = schedule(&g, &MatmulFusion::NONE);
        assert_eq!(s.kinds[mm], Kind::Extern);
        assert!(s.steps.contains(&Step::Extern { node: mm }));
        assert!(s.realized[chain]);
        // K = 128: a gemm on both targets
        let (g, chain, mm) = linear(8, 128, 8, 1);
        for s in [
            schedule_for(
                &C {
                    inline_matmul: true,
                    horizontal: true,
                },
                &g,
            ),
            schedule_for(&cuda, &g),
        ] {
            assert_eq!(s.kinds[mm], Kind::Extern);
            assert!(s.realized[chain]);
        }
        // 2^16 < 48·48·48 multiply-adds: extern
        let (g, _, mm) = linear(48, 48, 48, 1);
        assert_eq!(schedule_for(&cuda, &g).kinds[mm], Kind::Extern);
    }

    #[test]
    fn long_operand_chains_are_realized_by_the_target_s_limit() {
        // 4 ops: over the C target's limit (2), within the CUDA target's (8)
        let (g, chain, mm) = linear(10, 10, 10, 4);
        let c = schedule_for(
            &C {
                inline_matmul: true,
                horizontal: true,
            },
            &g,
        );
        assert_eq!(c.kinds[mm], Kind::Reduction);
        assert!(c.realized[chain]);
        let cuda = schedule_for(&Cuda::new(2), &g);
        assert!(!cuda.realized[chain]);
        assert_eq!(
            cuda.steps.len(),
            2,
            "the matmul and the bias add: {:?}",
            cuda.steps
        );
    }
    /// `x - c`, `* c`, `+ c`, `max(.., x)`, `* y` over [4096, 64] (`c` a broadcast [1, 64],
    /// `y` another large input or `x`), read by `readers` sums over dim 0 and kept as an output
    /// plus one: (graph, the chain's last value).
    fn chain_read_by_sums(second_large: bool, readers: usize) -> (Graph, NodeId) {
        let mut g = Graph::default();
        let shape = [4096, 64];
        let x = input(&mut g, &shape);
        let y = match second_large {
            true => input(&mut g, &shape),
            false => x,
        };
        let c = input(&mut g, &[1, 64]);
        let e = push(
            &mut g,
            Op::Prim(Prim::Expand(shape.to_vec())),
            vec![c],
            &shape,
        );
        let mut v = x;
        for (op, other) in [
            (BinaryOp::Sub, e),
            (BinaryOp::Mul, e),
            (BinaryOp::Add, e),
            (BinaryOp::Max, x),
            (BinaryOp::Mul, y),
        ] {
            v = push(&mut g, Op::Prim(Prim::Binary(op)), vec![v, other], &shape);
        }
        for _ in 0..readers {
            let s = sum(&mut g, v, &[0]);
            g.outputs.push(s);
        }
        (g, v)
    }

    /// A chain of five ops over one large buffer (and a per-channel one) is recomputed by each
    /// of its four readers: each loads that buffer where it would load the chain's, so a
    /// buffer would cost a write and a read for nothing (batch norm's backward recomputes its
    /// ReLU mask this way in all three of its passes). Over two large buffers it is recomputed
    /// by up to three readers; by more, it is realized (two loads per reader would pass one).
    #[test]
    fn a_chain_over_few_large_buffers_is_recomputed_by_its_readers() {
        let realized = |second_large, readers| {
            let (g, v) = chain_read_by_sums(second_large, readers);
            schedule(&g, &MatmulFusion::NONE).realized[v]
        };
        assert!(!realized(false, 4));
        assert!(!realized(false, 8));
        assert!(realized(false, 9));
        assert!(!realized(true, 3));
        assert!(realized(true, 4));
    }

    /// Heads merged after attention: a reshape of a permuted buffer is no view of it (the core
    /// would copy it), so it is a generated kernel; the permute under it stays a view, and so
    /// does a reshape of a buffer that keeps its order.
    #[test]
    fn a_reshape_of_a_permuted_buffer_is_a_kernel() {
        let mut g = Graph::default();
        let x = input(&mut g, &[2, 3, 4]);
        let p = push(
            &mut g,
            Op::Prim(Prim::Permute(vec![1, 0, 2])),
            vec![x],
            &[3, 2, 4],
        );
        let merged = push(
            &mut g,
            Op::Prim(Prim::Reshape(vec![3, 8])),
            vec![p],
            &[3, 8],
        );
        let flat = push(
            &mut g,
            Op::Prim(Prim::Reshape(vec![6, 4])),
            vec![x],
            &[6, 4],
        );
        g.outputs = vec![merged, flat];
        let s = schedule(&g, &MatmulFusion::NONE);
        assert!(
            s.steps.contains(&Step::Kernel { node: merged }),
            "{:?}",
            s.steps
        );
        assert!(
            s.steps.contains(&Step::Extern { node: flat }),
            "{:?}",
            s.steps
        );
        assert!(
            !s.steps.contains(&Step::Kernel { node: p }),
            "{:?}",
            s.steps
        );
    }

    /// A per-channel chain too long to recompute, broadcast and read by two reductions: the
    /// [1, 8] chain is realized and the [1024, 8] broadcast stays a view (not 8192 copies of 8
    /// values written and read back).
    #[test]
    fn a_shared_broadcast_realizes_what_it_broadcasts() {
        let mut g = Graph::default();
        let x = input(&mut g, &[1024, 8]);
        let mut c = input(&mut g, &[1, 8]);
        for _ in 0..6 {
            c = unary(&mut g, UnaryOp::Tanh, c);
        }
        let e = push(
            &mut g,
            Op::Prim(Prim::Expand(vec![1024, 8])),
            vec![c],
            &[1024, 8],
        );
        let reduce = |g: &mut Graph, a: NodeId, op| {
            let m = push(g, Op::Prim(Prim::Binary(op)), vec![x, a], &[1024, 8]);
            sum(g, m, &[0])
        };
        let s1 = reduce(&mut g, e, BinaryOp::Mul);
        let s2 = reduce(&mut g, e, BinaryOp::Add);
        g.outputs = vec![s1, s2];
        let c_target = C {
            inline_matmul: false,
            horizontal: true,
        };
        let s = schedule_for(&c_target, &g);
        assert!(!s.realized[e], "the broadcast is a view");
        assert!(s.realized[c], "the per-channel chain is a buffer");
    }
    /// Whether `tanh` applied `large_ops` times to x [1, 4, 8, 8], plus a per-channel value
    /// ([1, 4, 1, 1] through `small_ops` tanh, broadcast), padded and read through four strided
    /// windows (as a max-pool reads it), is realized.
    fn pad_read_through_windows_realized(large_ops: usize, small_ops: usize) -> bool {
        let mut g = Graph::default();
        let x = input(&mut g, &[1, 4, 8, 8]);
        let mut c = input(&mut g, &[1, 4, 1, 1]);
        for _ in 0..small_ops {
            c = unary(&mut g, UnaryOp::Tanh, c);
        }
        let wide = push(
            &mut g,
            Op::Prim(Prim::Expand(vec![1, 4, 8, 8])),
            vec![c],
            &[1, 4, 8, 8],
        );
        let mut s = push(
            &mut g,
            Op::Prim(Prim::Binary(BinaryOp::Add)),
            vec![x, wide],
            &[1, 4, 8, 8],
        );
        for _ in 1..large_ops {
            s = unary(&mut g, UnaryOp::Tanh, s);
        }
        let p = push(
            &mut g,
            Op::Prim(Prim::Pad {
                pads: vec![(0, 0), (0, 0), (1, 1), (1, 1)],
                value: f64::NEG_INFINITY,
            }),
            vec![s],
            &[1, 4, 10, 10],
        );
        let mut acc: Option<NodeId> = None;
        // four windows: more readers than a shared chain is otherwise recomputed for
        for ki in 0..4 {
            let v = push(
                &mut g,
                Op::Prim(Prim::Slice {
                    dim: 2,
                    start: ki,
                    end: ki + 7,
                    step: 2,
                }),
                vec![p],
                &[1, 4, 4, 10],
            );
            acc = Some(match acc {
                None => v,
                Some(a) => push(
                    &mut g,
                    Op::Prim(Prim::Binary(BinaryOp::Max)),
                    vec![a, v],
                    &[1, 4, 4, 10],
                ),
            });
        }
        g.outputs = vec![acc.expect("windows")];
        let c_target = C {
            inline_matmul: false,
            horizontal: true,
        };
        schedule_for(&c_target, &g).realized[p]
    }

    /// A value padded and read through strided windows (as a max-pool reads it) is not
    /// realized, however many windows: each window's reader recomputes it, up to 8 ops at its
    /// size besides up to 8 per-channel ones (training's batch norm and ReLU before ResNet's
    /// max-pool: 5 and 5, which counted together once made it a buffer).
    #[test]
    fn a_pad_read_through_windows_is_recomputed() {
        assert!(!pad_read_through_windows_realized(1, 0));
        assert!(!pad_read_through_windows_realized(5, 5));
        assert!(!pad_read_through_windows_realized(8, 8));
        assert!(pad_read_through_windows_realized(9, 0));
        assert!(pad_read_through_windows_realized(5, 9));
    }
}
