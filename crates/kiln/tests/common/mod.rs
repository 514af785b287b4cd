//! Differential harness: runs a function of tensors compiled (`compile_fn`, default `aot_eager`
//! backend) and eagerly on the same inputs and checks outputs, gradients, mutated state and the
//! compiled function's trace/replay counters.

#![allow(dead_code)] // each test binary uses part of the harness

use std::sync::{Mutex, MutexGuard};

#[path = "../../../kiln-core/tests/support/mock_device.rs"]
mod mock_device;

use kiln::core::storage::CpuStorage;
use kiln::prelude::*;
use kiln::{compile_fn, FnStats};

/// A seeded SplitMix64 stream: test inputs never touch kiln's default generator, so only tests that
/// ask for it (dropout, rand) depend on `manual_seed`.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e3779b97f4a7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58476d1ce4e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d049bb133111eb);
        z ^ (z >> 31)
    }
    /// Uniform on [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    pub fn normal(&mut self) -> f64 {
        let u = self.uniform().max(1e-300);
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (2.0 * std::f64::consts::PI * v).cos()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    fn f32s(&mut self, shape: &[usize], mut f: impl FnMut(&mut Rng) -> f64) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|_| f(self) as f32).collect();
        Tensor::from_vec(v, shape).unwrap()
    }
    /// Standard normal f32 values.
    pub fn randn(&mut self, shape: &[usize]) -> Tensor {
        self.f32s(shape, Rng::normal)
    }
    /// f32 values in [0.2, 2.2): inside the domain of log, sqrt, reciprocal, pow.
    pub fn positive(&mut self, shape: &[usize]) -> Tensor {
        self.f32s(shape, |r| 0.2 + 2.0 * r.uniform())
    }
    /// f32 values on a coarse grid (multiples of 0.5 in [-2, 2]): many exact ties and zeros, to
    /// exercise tie-breaking of max/min/argmax and the gradient at the kinks of relu/abs/clamp.
    pub fn ties(&mut self, shape: &[usize]) -> Tensor {
        self.f32s(shape, |r| (r.below(9) as f64 - 4.0) * 0.5)
    }
    /// int64 values in [lo, hi).
    pub fn ints(&mut self, shape: &[usize], lo: i64, hi: i64) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<i64> = (0..n)
            .map(|_| lo + (self.next_u64() % (hi - lo) as u64) as i64)
            .collect();
        Tensor::from_vec(v, shape).unwrap()
    }
    pub fn bools(&mut self, shape: &[usize]) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<bool> = (0..n).map(|_| self.next_u64() & 1 == 1).collect();
        Tensor::from_vec(v, shape).unwrap()
    }
    /// A seeded permutation of 0..n.
    pub fn perm(&mut self, n: usize) -> Vec<usize> {
        let mut p: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            p.swap(i, self.below(i + 1));
        }
        p
    }
}

type ViewFn = Box<dyn Fn(&Tensor) -> Result<Tensor>>;

/// One argument: a leaf tensor (its values), whether it requires grad, and an optional view taken of
/// the leaf to form the argument (a transposed or narrowed or expanded view: non-contiguous). With
/// `grad`, gradients are compared on the leaf, so they flow through the view.
pub struct In {
    pub base: Tensor,
    pub grad: bool,
    pub view: Option<ViewFn>,
}

impl In {
    /// An argument that does not require grad.
    pub fn val(t: Tensor) -> In {
        In {
            base: t,
            grad: false,
            view: None,
        }
    }
    /// An argument that requires grad.
    pub fn grad(t: Tensor) -> In {
        In {
            base: t,
            grad: true,
            view: None,
        }
    }
    pub fn view(mut self, f: impl Fn(&Tensor) -> Result<Tensor> + 'static) -> In {
        self.view = Some(Box::new(f));
        self
    }
}

/// How an argument of a given shape is laid out in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lay {
    /// A fresh contiguous tensor.
    C,
    /// The transpose of a tensor whose last two dims are swapped (rank >= 2).
    T,
    /// A strided slice: every other element of the last dim of a larger tensor.
    S,
    /// A size-1 dim 0 expanded (stride 0) to the requested size.
    E,
}

/// Value distributions for float arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gen {
    Normal,
    Positive,
    Ties,
    /// Uniform on [0, 1) (probabilities, binary targets).
    Unit,
}

