//! A composed launch on the GPU (`sequential.rs` plans it): the members as `__device__`
//! functions called in order by one block, their read-only inputs staged in shared memory.

use std::fmt::Write;

use super::builder::ty;
use super::cuda::{finish, member_fn, unrestricted, Cuda, CudaKernel};
use crate::sequential::{Arg, InputInfo, Sequence};

/// The members as `__device__` functions called in order by one block (block index 0 of 1:
/// their grid-stride loops cover their whole outputs with the block's threads), with
/// `__syncthreads()` where the sequence puts a barrier. A barrier orders and makes visible
/// the block's global writes, so a later member reads what an earlier one wrote; the
/// members' pointers lose `__restrict__`, which would let the compiler read a buffer written
/// earlier in the same launch through the non-coherent read-only cache.
///
/// The inputs no member writes are first copied into dynamic shared memory, all at once,
/// and the members read them there (`stage_inputs`): each member waits at its barrier and
/// then for its loads, so a chain of layers pays an L2 round trip per layer for its weights
/// unless they sit in shared memory (the 64 × 10x10 Linear model on an H100, the launch's
/// text timed alone: 110 µs with weights read from L2, 59 µs staged in batches of loads;
/// staging the members' outputs as well measured slower).
pub(super) fn sequential(t: &Cuda, seq: &Sequence<'_, CudaKernel>) -> Option<CudaKernel> {
    if !t.horizontal {
        return None;
    }
    let block = seq.members.first()?.kernel.block;
    if seq.members.iter().any(|m| m.kernel.block != block) {
        return None;
    }
    let mut in_types: Vec<Option<String>> = vec![None; seq.inputs.len()];
    let mut out_types: Vec<Option<String>> = vec![None; seq.outs.len()];
    let mut device_fns: Vec<(String, String)> = Vec::new();
    let (staged, shared) = stage_inputs(
        &seq.input_info,
        t.shared_per_block.saturating_sub(STATIC_SHARED_RESERVE),
    );
    let mut text = String::new();
    if shared > 0 {
        stage_text(&mut text, &staged, &seq.input_info, block);
    }
    for m in &seq.members {
        let k = m.kernel;
        if m.args.len() != k.param_types.len() {
            return None;
        }
        let f = member_fn(&mut device_fns, 's', k, &unrestricted(&k.sig));
        let mut names = Vec::with_capacity(m.args.len());
        for (j, (arg, t)) in m.args.iter().zip(&k.param_types).enumerate() {
            match *arg {
                Arg::In(i) => {
                    let t = unrestricted(t);
                    names.push(match staged.get(i).copied().flatten() {
                        Some(off) => format!("({t})(ksm + {off})"),
                        None => format!("x{i}"),
                    });
                    in_types[i].get_or_insert(t);
                }
                // an output written here has its own (non-const) type; one read here was
                // written by an earlier member
                Arg::Out(i) => {
                    if j >= k.inputs.len() {
                        out_types[i] = Some(unrestricted(t));
                    }
                    names.push(format!("y{i}"));
                }
            }
        }
        if m.barrier_before {
            text.push_str("  __syncthreads();\n");
        }
        let _ = writeln!(text, "  {f}({}, 0, 1);", names.join(", "));
    }
    // 4 KiB of pointers: what every CUDA driver accepts as a launch's parameters
    if in_types.len() + out_types.len() > kiln_core::device::MAX_KERNEL_PARAMS {
        return None;
    }
    let mut params: Vec<(String, String)> = Vec::new();
    for (i, t) in in_types.into_iter().enumerate() {
        params.push((t?, format!("x{i}")));
    }
    for (i, t) in out_types.into_iter().enumerate() {
        params.push((t?, format!("y{i}")));
    }
    let mut k = finish(seq.inputs.clone(), params, text, 1, block);
    k.device_fns = device_fns;
    k.shared = shared;
    // the members' own `__shared__` arrays live beside the staged inputs: within the reserve
    // the staging left them (and so within CUDA's limit on static shared memory)
    if super::cuda::static_shared_bytes(&k) > STATIC_SHARED_RESERVE {
        return None;
    }
    Some(k)
}

