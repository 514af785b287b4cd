//! ResNet and DenseNet against torchvision: parameter counts (torchvision's published figures),
//! state-dict key names and shapes, torchvision's initialisation, safetensors round trips, forward
//! shapes, train/eval behaviour of the BatchNorm buffers, and errors on bad inputs.

use kiln_core::{manual_seed, DType, Tensor};
use kiln_models::densenet::densenet121;
use kiln_models::resnet::{resnet18, resnet34, resnet50};
use kiln_nn::io::{
    from_safetensors_bytes, load_safetensors, save_safetensors, to_safetensors_bytes,
};
use kiln_nn::{Module, StateDict};

/// A tensor's elements as raw bits, so comparisons are exact (NaN-safe, -0.0 ≠ 0.0).
fn bits(t: &Tensor) -> Vec<u64> {
    match t.dtype() {
        DType::F32 => t
            .to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(|x| x.to_bits() as u64)
            .collect(),
        DType::I64 => t
            .to_vec::<i64>()
            .unwrap()
            .into_iter()
            .map(|x| x as u64)
            .collect(),
        other => panic!("unexpected dtype {other:?}"),
    }
}

fn shape_of(sd: &StateDict, key: &str) -> Vec<usize> {
    sd.get(key)
        .unwrap_or_else(|| panic!("missing key {key}"))
        .shape()
        .to_vec()
}

fn images(shape: &[usize], seed: u64) -> Tensor {
    manual_seed(seed);
    Tensor::randn(shape, DType::F32).unwrap()
}

// torchvision's figures: sum(p.numel() for p in torchvision.models.NAME().parameters()), as listed
// in torchvision's model documentation ("num_params").
#[test]
fn parameter_counts_match_torchvision() {
    assert_eq!(resnet18(1000).unwrap().num_parameters(), 11_689_512);
    assert_eq!(resnet34(1000).unwrap().num_parameters(), 21_797_672);
    assert_eq!(resnet50(1000).unwrap().num_parameters(), 25_557_032);
    assert_eq!(densenet121(1000).unwrap().num_parameters(), 7_978_856);
    // only the head depends on num_classes: 512 * 10 + 10 instead of 512 * 1000 + 1000
    assert_eq!(
        resnet18(10).unwrap().num_parameters(),
        11_689_512 - 513_000 + 5_130
    );
}

#[test]
fn resnet18_state_dict_keys_and_shapes() {
    let sd = resnet18(1000).unwrap().state_dict();
    // stem conv (1) + bn1 (5) + 8 basic blocks × (2 convs + 2 BNs = 12) + 3 downsamples
    // (conv + BN = 6) + fc (2) = 6 + 96 + 18 + 2
    assert_eq!(sd.len(), 122);
    let keys: Vec<&str> = sd.keys().collect();
    // torchvision's order: parameters before buffers within a module, modules in registration order
    assert_eq!(
        keys[..8],
        [
            "conv1.weight",
            "bn1.weight",
            "bn1.bias",
            "bn1.running_mean",
            "bn1.running_var",
            "bn1.num_batches_tracked",
            "layer1.0.conv1.weight",
            "layer1.0.bn1.weight",
        ]
    );
    assert_eq!(keys[keys.len() - 2..], ["fc.weight", "fc.bias"]);
    for (key, shape) in [
        ("conv1.weight", vec![64, 3, 7, 7]),
        ("layer1.1.conv2.weight", vec![64, 64, 3, 3]),
        ("layer2.0.conv1.weight", vec![128, 64, 3, 3]),
        ("layer2.0.downsample.0.weight", vec![128, 64, 1, 1]),
        ("layer2.0.downsample.1.running_var", vec![128]),
        ("layer3.0.downsample.1.num_batches_tracked", vec![]),
        ("layer4.1.bn2.bias", vec![512]),
        ("fc.weight", vec![1000, 512]),
        ("fc.bias", vec![1000]),
    ] {
        assert_eq!(shape_of(&sd, key), shape, "{key}");
    }
    // layer1 keeps 64 channels at stride 1: no projection shortcut
    assert!(!keys.iter().any(|k| k.starts_with("layer1.0.downsample")));
    assert_eq!(
        sd.get("bn1.num_batches_tracked").unwrap().dtype(),
        DType::I64
    );
}

