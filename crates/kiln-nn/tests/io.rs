//! safetensors round trips, the on-disk format, and IO errors.

mod common;

use common::*;
use half::{bf16, f16};
use kiln_core::{DType, Error, Tensor};
use kiln_nn::io::{
    from_safetensors_bytes, load_safetensors, save_safetensors, to_safetensors_bytes,
};
use kiln_nn::*;

fn temp_path(tag: &str) -> std::path::PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    std::env::temp_dir().join(format!(
        "kiln-nn-{tag}-{}-{nanos}.safetensors",
        std::process::id()
    ))
}

fn all_dtypes() -> StateDict {
    let mut sd = StateDict::new();
    sd.insert(
        "f32",
        Tensor::from_vec(vec![1.5f32, -2.25, 3.0, 1e-30], &[2, 2]).unwrap(),
    );
    sd.insert(
        "f64",
        Tensor::from_vec(vec![std::f64::consts::PI, -1e300], &[2]).unwrap(),
    );
    sd.insert(
        "f16",
        Tensor::from_vec(vec![f16::from_f64(0.5), f16::from_f64(-65504.0)], &[2, 1]).unwrap(),
    );
    sd.insert(
        "bf16",
        Tensor::from_vec(vec![bf16::from_f64(1.0e20), bf16::from_f64(-3.0)], &[1, 2]).unwrap(),
    );
    sd.insert(
        "i32",
        Tensor::from_vec(vec![i32::MIN, 7, i32::MAX], &[3]).unwrap(),
    );
    sd.insert("i64", Tensor::scalar(i64::MAX - 1));
    sd.insert("u8", Tensor::from_vec(vec![0u8, 255, 17], &[3]).unwrap());
    sd.insert(
        "bool",
        Tensor::from_vec(vec![true, false, true], &[3]).unwrap(),
    );
    sd.insert("empty", Tensor::zeros(&[0, 3], DType::F32).unwrap());
    sd
}

#[test]
fn round_trip_all_dtypes_through_a_file() {
    let sd = all_dtypes();
    let path = temp_path("dtypes");
    save_safetensors(&sd, &path).unwrap();
    let back = load_safetensors(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(back.len(), sd.len());
    for (k, t) in sd.iter() {
        let b = back.get(k).unwrap_or_else(|| panic!("missing {k}"));
        assert_eq!(b.dtype(), t.dtype(), "{k}");
        assert_eq!(b.shape(), t.shape(), "{k}");
        assert_eq!(f64s(b), f64s(t), "{k}");
    }
}

#[test]
fn file_layout_is_standard_safetensors() {
    let mut sd = StateDict::new();
    // a transposed (non-contiguous) view is written in its logical row-major order
    let t = Tensor::from_vec(vec![1.0f32, 2., 3., 4., 5., 6.], &[2, 3])
        .unwrap()
        .t()
        .unwrap();
    sd.insert("0.weight", t);
    sd.insert("1.num_batches_tracked", Tensor::scalar(3i64));
    let bytes = to_safetensors_bytes(&sd).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let w = &header["0.weight"];
    assert_eq!(w["dtype"], "F32");
    assert_eq!(w["shape"], serde_json::json!([3, 2]));
    let off: Vec<usize> = w["data_offsets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as usize)
        .collect();
    let want: Vec<u8> = [1.0f32, 4., 2., 5., 3., 6.]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(&data[off[0]..off[1]], &want[..]);
    let nb = &header["1.num_batches_tracked"];
    assert_eq!(nb["dtype"], "I64");
    assert_eq!(nb["shape"], serde_json::json!([]));
    let back = from_safetensors_bytes(&bytes).unwrap();
    assert_eq!(
        f64s(back.get("0.weight").unwrap()),
        vec![1., 4., 2., 5., 3., 6.]
    );
}

#[test]
fn module_round_trip_restores_outputs() {
    let make = || {
        Sequential::new()
            .add(Conv2d::new(2, 4, [3, 3], Conv2dConfig::default().padding(1)).unwrap())
            .add(BatchNorm2d::new(4).unwrap())
            .add(Flatten::default())
            .add(Linear::new(4 * 3 * 3, 5, true).unwrap())
    };
    let a = make();
    // give the BN non-default running stats
    let x = tensor_f32(&values(2 * 2 * 3 * 3, 3, 1.0), &[2, 2, 3, 3]);
    a.forward(&x).unwrap();
    a.eval();
    let path = temp_path("module");
    save_safetensors(&a, &path).unwrap();
    let b = make();
    b.eval();
    let sd = load_safetensors(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    b.load_state_dict(&sd, true).unwrap();
    assert_eq!(f64s(&a.forward(&x).unwrap()), f64s(&b.forward(&x).unwrap()));
    assert_eq!(
        f64s(b.state_dict().get("1.num_batches_tracked").unwrap()),
        vec![1.0]
    );
}

#[test]
fn io_errors_name_the_path() {
    let path = temp_path("missing");
    match load_safetensors(&path) {
        Err(Error::Io(msg)) => assert!(msg.contains(&path.display().to_string()), "{msg}"),
        other => panic!("expected Io error, got {other:?}"),
    }
    let path = temp_path("garbage");
    std::fs::write(&path, b"definitely not safetensors").unwrap();
    let r = load_safetensors(&path);
    std::fs::remove_file(&path).unwrap();
    match r {
        Err(Error::Io(msg)) => assert!(msg.contains(&path.display().to_string()), "{msg}"),
        other => panic!("expected Io error, got {other:?}"),
    }
    let bad_dir = std::env::temp_dir()
        .join("kiln-nn-no-such-dir")
        .join("x.safetensors");
    assert!(matches!(
        save_safetensors(&all_dtypes(), &bad_dir),
        Err(Error::Io(_))
    ));
}
