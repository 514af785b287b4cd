//! Optimizers against independent f64 implementations of PyTorch's update formulas; foreach equals
//! the per-parameter loop; schedulers against their closed forms.

mod common;

use common::*;
use kiln_core::{DType, Tensor};
use kiln_nn::optim::*;

/// The problem: loss = ½ Σ a·(p − c)², so grad = a·(p − c). Parameter 2 is not in the loss.
struct Quadratic {
    shapes: Vec<Vec<usize>>,
    a: Vec<Vec<f64>>,
    c: Vec<Vec<f64>>,
    init: Vec<Vec<f64>>,
}

fn quadratic() -> Quadratic {
    let shapes = vec![vec![2, 3], vec![4], vec![3]];
    let n = |i: usize| shapes[i].iter().product::<usize>();
    Quadratic {
        a: (0..3)
            .map(|i| {
                values(n(i), 100 + i as u64, 1.0)
                    .iter()
                    .map(|v| 1.5 + v)
                    .collect()
            })
            .collect(),
        c: (0..3).map(|i| values(n(i), 200 + i as u64, 2.0)).collect(),
        init: (0..3).map(|i| values(n(i), 300 + i as u64, 1.0)).collect(),
        shapes,
    }
}

impl Quadratic {
    fn params(&self, dtype: DType) -> Vec<Tensor> {
        (0..3)
            .map(|i| {
                Tensor::from_vec(self.init[i].clone(), &self.shapes[i])
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
                    .with_grad()
                    .unwrap()
            })
            .collect()
    }
    /// Forward + backward over the first two parameters.
    fn backward(&self, ps: &[Tensor]) {
        let mut loss = Tensor::scalar(0.0f64);
        for (i, p) in ps.iter().enumerate().take(2) {
            let a = Tensor::from_vec(self.a[i].clone(), &self.shapes[i]).unwrap();
            let c = Tensor::from_vec(self.c[i].clone(), &self.shapes[i]).unwrap();
            let a = a.to_dtype(p.dtype()).unwrap();
            let c = c.to_dtype(p.dtype()).unwrap();
            let l = p.sub(&c).unwrap().square().unwrap().mul(&a).unwrap();
            let l = l
                .sum_all()
                .unwrap()
                .mul(0.5)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap();
            loss = loss.add(&l).unwrap();
        }
        loss.backward().unwrap();
    }
    fn grad(&self, i: usize, p: &[f64]) -> Vec<f64> {
        (0..p.len())
            .map(|j| self.a[i][j] * (p[j] - self.c[i][j]))
            .collect()
    }
}

fn run(opt: &mut dyn Optimizer, q: &Quadratic, ps: &[Tensor], steps: usize) {
    for _ in 0..steps {
        opt.zero_grad();
        q.backward(ps);
        opt.step().unwrap();
    }
}

// ---- independent references, written from PyTorch's documented algorithms ----

fn sgd_ref(q: &Quadratic, c: &SGDConfig, steps: usize) -> Vec<Vec<f64>> {
    let mut ps = q.init.clone();
    let mut bufs: Vec<Option<Vec<f64>>> = vec![None; 2];
    for _ in 0..steps {
        for i in 0..2 {
            let mut g = q.grad(i, &ps[i]);
            for j in 0..g.len() {
                if c.maximize {
                    g[j] = -g[j];
                }
                g[j] += c.weight_decay * ps[i][j];
            }
            if c.momentum != 0.0 {
                let buf = match bufs[i].take() {
                    None => g.clone(),
                    Some(b) => (0..g.len())
                        .map(|j| c.momentum * b[j] + (1.0 - c.dampening) * g[j])
                        .collect(),
                };
                for j in 0..g.len() {
                    g[j] = if c.nesterov {
                        g[j] + c.momentum * buf[j]
                    } else {
                        buf[j]
                    };
                }
                bufs[i] = Some(buf);
            }
            for j in 0..g.len() {
                ps[i][j] -= c.lr * g[j];
            }
        }
    }
    ps
}