#[test]
fn resnet50_state_dict_keys_and_shapes() {
    let sd = resnet50(1000).unwrap().state_dict();
    // 6 (stem) + 16 bottlenecks × (3 convs + 3 BNs = 18) + 4 downsamples × 6 + 2 (fc)
    assert_eq!(sd.len(), 6 + 16 * 18 + 4 * 6 + 2);
    for (key, shape) in [
        ("layer1.0.conv1.weight", vec![64, 64, 1, 1]),
        ("layer1.0.conv3.weight", vec![256, 64, 1, 1]),
        ("layer1.0.downsample.0.weight", vec![256, 64, 1, 1]),
        // torchvision (v1.5) puts the stride on the 3x3 conv; shapes are the same either way,
        // the stride is checked by forward_output_shapes below
        ("layer2.0.conv2.weight", vec![128, 128, 3, 3]),
        ("layer3.5.bn3.running_mean", vec![1024]),
        ("layer4.0.downsample.0.weight", vec![2048, 1024, 1, 1]),
        ("fc.weight", vec![1000, 2048]),
    ] {
        assert_eq!(shape_of(&sd, key), shape, "{key}");
    }
}

#[test]
fn densenet121_state_dict_keys_and_shapes() {
    let sd = densenet121(1000).unwrap().state_dict();
    // conv0 (1) + norm0 (5) + 58 dense layers × (2 BNs + 2 convs = 12) + 3 transitions × 6
    // + norm5 (5) + classifier (2)
    assert_eq!(sd.len(), 1 + 5 + 58 * 12 + 3 * 6 + 5 + 2);
    let keys: Vec<&str> = sd.keys().collect();
    assert_eq!(
        keys[..7],
        [
            "features.conv0.weight",
            "features.norm0.weight",
            "features.norm0.bias",
            "features.norm0.running_mean",
            "features.norm0.running_var",
            "features.norm0.num_batches_tracked",
            "features.denseblock1.denselayer1.norm1.weight",
        ]
    );
    assert_eq!(
        keys[keys.len() - 2..],
        ["classifier.weight", "classifier.bias"]
    );
    for (key, shape) in [
        ("features.conv0.weight", vec![64, 3, 7, 7]),
        ("features.denseblock1.denselayer1.norm1.weight", vec![64]),
        (
            "features.denseblock1.denselayer1.conv1.weight",
            vec![128, 64, 1, 1],
        ),
        (
            "features.denseblock1.denselayer1.norm2.running_mean",
            vec![128],
        ),
        (
            "features.denseblock1.denselayer1.conv2.weight",
            vec![32, 128, 3, 3],
        ),
        // 64 + 5 × 32 channels reach the sixth layer
        (
            "features.denseblock1.denselayer6.conv1.weight",
            vec![128, 224, 1, 1],
        ),
        ("features.transition1.norm.weight", vec![256]),
        ("features.transition1.conv.weight", vec![128, 256, 1, 1]),
        ("features.transition3.conv.weight", vec![512, 1024, 1, 1]),
        (
            "features.denseblock4.denselayer16.conv2.weight",
            vec![32, 128, 3, 3],
        ),
        ("features.norm5.num_batches_tracked", vec![]),
        ("features.norm5.weight", vec![1024]),
        ("classifier.weight", vec![1000, 1024]),
    ] {
        assert_eq!(shape_of(&sd, key), shape, "{key}");
    }
    // transition1 follows denseblock1 in the key order, as torchvision registers them
    let pos = |k: &str| keys.iter().position(|x| *x == k).unwrap();
    assert!(
        pos("features.denseblock1.denselayer6.conv2.weight")
            < pos("features.transition1.norm.weight")
    );
    assert!(
        pos("features.transition1.conv.weight")
            < pos("features.denseblock2.denselayer1.norm1.weight")
    );
}

