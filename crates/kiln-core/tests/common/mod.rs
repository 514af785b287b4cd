//! Shared test helpers: a seeded RNG, proptest shape strategies, builders for non-contiguous inputs,
//! an f64 reference toolkit (index arithmetic, broadcasting, reductions) and a finite-difference
//! gradient checker. References here never call the op under test: they read `to_vec_f64()` data
//! and compute with plain f64 loops.
#![allow(dead_code)]

use kiln_core::storage::CpuStorage;
use kiln_core::{no_grad, DType, Result, Tensor};
use proptest::prelude::*;

// ---------------------------------------------------------------- randomness

/// splitmix64: deterministic values from a proptest-chosen seed.
pub struct TRng(u64);

impl TRng {
    pub fn new(seed: u64) -> Self {
        TRng(seed ^ 0x5eed_1234_abcd_0001)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform on [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }
    pub fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.unit().max(1e-300), self.unit());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    /// Uniform in ±[lo, hi]: values kept away from 0 (for ops with a kink there).
    pub fn away_from_zero(&mut self, lo: f64, hi: f64) -> f64 {
        let v = self.uniform(lo, hi);
        if self.unit() < 0.5 {
            -v
        } else {
            v
        }
    }
    pub fn perm(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            p.swap(i, self.below(i + 1));
        }
        p
    }
    pub fn vec(&mut self, n: usize, mut f: impl FnMut(&mut TRng) -> f64) -> Vec<f64> {
        (0..n).map(|_| f(self)).collect()
    }
}

// ---------------------------------------------------------------- strategies

/// A dim size: mostly 2..=max, with 0 and 1 over-represented.
pub fn dim(max: usize) -> impl Strategy<Value = usize> {
    prop_oneof![1 => Just(0usize), 2 => Just(1usize), 6 => 2..=max.max(2)]
}

/// A shape of rank `min_rank..=max_rank`.
pub fn shape(
    min_rank: usize,
    max_rank: usize,
    max_dim: usize,
) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(dim(max_dim), min_rank..=max_rank)
}

/// A shape with no zero-size dims.
pub fn shape_nz(
    min_rank: usize,
    max_rank: usize,
    max_dim: usize,
) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(1..=max_dim, min_rank..=max_rank)
}

/// A shape `b` broadcast-compatible with `a` (dims dropped from the left, some set to 1).
pub fn broadcast_partner(a: &[usize], rng: &mut TRng) -> Vec<usize> {
    let drop = rng.below(a.len() + 1);
    a[drop..]
        .iter()
        .map(|&d| if rng.unit() < 0.3 { 1 } else { d })
        .collect()
}

// ---------------------------------------------------------------- building inputs

/// How an input tensor is laid out in memory; the logical values are the same for every kind.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Kind {
    Contiguous,
    /// A permutation of a contiguous base (transpose is the two-dim case).
    Permuted,
    /// Every other element of a larger base along one dim (`x[1::2]`).
    Strided,
    /// One dim stretched from size 1 with stride 0.
    Expanded,
}

pub const KINDS: [Kind; 4] = [
    Kind::Contiguous,
    Kind::Permuted,
    Kind::Strided,
    Kind::Expanded,
];

pub fn kind() -> impl Strategy<Value = Kind> {
    prop::sample::select(KINDS.to_vec())
}

pub fn from_f64s(vals: &[f64], shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_storage(CpuStorage::from_f64s(dtype, vals.iter().copied()), shape).unwrap()
}

/// The base shape and the view that turns a base of that shape into a tensor of `shape`.
pub struct ViewPlan {
    pub base_shape: Vec<usize>,
    kind: Kind,
    perm_inv: Vec<usize>,
    dim: usize,
    target: Vec<usize>,
}

impl ViewPlan {
    pub fn new(shape: &[usize], kind: Kind, rng: &mut TRng) -> ViewPlan {
        let r = shape.len();
        let kind = if r == 0 { Kind::Contiguous } else { kind };
        let mut plan = ViewPlan {
            base_shape: shape.to_vec(),
            kind,
            perm_inv: vec![],
            dim: if r > 0 { rng.below(r) } else { 0 },
            target: shape.to_vec(),
        };
        match kind {
            Kind::Contiguous => {}
            Kind::Permuted => {
                let p = rng.perm(r);
                plan.base_shape = p.iter().map(|&i| shape[i]).collect();
                let mut inv = vec![0; r];
                for (i, &d) in p.iter().enumerate() {
                    inv[d] = i;
                }
                plan.perm_inv = inv;
            }
            Kind::Strided => plan.base_shape[plan.dim] = 2 * shape[plan.dim] + 1,
            Kind::Expanded => plan.base_shape[plan.dim] = 1,
        }
        plan
    }
    pub fn apply(&self, base: &Tensor) -> Result<Tensor> {
        match self.kind {
            Kind::Contiguous => Ok(base.clone()),
            Kind::Permuted => {
                let p: Vec<isize> = self.perm_inv.iter().map(|&d| d as isize).collect();
                base.permute(&p)
            }
            Kind::Strided => {
                let n = self.base_shape[self.dim] as isize;
                base.slice(self.dim as isize, 1, n, 2)
            }
            Kind::Expanded => base.expand(self.target.clone()),
        }
    }
}

