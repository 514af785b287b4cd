//! Compiled equals eager, op by op: every public op of kiln-core, run through `compile_fn` (default
//! options, or the backend named by `$KILN_TEST_BACKEND`: see `common::compile_options`) and
//! eagerly, on seeded random inputs of a few shapes each (broadcasting, non-contiguous views as
//! arguments, size-1 and size-0 dims).
//!
//! For each case the harness (`common::Case`) checks, on two calls (three for stateful and random
//! ops), each with new values of the same shapes:
//! - forward outputs equal, with equal shape, dtype and `requires_grad`;
//! - the gradients of `sum(out * random weights)` with respect to every input that requires grad
//!   equal (on the leaf, so through the view that formed a non-contiguous argument);
//! - the arguments as the call left them, and state the op updates (batch norm's running
//!   statistics), equal;
//! - no graph breaks, one trace, and every later call a replay of the compiled graph;
//! - where the op rejects its inputs, both fail with the same message.
//!
//! Everything is compared bitwise, and is bitwise equal with both the default `kiln` backend and
//! `aot_eager` (the same prims through the interpreter, the backward from the same per-prim VJP
//! rules); `Case::fwd_tol` / `grad_tol` exist for a backend that reorders float arithmetic.

#[path = "../common/mod.rs"]
mod common;

mod capture_edge_cases;
mod elementwise;
mod harness;
mod nn_ops;
mod reductions_linalg;
mod views_creation;
mod writes_through_views;

pub(crate) use common::{Case, Gen, In, Lay, Rng};
pub(crate) use kiln::core::RunningStats;
pub(crate) use kiln::prelude::*;

pub(crate) type Out = Result<Vec<Tensor>>;

pub(crate) fn one(t: Result<Tensor>) -> Out {
    t.map(|t| vec![t])
}

/// Shapes and layouts every elementwise op is checked on.
pub(crate) const ELEMENTWISE_SHAPES: &[(&[usize], Lay)] = &[
    (&[], Lay::C),
    (&[7], Lay::C),
    (&[3, 4], Lay::C),
    (&[3, 4], Lay::T),
    (&[2, 5], Lay::S),
    (&[4, 1, 3], Lay::E),
    (&[0, 3], Lay::C),
    (&[2, 0], Lay::T),
];

/// Generated C calls the C library's `erf`; eager kernels call the `libm` crate's (a port of
/// musl's). The two differ by an ulp on some inputs, so erf is compared to 1e-6 relative, and gelu
/// — `0.5·x·(1 + erf(x/√2))`, where `1 + erf` cancels for negative x and magnifies that ulp — to
/// 1e-5. Generated C computes sin and cos in vectorized loops with glibc's libmvec (where the C
/// compiler has it), documented within 4 ulp where the scalar functions the eager kernels call are
/// within 1 (measured: up to 2 ulp apart in f32, 3 in f64), and f32 ones in pointwise loops with
/// inline functions (kiln-inductor `runtime/trig.rs`: within 1.81 ulp, 1.62e-7 relative from the
/// scalar functions), so they are compared to 1e-6 relative: at least 8 ulp of f32, room for the
/// 4-ulp bound and the rounding of the products in their gradients. Every other unary op is
/// bitwise.
pub(crate) fn libm_tol(name: &str) -> f64 {
    match name {
        "erf" | "sin" | "cos" => 1e-6,
        "gelu" => 1e-5,
        _ => 0.0,
    }
}
