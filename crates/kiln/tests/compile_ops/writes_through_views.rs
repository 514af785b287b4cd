//! Writes through views inside compiled code: the write must reach the tensor the view aliases
//! (an argument, a captured tensor or a traced value), on every replay with new arguments, and
//! other views of that tensor must see it — as in eager mode, where they share storage.

use crate::*;
use kiln::Tensor;

fn no_grad_arg(r: &mut Rng, shape: &[usize], lay: Lay) -> In {
    r.arg(Gen::Normal, shape, lay, false)
}

#[test]
fn write_into_a_narrowed_argument() {
    let mut rng = Rng::new(61);
    for lay in [Lay::C, Lay::T, Lay::S] {
        Case::new(format!("x.narrow(0, 1, 2).assign(y) {lay:?}")).run(
            &mut rng,
            |a| {
                a[0].narrow(0, 1, 2)?.assign(&a[1].exp()?)?;
                one(a[0].sum(&[1], false))
            },
            move |r| {
                vec![
                    no_grad_arg(r, &[4, 3], lay),
                    no_grad_arg(r, &[2, 3], Lay::C),
                ]
            },
        );
    }
}

#[test]
fn write_through_a_chain_of_views() {
    let mut rng = Rng::new(62);
    Case::new("x.t().select(0, 1).slice(0, 0, 4, 2).assign(y)").run(
        &mut rng,
        |a| {
            let v = a[0].t()?.select(0, 1)?.slice(0, 0, 4, 2)?;
            v.assign(&a[1])?;
            one(a[0].mul(2.0))
        },
        |r| {
            vec![
                no_grad_arg(r, &[4, 3], Lay::C),
                no_grad_arg(r, &[2], Lay::C),
            ]
        },
    );
}

#[test]
fn earlier_views_see_a_later_write() {
    let mut rng = Rng::new(63);
    Case::new("row = x.select(0, 0); x.narrow(1, 1, 2).assign(y); row").run(
        &mut rng,
        |a| {
            let row = a[0].select(0, 0)?;
            let col = a[0].t()?.select(0, 2)?;
            a[0].narrow(1, 1, 2)?.assign(&a[1])?;
            Ok(vec![row.add(&row)?, col.exp()?])
        },
        |r| {
            vec![
                no_grad_arg(r, &[3, 4], Lay::C),
                no_grad_arg(r, &[3, 2], Lay::C),
            ]
        },
    );
    Case::new("v = x.narrow(0, 0, 2); x.assign(y); v").run(
        &mut rng,
        |a| {
            let v = a[0].narrow(0, 0, 2)?;
            a[0].assign(&a[1])?;
            Ok(vec![v.neg()?])
        },
        |r| {
            vec![
                no_grad_arg(r, &[3, 2], Lay::C),
                no_grad_arg(r, &[3, 2], Lay::C),
            ]
        },
    );
}

#[test]
fn write_into_a_view_of_a_traced_value() {
    let mut rng = Rng::new(64);
    Case::new("t = x * 2; t.narrow(0, 0, 1).assign(y); t").run(
        &mut rng,
        |a| {
            let t = a[0].mul(2.0)?;
            let v = t.narrow(0, 0, 1)?;
            v.assign(&a[1])?;
            Ok(vec![t.exp()?, v])
        },
        |r| {
            vec![
                no_grad_arg(r, &[3, 5], Lay::C),
                no_grad_arg(r, &[1, 5], Lay::C),
            ]
        },
    );
    Case::new("t = x + 1; t.assign(y); t").run(
        &mut rng,
        |a| {
            let t = a[0].add(1.0)?;
            t.assign(&a[1])?;
            one(t.sum_all())
        },
        |r| vec![no_grad_arg(r, &[4], Lay::C), no_grad_arg(r, &[4], Lay::C)],
    );
}

