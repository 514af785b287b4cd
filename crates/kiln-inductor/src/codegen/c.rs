//! C code generation: one function per kernel, `void k_<hash>(void **args)`, taking its input buffers
//! then its output buffer. Loops are nested one per dimension so the innermost one walks contiguous
//! memory (what the C compiler vectorizes); the outer loops run in parallel under OpenMP when the
//! kernel is large enough to pay for the threads. The function name is a hash of its text, so
//! identical kernels — the same block repeated 64 times — are one kernel.

use std::collections::{HashMap, HashSet};
use std::fmt::Write;
use std::sync::Arc;

use kiln_compile::graph::{Graph, NodeId, Op};
use kiln_core::prim::{Prim, ReduceOp, UnaryOp, SUM_CHUNKED_FROM};
use kiln_core::DType;

use super::c_horizontal::{member_fn, Member, Threads};
use super::c_sums::{chunked_sum, lane_sums};
use super::c_trig;
use crate::ir::index::Ix;
use crate::ir::lower::{
    binary_c, c_dtype, float_literal, linear, reduce_c, unary_c, view_index, Kind,
};
use crate::schedule::Schedule;
use kiln_compile::fast_hash::Fast;

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

/// Builds the expressions of one kernel body, in C that is also CUDA C: one `const` temporary per
/// value at an index, buffers read as `b<param>[offset]`, loop variables `i<dim>`. The loops
/// around the body are the target's (`loops` here, `codegen/cuda.rs` on the GPU).
pub(crate) struct Builder<'a> {
    g: &'a Graph,
    sched: &'a Schedule,
    ext: Vec<i64>,
    pub(crate) params: Vec<NodeId>,
    /// The values the same at every element (read from scalars, constants, and what is computed
    /// from them alone: an optimizer's bias corrections), computed once before the loops: a
    /// double-precision `pow` per element costs more than the element's bytes.
    pub(crate) pre: String,
    /// The lines of one element, inside the loops.
    pub(crate) body: String,
    /// The values (temporaries and literals) that `pre` holds or that need no loop.
    invariant: HashSet<String>,
    memo: HashMap<(NodeId, Vec<Ix>), String, Fast>,
    temps: usize,
    /// In an in-place kernel: each input whose storage an output is, the index written and that
    /// output's name. The input is read through the output, only sound at the index written.
    inplace: Vec<(NodeId, Ix, String)>,
    /// False once an in-place input is read anywhere but the index written.
    inplace_ok: bool,
    /// Lane mode (`codegen/cuda.rs`'s vector loop): the flat offset the kernel writes. A load at
    /// exactly that offset reads lane `k` of four consecutive elements loaded as one vector
    /// before the lanes run (`<buffer>_v.v[k]`).
    lanes_at: Option<Ix>,
    /// Lane mode where the innermost extent is a multiple of four: the innermost loop variable,
    /// the only one that differs between a vector's four lanes (lane `k`'s is `i<v>_l0 + k`, the
    /// others are lane 0's). A load that moves with it at unit stride from a multiple of four
    /// (`Ix::quad_in`) is then a vector too, read at lane 0's index (`<buffer>_w<n>.v[k]`): a
    /// window tap of a channels-last tensor, a broadcast row.
    pub(crate) lane_var: Option<usize>,
    /// The vectors read in lane mode, in first-read order.
    pub(crate) vector_reads: Vec<VectorRead>,
    /// Lane mode: the temporaries whose value depends on the lane variable alone (read from
    /// `VectorRead::fixed` vectors and invariants: a per-channel statistic of a channels-last
    /// tensor, its `1/sqrt(var + eps)`), their lines (`lane_pre`, in order) and types
    /// (`lane_temps`). A kernel whose threads keep their lane variable from one iteration to the
    /// next computes them once per thread (`codegen/cuda.rs`'s `hoisted_lanes`); another runs
    /// `lane_pre` at the start of each lane.
    per_lane: HashSet<String>,
    pub(crate) lane_pre: String,
    pub(crate) lane_temps: Vec<(String, DType)>,
    /// Values already in a register at one index (a row kernel's reductions at the row, and
    /// the row's operand a thread keeps: `rows::passes`); a read at another index loads
    /// or computes the value.
    pub(crate) registers: HashMap<(NodeId, Vec<Ix>), String, Fast>,
    /// Realized values computed again where read instead of loaded: a row kernel's earlier
    /// value members (`rows::passes`), which its later members would otherwise read from
    /// memory the kernel is still writing.
    pub(crate) recompute: Vec<NodeId>,
    /// The f32 operands of the sines and cosines computed in the loop body, for the blocks that
    /// check their range (`codegen/c_trig.rs`).
    trig_args: Vec<String>,
    /// Buffer reads in the loop body (each element's loads, the measure a split into residue
    /// classes must shrink: `codegen/cuda_residues.rs`).
    pub(crate) loads: usize,
    /// (loop variable, divisor) of each division or modulo the body's reads and tests depend
    /// on (`Ix::residue_vars`): where a split into residue classes may simplify them.
    pub(crate) residues: Vec<(usize, i64)>,
}