impl Rng {
    pub fn gen(&mut self, g: Gen, shape: &[usize]) -> Tensor {
        match g {
            Gen::Normal => self.randn(shape),
            Gen::Positive => self.positive(shape),
            Gen::Ties => self.ties(shape),
            Gen::Unit => self.f32s(shape, Rng::uniform),
        }
    }
    /// A float argument of `shape` with layout `lay`.
    pub fn arg(&mut self, g: Gen, shape: &[usize], lay: Lay, grad: bool) -> In {
        let shape = shape.to_vec();
        let r = shape.len();
        let (base_shape, view): (Vec<usize>, Option<ViewFn>) = match lay {
            Lay::C => (shape.clone(), None),
            Lay::T => {
                assert!(r >= 2, "Lay::T needs rank >= 2");
                let mut b = shape.clone();
                b.swap(r - 2, r - 1);
                (b, Some(Box::new(|t: &Tensor| t.transpose(-2, -1))))
            }
            Lay::S => {
                assert!(r >= 1, "Lay::S needs rank >= 1");
                let mut b = shape.clone();
                let n = b[r - 1];
                b[r - 1] = 2 * n + 1;
                (
                    b,
                    Some(Box::new(move |t: &Tensor| {
                        t.slice(-1, 1, 1 + 2 * n as isize, 2)
                    })),
                )
            }
            Lay::E => {
                assert!(r >= 1, "Lay::E needs rank >= 1");
                let mut b = shape.clone();
                b[0] = 1;
                let s = shape.clone();
                (b, Some(Box::new(move |t: &Tensor| t.expand(&s))))
            }
        };
        In {
            base: self.gen(g, &base_shape),
            grad,
            view,
        }
    }
}

/// A new leaf with its own storage holding `t`'s values, on the device the tests run on (see
/// `test_device`): the compiled and the eager run must not see each other's writes.
pub fn deep_copy(t: &Tensor) -> Tensor {
    let values = t.to_vec_f64().unwrap().into_iter();
    let host = Tensor::from_storage(CpuStorage::from_f64s(t.dtype(), values), t.shape()).unwrap();
    host.to(test_device()).unwrap()
}

/// Where the differential tests put their arguments: the CPU, the GPU when
/// `KILN_TEST_DEVICE=cuda`, or a mock device (host memory, CPU kernels, compiled graphs on the
/// interpreter: the capture's device plumbing without a GPU) when `KILN_TEST_DEVICE=mock` (the GPU machine runs the whole op suite so: compiled CUDA kernels
/// against eager CUDA kernels; see ARCHITECTURE.md). Ops that create tensors without a device
/// argument create them on the CPU, as PyTorch's do.
pub fn test_device() -> Device {
    static DEVICE: std::sync::OnceLock<Device> = std::sync::OnceLock::new();
    *DEVICE.get_or_init(|| match std::env::var("KILN_TEST_DEVICE").as_deref() {
        Ok("cuda") => {
            kiln::cuda::init();
            // compiled against eager with f32 precision: convolutions too (TF32 is cuDNN's default)
            kiln::cuda::set_cudnn_allow_tf32(false);
            Device::Cuda(0)
        }
        Ok("mock") => {
            mock_device::setup();
            mock_device::DEV
        }
        _ => Device::Cpu,
    })
}

/// Element-wise comparison; `tol == 0.0` means bitwise (NaNs of any payload match each other).
pub fn assert_same(what: &str, got: &Tensor, want: &Tensor, tol: f64) {
    assert_close(what, got, want, tol, false);
}

/// `assert_same`, with the tolerance relative to each element's magnitude, or with `of_max` to
/// the tensor's largest (sums with cancellation: an element near zero carries the rounding error
/// of its large terms).
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, tol: f64, of_max: bool) {
    assert_eq!(got.shape(), want.shape(), "{what}: shape");
    assert_eq!(got.dtype(), want.dtype(), "{what}: dtype");
    let (x, y) = (got.to_vec_f64().unwrap(), want.to_vec_f64().unwrap());
    let largest = match of_max {
        true => y
            .iter()
            .filter(|v| v.is_finite())
            .fold(0f64, |m, v| m.max(v.abs())),
        false => 0.0,
    };
    for (i, (p, q)) in x.iter().zip(&y).enumerate() {
        let ok = if p.is_nan() || q.is_nan() {
            p.is_nan() && q.is_nan()
        } else if tol == 0.0 {
            p.to_bits() == q.to_bits()
        } else {
            p == q || (p - q).abs() <= tol * p.abs().max(q.abs()).max(largest)
        };
        assert!(
            ok,
            "{what}: element {i} differs: compiled {p:e} vs eager {q:e} (tolerance {tol:e}, shape {:?})",
            want.shape()
        );
    }
}