#[allow(clippy::too_many_arguments)]
fn adam_ref(
    q: &Quadratic,
    lr: f64,
    (b1, b2): (f64, f64),
    eps: f64,
    wd: f64,
    amsgrad: bool,
    decoupled: bool,
    steps: usize,
) -> Vec<Vec<f64>> {
    let mut ps = q.init.clone();
    let mut m: Vec<Vec<f64>> = ps.iter().map(|p| vec![0.0; p.len()]).collect();
    let (mut v, mut vmax) = (m.clone(), m.clone());
    for t in 1..=steps {
        let t = t as i32;
        for i in 0..2 {
            let g0 = q.grad(i, &ps[i]);
            for j in 0..g0.len() {
                let mut g = g0[j];
                if decoupled {
                    ps[i][j] *= 1.0 - lr * wd;
                } else {
                    g += wd * ps[i][j];
                }
                m[i][j] = b1 * m[i][j] + (1.0 - b1) * g;
                v[i][j] = b2 * v[i][j] + (1.0 - b2) * g * g;
                let mhat = m[i][j] / (1.0 - b1.powi(t));
                vmax[i][j] = vmax[i][j].max(v[i][j]);
                let second = if amsgrad { vmax[i][j] } else { v[i][j] };
                let vhat = second / (1.0 - b2.powi(t));
                ps[i][j] -= lr * mhat / (vhat.sqrt() + eps);
            }
        }
    }
    ps
}

fn check(ps: &[Tensor], want: &[Vec<f64>], q: &Quadratic, tol: f64) {
    for i in 0..2 {
        assert_close(&f64s(&ps[i]), &want[i], tol);
    }
    // the parameter without a gradient is never touched
    assert_eq!(f64s(&ps[2]), q.init[2]);
}

#[test]
fn sgd_matches_reference() {
    let q = quadratic();
    let configs = [
        SGDConfig {
            lr: 0.1,
            ..Default::default()
        },
        SGDConfig {
            lr: 0.05,
            momentum: 0.9,
            dampening: 0.1,
            weight_decay: 0.01,
            ..Default::default()
        },
        SGDConfig {
            lr: 0.05,
            momentum: 0.8,
            weight_decay: 0.1,
            nesterov: true,
            ..Default::default()
        },
        SGDConfig {
            lr: 0.01,
            momentum: 0.5,
            maximize: true,
            ..Default::default()
        },
    ];
    for cfg in configs {
        let want = sgd_ref(&q, &cfg, 6);
        for foreach in [false, true] {
            let ps = q.params(DType::F64);
            let ids: Vec<u64> = ps.iter().map(|p| p.id()).collect();
            let mut opt = SGD::new(ps.clone(), SGDConfig { foreach, ..cfg }).unwrap();
            run(&mut opt, &q, &ps, 6);
            check(&ps, &want, &q, 1e-12);
            assert_eq!(ids, ps.iter().map(|p| p.id()).collect::<Vec<_>>());
        }
    }
}

#[test]
fn adam_and_adamw_match_reference() {
    let q = quadratic();
    let steps = 7;
    for (wd, amsgrad) in [(0.0, false), (0.1, false), (0.05, true)] {
        let want = adam_ref(&q, 0.1, (0.9, 0.99), 1e-8, wd, amsgrad, false, steps);
        let want_w = adam_ref(&q, 0.1, (0.9, 0.99), 1e-8, wd, amsgrad, true, steps);
        for foreach in [false, true] {
            let ps = q.params(DType::F64);
            let cfg = AdamConfig {
                lr: 0.1,
                betas: (0.9, 0.99),
                weight_decay: wd,
                amsgrad,
                foreach,
                ..Default::default()
            };
            let mut opt = Adam::new(ps.clone(), cfg).unwrap();
            run(&mut opt, &q, &ps, steps);
            check(&ps, &want, &q, 1e-10);
            assert_eq!(opt.steps(), &[steps as u64, steps as u64, 0]);

            let ps = q.params(DType::F64);
            let cfg = AdamWConfig {
                lr: 0.1,
                betas: (0.9, 0.99),
                weight_decay: wd,
                amsgrad,
                foreach,
                ..Default::default()
            };
            let mut opt = AdamW::new(ps.clone(), cfg).unwrap();
            run(&mut opt, &q, &ps, steps);
            check(&ps, &want_w, &q, 1e-10);
        }
    }
    assert_eq!(AdamWConfig::default().weight_decay, 0.01);
    assert_eq!(AdamConfig::default().weight_decay, 0.0);
}