/// A tensor of `shape` and `dtype` laid out as `kind`, with values drawn by `gen`.
pub fn make(
    shape: &[usize],
    kind: Kind,
    dtype: DType,
    rng: &mut TRng,
    gen: impl FnMut(&mut TRng) -> f64,
) -> Tensor {
    let plan = ViewPlan::new(shape, kind, rng);
    let n: usize = plan.base_shape.iter().product();
    let base = from_f64s(&rng.vec(n, gen), &plan.base_shape, dtype);
    let t = plan.apply(&base).unwrap();
    assert_eq!(t.shape(), shape);
    t
}

// ---------------------------------------------------------------- reference toolkit

pub fn numel(s: &[usize]) -> usize {
    s.iter().product()
}

pub fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        let n = shape[d].max(1);
        idx[d] = i % n;
        i /= n;
    }
    idx
}

pub fn ravel(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(shape).fold(0, |acc, (&i, &n)| acc * n + i)
}

/// PyTorch's broadcast shape, computed independently of kiln.
pub fn bshape(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let n = a.len().max(b.len());
    (0..n)
        .map(|i| {
            let da = if i + a.len() >= n {
                a[i + a.len() - n]
            } else {
                1
            };
            let db = if i + b.len() >= n {
                b[i + b.len() - n]
            } else {
                1
            };
            match (da, db) {
                _ if da == db => Some(da),
                (1, d) | (d, 1) => Some(d),
                _ => None,
            }
        })
        .collect()
}

/// The element of `vals` (row-major, shape `shape`) that output index `out` reads under broadcasting.
pub fn bget(vals: &[f64], shape: &[usize], out: &[usize]) -> f64 {
    let lead = out.len() - shape.len();
    let idx: Vec<usize> = shape
        .iter()
        .enumerate()
        .map(|(d, &n)| if n == 1 { 0 } else { out[lead + d] })
        .collect();
    vals[ravel(&idx, shape)]
}

/// Elementwise reference over broadcast operands.
pub fn ref_map(inputs: &[(&[f64], &[usize])], f: impl Fn(&[f64]) -> f64) -> (Vec<f64>, Vec<usize>) {
    let mut shape = inputs[0].1.to_vec();
    for (_, s) in &inputs[1..] {
        shape = bshape(&shape, s).expect("test shapes broadcast");
    }
    let out = (0..numel(&shape))
        .map(|i| {
            let idx = unravel(i, &shape);
            let args: Vec<f64> = inputs.iter().map(|(v, s)| bget(v, s, &idx)).collect();
            f(&args)
        })
        .collect();
    (out, shape)
}

/// Groups the elements of each output position of a reduction over `dims` (sorted, deduplicated)
/// and applies `f` to each group. Returns values and the keepdim / no-keepdim shapes.
pub fn ref_reduce(
    vals: &[f64],
    shape: &[usize],
    dims: &[usize],
    f: impl Fn(&[f64]) -> f64,
) -> (Vec<f64>, Vec<usize>, Vec<usize>) {
    let keep: Vec<usize> = (0..shape.len())
        .map(|d| if dims.contains(&d) { 1 } else { shape[d] })
        .collect();
    let drop: Vec<usize> = (0..shape.len())
        .filter(|d| !dims.contains(d))
        .map(|d| shape[d])
        .collect();
    let mut groups = vec![Vec::new(); numel(&keep)];
    for (i, &v) in vals.iter().enumerate() {
        let mut idx = unravel(i, shape);
        for &d in dims {
            idx[d] = 0;
        }
        groups[ravel(&idx, &keep)].push(v);
    }
    (groups.iter().map(|g| f(g)).collect(), keep, drop)
}

/// Random sorted distinct dims of a rank-`r` tensor, and the same dims written as PyTorch users might
/// (some negative, unsorted).
pub fn random_dims(r: usize, rng: &mut TRng) -> (Vec<usize>, Vec<isize>) {
    let mut d: Vec<usize> = (0..r).filter(|_| rng.unit() < 0.5).collect();
    if d.is_empty() && r > 0 {
        d.push(rng.below(r));
    }
    let mut user: Vec<isize> = d
        .iter()
        .map(|&i| {
            if rng.unit() < 0.5 {
                i as isize - r as isize
            } else {
                i as isize
            }
        })
        .collect();
    user.reverse();
    (d, user)
}

// ---------------------------------------------------------------- comparisons

