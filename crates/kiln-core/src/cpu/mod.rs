//! Eager CPU execution of the primitive ops. One file per prim family; this file dispatches and holds
//! the strided-memory helpers they share. Half-precision values are computed in f32 and rounded back,
//! as PyTorch's CPU kernels do.

pub mod alloc;
mod conv;
mod elementwise;
mod epilogue;
mod gather;
mod index;
mod matmul;
mod movement;
mod num;
mod random;
mod reduce;
mod walk;

use std::borrow::Cow;

use crate::prim::{ConvParams, OutMeta, Prim, FROM_CHANNELS_LAST, TO_CHANNELS_LAST};
use crate::shape::Layout;
use crate::storage::{CpuStorage, Storage, StorageElement};
use crate::{with_storage, Result, Tensor};

pub use random::{normal_sample, uniform_sample};

/// Below this many elements a kernel runs on the calling thread: rayon's fork costs more.
pub(crate) const PAR_THRESHOLD: usize = 1 << 15;

fn owned(s: CpuStorage, shape: &[usize]) -> (Storage, Layout) {
    (Storage::cpu(s), Layout::contiguous(shape))
}

/// Runs a prim whose operands are all CPU tensors (dispatch routed device operands elsewhere).
pub(crate) fn execute(
    prim: &Prim,
    inputs: &[&Tensor],
    meta: &OutMeta,
) -> Result<(Storage, Layout)> {
    let shape = &meta.shape;
    if let Some(p) = prim.conv_params().filter(|p| p.channels_last) {
        return channels_last_conv(prim, p, inputs, meta);
    }
    Ok(match prim {
        Prim::Permute(_) | Prim::Expand(_) | Prim::Slice { .. } | Prim::Reshape(_) => {
            match prim.view_layout(inputs[0].layout()) {
                Some(l) => (inputs[0].0.storage.clone(), l),
                None => owned(materialize(inputs[0]), shape),
            }
        }
        Prim::Contiguous => owned(materialize(inputs[0]), shape),
        Prim::Unary(op) => owned(elementwise::unary(*op, inputs[0]), shape),
        Prim::Binary(op) => owned(elementwise::binary(*op, inputs[0], inputs[1]), shape),
        Prim::Where => owned(elementwise::where_(inputs[0], inputs[1], inputs[2]), shape),
        Prim::Cast(d) => owned(elementwise::cast(inputs[0], *d), shape),
        Prim::Reduce { op, dims } => owned(reduce::reduce(*op, dims, inputs[0]), shape),
        Prim::ArgReduce { op, dim } => owned(reduce::arg_reduce(*op, *dim, inputs[0]), shape),
        Prim::Pad { pads, value } => owned(movement::pad(inputs[0], pads, *value, shape), shape),
        Prim::Cat { dim } => owned(movement::cat(inputs, *dim, meta), shape),
        Prim::Full { value, dtype, .. } => {
            owned(CpuStorage::full(*dtype, meta_numel(meta), *value), shape)
        }
        Prim::Iota { n, dtype } => owned(
            CpuStorage::from_f64s(*dtype, (0..*n).map(|i| i as f64)),
            shape,
        ),
        Prim::Rand {
            dtype,
            dist,
            seed,
            offset,
            ..
        } => owned(
            random::rand(*dtype, *dist, *seed, *offset, meta_numel(meta)),
            shape,
        ),
        Prim::Gather { dim } => owned(index::gather(inputs[0], inputs[1], *dim)?, shape),
        Prim::ScatterAdd { dim } => owned(
            index::scatter_add(inputs[0], inputs[1], inputs[2], *dim)?,
            shape,
        ),
        Prim::Matmul => owned(matmul::matmul(inputs[0], inputs[1]), shape),
        Prim::MatmulEpilogue(_) => epilogue_as_ops(prim, inputs)?,
        Prim::Conv2dEpilogue { params, epilogue } => {
            match conv::conv2d_epilogue(inputs, params, *epilogue, shape) {
                Some(fused) => owned(fused, shape),
                None => epilogue_as_ops(prim, inputs)?,
            }
        }
        Prim::Conv2d(p) => owned(conv::conv2d(inputs[0], inputs[1], p, shape), shape),
        Prim::Conv2dGradInput {
            params,
            input_shape,
        } => owned(
            conv::conv2d_grad_input(inputs[0], inputs[1], params, input_shape),
            shape,
        ),
        Prim::Conv2dGradWeight {
            params,
            weight_shape,
        } => owned(
            conv::conv2d_grad_weight(inputs[0], inputs[1], params, weight_shape),
            shape,
        ),
    })
}

