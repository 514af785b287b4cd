//! The comparison toolkit: every op runs on the GPU in f32 and on the CPU in f64 (the reference),
//! forward and backward, on shapes drawn from a seeded generator.

use kiln_core::{DType, Device, Result, Tensor};

pub const CUDA: Device = Device::Cuda(0);

/// splitmix64, for shapes and values.
pub struct Rng(u64);
impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x6b69_6c6e_6375_6461)
    }
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    pub fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// A shape of rank 0..=4 with dims in 1..=7, sometimes a size-1 or size-0 dim.
    pub fn shape(&mut self, allow_empty: bool) -> Vec<usize> {
        let rank = self.below(5);
        (0..rank)
            .map(|_| match self.below(10) {
                0 => 1,
                1 if allow_empty => 0,
                _ => 1 + self.below(7),
            })
            .collect()
    }
    /// A shape that broadcasts against `s`: some dims set to 1, maybe fewer leading dims.
    pub fn broadcast_of(&mut self, s: &[usize]) -> Vec<usize> {
        let drop = self.below(s.len() + 1);
        s[drop..]
            .iter()
            .map(|&d| if self.below(3) == 0 { 1 } else { d })
            .collect()
    }
}

/// A CPU f32 tensor of `shape` with values in [lo, hi); when `strided`, a non-contiguous view
/// (a transpose of a larger buffer, then a step-2 slice) with those values.
pub fn input(rng: &mut Rng, shape: &[usize], lo: f64, hi: f64, strided: bool) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    if !strided || shape.is_empty() {
        let v: Vec<f32> = (0..n)
            .map(|_| (lo + (hi - lo) * rng.unit()) as f32)
            .collect();
        return Tensor::from_vec(v, shape);
    }
    // build [..., 2*last] reversed-dims buffer, transpose back, take every other element
    let mut big: Vec<usize> = shape.to_vec();
    let last = big.len() - 1;
    big[last] *= 2;
    big.reverse();
    let m: usize = big.iter().product();
    let v: Vec<f32> = (0..m)
        .map(|_| (lo + (hi - lo) * rng.unit()) as f32)
        .collect();
    let t = Tensor::from_vec(v, &big)?;
    let perm: Vec<isize> = (0..big.len() as isize).rev().collect();
    let t = t.permute(&perm)?;
    t.slice(last as isize, 0, (2 * shape[last]) as isize, 2)
}

/// ‖a − b‖ / ‖b‖ over finite entries, after checking that NaN and infinities sit in the same places.
pub fn rel_err(got: &[f64], want: &[f64]) -> std::result::Result<f64, String> {
    if got.len() != want.len() {
        return Err(format!("{} values, expected {}", got.len(), want.len()));
    }
    let (mut num, mut den) = (0.0, 0.0);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if w.is_nan() || w.is_infinite() {
            if !(g.is_nan() && w.is_nan()) && g != w {
                return Err(format!("element {i}: got {g}, expected {w}"));
            }
            continue;
        }
        if !g.is_finite() {
            return Err(format!("element {i}: got {g}, expected {w}"));
        }
        num += (g - w) * (g - w);
        den += w * w;
    }
    Ok(if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    })
}

fn compare(what: &str, got: &Tensor, want: &Tensor, tol: f64) -> std::result::Result<(), String> {
    if got.shape() != want.shape() {
        return Err(format!(
            "{what}: shape {:?}, expected {:?}",
            got.shape(),
            want.shape()
        ));
    }
    let g = got.to_vec_f64().map_err(|e| e.to_string())?;
    let w = want.to_vec_f64().map_err(|e| e.to_string())?;
    let e = rel_err(&g, &w).map_err(|m| format!("{what}: {m}"))?;
    if e > tol {
        return Err(format!(
            "{what}: relative error {e:.3e} > {tol:.1e} (shape {:?})",
            want.shape()
        ));
    }
    Ok(())
}

fn to_ref(t: &Tensor) -> Result<Tensor> {
    if t.dtype().is_float() {
        t.to_dtype(DType::F64)
    } else {
        Ok(t.clone())
    }
}

/// The inputs moved to the GPU, and their f64 copies on the CPU (the reference); leaves that
/// require grad when `grad`.
fn placed(inputs: &[Tensor], grad: bool) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
    let leaf = |t: Tensor| if grad { t.with_grad() } else { Ok(t) };
    let gpu = inputs
        .iter()
        .map(|t| leaf(t.to(CUDA)?))
        .collect::<Result<_>>()?;
    let cpu = inputs
        .iter()
        .map(|t| leaf(to_ref(t)?))
        .collect::<Result<_>>()?;
    Ok((gpu, cpu))
}

/// Runs `f` on the inputs moved to the GPU and on their f64 copies on the CPU; compares outputs.
pub fn check_fwd(
    what: &str,
    inputs: &[Tensor],
    tol: f64,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> std::result::Result<(), String> {
    let e = |x: kiln_core::Error| format!("{what}: {x}");
    let (gpu, cpu) = placed(inputs, false).map_err(e)?;
    let out = f(&gpu).map_err(e)?;
    if out.device() != CUDA {
        return Err(format!(
            "{what}: result on {}, expected {CUDA}",
            out.device()
        ));
    }
    let want = f(&cpu).map_err(e)?;
    compare(what, &out, &want, tol)
}

/// Forward and backward: the gradient of `sum(f(inputs) * weights)` for each float input.
pub fn check_grad(
    what: &str,
    inputs: &[Tensor],
    tol: f64,
    f: impl Fn(&[Tensor]) -> Result<Tensor>,
) -> std::result::Result<(), String> {
    let e = |x: kiln_core::Error| format!("{what}: {x}");
    let (gpu, cpu) = placed(inputs, true).map_err(e)?;
    let run = |xs: &[Tensor]| -> Result<Tensor> {
        let y = f(xs)?;
        // weights make every output element's gradient different (a plain sum hides transposes)
        let n = y.numel();
        let w = Tensor::arange(1.0, n as f64 + 1.0, 1.0, DType::F64)?
            .reshape(y.shape().to_vec())?
            .to_dtype(y.dtype())?
            .to(y.device())?;
        let loss = y.mul(&w)?.sum_all()?;
        loss.backward()?;
        Ok(y)
    };
    let out = run(&gpu).map_err(e)?;
    let want = run(&cpu).map_err(e)?;
    compare(&format!("{what} forward"), &out, &want, tol)?;
    for (i, (g, c)) in gpu.iter().zip(&cpu).enumerate() {
        let (gg, cg) = (g.grad(), c.grad());
        match (gg, cg) {
            (Some(gg), Some(cg)) => {
                if gg.device() != CUDA {
                    return Err(format!("{what}: grad {i} on {}", gg.device()));
                }
                compare(&format!("{what} grad {i}"), &gg, &cg, tol)?
            }
            (None, None) => {}
            (a, b) => {
                return Err(format!(
                    "{what}: grad {i} present on gpu {} / cpu {}",
                    a.is_some(),
                    b.is_some()
                ))
            }
        }
    }
    Ok(())
}
