//! A convolution's first execution in a process is slow: CUDA loads cuDNN's kernels lazily, when
//! first launched (a warm start of DenseNet-121's training step spent 137 ms in the first
//! executions of its 359 convolutions, 571 µs a weight gradient where a step spends about 100).
//! While a compile plans and generates its graphs (CPU work on other threads), this runs each
//! distinct convolution of those graphs once, on zeros, through the core's eager kernels: the
//! same cuDNN plans (cached in memory and on disk) the compiled graph's extern steps then find,
//! their kernels already loaded.
//!
//! First the compiled function's engine is chosen (`DeviceRuntime::generated_convs`: kiln-cuda
//! times its generated kernels against cuDNN once per function, where it has many distinct
//! convolutions, and remembers the choice on disk). A convolution on kiln's generated kernels is
//! only readied (`DeviceRuntime::prepare` loads its module): nothing of it loads at its first
//! launch. A function's convolutions are also remembered (`encode`, with the engine chosen), and
//! its next process readies those on kiln's kernels while the function is still traced, after
//! its units (`codegen/cuda_prefetch.rs`).
//!
//! In max-autotune the convolutions run tuned (`exec::execute_routed`, `Route::Tuned`), as the
//! graph's steps will: each shape's cuDNN engines are timed here, off the compile's critical
//! path, and the graph's first call (or its CUDA graph's recording, when nothing can be timed)
//! finds the fastest plan chosen.
//!
//! Best effort: results are dropped, and an error (memory, an unsupported layout) only ends the
//! warm-up; the compiled graph's own call reports whatever is really wrong. The work is queued
//! on the device's stream ahead of the graph's first call, and takes there what the
//! convolutions take in a step.

use std::collections::HashMap;

use kiln_compile::codec::{self, Reader, Writer};
use kiln_compile::graph::{Graph, Op};
use kiln_core::device::{runtime_for, ConvUse, DeviceRuntime, Route};
use kiln_core::prim::Prim;
use kiln_core::{DType, Device, Result, Tensor};

/// One convolution to run: the prim, its operands' shapes and dtypes and how many times the
/// graphs run it, the device, and whether it runs on the runtime's generated kernels.
pub(crate) struct Conv {
    conv: ConvUse,
    device: Device,
    /// The compiled function's choice (`choose`); what a remembered line says (`encode`).
    generated: bool,
}

impl Conv {
    /// Readies this convolution on `rt` (its device's runtime) without running it: true where
    /// it runs on kiln's generated kernels, whose module is now loaded; false where a run is
    /// what readies it (cuDNN loads its kernels at their first run).
    fn ready(&self, rt: &dyn DeviceRuntime) -> Result<bool> {
        let route = match self.generated {
            true => Route::Generated,
            false => Route::Eager,
        };
        let (shapes, dtypes) = (self.conv.shapes(), self.conv.dtypes());
        rt.prepare(self.device, &self.conv.prim, &shapes, &dtypes, route)
    }
}

/// The distinct convolutions (prim and operand shapes) `graphs` run on a device, in graph order,
/// each with how many times the graphs run it.
pub(crate) fn distinct(graphs: &[&Graph]) -> Vec<Conv> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out: Vec<Conv> = Vec::new();
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
            let at = *seen.entry(format!("{p:?}{operands:?}")).or_insert_with(|| {
                out.push(Conv {
                    conv: ConvUse {
                        prim: p.clone(),
                        operands,
                        count: 0,
                    },
                    device,
                    generated: false,
                });
                out.len() - 1
            });
            out[at].conv.count += 1;
        }
    }
    out
}

