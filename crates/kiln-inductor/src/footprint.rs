//! What a planned step touches — the values it reads and produces, the storage (alias roots) it
//! reads and the storage it overwrites in place — and the one ordering rule on it: a step must
//! stay after an earlier one when it reads a value the earlier one produces, or either overwrites
//! storage the other reads. Horizontal fusion (`horizontal.rs`: which kernels may share a
//! launch), sibling reductions (`sibling_reductions.rs`: how far up a reduction may move) and
//! sequential composition (`sequential.rs`: where a barrier goes) ask it.

use kiln_compile::graph::{Graph, NodeId};

use crate::runtime::plan::Alloc;

#[derive(Clone, Debug, Default)]
pub struct Footprint {
    reads: Vec<NodeId>,
    produces: Vec<NodeId>,
    read_roots: Vec<NodeId>,
    overwrites: Vec<NodeId>,
}

fn intersects(a: &[NodeId], b: &[NodeId]) -> bool {
    a.iter().any(|x| b.contains(x))
}

impl Footprint {
    /// A kernel reading `reads` and writing `outs`; `roots`: each node's storage
    /// (`plan::alias_roots`). An in-place output's storage counts as read too: the kernel reads
    /// its old value there.
    pub fn of_kernel(reads: &[NodeId], outs: &[(NodeId, Alloc)], roots: &[NodeId]) -> Self {
        let overwrites = overwritten_roots(outs, roots);
        let mut read_roots: Vec<NodeId> = reads.iter().map(|&r| roots[r]).collect();
        read_roots.extend(&overwrites);
        Footprint {
            reads: reads.to_vec(),
            produces: outs.iter().map(|o| o.0).collect(),
            read_roots,
            overwrites,
        }
    }

    /// An extern step computing `node` from its arguments.
    pub fn of_extern(g: &Graph, node: NodeId, roots: &[NodeId]) -> Self {
        let reads = g.nodes[node].args.clone();
        Footprint {
            read_roots: reads.iter().map(|&r| roots[r]).collect(),
            reads,
            produces: vec![node],
            overwrites: Vec::new(),
        }
    }

    /// Whether a step touching `self`, planned after one touching `earlier`, must stay after it.
    pub fn must_follow(&self, earlier: &Footprint) -> bool {
        intersects(&self.reads, &earlier.produces)
            || intersects(&self.overwrites, &earlier.read_roots)
            || intersects(&self.read_roots, &earlier.overwrites)
    }

    /// Everything `other` touches added to this (several steps as one).
    pub fn extend(&mut self, other: Footprint) {
        self.reads.extend(other.reads);
        self.produces.extend(other.produces);
        self.read_roots.extend(other.read_roots);
        self.overwrites.extend(other.overwrites);
    }
}

/// The storage (alias roots) that outputs written in place into graph inputs overwrite.
pub fn overwritten_roots(outs: &[(NodeId, Alloc)], roots: &[NodeId]) -> Vec<NodeId> {
    outs.iter()
        .filter_map(|&(_, a)| match a {
            Alloc::InPlace(input) => Some(roots[input]),
            _ => None,
        })
        .collect()
}
