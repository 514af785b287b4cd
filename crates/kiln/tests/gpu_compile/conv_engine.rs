//! The default mode's convolution engine, chosen per compiled function
//! (`kiln-cuda/src/conv_choice.rs`, `function_choice`): a function with many distinct
//! convolutions times them once on cuDNN and on kiln's generated kernels and runs all of them on
//! one engine; a function with few runs cuDNN without timing; the choice is read back from disk
//! by a later scope over the same cache folder (a new process's view).

use kiln::cuda::{function_choices, generated_convs};
use kiln::inductor::{cache_dir, with_fresh_cache};
use kiln::prelude::*;

use super::{close_to_largest, conv_switches, err, randn, Outcome, CUDA};

/// How many convolutions `many_convs` runs: each of its own input channels, so all distinct,
/// more than the fewest a function's choice times (64).
const CONVS: usize = 66;

/// `CONVS` 3x3 convolutions of the first `4 i` channels of `x[0]` by `x[i]` (8 filters of
/// `4 i` channels), summed.
fn many_convs(x: &[Tensor]) -> Result<Vec<Tensor>> {
    let mut sum: Option<Tensor> = None;
    for (i, w) in x[1..].iter().enumerate() {
        let part = x[0].narrow(1, 0, 4 * (i + 1))?;
        let y = part.conv2d(w, None, [1, 1], [1, 1], [1, 1], 1)?;
        sum = Some(match sum {
            Some(s) => s.add(&y)?,
            None => y,
        });
    }
    Ok(vec![sum.ok_or_else(|| {
        kiln::Error::arg("many_convs", "no filters")
    })?])
}

/// `many_convs`'s inputs on the GPU, the first `filters` filters only.
fn inputs(filters: usize) -> Result<Vec<Tensor>> {
    let mut x = vec![randn(&[2, 4 * CONVS, 8, 8], 91)?.to(CUDA)?];
    for i in 1..=filters {
        x.push(
            randn(&[8, 4 * i, 3, 3], 91 + i as u64)?
                .mul(0.1)?
                .to(CUDA)?,
        );
    }
    Ok(x)
}

/// Generated convolutions `f` launches in one call of `compiled` on `x`, and its outputs.
fn launched(compiled: &kiln::CompiledFn<'_>, x: &[Tensor]) -> Result<(usize, Vec<Tensor>)> {
    let before = generated_convs();
    let out = compiled.call(x)?;
    Ok((generated_convs() - before, out))
}

/// A function of 66 distinct convolutions is timed once on both engines at its compile and runs
/// all of them on the engine chosen (66 generated launches a call, or none), equal to eager
/// within TF32's rounding; a new scope over the same cache folder reads the choice back and
/// times nothing. A function of 3 convolutions is not timed and runs on cuDNN, as every
/// function does under `ConvEngine::Cudnn`.
pub fn default_mode_chooses_one_convolution_engine_per_function() -> Outcome {
    let _switches = conv_switches();
    kiln::cuda::set_cudnn_allow_tf32(true);
    let r = (|| -> Outcome {
        let x = inputs(CONVS).map_err(err)?;
        let want = many_convs(&x).map_err(err)?;
        let opts = || CompileOptions::default().mode(Mode::Default);
        with_fresh_cache(|| -> Outcome {
            kiln::reset();
            let (timed, chose, read) = function_choices();
            let compiled = kiln::compile_fn(many_convs, opts()).map_err(err)?;
            let (_, first) = launched(&compiled, &x).map_err(err)?;
            close_to_largest("first call", &first, &want, 5e-3)?;
            let (timed_now, chose_now, _) = function_choices();
            if timed_now != timed + 1 {
                return Err(format!(
                    "{} functions timed by the compile, want 1",
                    timed_now - timed
                ));
            }
            let generated = chose_now == chose + 1;
            let (n, second) = launched(&compiled, &x).map_err(err)?;
            close_to_largest("second call", &second, &want, 5e-3)?;
            let want_n = if generated { CONVS } else { 0 };
            eprintln!(
                "conv engine: {} ({:?} ms on cuDNN and kiln's)",
                if generated { "kiln's" } else { "cuDNN" },
                kiln::cuda::last_function_timing()
            );
            if n != want_n {
                return Err(format!("{n} generated convolutions a call, want {want_n}"));
            }
            // a new process's view: the choice read from disk
            kiln::reset();
            let again = kiln::core::cache::with_root(cache_dir(), || -> Result<_> {
                let compiled = kiln::compile_fn(many_convs, opts())?;
                compiled.call(&x)?;
                launched(&compiled, &x)
            });
            let (n, out) = again.map_err(err)?;
            close_to_largest("new scope", &out, &want, 5e-3)?;
            let (timed_after, _, read_after) = function_choices();
            if timed_after != timed_now || read_after != read + 1 || n != want_n {
                return Err(format!(
                    "a new scope timed {} functions, read {} choices and launched {n} generated \
                     convolutions, want 0, 1 and {want_n}",
                    timed_after - timed_now,
                    read_after - read
                ));
            }
            // few convolutions, or cuDNN asked for: nothing timed, nothing generated
            let few = inputs(3).map_err(err)?;
            for engine in [kiln::cuda::ConvEngine::Auto, kiln::cuda::ConvEngine::Cudnn] {
                kiln::cuda::set_conv_engine(engine);
                let timed = function_choices().0;
                let compiled = kiln::compile_fn(many_convs, opts()).map_err(err)?;
                let calls = [&few, &x].map(|x| launched(&compiled, x));
                kiln::cuda::set_conv_engine(kiln::cuda::ConvEngine::Auto);
                for (c, what) in calls.into_iter().zip(["3 convolutions", "66 convolutions"]) {
                    let (n, _) = c.map_err(err)?;
                    let cudnn_wanted =
                        engine == kiln::cuda::ConvEngine::Cudnn || what.starts_with('3');
                    if cudnn_wanted && n != 0 {
                        return Err(format!("{engine:?}, {what}: {n} generated convolutions"));
                    }
                }
                if function_choices().0 != timed {
                    return Err(format!("{engine:?}: a function was timed"));
                }
            }
            Ok(())
        })
    })();
    kiln::cuda::set_conv_engine(kiln::cuda::ConvEngine::Auto);
    kiln::cuda::set_cudnn_allow_tf32(false);
    r
}
