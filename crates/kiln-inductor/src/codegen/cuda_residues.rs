//! The CUDA target's residue classes (`codegen/residues.rs`): one grid-stride loop whose flat
//! index holds the class as a digit (`cls`), each class a `case` of a switch. A warp's threads
//! share a class (the digit sits outside a whole row of the innermost split dim) and so branch
//! alike; a vector loop moves four elements of the innermost dim per iteration as `cuda.rs`'s
//! does.

use std::fmt::Write;

use kiln_compile::graph::{Graph, NodeId};

use super::builder::ty;
use super::c::{split_index_as, PointwiseBody};
use super::cuda::{finish, parameters, Cuda, CudaKernel, VECTOR_FROM};
use super::cuda_vector::{
    aligned_test, fixed_lanes, fixed_test, hoisted_lanes, lane_grid, lane_values, vector_reads,
};
use super::residues;
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

/// The kernel of `roots` split into residue classes (`residues::split`), or `None`.
pub(super) fn split(
    cuda: &Cuda,
    g: &Graph,
    sched: &Schedule,
    roots: &[(NodeId, Option<NodeId>)],
    whole: &PointwiseBody<'_>,
) -> Option<CudaKernel> {
    let split = residues::split(g, sched, roots, whole)?;
    let shape = &g.nodes[roots[0].0].shape;
    let numel: usize = shape.iter().product();
    let vars: Vec<(usize, usize)> = split
        .loops(shape)
        .into_iter()
        .map(|(d, n)| (d.unwrap_or(CLASS), n))
        .collect();
    let mut text = String::from(
        "  const long long stride = knblk * blockDim.x;\n  long long e0 = kbid * blockDim.x + \
         threadIdx.x;\n",
    );
    let lane_var = shape.len() - 1;
    let lanes = (numel >= VECTOR_FROM && shape[lane_var] % 4 == 0)
        .then(|| split.build(g, sched, roots, whole, true))
        .flatten();
    let block = cuda.cfg.block;
    let vectorized = match &lanes {
        Some(lanes) => {
            let grid = lane_grid(cuda, &lanes[0], &vars, numel);
            vector_classes(&mut text, g, lanes, &vars, numel, (block, grid)).then_some(grid)
        }
        None => None,
    };
    let _ = writeln!(text, "  for (; e0 < {numel}; e0 += stride) {{");
    split_index_as(&mut text, "e0", &vars, "    ", "rem", |v| var_name(v, None));
    text.push_str("    switch (cls) {\n");
    for (c, b) in split.bodies.iter().enumerate() {
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
    let grid = vectorized.unwrap_or_else(|| cuda.blocks(numel, block as usize));
    Some(finish(whole.b.params.clone(), params, text, grid, block))
}

/// The vector loop over the classes (`cuda_vector.rs`'s `vector_loop`, one `case` per class): four
/// consecutive elements of the innermost dim per iteration, when every buffer read or written
/// as vectors is aligned. False, and nothing written, when a class's output offset is not a
/// vector's (`Ix::quad_in`). The classes share the first class's per-lane values
/// (`residues::Split::build`), computed once per thread before the loop where the lane variable
/// stays fixed (`cuda_vector.rs`'s `hoisted_lanes`), else at the start of every class's lanes,
/// with the first class's invariants they read.
fn vector_classes(
    text: &mut String,
    g: &Graph,
    lanes: &[PointwiseBody<'_>],
    vars: &[(usize, usize)],
    numel: usize,
    (block, grid): (u32, u32),
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
    let Some(first) = lanes.first() else {
        return false;
    };
    let aligned = aligned_test(g, lanes);
    let nvec = numel / 4;
    let fixed = fixed_lanes(first, vars, block, grid);
    let _ = writeln!(text, "  if ({aligned}{}) {{", fixed_test(fixed));
    if let Some(f) = fixed {
        text.push_str(&first.b.pre);
        hoisted_lanes(text, first, f.extent);
    }
    let _ = writeln!(
        text,
        "    for (long long q = e0; q < {nvec}; q += stride) {{"
    );
    let name = |v: usize| var_name(v, Some(lane_var));
    split_index_as(text, "q * 4", vars, "      ", "rem", name);
    text.push_str("      switch (cls) {\n");
    for (c, (b, rest)) in lanes.iter().zip(&rests).enumerate() {
        let _ = writeln!(text, "      case {c}: {{");
        if c > 0 && fixed.is_none() {
            // the first class's per-lane values, computed in each lane below, read its invariants
            text.push_str(&first.b.pre);
        }
        text.push_str(&b.b.pre);
        vector_reads(text, g, b, fixed.map(|_| first));
        let _ = writeln!(
            text,
            "      #pragma unroll\n      for (int k = 0; k < 4; k++) {{\n      const long long \
             i{lane_var} = i{lane_var}_l0 + k;"
        );
        lane_values(text, first, fixed.is_some());
        if c > 0 {
            // what this class computes per lane beyond the first class's values
            text.push_str(&b.b.lane_pre);
        }
        let _ = writeln!(text, "{}{}      }}", b.b.body, b.stores);
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
