//! `torch.optim.SGD` with momentum, dampening, Nesterov, weight decay and maximize.

use kiln_core::{no_grad, Error, Result, Tensor};

use super::flat::{cat_flat, group_by_dtype, FlatGroup};
use super::{check_hyper, check_params, grad_of, LrHandle, Optimizer};

/// SGD's hyper-parameters, PyTorch's defaults in `Default`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SGDConfig {
    pub lr: f64,
    pub momentum: f64,
    pub dampening: f64,
    pub weight_decay: f64,
    pub nesterov: bool,
    pub maximize: bool,
    /// The multi-tensor implementation (one flat tensor per dtype) instead of a per-parameter loop.
    pub foreach: bool,
}

impl Default for SGDConfig {
    fn default() -> Self {
        SGDConfig {
            lr: 1e-3,
            momentum: 0.0,
            dampening: 0.0,
            weight_decay: 0.0,
            nesterov: false,
            maximize: false,
            foreach: false,
        }
    }
}

/// PyTorch's SGD rule on one tensor (a parameter, or every parameter concatenated):
///   g ← ±g + wd·p;  buf ← g (first step) or m·buf + (1−d)·g;  g ← g + m·buf (Nesterov) or buf;
///   p ← p − lr·g.
/// Returns the new parameter values and the new momentum buffer.
///
/// `buf: None` is a first step. A buffer that exists from the start (zeros) makes the rule the
/// same on every step, so a compiled step replays it: with no dampening m·0 + g is exactly g, the
/// first-step value; with dampening, `started` (a bool scalar) selects g on the first step.
pub(crate) fn update(
    p: &Tensor,
    g: &Tensor,
    buf: Option<&Tensor>,
    started: Option<&Tensor>,
    h: &SGDConfig,
    lr: f64,
) -> Result<(Tensor, Option<Tensor>)> {
    let mut g = if h.maximize { g.neg()? } else { g.clone() };
    if h.weight_decay != 0.0 {
        g = g.add(&p.mul(h.weight_decay)?)?;
    }
    let mut new_buf = None;
    if h.momentum != 0.0 {
        let b = match buf {
            // a copy, not a handle: the buffer must never alias the gradient (torch.clone(grad))
            None => {
                let b = Tensor::zeros_like(&g)?;
                b.assign(&g)?;
                b
            }
            Some(b) => {
                let next = b.mul(h.momentum)?.add(&g.mul(1.0 - h.dampening)?)?;
                match started {
                    Some(s) => Tensor::where_(s, &next, &g)?,
                    None => next,
                }
            }
        };
        g = if h.nesterov {
            g.add(&b.mul(h.momentum)?)?
        } else {
            b.clone()
        };
        new_buf = Some(b);
    }
    Ok((p.add(&g.mul(-lr)?)?, new_buf))
}

pub struct SGD {
    params: Vec<Tensor>,
    config: SGDConfig,
    lr: LrHandle,
    /// Per-parameter momentum buffers (for-loop mode with momentum): zeros from the start and
    /// written in place, so a compiled step sees the same tensors on every call.
    bufs: Vec<Tensor>,
    /// With dampening: per parameter, whether its buffer has had a first step (bool scalars).
    started: Vec<Tensor>,
    /// Foreach mode: dtype groups, one flat momentum buffer each, and which parameters have one yet.
    groups: Vec<FlatGroup>,
    flat_bufs: Vec<Tensor>,
    has_buf: Vec<bool>,
}

impl SGD {
    pub fn new(params: Vec<Tensor>, config: SGDConfig) -> Result<SGD> {
        let op = "SGD";
        check_hyper(op, "learning rate", config.lr, config.lr >= 0.0)?;
        check_hyper(op, "momentum", config.momentum, config.momentum >= 0.0)?;
        check_hyper(
            op,
            "dampening",
            config.dampening,
            config.dampening.is_finite(),
        )?;
        check_hyper(
            op,
            "weight_decay",
            config.weight_decay,
            config.weight_decay >= 0.0,
        )?;
        if config.nesterov && (config.momentum <= 0.0 || config.dampening != 0.0) {
            return Err(Error::arg(
                op,
                "Nesterov momentum requires a momentum and zero dampening",
            ));
        }
        let params = check_params(op, params)?;
        let n = params.len();
        let (groups, flat_bufs) = if config.foreach && config.momentum != 0.0 {
            let groups = group_by_dtype(&params);
            let bufs = groups.iter().map(|g| g.zeros()).collect::<Result<_>>()?;
            (groups, bufs)
        } else if config.foreach {
            (group_by_dtype(&params), Vec::new())
        } else {
            (Vec::new(), Vec::new())
        };
        let loop_momentum = !config.foreach && config.momentum != 0.0;
        let bufs = match loop_momentum {
            true => params
                .iter()
                .map(Tensor::zeros_like)
                .collect::<Result<_>>()?,
            false => Vec::new(),
        };
        let started = match loop_momentum && config.dampening != 0.0 {
            true => (0..n)
                .map(|_| Tensor::zeros(&[], kiln_core::DType::Bool))
                .collect::<Result<_>>()?,
            false => Vec::new(),
        };
        Ok(SGD {
            lr: LrHandle::new(config.lr),
            params,
            config,
            bufs,
            started,
            groups,
            flat_bufs,
            // with no dampening, the zero buffers already behave as a first step (see `update`)
            has_buf: vec![config.dampening == 0.0; n],
        })
    }

