//! A graph's compile on disk (PyTorch's FX graph cache): the graph its steps run (rewritten and
//! planned), the steps (each generated kernel's name, operands, where its outputs go and its
//! launch shape; extern calls by node), and the kernels' sources, keyed by the graph the backend
//! was handed, the target and the compiler's build id (`kiln_compile::disk_cache`). A new
//! process that captures the same graph skips rewriting, planning and code generation, and the
//! stored sources hit the kernel caches (the C libraries, NVRTC's cubins), so nothing is built.
//! Not for one size of a symbolic graph (its kernels come from templates fitted across sizes)
//! or under max-autotune (its launches choose among candidates at their first run).

use kiln_compile::codec::{self, Reader, Seeds, Writer};
use kiln_compile::disk_cache;
use kiln_compile::graph::{Graph, NodeId};
use kiln_compile::prefetch::{Prefetched, Recent};
use kiln_compile::BackendContext;

use kiln_core::Result;

use crate::runtime::exec::{Exec, Launch};
use crate::runtime::plan::Alloc;

/// The build id (`build.rs`): a hash of this crate's, kiln-compile's and kiln-core's sources.
pub const BUILD_ID: &str = env!("KILN_INDUCTOR_BUILD_ID");

/// One step of a stored compile.
#[derive(Clone, Debug, PartialEq)]
pub enum PlanStep {
    Kernel {
        outs: Vec<(NodeId, Alloc)>,
        inputs: Vec<NodeId>,
        name: String,
        /// A size-generic kernel's size arguments (empty otherwise).
        sizes: Vec<i64>,
        /// grid (x, y, z), block, dynamic shared bytes; unused on the CPU.
        launch: ([u32; 3], u32, u32),
    },
    Extern {
        node: NodeId,
    },
}

impl PlanStep {
    /// The executor's step: a kernel launched as `launch(name, (grid, block, shared))` says (a
    /// C function, a device kernel, the candidates max-autotune times).
    pub fn into_exec(
        self,
        launch: impl FnOnce(&str, ([u32; 3], u32, u32)) -> Result<Launch>,
    ) -> Result<Exec> {
        Ok(match self {
            PlanStep::Kernel {
                outs,
                inputs,
                name,
                sizes,
                launch: shape,
            } => Exec::Kernel {
                f: launch(&name, shape)?,
                outs,
                inputs,
                name: name.into(),
                sizes,
            },
            PlanStep::Extern { node } => Exec::Extern { node },
        })
    }
}

/// A stored compile: the graph the steps run, the steps, and the sources to load (translation
/// units with the kernels each defines).
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub graph: Graph,
    pub steps: Vec<PlanStep>,
    pub units: Vec<(String, Vec<String>)>,
}

/// Environment variables that change what the compiler makes of a graph.
const ENV: [&str; 7] = [
    "KILN_CHANNELS_LAST",
    "KILN_MATMUL_EPILOGUES",
    "KILN_CONV_EPILOGUES",
    "KILN_SHARE_KERNELS_FROM",
    "KILN_NO_LIBMVEC",
    "KILN_COMPILE_UNITS",
    "KILN_COMPILE_THREADS",
];

/// The build id and the values of the environment variables that change what the compiler
/// makes of a graph: part of every key this crate (and AOT autograd around it) stores under.
pub fn build_and_settings() -> String {
    let env: String = ENV
        .iter()
        .map(|v| format!("{v}={:?};", std::env::var_os(v)))
        .collect();
    format!("{BUILD_ID};{env}")
}

/// The key of `graph` compiled for `target` (a description of the target and its options, as
/// the caller makes it: everything but the graph that its plan depends on), or `None` when the
/// cache is off.
pub fn key(kind: &str, target: &str, graph: &Graph) -> Option<u128> {
    if !disk_cache::enabled() {
        return None;
    }
    Some(disk_cache::key(&[
        kind.as_bytes(),
        build_and_settings().as_bytes(),
        target.as_bytes(),
        &graph.structure_key(),
    ]))
}

/// Plans read ahead while their function is traced (`kiln_compile::prefetch`), by key (a key
/// covers its kind: one table serves both targets).
static READ_AHEAD: Prefetched<Plan> = Prefetched::new();

/// The disk cache's kinds of plans: the CUDA target's and the C target's.
pub const CUDA_KIND: &str = "cuda";
pub const C_KIND: &str = "c";

/// The manifest of the plans of `kind` the function `ctx` names used (`prefetch::Recent`),
/// under its name, its mode, and this build and its settings; `None` when nothing is cached.
pub fn recent(kind: &str, ctx: &BackendContext) -> Option<Recent> {
    Recent::new(
        kind,
        &[
            ctx.name.as_bytes(),
            ctx.mode.as_bytes(),
            build_and_settings().as_bytes(),
        ],
    )
}

/// Starts reading ahead, each on a thread of its own, the plans (of either target) the
/// function `ctx` names used in its last compiles: all at once, while the function is traced.
/// Once a process for a function, as AOT autograd's splits.
pub fn read_ahead_recent(ctx: &BackendContext) {
    for kind in [CUDA_KIND, C_KIND] {
        let Some(recent) = recent(kind, ctx) else {
            return;
        };
        for key in recent.to_read_ahead() {
            READ_AHEAD.start_disk(&ctx.name, kind, key, decode);
        }
    }
}

