//! One test per error kind: the message names the op and the offending shapes/dtypes, nothing
//! panics, and a failed op leaves its inputs unchanged.

use kiln_core::dispatch::apply;
use kiln_core::prim::{BinaryOp, Prim, UnaryOp};
use kiln_core::{DType, Error, Tensor};

#[track_caller]
fn expect_err(r: kiln_core::Result<Tensor>, needles: &[&str]) -> Error {
    let e = match r {
        Ok(t) => panic!("expected an error, got a tensor of shape {:?}", t.shape()),
        Err(e) => e,
    };
    let msg = e.to_string();
    for n in needles {
        assert!(msg.contains(n), "error {msg:?} should mention {n:?}");
    }
    e
}

fn f32s(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::from_vec((0..n).map(|i| i as f32).collect(), shape).unwrap()
}

#[test]
fn broadcast_mismatch() {
    let (a, b) = (f32s(&[2, 3]), f32s(&[4]));
    let e = expect_err(a.add(&b), &["add", "[2, 3]", "[4]"]);
    assert!(matches!(e, Error::Shape { .. }));
    expect_err(
        Tensor::where_(&a.gt(0.0).unwrap(), &a, &b),
        &["where", "[2, 3]", "[4]"],
    );
    // inputs unchanged by the failure
    assert_eq!(a.to_vec::<f32>().unwrap(), vec![0., 1., 2., 3., 4., 5.]);
    assert_eq!(b.shape(), &[4]);
}

#[test]
fn matmul_inner_dim_mismatch() {
    let e = expect_err(
        f32s(&[2, 3]).matmul(&f32s(&[4, 5])),
        &["matmul", "[2, 3]", "[4, 5]"],
    );
    assert!(matches!(e, Error::Shape { .. }));
    expect_err(f32s(&[3]).matmul(&f32s(&[4])), &["matmul", "[3]", "[4]"]);
    expect_err(
        f32s(&[2, 2, 3]).matmul(&f32s(&[3, 2, 1])),
        &["matmul", "[2, 2, 3]", "[3, 2, 1]"],
    );
    expect_err(
        f32s(&[2, 3]).linear(&f32s(&[4, 2]), None),
        &["matmul", "[2, 3]", "[2, 4]"],
    );
}

#[test]
fn reshape_wrong_numel() {
    let x = f32s(&[2, 3]);
    expect_err(x.reshape([4, 2]), &["reshape", "[2, 3]", "[4, 2]"]);
    expect_err(x.reshape([-1, 4]), &["reshape", "[-1, 4]", "6"]);
    expect_err(x.reshape([-1, -1]), &["reshape", "inferred"]);
    assert_eq!(x.shape(), &[2, 3]);
}

#[test]
fn bad_dim_index() {
    let x = f32s(&[2, 3]);
    for (r, op) in [
        (x.sum(&[2], false), "sum"),
        (x.softmax(-3), "softmax"),
        (x.transpose(0, 5), "transpose"),
        (x.select(0, 2), "select"),
        (x.narrow(1, 2, 2), "narrow"),
        (x.unsqueeze(4), "unsqueeze"),
        (x.argmax(Some(2), false), "argmax"),
    ] {
        let e = expect_err(r, &[op]);
        assert!(matches!(e, Error::Index { .. }), "{op}: {e:?}");
    }
    expect_err(x.permute(&[0, 0]), &["permute", "[0, 0]", "[2, 3]"]);
}

#[test]
fn gather_index_out_of_range() {
    let x = f32s(&[2, 3]);
    let idx = Tensor::from_vec(vec![0i64, 3], &[2, 1]).unwrap();
    let e = expect_err(x.gather(1, &idx), &["gather", "3", "size 3"]);
    assert!(matches!(e, Error::Index { .. }));
    let neg = Tensor::from_vec(vec![-1i64], &[1]).unwrap();
    expect_err(x.index_select(0, &neg), &["gather", "-1"]);
    expect_err(
        x.embedding(&Tensor::from_vec(vec![5i64], &[1]).unwrap()),
        &["5", "size 2"],
    );
    expect_err(
        x.scatter_add(
            0,
            &Tensor::from_vec(vec![2i64], &[1, 1]).unwrap(),
            &f32s(&[1, 1]),
        ),
        &["scatter_add", "2"],
    );
    expect_err(
        x.gather(0, &Tensor::from_vec(vec![0.0f32], &[1, 1]).unwrap()),
        &["gather", "F32", "integer"],
    );
    // cross_entropy with an out-of-range class names it too
    expect_err(
        x.cross_entropy(
            &Tensor::from_vec(vec![0i64, 7], &[2]).unwrap(),
            None,
            0.0,
            Default::default(),
        ),
        &["7"],
    );
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![0., 1., 2., 3., 4., 5.]);
}

