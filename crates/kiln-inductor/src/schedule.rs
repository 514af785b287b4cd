//! The scheduler: decides which values become buffers (are *realized*) and which are inlined into
//! the kernels that read them — that choice is the fusion. A pointwise or view value read once is
//! computed inside its reader's loop (vertical fusion, and elementwise producers fused into
//! reductions); values read by several kernels, graph outputs, reductions and the operands of extern
//! ops are realized. Every realized value becomes one step: a generated kernel or an extern call.

use kiln_compile::graph::{Graph, NodeId, Op};
use kiln_core::prim::Prim;

use crate::ir::lower::{kind, Kind};

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// A generated loop nest computing `node` into a buffer (which one: `runtime/plan.rs`).
    Kernel { node: NodeId },
    /// `node` through the core's kernels (matmul, conv, gather, random, views of buffers, ...).
    Extern { node: NodeId },
}

/// Longest pointwise chain inlined into several readers instead of realized.
const MAX_RECOMPUTE_OPS: usize = 4;
/// Most readers a shared pointwise chain is inlined into.
const MAX_RECOMPUTE_USERS: usize = 3;

pub struct Schedule {
    pub kinds: Vec<Kind>,
    pub realized: Vec<bool>,
    pub steps: Vec<Step>,
}

fn is_pad_or_cat(g: &Graph, id: NodeId) -> bool {
    matches!(
        g.nodes[id].op,
        Op::Prim(Prim::Pad { .. }) | Op::Prim(Prim::Cat { .. })
    )
}

pub fn schedule(g: &Graph) -> Schedule {
    let n = g.nodes.len();
    let kinds: Vec<Kind> = g.nodes.iter().map(|node| kind(g, node)).collect();
    let mut users = vec![0usize; n];
    let mut must_realize = vec![false; n];
    for &o in &g.outputs {
        must_realize[o] = true;
    }
    for (id, node) in g.nodes.iter().enumerate() {
        for &a in &node.args {
            users[a] += 1;
            // extern ops take tensors; pad and cat read their operands under a bounds check
            if kinds[id] == Kind::Extern || is_pad_or_cat(g, id) {
                must_realize[a] = true;
            }
        }
    }
    let mut realized = vec![false; n];
    // a view of a buffer, or a constant: free to inline however many readers it has
    let mut cheap = vec![false; n];
    // pointwise ops a reader recomputes when it inlines the value
    let mut cost = vec![0usize; n];
    for (id, node) in g.nodes.iter().enumerate() {
        realized[id] = match kinds[id] {
            Kind::Input | Kind::Extern | Kind::Reduction => true,
            Kind::Constant => must_realize[id],
            Kind::Pointwise | Kind::Movement => {
                let is_view = kinds[id] == Kind::Movement && !is_pad_or_cat(g, id);
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
                // a short chain read by a few kernels is recomputed in each (softmax's exp is
                // computed by the sum and by the division: no buffer written and read back)
                let shared = users[id] >= 2 && !view_of_buffer;
                let recompute = cost[id] <= MAX_RECOMPUTE_OPS && users[id] <= MAX_RECOMPUTE_USERS;
                must_realize[id] || (shared && !recompute)
            }
        };
        if kinds[id] == Kind::Constant {
            cheap[id] = true;
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
    Schedule {
        kinds,
        realized,
        steps,
    }
}
