//! The integers of a graph that a size can flow into ("slots"): every node's shape, the size-like
//! parameters of prims (reshape and expand targets, slice bounds, pads, creation shapes, random
//! offsets, conv-gradient shapes), a `Full` value that is a whole number (`mean` divides by a
//! count) and the graph's random span. Axis numbers, permutations, strides and other float
//! constants are structure, not slots: two graphs unify only if those are equal.
//!
//! Every slot is visited in one fixed order, so a graph is (its structure with slots erased, its
//! slot values), and two traces of the same code at different sizes differ only in the values.

use kiln_core::prim::Prim;

use crate::graph::{Graph, Op};

/// What a slot is, for messages and for finding input dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotKind {
    /// Dimension `dim` of node `node`'s shape.
    Shape { node: usize, dim: usize },
    /// The `index`-th size parameter of node `node`'s prim.
    Param { node: usize, index: usize },
    /// `Graph::rng_span`.
    RngSpan,
}

/// Calls `f` on every slot of `g`, in the fixed order, letting it rewrite the value.
/// Returns false if `f` set a size slot negative (left at 0).
pub fn visit_slots(g: &mut Graph, f: &mut dyn FnMut(SlotKind, &mut i64)) -> bool {
    let mut ok = true;
    for (id, n) in g.nodes.iter_mut().enumerate() {
        for (d, x) in n.shape.iter_mut().enumerate() {
            ok &= visit_usize(x, SlotKind::Shape { node: id, dim: d }, f);
        }
        if let Op::Prim(p) = &mut n.op {
            let mut index = 0;
            ok &= visit_prim(p, &mut |x: &mut i64| {
                f(SlotKind::Param { node: id, index }, x);
                index += 1;
            });
        }
    }
    let mut span = g.rng_span as i64;
    f(SlotKind::RngSpan, &mut span);
    g.rng_span = span.max(0) as u64;
    ok && span >= 0
}

fn visit_usize(x: &mut usize, k: SlotKind, f: &mut dyn FnMut(SlotKind, &mut i64)) -> bool {
    let mut v = *x as i64;
    f(k, &mut v);
    *x = v.max(0) as usize;
    v >= 0
}

/// Whole numbers up to 2^53 are exact in f64: such a `Full` value may be a size.
fn whole(v: f64) -> bool {
    v.fract() == 0.0 && v.abs() <= (1u64 << 53) as f64
}

fn visit_prim(p: &mut Prim, f: &mut dyn FnMut(&mut i64)) -> bool {
    let mut ok = true;
    let mut each = |x: &mut usize| {
        let mut v = *x as i64;
        f(&mut v);
        ok &= v >= 0;
        *x = v.max(0) as usize;
    };
    match p {
        Prim::Reshape(v) | Prim::Expand(v) => v.iter_mut().for_each(&mut each),
        Prim::Slice { start, end, .. } => {
            each(start);
            each(end);
        }
        Prim::Pad { pads, .. } => {
            for (a, b) in pads.iter_mut() {
                each(a);
                each(b);
            }
        }
        Prim::Full { shape, value, .. } => {
            shape.iter_mut().for_each(&mut each);
            if whole(*value) {
                let mut v = *value as i64;
                f(&mut v);
                *value = v as f64;
            }
        }
        Prim::Iota { n, .. } => each(n),
        Prim::Rand { shape, offset, .. } => {
            shape.iter_mut().for_each(&mut each);
            let mut o = *offset as usize;
            each(&mut o);
            *offset = o as u64;
        }
        Prim::Conv2dGradInput { input_shape, .. } => input_shape.iter_mut().for_each(&mut each),
        Prim::Conv2dGradWeight { weight_shape, .. } => weight_shape.iter_mut().for_each(&mut each),
        // every other prim's integers (axes, permutations, conv strides) are structure
        _ => {}
    }
    ok
}

/// The slot values of `g`, in visiting order, with what each slot is.
pub fn slots_of(g: &Graph) -> (Vec<i64>, Vec<SlotKind>) {
    let mut g = g.clone();
    let (mut vals, mut kinds) = (Vec::new(), Vec::new());
    let _ = visit_slots(&mut g, &mut |k, x| {
        vals.push(*x);
        kinds.push(k);
    });
    (vals, kinds)
}

/// `g` with every slot set to `values[i]` (same visiting order). `None` if a size would be
/// negative or the count is wrong.
pub fn with_slots(g: &Graph, values: &[i64]) -> Option<Graph> {
    let mut g = g.clone();
    let mut i = 0;
    let mut missing = false;
    let sizes_ok = visit_slots(&mut g, &mut |_, x| {
        match values.get(i) {
            Some(&v) => *x = v,
            None => missing = true,
        }
        i += 1;
    });
    (sizes_ok && !missing && i == values.len()).then_some(g)
}

/// A key equal for two graphs that differ only in slot values.
pub fn erased_key(g: &Graph) -> Vec<u8> {
    let mut g = g.clone();
    let _ = visit_slots(&mut g, &mut |_, x| *x = 0);
    g.structure_key()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(n: usize) -> Graph {
        super::super::test_graph(n, 1)
    }

    #[test]
    fn graphs_of_one_structure_differ_only_in_slots() {
        let (a, b) = (graph(4), graph(7));
        assert_ne!(a.structure_key(), b.structure_key());
        assert_eq!(erased_key(&a), erased_key(&b));
        let (va, kinds) = slots_of(&a);
        assert_eq!(va, vec![4, 3, 12, 12, 11, 1, 12, 0]);
        assert_eq!(kinds[0], SlotKind::Shape { node: 0, dim: 0 });
        assert_eq!(kinds[3], SlotKind::Param { node: 1, index: 0 });
        let (vb, _) = slots_of(&b);
        assert_eq!(with_slots(&a, &vb), Some(b));
        assert_eq!(with_slots(&a, &va[1..]), None, "too few values");
    }
}