#[test]
fn dtype_errors() {
    let f = f32s(&[2]);
    let b = Tensor::from_vec(vec![true, false], &[2]).unwrap();
    // logical prim on floats, float-only prim on bool, arithmetic on bool
    let e = expect_err(
        apply(Prim::Binary(BinaryOp::And), &[&f, &f]),
        &["binary", "F32", "bool"],
    );
    assert!(matches!(
        e,
        Error::DType {
            dtype: DType::F32,
            ..
        }
    ));
    expect_err(
        apply(Prim::Unary(UnaryOp::Exp), &[&b]),
        &["unary", "Bool", "Exp"],
    );
    expect_err(
        apply(Prim::Binary(BinaryOp::Add), &[&b, &b]),
        &["binary", "Bool", "Add"],
    );
    expect_err(
        apply(
            Prim::Binary(BinaryOp::Add),
            &[&f, &f.to_dtype(DType::F64).unwrap()],
        ),
        &["binary", "F32", "F64"],
    );
    expect_err(b.neg(), &["Neg", "Bool"]);
    expect_err(b.matmul(&b), &["matmul", "Bool"]);
    let i = Tensor::from_vec(vec![1i64, 2], &[2]).unwrap();
    expect_err(i.conv2d(&i, None, [1, 1], [0, 0], [1, 1], 1), &["conv2d"]);
    expect_err(Tensor::rand(&[2], DType::I32), &["rand", "I32"]);
    let e = i.with_grad().unwrap_err();
    assert!(e.to_string().contains("int64"), "{e}");
}

#[test]
fn backward_on_non_scalar_without_gradient() {
    let x = f32s(&[2, 2]).with_grad().unwrap();
    let y = x.mul(2.0).unwrap();
    let e = y.backward().unwrap_err();
    assert!(matches!(e, Error::Autograd(_)));
    assert!(e.to_string().contains("[2, 2]"), "{e}");
    let e = y.backward_with(&f32s(&[4])).unwrap_err();
    assert!(
        e.to_string().contains("backward")
            && e.to_string().contains("[4]")
            && e.to_string().contains("[2, 2]"),
        "{e}"
    );
    assert!(x.grad().is_none(), "a failed backward accumulates nothing");
    let e = f32s(&[1]).backward().unwrap_err();
    assert!(e.to_string().contains("does not require grad"), "{e}");
}

#[test]
fn item_on_multi_element() {
    let e = f32s(&[2, 3]).item::<f32>().unwrap_err();
    assert!(
        e.to_string().contains("item") && e.to_string().contains("[2, 3]"),
        "{e}"
    );
    assert_eq!(f32s(&[1, 1]).item::<f32>().unwrap(), 0.0);
    assert_eq!(Tensor::scalar(2.5f64).item::<f32>().unwrap(), 2.5);
}

#[test]
fn cat_and_stack_mismatched_shapes() {
    let (a, b) = (f32s(&[2, 3]), f32s(&[2, 4]));
    let e = expect_err(Tensor::cat(&[&a, &b], 0), &["cat", "[2, 3]", "[2, 4]"]);
    assert!(matches!(e, Error::Shape { .. }));
    expect_err(
        Tensor::cat(&[&a, &f32s(&[3])], 0),
        &["cat", "[2, 3]", "[3]"],
    );
    expect_err(Tensor::cat(&[], 0), &["cat"]);
    expect_err(Tensor::stack(&[&a, &b], 0), &["stack", "[2, 3]", "[2, 4]"]);
    assert_eq!(Tensor::cat(&[&a, &b], 1).unwrap().shape(), &[2, 7]);
}

#[test]
fn conv2d_channel_and_group_mismatch() {
    let x = f32s(&[1, 4, 5, 5]);
    expect_err(
        x.conv2d(&f32s(&[2, 3, 3, 3]), None, [1, 1], [0, 0], [1, 1], 1),
        &["conv2d", "[1, 4, 5, 5]", "[2, 3, 3, 3]", "groups=1"],
    );
    expect_err(
        x.conv2d(&f32s(&[3, 2, 3, 3]), None, [1, 1], [0, 0], [1, 1], 2),
        &["conv2d", "[3, 2, 3, 3]", "groups=2"],
    );
    expect_err(
        x.conv2d(&f32s(&[2, 4, 7, 7]), None, [1, 1], [0, 0], [1, 1], 1),
        &["conv2d", "[2, 4, 7, 7]"],
    );
    expect_err(
        x.conv2d(&f32s(&[2, 4, 1, 1]), None, [0, 1], [0, 0], [1, 1], 1),
        &["conv2d", "stride"],
    );
    expect_err(
        f32s(&[4, 5, 5]).conv2d(&f32s(&[2, 4, 1, 1]), None, [1, 1], [0, 0], [1, 1], 1),
        &["conv2d", "[4, 5, 5]"],
    );
    expect_err(
        x.max_pool2d([7, 7], [1, 1], [0, 0]),
        &["max_pool2d", "[7, 7]"],
    );
    assert_eq!(x.to_vec::<f32>().unwrap()[..3], [0., 1., 2.]);
}

#[test]
fn loss_and_norm_argument_errors() {
    let x = f32s(&[3, 4]);
    expect_err(
        x.cross_entropy(
            &Tensor::from_vec(vec![0i64, 1], &[2]).unwrap(),
            None,
            0.0,
            Default::default(),
        ),
        &["cross_entropy", "[2]", "[3, 4]"],
    );
    expect_err(
        x.mse_loss(&f32s(&[4, 3]), Default::default()),
        &["mse_loss", "[3, 4]", "[4, 3]"],
    );
    expect_err(
        x.layer_norm(&[3], None, None, 1e-5),
        &["layer_norm", "[3]", "[3, 4]"],
    );
    expect_err(
        f32s(&[1, 4]).batch_norm(None, None, None, true, 1e-5),
        &["batch_norm", "[1, 4]"],
    );
    expect_err(x.dropout(1.5, true), &["dropout", "1.5"]);
}