/// Loads in flight per thread while inputs are staged (`stage_text`).
const STAGE_BATCH: usize = 32;

/// The copy of the staged inputs into shared memory, then a barrier. Each thread copies its
/// elements (one per `block` threads of each input) in batches: `STAGE_BATCH` loads into
/// registers, then their stores, so the loads of a batch are in flight together. A loop per
/// input (load, store, next) puts a round trip to L2 between consecutive loads, since the
/// compiler cannot move a global load above a shared store it cannot prove apart: 114 us for the
/// 64-layer model's launch where batched copies took 59 us (nvcc harness over the generated
/// kernel, H100).
fn stage_text(text: &mut String, staged: &[Option<u32>], inputs: &[InputInfo], block: u32) {
    let block = block.max(1) as usize;
    // (input, its byte offset in shared memory, the round's first element, the input's elements)
    let mut copies: Vec<(usize, u32, usize, usize)> = Vec::new();
    for (i, (off, info)) in staged.iter().zip(inputs).enumerate() {
        if let Some(off) = off {
            for round in (0..info.numel).step_by(block) {
                copies.push((i, *off, round, info.numel));
            }
        }
    }
    text.push_str("  extern __shared__ __align__(16) unsigned char ksm[];\n  {\n");
    text.push_str("    const int e = threadIdx.x;\n");
    for (batch_at, batch) in copies.chunks(STAGE_BATCH).enumerate() {
        for (k, &(i, _, round, numel)) in batch.iter().enumerate() {
            let t = ty(inputs[i].dtype);
            let _ = writeln!(
                text,
                "    const {t} v{batch_at}_{k} = e + {round} < {numel} ? x{i}[e + {round}] : ({t})0;"
            );
        }
        for (k, &(i, off, round, numel)) in batch.iter().enumerate() {
            let t = ty(inputs[i].dtype);
            let _ = writeln!(
                text,
                "    if (e + {round} < {numel}) (({t} *)(ksm + {off}))[e + {round}] = v{batch_at}_{k};"
            );
        }
    }
    text.push_str("  }\n  __syncthreads();\n");
}

/// Shared memory a composed launch leaves for its members' own `__shared__` arrays (a block
/// reduction's partial sums: a few hundred bytes each).
const STATIC_SHARED_RESERVE: u32 = 8 << 10;

/// Where each input of a composed launch is staged in its dynamic shared memory (a byte offset,
/// 16-byte aligned so the members' four-element vector loads stay aligned), and the bytes in
/// all: every input no member writes, in order, while they fit in `budget`.
fn stage_inputs(inputs: &[InputInfo], budget: u32) -> (Vec<Option<u32>>, u32) {
    let mut at: u32 = 0;
    let staged = inputs
        .iter()
        .map(|info| {
            let bytes = u32::try_from(info.numel * info.dtype.size_in_bytes()).ok()?;
            let end = at.checked_add(bytes)?;
            if info.written || info.numel == 0 || end > budget {
                return None;
            }
            let off = at;
            at = end.next_multiple_of(16);
            Some(off)
        })
        .collect();
    (staged, at)
}

#[cfg(test)]
mod tests {
    use kiln_core::DType;

    use super::*;

    /// Inputs are staged in order while they fit, 16-byte aligned; one a member writes, an
    /// empty one and one past the budget are read from global memory.
    #[test]
    fn inputs_are_staged_while_they_fit() {
        let info = |numel, dtype, written| InputInfo {
            numel,
            dtype,
            written,
        };
        let inputs = [
            info(3, DType::F32, false),
            info(10, DType::F32, true),
            info(2, DType::F64, false),
            info(0, DType::F32, false),
            info(100, DType::F32, false),
            info(1, DType::U8, false),
        ];
        let (offsets, bytes) = stage_inputs(&inputs, 64);
        assert_eq!(offsets, vec![Some(0), None, Some(16), None, None, Some(32)]);
        assert_eq!(bytes, 48);
        let (offsets, bytes) = stage_inputs(&inputs, 1 << 20);
        assert_eq!(offsets[4], Some(32));
        assert_eq!((offsets[5], bytes), (Some(432), 448));
    }
}