/// Many f32 and f64 parameters, some without gradients on some steps: the flat implementation
/// must give the loop's numbers.
fn mixed_run(make: &dyn Fn(Vec<Tensor>, bool) -> Box<dyn Optimizer>) {
    let shapes: Vec<Vec<usize>> = vec![vec![3, 4], vec![5], vec![2, 2, 2], vec![7], vec![1]];
    let mk = |k: usize, s: &[usize]| {
        let n = s.iter().product();
        let dtype = if k == 3 { DType::F64 } else { DType::F32 };
        Tensor::from_vec(values(n, 500 + k as u64, 1.0), s)
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .with_grad()
            .unwrap()
    };
    let mut results = vec![];
    for foreach in [false, true] {
        let ps: Vec<Tensor> = shapes.iter().enumerate().map(|(k, s)| mk(k, s)).collect();
        let mut opt = make(ps.clone(), foreach);
        for step in 0..8usize {
            opt.zero_grad();
            // parameter k joins the loss only on some steps, so states and step counts diverge
            let mut loss = Tensor::scalar(0.0f64);
            for (k, p) in ps.iter().enumerate() {
                if (step + k) % 3 == 0 && k != 0 {
                    continue;
                }
                let l = p.sin().unwrap().mul(p).unwrap().sum_all().unwrap();
                loss = loss.add(l.to_dtype(DType::F64).unwrap()).unwrap();
            }
            loss.backward().unwrap();
            opt.step().unwrap();
        }
        results.push(ps.iter().map(f64s).collect::<Vec<_>>());
    }
    for (a, b) in results[0].iter().zip(&results[1]) {
        assert_close(b, a, 1e-6);
    }
}

#[test]
fn foreach_equals_for_loop() {
    mixed_run(&|ps, foreach| {
        Box::new(
            SGD::new(
                ps,
                SGDConfig {
                    lr: 0.05,
                    momentum: 0.9,
                    dampening: 0.2,
                    weight_decay: 0.01,
                    foreach,
                    ..Default::default()
                },
            )
            .unwrap(),
        )
    });
    mixed_run(&|ps, foreach| {
        Box::new(
            SGD::new(
                ps,
                SGDConfig {
                    lr: 0.05,
                    momentum: 0.9,
                    nesterov: true,
                    foreach,
                    ..Default::default()
                },
            )
            .unwrap(),
        )
    });
    for amsgrad in [false, true] {
        mixed_run(&|ps, foreach| {
            Box::new(
                Adam::new(
                    ps,
                    AdamConfig {
                        lr: 0.05,
                        weight_decay: 0.01,
                        amsgrad,
                        foreach,
                        ..Default::default()
                    },
                )
                .unwrap(),
            )
        });
        mixed_run(&|ps, foreach| {
            Box::new(
                AdamW::new(
                    ps,
                    AdamWConfig {
                        lr: 0.05,
                        amsgrad,
                        foreach,
                        ..Default::default()
                    },
                )
                .unwrap(),
            )
        });
    }
}