/// Sample standard deviation of a tensor's elements (their mean is zero by construction).
fn rms(t: &Tensor) -> f64 {
    let v = t.to_vec_f64().unwrap();
    (v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64).sqrt()
}

#[test]
fn initialisation_follows_torchvision() {
    manual_seed(3);
    let r = resnet18(10).unwrap();
    // kaiming_normal_(mode='fan_out', nonlinearity='relu'): std = sqrt(2 / (out · kh · kw))
    for (w, fan_out) in [
        (&r.conv1.weight, 64.0f64 * 49.0),
        (
            &r.layer4.state_dict().get("1.conv2.weight").unwrap().clone(),
            512.0 * 9.0,
        ),
    ] {
        let want = (2.0 / fan_out).sqrt();
        assert!((rms(w) / want - 1.0).abs() < 0.05, "{} vs {want}", rms(w));
    }
    assert!(r
        .bn1
        .weight
        .as_ref()
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .all(|&x| x == 1.0));
    assert!(r
        .bn1
        .bias
        .as_ref()
        .unwrap()
        .to_vec::<f32>()
        .unwrap()
        .iter()
        .all(|&x| x == 0.0));

    let d = densenet121(10).unwrap();
    let sd = d.state_dict();
    // kaiming_normal_ with PyTorch's defaults (fan_in, leaky_relu a=0): std = sqrt(2 / (in · kh · kw))
    let w = sd
        .get("features.denseblock3.denselayer24.conv1.weight")
        .unwrap();
    let want = (2.0 / (992.0f64)).sqrt();
    assert!((rms(w) / want - 1.0).abs() < 0.05, "{} vs {want}", rms(w));
    assert!(bits(sd.get("classifier.bias").unwrap())
        .iter()
        .all(|&b| b == 0));
}

/// Every tensor of `a` equals the one of the same name in `b`, bit for bit, and the key lists match.
fn assert_state_dicts_identical(a: &StateDict, b: &StateDict) {
    let (ka, kb): (Vec<&str>, Vec<&str>) = (a.keys().collect(), b.keys().collect());
    let (mut sa, mut sb) = (ka.clone(), kb.clone());
    sa.sort_unstable();
    sb.sort_unstable();
    assert_eq!(sa, sb);
    for (k, t) in a.iter() {
        let u = b.get(k).unwrap();
        assert_eq!(t.dtype(), u.dtype(), "{k}");
        assert_eq!(t.shape(), u.shape(), "{k}");
        assert!(bits(t) == bits(u), "{k}: values differ");
    }
}

#[test]
fn resnet18_safetensors_round_trip_is_bit_exact() {
    manual_seed(11);
    let saved = resnet18(10).unwrap();
    // one training step's forward moves the running statistics away from their defaults
    saved.forward(&images(&[4, 3, 32, 32], 12)).unwrap();
    assert_eq!(
        saved
            .bn1
            .running
            .as_ref()
            .unwrap()
            .num_batches_tracked
            .item::<i64>()
            .unwrap(),
        1
    );
    saved.eval();

    let path =
        std::env::temp_dir().join(format!("kiln-resnet18-{}.safetensors", std::process::id()));
    save_safetensors(&saved, &path).unwrap();
    let file = load_safetensors(&path).unwrap();
    std::fs::remove_file(&path).unwrap();

    manual_seed(99);
    let loaded = resnet18(10).unwrap();
    loaded.eval();
    let x = images(&[2, 3, 32, 32], 13);
    // a fresh model differs (different seed), so the comparison below can fail
    assert!(bits(&loaded.forward(&x).unwrap()) != bits(&saved.forward(&x).unwrap()));
    loaded.load_state_dict(&file, true).unwrap();
    assert_state_dicts_identical(&saved.state_dict(), &loaded.state_dict());
    assert!(bits(&loaded.forward(&x).unwrap()) == bits(&saved.forward(&x).unwrap()));
}

