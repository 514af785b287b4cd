//! What a user sees when CUDA cannot be used. Runs on every machine, GPU or not.

use kiln_core::{DType, Device, Tensor};

#[test]
fn a_missing_library_is_named_with_where_kiln_looked_and_what_to_set() {
    let err = kiln_cuda::probe_libraries(&["kiln_no_such_cuda_lib"]).unwrap_err();
    for want in [
        "kiln_no_such_cuda_lib",
        "was not found",
        "looked in",
        "LD_LIBRARY_PATH",
        "To fix",
    ] {
        assert!(err.contains(want), "message lacks {want:?}: {err}");
    }
}

#[test]
fn to_cuda_is_an_error_or_works_never_a_panic() {
    kiln_cuda::init();
    let t = Tensor::ones(&[2, 3], DType::F32).unwrap();
    match t.to(Device::Cuda(0)) {
        Ok(g) => {
            // a GPU machine: the round trip keeps the values
            assert_eq!(g.device(), Device::Cuda(0));
            assert_eq!(
                g.to(Device::Cpu).unwrap().to_vec::<f32>().unwrap(),
                vec![1.0; 6]
            );
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.contains("Cuda(0)"), "{msg}");
            assert!(
                msg.contains("not found") || msg.contains("cuInit"),
                "unclear error: {msg}"
            );
            assert!(!kiln_cuda::is_available());
            assert_eq!(kiln_cuda::device_count(), 0);
        }
    }
}

#[test]
fn a_device_that_does_not_exist_is_an_error() {
    kiln_cuda::init();
    let t = Tensor::ones(&[2], DType::F32).unwrap();
    let err = t.to(Device::Cuda(4096)).unwrap_err().to_string();
    assert!(err.contains("Cuda(4096)"), "{err}");
}
