//! A convolution's first execution in a process is slow: CUDA loads cuDNN's kernels lazily, when
//! first launched (a warm start of DenseNet-121's training step spent 137 ms in the first
//! executions of its 359 convolutions, 571 µs a weight gradient where a step spends about 100).
//! While a compile plans and generates its graphs (CPU work on other threads), this runs each
//! distinct convolution of those graphs once, on zeros, through the core's eager kernels: the
//! same cuDNN plans (cached in memory and on disk) the compiled graph's extern steps then find,
//! their kernels already loaded.
//!
//! A convolution on kiln's generated kernels (`kiln_cuda::set_generated_conv`) is only readied
//! (`DeviceRuntime::prepare` loads its module): nothing of it loads at its first launch.
//!
//! In max-autotune the convolutions run tuned (`exec::execute_tuned`), as the graph's steps
//! will: each shape's cuDNN engines are timed here, off the compile's critical path, and the
//! graph's first call (or its CUDA graph's recording, when nothing can be timed) finds the
//! fastest plan chosen.
//!
//! Best effort: results are dropped, and an error (memory, an unsupported layout) only ends the
//! warm-up; the compiled graph's own call reports whatever is really wrong. The work is queued
//! on the device's stream ahead of the graph's first call, and takes there what the
//! convolutions take in a step.

use std::collections::HashSet;

use kiln_compile::graph::{Graph, Op};
use kiln_core::device::runtime_for;
use kiln_core::prim::Prim;
use kiln_core::{DType, Device, Result, Tensor};

/// One convolution to run: the prim, its operands' shapes and dtypes, and the device.
pub(crate) struct Conv {
    prim: Prim,
    operands: Vec<(Vec<usize>, DType)>,
    device: Device,
}

/// The distinct convolutions (prim and operand shapes) `graphs` run on a device, in graph order.
pub(crate) fn distinct(graphs: &[&Graph]) -> Vec<Conv> {
    let mut seen: HashSet<String> = HashSet::new();
    let mut out = Vec::new();
    for g in graphs {
        let device = g.device();
        if device == Device::Cpu {
            continue;
        }
        for node in &g.nodes {
            let Op::Prim(p) = &node.op else { continue };
            if p.conv_params().is_none() && !matches!(p, Prim::Conv2dEpilogue { .. }) {
                continue;
            }
            let operands: Vec<(Vec<usize>, DType)> = node
                .args
                .iter()
                .map(|&a| (g.nodes[a].shape.clone(), g.nodes[a].dtype))
                .collect();
            if seen.insert(format!("{p:?}{operands:?}")) {
                out.push(Conv {
                    prim: p.clone(),
                    operands,
                    device,
                });
            }
        }
    }
    out
}

/// Runs each of `convs` once on zeros (`tuned`: as max-autotune's steps run them), stopping
/// at the first error.
pub(crate) fn run(convs: &[Conv], tuned: bool) -> Result<()> {
    let _span = kiln_core::profiler::span(kiln_core::profiler::Category::Compile, || {
        format!(
            "inductor: {} convolutions run once (cuDNN warm-up)",
            convs.len()
        )
        .into()
    });
    for c in convs {
        // a convolution on kiln's generated kernels needs its module loaded, not a run (which
        // would queue a step's worth of convolutions ahead of the graph's first call)
        let shapes: Vec<&[usize]> = c.operands.iter().map(|(s, _)| s.as_slice()).collect();
        let dtypes: Vec<DType> = c.operands.iter().map(|&(_, d)| d).collect();
        if !tuned
            && runtime_for("conv2d", c.device)?.prepare(c.device, &c.prim, &shapes, &dtypes)?
        {
            continue;
        }
        let operands = c
            .operands
            .iter()
            .map(|(shape, dtype)| Tensor::full_on(shape, 0.0, *dtype, c.device))
            .collect::<Result<Vec<_>>>()?;
        let refs: Vec<&Tensor> = operands.iter().collect();
        drop(match tuned {
            true => super::exec::execute_tuned(&c.prim, &refs, c.device)?,
            false => kiln_core::dispatch::apply_on(c.prim.clone(), &refs, c.device)?,
        });
    }
    Ok(())
}
