//! Per-call cost of a compiled module's replay, and how much of it is kiln's own host work.
//!
//! Workload (DESIGN.md, "the workloads"; `../shared/bench/torch_baseline.py`'s `regional`): one
//! Linear 10→10, then 64 × Layer(Linear 10→10, ReLU, sigmoid, Linear 10→10, ReLU) — 129 Linear
//! layers, 258 parameters — on a fixed 10×10 input (the baseline's `torch.randn(10, 10)`).
//!
//! Each figure is per forward call, in two settings: `no_grad` (inference) and a plain forward with
//! grad mode on and parameters requiring grad (what a training step's forward does).
//!
//! - (a) `eager`: the module's own forward.
//! - (b) `compiled`: `kiln::compile(&model, ..)` with the `aot_eager` backend (the default at the
//!   time of writing), after warm-up: guard check, then the captured graph replayed by the eager
//!   interpreter (plus the AOT autograd function node when grads are needed). While the default
//!   backend is another one, (b′) `compiled_default` times `CompileOptions::default()` too.
//! - (c) `host_only`: the same module compiled with a backend whose graphs return output tensors
//!   computed once at compile time, so only kiln's host path is timed: guard evaluation (including
//!   the module's training-flag key), the entry lookup, gathering the graph inputs (parameters by
//!   reference) and wiring the outputs.
//! - (c') `host_only_fn`: (c) through `compile_fn` on a closure calling the module, i.e. without the
//!   training-flag walk that `CompiledModule::forward` does on every call.
//! - (d) `guards_hold`: `Guards::hold` alone, for one argument and 258 captured parameters.
//!
//! (b) - (c) is the interpreter's cost (per-prim dispatch of ~1,000 nodes).
//!
//! Run: cargo bench -p kiln --bench replay_overhead

use std::sync::Arc;
use std::time::Duration;

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use kiln::compiler::guards::Guards;
use kiln::compiler::trace::Source;
use kiln::compiler::BackendChoice;
use kiln::nn::{Linear, Module, ReLU, Sequential, Sigmoid};
use kiln::{
    no_grad, Backend, BackendContext, CompileOptions, CompiledGraph, DType, Graph, Result, Tensor,
};

const LAYERS: usize = 64;
const WIDTH: usize = 10;
const BATCH: usize = 10;
/// The backend of (b): captured graphs run by the eager interpreter.
const INTERPRETER: &str = "aot_eager";

/// Linear(10, 10), then 64 × (Linear, ReLU, sigmoid, Linear, ReLU).
fn model() -> Result<Sequential> {
    let mut m = Sequential::new().add(Linear::new(WIDTH, WIDTH, true)?);
    for _ in 0..LAYERS {
        m.push(
            Sequential::new()
                .add(Linear::new(WIDTH, WIDTH, true)?)
                .add(ReLU::new())
                .add(Sigmoid::new())
                .add(Linear::new(WIDTH, WIDTH, true)?)
                .add(ReLU::new()),
        );
    }
    Ok(m)
}

/// A backend that computes nothing: each compiled graph returns tensors of its output shapes,
/// allocated once at compile time.
struct Precomputed;

struct Canned(Vec<Tensor>);

impl Backend for Precomputed {
    fn name(&self) -> &str {
        "bench_precomputed"
    }
    fn compile(&self, g: &Graph, _: &BackendContext) -> Result<Arc<dyn CompiledGraph>> {
        let outs = g
            .outputs
            .iter()
            .map(|&o| Tensor::zeros(&g.nodes[o].shape, g.nodes[o].dtype))
            .collect::<Result<Vec<_>>>()?;
        Ok(Arc::new(Canned(outs)))
    }
}

impl CompiledGraph for Canned {
    fn run(&self, _inputs: &[Tensor]) -> Result<Vec<Tensor>> {
        Ok(self.0.clone())
    }
}

fn bench(c: &mut Criterion) {
    let m = model().expect("model");
    assert_eq!(
        m.parameters().len(),
        2 * (2 * LAYERS + 1),
        "129 Linear layers"
    );
    let x = Tensor::randn(&[BATCH, WIDTH], DType::F32).expect("randn");
    let interp = CompileOptions::default().backend(INTERPRETER);
    let compiled = kiln::compile(&m, interp).expect("compile");
    let default_is_interp = matches!(
        &CompileOptions::default().backend,
        BackendChoice::Named(n) if n == INTERPRETER
    );
    let default = (!default_is_interp)
        .then(|| kiln::compile(&m, CompileOptions::default()).expect("compile"));
    let opts = CompileOptions::default().custom_backend(Arc::new(Precomputed));
    let host = kiln::compile(&m, opts.clone()).expect("compile");
    let host_fn =
        kiln::compile_fn(|a: &[Tensor]| Ok(vec![m.forward(&a[0])?]), opts).expect("compile_fn");
    let args = std::slice::from_ref(&x);

    // (d) the guards a whole-model entry holds: the argument and every parameter
    let sources: Vec<Source> = std::iter::once(Source::Arg(0))
        .chain(m.parameters().into_iter().map(Source::Captured))
        .collect();

    for (setting, grad) in [("no_grad", false), ("grad", true)] {
        let run = |f: &mut dyn FnMut()| {
            if grad {
                f()
            } else {
                no_grad(f)
            }
        };
        // warm-up: trace + compile once in this grad mode, check compiled == eager, and replays
        let mut check = || {
            let want = m.forward(&x).expect("eager").to_vec::<f32>().expect("vec");
            for _ in 0..3 {
                let got = compiled.forward(&x).expect("compiled");
                assert_eq!(got.requires_grad(), grad);
                assert_eq!(got.to_vec::<f32>().expect("vec"), want, "compiled == eager");
                if let Some(d) = &default {
                    let got = d.forward(&x).expect("compiled (default backend)");
                    let got = got.to_vec::<f32>().expect("vec");
                    let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs());
                    assert!(err.fold(0.0, f32::max) < 1e-5, "compiled == eager");
                }
                host.forward(&x).expect("host");
                host_fn.call(args).expect("host_fn");
            }
        };
        run(&mut check);

        let mut g = c.benchmark_group(format!("replay_129_linear/{setting}"));
        g.sample_size(30)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3));
        g.bench_function("a_eager", |b| {
            run(&mut || b.iter(|| m.forward(black_box(&x)).expect("eager")))
        });
        g.bench_function("b_compiled", |b| {
            run(&mut || b.iter(|| compiled.forward(black_box(&x)).expect("compiled")))
        });
        if let Some(d) = &default {
            g.bench_function("b2_compiled_default", |b| {
                run(&mut || b.iter(|| d.forward(black_box(&x)).expect("compiled")))
            });
        }
        g.bench_function("c_host_only", |b| {
            run(&mut || b.iter(|| host.forward(black_box(&x)).expect("host")))
        });
        g.bench_function("c2_host_only_fn", |b| {
            run(&mut || b.iter(|| host_fn.call(black_box(args)).expect("host_fn")))
        });
        g.bench_function("d_guards_hold", |b| {
            run(&mut || {
                let guards = Guards::new(args, &sources, 0);
                b.iter(|| assert!(guards.hold(black_box(args), 0)))
            })
        });
        g.finish();
    }

    for (name, f) in [
        ("compiled", compiled.stats()),
        ("host_only", host.stats()),
        ("host_only_fn", host_fn.stats()),
    ] {
        assert_eq!((f.traces, f.compiles), (2, 2), "{name}: one per grad mode");
        assert!(f.replays > 0 && f.eager_fallbacks == 0, "{name}: {f:?}");
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
