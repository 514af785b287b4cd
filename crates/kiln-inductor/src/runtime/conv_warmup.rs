//! A convolution's first execution in a process is slow: CUDA loads cuDNN's kernels lazily, when
//! first launched (a warm start of DenseNet-121's training step spent 137 ms in the first
//! executions of its 359 convolutions, 571 µs a weight gradient where a step spends about 100).
//! While a compile plans and generates its graphs (CPU work on other threads), this runs each
//! distinct convolution of those graphs once, on zeros, through the core's eager kernels: the
//! same cuDNN plans (cached in memory and on disk) the compiled graph's extern steps then find,
//! their kernels already loaded.
//!
//! Best effort: results are dropped, and an error (memory, an unsupported layout) only ends the
//! warm-up; the compiled graph's own call reports whatever is really wrong. The work is queued
//! on the device's stream ahead of the graph's first call, and takes there what the
//! convolutions take in a step.

use std::collections::HashSet;

use kiln_compile::graph::{Graph, Op};
use kiln_core::{Device, Result, Tensor};

/// Whether any of `graphs` runs a convolution on a device (the warm-up has something to do).
pub(crate) fn wanted(graphs: &[&Graph]) -> bool {
    graphs.iter().any(|g| {
        g.device() != Device::Cpu
            && g.nodes
                .iter()
                .any(|n| matches!(&n.op, Op::Prim(p) if p.conv_params().is_some()))
    })
}

/// Runs each distinct convolution of `graphs` (prim and operand shapes) once on zeros, in graph
/// order, stopping at the first error.
pub(crate) fn run(graphs: &[&Graph]) -> Result<()> {
    let mut seen: HashSet<String> = HashSet::new();
    for g in graphs {
        let device = g.device();
        if device == Device::Cpu {
            continue;
        }
        for node in &g.nodes {
            let Op::Prim(p) = &node.op else { continue };
            if p.conv_params().is_none() {
                continue;
            }
            let args: Vec<(&[usize], kiln_core::DType, Device)> = node
                .args
                .iter()
                .map(|&a| {
                    let n = &g.nodes[a];
                    (n.shape.as_slice(), n.dtype, n.device)
                })
                .collect();
            if !seen.insert(format!("{p:?}{args:?}")) {
                continue;
            }
            let operands = args
                .iter()
                .map(|&(shape, dtype, dev)| Tensor::full_on(shape, 0.0, dtype, dev))
                .collect::<Result<Vec<_>>>()?;
            let refs: Vec<&Tensor> = operands.iter().collect();
            drop(kiln_core::dispatch::apply_on(p.clone(), &refs, device)?);
        }
    }
    Ok(())
}