/// Remembers the keys of the plans a compile of the function `recent` names used.
pub fn remember(recent: Option<&Recent>, keys: impl IntoIterator<Item = Option<u128>>) {
    if let Some(recent) = recent {
        recent.remember_all(&keys.into_iter().flatten().collect::<Vec<_>>());
    }
}

/// The plan stored under (`kind`, `key`): the one read ahead, else read now.
pub fn take_or_load(kind: &str, key: u128) -> Option<Plan> {
    READ_AHEAD.take_or_load(kind, key, decode)
}

/// Drops the plans read ahead for `function` that its compile did not take (stale: its graphs
/// changed since its last compile).
pub fn discard_read_ahead(function: &str) {
    READ_AHEAD.discard(function);
}

pub fn store(kind: &str, key: u128, plan: &Plan) {
    disk_cache::store(kind, key, &encode(plan));
}

fn alloc(w: &mut Writer, a: Alloc) {
    match a {
        Alloc::Output => w.u64(0),
        Alloc::Pooled => w.u64(1),
        Alloc::InPlace(i) => w.u64(2 + i as u64),
    }
}

fn read_alloc(r: &mut Reader) -> Option<Alloc> {
    Some(match r.usize()? {
        0 => Alloc::Output,
        1 => Alloc::Pooled,
        i => Alloc::InPlace(i - 2),
    })
}

fn encode(p: &Plan) -> Vec<u8> {
    let mut w = Writer::default();
    codec::graph(&mut w, &p.graph, Seeds::Keep);
    w.usize(p.steps.len());
    for s in &p.steps {
        match s {
            PlanStep::Kernel {
                outs,
                inputs,
                name,
                sizes,
                launch: (grid, block, shared),
            } => {
                w.u64(0);
                w.usize(outs.len());
                for &(n, a) in outs {
                    w.usize(n);
                    alloc(&mut w, a);
                }
                w.usizes(inputs);
                w.str(name);
                w.i64s(sizes);
                for v in grid.iter().chain([block, shared]) {
                    w.u32(*v);
                }
            }
            PlanStep::Extern { node } => {
                w.u64(1);
                w.usize(*node);
            }
        }
    }
    w.usize(p.units.len());
    for (source, names) in &p.units {
        w.str(source);
        w.usize(names.len());
        for n in names {
            w.str(n);
        }
    }
    w.bytes
}

fn decode(bytes: &[u8]) -> Option<Plan> {
    let mut r = Reader::new(bytes);
    let graph = codec::read_graph(&mut r)?;
    let nodes = graph.nodes.len();
    let n = r.count()?;
    let mut steps = Vec::with_capacity(n);
    for _ in 0..n {
        steps.push(match r.u64()? {
            0 => {
                let k = r.count()?;
                let outs = (0..k)
                    .map(|_| Some((r.usize()?, read_alloc(&mut r)?)))
                    .collect::<Option<Vec<_>>>()?;
                let inputs = r.usizes()?;
                let name = r.str()?;
                let sizes = r.i64s()?;
                let grid = [r.u32()?, r.u32()?, r.u32()?];
                let launch = (grid, r.u32()?, r.u32()?);
                let in_range = outs
                    .iter()
                    .all(|&(o, a)| o < nodes && !matches!(a, Alloc::InPlace(i) if i >= nodes))
                    && inputs.iter().all(|&i| i < nodes);
                if !in_range {
                    return None;
                }
                PlanStep::Kernel {
                    outs,
                    inputs,
                    name,
                    sizes,
                    launch,
                }
            }
            1 => PlanStep::Extern {
                node: r.usize().filter(|&i| i < nodes)?,
            },
            _ => return None,
        });
    }
    let u = r.count()?;
    let mut units = Vec::with_capacity(u);
    for _ in 0..u {
        let source = r.str()?;
        let k = r.count()?;
        let names = (0..k).map(|_| r.str()).collect::<Option<Vec<_>>>()?;
        units.push((source, names));
    }
    r.done().then_some(Plan {
        graph,
        steps,
        units,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_graphs::{binary, input};
    use kiln_core::prim::BinaryOp;

    fn sample() -> Plan {
        let mut graph = kiln_compile::graph::Graph::default();
        let x = input(&mut graph, &[3, 4]);
        let y = binary(&mut graph, BinaryOp::Add, x, x);
        graph.outputs = vec![y];
        Plan {
            graph,
            steps: vec![
                PlanStep::Kernel {
                    outs: vec![(1, Alloc::Output), (0, Alloc::InPlace(0))],
                    inputs: vec![0],
                    name: "k_1".into(),
                    sizes: vec![-3, 1 << 40],
                    launch: ([132, 2, 1], 256, 4096),
                },
                PlanStep::Extern { node: 1 },
            ],
            units: vec![("extern \"C\" ...".into(), vec!["k_1".into(), "k_2".into()])],
        }
    }

    #[test]
    fn a_plan_reads_back_as_written_and_damage_reads_as_none() {
        let p = sample();
        let bytes = encode(&p);
        assert_eq!(decode(&bytes), Some(p));
        for cut in 0..bytes.len() {
            assert_eq!(decode(&bytes[..cut]), None, "cut {cut}");
        }
    }
}
