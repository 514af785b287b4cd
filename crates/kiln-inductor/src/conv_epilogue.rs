//! Convolution epilogues: what follows a convolution in an inference network — an eval-mode
//! batch norm's per-channel scale and shift, a Conv2d's bias, a ResNet block's skip connection,
//! a ReLU or tanh-GELU — computed by the convolution's own call (`Prim::Conv2dEpilogue`), so its
//! result is written once instead of written, read and written again by a generated kernel.
//! PyTorch's Inductor leaves these to a generated kernel after `aten.convolution`.
//!
//! The pattern: a `conv2d`, then `mul(_, expand(scale))`, `add(_, expand(shift))` (per-channel
//! values broadcast over N, H and W), `add(_, residual)` (a value of the output's shape) and an
//! activation (`epilogue::activation_of`), each optional but at least one. A value inside the
//! pattern that anything else reads, or that the graph returns, ends it. Which convolutions a
//! target takes is its `Fuser`:
//!
//! On the CPU (`fuse_cpu`, every mode): NCHW, any groups, f32 or f64. The prim is the core's
//! im2col + GEMM convolution finishing each image's output right after its GEMM, while the image
//! is in cache (`kiln_core`'s `cpu/epilogue.rs`), computing what the ops compute bit for bit and
//! costing no plan. ResNet-18 at batch 16 on two cores: about a fifth off the compiled call
//! (BENCHMARKS.md).
//!
//! On a device (`fuse`, after the channels-last layout pass, `channels_last.rs`): one cuDNN
//! operation graph, the convolution then pointwise operations on its accumulator. cuDNN fuses
//! these graphs only with engines it compiles at run time (NVRTC inside cuDNN): each distinct
//! fused convolution costs 0.3-2.2 s of plan making on the H200 machine, against a few
//! milliseconds for a plain convolution's plan, and the fused kernels are not faster everywhere
//! (the measurements are in BENCHMARKS.md). That is max-autotune's trade — compile time for call
//! time — so there the pass runs for the max-autotune modes only (`cuda_compile.rs`), not for
//! default or reduce-overhead, whose compiles stay in milliseconds. It needs a channels-last
//! convolution (cuDNN fuses NHWC tensors only), one group, f32 with cuDNN's TF32 switch on (its
//! default; with it off, only a bias alone fuses), f16 or bf16, and at least
//! `MIN_INPUT_CHANNELS` input channels. Where cuDNN still refuses a case, the prim runs as the
//! convolution and then the ops it stands for (`kiln_core::ops::epilogue`). What it computes
//! there: cuDNN's pointwise steps run in f32 on the accumulator, so a half-precision result is
//! rounded once, where eager execution rounds after each op; cuDNN's ReLU is `max(x, 0)`, which
//! turns a NaN into 0 where eager's `relu` keeps it.
//!
//! `KILN_CONV_EPILOGUES=0` turns the pass off on every target.

use kiln_compile::graph::{Graph, Node, NodeId, Op};
use kiln_core::backends::{self, Switch};
use kiln_core::prim::{Activation, BinaryOp, ConvEpilogue, ConvParams, Prim};
use kiln_core::DType;

use crate::epilogue::{activation_of, bias_of};
use crate::matchers::Uses;
use crate::replace::{as_vector, replace};

/// Fewest input channels a fused convolution reads. ResNet's stem (3 channels, 7x7, stride 2,
/// batch 16 at 224x224) ran 423 µs fused against 110 µs for the plain convolution in f32 (TF32)
/// on the H200 machine, 207 against 49 µs in f16; the 3x3 convolutions of 64 channels and more
/// ran within a few microseconds of their plain convolutions.
const MIN_INPUT_CHANNELS: usize = 16;

