//! The captured graph: prims over numbered values, free of tensor identities and values, so two
//! captures of the same structure are equal (DESIGN.md invariants 3 and 4).

use std::fmt::Write;

use kiln_core::prim::Prim;
use kiln_core::{DType, Device};

pub type NodeId = usize;

#[derive(Clone, Debug, PartialEq)]
pub enum Op {
    /// The i-th graph input (a call argument or a captured tensor such as a parameter).
    Input(usize),
    Prim(Prim),
}

#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    pub op: Op,
    pub args: Vec<NodeId>,
    pub shape: Vec<usize>,
    pub dtype: DType,
    /// Grad mode when the op was traced (code under `no_grad` stays so on replay).
    pub grad_enabled: bool,
    /// For inputs: whether the tensor fed here requires grad (a guarded fact). False on prims.
    pub requires_grad: bool,
    /// Where the value lives: an input's device (guarded), where a prim runs (its operands' device,
    /// or the device a creation prim was asked for). A device prim may read a single-element CPU
    /// input (PyTorch's CPU-scalar rule); nothing else mixes devices.
    pub device: Device,
}

impl Node {
    /// Elements of the value.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes of the value.
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size_in_bytes()
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Graph {
    pub nodes: Vec<Node>,
    pub num_inputs: usize,
    pub outputs: Vec<NodeId>,
    /// Random values the graph draws per run. `Rand` offsets inside the graph are relative to a base
    /// that each run reserves from the default generator (seeds too are per run), so replays draw
    /// fresh numbers exactly as eager code would.
    pub rng_span: u64,
    /// In-place updates the caller applies after a run: (graph output index, graph input index)
    /// where the caller copies that output into that input's tensor (an optimizer's parameters
    /// and state, via `Tensor::assign`), and the input receives no other write. A backend may
    /// write the output straight into the input's storage and return the input tensor itself as
    /// that output, provided nothing it computes afterwards, and no other output, reads the old
    /// values; the caller skips the copy when handed its destination back.
    pub mutated_inputs: Vec<(usize, usize)>,
    /// Per input: whether it is a tensor the traced code captured (a parameter, a buffer, an
    /// optimizer's state) rather than a call argument or a gradient. Those keep their storage
    /// from call to call (updated in place), so a backend that records device work for replay
    /// (CUDA graphs) may read them where they are instead of copying them into buffers of its
    /// own. Missing entries are false.
    pub static_inputs: Vec<bool>,
}

/// A graph's `Rand` prim made concrete for one run whose draws start at `(seed, base)`; other prims
/// unchanged. Every backend runs random prims through this.
pub fn rand_at(p: &Prim, seed: u64, base: u64) -> Prim {
    match p {
        Prim::Rand {
            shape,
            dtype,
            dist,
            offset,
            ..
        } => Prim::Rand {
            shape: shape.clone(),
            dtype: *dtype,
            dist: *dist,
            seed,
            offset: base + offset,
        },
        p => p.clone(),
    }
}

impl Graph {
    /// Whether node `id` is a view the core makes of its operand (the core's rule,
    /// `Prim::view_layout`, over the operand as a contiguous value: traced values are).
    pub fn is_view(&self, id: NodeId) -> bool {
        let node = &self.nodes[id];
        let (Op::Prim(p), Some(&a)) = (&node.op, node.args.first()) else {
            return false;
        };
        p.view_layout(&kiln_core::shape::Layout::contiguous(&self.nodes[a].shape))
            .is_some()
    }

    /// A graph with this one's inputs count, outputs, random span, in-place updates and static
    /// inputs but no nodes yet (room for `capacity`): what a rewriting pass fills. Cheaper than
    /// `Graph { nodes: .., ..g.clone() }`, which copies every node only to drop them.
    pub fn empty_like(&self, capacity: usize) -> Graph {
        Graph {
            nodes: Vec::with_capacity(capacity),
            num_inputs: self.num_inputs,
            outputs: self.outputs.clone(),
            rng_span: self.rng_span,
            mutated_inputs: self.mutated_inputs.clone(),
            static_inputs: self.static_inputs.clone(),
        }
    }