/// The options every compiled function here is built with: `CompileOptions::default()` (the default
/// backend), or the backend named by `$KILN_TEST_BACKEND` (e.g. `aot_eager`), to hold another
/// backend to the same checks, in the mode named by `$KILN_TEST_MODE` (`reduce-overhead`,
/// `max-autotune`, ...; default when unset), to hold every mode to them.
///
/// On a GPU, small matmuls stay cuBLAS calls here (`inline_small_matmuls` off): the suite
/// compares bitwise, and a generated matmul sums in double where cuBLAS rounds in f32. The
/// generated ones are checked against eager and a float64 reference by `tests/small_matmul.rs`
/// (`KILN_TEST_DEVICE=cuda` runs it on the GPU) and `tests/gpu_compile.rs`.
pub fn compile_options() -> CompileOptions {
    let opts = match std::env::var("KILN_TEST_BACKEND") {
        Ok(name) if !name.is_empty() => CompileOptions::default().backend(&name),
        _ => CompileOptions::default(),
    };
    let opts = opts.mode(test_mode());
    match test_device() {
        Device::Cuda(_) => opts.option(kiln::inductor::INLINE_SMALL_MATMULS, "false"),
        _ => opts,
    }
}

/// The mode `$KILN_TEST_MODE` names (torch.compile's names), the default mode when unset.
pub fn test_mode() -> Mode {
    match std::env::var("KILN_TEST_MODE") {
        Ok(name) if !name.is_empty() => match Mode::from_name(&name) {
            Some(m) => m,
            None => panic!("KILN_TEST_MODE={name:?} names no mode"),
        },
        _ => Mode::Default,
    }
}

/// The tolerance every comparison gets at least: 0 (bitwise), except on a GPU in a mode that
/// records CUDA graphs or tunes launch shapes, 1e-5 relative (a few ulps of f32 over these
/// cases' short sums): max-autotune's tuned launch shapes may split a reduction into other
/// chunks (its sums add in another order), and while a graph records, cuBLAS may pick another
/// kernel for a matmul than it runs eagerly (seen: an ulp apart where both operands are
/// transposed; `gpu_compile`'s `reduce_overhead_matmuls_match_eager`).
fn mode_tolerance() -> f64 {
    match (test_device(), test_mode()) {
        (Device::Cuda(_), Mode::Default) => 0.0,
        (Device::Cuda(_), _) => 1e-5,
        _ => 0.0,
    }
}

/// Serializes the tests that read kiln's process-wide default generator (when `cargo test` runs
/// tests of one binary on several threads).
pub fn default_rng_lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// One differential check: `f` compiled and eager, on `calls` fresh input sets of one shape.
pub struct Case {
    name: String,
    fwd_tol: f64,
    grad_tol: f64,
    /// Tolerances relative to each tensor's largest element (`assert_close`).
    tol_of_max: bool,
    seed: Option<u64>,
    calls: usize,
    errs: bool,
    retraced: bool,
}

impl Case {
    pub fn new(name: impl Into<String>) -> Case {
        Case {
            name: name.into(),
            fwd_tol: mode_tolerance(),
            grad_tol: mode_tolerance(),
            tol_of_max: false,
            seed: None,
            calls: 2,
            errs: false,
            retraced: false,
        }
    }
    /// Relative tolerance for forward outputs (default: bitwise).
    pub fn fwd_tol(mut self, t: f64) -> Case {
        self.fwd_tol = t.max(mode_tolerance());
        self
    }
    /// For ops that sum by atomic adds on a GPU (scatter_add, and the backward of gather,
    /// index_select and embedding where indices repeat): eager and compiled each add in the order
    /// the threads arrive, as PyTorch's CUDA kernels do outside deterministic mode, so on a GPU
    /// outputs and gradients agree to a few ulps (1e-5 relative), not to the bit. Bitwise on
    /// the CPU.
    pub fn atomic_sums(self) -> Case {
        match test_device() {
            Device::Cuda(_) => self.fwd_tol(1e-5).grad_tol(1e-5),
            _ => self,
        }
    }
    /// Relative tolerance for gradients (default: bitwise).
    pub fn grad_tol(mut self, t: f64) -> Case {
        self.grad_tol = t.max(mode_tolerance());
        self
    }
    /// The tolerances relative to each compared tensor's largest element.
    pub fn tol_of_max(mut self) -> Case {
        self.tol_of_max = true;
        self
    }
    /// `manual_seed(seed + call)` before each compiled and each eager run.
    pub fn seeded(mut self, seed: u64) -> Case {
        self.seed = Some(seed);
        self
    }
    pub fn calls(mut self, n: usize) -> Case {
        self.calls = n;
        self
    }
    /// `f` reads Rust state a replay cannot reproduce (an explicit `Generator`): it is traced on
    /// every call instead of replayed.
    pub fn retraced(mut self) -> Case {
        self.retraced = true;
        self
    }
    /// The op rejects these inputs: eager and compiled must both fail, with the same message.
    pub fn errs(mut self) -> Case {
        self.errs = true;
        self
    }

