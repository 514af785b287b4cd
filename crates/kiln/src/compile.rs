//! `kiln::compile(&module, opts)`: a compiled module is itself a `Module`, so it drops into existing
//! code; its parameters are the original module's (optimizers see the same tensors).

use kiln_compile::{CompileOptions, CompiledFn, ExplainOutput, FnStats};
use kiln_core::{Error, Result, Tensor};
use kiln_nn::{Module, TensorKind, TrainFlag};

pub struct CompiledModule<'m> {
    inner: &'m dyn Module,
    func: CompiledFn<'m>,
    /// (training-flag generation, training key) of the last call: walking every submodule costs
    /// more than the rest of a replay, and the flags rarely change.
    key: std::sync::Mutex<Option<(u64, u64)>>,
}

/// `torch.compile(model)`.
pub fn compile<'m, M: Module>(module: &'m M, opts: CompileOptions) -> Result<CompiledModule<'m>> {
    let inner: &'m dyn Module = module;
    let name = std::any::type_name::<M>()
        .rsplit("::")
        .next()
        .unwrap_or("module")
        .to_string();
    let func = compile_named(
        &name,
        move |args: &[Tensor]| {
            let x = args
                .first()
                .ok_or_else(|| Error::arg("forward", "expects one input tensor"))?;
            Ok(vec![inner.forward(x)?])
        },
        opts,
    )?;
    Ok(CompiledModule {
        inner,
        func,
        key: std::sync::Mutex::new(None),
    })
}

/// `torch.compile(fn)`: wraps `f`; nothing is traced until the first call.
pub fn compile_fn<'f, F>(f: F, opts: CompileOptions) -> Result<CompiledFn<'f>>
where
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'f,
{
    compile_named("fn", f, opts)
}

/// `compile_fn` with a name for logs, debug dumps and `explain`.
pub fn compile_named<'f, F>(name: &str, f: F, opts: CompileOptions) -> Result<CompiledFn<'f>>
where
    F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + 'f,
{
    // the default backend, `kiln`, lives in kiln-inductor, above the capture crate
    kiln_inductor::register();
    kiln_compile::compile_named(name, f, opts)
}

/// `torch._dynamo.list_backends()`: the registered backend names (`kiln` included).
pub fn list_backends() -> Vec<String> {
    kiln_inductor::register();
    kiln_compile::list_backends()
}

/// A fingerprint of every submodule's training flag: the traced code branches on them
/// (dropout, batch norm), so they are guarded like tensor metadata.
fn training_key(m: &dyn Module) -> u64 {
    fn walk(m: &dyn Module, acc: &mut u64, n: &mut u32) {
        *acc = acc.rotate_left(1) ^ (m.is_training() as u64) ^ ((*n as u64) << 32);
        *n += 1;
        for (_, c) in m.children() {
            walk(c, acc, n);
        }
    }
    let (mut acc, mut n) = (0x6b696c6e, 0);
    walk(m, &mut acc, &mut n);
    acc
}

impl<'m> CompiledModule<'m> {
    fn training_key(&self) -> u64 {
        let generation = kiln_nn::train_flag_generation();
        let mut cached = self.key.lock().unwrap_or_else(|e| e.into_inner());
        match *cached {
            Some((g, k)) if g == generation => k,
            _ => {
                let k = training_key(self.inner);
                *cached = Some((generation, k));
                k
            }
        }
    }
    pub fn stats(&self) -> FnStats {
        self.func.stats()
    }
    /// `kiln::explain` of the module's forward on `x`, with the compiled module's cache entries
    /// (static or symbolic: symbols, guards, sizes seen).
    pub fn explain(&self, x: &Tensor) -> Result<ExplainOutput> {
        self.func.explain(std::slice::from_ref(x))
    }
    pub fn original(&self) -> &'m dyn Module {
        self.inner
    }
}

impl Module for CompiledModule<'_> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut out = self
            .func
            .call_keyed(std::slice::from_ref(x), self.training_key())?;
        out.pop()
            .ok_or_else(|| Error::arg("forward", "compiled module produced no output"))
    }
    fn train_flag(&self) -> &TrainFlag {
        self.inner.train_flag()
    }
    fn visit_own(&self, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        self.inner.visit_own(f)
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        self.inner.children()
    }
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        self.inner.visit(prefix, f)
    }
    fn train(&self, mode: bool) {
        self.inner.train(mode)
    }
}
