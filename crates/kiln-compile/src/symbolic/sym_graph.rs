//! `SymGraph`: one graph for many sizes. It is a representative trace plus, for every slot (see
//! `slots.rs`), an expression of the symbols; each symbol is bound to one input dimension (its
//! first binding) and any other input dimension that always equals it (duck sizing, guarded).
//!
//! Built by `unify` from traces of the same code at different sizes; used by `instantiates`, which
//! checks that a new trace is exactly this graph at that trace's symbol values.

use kiln_core::{Error, Result};

use super::expr::{Expr, SymId};
use super::fit::{fit, Sample};
use super::guards::{first_failure, SymGuard};
use super::slots::{erased_key, slots_of, with_slots, SlotKind};
use crate::graph::{Graph, Node, Op};
use kiln_core::prim::Prim;

#[derive(Clone, Debug)]
pub struct Symbol {
    /// The input dimensions this symbol stands for: (graph input, dim). The first is where its
    /// value is read at run time.
    pub dims: Vec<(usize, usize)>,
}

#[derive(Clone, Debug)]
pub struct SymGraph {
    /// A trace at some sizes; its slot values are those of `example_values`.
    pub graph: Graph,
    pub symbols: Vec<Symbol>,
    /// One expression per slot, in `slots.rs` order (a constant for a fixed slot).
    pub exprs: Vec<Expr>,
    pub guards: Vec<SymGuard>,
    /// The symbol values of `graph`.
    pub example_values: Vec<i64>,
    erased: Vec<u8>,
    /// Slot index of each symbol's first binding.
    binding_slots: Vec<usize>,
}

/// Why traces did not unify: a message, and the symbols to give up (make static) to try again.
#[derive(Debug)]
pub struct UnifyError {
    pub message: String,
    pub culprits: Vec<SymId>,
}

/// The slot index of input dimension (graph input `input`, `dim`), if the graph has it.
pub fn input_dim_slot(kinds: &[SlotKind], g: &Graph, input: usize, dim: usize) -> Option<usize> {
    let node = g
        .nodes
        .iter()
        .position(|n| matches!(n.op, Op::Input(i) if i == input))?;
    kinds
        .iter()
        .position(|k| *k == SlotKind::Shape { node, dim })
}

impl SymGraph {
    /// One graph for `traces` (the first is the representative), with one symbol per group of input
    /// dimensions in `symbols`. Every trace must have the same structure; every slot must be
    /// explained by an expression of the symbols that reproduces it in every trace.
    pub fn unify(
        traces: &[Graph],
        symbols: &[Symbol],
    ) -> std::result::Result<SymGraph, UnifyError> {
        let first = traces.first().ok_or(UnifyError {
            message: "no traces".into(),
            culprits: vec![],
        })?;
        let erased = erased_key(first);
        if let Some(i) = traces.iter().position(|t| erased_key(t) != erased) {
            return Err(UnifyError {
                message: format!(
                    "trace {i} has a different structure (ops, wiring, dtypes or axes)"
                ),
                culprits: vec![],
            });
        }
        let (_, kinds) = slots_of(first);
        let values: Vec<Vec<i64>> = traces.iter().map(|t| slots_of(t).0).collect();
        let mut binding_slots = Vec::new();
        for (k, s) in symbols.iter().enumerate() {
            let &(input, dim) = s.dims.first().ok_or(UnifyError {
                message: format!("symbol s{k} is bound to no input dimension"),
                culprits: vec![k],
            })?;
            let slot = input_dim_slot(&kinds, first, input, dim).ok_or(UnifyError {
                message: format!("s{k}: graph input {input} has no dimension {dim}"),
                culprits: vec![k],
            })?;
            binding_slots.push(slot);
        }
        let sym_values: Vec<Vec<i64>> = values
            .iter()
            .map(|v| binding_slots.iter().map(|&s| v[s]).collect())
            .collect();
        let mut exprs = Vec::with_capacity(kinds.len());
        for (slot, kind) in kinds.iter().enumerate() {
            let samples: Vec<Sample> = sym_values
                .iter()
                .zip(&values)
                .map(|(s, v)| (s.as_slice(), v[slot]))
                .collect();
            match fit(&samples, symbols.len()) {
                Some(e) => exprs.push(e),
                None => {
                    // the symbols whose moving moved this slot
                    let culprits = (0..symbols.len())
                        .filter(|&k| {
                            samples
                                .iter()
                                .any(|&(s, x)| s[k] != samples[0].0[k] && x != samples[0].1)
                        })
                        .collect();
                    let shown: Vec<String> = samples
                        .iter()
                        .map(|(s, x)| format!("{x} at {}", show_values(s)))
                        .collect();
                    return Err(UnifyError {
                        message: format!(
                            "{} is {}: no size expression fits",
                            describe_slot(first, *kind),
                            shown.join(", ")
                        ),
                        culprits,
                    });
                }
            }
        }
        // 0 is specialised (an empty tensor skips the kernels): its own entry. 1 is not guarded
        // off although broadcasting and squeezing branch on it: a size-1 call runs this graph only
        // if its trace instantiates it exactly (`instantiates`), which proves no branch at 1
        // changed the graph. Symbols are still made from sizes >= 2 only (`compiled_fn/dynamic.rs`)
        let guards: Vec<SymGuard> = (0..symbols.len())
            .map(|k| SymGuard::AtLeast(Expr::sym(k), 1))
            .collect();
        for (k, s) in symbols.iter().enumerate() {
            for &(i, d) in &s.dims[1..] {
                if let Some(slot) = input_dim_slot(&kinds, first, i, d) {
                    // duck-sized: the slot check of every instantiation guards the equality
                    exprs[slot] = Expr::sym(k);
                }
            }
        }
        Ok(SymGraph {
            graph: first.clone(),
            symbols: symbols.to_vec(),
            exprs,
            guards,
            example_values: sym_values[0].clone(),
            erased,
            binding_slots,
        })
    }