    pub fn push(&mut self, node: Node) -> NodeId {
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    /// A new input of the graph (the next input number), traced with grad mode off.
    pub fn push_input(
        &mut self,
        shape: &[usize],
        dtype: DType,
        device: Device,
        requires_grad: bool,
    ) -> NodeId {
        let i = self.num_inputs;
        self.num_inputs += 1;
        self.push(Node {
            op: Op::Input(i),
            args: vec![],
            shape: shape.to_vec(),
            dtype,
            grad_enabled: false,
            requires_grad,
            device,
        })
    }

    /// The device the graph computes on: the device any of its values lives on, else the CPU.
    /// Values of one graph share a device, but for single-element CPU tensors a device graph
    /// reads (PyTorch's CPU-scalar rule) and what the graph computes from them alone (their
    /// broadcasts, say): a backend computes those on the device too, from a copy.
    pub fn device(&self) -> Device {
        self.nodes
            .iter()
            .map(|n| n.device)
            .find(|&d| d != Device::Cpu)
            .unwrap_or(Device::Cpu)
    }

    /// Number of prim nodes (inputs excluded).
    pub fn num_ops(&self) -> usize {
        self.nodes
            .iter()
            .filter(|n| matches!(n.op, Op::Prim(_)))
            .count()
    }

    /// The input node ids, in input order.
    pub fn input_nodes(&self) -> Vec<NodeId> {
        let mut v = vec![0; self.num_inputs];
        for (id, n) in self.nodes.iter().enumerate() {
            if let Op::Input(i) = n.op {
                v[i] = id;
            }
        }
        v
    }

    /// A key equal for structurally identical graphs: the ops with their attributes, the wiring, the
    /// input and output metadata. Random seeds are excluded: they are runtime values (offsets,
    /// relative to a run's base, are structure). The graph's bytes (`codec::graph_bytes`), so a
    /// key costs a walk over the nodes, no formatting.
    pub fn structure_key(&self) -> Vec<u8> {
        crate::codec::graph_bytes(self, crate::codec::Seeds::Zero)
    }

    /// For each node, the last node that reads it (outputs live to the end).
    pub fn last_uses(&self) -> Vec<usize> {
        let mut last = vec![0; self.nodes.len()];
        for (id, n) in self.nodes.iter().enumerate() {
            for &a in &n.args {
                last[a] = id;
            }
        }
        for &o in &self.outputs {
            last[o] = usize::MAX;
        }
        last
    }

    /// A readable listing, like torch.fx's `print_readable`.
    pub fn to_code(&self, name: &str) -> String {
        let mut s = String::new();
        let ty = |n: &Node| format!("{}{:?}", n.dtype.tag(), n.shape);
        let inputs: Vec<String> = self
            .input_nodes()
            .iter()
            .map(|&id| {
                let n = &self.nodes[id];
                let rg = if n.requires_grad {
                    " (requires_grad)"
                } else {
                    ""
                };
                format!("%{id}: {}{rg}", ty(n))
            })
            .collect();
        let _ = writeln!(s, "def {name}({}):", inputs.join(", "));
        for (id, n) in self.nodes.iter().enumerate() {
            let Op::Prim(p) = &n.op else { continue };
            let args: Vec<String> = n.args.iter().map(|a| format!("%{a}")).collect();
            let grad = if n.grad_enabled { "" } else { "  # no_grad" };
            let _ = writeln!(
                s,
                "    %{id}: {} = {}({}){grad}",
                ty(n),
                prim_text(p),
                args.join(", ")
            );
        }
        let outs: Vec<String> = self.outputs.iter().map(|o| format!("%{o}")).collect();
        let _ = writeln!(s, "    return ({})", outs.join(", "));
        for (k, i) in &self.mutated_inputs {
            let _ = writeln!(s, "    # output {k} is copied into input {i}");
        }
        s
    }
}

fn prim_text(p: &Prim) -> String {
    match p {
        Prim::Unary(u) => format!("{u:?}").to_lowercase(),
        Prim::Binary(b) => format!("{b:?}").to_lowercase(),
        Prim::Reduce { op, dims } => format!("{}[dims={dims:?}]", format!("{op:?}").to_lowercase()),
        Prim::ArgReduce { op, dim } => format!("{}[dim={dim}]", format!("{op:?}").to_lowercase()),
        Prim::Cast(d) => format!("cast[{}]", d.tag()),
        other => {
            let d = format!("{other:?}");
            // `Reshape([2, 3])` -> `reshape[[2, 3]]`, `Slice { dim: 0, .. }` -> `slice[dim: 0, ..]`
            match d.find(['(', '{']) {
                Some(i) => {
                    let inner = d[i + 1..d.len() - 1].trim();
                    format!("{}[{inner}]", other.name())
                }
                None => other.name().to_string(),
            }
        }
    }
}
