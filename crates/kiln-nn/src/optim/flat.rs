//! The bookkeeping of the multi-tensor ("foreach") optimizers: parameters of one dtype laid end to end,
//! so their gradients and optimizer states live in single flat tensors.

use kiln_core::{DType, Device, Result, Tensor};

pub(crate) struct FlatGroup {
    /// Indices into the optimizer's parameter list.
    pub members: Vec<usize>,
    /// Start of each member in the flat layout.
    pub offsets: Vec<usize>,
    pub numels: Vec<usize>,
    pub total: usize,
    pub dtype: DType,
    /// Where the members live: a flat state sits beside them.
    pub device: Device,
}

/// One group per dtype (concatenation needs one dtype), in first-appearance order.
pub(crate) fn group_by_dtype(params: &[Tensor]) -> Vec<FlatGroup> {
    let mut groups: Vec<FlatGroup> = Vec::new();
    for (i, p) in params.iter().enumerate() {
        let g = match groups
            .iter_mut()
            .position(|g| g.dtype == p.dtype() && g.device == p.device())
        {
            Some(k) => &mut groups[k],
            None => {
                groups.push(FlatGroup {
                    members: Vec::new(),
                    offsets: Vec::new(),
                    numels: Vec::new(),
                    total: 0,
                    dtype: p.dtype(),
                    device: p.device(),
                });
                let k = groups.len() - 1;
                &mut groups[k]
            }
        };
        g.members.push(i);
        g.offsets.push(g.total);
        g.numels.push(p.numel());
        g.total += p.numel();
    }
    groups
}

/// Flattens and concatenates tensors into one 1-D tensor.
pub(crate) fn cat_flat(ts: &[Tensor]) -> Result<Tensor> {
    let flat = ts
        .iter()
        .map(|t| t.reshape([t.numel()]))
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&flat.iter().collect::<Vec<_>>(), 0)
}

impl FlatGroup {
    /// A zero-filled flat state tensor for this group.
    pub fn zeros(&self) -> Result<Tensor> {
        Tensor::zeros_on(&[self.total], self.dtype, self.device)
    }

    fn is_whole(&self, sel: &[usize]) -> bool {
        sel.len() == self.members.len()
    }

    /// Member `k`'s part of a flat state, shaped like its parameter (a view: writes reach the
    /// state).
    pub fn member(&self, state: &Tensor, k: usize, shape: &[usize]) -> Result<Tensor> {
        state
            .narrow(0, self.offsets[k], self.numels[k])?
            .reshape(shape)
    }

    /// The part of a flat state that belongs to the selected members (positions within the group),
    /// as one flat tensor. The whole group is the state itself, no copy.
    pub fn gather(&self, state: &Tensor, sel: &[usize]) -> Result<Tensor> {
        if self.is_whole(sel) {
            return Ok(state.clone());
        }
        let parts = sel
            .iter()
            .map(|&k| state.narrow(0, self.offsets[k], self.numels[k]))
            .collect::<Result<Vec<_>>>()?;
        Tensor::cat(&parts.iter().collect::<Vec<_>>(), 0)
    }

    /// Stores the new values of the selected members' state. The whole group replaces the handle;
    /// a subset is written in place into its slices.
    pub fn scatter(&self, state: &mut Tensor, sel: &[usize], new: Tensor) -> Result<()> {
        if self.is_whole(sel) {
            *state = new;
            return Ok(());
        }
        let mut at = 0;
        let mut pairs = Vec::with_capacity(sel.len());
        for &k in sel {
            let n = self.numels[k];
            pairs.push((state.narrow(0, self.offsets[k], n)?, new.narrow(0, at, n)?));
            at += n;
        }
        assign_pairs(&pairs)
    }

    /// `scatter` that keeps the state's identity for the whole group too (a compiled step's graph
    /// reads and writes the live tensor).
    pub fn scatter_in_place(&self, state: &Tensor, sel: &[usize], new: Tensor) -> Result<()> {
        if self.is_whole(sel) {
            return state.assign(&new);
        }
        // a subset is written in place into its slices: the handle is never replaced
        self.scatter(&mut state.clone(), sel, new)
    }

    /// Writes the selected members' new values (one flat tensor) back into the parameters in place.
    pub fn write_params(&self, params: &[Tensor], sel: &[usize], new: &Tensor) -> Result<()> {
        let mut at = 0;
        let mut pairs = Vec::with_capacity(sel.len());
        for &k in sel {
            let p = &params[self.members[k]];
            let n = self.numels[k];
            pairs.push((p.clone(), new.narrow(0, at, n)?.reshape(p.shape())?));
            at += n;
        }
        assign_pairs(&pairs)
    }
}

/// `dst.assign(src)` for each pair, as one multi-tensor copy on a device (a launch or two where
/// one per parameter was ~2.5 µs of host time each).
pub(crate) fn assign_pairs(pairs: &[(Tensor, Tensor)]) -> Result<()> {
    let refs: Vec<(&Tensor, &Tensor)> = pairs.iter().map(|(d, s)| (d, s)).collect();
    Tensor::assign_many(&refs)
}
