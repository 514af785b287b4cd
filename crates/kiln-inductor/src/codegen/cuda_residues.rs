//! A pointwise kernel split into residue classes of its output index. A stride-2 window's
//! backward (max-pool's, avg-pool's) gathers each input pixel from the taps whose windows cover
//! it, and which taps those are depends on the pixel's parity: a kernel over all pixels tests
//! and loads all nine taps of a 3×3 window at every element, for the one to four that count.
//! Split by the parity of its rows and columns, each class's body is built with the parity a
//! constant (`ResidueClass`), its taps' tests decide while the body is built (`Ix::unclamped`),
//! and the taps a class cannot read leave its body with their loads and index arithmetic.
//!
//! The threads walk the classes one after another (class-major flat index), so a warp's threads
//! share a class and branch alike; the innermost dim is never split, so a class's reads and
//! writes along it stay coalesced (a channels-last pixel's channels are one contiguous run).

use std::fmt::Write;

use kiln_compile::graph::{Graph, NodeId};

use super::c::{one_size, pointwise_body_in, split_index_as, ty, PointwiseBody, ResidueClass};
use super::cuda::{finish, parameters, Cuda, CudaKernel, VECTOR_FROM};
use crate::schedule::Schedule;

/// The class digit's place among a kernel's loop variables (`split`'s `vars`).
const CLASS: usize = usize::MAX;

/// The C name of loop variable `v` (`cls` for the class digit; lane 0's `i<v>_l0` for the lane
/// variable of a vector loop).
fn var_name(v: usize, lane_var: Option<usize>) -> String {
    match v {
        CLASS => "cls".into(),
        v if Some(v) == lane_var => format!("i{v}_l0"),
        v => format!("i{v}"),
    }
}

/// At most this many classes (copies of the body in the kernel's source).
const MAX_CLASSES: usize = 16;

/// The divisors a split considers (a window's stride).
const MODULI: [i64; 3] = [2, 3, 4];

/// The kernel of `roots` split into residue classes when its body (`whole`, built over all
/// elements) divides or takes the modulo of an output index by a divisor of its extent, and the
/// classes' bodies read at most three quarters of what `whole` reads per element. `None`: keep
/// the plain kernel.
pub(super) fn split(
    cuda: &Cuda,
    g: &Graph,
    sched: &Schedule,
    roots: &[(NodeId, Option<NodeId>)],
    whole: &PointwiseBody<'_>,
) -> Option<CudaKernel> {
    // a size-generic kernel is fitted from its text across sizes (`codegen/template.rs`)
    if !one_size() || whole.b.loads == 0 {
        return None;
    }
    let shape = &g.nodes[roots[0].0].shape;
    let (modulus, dims) = choose(shape, &whole.b.residues)?;
    let count = (modulus as usize).pow(dims.len() as u32);
    let classes: Vec<Vec<i64>> = (0..count)
        .map(|c| {
            (0..dims.len())
                .map(|j| (c / (modulus as usize).pow((dims.len() - 1 - j) as u32)) as i64)
                .map(|q| q % modulus)
                .collect()
        })
        .collect();
    let body = |residues: &[i64], lanes: bool| {
        let class = ResidueClass {
            dims: &dims,
            modulus,
            residues,
            params: &whole.b.params,
        };
        let b = pointwise_body_in(g, sched, roots, lanes, Some(&class));
        // a class reads a subset of the kernel's buffers, in-place ones only where written
        (b.ok && b.b.params == whole.b.params).then_some(b)
    };
    let scalar: Vec<PointwiseBody<'_>> = classes
        .iter()
        .map(|r| body(r, false))
        .collect::<Option<_>>()?;
    let loads: usize = scalar.iter().map(|b| b.b.loads).sum();
    if loads * 4 > whole.b.loads * count * 3 {
        return None;
    }
    let numel: usize = shape.iter().product();
    // the flat index's digits, outermost first: each dim's index in its class, and the class
    // (`CLASS`) just outside the innermost split dim, so the classes of neighbouring rows run
    // close in time and share the rows they read in cache, while the elements under one class
    // digit (that dim's row and all inner dims) keep a warp in one class
    let mut vars: Vec<(usize, usize)> = shape.iter().copied().enumerate().collect();
    for &d in &dims {
        vars[d].1 /= modulus as usize;
    }
    let innermost_split = *dims.iter().max()?;
    vars.insert(innermost_split, (CLASS, count));
    let mut text = String::from(
        "  const long long stride = knblk * blockDim.x;\n  long long e0 = kbid * blockDim.x + \
         threadIdx.x;\n",
    );
    let lane_var = shape.len() - 1;
    let lanes: Option<Vec<PointwiseBody<'_>>> = (numel >= VECTOR_FROM && shape[lane_var] % 4 == 0)
        .then(|| classes.iter().map(|r| body(r, true)).collect())
        .flatten();
    let vectorized = match &lanes {
        Some(lanes) => vector_classes(&mut text, g, lanes, &vars, numel),
        None => false,
    };
    let _ = writeln!(text, "  for (; e0 < {numel}; e0 += stride) {{");
    split_index_as(&mut text, "e0", &vars, "    ", "rem", |v| var_name(v, None));
    text.push_str("    switch (cls) {\n");
    for (c, b) in scalar.iter().enumerate() {
        let _ = writeln!(
            text,
            "    case {c}: {{\n{}{}{}    }} break;",
            b.b.pre, b.b.body, b.stores
        );
    }
    text.push_str("    }\n  }\n");
    let buffers = whole
        .b
        .params
        .iter()
        .chain(whole.outputs.iter().map(|o| &o.0));
    let text = cuda.narrow_index(g, buffers.copied(), numel, text);
    let params = parameters(&whole.b, g, &whole.outputs);
    let per_thread = if vectorized { 4 } else { 1 };
    let grid = cuda.blocks(numel.div_ceil(per_thread), cuda.cfg.block as usize);
    Some(finish(
        whole.b.params.clone(),
        params,
        text,
        grid,
        cuda.cfg.block,
    ))
}

