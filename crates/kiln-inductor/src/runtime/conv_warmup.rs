//! A convolution's first execution in a process is slow: CUDA loads cuDNN's kernels lazily, when
//! first launched (a warm start of DenseNet-121's training step spent 137 ms in the first
//! executions of its 359 convolutions, 571 µs a weight gradient where a step spends about 100).
//! While a compile plans and generates its graphs (CPU work on other threads), this runs each
//! distinct convolution of those graphs once, on zeros, through the core's eager kernels: the
//! same cuDNN plans (cached in memory and on disk) the compiled graph's extern steps then find,
//! their kernels already loaded.
//!
//! A convolution on kiln's generated kernels (`kiln_cuda::set_generated_conv`) is only readied
//! (`DeviceRuntime::prepare` loads its module): nothing of it loads at its first launch. A
//! function's convolutions are also remembered (`encode`), and its next process readies them
//! while the function is still traced, after its units (`codegen/cuda_prefetch.rs`).
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

use kiln_compile::codec::{self, Reader, Writer};
use kiln_compile::graph::{Graph, Op};
use kiln_core::device::{runtime_for, DeviceRuntime};
use kiln_core::prim::Prim;
use kiln_core::{DType, Device, Result, Tensor};

/// One convolution to run: the prim, its operands' shapes and dtypes, and the device.
pub(crate) struct Conv {
    prim: Prim,
    operands: Vec<(Vec<usize>, DType)>,
    device: Device,
}

impl Conv {
    /// Readies this convolution on `rt` (its device's runtime) without running it: true where
    /// it runs on kiln's generated kernels, whose module is now loaded; false where a run is
    /// what readies it (cuDNN loads its kernels at their first run).
    fn ready(&self, rt: &dyn DeviceRuntime) -> Result<bool> {
        let shapes: Vec<&[usize]> = self.operands.iter().map(|(s, _)| s.as_slice()).collect();
        let dtypes: Vec<DType> = self.operands.iter().map(|&(_, d)| d).collect();
        rt.prepare(self.device, &self.prim, &shapes, &dtypes)
    }
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
        if !tuned && c.ready(runtime_for("conv2d", c.device)?.as_ref())? {
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

/// Readies on `rt` (their device's runtime) each of `convs` that runs on kiln's generated
/// kernels (loads its module), running nothing: what cuDNN runs is left to `run`. Best effort:
/// errors are dropped.
pub(crate) fn prepare(rt: &dyn DeviceRuntime, convs: &[Conv]) {
    for c in convs {
        let _ = c.ready(rt);
    }
}

/// `convs` as text, one line each: the prim and its operands' shapes and dtypes (`codec`), in
/// hex. The device is not written: a manifest names it.
pub(crate) fn encode(convs: &[Conv]) -> Vec<String> {
    convs
        .iter()
        .map(|c| {
            let mut w = Writer::default();
            codec::prim(&mut w, &c.prim, codec::Seeds::Zero);
            w.usize(c.operands.len());
            for (shape, dtype) in &c.operands {
                w.usizes(shape);
                codec::dtype(&mut w, *dtype);
            }
            w.bytes.iter().map(|b| format!("{b:02x}")).collect()
        })
        .collect()
}

/// The convolutions `lines` (`encode`) on `device`; damaged lines are skipped.
pub(crate) fn decode<'a>(lines: impl IntoIterator<Item = &'a str>, device: Device) -> Vec<Conv> {
    let one = |line: &str| -> Option<Conv> {
        let hex = line.trim().as_bytes();
        if hex.is_empty() || hex.len() % 2 != 0 {
            return None;
        }
        let bytes: Vec<u8> = hex
            .chunks(2)
            .map(|p| u8::from_str_radix(std::str::from_utf8(p).ok()?, 16).ok())
            .collect::<Option<_>>()?;
        let mut r = Reader::new(&bytes);
        let prim = codec::read_prim(&mut r)?;
        let n = r.count()?;
        let operands = (0..n)
            .map(|_| Some((r.usizes()?, codec::read_dtype(&mut r)?)))
            .collect::<Option<Vec<_>>>()?;
        r.done().then_some(Conv {
            prim,
            operands,
            device,
        })
    };
    lines.into_iter().filter_map(one).collect()
}

#[cfg(test)]
impl Conv {
    /// A stride-1, padding-1 channels-last convolution of operands `shapes` (f32) on `device`.
    pub(crate) fn of(shapes: &[&[usize]], device: Device) -> Conv {
        Conv {
            prim: Prim::Conv2d(kiln_core::prim::ConvParams {
                stride: [1, 1],
                padding: [1, 1],
                dilation: [1, 1],
                groups: 1,
                channels_last: true,
            }),
            operands: shapes.iter().map(|s| (s.to_vec(), DType::F32)).collect(),
            device,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Convolutions written as lines read back as written, on the device the reader names;
    /// damaged lines are skipped.
    #[test]
    fn remembered_convolutions_read_back() {
        let convs = [
            Conv::of(&[&[2, 8, 8, 16], &[32, 3, 3, 16]], Device::Cuda(0)),
            Conv::of(&[&[4, 7, 7, 64], &[64, 1, 1, 64]], Device::Cuda(0)),
        ];
        let mut lines = encode(&convs);
        lines.insert(1, "zz".into());
        lines.push(lines[0][..lines[0].len() - 2].to_string());
        lines.push("abc".into());
        let back = decode(lines.iter().map(String::as_str), Device::Cuda(1));
        assert_eq!(back.len(), 2);
        for (b, c) in back.iter().zip(&convs) {
            assert_eq!(format!("{:?}", b.prim), format!("{:?}", c.prim));
            assert_eq!(b.operands, c.operands);
            assert_eq!(b.device, Device::Cuda(1));
        }
    }
}
