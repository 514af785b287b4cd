//! The expression builder every kernel body is written with, on both targets: one C (and CUDA C)
//! temporary per value at an index, loads of realized buffers through index expressions, and the
//! placement of each temporary — before the loops (the same at every element), per lane of a
//! CUDA vector loop (`Builder::per_lane`), or in the loop body. The loops around a body are the
//! targets' (`codegen/c.rs`, `codegen/cuda.rs`).

use std::collections::{HashMap, HashSet};
use std::fmt::Write;

use kiln_compile::fast_hash::Fast;
use kiln_compile::graph::{Graph, NodeId, Op};
use kiln_core::prim::{Prim, UnaryOp};
use kiln_core::DType;

use crate::ir::index::Ix;
use crate::ir::lower::{binary_c, c_dtype, float_literal, linear, unary_c, view_index};
use crate::schedule::Schedule;

/// Builds the expressions of one kernel body, in C that is also CUDA C: one `const` temporary per
/// value at an index, buffers read as `b<param>[offset]`, loop variables `i<dim>`. The loops
/// around the body are the target's (`loops` here, `codegen/cuda.rs` on the GPU).
pub(crate) struct Builder<'a> {
    pub(super) g: &'a Graph,
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
    pub(super) memo: HashMap<(NodeId, Vec<Ix>), String, Fast>,
    temps: usize,
    /// In an in-place kernel: each input whose storage an output is, the index written and that
    /// output's name. The input is read through the output, only sound at the index written.
    pub(super) inplace: Vec<(NodeId, Ix, String)>,
    /// False once an in-place input is read anywhere but the index written.
    pub(super) inplace_ok: bool,
    /// Lane mode (`codegen/cuda_vector.rs`'s vector loop): the flat offset the kernel writes. A load at
    /// exactly that offset reads lane `k` of four consecutive elements loaded as one vector
    /// before the lanes run (`<buffer>_v.v[k]`).
    pub(super) lanes_at: Option<Ix>,
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
    /// next computes them once per thread (`codegen/cuda_vector.rs`'s `hoisted_lanes`); another runs
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
    pub(super) trig_args: Vec<String>,
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
    pub(super) fn temp_of(&mut self, d: DType, expr: String, operands: &[&String]) -> String {
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