/// The compiled function's engine for `convs` (all on one device; not under max-autotune, which
/// chooses per convolution by running them), marked on each: `true` where they run on the
/// runtime's generated kernels. Decided by the runtime (`DeviceRuntime::generated_convs`,
/// timing them if nothing was decided before); best effort: an error leaves the default's.
pub(crate) fn choose(convs: &mut [Conv]) -> bool {
    let Some(device) = convs.first().map(|c| c.device) else {
        return false;
    };
    let uses: Vec<&ConvUse> = convs.iter().map(|c| &c.conv).collect();
    let generated = runtime_for("conv2d", device)
        .and_then(|rt| rt.generated_convs(device, &uses))
        .unwrap_or(false);
    for c in convs.iter_mut() {
        c.generated = generated;
    }
    generated
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
        let operands = c.conv.zeros_on(c.device)?;
        let refs: Vec<&Tensor> = operands.iter().collect();
        drop(match tuned {
            true => super::exec::execute_routed(&c.conv.prim, &refs, c.device, Route::Tuned)?,
            false => kiln_core::dispatch::apply_on(c.conv.prim.clone(), &refs, c.device)?,
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

/// `convs` as text, one line each: the prim, its operands' shapes and dtypes, and whether it
/// runs on the runtime's generated kernels (`codec`), in hex. The device is not written: a
/// manifest names it; nor the count, which only the choice weighs.
pub(crate) fn encode(convs: &[Conv]) -> Vec<String> {
    convs
        .iter()
        .map(|c| {
            let mut w = Writer::default();
            codec::prim(&mut w, &c.conv.prim, codec::Seeds::Zero);
            w.usize(c.conv.operands.len());
            for (shape, dtype) in &c.conv.operands {
                w.usizes(shape);
                codec::dtype(&mut w, *dtype);
            }
            w.usize(c.generated as usize);
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
        let generated = match r.usize()? {
            0 => false,
            1 => true,
            _ => return None,
        };
        r.done().then_some(Conv {
            conv: ConvUse {
                prim,
                operands,
                count: 1,
            },
            device,
            generated,
        })
    };
    lines.into_iter().filter_map(one).collect()
}

#[cfg(test)]
impl Conv {
    /// The geometry of the tests' convolutions: stride 1, padding 1, channels-last.
    pub(crate) fn same_padding() -> kiln_core::prim::ConvParams {
        kiln_core::prim::ConvParams {
            stride: [1, 1],
            padding: [1, 1],
            dilation: [1, 1],
            groups: 1,
            channels_last: true,
        }
    }

    /// A `same_padding` convolution of operands `shapes` (f32) on `device`.
    pub(crate) fn of(shapes: &[&[usize]], device: Device) -> Conv {
        Conv {
            conv: ConvUse {
                prim: Prim::Conv2d(Conv::same_padding()),
                operands: shapes.iter().map(|s| (s.to_vec(), DType::F32)).collect(),
                count: 1,
            },
            device,
            generated: false,
        }
    }
}

#[cfg(test)]
impl Conv {
    /// This convolution as a function that chose kiln's generated kernels runs it.
    pub(crate) fn on_generated(mut self) -> Conv {
        self.generated = true;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Convolutions written as lines read back as written, the engine chosen with them, on the
    /// device the reader names; damaged lines are skipped.
    #[test]
    fn remembered_convolutions_read_back() {
        let convs = [
            Conv::of(&[&[2, 8, 8, 16], &[32, 3, 3, 16]], Device::Cuda(0)),
            Conv::of(&[&[4, 7, 7, 64], &[64, 1, 1, 64]], Device::Cuda(0)).on_generated(),
        ];
        let mut lines = encode(&convs);
        lines.insert(1, "zz".into());
        lines.push(lines[0][..lines[0].len() - 2].to_string());
        lines.push("abc".into());
        let back = decode(lines.iter().map(String::as_str), Device::Cuda(1));
        assert_eq!(back.len(), 2);
        for (b, c) in back.iter().zip(&convs) {
            assert_eq!(format!("{:?}", b.conv.prim), format!("{:?}", c.conv.prim));
            assert_eq!(b.conv.operands, c.conv.operands);
            assert_eq!(b.device, Device::Cuda(1));
            assert_eq!(b.generated, c.generated);
        }
    }

    /// A graph's convolutions are listed once per prim and operand shapes, each with how many
    /// times the graphs run it: what the function's choice weighs them by.
    #[test]
    fn distinct_convolutions_are_counted() {
        use crate::test_graphs::{input, push};
        let conv = Op::Prim(Prim::Conv2d(Conv::same_padding()));
        let mut g = Graph::default();
        let x = input(&mut g, &[2, 8, 8, 16]);
        let (w16, w32) = (
            input(&mut g, &[16, 3, 3, 16]),
            input(&mut g, &[32, 3, 3, 16]),
        );
        let y = push(&mut g, conv.clone(), vec![x, w16], &[2, 8, 8, 16]);
        let z = push(&mut g, conv.clone(), vec![y, w16], &[2, 8, 8, 16]);
        push(&mut g, conv.clone(), vec![x, w32], &[2, 8, 8, 32]);
        push(&mut g, conv, vec![z, w16], &[2, 8, 8, 16]);
        let convs = distinct(&[&g, &g]);
        let counts: Vec<(usize, usize)> = convs
            .iter()
            .map(|c| (c.conv.operands[1].0[0], c.conv.count))
            .collect();
        // three 16-filter convolutions of one input shape, one 32-filter one, in each graph
        assert_eq!(counts, [(16, 6), (32, 2)]);
        assert!(convs
            .iter()
            .all(|c| c.device == Device::Cuda(0) && !c.generated));
    }
}
