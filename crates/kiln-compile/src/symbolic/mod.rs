//! Dynamic shapes: symbolic sizes in graphs, so one compiled graph serves many input sizes.
//!
//! Rust code reads sizes as plain `usize` and may branch on them where no tracer sees it, so kiln
//! never trusts a graph at a size it has not traced: symbolic graphs are built by tracing the code
//! at several sizes and unifying the traces (`SymGraph::unify`, `fit.rs`), and a new size is traced
//! again and must instantiate the symbolic graph exactly (`SymGraph::instantiates`) before its
//! compiled code runs there. See ARCHITECTURE.md, "Dynamic shapes".

pub mod compiled;
pub mod context;
pub mod expr;
pub mod fit;
pub mod guards;
pub mod marks;
pub mod slots;
pub mod sym_graph;

pub use expr::{Expr, SymId};
pub use guards::SymGuard;
pub use marks::{mark_dynamic, mark_static};
pub use sym_graph::{SymGraph, Symbol};

/// The unit tests' graph: x: [n, 3] -> reshape [3n] -> slice [1, 3n) with `step`.
#[cfg(test)]
fn test_graph(n: usize, step: usize) -> crate::graph::Graph {
    use crate::graph::{Graph, Node, Op};
    use kiln_core::prim::Prim;
    let mut g = Graph {
        num_inputs: 1,
        ..Graph::default()
    };
    let node = |op, args, shape: Vec<usize>| Node {
        op,
        args,
        shape,
        dtype: kiln_core::DType::F32,
        grad_enabled: true,
        requires_grad: false,
        device: kiln_core::Device::Cpu,
    };
    let x = g.push(node(Op::Input(0), vec![], vec![n, 3]));
    let r = g.push(node(
        Op::Prim(Prim::Reshape(vec![3 * n])),
        vec![x],
        vec![3 * n],
    ));
    let s = g.push(node(
        Op::Prim(Prim::Slice {
            dim: 0,
            start: 1,
            end: 3 * n,
            step,
        }),
        vec![r],
        vec![(3 * n - 1).div_ceil(step)],
    ));
    g.outputs = vec![s];
    g
}