    pub fn config(&self) -> &SGDConfig {
        &self.config
    }

    fn step_loop(&mut self, lr: f64) -> Result<()> {
        // the value every first-step flag takes: made once per step, not once per parameter
        let yes = match self.started.is_empty() {
            true => None,
            false => Some(Tensor::ones(&[], kiln_core::DType::Bool)?),
        };
        for (i, p) in self.params.iter().enumerate() {
            let Some(g) = grad_of(p)? else { continue };
            let (buf, started) = (self.bufs.get(i), self.started.get(i));
            let (new_p, new_buf) = update(p, &g, buf, started, &self.config, lr)?;
            p.assign(&new_p)?;
            if let (Some(buf), Some(new_buf)) = (buf, new_buf) {
                buf.assign(&new_buf)?;
            }
            if let (Some(s), Some(yes)) = (started, &yes) {
                s.assign(yes)?;
            }
        }
        Ok(())
    }

    fn step_foreach(&mut self, lr: f64) -> Result<()> {
        let momentum = self.config.momentum != 0.0;
        for (gi, group) in self.groups.iter().enumerate() {
            let mut grads = Vec::new();
            let mut active = Vec::new();
            for (k, &i) in group.members.iter().enumerate() {
                if let Some(g) = grad_of(&self.params[i])? {
                    grads.push(g);
                    active.push(k);
                }
            }
            // parameters with and without a momentum buffer follow different rules; each class is
            // one flat update (after the first step there is a single class)
            let all: Vec<usize> = (0..active.len()).collect();
            let classes = match momentum {
                false => vec![(all, false)],
                true => [true, false]
                    .into_iter()
                    .map(|wb| {
                        let sel = all.iter().copied();
                        let sel = sel.filter(|&a| self.has_buf[group.members[active[a]]] == wb);
                        (sel.collect::<Vec<_>>(), wb)
                    })
                    .collect(),
            };
            for (sel, with_buf) in classes {
                if sel.is_empty() {
                    continue;
                }
                let ks: Vec<usize> = sel.iter().map(|&a| active[a]).collect();
                let ps: Vec<Tensor> = ks
                    .iter()
                    .map(|&k| self.params[group.members[k]].clone())
                    .collect();
                let gs: Vec<Tensor> = sel.iter().map(|&a| grads[a].clone()).collect();
                let (p_cat, g_cat) = (cat_flat(&ps)?, cat_flat(&gs)?);
                let buf = match with_buf {
                    true => Some(group.gather(&self.flat_bufs[gi], &ks)?),
                    false => None,
                };
                let (new_p, new_buf) =
                    update(&p_cat, &g_cat, buf.as_ref(), None, &self.config, lr)?;
                group.write_params(&self.params, &ks, &new_p)?;
                if !with_buf {
                    // which parameters have a buffer yet is Rust state a compiled replay cannot
                    // see: a compiled step is traced again on every call
                    if let Some(i) = kiln_core::intercept::current() {
                        i.retrace_every_call("SGD(foreach, dampening) starts momentum buffers");
                    }
                }
                if let Some(nb) = new_buf {
                    group.scatter_in_place(&self.flat_bufs[gi], &ks, nb)?;
                    for &k in &ks {
                        self.has_buf[group.members[k]] = true;
                    }
                }
            }
        }
        Ok(())
    }
}

impl Optimizer for SGD {
    fn step(&mut self) -> Result<()> {
        let lr = self.lr.get();
        no_grad(|| {
            if self.config.foreach {
                self.step_foreach(lr)
            } else {
                self.step_loop(lr)
            }
        })
    }
    fn zero_grad(&self) {
        for p in &self.params {
            p.zero_grad();
        }
    }
    fn lr(&self) -> f64 {
        self.lr.get()
    }
    fn set_lr(&mut self, lr: f64) {
        self.lr.set(lr)
    }
    fn lr_handle(&self) -> LrHandle {
        self.lr.clone()
    }
}
