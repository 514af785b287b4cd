//! The C target's residue classes (`codegen/residues.rs`): the loops outside the class digit are
//! shared among OpenMP threads, and inside them each class runs its own loops over the rest of
//! the dims, its body in the innermost (contiguous, so the C compiler vectorizes it as in any
//! pointwise kernel). Not a member of horizontal kernels: its nest is several nests.

use std::fmt::Write;
use std::sync::Arc;

use kiln_compile::graph::{Graph, NodeId};

use super::c::{kernel_args, loops, Kernel, PointwiseBody, PARALLEL_THRESHOLD};
use super::c_horizontal::{Member, Threads};
use super::residues;
use crate::schedule::Schedule;

/// The kernel of `roots` split into residue classes (`residues::split`), or `None` (also where
/// no dim lies outside the class digit to share among threads, or a body computes sines and
/// cosines, which `codegen/c_trig.rs` blocks).
pub(super) fn split(
    g: &Graph,
    sched: &Schedule,
    roots: &[(NodeId, Option<NodeId>)],
    whole: &PointwiseBody<'_>,
) -> Option<Kernel> {
    if whole.b.has_trig() {
        return None;
    }
    let split = residues::split(g, sched, roots, whole)?;
    let shape = &g.nodes[roots[0].0].shape;
    let all = split.loops(shape);
    let at = all.iter().position(|(d, _)| d.is_none())?;
    let outer: Vec<(usize, usize)> = all[..at]
        .iter()
        .map(|&(d, n)| (d.unwrap_or(0), n))
        .collect();
    let inner: Vec<(usize, usize)> = all[at + 1..]
        .iter()
        .map(|&(d, n)| (d.unwrap_or(0), n))
        .collect();
    if outer.is_empty() {
        return None;
    }
    let numel: usize = shape.iter().product();
    let parallel = numel >= PARALLEL_THRESHOLD;
    let member = Member {
        inputs: whole.b.params.len(),
        args: kernel_args(g, &whole.b.params, &whole.outputs),
        pre: String::new(),
        outer: Vec::new(),
        block: 1,
        inner: String::new(),
        parallel,
        elements: numel,
    };
    let mut text = String::new();
    member.declare(&mut text, 0, member.inputs);
    if parallel {
        let _ = writeln!(
            text,
            "  #pragma omp parallel for collapse({}) schedule(static)",
            outer.len()
        );
    }
    loops(&mut text, &outer, Threads::One);
    text.push_str("  {\n");
    for b in &split.bodies {
        // each class in a block of its own: its values are named as in any kernel's body
        let _ = write!(text, "  {{\n{}", b.b.pre);
        loops(&mut text, &inner, Threads::One);
        let _ = writeln!(text, "  {{\n{}{}  }}\n  }}", b.b.body, b.stores);
    }
    text.push_str("  }\n");
    let hash = xxhash_rust::xxh3::xxh3_64(format!("{parallel}{text}").as_bytes());
    let name = format!("k_{hash:016x}");
    Some(Kernel {
        source: format!("void {name}(void **args) {{\n{text}}}\n"),
        name,
        inputs: whole.b.params.clone(),
        member: None::<Arc<Member>>,
    })
}