/// One convolution and what it absorbs.
struct Fused {
    /// The value the epilogue call produces: the last op absorbed.
    last: NodeId,
    x: NodeId,
    w: NodeId,
    params: ConvParams,
    /// Nodes of C values each, in channel order (reshaped to `[C]` if need be).
    scale: Option<NodeId>,
    shift: Option<NodeId>,
    residual: Option<NodeId>,
    act: Activation,
}

/// `node` as `op(cur, other)` or `op(other, cur)`: the other operand.
fn other_operand(node: &Node, op: BinaryOp, cur: NodeId) -> Option<NodeId> {
    if !matches!(node.op, Op::Prim(Prim::Binary(o)) if o == op) {
        return None;
    }
    match node.args[..] {
        [a, b] if a == cur => Some(b),
        [a, b] if b == cur => Some(a),
        _ => None,
    }
}

/// Which convolutions a target fuses, and where their channels are.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fuser {
    /// cuDNN's operation graphs: channels-last, one group, f32 (with cuDNN's TF32 switch, as
    /// `fusable` says), f16 or bf16, at least `MIN_INPUT_CHANNELS` input channels.
    Cudnn { tf32: bool },
    /// The CPU's im2col + GEMM convolution (`kiln_core`'s `cpu/conv.rs`), which finishes each
    /// image's output after its GEMM: NCHW, any groups, f32 or f64.
    Cpu,
}

impl Fuser {
    /// The dim of a convolution's output that holds its channels.
    fn channel_dim(self) -> usize {
        match self {
            Fuser::Cudnn { .. } => 3,
            Fuser::Cpu => 1,
        }
    }

    /// Whether this target fuses anything after `conv` (its params, dtype and input `x`).
    fn takes(self, params: &ConvParams, dtype: DType, x: &Node) -> bool {
        match self {
            Fuser::Cudnn { .. } => {
                let input_channels = x.shape.last().copied().unwrap_or(0);
                params.channels_last
                    && params.groups == 1
                    && matches!(dtype, DType::F32 | DType::F16 | DType::BF16)
                    && input_channels >= MIN_INPUT_CHANNELS
            }
            Fuser::Cpu => !params.channels_last && matches!(dtype, DType::F32 | DType::F64),
        }
    }
}

/// The node holding C values that `id` broadcasts along every dim of a rank-4 value but `dim`
/// (of size C), when it is such a broadcast: `expand(v)` where `v` is `[1, C, 1, 1]` for dim 1
/// (a Conv2d's bias and eval batch norm's scale and shift in NCHW), or `[.., 1, C]` for the last.
fn per_channel(g: &Graph, id: NodeId, channels: usize, dim: usize) -> Option<NodeId> {
    let node = &g.nodes[id];
    if dim + 1 == node.shape.len() {
        return bias_of(g, id, channels);
    }
    let Op::Prim(Prim::Expand(_)) = node.op else {
        return None;
    };
    let v = node.args[0];
    let s = &g.nodes[v].shape;
    let one_channel_dim = s.len() == node.shape.len()
        && node.shape.get(dim) == Some(&channels)
        && s.iter()
            .enumerate()
            .all(|(d, &n)| n == if d == dim { channels } else { 1 });
    one_channel_dim.then_some(v)
}

