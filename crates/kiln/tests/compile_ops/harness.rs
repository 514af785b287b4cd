//! The harness itself must fail on a forward and on a gradient mismatch.

use crate::*;

/// The harness itself must catch a compiled result that differs from eager.
#[test]
#[should_panic(expected = "differs")]
fn harness_detects_a_forward_mismatch() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let runs = AtomicUsize::new(0);
    // the traced (first) run and the eager run see different Rust state: 1 vs 2
    Case::new("rust state read at trace time").run(
        &mut Rng::new(28),
        move |a| one(a[0].mul((runs.fetch_add(1, Ordering::SeqCst) + 1) as f64)),
        |r| vec![r.arg(Gen::Positive, &[3], Lay::C, false)],
    );
}

#[test]
#[should_panic(expected = "grad of input 0")]
fn harness_detects_a_gradient_mismatch() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let runs = AtomicUsize::new(0);
    // equal values, but the traced run stops the gradient through one factor of x * x
    Case::new("gradient differs").run(
        &mut Rng::new(29),
        move |a| {
            let y = if runs.fetch_add(1, Ordering::SeqCst) == 0 {
                a[0].mul(a[0].exp()?.log()?.detach())?
            } else {
                a[0].mul(&a[0].exp()?.log()?)?
            };
            one(Ok(y))
        },
        |r| vec![r.arg(Gen::Positive, &[3], Lay::C, true)],
    );
}