/// A four-element vector a lane-mode kernel loads before its lanes run.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct VectorRead {
    /// The buffer's C name (`b<param>`, or an in-place output's).
    pub(crate) buf: String,
    pub(crate) dtype: DType,
    /// The vector's C name.
    pub(crate) name: String,
    /// Which vector of the buffer, in four-element units, over lane 0's index variables.
    pub(crate) at: String,
    /// Whether `at` reads lane 0's lane variable alone (no other index variable).
    pub(crate) fixed: bool,
}

/// Where a temporary is computed: before the loops (the same at every element), per thread
/// for its lane (`Builder::per_lane`), or in the loop body.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Place {
    Pre,
    Lane,
    Body,
}

/// The C type of a value of `d` (what the builder declares its temporaries as).
pub(crate) fn ty(d: DType) -> &'static str {
    c_dtype(d).unwrap_or("double")
}

/// The key of a value held in a register (`Builder::registers`): the node and its index, with
/// every dim of extent 1 at 0 — whatever expression a reader indexes such a dim by (the row's
/// loop variable of a size-1 dim, or the 0 a broadcast leaves), it is the same element.
pub(crate) fn register_key(id: NodeId, idx: &[Ix], shape: &[usize]) -> (NodeId, Vec<Ix>) {
    let idx = idx
        .iter()
        .zip(shape)
        .map(|(i, &n)| if n == 1 { Ix::constant(0) } else { i.clone() })
        .collect();
    (id, idx)
}

impl<'a> Builder<'a> {
    /// A builder for a kernel whose loop variable `v` runs over `0..ext[v]`.
    pub(crate) fn new(g: &'a Graph, sched: &'a Schedule, ext: Vec<i64>) -> Self {
        Builder {
            g,
            sched,
            ext,
            params: Vec::new(),
            pre: String::new(),
            body: String::new(),
            invariant: HashSet::new(),
            memo: HashMap::default(),
            temps: 0,
            inplace: Vec::new(),
            inplace_ok: true,
            lanes_at: None,
            lane_var: None,
            vector_reads: Vec::new(),
            per_lane: HashSet::new(),
            lane_pre: String::new(),
            lane_temps: Vec::new(),
            registers: HashMap::default(),
            recompute: Vec::new(),
            trig_args: Vec::new(),
            loads: 0,
            residues: Vec::new(),
        }
    }

    /// Forgets the loop body's values (a row kernel's next loop starts a new body); values
    /// computed before the loops stay.
    pub(crate) fn new_body(&mut self) -> String {
        let invariant = &self.invariant;
        self.memo.retain(|_, v| invariant.contains(v));
        self.trig_args.clear();
        std::mem::take(&mut self.body)
    }

    /// Whether the body computes f32 sines or cosines (`codegen/c_trig.rs` blocks such loops).
    pub(crate) fn has_trig(&self) -> bool {
        !self.trig_args.is_empty()
    }

    fn temp(&mut self, d: DType, expr: String) -> String {
        self.temp_in(d, expr, Place::Body)
    }

    /// A temporary in the loop body, in `pre` or in `lane_pre` (`place`).
    fn temp_in(&mut self, d: DType, expr: String, place: Place) -> String {
        let name = format!("t{}", self.temps);
        self.temps += 1;
        let lines = match place {
            Place::Pre => {
                self.invariant.insert(name.clone());
                &mut self.pre
            }
            Place::Lane => {
                self.per_lane.insert(name.clone());
                self.lane_temps.push((name.clone(), d));
                &mut self.lane_pre
            }
            Place::Body => &mut self.body,
        };
        let _ = writeln!(lines, "    const {} {name} = {expr};", ty(d));
        name
    }