/// An epilogue prim the CPU has no fused kernel for, as the ops it stands for compute it.
fn epilogue_as_ops(prim: &Prim, inputs: &[&Tensor]) -> Result<(Storage, Layout)> {
    let t = crate::ops::epilogue::as_ops(prim, inputs)?;
    Ok((t.0.storage.clone(), t.layout().clone()))
}

/// A channels-last convolution (`ConvParams::channels_last`): the NCHW one over permuted views of
/// the operands, its result copied into channels-last order. The CPU has no NHWC kernel; this is
/// the reference the GPU's NHWC convolutions are checked against.
fn channels_last_conv(
    prim: &Prim,
    p: ConvParams,
    inputs: &[&Tensor],
    meta: &OutMeta,
) -> Result<(Storage, Layout)> {
    let nchw: Vec<Tensor> = inputs
        .iter()
        .map(|t| {
            let layout = t.layout().permute(&FROM_CHANNELS_LAST);
            Tensor::from_parts(t.0.storage.clone(), layout, t.dtype(), None)
        })
        .collect();
    let refs: Vec<&Tensor> = nchw.iter().collect();
    let plain = ConvParams {
        channels_last: false,
        ..p
    };
    let prim = match prim {
        Prim::Conv2dGradInput { input_shape, .. } => Prim::Conv2dGradInput {
            params: plain,
            input_shape: FROM_CHANNELS_LAST.map(|d| input_shape[d]),
        },
        Prim::Conv2dGradWeight { weight_shape, .. } => Prim::Conv2dGradWeight {
            params: plain,
            weight_shape: FROM_CHANNELS_LAST.map(|d| weight_shape[d]),
        },
        _ => Prim::Conv2d(plain),
    };
    let nchw_meta = OutMeta {
        shape: p.nchw(&meta.shape),
        dtype: meta.dtype,
    };
    let (storage, layout) = execute(&prim, &refs, &nchw_meta)?;
    let out = Tensor::from_parts(storage, layout.permute(&TO_CHANNELS_LAST), meta.dtype, None);
    Ok(owned(materialize(&out), &meta.shape))
}

fn meta_numel(m: &OutMeta) -> usize {
    m.shape.iter().product()
}

/// The elements of a strided view of `data`, contiguous. Borrows when the view already is.
pub(crate) fn contig<'a, T: StorageElement + Send + Sync>(
    data: &'a [T],
    layout: &Layout,
) -> Cow<'a, [T]> {
    let n = layout.numel();
    if n == 0 {
        // an empty view may carry an offset past the end of its (possibly empty) buffer
        return Cow::Borrowed(&[]);
    }
    if layout.is_contiguous() {
        return Cow::Borrowed(&data[layout.offset..layout.offset + n]);
    }
    if n >= PAR_THRESHOLD {
        if let Some(out) = gather::transposed(data, layout) {
            return Cow::Owned(out);
        }
        if let Some(out) = gather::rows(data, layout) {
            return Cow::Owned(out);
        }
    }
    let mut out = Vec::with_capacity(n);
    layout.for_each_offset(|o| out.push(data[o]));
    Cow::Owned(out)
}

/// A tensor's elements as a contiguous slice of `T` (the storage must hold `T`).
pub(crate) fn typed<'a, T: StorageElement>(s: &'a CpuStorage, layout: &Layout) -> Cow<'a, [T]> {
    match T::view(s) {
        Some(v) => contig(v, layout),
        None => Cow::Owned(Vec::new()), // unreachable: Prim::infer checked the dtype
    }
}

/// A tensor's elements as contiguous f32, converting f16/bf16 (and borrowing f32).
pub(crate) fn as_f32<'a>(s: &'a CpuStorage, layout: &Layout) -> Cow<'a, [f32]> {
    match s {
        CpuStorage::F32(v) => contig(v, layout),
        CpuStorage::F16(v) => Cow::Owned(contig(v, layout).iter().map(|x| x.to_f32()).collect()),
        CpuStorage::BF16(v) => Cow::Owned(contig(v, layout).iter().map(|x| x.to_f32()).collect()),
        other => Cow::Owned(
            contig_f64(other, layout)
                .iter()
                .map(|&x| x as f32)
                .collect(),
        ),
    }
}

