//! Guards: the facts about a call that a compiled graph was specialised to. A call whose guards all
//! hold replays the graph without re-running the user's Rust code; any failure means a recompile.

use kiln_core::autograd::is_grad_enabled;
use kiln_core::backends;
use kiln_core::{DType, Device, Tensor};

use crate::trace::Source;

/// Metadata a graph depends on for one tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorGuard {
    pub shape: Vec<usize>,
    pub dtype: DType,
    pub device: Device,
    pub contiguous: bool,
    pub requires_grad: bool,
}

impl TensorGuard {
    pub fn of(t: &Tensor) -> Self {
        TensorGuard {
            shape: t.shape().to_vec(),
            dtype: t.dtype(),
            device: t.device(),
            contiguous: t.is_contiguous(),
            requires_grad: t.requires_grad(),
        }
    }
    #[inline]
    pub fn holds(&self, t: &Tensor) -> bool {
        t.shape() == self.shape.as_slice()
            && t.dtype() == self.dtype
            && t.device() == self.device
            && t.requires_grad() == self.requires_grad
            && t.is_contiguous() == self.contiguous
    }
    /// `holds`, except that only the rank of the shape is checked (a symbolic entry checks sizes
    /// itself).
    #[inline]
    pub fn holds_except_size(&self, t: &Tensor) -> bool {
        t.shape().len() == self.shape.len()
            && t.dtype() == self.dtype
            && t.device() == self.device
            && t.requires_grad() == self.requires_grad
            && t.is_contiguous() == self.contiguous
    }
    /// What differs, in words, or `None` when the guard holds.
    pub fn mismatch(&self, t: &Tensor) -> Option<String> {
        let now = TensorGuard::of(t);
        if now.shape != self.shape {
            return Some(format!(
                "size mismatch: expected {:?}, actual {:?}",
                self.shape, now.shape
            ));
        }
        if now.dtype != self.dtype {
            return Some(format!(
                "dtype mismatch: expected {}, actual {}",
                self.dtype, now.dtype
            ));
        }
        if now.device != self.device {
            return Some(format!(
                "device mismatch: expected {}, actual {}",
                self.device, now.device
            ));
        }
        if now.requires_grad != self.requires_grad {
            return Some(format!(
                "requires_grad mismatch: expected {}, actual {}",
                self.requires_grad, now.requires_grad
            ));
        }
        if now.contiguous != self.contiguous {
            return Some(format!(
                "stride mismatch: expected contiguous={}, actual {}",
                self.contiguous, now.contiguous
            ));
        }
        None
    }
}

impl std::fmt::Display for TensorGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}{:?} on {}, {}, requires_grad={}",
            self.dtype,
            self.shape,
            self.device,
            if self.contiguous {
                "contiguous"
            } else {
                "strided"
            },
            self.requires_grad
        )
    }
}

/// All guards of one cache entry.
#[derive(Clone, Debug)]
pub struct Guards {
    pub args: Vec<TensorGuard>,
    /// Captured tensors (parameters, buffers) with their requires_grad at trace time; their shape,
    /// dtype and device cannot change without changing the tensor itself.
    pub captured: Vec<(Tensor, bool)>,
    /// Gradients read through `.grad`: the owner, and the gradient's metadata at trace time.
    pub grads: Vec<(Tensor, TensorGuard)>,
    /// For each argument, the first argument that is the same tensor: a graph traced with `f(x, x)`
    /// reads one input for both and must not replay `f(y, z)`.
    pub aliases: Vec<usize>,
    pub grad_mode: bool,
    /// `kiln_core::backends::fingerprint()` when compiled: TF32 and cuDNN benchmark switches, as
    /// Dynamo's global-state guard (a graph recorded for replay holds the kernels they chose).
    pub switches: u64,
    /// A caller-supplied key for Rust state the graph depends on (a module's training flag).
    pub extra: u64,
}

/// The first argument that is the same tensor as argument `i` (`i` itself when none is).
fn first_alias(args: &[Tensor], i: usize) -> usize {
    (0..i).find(|&j| args[j].same_tensor(&args[i])).unwrap_or(i)
}

fn alias_pattern(args: &[Tensor]) -> Vec<usize> {
    (0..args.len()).map(|i| first_alias(args, i)).collect()
}

