//! A compiled function guards on the process's backend switches (`kiln::core::backends`: TF32
//! for matmuls and cuDNN, cuDNN's benchmark mode), as Dynamo's global-state guard does: a call
//! after a switch changed compiles anew, with the reason in the recompile log, and a call under
//! the earlier switches takes the entry compiled under them. (Its own test binary: the switches
//! are process-wide, and other tests count their compiles.)

use kiln::core::backends::{self, Switch};
use kiln::prelude::*;

#[test]
fn a_changed_switch_recompiles_and_switching_back_replays() -> Result<()> {
    let f = kiln::compile_fn(
        |a: &[Tensor]| Ok(vec![a[0].matmul(&a[1])?.relu()?]),
        CompileOptions::default(),
    )?;
    let x = [
        Tensor::randn(&[4, 8], DType::F32)?,
        Tensor::randn(&[8, 3], DType::F32)?,
    ];
    let want = x[0].matmul(&x[1])?.relu()?.to_vec::<f32>()?;
    let was = backends::get(Switch::MatmulTf32);
    let calls = || -> Result<()> {
        assert_eq!(f.call(&x)?[0].to_vec::<f32>()?, want);
        Ok(())
    };
    calls()?;
    calls()?;
    backends::set(Switch::MatmulTf32, !was);
    let changed = calls();
    backends::set(Switch::MatmulTf32, was);
    changed?;
    calls()?;
    let s = f.stats();
    assert_eq!((s.compiles, s.replays), (2, 2), "{s:?}");
    let reason = s.recompile_log.last().cloned().unwrap_or_default();
    assert!(reason.contains("backend switches changed"), "{reason}");
    Ok(())
}
