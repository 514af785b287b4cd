//! The `Module` trait: PyTorch's `nn.Module` contract. A module lists its own tensors (`visit_own`)
//! and its children (`children`); everything else — dotted names, state dicts, train/eval, zero_grad —
//! is derived from those two, so a user module only has to describe its structure once.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};

use kiln_core::{Device, Error, Result, Tensor};

use crate::StateDict;

/// Whether a named tensor is learned (a parameter) or carried state (a buffer, like running_mean).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorKind {
    Parameter,
    Buffer,
}

/// A module's `training` attribute. Atomic so `train()`/`eval()` work through `&self` on modules that
/// are shared between threads (the trait is `Send + Sync`).
#[derive(Debug)]
pub struct TrainFlag(AtomicBool);

impl Default for TrainFlag {
    /// Modules start in training mode, as in PyTorch.
    fn default() -> Self {
        TrainFlag(AtomicBool::new(true))
    }
}

/// Bumped on every change of any module's training flag, so a compiled module can tell in one
/// load that the flags it guards on are unchanged since its last call.
static TRAIN_FLAG_GENERATION: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The current training-flag generation (see `TrainFlag::set`).
pub fn train_flag_generation() -> u64 {
    TRAIN_FLAG_GENERATION.load(Ordering::Acquire)
}

impl TrainFlag {
    pub fn get(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
    pub fn set(&self, on: bool) {
        if self.0.swap(on, Ordering::AcqRel) != on {
            TRAIN_FLAG_GENERATION.fetch_add(1, Ordering::AcqRel);
        }
    }
}

/// `prefix.name`, or `name` at the root.
pub fn join_name(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

pub trait Module: Send + Sync {
    fn forward(&self, x: &Tensor) -> Result<Tensor>;

    /// This module's training flag (each module owns one; `train` propagates it to children).
    fn train_flag(&self) -> &TrainFlag;

    /// This module's own parameters and buffers, without children: parameters first, then buffers,
    /// each in registration order — the order of PyTorch's `state_dict`.
    fn visit_own(&self, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        let _ = f;
    }

    /// Direct submodules with their attribute names ("0", "1", .. in containers).
    fn children(&self) -> Vec<(String, &dyn Module)> {
        Vec::new()
    }

    /// Every parameter and buffer of the tree with its dotted name, parents before children.
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        self.visit_own(&mut |name, t, kind| f(&join_name(prefix, name), t, kind));
        for (name, child) in self.children() {
            child.visit(&join_name(prefix, &name), f);
        }
    }

    /// `visit_own` with mutable access, so `to(device)` can replace the handles. A module that
    /// holds tensors implements it beside `visit_own`, listing the same tensors in the same order;
    /// `to` checks that the two agree and moves nothing when they do not.
    fn visit_own_mut(&mut self, f: &mut dyn FnMut(&str, &mut Tensor, TensorKind)) {
        let _ = f;
    }

    /// `children` with mutable access (same names, same order), for `to(device)`.
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        Vec::new()
    }