    /// A temporary whose expression is a pure function of `operands`, placed where they all are.
    fn temp_of(&mut self, d: DType, expr: String, operands: &[&String]) -> String {
        let place = self.place_of(operands);
        self.temp_in(d, expr, place)
    }

    fn invariant(&self, values: &[&String]) -> bool {
        values.iter().all(|v| self.invariant.contains(*v))
    }

    /// Where a pure function of `operands` can be computed: before the loops when they all are
    /// invariant, per lane when each is invariant or per-lane, else in the body.
    fn place_of(&self, operands: &[&String]) -> Place {
        if self.invariant(operands) {
            Place::Pre
        } else if operands
            .iter()
            .all(|v| self.invariant.contains(*v) || self.per_lane.contains(*v))
        {
            Place::Lane
        } else {
            Place::Body
        }
    }

    /// Class `seed`'s per-lane values, for another residue class of the same kernel: their
    /// reads and temporaries keep `seed`'s names (its `lane_pre` computes them, once for every
    /// class: `codegen/cuda_residues.rs`), and this class's own temporaries are numbered after
    /// `seed`'s. A per-lane value reads no index variable but the innermost, which no class
    /// splits, so it is the same value at the same index in every class.
    pub(crate) fn share_lanes_of(&mut self, seed: &Builder<'_>) {
        let per_lane = &seed.per_lane;
        self.memo.extend(
            seed.memo
                .iter()
                .filter(|(_, v)| per_lane.contains(*v))
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        self.per_lane = seed.per_lane.clone();
        self.temps = seed.temps;
        self.vector_reads = seed
            .vector_reads
            .iter()
            .filter(|r| r.fixed)
            .cloned()
            .collect();
    }

    fn param(&mut self, id: NodeId) -> usize {
        match self.params.iter().position(|&q| q == id) {
            Some(p) => p,
            None => {
                self.params.push(id);
                self.params.len() - 1
            }
        }
    }

    /// Reads buffer `id` at `idx` into a temporary. Loads are never placed under a condition:
    /// GCC 12 miscompiles vectorized masked loads in unrolled loops (every lane group used the
    /// first group's mask), so selects pick between values that were loaded unconditionally.
    fn load(&mut self, id: NodeId, idx: &[Ix]) -> String {
        let key = (id, idx.to_vec());
        if let Some(v) = self.memo.get(&key) {
            return v.clone();
        }
        let off = linear(idx, &self.g.nodes[id].shape);
        let buf = match self.inplace.iter().find(|(input, _, _)| *input == id) {
            Some((_, written, out)) => {
                // the old value, read before the iteration's stores (same element, same iteration)
                self.inplace_ok &= off == *written;
                out.clone()
            }
            None => format!("b{}", self.param(id)),
        };
        let node = &self.g.nodes[id];
        let dtype = node.dtype;
        // one element of a read-only buffer that is not empty: the same at every element
        let in_place = self.inplace.iter().any(|(input, _, _)| *input == id);
        let invariant = off.as_constant().is_some() && !in_place && !node.shape.contains(&0);
        let quad = match self.lane_var {
            // an in-place input is read only at the index written (`inplace_ok`)
            Some(v) if !in_place && !invariant => off.quad_in(v).map(|rest| (v, rest)),
            _ => None,
        };
        if !invariant {
            self.loads += 1;
            off.residue_vars(&mut self.residues);
        }
        let v = if self.lanes_at.as_ref() == Some(&off) {
            let name = self.vector_read(&buf, dtype, "q".into(), false);
            self.temp(dtype, format!("{name}.v[k]"))
        } else if let Some((v, rest)) = quad {
            let fixed = rest.as_constant().is_some();
            let at = match rest.as_constant() {
                Some(0) => format!("i{v}_l0 / 4"),
                _ => format!("({} + i{v}_l0) / 4", rest.to_c("i")),
            };
            let name = self.vector_read(&buf, dtype, at, fixed);
            let place = if fixed { Place::Lane } else { Place::Body };
            self.temp_in(dtype, format!("{name}.v[k]"), place)
        } else {
            let place = if invariant { Place::Pre } else { Place::Body };
            self.temp_in(dtype, format!("{buf}[{}]", off.to_c("i")), place)
        };
        self.memo.insert(key, v.clone());
        v
    }

    /// The name of the vector of `buf` the lanes read at `at`, recorded the first time: `<buf>_v`
    /// at the written offset (`q`), `<buf>_w<n>` elsewhere.
    fn vector_read(&mut self, buf: &str, dtype: DType, at: String, fixed: bool) -> String {
        if let Some(r) = self
            .vector_reads
            .iter()
            .find(|r| r.buf == buf && r.at == at)
        {
            return r.name.clone();
        }
        let name = match at.as_str() {
            "q" => format!("{buf}_v"),
            _ => format!("{buf}_w{}", self.vector_reads.len()),
        };
        self.vector_reads.push(VectorRead {
            buf: buf.to_string(),
            dtype,
            name: name.clone(),
            at,
            fixed,
        });
        name
    }

    /// `id`'s value at `idx` with each index held inside `id`'s shape: what pad and cat read,
    /// whose out-of-range positions the caller then replaces. The expression is evaluated at
    /// every element, so every read inside it must be in bounds. (An extent of 0 leaves nothing
    /// to hold the index in: only a kernel with no elements to compute reads such a value.)
    fn value_held(&mut self, id: NodeId, idx: &[Ix]) -> String {
        let held: Vec<Ix> = idx
            .iter()
            .zip(&self.g.nodes[id].shape)
            .map(|(j, &n)| j.held_in(0, n as i64 - 1, &self.ext))
            .collect();
        self.value(id, &held, false)
    }

    /// The C expression for node `id` at index `idx` (buffers are loaded unless `id` is the root).
    pub(crate) fn value(&mut self, id: NodeId, idx: &[Ix], root: bool) -> String {
        // a value a row kernel's thread holds: a reduction's result at the row, or the row's
        // operand it keeps (`rows::passes`)
        if !root && !self.registers.is_empty() {
            let shape = &self.g.nodes[id].shape;
            if let Some(r) = self.registers.get(&register_key(id, idx, shape)) {
                return r.clone();
            }
        }
        if self.sched.realized[id] && !root && !self.recompute.contains(&id) {
            return self.load(id, idx);
        }
        let key = (id, idx.to_vec());
        if let Some(v) = self.memo.get(&key) {
            return v.clone();
        }
        let g = self.g;
        let node = &g.nodes[id];
        let Op::Prim(p) = &node.op else {
            return self.load(id, idx);
        };
        let arg_dtype = |k: usize| g.nodes[node.args[k]].dtype;
        let v = match p {
            Prim::Unary(op) => {
                let a = self.value(node.args[0], idx, false);
                let e = unary_c(*op, &a, arg_dtype(0));
                let place = self.place_of(&[&a]);
                let trig = matches!(op, UnaryOp::Sin | UnaryOp::Cos);
                let checked = trig && arg_dtype(0) == DType::F32 && place != Place::Pre;
                if checked && !self.trig_args.contains(&a) {
                    self.trig_args.push(a.clone());
                }
                self.temp_in(node.dtype, e, place)
            }
            Prim::Binary(op) => {
                let a = self.value(node.args[0], idx, false);
                let b = self.value(node.args[1], idx, false);
                let e = binary_c(*op, &a, &b, arg_dtype(0));
                self.temp_of(node.dtype, e, &[&a, &b])
            }
            Prim::Where => {
                let c = self.value(node.args[0], idx, false);
                let a = self.value(node.args[1], idx, false);
                let b = self.value(node.args[2], idx, false);
                self.temp_of(node.dtype, format!("{c} ? {a} : {b}"), &[&c, &a, &b])
            }
            Prim::Cast(to) => {
                let a = self.value(node.args[0], idx, false);
                let e = if *to == DType::Bool {
                    format!("(uint8_t)({a} != 0)")
                } else {
                    format!("({})({a})", ty(*to))
                };
                self.temp_of(node.dtype, e, &[&a])
            }
            Prim::Full { value, dtype, .. } => {
                let literal = full_literal(*value, *dtype);
                self.invariant.insert(literal.clone());
                literal
            }
            Prim::Iota { dtype, .. } => format!("(({})({}))", ty(*dtype), idx[0].to_c("i")),
            Prim::Pad { pads, value } => {
                let src = node.args[0];
                let in_shape = &g.nodes[src].shape;
                if in_shape.contains(&0) {
                    // nothing to read: every element is the fill
                    let fill = float_literal(*value, node.dtype);
                    self.invariant.insert(fill.clone());
                    return fill;
                }
                let fill = float_literal(*value, node.dtype);
                let mut conds = Vec::new();
                let mut in_idx = Vec::with_capacity(idx.len());
                for (d, (i, &(lo, _))) in idx.iter().zip(pads).enumerate() {
                    let j = i.add_const(-(lo as i64));
                    let n = in_shape[d] as i64;
                    // whether a side needs a test: the index as read (an outer pad's clamp
                    // inside it); the test itself: the index unclamped (`Ix::unclamped`)
                    let (bl, bh) = j.bounds(&self.ext);
                    let free = j.unclamped(&self.ext);
                    for (crosses, below) in [(bl < 0, true), (bh >= n, false)] {
                        if !crosses {
                            continue;
                        }
                        match free.as_constant() {
                            Some(c) if (below && c >= 0) || (!below && c < n) => {}
                            // outside wherever the value is used: the fill
                            Some(_) => {
                                self.invariant.insert(fill.clone());
                                return fill;
                            }
                            None => {
                                free.residue_vars(&mut self.residues);
                                let e = free.to_c("i");
                                conds.push(match below {
                                    true => format!("{e} >= 0"),
                                    false => format!("{e} < {n}"),
                                });
                            }
                        }
                    }
                    in_idx.push(j);
                }
                // the operand's expression (fused, or a load of its buffer): the fill replaces it
                // outside
                let load = self.value_held(src, &in_idx);
                // an operand that is the fill itself (a pad of a pad wholly outside) needs no test
                if conds.is_empty() || load == fill {
                    load
                } else {
                    self.temp(
                        node.dtype,
                        format!("({}) ? {load} : {fill}", conds.join(" && ")),
                    )
                }
            }
            Prim::Cat { dim } => {
                let mut start = 0i64;
                let mut pieces = Vec::new();
                let any = node.args.iter().any(|&a| g.nodes[a].shape[*dim] > 0);
                for &a in &node.args {
                    let len = g.nodes[a].shape[*dim] as i64;
                    if len == 0 && any {
                        continue; // no element of the output is read from it
                    }
                    let mut j = idx.to_vec();
                    j[*dim] = idx[*dim].add_const(-start);
                    pieces.push((start + len, self.value_held(a, &j)));
                    start += len;
                }
                let i = idx[*dim].to_c("i");
                let mut e = pieces.last().map(|p| p.1.clone()).unwrap_or_default();
                for (end, load) in pieces.iter().rev().skip(1) {
                    e = format!("({i} < {end}) ? {load} : ({e})");
                }
                self.temp(node.dtype, e)
            }
            Prim::Reshape(_)
            | Prim::Permute(_)
            | Prim::Expand(_)
            | Prim::Slice { .. }
            | Prim::Contiguous => {
                let src = node.args[0];
                let j = view_index(p, &g.nodes[src].shape, idx, &node.shape, &self.ext);
                self.value(src, &j, false)
            }
            // extern and reductions are always realized: only reached as a root (reductions are
            // generated by `reduction_kernel`)
            _ => self.load(id, idx),
        };
        self.memo.insert(key, v.clone());
        v
    }
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
        lanes: *op == ReduceOp::Sum && matches!(dtype, DType::F32 | DType::F64) && !dims.is_empty(),
    }
}

