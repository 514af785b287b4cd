//! GPU end-to-end checks of the facade (ignored, with the reason, without CUDA).
//!
//! No device-memory growth over 1000 training steps of the digits model on the GPU: after a
//! warm-up of two epochs (every batch size, the last short batch included, has been seen), the
//! caching allocator's live bytes, reserved bytes and driver allocations are the same before and
//! after (PyTorch's `torch.cuda.memory_stats` check). A machine without CUDA reports the
//! test as ignored, with the reason.

use kiln::data::{digits_path, permutation, Digits};
use kiln::models::DigitsCnn;
use kiln::nn::optim::{Adam, AdamConfig, Optimizer};
use kiln::prelude::*;
use libtest_mimic::{Arguments, Failed, Trial};

const CUDA: Device = Device::Cuda(0);
const STEPS: usize = 1000;

/// `steps` training steps from batch `from` on; the loss of each.
fn train_steps(
    model: &DigitsCnn,
    opt: &mut Adam,
    batches: &[(Tensor, Tensor)],
    from: usize,
    steps: usize,
) -> Result<Vec<f32>> {
    let mut losses = Vec::with_capacity(steps);
    for k in from..from + steps {
        let (x, y) = &batches[k % batches.len()];
        let loss = model
            .forward(x)?
            .cross_entropy(y, None, 0.0, Reduction::Mean)?;
        opt.zero_grad();
        loss.backward()?;
        opt.step()?;
        losses.push(loss.item::<f32>()?);
    }
    Ok(losses)
}

fn mean(v: &[f32]) -> f32 {
    v.iter().sum::<f32>() / v.len().max(1) as f32
}

fn no_growth_over_1000_steps() -> std::result::Result<(), Failed> {
    manual_seed(0);
    let data = Digits::load(&digits_path()?)?;
    let batches: Vec<(Tensor, Tensor)> = data
        .batches(&permutation(data.len(), 0), 32)?
        .into_iter()
        .map(|(x, y)| Ok((x.to(CUDA)?, y.to(CUDA)?)))
        .collect::<Result<_>>()?;
    let mut model = DigitsCnn::new()?;
    model.to(CUDA)?;
    let mut opt = Adam::new(
        model.parameters(),
        AdamConfig {
            lr: 2e-3,
            ..AdamConfig::default()
        },
    )?;
    let warmup = 2 * batches.len();
    let warm = train_steps(&model, &mut opt, &batches, 0, warmup)?;
    kiln::cuda::synchronize(CUDA)?;
    let before = kiln::cuda::memory_stats(CUDA)?;
    let steady = train_steps(&model, &mut opt, &batches, warmup, STEPS)?;
    // the first epoch's mean loss against the last epoch's (single batches are too noisy)
    let epoch = batches.len();
    let (first, last) = (mean(&warm[..epoch]), mean(&steady[STEPS - epoch..]));
    kiln::cuda::synchronize(CUDA)?;
    let after = kiln::cuda::memory_stats(CUDA)?;
    println!("mean loss: first epoch {first:.4}, last epoch (after {STEPS} more steps) {last:.4}");
    println!("memory before {before:?}\nmemory after  {after:?}");
    if !(last.is_finite() && last < first) {
        return Err(format!("the model did not train: loss {first} -> {last}").into());
    }
    if after.allocated != before.allocated
        || after.reserved != before.reserved
        || after.driver_allocs != before.driver_allocs
    {
        return Err(format!(
            "device memory grew over {STEPS} steps: before {before:?}, after {after:?}"
        )
        .into());
    }
    Ok(())
}

/// A small random BERT (the MiniLM shape scaled down) moved to the GPU gives the CPU's sentence
/// embeddings: the path `bert_embed --device cuda` takes, without the 91 MB weights.
fn small_bert_on_cuda_matches_cpu() -> std::result::Result<(), Failed> {
    use kiln::models::bert::{sentence_embedding, BertConfig, BertModel};
    manual_seed(1);
    let cfg = BertConfig {
        vocab_size: 97,
        hidden_size: 32,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 64,
        max_position_embeddings: 40,
        ..BertConfig::default()
    };
    let mut model = BertModel::from_config(&cfg)?;
    model.eval();
    let ids: Vec<i64> = (0..2 * 9).map(|i| (i * 7 % 97) as i64).collect();
    let ids = Tensor::from_vec(ids, &[2, 9])?;
    let mask: Vec<i64> = (0..2 * 9).map(|i| i64::from(i < 9 || i % 9 < 5)).collect();
    let mask = Tensor::from_vec(mask, &[2, 9])?;
    let embed = |m: &BertModel, ids: &Tensor, mask: &Tensor| -> Result<Tensor> {
        no_grad(|| sentence_embedding(&m.encode(ids, Some(mask), None)?, mask))
    };
    let want = embed(&model, &ids, &mask)?.to_vec_f64()?;
    model.to(CUDA)?;
    let got = embed(&model, &ids.to(CUDA)?, &mask.to(CUDA)?)?;
    if got.device() != CUDA {
        return Err(format!("embeddings on {}", got.device()).into());
    }
    let err = got
        .to_vec_f64()?
        .iter()
        .zip(&want)
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
    println!("small BERT on cuda: max abs difference from the CPU {err:.2e}");
    if err > 1e-5 {
        return Err(
            format!("sentence embeddings differ from the CPU's by {err:.2e} (bar 1e-5)").into(),
        );
    }
    Ok(())
}

fn main() {
    let args = Arguments::from_args();
    kiln::cuda::init();
    let available = kiln::cuda::is_available();
    if !available {
        eprintln!(
            "cuda_memory skipped: {}",
            kiln::cuda::unavailable_reason()
                .map(|e| e.to_string())
                .unwrap_or_default()
        );
    }
    let trials = vec![
        Trial::test(
            "digits_training_no_memory_growth",
            no_growth_over_1000_steps,
        )
        .with_ignored_flag(!available),
        Trial::test(
            "small_bert_on_cuda_matches_cpu",
            small_bert_on_cuda_matches_cpu,
        )
        .with_ignored_flag(!available),
    ];
    libtest_mimic::run(&args, trials).exit();
}
