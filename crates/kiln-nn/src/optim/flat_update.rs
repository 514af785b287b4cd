//! A foreach optimizer's flat update, compiled once into generated kernels on a device.
//!
//! Run eagerly, the update rule (`adam::update`) is about fifteen elementwise ops, each a pass over
//! every parameter of the group: on a GPU that is the step's cost (PyTorch's foreach Adam runs about
//! eight multi-tensor kernels; its `fused=True`, one). The same rule traced by kiln-compile's
//! `compile_fn` becomes one fused kernel that reads the flat parameter, gradient and moments once
//! and writes them once. Nothing is defined twice: the compiled function calls the eager rule.
//!
//! The compiled function is pure (new tensors out, nothing written in place), so when it cannot be
//! built — no `kiln` backend registered (kiln-nn used without the facade), a compile error — the
//! eager rule runs on the same inputs and the step's result is the same up to rounding. Eager on the
//! CPU, Adam does not come here: it updates member by member (`adam.rs`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use kiln_compile::{compile_named, CompileOptions, CompiledFn};
use kiln_core::{intercept, Result, Tensor};

type Rule = dyn Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync;

pub(crate) struct FlatUpdate {
    name: &'static str,
    /// `None` until the first device step; `Some(None)` once building or running it failed.
    compiled: Mutex<Option<Option<CompiledFn<'static>>>>,
    /// Calls the compiled function answered.
    calls: AtomicU64,
}

impl FlatUpdate {
    pub fn new(name: &'static str) -> FlatUpdate {
        FlatUpdate {
            name,
            compiled: Mutex::new(None),
            calls: AtomicU64::new(0),
        }
    }

    /// How many calls the compiled function answered (the others ran the eager rule).
    pub fn compiled_calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// `rule(inputs)`, through the compiled function where one applies.
    pub fn run<F>(&self, inputs: &[Tensor], rule: F) -> Result<Vec<Tensor>>
    where
        F: Fn(&[Tensor]) -> Result<Vec<Tensor>> + Send + Sync + Clone + 'static,
    {
        // inside a step being traced (a compiled `opt.step()`), the rule's ops are what the
        // caller wants recorded
        if intercept::current().is_some() {
            return rule(inputs);
        }
        let mut slot = self.compiled.lock().unwrap_or_else(|e| e.into_inner());
        let compiled = slot.get_or_insert_with(|| self.build(Box::new(rule.clone())));
        let Some(f) = compiled else {
            return rule(inputs);
        };
        match f.call(inputs) {
            Ok(out) => {
                self.calls.fetch_add(1, Ordering::Relaxed);
                Ok(out)
            }
            Err(e) => {
                // the compiled function wrote nothing: the eager rule starts from the same state
                eprintln!(
                    "kiln: {}'s compiled update failed ({e}); this optimizer runs its update \
                     eagerly from now on",
                    self.name
                );
                *compiled = None;
                rule(inputs)
            }
        }
    }

    fn build(&self, rule: Box<Rule>) -> Option<CompiledFn<'static>> {
        // fails without the `kiln` backend, which the facade registers (`kiln::compile`,
        // `kiln::cuda::init`): kiln-nn alone has none. Not `fullgraph`: the rule has no graph
        // break, and on a device whose kernels cannot be generated the backend then runs the
        // graph on its interpreter instead of failing every call
        let opts = CompileOptions::default();
        compile_named(self.name, move |xs: &[Tensor]| rule(xs), opts).ok()
    }
}
