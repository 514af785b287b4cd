//! `Module::to(Device::Cuda(0))` with the real runtime: names, devices, leaves, forward and
//! backward on the GPU against the same module on the CPU, and back to the CPU.

use kiln_core::{Device, Tensor};
use kiln_nn::{BatchNorm2d, Conv2d, Conv2dConfig, Flatten, Linear, Module, ReLU, Sequential};

use super::harness::{input, rel_err, Rng, CUDA};

type Outcome = std::result::Result<(), String>;

fn net() -> kiln_core::Result<Sequential> {
    // no conv bias before a training-mode BatchNorm: its gradient is exactly zero in theory and
    // rounding noise in practice, which a relative comparison cannot judge
    let same = Conv2dConfig {
        padding: [1, 1],
        bias: false,
        ..Conv2dConfig::default()
    };
    Ok(Sequential::new()
        .add(Conv2d::new(3, 8, [3, 3], same)?)
        .add(BatchNorm2d::new(8)?)
        .add(ReLU::new())
        .add(Flatten::new(1, -1))
        .add(Linear::new(8 * 5 * 5, 4, true)?))
}

fn values(t: &Tensor) -> std::result::Result<Vec<f64>, String> {
    t.to_vec_f64().map_err(|e| e.to_string())
}

pub fn module_to_cuda_and_back() -> Outcome {
    let e = |x: kiln_core::Error| x.to_string();
    let mut rng = Rng::new(3000);
    let x = input(&mut rng, &[2, 3, 5, 5], -1.0, 1.0, false).map_err(e)?;
    let mut cpu = net().map_err(e)?;
    let mut gpu = net().map_err(e)?;
    gpu.load_state_dict(&cpu.state_dict(), true).map_err(e)?;
    let names: Vec<String> = gpu.state_dict().keys().map(|k| k.to_string()).collect();
    gpu.to(CUDA).map_err(e)?;
    let moved: Vec<String> = gpu.state_dict().keys().map(|k| k.to_string()).collect();
    if moved != names {
        return Err(format!("names changed: {names:?} -> {moved:?}"));
    }
    for (name, t) in gpu.named_parameters() {
        if t.device() != CUDA || !t.requires_grad() || !t.is_leaf() {
            return Err(format!("{name}: {t:?} requires_grad={}", t.requires_grad()));
        }
    }
    for (name, t) in gpu.named_buffers() {
        if t.device() != CUDA {
            return Err(format!("buffer {name} on {}", t.device()));
        }
    }
    // a training-mode step on both: outputs, gradients and running stats agree
    let want = cpu.forward(&x).map_err(e)?;
    let got = gpu.forward(&x.to(CUDA).map_err(e)?).map_err(e)?;
    let err = rel_err(&values(&got)?, &values(&want)?)?;
    if got.device() != CUDA || err > 1e-5 {
        return Err(format!("forward on {}: error {err:.2e}", got.device()));
    }
    want.sum_all().map_err(e)?.backward().map_err(e)?;
    got.sum_all().map_err(e)?.backward().map_err(e)?;
    for ((name, g), (_, c)) in gpu.named_parameters().iter().zip(cpu.named_parameters()) {
        let (gg, cg) = match (g.grad(), c.grad()) {
            (Some(a), Some(b)) => (a, b),
            _ => return Err(format!("{name}: missing gradient")),
        };
        let err = rel_err(&values(&gg)?, &values(&cg)?)?;
        if gg.device() != CUDA || err > 1e-5 {
            return Err(format!("{name} grad on {}: error {err:.2e}", gg.device()));
        }
    }
    for ((name, g), (_, c)) in gpu.named_buffers().iter().zip(cpu.named_buffers()) {
        let err = rel_err(&values(g)?, &values(&c)?)?;
        if err > 1e-5 {
            return Err(format!("running buffer {name}: error {err:.2e}"));
        }
    }
    gpu.to(Device::Cpu).map_err(e)?;
    cpu.to(Device::Cpu).map_err(e)?;
    if gpu.parameters().iter().any(|p| p.device() != Device::Cpu) {
        return Err("parameters did not come back to the CPU".into());
    }
    Ok(())
}