#[test]
fn write_into_a_reshaped_view_and_an_empty_view() {
    let mut rng = Rng::new(65);
    Case::new("x.reshape([6, 2]).narrow(0, 2, 3).assign(y)").run(
        &mut rng,
        |a| {
            a[0].reshape([6, 2])?.narrow(0, 2, 3)?.assign(&a[1])?;
            one(a[0].exp())
        },
        |r| {
            vec![
                no_grad_arg(r, &[3, 4], Lay::C),
                no_grad_arg(r, &[3, 2], Lay::C),
            ]
        },
    );
    // a view only because of the argument's strides (a transpose splits dim 0 without a copy):
    // only contiguity is guarded, so such a write is traced on every call
    Case::new("x^T.reshape([2, 2, 3]).select(0, 1).assign(y)")
        .retraced()
        .run(
            &mut rng,
            |a| {
                a[0].reshape([2, 2, 3])?.select(0, 1)?.assign(&a[1])?;
                one(a[0].exp())
            },
            |r| {
                vec![
                    no_grad_arg(r, &[4, 3], Lay::T),
                    no_grad_arg(r, &[2, 3], Lay::C),
                ]
            },
        );
    Case::new("x.narrow(0, 1, 0).assign(empty)").run(
        &mut rng,
        |a| {
            a[0].narrow(0, 1, 0)?.assign(&a[1])?;
            one(a[0].exp())
        },
        |r| {
            vec![
                no_grad_arg(r, &[3, 4], Lay::C),
                no_grad_arg(r, &[0, 4], Lay::C),
            ]
        },
    );
}

/// A captured tensor (a module buffer, say) updated through a view, call after call.
#[test]
fn write_through_a_view_of_a_captured_tensor() -> kiln::Result<()> {
    let buf_c = Tensor::zeros(&[4, 2], kiln::DType::F32)?;
    let buf_e = Tensor::zeros(&[4, 2], kiln::DType::F32)?;
    let step = |buf: &Tensor, x: &Tensor| -> kiln::Result<Vec<Tensor>> {
        let head = buf.narrow(0, 0, 2)?;
        head.assign(&head.add(x)?)?;
        Ok(vec![buf.sum_all()?])
    };
    let compiled = kiln::compile_fn(
        |a: &[Tensor]| step(&buf_c, &a[0]),
        common::compile_options(),
    )?;
    let mut rng = Rng::new(66);
    for call in 0..3 {
        let x = rng.randn(&[2, 2]);
        let got = compiled.call(std::slice::from_ref(&x))?;
        let want = step(&buf_e, &x)?;
        common::assert_same(&format!("sum, call {call}"), &got[0], &want[0], 0.0);
        common::assert_same(&format!("buffer, call {call}"), &buf_c, &buf_e, 0.0);
    }
    assert_eq!(compiled.stats().graph_breaks, 0);
    assert_eq!(compiled.stats().traces, 1);
    Ok(())
}

#[test]
fn write_into_an_expanded_view_is_refused() {
    let x = Tensor::zeros(&[1, 3], kiln::DType::F32).unwrap();
    let compiled = kiln::compile_fn(
        |a: &[Tensor]| {
            a[0].expand([2, 3])?.assign(&a[1])?;
            Ok(vec![a[0].clone()])
        },
        common::compile_options(),
    )
    .unwrap();
    let err = compiled
        .call(&[x, Tensor::ones(&[2, 3], kiln::DType::F32).unwrap()])
        .expect_err("a write into an expanded view must fail");
    assert!(err.to_string().contains("overlap"), "{err}");
}

/// Reading the values of a tensor the traced code wrote (`item`, `to_vec`) must see the write: the
/// graph so far runs first (a graph break), as it would for a read of a traced value.
#[test]
fn reading_a_written_argument_sees_the_write() -> kiln::Result<()> {
    let f = |a: &[Tensor]| -> kiln::Result<Vec<Tensor>> {
        a[0].narrow(0, 0, 1)?.assign(&a[1].exp()?)?;
        let total: f32 = a[0].to_vec::<f32>()?.iter().sum();
        let total = f64::from(total);
        Ok(vec![a[0].mul(total)?])
    };
    let compiled = kiln::compile_fn(f, common::compile_options())?;
    let mut rng = Rng::new(67);
    for call in 0..2 {
        let (x, y) = (rng.randn(&[2, 3]), common::deep_copy(&rng.randn(&[1, 3])));
        let (xc, xe) = (common::deep_copy(&x), common::deep_copy(&x));
        let got = compiled.call(&[xc.clone(), y.clone()])?;
        let want = f(&[xe.clone(), y])?;
        common::assert_same(&format!("output, call {call}"), &got[0], &want[0], 0.0);
        common::assert_same(&format!("argument, call {call}"), &xc, &xe, 0.0);
    }
    assert!(compiled.stats().graph_breaks >= 1, "{:?}", compiled.stats());
    let strict = kiln::compile_fn(f, common::compile_options().fullgraph(true))?;
    let err = strict
        .call(&[
            common::deep_copy(&rng.randn(&[2, 3])),
            common::deep_copy(&rng.randn(&[1, 3])),
        ])
        .expect_err("fullgraph refuses the break");
    assert!(err.to_string().contains("graph break"), "{err}");
    Ok(())
}