/// What a reduction accumulates: the operand's expression `value`, the accumulator's C type,
/// initial value and combine step `acc = step(acc, v)`.
pub(crate) struct Accumulator {
    pub(crate) value: String,
    pub(crate) acc_t: &'static str,
    pub(crate) init: String,
    pub(crate) step: fn(&str, &str) -> String,
    /// A float sum: on the CPU it follows `prim::SUM_LANES`'s summation order (the eager
    /// kernel's), not one sequential accumulator.
    pub(crate) lanes: bool,
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
            chunked_sum(&mut text, (&b.body, v), acc_t, (d, n), outer, step);
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

/// A `Full` value in C. A whole number in a float type is written as an integer converted to
/// the type: the same value (exact below 2^53, rounded to nearest like the literal otherwise),
/// and in a symbolic graph such a value may be a size (a mean's count), which
/// `codegen/template.rs` can then fit like any other integer literal of the kernel.
fn full_literal(v: f64, dtype: DType) -> String {
    let whole = v.fract() == 0.0 && v.abs() < 9.0e15 && !(v == 0.0 && v.is_sign_negative());
    match dtype {
        DType::F32 | DType::F64 if whole => {
            let sign = if v < 0.0 { "-" } else { "" };
            format!("(({}){sign}{})", ty(dtype), v.abs() as i64)
        }
        _ => float_literal(v, dtype),
    }
}