fn contig_f64(s: &CpuStorage, layout: &Layout) -> Vec<f64> {
    let mut out = Vec::with_capacity(layout.numel());
    layout.for_each_offset(|o| out.push(s.get_f64(o)));
    out
}

/// Rounds f32 results back to the half type `like` holds.
pub(crate) fn from_f32_like(like: crate::DType, v: Vec<f32>) -> CpuStorage {
    match like {
        crate::DType::F16 => CpuStorage::F16(v.into_iter().map(half::f16::from_f32).collect()),
        crate::DType::BF16 => CpuStorage::BF16(v.into_iter().map(half::bf16::from_f32).collect()),
        _ => CpuStorage::F32(v),
    }
}

/// A contiguous copy of a CPU tensor's elements (device tensors: `to_device(Device::Cpu)` first).
pub fn materialize(t: &Tensor) -> CpuStorage {
    let s = t.storage();
    with_storage!(&*s, v => StorageElement::wrap(contig(v, t.layout()).into_owned()))
}

/// Copies `n` elements from `src[from..]` to `dst[to..]` (same dtype).
pub(crate) fn copy_range(dst: &mut CpuStorage, to: usize, src: &CpuStorage, from: usize, n: usize) {
    fn go<T: StorageElement>(
        dst: &mut CpuStorage,
        to: usize,
        src: &CpuStorage,
        from: usize,
        n: usize,
    ) {
        if let (Some(d), Some(s)) = (T::view_mut(dst), T::view(src)) {
            d[to..to + n].copy_from_slice(&s[from..from + n]);
        }
    }
    with_storage!(src, v => {
        fn tag<T: StorageElement>(_: &[T]) -> fn(&mut CpuStorage, usize, &CpuStorage, usize, usize) { go::<T> }
        tag(v)(dst, to, src, from, n)
    })
}

/// Writes contiguous `values` into the positions `layout` addresses in `d`, a row of its
/// innermost dim at a time: a copy where that dim is contiguous (a pad's interior, a cat's part),
/// a strided loop otherwise (the gradient of a strided slice: a max-pool window's).
fn write_positions<T: Copy>(d: &mut [T], layout: &Layout, values: &[T]) {
    match (layout.shape.split_last(), layout.strides.split_last()) {
        (Some((&row, outer)), Some((&step, outer_strides))) if row > 1 => {
            let rows = Layout {
                shape: outer.into(),
                strides: outer_strides.into(),
                offset: layout.offset,
            };
            let mut i = 0;
            rows.for_each_offset(|o| {
                let src = &values[i..i + row];
                if step == 1 {
                    d[o..o + row].copy_from_slice(src);
                } else {
                    for (k, &v) in src.iter().enumerate() {
                        d[o + k * step] = v;
                    }
                }
                i += row;
            });
        }
        _ => {
            let mut i = 0;
            layout.for_each_offset(|o| {
                d[o] = values[i];
                i += 1;
            });
        }
    }
}

/// Writes contiguous `values` into the positions `layout` addresses in `dst` (same dtype).
pub(crate) fn write_strided(dst: &mut CpuStorage, layout: &Layout, values: &CpuStorage) {
    fn go<T: StorageElement>(dst: &mut CpuStorage, layout: &Layout, values: &CpuStorage) {
        if let (Some(d), Some(v)) = (T::view_mut(dst), T::view(values)) {
            write_positions(d, layout, v);
        }
    }
    with_storage!(values, v => {
        fn tag<T: StorageElement>(_: &[T]) -> fn(&mut CpuStorage, &Layout, &CpuStorage) { go::<T> }
        tag(v)(dst, layout, values)
    })
}

/// `write_strided` from a tensor's elements, read in place where they are contiguous: for a
/// fresh `dst`, which cannot share the tensor's storage.
pub(crate) fn write_strided_from(dst: &mut CpuStorage, layout: &Layout, src: &Tensor) {
    fn go<T: StorageElement>(dst: &mut CpuStorage, layout: &Layout, src: &[T], l: &Layout) {
        if let Some(d) = T::view_mut(dst) {
            write_positions(d, layout, &contig(src, l));
        }
    }
    let s = src.storage();
    with_storage!(&*s, v => go(dst, layout, v, src.layout()))
}
