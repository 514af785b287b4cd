//! Replays that once went wrong: detach of an argument, one tensor passed twice, the detached max of a rank-0 input.

use crate::*;

#[test]
fn detach_of_an_argument_on_replay() {
    let mut rng = Rng::new(26);
    Case::new("detach of an argument").run(
        &mut rng,
        |a| one(a[0].detach().exp()),
        |r| vec![r.arg(Gen::Normal, &[3, 4], Lay::C, false)],
    );
    Case::new("detach of an argument, mixed with grad").run(
        &mut rng,
        |a| one(a[0].mul(&a[1])?.add(&a[0].detach().exp()?)),
        |r| {
            vec![
                r.arg(Gen::Normal, &[3, 4], Lay::T, true),
                r.arg(Gen::Normal, &[3, 4], Lay::C, false),
            ]
        },
    );
}

#[test]
fn the_same_tensor_as_two_arguments() -> Result<()> {
    let mut rng = Rng::new(33);
    let f = |a: &[Tensor]| one(a[0].sub(&a[1])?.add(&a[0].mul(2.0)?));
    let compiled = compile_fn(f, common::compile_options())?;
    let x = rng.randn(&[3]);
    let args = [x.clone(), x];
    common::assert_same("f(x, x)", &compiled.call(&args)?[0], &f(&args)?[0], 0.0);
    let args = [rng.randn(&[3]), rng.randn(&[3])];
    common::assert_same("f(y, z)", &compiled.call(&args)?[0], &f(&args)?[0], 0.0);
    Ok(())
}

/// A rank-0 argument of magnitude ~100: `exp(x - stale max)` overflows.
fn big_scalar(r: &mut Rng) -> Vec<In> {
    vec![In::grad(r.randn(&[]).mul(100.0).unwrap())]
}

#[test]
fn softmax_family_of_a_rank0_input_on_replay() {
    let mut rng = Rng::new(27);
    for keep in [false, true] {
        Case::new(format!("logsumexp [] keepdim {keep}")).run(
            &mut rng,
            move |a| one(a[0].logsumexp(&[], keep)),
            big_scalar,
        );
    }
    Case::new("softmax []").run(&mut rng, |a| one(a[0].softmax(0)), big_scalar);
    Case::new("log_softmax []").run(&mut rng, |a| one(a[0].log_softmax(-1)), big_scalar);
}