    /// The graph at symbol values `syms`.
    pub fn instantiate(&self, syms: &[i64]) -> Result<Graph> {
        let vals: Option<Vec<i64>> = self.exprs.iter().map(|e| e.eval(syms)).collect();
        vals.and_then(|v| with_slots(&self.graph, &v))
            .ok_or_else(|| {
                Error::arg(
                    "compile",
                    format!(
                        "symbolic graph: sizes {} give a negative or undefined size",
                        show_values(syms)
                    ),
                )
            })
    }

    /// The symbol values of a trace `g` of this graph's structure, read from its input dims.
    pub fn values_in(&self, g: &Graph) -> Vec<i64> {
        let (v, _) = slots_of(g);
        self.binding_slots.iter().map(|&s| v[s]).collect()
    }

    /// Whether trace `g` is this graph at some symbol values: `Ok(values)` if so, else why not.
    /// Exactly, or but for identity views (see `instantiates_but_for_identity_views`).
    pub fn instantiates(&self, g: &Graph) -> std::result::Result<Vec<i64>, String> {
        if erased_key(g) != self.erased {
            return self.instantiates_but_for_identity_views(g);
        }
        let (vals, kinds) = slots_of(g);
        let syms: Vec<i64> = self.binding_slots.iter().map(|&s| vals[s]).collect();
        if let Some(why) = first_failure(&self.guards, &syms) {
            return Err(why);
        }
        for (slot, (e, &v)) in self.exprs.iter().zip(&vals).enumerate() {
            if e.eval(&syms) != Some(v) {
                return Err(format!(
                    "at {}, {} is {v}, not {e} = {}",
                    show_values(&syms),
                    describe_slot(g, kinds[slot]),
                    e.eval(&syms).map_or("undefined".into(), |x| x.to_string())
                ));
            }
        }
        Ok(syms)
    }

    /// Broadcasting expands an operand only where its size differs, so where a symbol is 1 the
    /// trace lacks expands (and reshapes) that this graph has and that are identities there: the
    /// trace instantiates this graph if both are equal with value-identity views removed. Equal
    /// after removing nodes that do not change values, they compute the same values, and the
    /// graph run is this one at the trace's sizes, as when the trace matches exactly.
    fn instantiates_but_for_identity_views(
        &self,
        g: &Graph,
    ) -> std::result::Result<Vec<i64>, String> {
        let different = "the new trace has a different structure (ops, wiring, dtypes or axes)";
        let syms = self.values_at_inputs(g).ok_or(different)?;
        if let Some(why) = first_failure(&self.guards, &syms) {
            return Err(format!("{different}; {why}"));
        }
        let inst = self.instantiate(&syms).map_err(|e| e.to_string())?;
        if without_identity_views(&inst).structure_key()
            == without_identity_views(g).structure_key()
        {
            Ok(syms)
        } else {
            Err(format!(
                "{different}, also with identity expands and reshapes removed"
            ))
        }
    }

    /// The symbol values of any trace `g`, read off its input nodes' shapes (`values_in` needs
    /// this graph's structure); `None` if `g` lacks an input dimension a symbol is bound to.
    fn values_at_inputs(&self, g: &Graph) -> Option<Vec<i64>> {
        self.symbols
            .iter()
            .map(|s| {
                let &(input, dim) = s.dims.first()?;
                let node = g
                    .nodes
                    .iter()
                    .find(|n| matches!(n.op, Op::Input(i) if i == input))?;
                node.shape.get(dim).map(|&v| v as i64)
            })
            .collect()
    }

    /// The symbols' definitions and guards, for logs.
    pub fn describe(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .symbols
            .iter()
            .enumerate()
            .map(|(k, s)| {
                let dims: Vec<String> = s
                    .dims
                    .iter()
                    .map(|(i, d)| format!("input {i} dim {d}"))
                    .collect();
                format!("s{k} = {}", dims.join(" = "))
            })
            .collect();
        v.extend(self.guards.iter().map(|g| g.to_string()));
        v
    }
}