    /// `visit` with mutable access: every tensor the tree reaches through `visit_own_mut` and
    /// `children_mut`, with its dotted name.
    fn visit_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor, TensorKind)) {
        self.visit_own_mut(&mut |name, t, kind| f(&join_name(prefix, name), t, kind));
        for (name, child) in self.children_mut() {
            child.visit_mut(&join_name(prefix, &name), f);
        }
    }

    /// `model.to(device)`: every parameter and buffer moves to `device`, under the same names; a
    /// parameter stays a leaf with `requires_grad` and its `.grad` moves with it; tied weights
    /// stay tied. All copies are made before any is installed, so on `Err` (no runtime for the
    /// device, a module that does not implement `visit_own_mut` / `children_mut`) the module is
    /// unchanged.
    ///
    /// Unlike PyTorch, which swaps `param.data` under the same Parameter, the module gets new
    /// handles: tensors taken from it before the move (an optimizer's parameter list) still
    /// refer to the old copies. Move the model first, then build its optimizer (PyTorch's own
    /// advice for optimizers).
    fn to(&mut self, device: Device) -> Result<()> {
        crate::module_to::move_module(self, device)
    }

    /// `named_parameters()`: a parameter shared by several modules (tied weights) is listed once,
    /// under its first name, so an optimizer never updates it twice.
    fn named_parameters(&self) -> Vec<(String, Tensor)> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        self.visit("", &mut |name, t, kind| {
            if kind == TensorKind::Parameter && seen.insert(t.id()) {
                out.push((name.to_string(), t.clone()));
            }
        });
        out
    }

    fn parameters(&self) -> Vec<Tensor> {
        self.named_parameters()
            .into_iter()
            .map(|(_, t)| t)
            .collect()
    }

    fn named_buffers(&self) -> Vec<(String, Tensor)> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        self.visit("", &mut |name, t, kind| {
            if kind == TensorKind::Buffer && seen.insert(t.id()) {
                out.push((name.to_string(), t.clone()));
            }
        });
        out
    }

    fn buffers(&self) -> Vec<Tensor> {
        self.named_buffers().into_iter().map(|(_, t)| t).collect()
    }

    /// Total number of parameter elements.
    fn num_parameters(&self) -> usize {
        self.parameters().iter().map(|t| t.numel()).sum()
    }

    /// `state_dict()`: parameters and buffers under every name they have (tied weights appear twice,
    /// as in PyTorch). The tensors are handles to the live values, not copies.
    fn state_dict(&self) -> StateDict {
        let mut sd = StateDict::new();
        self.visit("", &mut |name, t, _| {
            sd.insert(name, t.detach());
        });
        sd
    }

    /// `load_state_dict(sd, strict)`: copies values in place, so parameters keep their identity.
    /// Every key and shape is checked before anything is written: on error the module is unchanged.
    /// Shape mismatches are errors even when `strict` is false, as in PyTorch.
    fn load_state_dict(&self, sd: &StateDict, strict: bool) -> Result<()> {
        let mut targets: Vec<(String, Tensor)> = Vec::new();
        self.visit("", &mut |name, t, _| {
            targets.push((name.to_string(), t.clone()))
        });
        let mut missing = Vec::new();
        let mut mismatched = Vec::new();
        let mut plan = Vec::new();
        for (name, dst) in &targets {
            match sd.get(name) {
                None => missing.push(name.clone()),
                Some(src) if src.shape() != dst.shape() => mismatched.push(format!(
                    "size mismatch for {name}: copying a param with shape {:?} from checkpoint, \
                     the shape in current model is {:?}",
                    src.shape(),
                    dst.shape()
                )),
                Some(src) => plan.push((dst, src)),
            }
        }
        let known: HashSet<&str> = targets.iter().map(|(n, _)| n.as_str()).collect();
        let unexpected: Vec<&str> = sd.keys().filter(|k| !known.contains(k)).collect();
        let mut errors = Vec::new();
        if strict && !missing.is_empty() {
            errors.push(format!(
                "Missing key(s) in state_dict: {}",
                quoted(&missing)
            ));
        }
        if strict && !unexpected.is_empty() {
            errors.push(format!(
                "Unexpected key(s) in state_dict: {}",
                quoted(&unexpected)
            ));
        }
        errors.extend(mismatched);
        if !errors.is_empty() {
            return Err(Error::arg(
                "load_state_dict",
                format!("Error(s) in loading state_dict: {}", errors.join(". ")),
            ));
        }
        kiln_core::no_grad(|| plan.iter().try_for_each(|(dst, src)| dst.assign(src)))
    }

    /// `zero_grad()` with PyTorch's default `set_to_none=True`.
    fn zero_grad(&self) {
        for p in self.parameters() {
            p.zero_grad();
        }
    }

    /// `train(mode)`: sets this module and every descendant.
    fn train(&self, mode: bool) {
        self.train_flag().set(mode);
        for (_, child) in self.children() {
            child.train(mode);
        }
    }

    fn eval(&self) {
        self.train(false)
    }

    fn is_training(&self) -> bool {
        self.train_flag().get()
    }
}

fn quoted<S: AsRef<str>>(names: &[S]) -> String {
    names
        .iter()
        .map(|n| format!("\"{}\"", n.as_ref()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A boxed module is a module, so containers and user code can hold `Box<dyn Module>`.
impl<M: Module + ?Sized> Module for Box<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        (**self).forward(x)
    }
    fn train_flag(&self) -> &TrainFlag {
        (**self).train_flag()
    }
    fn visit_own(&self, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        (**self).visit_own(f)
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        (**self).children()
    }
    fn visit(&self, prefix: &str, f: &mut dyn FnMut(&str, &Tensor, TensorKind)) {
        (**self).visit(prefix, f)
    }
    fn visit_own_mut(&mut self, f: &mut dyn FnMut(&str, &mut Tensor, TensorKind)) {
        (**self).visit_own_mut(f)
    }
    fn children_mut(&mut self) -> Vec<(String, &mut dyn Module)> {
        (**self).children_mut()
    }
    fn visit_mut(&mut self, prefix: &str, f: &mut dyn FnMut(&str, &mut Tensor, TensorKind)) {
        (**self).visit_mut(prefix, f)
    }
    fn train(&self, mode: bool) {
        (**self).train(mode)
    }
}
