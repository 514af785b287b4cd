//! Views share storage and read the right elements; `contiguous` copies; Display matches PyTorch.

mod common;

use common::*;
use kiln_core::{DType, Result, Tensor};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    #[test]
    fn views_share_storage_and_index_correctly(shape in shape_nz(2, 4, 4), seed: u64) {
        let mut rng = TRng::new(seed);
        let r = shape.len();
        let vals: Vec<f64> = (0..numel(&shape)).map(|i| i as f64).collect();
        let x = from_f64s(&vals, &shape, DType::F32);
        // permute: out[i] = x[p-permuted index]
        let p = rng.perm(r);
        let pi: Vec<isize> = p.iter().map(|&d| d as isize).collect();
        let y = x.permute(&pi).unwrap();
        prop_assert!(y.shares_storage(&x));
        let ys: Vec<usize> = p.iter().map(|&d| shape[d]).collect();
        let want: Vec<f64> = (0..numel(&ys)).map(|i| { let o = unravel(i, &ys); let mut src = vec![0; r]; for (k, &d) in p.iter().enumerate() { src[d] = o[k]; } vals[ravel(&src, &shape)] }).collect();
        check(&y, &want, &ys, DType::F32, "permute");
        // contiguous copies a non-contiguous view, is a no-op on a contiguous one
        let c = y.contiguous().unwrap();
        prop_assert!(c.is_contiguous());
        prop_assert_eq!(c.to_vec_f64().unwrap(), want.clone());
        prop_assert_eq!(c.shares_storage(&x), y.is_contiguous());
        prop_assert!(x.contiguous().unwrap().shares_storage(&x));
        // reshape / flatten / unsqueeze / squeeze of a contiguous tensor are views
        for v in [x.reshape([-1isize]).unwrap(), x.flatten(0, -1).unwrap(), x.unsqueeze(1).unwrap().squeeze_dim(1).unwrap(), x.view(vec![numel(&shape)]).unwrap()] {
            prop_assert!(v.shares_storage(&x));
            prop_assert_eq!(v.to_vec_f64().unwrap(), vals.clone());
        }
        // reshape of a non-contiguous view copies, values in row-major order of the view
        let yr = y.reshape([-1isize]).unwrap();
        prop_assert_eq!(yr.to_vec_f64().unwrap(), want.clone());
        if !y.is_contiguous() { prop_assert!(y.view([-1isize]).is_err()); }
        // slice with a step, narrow and select
        let d = rng.below(r);
        let (start, step) = (rng.below(shape[d]), 1 + rng.below(3));
        let s = x.slice(d as isize, start as isize, shape[d] as isize, step).unwrap();
        prop_assert!(s.shares_storage(&x));
        let mut ss = shape.clone();
        ss[d] = (shape[d] - start).div_ceil(step);
        let want_s: Vec<f64> = (0..numel(&ss)).map(|i| { let mut o = unravel(i, &ss); o[d] = start + o[d] * step; vals[ravel(&o, &shape)] }).collect();
        check(&s, &want_s, &ss, DType::F32, "slice");
        let sel = x.select(d as isize, -1).unwrap();
        let mut sels = shape.clone();
        sels.remove(d);
        let want_sel: Vec<f64> = (0..numel(&sels)).map(|i| { let mut o = unravel(i, &sels); o.insert(d, shape[d] - 1); vals[ravel(&o, &shape)] }).collect();
        check(&sel, &want_sel, &sels, DType::F32, "select");
        prop_assert!(sel.shares_storage(&x));
        // transpose of two dims and expand of a size-1 dim
        let t = x.transpose(0, -1).unwrap();
        prop_assert!(t.shares_storage(&x));
        prop_assert_eq!(t.shape()[0], shape[r - 1]);
        let e = x.narrow(0, 0, 1).unwrap().expand(vec![3i64].into_iter().chain(shape[1..].iter().map(|&v| v as i64)).collect::<Vec<_>>()).unwrap();
        prop_assert!(e.shares_storage(&x));
        prop_assert_eq!(e.strides()[0], 0);
        let row: Vec<f64> = vals[..numel(&shape[1..])].to_vec();
        prop_assert_eq!(e.to_vec_f64().unwrap(), [row.clone(), row.clone(), row].concat());
        // squeeze drops every size-1 dim
        let sq: Vec<usize> = shape.iter().copied().filter(|&v| v != 1).collect();
        let squeezed = x.squeeze().unwrap();
        prop_assert_eq!(squeezed.shape(), sq.as_slice());
    }
}