#[test]
fn densenet121_safetensors_round_trip_is_bit_exact() {
    manual_seed(21);
    let saved = densenet121(5).unwrap();
    saved.forward(&images(&[2, 3, 32, 32], 22)).unwrap();
    saved.eval();
    let bytes = to_safetensors_bytes(&saved).unwrap();

    manual_seed(23);
    let loaded = densenet121(5).unwrap();
    loaded.eval();
    loaded
        .load_state_dict(&from_safetensors_bytes(&bytes).unwrap(), true)
        .unwrap();
    assert_state_dicts_identical(&saved.state_dict(), &loaded.state_dict());
    let x = images(&[2, 3, 32, 32], 24);
    assert!(bits(&loaded.forward(&x).unwrap()) == bits(&saved.forward(&x).unwrap()));
}

#[test]
fn forward_output_shapes() {
    manual_seed(31);
    let r = resnet18(10).unwrap();
    assert_eq!(
        r.forward(&images(&[2, 3, 32, 32], 1)).unwrap().shape(),
        [2, 10]
    );
    // non-square, odd sizes: adaptive pooling makes the head independent of the resolution
    assert_eq!(
        r.forward(&images(&[3, 3, 45, 29], 2)).unwrap().shape(),
        [3, 10]
    );
    // the stages' feature maps: 32 → 16 (conv1) → 8 (maxpool) → 8, 4, 2, 1
    let x = images(&[2, 3, 32, 32], 3);
    let stem = r.maxpool.forward(&r.conv1.forward(&x).unwrap()).unwrap();
    assert_eq!(stem.shape(), [2, 64, 8, 8]);
    let l2 = r.layer2.forward(&r.layer1.forward(&stem).unwrap()).unwrap();
    assert_eq!(l2.shape(), [2, 128, 4, 4]);

    let r50 = resnet50(7).unwrap();
    let l1 = r50.layer1.forward(&stem).unwrap();
    assert_eq!(l1.shape(), [2, 256, 8, 8]);
    let l2 = r50.layer2.forward(&l1).unwrap();
    assert_eq!(l2.shape(), [2, 512, 4, 4]);
    // one image reaches layer4 at 1x1: one value per channel, which only eval mode accepts
    r50.eval();
    assert_eq!(
        r50.forward(&images(&[1, 3, 32, 32], 4)).unwrap().shape(),
        [1, 7]
    );

    let d = densenet121(5).unwrap();
    assert_eq!(
        d.forward(&images(&[2, 3, 32, 32], 5)).unwrap().shape(),
        [2, 5]
    );
    assert_eq!(
        d.features
            .forward(&images(&[1, 3, 64, 48], 6))
            .unwrap()
            .shape(),
        [1, 1024, 2, 1]
    );
}

fn bn_buffers(m: &dyn Module) -> Vec<(String, Vec<u64>)> {
    m.named_buffers()
        .into_iter()
        .map(|(n, t)| (n, bits(&t)))
        .collect()
}

#[test]
fn batchnorm_statistics_update_only_in_training() {
    manual_seed(41);
    for model in [
        Box::new(resnet18(10).unwrap()) as Box<dyn Module>,
        Box::new(densenet121(10).unwrap()),
    ] {
        let x = images(&[2, 3, 32, 32], 42);
        let fresh = bn_buffers(&*model);

        model.eval();
        let e1 = model.forward(&x).unwrap();
        assert_eq!(
            bn_buffers(&*model),
            fresh,
            "eval must not touch the running statistics"
        );

        model.train(true);
        let t1 = model.forward(&x).unwrap();
        let after = bn_buffers(&*model);
        for ((name, before), (_, now)) in fresh.iter().zip(&after) {
            if name.ends_with("num_batches_tracked") {
                assert_eq!(now, &vec![1], "{name}");
            } else {
                assert_ne!(now, before, "{name} should move in training");
            }
        }

        model.eval();
        let e2 = model.forward(&x).unwrap();
        assert_eq!(bn_buffers(&*model), after);
        // eval output depends on the running statistics, which training moved; the batch-statistics
        // output of training mode differs from both
        assert!(bits(&e1) != bits(&e2));
        assert!(bits(&t1) != bits(&e2));
        assert!(
            bits(&model.forward(&x).unwrap()) == bits(&e2),
            "eval is deterministic"
        );
    }
}

