//! Creation ops and the random generator.

use std::sync::Mutex;

use crate::dispatch::apply_on;
use crate::prim::{Prim, RandDist};
use crate::{DType, Device, Error, Result, Tensor};

/// A seedable source of (seed, offset) pairs for the counter-based `Rand` prim. Each draw advances
/// the offset by the number of values drawn, so results depend only on the seed and the call order.
#[derive(Clone, Debug)]
pub struct Generator {
    seed: u64,
    offset: u64,
}

impl Generator {
    pub fn new(seed: u64) -> Self {
        Generator { seed, offset: 0 }
    }
    /// Reserves `n` values and returns (seed, first offset).
    pub fn draw(&mut self, n: usize) -> (u64, u64) {
        let at = self.offset;
        self.offset += n as u64;
        (self.seed, at)
    }
}

static DEFAULT_GENERATOR: Mutex<Generator> = Mutex::new(Generator {
    seed: 0x6b696c6e,
    offset: 0,
});

/// `torch.manual_seed`: reseeds the default generator.
pub fn manual_seed(seed: u64) {
    *DEFAULT_GENERATOR.lock().unwrap_or_else(|e| e.into_inner()) = Generator::new(seed);
}

/// Reserves `n` values of the default generator: (seed, first offset).
pub fn default_draw(n: usize) -> (u64, u64) {
    DEFAULT_GENERATOR
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .draw(n)
}

/// Moves the default generator to (seed, offset); the tracer rewinds it so a graph's first run
/// draws exactly what the traced eager code drew.
pub fn set_default_generator_state(seed: u64, offset: u64) {
    *DEFAULT_GENERATOR.lock().unwrap_or_else(|e| e.into_inner()) = Generator { seed, offset };
}

impl Tensor {
    pub fn full(shape: &[usize], value: f64, dtype: DType) -> Result<Tensor> {
        Tensor::full_on(shape, value, dtype, Device::Cpu)
    }
    /// `torch.full(shape, value, dtype=dtype, device=device)`.
    pub fn full_on(shape: &[usize], value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        apply_on(
            Prim::Full {
                shape: shape.to_vec(),
                value,
                dtype,
            },
            &[],
            device,
        )
    }
    pub fn zeros_on(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full_on(shape, 0.0, dtype, device)
    }
    pub fn zeros(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::full(shape, 0.0, dtype)
    }
    pub fn ones(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::full(shape, 1.0, dtype)
    }
    /// `torch.ones(shape, device=device)`.
    pub fn ones_on(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full_on(shape, 1.0, dtype, device)
    }
    /// Like PyTorch's `*_like`: the shape, dtype and device of `t`.
    pub fn zeros_like(t: &Tensor) -> Result<Tensor> {
        Tensor::full_on(t.shape(), 0.0, t.dtype(), t.device())
    }
    pub fn ones_like(t: &Tensor) -> Result<Tensor> {
        Tensor::full_on(t.shape(), 1.0, t.dtype(), t.device())
    }
    pub fn full_like(t: &Tensor, value: f64) -> Result<Tensor> {
        Tensor::full_on(t.shape(), value, t.dtype(), t.device())
    }
    /// `torch.arange(start, end, step)`.
    pub fn arange(start: f64, end: f64, step: f64, dtype: DType) -> Result<Tensor> {
        Tensor::arange_on(start, end, step, dtype, Device::Cpu)
    }
    /// `torch.arange(start, end, step, device=device)`: made on the device, so code compiled for a
    /// device captures it in the device's graph (a CPU arange moved over would be a graph break).
    pub fn arange_on(
        start: f64,
        end: f64,
        step: f64,
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
            return Err(Error::arg(
                "arange",
                format!("invalid range start={start} end={end} step={step}"),
            ));
        }
        let n = ((end - start) / step).ceil().max(0.0) as usize;
        let compute = if dtype.is_float() { dtype } else { DType::F64 };
        let i = apply_on(Prim::Iota { n, dtype: compute }, &[], device)?;
        i.mul(step)?.add(start)?.to_dtype(dtype)
    }
    /// `torch.linspace(start, end, steps)`.
    pub fn linspace(start: f64, end: f64, steps: usize, dtype: DType) -> Result<Tensor> {
        Tensor::linspace_on(start, end, steps, dtype, Device::Cpu)
    }
    /// `torch.linspace(start, end, steps, device=device)`.
    pub fn linspace_on(
        start: f64,
        end: f64,
        steps: usize,
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        let i = apply_on(
            Prim::Iota {
                n: steps,
                dtype: DType::F64,
            },
            &[],
            device,
        )?;
        let step = if steps > 1 {
            (end - start) / (steps - 1) as f64
        } else {
            0.0
        };
        i.mul(step)?.add(start)?.to_dtype(dtype)
    }
    fn random(
        shape: &[usize],
        dtype: DType,
        dist: RandDist,
        gen: Option<&mut Generator>,
        device: Device,
    ) -> Result<Tensor> {
        if !dtype.is_float() {
            return Err(Error::dtype(
                "rand",
                dtype,
                "random values need a floating-point dtype",
            ));
        }
        let n = shape.iter().product();
        // an explicit generator is Rust state a replayed graph cannot advance: under a tracer the
        // values are drawn eagerly (outside the trace) and the tracer re-runs the code every call
        let mut _outside = None;
        let (seed, offset) = match gen {
            Some(g) => {
                if let Some(i) = crate::intercept::current() {
                    i.retrace_every_call("a random draw from an explicit Generator");
                    _outside = Some(crate::intercept::install(None));
                }
                g.draw(n)
            }
            None => default_draw(n),
        };
        apply_on(
            Prim::Rand {
                shape: shape.to_vec(),
                dtype,
                dist,
                seed,
                offset,
            },
            &[],
            device,
        )
    }
    /// Uniform on [0, 1), from the default generator.
    pub fn rand(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::random(shape, dtype, RandDist::Uniform, None, Device::Cpu)
    }
    /// Standard normal, from the default generator.
    pub fn randn(shape: &[usize], dtype: DType) -> Result<Tensor> {
        Tensor::random(shape, dtype, RandDist::Normal, None, Device::Cpu)
    }
    /// `torch.rand(shape, device=device)`: the same values on every device for one (seed, offset).
    pub fn rand_on(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::random(shape, dtype, RandDist::Uniform, None, device)
    }
    pub fn randn_on(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::random(shape, dtype, RandDist::Normal, None, device)
    }
    pub fn rand_with(shape: &[usize], dtype: DType, gen: &mut Generator) -> Result<Tensor> {
        Tensor::random(shape, dtype, RandDist::Uniform, Some(gen), Device::Cpu)
    }
    pub fn randn_with(shape: &[usize], dtype: DType, gen: &mut Generator) -> Result<Tensor> {
        Tensor::random(shape, dtype, RandDist::Normal, Some(gen), Device::Cpu)
    }
    /// Uniform on [low, high).
    pub fn uniform(shape: &[usize], low: f64, high: f64, dtype: DType) -> Result<Tensor> {
        Tensor::uniform_on(shape, low, high, dtype, Device::Cpu)
    }
    /// Uniform on [low, high), made on `device` (so a compiled device graph captures it).
    pub fn uniform_on(
        shape: &[usize],
        low: f64,
        high: f64,
        dtype: DType,
        device: Device,
    ) -> Result<Tensor> {
        Tensor::rand_on(shape, dtype, device)?
            .mul(high - low)?
            .add(low)
    }
}
