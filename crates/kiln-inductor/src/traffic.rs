//! What the steps planned for a device graph move through memory: per launch, the bytes of the
//! buffers it reads (each once) and writes. A generated kernel on a large tensor is bound by
//! these bytes, so their sum is what fusion decisions are judged by, on any machine (the plan is
//! the one a GPU of `sm_count` multiprocessors gets; no device is needed). Views the core makes
//! move nothing; an extern call (cuBLAS, cuDNN) is counted by its operands and result.

use kiln_compile::graph::{Graph, Op};

use crate::backend::{prepare, Planned};
use crate::codegen::cuda::Cuda;

/// One planned launch and what it moves.
#[derive(Clone, Debug)]
pub struct StepTraffic {
    /// The generated kernel's name, or the extern prim's.
    pub name: String,
    /// A generated kernel (else an extern call).
    pub generated: bool,
    pub read: usize,
    pub written: usize,
    /// The shapes it writes.
    pub writes: Vec<Vec<usize>>,
    /// A generated kernel's launch (grid, threads per block) and CUDA C, to read a plan's code
    /// on a machine without a GPU; `None` for an extern call.
    pub launch: Option<([u32; 3], u32, String)>,
}

/// The launches the CUDA target plans for `graph` (rewritten and split as a compile for a
/// device of `sm_count` multiprocessors rewrites it: `codegen::cuda::plan`, the default launch
/// shape, 48 KiB of shared memory per block), in order, with their traffic.
pub fn cuda_traffic(graph: &Graph, sm_count: u32) -> kiln_core::Result<Vec<StepTraffic>> {
    let prepared = prepare(graph)?;
    let (g, planned) = crate::codegen::cuda::plan(&prepared, &Cuda::new(sm_count), false);
    let g: &Graph = &g;
    Ok(planned
        .into_iter()
        .filter_map(|p| match p {
            Planned::Kernel { kernel, outs } => {
                // a launch of several members side by side lists each member's inputs: each
                // member loads its own
                let inputs = &kernel.inputs;
                Some(StepTraffic {
                    name: kernel.name,
                    generated: true,
                    read: inputs.iter().map(|&i| g.nodes[i].nbytes()).sum(),
                    written: outs.iter().map(|&(o, _)| g.nodes[o].nbytes()).sum(),
                    writes: outs
                        .iter()
                        .map(|&(o, _)| g.nodes[o].shape.clone())
                        .collect(),
                    launch: Some((kernel.grid, kernel.block, {
                        // the device functions a horizontal launch calls, then its definition
                        let mut src: String = kernel
                            .device_fns
                            .iter()
                            .map(|(_, def)| format!("{def}\n"))
                            .collect();
                        src.push_str(&kernel.source);
                        src
                    })),
                })
            }
            Planned::Extern { node } => {
                let n = &g.nodes[node];
                let Op::Prim(prim) = &n.op else { return None };
                // views the core makes move nothing
                if g.is_view(node) {
                    return None;
                }
                Some(StepTraffic {
                    name: prim.name().to_string(),
                    generated: false,
                    read: n.args.iter().map(|&a| g.nodes[a].nbytes()).sum(),
                    written: n.nbytes(),
                    writes: vec![n.shape.clone()],
                    launch: None,
                })
            }
        })
        .collect())
}