#[test]
fn invalid_optimizer_arguments_are_errors() {
    let p = || {
        vec![Tensor::zeros(&[2], DType::F32)
            .unwrap()
            .with_grad()
            .unwrap()]
    };
    let sgd = |c: SGDConfig| SGD::new(p(), c).is_err();
    assert!(sgd(SGDConfig {
        lr: -1.0,
        ..Default::default()
    }));
    assert!(sgd(SGDConfig {
        nesterov: true,
        ..Default::default()
    }));
    assert!(sgd(SGDConfig {
        nesterov: true,
        momentum: 0.9,
        dampening: 0.1,
        ..Default::default()
    }));
    assert!(SGD::new(vec![], SGDConfig::default()).is_err());
    let int = Tensor::zeros(&[2], DType::I64).unwrap();
    assert!(SGD::new(vec![int], SGDConfig::default()).is_err());
    let leaf = p().remove(0);
    let non_leaf = leaf.mul(2.0).unwrap();
    assert!(SGD::new(vec![non_leaf], SGDConfig::default()).is_err());
    let adam = |c: AdamConfig| Adam::new(p(), c).is_err();
    assert!(adam(AdamConfig {
        betas: (1.0, 0.999),
        ..Default::default()
    }));
    assert!(adam(AdamConfig {
        betas: (0.9, -0.1),
        ..Default::default()
    }));
    assert!(adam(AdamConfig {
        eps: -1.0,
        ..Default::default()
    }));
    assert!(adam(AdamConfig {
        lr: f64::NAN,
        ..Default::default()
    }));
}

#[test]
fn step_lr_sequence() {
    let p = vec![Tensor::zeros(&[1], DType::F32)
        .unwrap()
        .with_grad()
        .unwrap()];
    let mut opt = SGD::new(
        p,
        SGDConfig {
            lr: 0.1,
            ..Default::default()
        },
    )
    .unwrap();
    let mut s = StepLR::new(&opt, 3, 0.5).unwrap();
    assert_eq!(s.get_last_lr(), 0.1);
    for e in 1..=12 {
        s.step();
        let want = 0.1 * 0.5f64.powi(e / 3);
        assert!((s.get_last_lr() - want).abs() < 1e-15, "epoch {e}");
        assert_eq!(opt.lr(), s.get_last_lr());
    }
    // the optimizer really uses the scheduled lr
    opt.set_lr(0.25);
    assert_eq!(opt.lr(), 0.25);
    assert!(StepLR::new(&opt, 0, 0.5).is_err());
}

#[test]
fn cosine_annealing_sequence() {
    let p = vec![Tensor::zeros(&[1], DType::F32)
        .unwrap()
        .with_grad()
        .unwrap()];
    let opt = Adam::new(
        p,
        AdamConfig {
            lr: 0.1,
            ..Default::default()
        },
    )
    .unwrap();
    let (t_max, eta_min) = (10, 0.001);
    let mut s = CosineAnnealingLR::new(&opt, t_max, eta_min).unwrap();
    assert_eq!(s.get_last_lr(), 0.1);
    // the closed form holds for every epoch, past T_max too (the schedule is a cosine wave)
    for e in 1..=35 {
        s.step();
        let want = eta_min
            + (0.1 - eta_min) * (1.0 + (std::f64::consts::PI * e as f64 / t_max as f64).cos())
                / 2.0;
        assert!(
            (s.get_last_lr() - want).abs() < 1e-12,
            "epoch {e}: {} vs {want}",
            s.get_last_lr()
        );
        assert_eq!(opt.lr(), s.get_last_lr());
    }
    assert!(CosineAnnealingLR::new(&opt, 0, 0.0).is_err());
}

#[test]
fn scheduled_lr_drives_the_update() {
    // one SGD step at a scheduled lr moves the parameter by exactly lr * grad
    let p = Tensor::from_vec(vec![1.0f64], &[1])
        .unwrap()
        .with_grad()
        .unwrap();
    let mut opt = SGD::new(
        vec![p.clone()],
        SGDConfig {
            lr: 1.0,
            ..Default::default()
        },
    )
    .unwrap();
    let mut s = StepLR::new(&opt, 1, 0.1).unwrap();
    s.step();
    p.mul(&p).unwrap().sum_all().unwrap().backward().unwrap(); // grad = 2
    opt.step().unwrap();
    assert!((f64s(&p)[0] - (1.0 - 0.1 * 2.0)).abs() < 1e-15);
}
