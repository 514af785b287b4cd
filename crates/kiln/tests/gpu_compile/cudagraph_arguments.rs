//! reduce-overhead's arguments (`kiln-inductor/src/runtime/cudagraph.rs`): a device argument
//! passed again is read where it lies, so a replay copies nothing; its values written in place
//! between calls are what the replay reads; another tensor in its place records anew and is
//! copied from then on; the graph's own output passed back is copied, never read while the
//! replay writes it.

use kiln::prelude::*;

use super::{err, exec_stats, randn, same_outputs, Outcome, CUDA};

fn f(a: &[Tensor]) -> Result<Vec<Tensor>> {
    Ok(vec![a[0].sin()?.add(&a[0].cos()?)?.mul(&a[1])?])
}

fn cuda(shape: &[usize], seed: u64) -> std::result::Result<Tensor, String> {
    randn(shape, seed).and_then(|t| t.to(CUDA)).map_err(err)
}

/// One compiled call of `args` against eager: the bytes its replays copied and the replays.
fn call(
    compiled: &kiln::CompiledFn,
    what: &str,
    args: &[Tensor],
) -> std::result::Result<(u64, u64), String> {
    let want = f(args).map_err(err)?;
    let before = exec_stats();
    let got = compiled.call(args).map_err(err)?;
    let after = exec_stats();
    same_outputs(what, &got, &want, 1e-6)?;
    Ok((
        after.replay_copied_bytes - before.replay_copied_bytes,
        after.graph_replays - before.graph_replays,
    ))
}

pub fn reduce_overhead_reads_a_repeated_argument_in_place() -> Outcome {
    let compiled =
        kiln::compile_fn(f, CompileOptions::default().mode(Mode::ReduceOverhead)).map_err(err)?;
    let (x, w) = (cuda(&[256, 300], 1)?, cuda(&[300], 2)?);
    let x_bytes = (x.numel() * 4) as u64;
    // the first call runs, the second records holding x and w, the rest replay copying nothing
    for k in 0..5 {
        let (copied, replays) = call(
            &compiled,
            &format!("same x, call {k}"),
            &[x.clone(), w.clone()],
        )?;
        if k >= 1 && (copied != 0 || replays != 1) {
            return Err(format!(
                "same x, call {k}: {replays} replays copying {copied} bytes (want 1, 0)"
            ));
        }
    }
    // x's values written in place: the replay reads them where they lie
    x.assign(&cuda(&[256, 300], 3)?).map_err(err)?;
    let (copied, _) = call(&compiled, "x written in place", &[x.clone(), w.clone()])?;
    if copied != 0 {
        return Err(format!("x written in place: {copied} bytes copied"));
    }
    // other tensors in x's place: recorded anew once, then copied in before each replay (w stays held)
    for k in 0..3 {
        let y = cuda(&[256, 300], 10 + k)?;
        let (copied, replays) = call(&compiled, &format!("new x, call {k}"), &[y, w.clone()])?;
        if k >= 1 && (copied != x_bytes || replays != 1) {
            return Err(format!(
                "new x, call {k}: {replays} replays copying {copied} bytes (want 1, {x_bytes})"
            ));
        }
    }
    // the graph's own output passed back: copied in, so the replay does not write what it reads
    let mut v = x.clone();
    for k in 0..4 {
        let want = f(&[v.clone(), w.clone()]).map_err(err)?;
        let got = compiled.call(&[v.clone(), w.clone()]).map_err(err)?;
        same_outputs(&format!("output passed back, call {k}"), &got, &want, 1e-6)?;
        v = got.into_iter().next().ok_or("no output")?;
    }
    Ok(())
}
