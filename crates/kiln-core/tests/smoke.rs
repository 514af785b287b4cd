use kiln_core::{DType, Reduction, Tensor};

#[test]
fn smoke() -> kiln_core::Result<()> {
    let a = Tensor::from_vec(vec![1.0f32, 2., 3., 4., 5., 6.], &[2, 3])?;
    let b = Tensor::from_vec(vec![1.0f32, 0.5, -1.0], &[3])?;
    let c = a.add(&b)?.mul(2.0)?;
    assert_eq!(c.to_vec::<f32>()?, vec![4., 5., 4., 10., 11., 10.]);
    println!("{c}");
    let w = Tensor::randn(&[4, 3], DType::F32)?.with_grad()?;
    let y = a.linear(&w, None)?.relu()?.sum_all()?;
    y.backward()?;
    println!("{}", w.grad().unwrap());
    let logits = Tensor::randn(&[5, 4], DType::F64)?.with_grad()?;
    let t = Tensor::from_vec(vec![0i64, 1, 2, 3, 1], &[5])?;
    let l = logits.cross_entropy(&t, None, 0.0, Reduction::Mean)?;
    l.backward()?;
    println!("{l} {}", logits.grad().unwrap());
    let x = Tensor::randn(&[2, 3, 8, 8], DType::F32)?.with_grad()?;
    let k = Tensor::randn(&[4, 3, 3, 3], DType::F32)?.with_grad()?;
    let o = x
        .conv2d(&k, None, [1, 1], [1, 1], [1, 1], 1)?
        .max_pool2d([2, 2], [2, 2], [0, 0])?;
    assert_eq!(o.shape(), &[2, 4, 4, 4]);
    o.sum_all()?.backward()?;
    assert_eq!(k.grad().unwrap().shape(), &[4, 3, 3, 3]);
    println!("{}", Tensor::arange(0.0, 5.0, 1.0, DType::I64)?);
    Ok(())
}