#[test]
fn bad_inputs_are_errors_that_name_the_model_and_shape() {
    manual_seed(51);
    let r = resnet18(10).unwrap();
    let d = densenet121(10).unwrap();
    let cases: [(&dyn Module, &str, Vec<usize>); 6] = [
        (&r, "ResNet", vec![2, 1, 32, 32]),
        (&r, "ResNet", vec![3, 32, 32]),
        (&r, "ResNet", vec![0, 3, 32, 32]),
        (&d, "DenseNet", vec![2, 4, 32, 32]),
        (&d, "DenseNet", vec![3, 32, 32]),
        (&d, "DenseNet", vec![2, 3, 28, 64]),
    ];
    for (model, name, shape) in cases {
        let before = bn_buffers(model);
        let err = model
            .forward(&Tensor::zeros(&shape, DType::F32).unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains(name), "{err}");
        assert!(err.contains(&format!("{shape:?}")), "{err}");
        // rejected before any BatchNorm counted the batch
        assert_eq!(bn_buffers(model), before, "{name} {shape:?}");
    }
    // 29 is the smallest side DenseNet-121 accepts
    assert_eq!(
        d.forward(&images(&[2, 3, 29, 29], 52)).unwrap().shape(),
        [2, 10]
    );

    assert!(resnet18(0).is_err());
    assert!(densenet121(0).is_err());
    let wrong = resnet18(10).unwrap().state_dict();
    let err = resnet18(11)
        .unwrap()
        .load_state_dict(&wrong, true)
        .unwrap_err()
        .to_string();
    assert!(err.contains("fc.weight"), "{err}");
}

/// A small DenseNet built from a custom config: dropout after each dense layer in training only,
/// the input-size bound follows the number of transitions, and bad configs are rejected.
#[test]
fn densenet_custom_config_dropout_and_validation() {
    use kiln_models::densenet::{DenseNet, DenseNetConfig};
    let config = DenseNetConfig {
        growth_rate: 4,
        block_config: vec![2, 3],
        num_init_features: 8,
        bn_size: 2,
        drop_rate: 0.5,
    };
    manual_seed(61);
    let d = DenseNet::new(config.clone(), 3).unwrap();
    // 8 + 2·4 = 16 → transition to 8 → 8 + 3·4 = 20 channels
    assert_eq!(d.features.num_features, 20);
    assert_eq!(
        shape_of(&d.state_dict(), "features.transition1.conv.weight"),
        [8, 16, 1, 1]
    );
    let x = images(&[2, 3, 16, 16], 62);
    let (a, b) = (d.forward(&x).unwrap(), d.forward(&x).unwrap());
    assert!(
        bits(&a) != bits(&b),
        "dropout draws a new mask per call in training"
    );
    d.eval();
    let (a, b) = (d.forward(&x).unwrap(), d.forward(&x).unwrap());
    assert!(bits(&a) == bits(&b), "no dropout in eval");

    // one transition: the stem's output must be at least 2x2, i.e. images of at least 5x5
    assert_eq!(
        d.forward(&images(&[1, 3, 5, 5], 63)).unwrap().shape(),
        [1, 3]
    );
    let err = d
        .forward(&images(&[1, 3, 4, 9], 64))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("too small") && err.contains("[1, 3, 4, 9]"),
        "{err}"
    );

    for bad in [
        DenseNetConfig {
            drop_rate: 1.0,
            ..config.clone()
        },
        DenseNetConfig {
            block_config: vec![],
            ..config.clone()
        },
        DenseNetConfig {
            growth_rate: 0,
            ..config.clone()
        },
    ] {
        let err = DenseNet::new(bad.clone(), 3).err().unwrap().to_string();
        assert!(err.contains("DenseNet"), "{bad:?}: {err}");
    }
}
