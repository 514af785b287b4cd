//! Counter-based random numbers: element i of a `Rand` prim is a pure function of (seed, offset + i),
//! so eager, compiled CPU and compiled GPU code produce the same values, and a backward pass can
//! regenerate a dropout mask instead of saving it.

use crate::prim::RandDist;
use crate::storage::CpuStorage;
use crate::DType;

#[inline]
fn mix(mut z: u64) -> u64 {
    // splitmix64's finalizer
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
    z ^ (z >> 31)
}

#[inline]
fn bits(seed: u64, counter: u64) -> u64 {
    mix(mix(seed).wrapping_add(counter.wrapping_mul(0x9e3779b97f4a7c15)))
}

/// Uniform on [0, 1) with 53 random bits.
#[inline]
pub fn uniform_sample(seed: u64, counter: u64) -> f64 {
    (bits(seed, counter) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Standard normal by Box–Muller on the two 32-bit halves of one draw.
#[inline]
pub fn normal_sample(seed: u64, counter: u64) -> f64 {
    let b = bits(seed, counter);
    let u1 = ((b >> 32) as f64 + 0.5) / 4294967296.0;
    let u2 = (b & 0xffff_ffff) as f64 / 4294967296.0;
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

pub(super) fn rand(dtype: DType, dist: RandDist, seed: u64, offset: u64, n: usize) -> CpuStorage {
    let sample = match dist {
        RandDist::Uniform => uniform_sample,
        RandDist::Normal => normal_sample,
    };
    CpuStorage::from_f64s(dtype, (0..n as u64).map(|i| sample(seed, offset + i)))
}
