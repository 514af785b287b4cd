//! What the generated kernels of a training step move through memory, as planned for an H100
//! (`kiln::inductor::traffic`), on the mock device: no GPU needed, and the plan is exactly the
//! one a GPU gets. Batch norm's backward is the case: a fusion decision that writes one more
//! activation-sized buffer shows here as bytes, deterministically, long before a benchmark.

#[path = "support/capture.rs"]
mod capture;
#[path = "../../kiln-core/tests/support/mock_device.rs"]
mod mock_device;

use std::sync::Arc;

use capture::Capture;
use kiln::compiler::graph::Graph;
use kiln::nn::{BatchNorm2d, Conv2d, Conv2dConfig, Module, ReLU, Sequential};
use kiln::prelude::*;
use mock_device::{setup, DEV};

/// An H100's multiprocessors: the split reductions' chunk counts depend on them.
const SMS: u32 = 132;

/// Bytes the generated kernels of `g` read and write, and their table (for a failure message).
fn generated_bytes(g: &Graph) -> Result<(usize, String)> {
    let mut total = 0;
    let mut table = String::new();
    for s in kiln::inductor::traffic::cuda_traffic(g, SMS)? {
        if s.generated {
            total += s.read + s.written;
        }
        table += &format!(
            "  {:>6} {:24} read {:>10} written {:>10} {:?}\n",
            if s.generated { "kernel" } else { "extern" },
            &s.name[..s.name.len().min(24)],
            s.read,
            s.written,
            s.writes
        );
    }
    Ok((total, table))
}

/// conv → batch norm → ReLU → conv in training, on a [16, 64, 32, 32] activation (large enough
/// for batch norm's sums to be split as on a GPU). The forward reads the batch norm's input once
/// for its statistics. The backward's generated kernels move at
/// most 9.5 activations: batch norm's three passes read the convolution's output and the
/// gradient (2 + 1 + 2, the first pass's four sums in one kernel) and write the input's
/// gradient (1); the output gradient, handed in NCHW, is made NHWC (2); partial sums and
/// weights make up the rest (8.77 in all). The ReLU output the second convolution's weight
/// gradient reads is saved by the forward, which writes it anyway. At commit 2ef8e10 the sums
/// were separate kernels, the ReLU mask and scales were written out and the ReLU output was
/// rebuilt: 20 activations at [64, 64, 56, 56].
#[test]
fn batch_norm_backward_moves_few_activations() -> Result<()> {
    setup();
    let conv = || {
        Conv2d::new(
            64,
            64,
            [3, 3],
            Conv2dConfig {
                padding: [1, 1],
                bias: false,
                ..Default::default()
            },
        )
    };
    let mut m = Sequential::new()
        .add(conv()?)
        .add(BatchNorm2d::new(64)?)
        .add(ReLU::new())
        .add(conv()?);
    m.train(true);
    m.to(DEV)?;
    let capture = Capture::new();
    let aot = Arc::new(kiln::compiler::aot::AotBackend::new(
        "capture",
        capture.clone(),
    ));
    let compiled = kiln::compile(&m, CompileOptions::default().custom_backend(aot))?;
    let shape = [16, 64, 32, 32];
    let x = Tensor::randn(&shape, DType::F32)?.to(DEV)?;
    compiled.forward(&x)?.sum(&[], false)?.backward()?;
    let graphs = capture.graphs();
    assert_eq!(graphs.len(), 2, "a forward and a backward graph");
    let activation = shape.iter().product::<usize>() * 4;
    let (bytes, table) = generated_bytes(&graphs[1])?;
    let moved = bytes as f64 / activation as f64;
    assert!(
        moved <= 9.5,
        "the backward's kernels move {moved:.2} activations:\n{table}"
    );
    // the forward's batch norm reads the convolution's output once for its statistics (its
    // mean's sum, Σx and Σx² in f64: sibling sums, `two_pass.rs`) and once to normalize: 7.77
    // activations in all; with the squared deviations' two sums (the mean's, then the squares
    // around it) it read the output twice for them: 8.52
    let (bytes, table) = generated_bytes(&graphs[0])?;
    let moved = bytes as f64 / activation as f64;
    assert!(
        moved <= 8.0,
        "the forward's kernels move {moved:.2} activations:\n{table}"
    );
    Ok(())
}

/// Bytes every step of `g` reads and writes, generated kernels and extern calls alike.
fn all_bytes(g: &Graph) -> Result<usize> {
    let steps = kiln::inductor::traffic::cuda_traffic(g, SMS)?;
    Ok(steps.iter().map(|s| s.read + s.written).sum())
}

/// Cross-entropy on [256, 1000] logits, forward and backward. The forward reads the logits once
/// and writes one [256, 1000] value the backward keeps (`x - max`): max, sum of exponentials
/// and each row's picked log-probability are one row kernel, and the target's range is checked
/// by a gather out of a 1000-element zero row. The backward is one kernel (softmax minus the
/// one-hot target, times the gradient). Before the pick became a sum over the row (one_hot.rs),
/// the log-probabilities were written out for an extern gather, and the gradient went through
/// an extern scatter_add into a saved [256, 1000] tensor of zeros: 5 logits' worth of bytes in
/// the forward and 5 in the backward.
#[test]
fn cross_entropy_reads_the_logits_once() -> Result<()> {
    setup();
    let capture = Capture::new();
    let aot = Arc::new(kiln::compiler::aot::AotBackend::new(
        "capture",
        capture.clone(),
    ));
    let loss = kiln::compile_fn(
        |a: &[Tensor]| {
            Ok(vec![a[0].cross_entropy(
                &a[1],
                None,
                0.0,
                Reduction::Mean,
            )?])
        },
        CompileOptions::default().custom_backend(aot),
    )?;
    let (rows, classes) = (256usize, 1000usize);
    let x = Tensor::randn(&[rows, classes], DType::F32)?
        .to(DEV)?
        .with_grad()?;
    let targets: Vec<i64> = (0..rows as i64).map(|i| (i * 7) % classes as i64).collect();
    let t = Tensor::from_vec(targets, &[rows])?.to(DEV)?;
    loss.call(&[x.clone(), t])?.remove(0).backward()?;
    let graphs = capture.graphs();
    assert_eq!(graphs.len(), 2, "a forward and a backward graph");
    let logits = rows * classes * 4;
    for (g, name, most) in [(&graphs[0], "forward", 2.1), (&graphs[1], "backward", 2.1)] {
        let moved = all_bytes(g)? as f64 / logits as f64;
        let (_, table) = generated_bytes(g)?;
        assert!(
            moved <= most,
            "the {name} moves {moved:.2} logits' worth of bytes:\n{table}"
        );
    }
    let (_, table) = generated_bytes(&graphs[1])?;
    assert!(
        !table.contains("extern"),
        "the backward runs no extern call:\n{table}"
    );
    Ok(())
}