#[test]
fn views_alias_writes() -> Result<()> {
    let x = Tensor::from_vec(vec![1.0f32, 2., 3., 4., 5., 6.], &[2, 3])?;
    let t = x.t()?;
    assert!(!t.is_contiguous() && t.shares_storage(&x));
    let c = t.contiguous()?;
    assert!(!c.shares_storage(&x));
    // writing through a view is seen by the base; the contiguous copy is unaffected
    let col = x.select(1, 1)?;
    col.assign(&Tensor::from_vec(vec![20.0f32, 50.], &[2])?)?;
    assert_eq!(x.to_vec::<f32>()?, vec![1., 20., 3., 4., 50., 6.]);
    assert_eq!(t.to_vec::<f32>()?, vec![1., 4., 20., 50., 3., 6.]);
    assert_eq!(c.to_vec::<f32>()?, vec![1., 4., 2., 5., 3., 6.]);
    Ok(())
}

#[test]
fn display_matches_pytorch() -> Result<()> {
    let s = |t: Tensor| t.to_string();
    assert_eq!(
        s(Tensor::from_vec(vec![1.0f32, 2., 3.], &[3])?),
        "tensor([1., 2., 3.])"
    );
    assert_eq!(
        s(Tensor::from_vec(vec![1.5f32, -2.25], &[2])?),
        "tensor([ 1.5000, -2.2500])"
    );
    assert_eq!(
        s(Tensor::from_vec(vec![1.0f32, 2., 3., 4.], &[2, 2])?),
        "tensor([[1., 2.],\n        [3., 4.]])"
    );
    assert_eq!(
        s(Tensor::from_vec(vec![1i64, -20, 3], &[3])?),
        "tensor([  1, -20,   3])"
    );
    assert_eq!(
        s(Tensor::from_vec(
            vec![1i64, 2, 3, 4, 5, 6, 7, 8],
            &[2, 2, 2]
        )?),
        "tensor([[[1, 2],\n         [3, 4]],\n\n        [[5, 6],\n         [7, 8]]])"
    );
    assert_eq!(
        s(Tensor::from_vec(vec![1i32, 2], &[2])?),
        "tensor([1, 2], dtype=torch.int32)"
    );
    assert_eq!(
        s(Tensor::from_vec(vec![true, false], &[2])?),
        "tensor([ True, False])"
    );
    assert_eq!(
        s(Tensor::from_vec(vec![1.0f64, 2.5], &[2])?),
        "tensor([1.0000, 2.5000], dtype=torch.float64)"
    );
    assert_eq!(
        s(Tensor::from_vec(vec![half::f16::from_f32(0.5)], &[1])?),
        "tensor([0.5000], dtype=torch.float16)"
    );
    assert_eq!(s(Tensor::scalar(3.0f32)), "tensor(3.)");
    assert_eq!(s(Tensor::scalar(7i64)), "tensor(7)");
    assert_eq!(
        s(Tensor::from_vec(vec![1e-5f32, 1.0], &[2])?),
        "tensor([1.0000e-05, 1.0000e+00])"
    );
    assert_eq!(
        s(Tensor::from_vec(vec![1.0f32, 1e6], &[2])?),
        "tensor([1.0000e+00, 1.0000e+06])"
    );
    assert_eq!(
        s(Tensor::from_vec(vec![100000000.0f32], &[1])?),
        "tensor([100000000.])"
    );
    assert_eq!(
        s(Tensor::from_vec(
            vec![f32::NAN, 1.0, f32::NEG_INFINITY],
            &[3]
        )?),
        "tensor([nan, 1., -inf])"
    );
    assert_eq!(s(Tensor::zeros(&[0], DType::F32)?), "tensor([])");
    assert_eq!(
        s(Tensor::zeros(&[0, 3], DType::F32)?),
        "tensor([], size=(0, 3))"
    );
    assert_eq!(
        s(Tensor::zeros(&[2], DType::F32)?.with_grad()?),
        "tensor([0., 0.], requires_grad=True)"
    );
    // a non-contiguous view prints its logical order
    let t = Tensor::from_vec(vec![1i64, 2, 3, 4], &[2, 2])?.t()?;
    assert_eq!(s(t), "tensor([[1, 3],\n        [2, 4]])");
    Ok(())
}