/// The epilogue pattern that starts at convolution `conv`, if there is one.
fn pattern(g: &Graph, uses: &Uses, conv: NodeId, fuser: Fuser) -> Option<Fused> {
    let node = &g.nodes[conv];
    let Op::Prim(Prim::Conv2d(params)) = node.op else {
        return None;
    };
    let x = node.args[0];
    if !fuser.takes(&params, node.dtype, &g.nodes[x]) {
        return None;
    }
    let dim = fuser.channel_dim();
    let channels = *node.shape.get(dim)?;
    let alike = |v: NodeId| g.nodes[v].dtype == node.dtype && g.nodes[v].device == node.device;
    let mut cur = conv;
    // `op(cur, per-channel values)` as `cur`'s only reader: absorbed, its values returned
    let absorb = |op: BinaryOp, cur: &mut NodeId| -> Option<NodeId> {
        let r = uses.only_reader(*cur)?;
        let v = other_operand(&g.nodes[r], op, *cur)
            .and_then(|o| per_channel(g, o, channels, dim))
            .filter(|&v| alike(v))?;
        *cur = r;
        Some(v)
    };
    let scale = absorb(BinaryOp::Mul, &mut cur);
    let shift = absorb(BinaryOp::Add, &mut cur);
    // the skip connection joins the convolution of the two branches that comes later in the
    // graph: a ResNet downsampling block's 1x1 convolution and its batch norm would otherwise
    // end at the same add as the main branch's, and one of the two patterns would be lost
    let residual = uses.only_reader(cur).and_then(|r| {
        let o = other_operand(&g.nodes[r], BinaryOp::Add, cur)?;
        let full = g.nodes[o].shape == node.shape && alike(o) && o < conv;
        full.then(|| {
            cur = r;
            o
        })
    });
    let (act, last) = activation_of(g, uses, cur);
    if scale.is_none() && shift.is_none() && residual.is_none() && act == Activation::None {
        return None;
    }
    Some(Fused {
        last,
        x,
        w: node.args[1],
        params,
        scale,
        shift,
        residual,
        act,
    })
}

/// Whether the pass runs: unless `KILN_CONV_EPILOGUES=0`.
fn enabled() -> bool {
    std::env::var("KILN_CONV_EPILOGUES").as_deref() != Ok("0")
}

/// Whether the target runs `f` fused in `dtype`. cuDNN: f32 held to FMA math (cuDNN's TF32
/// switch off) has fused engines for a bias alone (gpu_ops' `conv_cudnn_epilogues` on
/// nvidia-h200), and anything else would run as the convolution and then eager ops, slower than
/// the generated kernel. The CPU's kernel fuses every epilogue.
fn fusable(f: &Fused, dtype: DType, fuser: Fuser) -> bool {
    let bias_alone =
        f.scale.is_none() && f.residual.is_none() && f.act == Activation::None && f.shift.is_some();
    match fuser {
        Fuser::Cudnn { tf32 } => dtype != DType::F32 || tf32 || bias_alone,
        Fuser::Cpu => true,
    }
}

/// `g` (a CUDA graph after the channels-last rewrite) with its convolution epilogues fused, or
/// `None` when it has none (or the pass is off). Reads cuDNN's TF32 switch, which compiled
/// functions guard on (`kiln_core::backends`).
pub fn fuse(g: &Graph) -> Option<Graph> {
    fuse_for(
        g,
        Fuser::Cudnn {
            tf32: backends::get(Switch::CudnnTf32),
        },
    )
}

/// `g` (a CPU graph) with its NCHW convolution epilogues fused, or `None` when it has none (or
/// the pass is off). The CPU's kernel computes what the ops compute bit for bit, and costs no
/// plan: every mode takes it.
pub fn fuse_cpu(g: &Graph) -> Option<Graph> {
    fuse_for(g, Fuser::Cpu)
}

fn fuse_for(g: &Graph, fuser: Fuser) -> Option<Graph> {
    if !enabled() {
        return None;
    }
    let found = |uses: &Uses, conv: NodeId| {
        pattern(g, uses, conv, fuser)
            .filter(|f| fusable(f, g.nodes[conv].dtype, fuser))
            .map(|f| (f.last, f))
    };
    replace(g, found, |out, map, node, f: Fused| {
        let channels = node.shape.get(fuser.channel_dim()).copied().unwrap_or(0);
        let mut args = vec![map[f.x], map[f.w]];
        for v in [f.scale, f.shift].into_iter().flatten() {
            args.push(as_vector(out, map[v], channels));
        }
        args.extend(f.residual.map(|r| map[r]));
        let epilogue = ConvEpilogue {
            scale: f.scale.is_some(),
            shift: f.shift.is_some(),
            residual: f.residual.is_some(),
            act: f.act,
        };
        out.push(Node {
            op: Op::Prim(Prim::Conv2dEpilogue {
                params: f.params,
                epilogue,
            }),
            args,
            ..node.clone()
        })
    })
}