impl Guards {
    pub fn new(args: &[Tensor], sources: &[Source], extra: u64) -> Self {
        Guards {
            args: args.iter().map(TensorGuard::of).collect(),
            captured: sources
                .iter()
                .filter_map(|s| match s {
                    Source::Captured(t) => Some((t.clone(), t.requires_grad())),
                    _ => None,
                })
                .collect(),
            grads: sources
                .iter()
                .filter_map(|s| match s {
                    Source::Grad(owner) => {
                        owner.grad().map(|g| (owner.clone(), TensorGuard::of(&g)))
                    }
                    _ => None,
                })
                .collect(),
            aliases: alias_pattern(args),
            grad_mode: is_grad_enabled(),
            switches: backends::fingerprint(),
            extra,
        }
    }

    #[inline]
    pub fn hold(&self, args: &[Tensor], extra: u64) -> bool {
        self.hold_with(args, extra, TensorGuard::holds)
    }

    /// `hold`, with argument sizes left to the caller (`holds_except_size`).
    pub fn hold_except_sizes(&self, args: &[Tensor], extra: u64) -> bool {
        self.hold_with(args, extra, TensorGuard::holds_except_size)
    }

    /// Every guard, each argument checked by `arg_holds`. Runs on every call: comparisons only.
    #[inline]
    fn hold_with(
        &self,
        args: &[Tensor],
        extra: u64,
        arg_holds: impl Fn(&TensorGuard, &Tensor) -> bool,
    ) -> bool {
        self.extra == extra
            && self.grad_mode == is_grad_enabled()
            && self.switches == backends::fingerprint()
            && args.len() == self.args.len()
            && self.args.iter().zip(args).all(|(g, t)| arg_holds(g, t))
            && self.captured.iter().all(|(t, rg)| t.requires_grad() == *rg)
            && self.grads_hold()
            && self.aliases_hold(args)
    }

    fn grads_hold(&self) -> bool {
        self.grads
            .iter()
            .all(|(owner, g)| owner.grad().is_some_and(|t| g.holds(&t)))
    }

    fn aliases_hold(&self, args: &[Tensor]) -> bool {
        // checked in place: this runs on every call (one comparison per pair, no allocation)
        self.aliases
            .iter()
            .enumerate()
            .all(|(i, &a)| first_alias(args, i) == a)
    }

    /// The first failing guard, in words (for recompile logs and the fallback warning).
    pub fn why_not(&self, args: &[Tensor], extra: u64) -> Option<String> {
        if args.len() != self.args.len() {
            return Some(format!(
                "number of arguments changed from {} to {}",
                self.args.len(),
                args.len()
            ));
        }
        for (i, (g, t)) in self.args.iter().zip(args).enumerate() {
            if let Some(m) = g.mismatch(t) {
                return Some(format!("argument {i}: {m}"));
            }
        }
        if self.grad_mode != is_grad_enabled() {
            return Some(format!("grad mode changed to {}", is_grad_enabled()));
        }
        let switches = backends::fingerprint();
        if self.switches != switches {
            return Some(format!(
                "backend switches changed ({} -> {})",
                backends::describe(self.switches),
                backends::describe(switches)
            ));
        }
        if self.extra != extra {
            return Some(format!(
                "guarded Rust state changed ({} -> {extra})",
                self.extra
            ));
        }
        if !self.aliases_hold(args) {
            return Some("arguments that were the same tensor are not (or the reverse)".into());
        }
        for (k, (owner, g)) in self.grads.iter().enumerate() {
            match owner.grad() {
                None => return Some(format!("gradient {k} ({:?}) is now None", owner.shape())),
                Some(t) => {
                    if let Some(m) = g.mismatch(&t) {
                        return Some(format!("gradient {k}: {m}"));
                    }
                }
            }
        }
        for (k, (t, rg)) in self.captured.iter().enumerate() {
            if t.requires_grad() != *rg {
                return Some(format!(
                    "captured tensor {k} ({:?}): requires_grad changed to {}",
                    t.shape(),
                    t.requires_grad()
                ));
            }
        }
        None
    }

    pub fn describe(&self) -> Vec<String> {
        let mut v: Vec<String> = self
            .args
            .iter()
            .enumerate()
            .map(|(i, g)| format!("argument {i}: {g}"))
            .collect();
        v.push(format!(
            "{} captured tensors: requires_grad as traced",
            self.captured.len()
        ));
        v.push(format!(
            "grad mode: {}",
            if self.grad_mode {
                "enabled"
            } else {
                "disabled"
            }
        ));
        if self.extra != 0 {
            v.push(format!("guarded Rust state: {}", self.extra));
        }
        v
    }
}