    /// Checks a stateless `f`; `make` draws a fresh set of arguments (same shapes on every call).
    pub fn run<F, M>(self, rng: &mut Rng, f: F, make: M)
    where
        F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync,
        M: Fn(&mut Rng) -> Vec<In>,
    {
        self.run_stateful(rng, || (), |_: &(), a: &[Tensor]| f(a), |_| vec![], make)
    }

    /// Checks `f` that reads and updates state (running statistics, a parameter): the compiled and
    /// the eager run each get their own state from `init`, and `state` lists the tensors compared
    /// after every call.
    pub fn run_stateful<S, I, F, G, M>(self, rng: &mut Rng, init: I, f: F, state: G, make: M)
    where
        S: Sync,
        I: Fn() -> S,
        F: Fn(&S, &[Tensor]) -> Result<Vec<Tensor>> + Send + Sync,
        G: Fn(&S) -> Vec<Tensor>,
        M: Fn(&mut Rng) -> Vec<In>,
    {
        let name = &self.name;
        let _lock = self.seed.map(|_| default_rng_lock());
        let (state_c, state_e) = (init(), init());
        let (fr, sc) = (&f, &state_c);
        let compiled = compile_fn(move |a: &[Tensor]| fr(sc, a), compile_options())
            .unwrap_or_else(|e| panic!("{name}: compile_fn: {e}"));
        let mut shapes: Option<Vec<Vec<usize>>> = None;
        for call in 0..self.calls {
            let what = format!("{name} (call {call})");
            let ins = make(rng);
            let now: Vec<Vec<usize>> = ins.iter().map(|i| i.base.shape().to_vec()).collect();
            match &shapes {
                None => shapes = Some(now),
                Some(s) => assert_eq!(s, &now, "{what}: make() must keep shapes"),
            }
            let leaves = |ins: &[In]| -> (Vec<Tensor>, Vec<Tensor>) {
                let leaves: Vec<Tensor> = ins
                    .iter()
                    .map(|i| {
                        let t = deep_copy(&i.base);
                        t.set_requires_grad(i.grad).unwrap();
                        t
                    })
                    .collect();
                let args = ins
                    .iter()
                    .zip(&leaves)
                    .map(|(i, t)| match &i.view {
                        Some(v) => v(t).unwrap(),
                        None => t.clone(),
                    })
                    .collect();
                (leaves, args)
            };
            let (leaves_c, args_c) = leaves(&ins);
            let (leaves_e, args_e) = leaves(&ins);

            let before = compiled.stats();
            if let Some(s) = self.seed {
                manual_seed(s + call as u64);
            }
            let out_c = compiled.call(&args_c);
            let after = compiled.stats();
            if let Some(s) = self.seed {
                manual_seed(s + call as u64);
            }
            let out_e = f(&state_e, &args_e);
            let (out_c, out_e) = match (out_c, out_e) {
                (Err(c), Err(e)) if self.errs => {
                    assert_eq!(c.to_string(), e.to_string(), "{what}: error messages");
                    continue;
                }
                (Ok(_), Ok(_)) if self.errs => panic!("{what}: expected an error"),
                (Ok(c), Ok(e)) => (c, e),
                (c, e) => panic!(
                    "{what}: compiled {} vs eager {}",
                    c.map_or_else(|e| e.to_string(), |_| "ok".into()),
                    e.map_or_else(|e| e.to_string(), |_| "ok".into())
                ),
            };
            check_stats(&what, call, &before, &after, self.retraced);

            assert_eq!(out_c.len(), out_e.len(), "{what}: number of outputs");
            for (k, (c, e)) in out_c.iter().zip(&out_e).enumerate() {
                let what = format!("{what}: output {k}");
                assert_close(&what, c, e, self.fwd_tol, self.tol_of_max);
                assert_eq!(
                    c.requires_grad(),
                    e.requires_grad(),
                    "{what}: output {k} requires_grad"
                );
            }
            // arguments as the call left them (an op that writes into an argument)
            for (k, (c, e)) in args_c.iter().zip(&args_e).enumerate() {
                assert_same(&format!("{what}: argument {k} after the call"), c, e, 0.0);
            }
            for (k, (c, e)) in state(&state_c).iter().zip(&state(&state_e)).enumerate() {
                let what = format!("{what}: state {k}");
                assert_close(&what, c, e, self.fwd_tol, self.tol_of_max);
            }

            // backward of sum(out_k * w_k) with random weights w_k, through every differentiable output
            let weights: Vec<Option<Tensor>> = out_e
                .iter()
                .map(|o| {
                    o.requires_grad().then(|| {
                        let w = rng.randn(o.shape()).to_dtype(o.dtype()).unwrap();
                        w.to(o.device()).unwrap()
                    })
                })
                .collect();
            if weights.iter().all(Option::is_none) {
                continue;
            }
            let loss = |outs: &[Tensor]| -> Tensor {
                let mut total: Option<Tensor> = None;
                for (o, w) in outs.iter().zip(&weights) {
                    if let Some(w) = w {
                        let l = o.mul(w).unwrap().sum_all().unwrap();
                        total = Some(match total {
                            Some(t) => t.add(&l).unwrap(),
                            None => l,
                        });
                    }
                }
                total.unwrap()
            };
            loss(&out_c)
                .backward()
                .unwrap_or_else(|e| panic!("{what}: compiled backward failed: {e}"));
            loss(&out_e)
                .backward()
                .unwrap_or_else(|e| panic!("{what}: eager backward failed: {e}"));
            assert!(
                ins.iter().all(|i| !i.grad) || leaves_e.iter().any(|l| l.grad().is_some()),
                "{what}: a differentiable output but no input got a gradient"
            );
            for (k, (c, e)) in leaves_c.iter().zip(&leaves_e).enumerate() {
                match (c.grad(), e.grad()) {
                    (Some(gc), Some(ge)) => assert_close(
                        &format!("{what}: grad of input {k}"),
                        &gc,
                        &ge,
                        self.grad_tol,
                        self.tol_of_max,
                    ),
                    (None, None) => {}
                    (gc, ge) => panic!(
                        "{what}: grad of input {k}: compiled {:?} vs eager {:?}",
                        gc.map(|g| g.shape().to_vec()),
                        ge.map(|g| g.shape().to_vec())
                    ),
                }
            }
        }
        // On a GPU (not the mock device, whose graphs all run on the interpreter) every graph
        // must run as generated kernels: one that fell back to the interpreter still gives
        // right answers, so only this count tells (process-wide, so a fallback fails whichever
        // test looks next; stderr names the graph and why).
        if std::env::var("KILN_TEST_DEVICE").as_deref() == Ok("cuda") {
            let interpreted = kiln::inductor::interpreted_graphs();
            assert_eq!(interpreted, 0, "{name}: compiled graphs on the interpreter");
        }
    }
}

fn check_stats(what: &str, call: usize, before: &FnStats, after: &FnStats, retraced: bool) {
    assert_eq!(after.graph_breaks, 0, "{what}: graph breaks: {after:?}");
    assert_eq!(
        after.eager_fallbacks, 0,
        "{what}: eager fallbacks: {after:?}"
    );
    if retraced {
        assert_eq!(
            (after.traces, after.replays),
            (call + 1, 0),
            "{what}: code reading unreplayable Rust state is traced on every call"
        );
    } else if call == 0 {
        assert_eq!(
            (after.traces, after.compiles, after.replays),
            (1, 1, 0),
            "{what}: the first call traces and compiles once"
        );
    } else {
        assert_eq!(
            (after.traces, after.compiles, after.replays),
            (1, 1, before.replays + 1),
            "{what}: a later call with the same shapes must be a replay"
        );
    }
}