#[cfg(test)]
mod tests {
    use kiln_core::{Result, RunningStats, Tensor};

    use super::*;
    use crate::test_graphs::rewritten_bitwise;

    fn epilogues(g: &Graph) -> Vec<ConvEpilogue> {
        g.nodes
            .iter()
            .filter_map(|n| match n.op {
                Op::Prim(Prim::Conv2dEpilogue { epilogue, .. }) => Some(epilogue),
                _ => None,
            })
            .collect()
    }

    /// The graph as a device compile sees it: channels-last, then fused.
    fn rewritten(g: &Graph) -> Graph {
        let nhwc = crate::channels_last::rewrite(g);
        fuse(&nhwc).unwrap_or(nhwc)
    }

    /// `f`'s fused epilogues, after checking that the rewritten graph computes what `f`
    /// computes eagerly, bit for bit (the CPU computes the fused prim as the ops it stands for).
    fn fused(
        f: impl Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + Clone + 'static,
        args: &[Tensor],
    ) -> Result<Vec<ConvEpilogue>> {
        Ok(epilogues(&rewritten_bitwise(f, args, rewritten)?))
    }

    /// Eval-mode batch norm of `x` with the statistics and affine in `p[0..4]`.
    fn bn(x: &Tensor, p: &[Tensor]) -> Result<Tensor> {
        let stats = RunningStats {
            mean: &p[0],
            var: &p[1],
            momentum: 0.1,
        };
        x.batch_norm(Some(&p[2]), Some(&p[3]), Some(stats), false, 1e-5)
    }

    fn conv3(x: &Tensor, w: &Tensor) -> Result<Tensor> {
        x.conv2d(w, None, [1, 1], [1, 1], [1, 1], 1)
    }

    /// x, two 3x3 weights of 16 channels, and two batch norms' mean, var, weight, bias.
    fn block_args() -> Result<Vec<Tensor>> {
        let c = 16;
        let mut v = vec![
            Tensor::randn(&[2, c, 6, 6], DType::F32)?,
            Tensor::randn(&[c, c, 3, 3], DType::F32)?.mul(0.1)?,
            Tensor::randn(&[c, c, 3, 3], DType::F32)?.mul(0.1)?,
        ];
        for _ in 0..2 {
            v.push(Tensor::randn(&[c], DType::F32)?);
            v.push(Tensor::rand(&[c], DType::F32)?.add(0.5)?);
            v.push(Tensor::randn(&[c], DType::F32)?);
            v.push(Tensor::randn(&[c], DType::F32)?);
        }
        Ok(v)
    }

    fn conv3_bias(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
        x.conv2d(w, Some(b), [1, 1], [1, 1], [1, 1], 1)
    }

    /// A Conv2d's bias alone.
    const BIAS: ConvEpilogue = ConvEpilogue {
        scale: false,
        shift: true,
        residual: false,
        act: Activation::None,
    };

    const BN_RELU: ConvEpilogue = ConvEpilogue {
        scale: true,
        shift: true,
        residual: false,
        act: Activation::Relu,
    };

    /// A ResNet basic block in eval mode: `relu(bn(conv(relu(bn(conv(x))))) + x)` is two calls,
    /// the second with the skip connection.
    #[test]
    fn a_resnet_block_is_two_calls() -> Result<()> {
        let got = fused(
            |a: &[Tensor]| {
                let h = bn(&conv3(&a[0], &a[1])?, &a[3..7])?.relu()?;
                let h = bn(&conv3(&h, &a[2])?, &a[7..11])?;
                Ok(vec![h.add(&a[0])?.relu()?])
            },
            &block_args()?,
        )?;
        let with_skip = ConvEpilogue {
            residual: true,
            ..BN_RELU
        };
        assert_eq!(got, [BN_RELU, with_skip]);
        Ok(())
    }

