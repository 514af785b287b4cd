//! `nn.init` initialisers: the statistics of what they draw, and that they write in place.

use kiln_core::{manual_seed, DType, Tensor};
use kiln_nn::init::{self, FanMode};

/// Sample mean and standard deviation of a tensor's elements.
fn mean_std(t: &Tensor) -> (f64, f64) {
    let v = t.to_vec_f64().unwrap();
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n;
    (mean, var.sqrt())
}

#[test]
fn kaiming_normal_scales_by_the_chosen_fan() {
    manual_seed(7);
    // [out=64, in=16, 3, 3]: fan_in = 144, fan_out = 576, so the two modes differ by 2x in std
    let w = init::parameter(Tensor::zeros(&[64, 16, 3, 3], DType::F32).unwrap()).unwrap();
    let id = w.id();
    for (mode, fan) in [(FanMode::FanIn, 144.0f64), (FanMode::FanOut, 576.0)] {
        init::kaiming_normal_(&w, 0.0, mode).unwrap();
        assert_eq!(w.id(), id, "initialised in place");
        let (mean, std) = mean_std(&w);
        let want = (2.0 / fan).sqrt();
        // 9216 draws: the sample std is within ~1.5% of the true one with overwhelming probability
        assert!(
            (std / want - 1.0).abs() < 0.05,
            "{mode:?}: std {std} vs {want}"
        );
        assert!(mean.abs() < 0.05 * want, "{mode:?}: mean {mean}");
    }
}

#[test]
fn kaiming_normal_negative_slope_lowers_the_gain() {
    manual_seed(8);
    let w = Tensor::zeros(&[128, 100], DType::F32).unwrap();
    init::kaiming_normal_(&w, 1.0, FanMode::FanIn).unwrap();
    // gain sqrt(2 / (1 + 1)) = 1, fan_in = 100
    let (_, std) = mean_std(&w);
    assert!((std / 0.1 - 1.0).abs() < 0.05, "std {std}");
}

#[test]
fn kaiming_normal_rejects_vectors() {
    let b = Tensor::zeros(&[10], DType::F32).unwrap();
    let err = init::kaiming_normal_(&b, 0.0, FanMode::FanOut).unwrap_err();
    assert!(err.to_string().contains("fewer than 2 dimensions"), "{err}");
}