/// (relative, absolute) tolerance of a dtype.
pub fn tol(dtype: DType) -> (f64, f64) {
    match dtype {
        DType::F64 => (1e-10, 1e-10),
        DType::F32 => (1e-5, 1e-5),
        // composite ops round to the half type after every prim, so errors add up over a few steps
        DType::F16 | DType::BF16 => (2e-2, 2e-2),
        _ => (0.0, 0.0),
    }
}

pub fn close(got: f64, want: f64, rtol: f64, atol: f64) -> bool {
    if want.is_nan() || got.is_nan() {
        return want.is_nan() && got.is_nan();
    }
    if want.is_infinite() || got.is_infinite() {
        return got == want;
    }
    (got - want).abs() <= atol + rtol * want.abs()
}

#[track_caller]
pub fn assert_close(got: &[f64], want: &[f64], rtol: f64, atol: f64, ctx: &str) {
    assert_eq!(got.len(), want.len(), "{ctx}: lengths differ");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            close(g, w, rtol, atol),
            "{ctx}: element {i}: got {g}, want {w} (rtol {rtol}, atol {atol})\n got  {got:?}\n want {want:?}"
        );
    }
}

/// Checks a tensor's shape, dtype and values against a reference.
#[track_caller]
pub fn check(t: &Tensor, want: &[f64], shape: &[usize], dtype: DType, ctx: &str) {
    assert_eq!(t.shape(), shape, "{ctx}: shape");
    assert_eq!(t.dtype(), dtype, "{ctx}: dtype");
    let (r, a) = tol(dtype);
    assert_close(&t.to_vec_f64().unwrap(), want, r, a, ctx);
}

/// Rounds an f64 to what `dtype` stores.
pub fn round_to(v: f64, dtype: DType) -> f64 {
    match dtype {
        DType::F32 => v as f32 as f64,
        DType::F16 => half::f16::from_f64(v).to_f64(),
        DType::BF16 => half::bf16::from_f64(v).to_f64(),
        _ => v,
    }
}

// ---------------------------------------------------------------- gradient checking

/// Compares reverse-mode gradients with central finite differences in f64.
///
/// `inputs` are (values, base shape) pairs; `f` receives them as leaves requiring grad (it may view
/// them further, e.g. permute or expand) and returns any tensor. The checked scalar is
/// `sum(f(x) * w)` for a random `w`, seeded through `backward_with(w)`.
#[track_caller]
pub fn check_grad(
    inputs: &[(Vec<f64>, Vec<usize>)],
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
    rng: &mut TRng,
    ctx: &str,
) {
    let leaves: Vec<Tensor> = inputs
        .iter()
        .map(|(v, s)| from_f64s(v, s, DType::F64).with_grad().unwrap())
        .collect();
    let out = f(&leaves).unwrap_or_else(|e| panic!("{ctx}: forward failed: {e}"));
    let w: Vec<f64> = rng.vec(out.numel(), |r| r.uniform(-1.0, 1.0));
    let wt = from_f64s(&w, out.shape(), DType::F64);
    if out.requires_grad() {
        out.backward_with(&wt)
            .unwrap_or_else(|e| panic!("{ctx}: backward failed: {e}"));
    }
    let loss = |xs: &[Tensor]| -> f64 {
        let o = no_grad(|| f(xs)).unwrap().to_vec_f64().unwrap();
        o.iter().zip(&w).map(|(a, b)| a * b).sum()
    };
    let eps = 1e-6;
    for (k, (vals, shape)) in inputs.iter().enumerate() {
        let analytic = match leaves[k].grad() {
            Some(g) => {
                assert_eq!(g.shape(), shape.as_slice(), "{ctx}: grad {k} shape");
                g.to_vec_f64().unwrap()
            }
            None => vec![0.0; vals.len()],
        };
        let mut numeric = Vec::with_capacity(vals.len());
        for j in 0..vals.len() {
            let at = |delta: f64| {
                let xs: Vec<Tensor> = inputs
                    .iter()
                    .enumerate()
                    .map(|(i, (v, s))| {
                        if i == k {
                            let mut v = v.clone();
                            v[j] += delta;
                            from_f64s(&v, s, DType::F64)
                        } else {
                            from_f64s(v, s, DType::F64)
                        }
                    })
                    .collect();
                loss(&xs)
            };
            numeric.push((at(eps) - at(-eps)) / (2.0 * eps));
        }
        assert_close(
            &analytic,
            &numeric,
            1e-5,
            1e-5,
            &format!("{ctx}: d/d input {k}"),
        );
    }
}

/// Random values for a grad check of `shape`.
pub fn gvals(shape: &[usize], rng: &mut TRng) -> (Vec<f64>, Vec<usize>) {
    (
        rng.vec(numel(shape), |r| r.uniform(-2.0, 2.0)),
        shape.to_vec(),
    )
}