    /// A downsampling block: `relu(bn(conv(h)) + bn(conv1x1(x)))`. The skip connection joins
    /// the later of the two convolutions (the 1x1 one): both end at that add otherwise, and one
    /// of them was left unfused. On the CPU and on a device alike.
    #[test]
    fn a_downsampling_block_fuses_all_three() -> Result<()> {
        let block = |a: &[Tensor]| -> Result<Vec<Tensor>> {
            let s2 = |x: &Tensor, w: &Tensor| x.conv2d(w, None, [2, 2], [1, 1], [1, 1], 1);
            let h = bn(&s2(&a[0], &a[1])?, &a[3..7])?.relu()?;
            let h = bn(&conv3(&h, &a[2])?, &a[7..11])?;
            let w1 = a[2].narrow(2, 0, 1)?.narrow(3, 0, 1)?;
            let down = a[0].conv2d(&w1, None, [2, 2], [0, 0], [1, 1], 1)?;
            Ok(vec![h.add(&bn(&down, &a[3..7])?)?.relu()?])
        };
        let bn_only = ConvEpilogue {
            act: Activation::None,
            ..BN_RELU
        };
        let with_skip = ConvEpilogue {
            residual: true,
            ..BN_RELU
        };
        let want = [BN_RELU, bn_only, with_skip];
        let mut a = block_args()?;
        assert_eq!(fused(block, &a)?, want);
        // one image: another graph, which the compiled-graph cache has not seen
        a[0] = a[0].narrow(0, 0, 1)?;
        assert_eq!(fused_cpu(block, &a)?, want);
        Ok(())
    }

    /// A Conv2d's bias and a tanh-GELU; a bias alone.
    #[test]
    fn a_bias_and_an_activation() -> Result<()> {
        let got = fused(
            |a: &[Tensor]| {
                let h = conv3_bias(&a[0], &a[1], &a[3])?;
                let h = h.gelu_tanh()?;
                Ok(vec![conv3_bias(&h, &a[2], &a[4])?])
            },
            &block_args()?,
        )?;
        let gelu = ConvEpilogue {
            act: Activation::GeluTanh,
            ..BIAS
        };
        assert_eq!(got, [gelu, BIAS]);
        Ok(())
    }

    /// With cuDNN's TF32 switch off, f32 keeps its generated kernels but for a bias alone (what
    /// cuDNN fuses in FMA math).
    #[test]
    fn without_tf32_only_a_bias_fuses() -> Result<()> {
        let without_tf32 = |g: &Graph| {
            let nhwc = crate::channels_last::rewrite(g);
            fuse_for(&nhwc, Fuser::Cudnn { tf32: false }).unwrap_or(nhwc)
        };
        let a = block_args()?;
        let g = rewritten_bitwise(
            |a: &[Tensor]| {
                let h = bn(&conv3(&a[0], &a[1])?, &a[3..7])?.relu()?;
                Ok(vec![conv3_bias(&h, &a[2], &a[4])?])
            },
            &a,
            without_tf32,
        )?;
        assert_eq!(epilogues(&g), [BIAS]);
        Ok(())
    }