/// `g` without its value-identity views: an `Expand` or `Reshape` whose shape is its operand's
/// is replaced by the operand (uses and outputs rewired, nodes renumbered in order).
fn without_identity_views(g: &Graph) -> Graph {
    let mut out = Graph {
        nodes: Vec::with_capacity(g.nodes.len()),
        num_inputs: g.num_inputs,
        outputs: Vec::new(),
        rng_span: g.rng_span,
        mutated_inputs: g.mutated_inputs.clone(),
        static_inputs: g.static_inputs.clone(),
    };
    let mut at: Vec<usize> = Vec::with_capacity(g.nodes.len());
    for n in &g.nodes {
        // nodes only read earlier nodes: `at` has every argument
        let args: Vec<usize> = n.args.iter().map(|&a| at[a]).collect();
        let identity = matches!(n.op, Op::Prim(Prim::Expand(_) | Prim::Reshape(_)))
            && args.len() == 1
            && out.nodes[args[0]].shape == n.shape
            && out.nodes[args[0]].dtype == n.dtype;
        if identity {
            at.push(args[0]);
        } else {
            at.push(out.push(Node { args, ..n.clone() }));
        }
    }
    out.outputs = g.outputs.iter().map(|&o| at[o]).collect();
    out
}

pub fn show_values(syms: &[i64]) -> String {
    let v: Vec<String> = syms
        .iter()
        .enumerate()
        .map(|(k, x)| format!("s{k}={x}"))
        .collect();
    v.join(", ")
}

fn describe_slot(g: &Graph, k: SlotKind) -> String {
    let name = |node: usize| match &g.nodes[node].op {
        Op::Input(i) => format!("input {i}"),
        Op::Prim(p) => format!("%{node} ({})", p.name()),
    };
    match k {
        SlotKind::Shape { node, dim } => format!("dim {dim} of {}", name(node)),
        SlotKind::Param { node, index } => format!("size parameter {index} of {}", name(node)),
        SlotKind::RngSpan => "the graph's random span".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// x: [n, 3] -> reshape [3n] -> slice [1, 3n) (stride 2 when `odd_branch`)
    fn graph(n: usize, odd_branch: bool) -> Graph {
        super::super::test_graph(n, if odd_branch { 2 } else { 1 })
    }

    #[test]
    fn unifies_traces_and_checks_new_ones_exactly() {
        let sym = vec![Symbol { dims: vec![(0, 0)] }];
        let sg = SymGraph::unify(&[graph(4, false), graph(6, false), graph(9, false)], &sym)
            .expect("one structure, sizes affine in n");
        assert_eq!(sg.example_values, vec![4]);
        assert_eq!(sg.instantiates(&graph(20, false)), Ok(vec![20]));
        assert_eq!(sg.instantiate(&[20]).ok(), Some(graph(20, false)));
        let other = sg.instantiates(&graph(20, true)).unwrap_err();
        assert!(other.contains("different structure"), "{other}");
        // size 1 is no symbol value the fit saw, but the trace at 1 is the graph at s0 = 1
        assert_eq!(sg.instantiates(&graph(1, false)), Ok(vec![1]));
        assert_eq!(sg.guards, vec![SymGuard::AtLeast(Expr::sym(0), 1)]);
        // a trace at 1 without an expand that is an identity there is still this graph
        let bcast = |n: usize, skip_identity: bool| {
            let mut g = graph(n, false);
            let b = g.push(Node {
                op: Op::Prim(Prim::Expand(vec![3 * n - 1])),
                args: vec![1],
                shape: vec![3 * n - 1],
                ..g.nodes[2].clone()
            });
            g.nodes[b].args = vec![2];
            if skip_identity && n == 1 {
                g.nodes.pop();
                g.outputs = vec![2];
            } else {
                g.outputs = vec![b];
            }
            g
        };
        let sb = SymGraph::unify(&[bcast(4, true), bcast(6, true), bcast(9, true)], &sym)
            .expect("one structure");
        assert_eq!(sb.instantiates(&bcast(1, true)), Ok(vec![1]));
        assert_eq!(sb.instantiates(&bcast(1, false)), Ok(vec![1]));
        let mut wrong = bcast(1, true);
        wrong.nodes[2].op = Op::Prim(Prim::Reshape(vec![2]));
        assert!(
            sb.instantiates(&wrong).is_err(),
            "a node that is no view still counts"
        );
        // a slot that is no function of the symbols: the symbol is the culprit
        let mut odd = graph(6, false);
        odd.nodes[2].shape[0] = 7;
        let e = SymGraph::unify(&[graph(4, false), odd, graph(9, false)], &sym).unwrap_err();
        assert_eq!(e.culprits, vec![0]);
        assert!(e.message.contains("dim 0 of %2 (slice)"), "{}", e.message);
    }
}