/// The divisor and the dims to split by it: the divisor the most eligible dims share, a dim
/// eligible when the body divides its index by that divisor, the divisor divides its extent,
/// and it is not the innermost. Classes stay at most `MAX_CLASSES`.
fn choose(shape: &[usize], residues: &[(usize, i64)]) -> Option<(i64, Vec<usize>)> {
    let last = shape.len().checked_sub(1)?;
    let eligible = |m: i64| -> Vec<usize> {
        let mut dims: Vec<usize> = residues
            .iter()
            .filter(|&&(v, n)| n == m && v != last && shape[v] % m as usize == 0)
            .map(|&(v, _)| v)
            .collect();
        dims.sort_unstable();
        dims.dedup();
        while (m as usize).pow(dims.len() as u32) > MAX_CLASSES {
            dims.pop();
        }
        dims
    };
    MODULI
        .iter()
        .map(|&m| (m, eligible(m)))
        .filter(|(_, dims)| !dims.is_empty())
        .max_by_key(|(m, dims)| (dims.len(), -m))
}

/// The vector loop over the classes (`cuda.rs`'s `vector_loop`, one `case` per class): four
/// consecutive elements of the innermost dim per iteration, when every buffer read or written
/// as vectors is aligned. False, and nothing written, when a class's output offset is not a
/// vector's (`Ix::quad_in`).
fn vector_classes(
    text: &mut String,
    g: &Graph,
    lanes: &[PointwiseBody<'_>],
    vars: &[(usize, usize)],
    numel: usize,
) -> bool {
    // the innermost dim, never split
    let Some(&(lane_var, _)) = vars.last() else {
        return false;
    };
    let Some(rests) = lanes
        .iter()
        .map(|b| b.written.quad_in(lane_var))
        .collect::<Option<Vec<_>>>()
    else {
        return false;
    };
    let mut vectors: Vec<(String, usize)> = Vec::new();
    for b in lanes {
        let read = b.b.vector_reads.iter().map(|r| (&r.buf, r.dtype));
        let written = b.outputs.iter().map(|(root, n)| (n, g.nodes[*root].dtype));
        for (name, d) in read.chain(written) {
            if !vectors.iter().any(|(n, _)| n == name) {
                vectors.push((name.clone(), 4 * d.size_in_bytes()));
            }
        }
    }
    let aligned = vectors
        .iter()
        .map(|(name, bytes)| format!("(unsigned long long){name} % {bytes} == 0"))
        .collect::<Vec<_>>()
        .join(" && ");
    let nvec = numel / 4;
    let _ = writeln!(
        text,
        "  if ({aligned}) {{\n    for (long long q = e0; q < {nvec}; q += stride) {{"
    );
    let name = |v: usize| var_name(v, Some(lane_var));
    split_index_as(text, "q * 4", vars, "      ", "rem", name);
    text.push_str("      switch (cls) {\n");
    for (c, (b, rest)) in lanes.iter().zip(&rests).enumerate() {
        let _ = writeln!(text, "      case {c}: {{\n{}", b.b.pre);
        for r in &b.b.vector_reads {
            let t = ty(r.dtype);
            let _ = writeln!(
                text,
                "      const kiln_v4<{t}> {} = ((const kiln_v4<{t}> *){})[{}];",
                r.name, r.buf, r.at
            );
        }
        for (root, out) in &b.outputs {
            let _ = writeln!(text, "      kiln_v4<{}> {out}_s;", ty(g.nodes[*root].dtype));
        }
        let _ = writeln!(
            text,
            "      #pragma unroll\n      for (int k = 0; k < 4; k++) {{\n      const long long \
             i{lane_var} = i{lane_var}_l0 + k;\n{}{}      }}",
            b.b.body, b.stores
        );
        let at = format!("({} + i{lane_var}_l0) / 4", rest.to_c("i"));
        for (root, out) in &b.outputs {
            let t = ty(g.nodes[*root].dtype);
            let _ = writeln!(text, "      ((kiln_v4<{t}> *){out})[{at}] = {out}_s;");
        }
        text.push_str("      } break;\n");
    }
    let _ = writeln!(
        text,
        "      }}\n    }}\n    e0 = {} + (long long)kbid * blockDim.x + threadIdx.x;\n  }}",
        nvec * 4
    );
    true
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kiln_compile::aot::AotBackend;
    use kiln_compile::CompileOptions;
    use kiln_core::{DType, Result, Tensor};

    use super::*;
    use crate::test_graphs::{kernels, Capture};

    /// The backward graph AOT autograd derives for a max-pool (3×3 windows, stride 2, padding
    /// 1) or avg-pool (2×2, stride 2) of an `[n, c, h, w]` input.
    fn pool_backward(max: bool, x: &Tensor) -> Result<Graph> {
        let capture = Arc::new(Capture(Default::default()));
        let aot = Arc::new(AotBackend::new("aot", capture.clone()));
        let f = move |a: &[Tensor]| -> Result<Vec<Tensor>> {
            Ok(vec![match max {
                true => a[0].max_pool2d([3, 3], [2, 2], [1, 1])?,
                false => a[0].avg_pool2d([2, 2], [2, 2], [0, 0], true)?,
            }])
        };
        let compiled = kiln_compile::compile_fn(f, CompileOptions::default().custom_backend(aot))?;
        compiled.call(std::slice::from_ref(x))?;
        let graphs = capture.0.lock().unwrap_or_else(|e| e.into_inner());
        // the compiled forward first, then the backward
        graphs
            .get(1)
            .cloned()
            .ok_or_else(|| kiln_core::Error::arg("pool_backward", "no backward graph"))
    }

    /// A stride-2 pool's backward is one kernel split by the parity of its rows (its columns are
    /// the innermost dim, never split): two classes, neither testing a row's parity at run time,
    /// which together read what the whole kernel read for one element — each window tap's
    /// saved index and gradient (max) or gradient (avg) where the row's parity lets the tap
    /// reach it (max: one row of taps for even rows, two for odd; avg: one for each).
    #[test]
    fn pool_backward_splits_by_row_parity() -> Result<()> {
        let (n, c, h) = (2usize, 3usize, 16usize);
        for (max, reads) in [(true, [6, 12]), (false, [2, 2])] {
            let x = Tensor::randn(&[n, c, h, h], DType::F32)?;
            x.set_requires_grad(true)?;
            let g = pool_backward(max, &x)?;
            let planned = kernels(&Cuda::new(132), &crate::backend::prepare(&g));
            let split: Vec<&CudaKernel> = planned
                .iter()
                .map(|(k, _)| k)
                .filter(|k| k.source.contains("switch (cls)"))
                .collect();
            assert_eq!(split.len(), 1, "max {max}: {planned:#?}");
            let src = &split[0].source;
            // the scalar loop's classes (the vector loop's read whole rows of four)
            let scalar = &src[src.find("for (; e0 <").expect("a scalar loop")..];
            let cases: Vec<&str> = scalar.split("case ").skip(1).collect();
            assert_eq!(cases.len(), 2, "{src}");
            for (case, want) in cases.iter().zip(reads) {
                assert!(!case.contains("*i2 + 1) % 2") && !case.contains("((i2) % 2)"));
                let loads = case.matches("= b0[").count() + case.matches("= b1[").count();
                assert_eq!(loads, want, "max {max}:\n{src}");
            }
        }
        Ok(())
    }
}