    /// What stays apart: a stem of 3 input channels (cuDNN's fused engine is slower there), a
    /// convolution whose result the graph also returns, a training-mode batch norm (its
    /// statistics read the convolution's result), grouped convolutions.
    #[test]
    fn what_stays_apart() -> Result<()> {
        let a = block_args()?;
        let stem = |a: &[Tensor]| -> Result<Vec<Tensor>> {
            let x = a[0].narrow(1, 0, 3)?;
            let w = a[1].narrow(1, 0, 3)?;
            Ok(vec![bn(&conv3(&x, &w)?, &a[3..7])?.relu()?])
        };
        assert_eq!(fused(stem, &a)?, []);
        let returned = |a: &[Tensor]| -> Result<Vec<Tensor>> {
            let y = conv3(&a[0], &a[1])?;
            Ok(vec![bn(&y, &a[3..7])?.relu()?, y])
        };
        assert_eq!(fused(returned, &a)?, []);
        let training = |a: &[Tensor]| -> Result<Vec<Tensor>> {
            let y = conv3(&a[0], &a[1])?;
            Ok(vec![y
                .batch_norm(Some(&a[5]), Some(&a[6]), None, true, 1e-5)?
                .relu()?])
        };
        assert_eq!(fused(training, &a)?, []);
        let grouped = |a: &[Tensor]| -> Result<Vec<Tensor>> {
            let w = a[1].narrow(1, 0, 8)?;
            let y = a[0].conv2d(&w, None, [1, 1], [1, 1], [1, 1], 2)?;
            Ok(vec![bn(&y, &a[3..7])?.relu()?])
        };
        assert_eq!(fused(grouped, &a)?, []);
        Ok(())
    }

    /// The CPU's form: NCHW convolutions, fused by `fuse_cpu`.
    fn fused_cpu(
        f: impl Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + Clone + 'static,
        args: &[Tensor],
    ) -> Result<Vec<ConvEpilogue>> {
        let on_cpu = |g: &Graph| fuse_cpu(g).unwrap_or_else(|| g.clone());
        Ok(epilogues(&rewritten_bitwise(f, args, on_cpu)?))
    }

    /// On the CPU a ResNet block, a bias with a GELU, the 3-channel stem and grouped
    /// convolutions fuse (the CPU kernel has no engine to choose); a training-mode batch norm
    /// and a returned convolution stay apart. Bit for bit as eager, through the CPU's kernel.
    #[test]
    fn on_the_cpu() -> Result<()> {
        let a = block_args()?;
        let block = |a: &[Tensor]| -> Result<Vec<Tensor>> {
            let h = bn(&conv3(&a[0], &a[1])?, &a[3..7])?.relu()?;
            let h = bn(&conv3(&h, &a[2])?, &a[7..11])?;
            Ok(vec![h.add(&a[0])?.relu()?])
        };
        let with_skip = ConvEpilogue {
            residual: true,
            ..BN_RELU
        };
        assert_eq!(fused_cpu(block, &a)?, [BN_RELU, with_skip]);
        let gelu = |a: &[Tensor]| -> Result<Vec<Tensor>> {
            let h = conv3_bias(&a[0], &a[1], &a[3])?.gelu_tanh()?;
            Ok(vec![conv3_bias(&h, &a[2], &a[4])?])
        };
        let gelu_bias = ConvEpilogue {
            act: Activation::GeluTanh,
            ..BIAS
        };
        assert_eq!(fused_cpu(gelu, &a)?, [gelu_bias, BIAS]);
        let stem_and_groups = |a: &[Tensor]| -> Result<Vec<Tensor>> {
            let x = a[0].narrow(1, 0, 3)?;
            let stem = bn(&conv3(&x, &a[1].narrow(1, 0, 3)?)?, &a[3..7])?.relu()?;
            let w = a[2].narrow(1, 0, 8)?;
            let grouped = a[0].conv2d(&w, None, [2, 2], [1, 1], [1, 1], 2)?;
            Ok(vec![stem, bn(&grouped, &a[7..11])?.relu()?])
        };
        assert_eq!(fused_cpu(stem_and_groups, &a)?, [BN_RELU, BN_RELU]);
        let apart = |a: &[Tensor]| -> Result<Vec<Tensor>> {
            let y = conv3(&a[0], &a[1])?;
            let trained =
                conv3(&a[0], &a[2])?.batch_norm(Some(&a[5]), Some(&a[6]), None, true, 1e-5)?;
            Ok(vec![bn(&y, &a[3..7])?.relu()?, y, trained.relu()?])
        };
        assert_eq!(fused_cpu(apart, &a)?, []);
        Ok(())
    }
}
