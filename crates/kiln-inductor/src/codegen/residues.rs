//! Splitting a pointwise kernel into residue classes of its output index, target-neutral: which
//! dims to split by which divisor, each class's body, and whether the classes pay. A stride-2
//! window's backward (max-pool's, avg-pool's) gathers each input pixel from the taps whose
//! windows cover it, and which taps those are depends on the pixel's parity: a kernel over all
//! pixels tests and loads all nine taps of a 3×3 window at every element, for the one to four
//! that count. Split by the parity of its rows and columns, each class's body is built with the
//! parity a constant (`ResidueClass`), its taps' tests decide while the body is built
//! (`Ix::unclamped`), and the taps a class cannot read leave its body with their loads and index
//! arithmetic. The classes compute what the whole body computes, in the same order: a split
//! kernel's results are the plain kernel's bit for bit.
//!
//! The targets walk the classes alike (`codegen/c_residues.rs`, `codegen/cuda_residues.rs`): the
//! class is a digit of the iteration just outside the innermost split dim, so the classes of
//! neighbouring rows run close in time and share in cache what they read; the innermost dim is
//! never split, so a class's reads and writes along it stay contiguous.

use kiln_compile::graph::{Graph, NodeId};

use super::c::{one_size, pointwise_body_in, PointwiseBody, ResidueClass};
use crate::schedule::Schedule;

/// At most this many classes (copies of the body in the kernel's source).
const MAX_CLASSES: usize = 16;

/// The divisors a split considers (a window's stride).
const MODULI: [i64; 3] = [2, 3, 4];

/// A pointwise kernel's residue classes: along each of `dims` the output index is `modulus · i +
/// residue`, one residue vector per class (`classes`), each class's body over those indices.
pub(crate) struct Split<'a> {
    pub(crate) modulus: i64,
    pub(crate) dims: Vec<usize>,
    pub(crate) classes: Vec<Vec<i64>>,
    pub(crate) bodies: Vec<PointwiseBody<'a>>,
}

/// The split of `roots`' kernel when its body (`whole`, built over all elements) divides or takes
/// the modulo of an output index by a divisor of its extent, and the classes' bodies read at
/// most three quarters of what `whole` reads per element. `None`: keep the plain kernel.
pub(crate) fn split<'a>(
    g: &'a Graph,
    sched: &'a Schedule,
    roots: &[(NodeId, Option<NodeId>)],
    whole: &PointwiseBody<'_>,
) -> Option<Split<'a>> {
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
    let mut s = Split {
        modulus,
        dims,
        classes,
        bodies: Vec::new(),
    };
    s.bodies = s.build(g, sched, roots, whole, false)?;
    let loads: usize = s.bodies.iter().map(|b| b.b.loads).sum();
    (loads * 4 <= whole.b.loads * count * 3).then_some(s)
}

impl<'a> Split<'a> {
    /// Each class's body (`lanes`: as one lane of a vector, `pointwise_body`'s lane mode), over
    /// `whole`'s parameters; `None` if a class would read a buffer `whole` does not, or read an
    /// in-place input where it is not written.
    pub(crate) fn build(
        &self,
        g: &'a Graph,
        sched: &'a Schedule,
        roots: &[(NodeId, Option<NodeId>)],
        whole: &PointwiseBody<'_>,
        lanes: bool,
    ) -> Option<Vec<PointwiseBody<'a>>> {
        let mut bodies: Vec<PointwiseBody<'a>> = Vec::with_capacity(self.classes.len());
        for residues in &self.classes {
            let class = ResidueClass {
                dims: &self.dims,
                modulus: self.modulus,
                residues,
                params: &whole.b.params,
            };
            // in lane mode the classes share the first class's per-lane values (computed once
            // per thread for all of them where the target can: `codegen/cuda_residues.rs`)
            let first = bodies.first().filter(|_| lanes).map(|f| &f.b);
            let b = pointwise_body_in(g, sched, roots, lanes, Some(&class), first);
            if !b.ok || b.b.params != whole.b.params {
                return None;
            }
            bodies.push(b);
        }
        Some(bodies)
    }

    /// The loops of the kernel, outermost first, as (dim, extent): each dim's extent within a
    /// class, and the class (`None`) just outside the innermost split dim.
    pub(crate) fn loops(&self, shape: &[usize]) -> Vec<(Option<usize>, usize)> {
        let mut vars: Vec<(Option<usize>, usize)> = shape
            .iter()
            .enumerate()
            .map(|(d, &n)| (Some(d), n))
            .collect();
        for &d in &self.dims {
            vars[d].1 /= self.modulus as usize;
        }
        let innermost_split = self.dims.iter().copied().max().unwrap_or(0);
        vars.insert(innermost_split, (None, self.classes.len()));
        vars
    }
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use kiln_compile::aot::AotBackend;
    use kiln_compile::CompileOptions;
    use kiln_core::{DType, Result, Tensor};

    use super::*;
    use crate::codegen::cuda::{Cuda, CudaKernel};
    use crate::test_graphs::{kernels, Capture, C_TARGET};

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

    /// The loads of each class's body in `src` after `from`, a class's text starting at each
    /// `marker`.
    fn class_loads(src: &str, from: &str, marker: &str) -> Vec<usize> {
        let at = src.find(from).unwrap_or(0);
        src[at..]
            .split(marker)
            .skip(1)
            .map(|case| case.matches("= b0[").count() + case.matches("= b1[").count())
            .collect()
    }

    /// A stride-2 pool's backward is one kernel split by the parity of its rows (its columns are
    /// the innermost dim, never split), on both targets: two classes, neither testing a row's
    /// parity at run time, which together read what the whole kernel read for one element —
    /// each window tap's saved index and gradient (max) or gradient (avg) where the row's parity
    /// lets the tap reach it (max: one row of taps for even rows, two for odd; avg: one each).
    #[test]
    fn pool_backward_splits_by_row_parity() -> Result<()> {
        let (n, c, h) = (2usize, 3usize, 16usize);
        for (max, reads) in [(true, vec![6, 12]), (false, vec![2, 2])] {
            let x = Tensor::randn(&[n, c, h, h], DType::F32)?;
            x.set_requires_grad(true)?;
            let backward = pool_backward(max, &x)?;
            let g = crate::backend::prepare(&backward)?;
            let planned = kernels(&Cuda::new(132), &g);
            let split: Vec<&CudaKernel> = planned
                .iter()
                .map(|(k, _)| k)
                .filter(|k| k.source.contains("switch (cls)"))
                .collect();
            assert_eq!(split.len(), 1, "max {max}: {planned:#?}");
            let src = &split[0].source;
            assert!(
                !src.contains("*i2 + 1) % 2") && !src.contains("((i2) % 2)"),
                "{src}"
            );
            // the scalar loop's classes (the vector loop's read whole rows of four)
            assert_eq!(
                class_loads(src, "for (; e0 <", "case "),
                reads,
                "max {max}:\n{src}"
            );
            // the C target: the same classes, each its own loops inside the shared ones
            let c = kernels(&C_TARGET, &g);
            let split: Vec<&str> = c
                .iter()
                .map(|(k, _)| k.source.as_str())
                .filter(|s| s.matches("for (int64_t i2 = 0; i2 < 8;").count() == 2)
                .collect();
            assert_eq!(split.len(), 1, "max {max}: {c:#?}");
            assert!(!split[0].contains("*i2 + 1) % 2") && !split[0].contains("((i2) % 2)"));
            let marker = "for (int64_t i2 = 0; i2 < 8;";
            assert_eq!(class_loads(split[0], "", marker), reads, "{}", split[0]);
        }
        Ok(())
    }
}
