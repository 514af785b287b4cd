//! Shapes, strides and the layout of a tensor over its storage.

use smallvec::SmallVec;

use crate::{Error, Result};

/// A layout's sizes or strides: inline up to rank 4 (an NCHW activation), so the layouts a
/// trace makes for every value it records (`Tensor::deferred`) and every view cost no heap
/// allocation; it derefs to `[usize]` like the `Vec` it replaces.
pub type Dims = SmallVec<[usize; 4]>;

/// Row-major strides of a contiguous tensor of this shape.
pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    contiguous_dims(shape).into_vec()
}

/// `contiguous_strides`, inline.
fn contiguous_dims(shape: &[usize]) -> Dims {
    let mut strides: Dims = smallvec::smallvec![0; shape.len()];
    let mut acc = 1;
    for i in (0..shape.len()).rev() {
        strides[i] = acc;
        acc *= shape[i].max(1);
    }
    strides
}

pub fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

/// Normalizes a possibly negative dim index against a rank, as PyTorch does.
pub fn norm_dim(op: &'static str, dim: isize, rank: usize) -> Result<usize> {
    let r = rank.max(1) as isize;
    let d = if dim < 0 { dim + r } else { dim };
    if d < 0 || d >= r {
        return Err(Error::index(
            op,
            format!("dim {dim} out of range for a tensor of rank {rank}"),
        ));
    }
    Ok(d as usize)
}

/// The broadcast shape of two shapes, by PyTorch's rules (align right; 1 stretches).
pub fn broadcast_shapes(op: &'static str, a: &[usize], b: &[usize]) -> Result<Vec<usize>> {
    let n = a.len().max(b.len());
    let mut out = vec![0; n];
    for i in 0..n {
        let da = if i + a.len() >= n {
            a[i + a.len() - n]
        } else {
            1
        };
        let db = if i + b.len() >= n {
            b[i + b.len() - n]
        } else {
            1
        };
        out[i] = if da == db || db == 1 {
            da
        } else if da == 1 {
            db
        } else {
            return Err(Error::shape(
                op,
                format!(
                    "shapes {a:?} and {b:?} cannot be broadcast together (dim {i}: {da} vs {db})"
                ),
            ));
        };
    }
    Ok(out)
}

/// Shape, strides (in elements) and offset of a tensor into its storage.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Layout {
    pub shape: Dims,
    pub strides: Dims,
    pub offset: usize,
}

impl Layout {
    pub fn contiguous(shape: &[usize]) -> Self {
        Layout {
            shape: Dims::from_slice(shape),
            strides: contiguous_dims(shape),
            offset: 0,
        }
    }
    pub fn numel(&self) -> usize {
        numel(&self.shape)
    }
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    /// True when the elements are laid out row-major with no gaps (size-1 dims may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut acc = 1;
        for i in (0..self.shape.len()).rev() {
            if self.shape[i] != 1 && self.strides[i] != acc {
                return false;
            }
            acc *= self.shape[i];
        }
        true
    }
    pub fn permute(&self, perm: &[usize]) -> Layout {
        Layout {
            shape: perm.iter().map(|&p| self.shape[p]).collect(),
            strides: perm.iter().map(|&p| self.strides[p]).collect(),
            offset: self.offset,
        }
    }
    /// Same-rank broadcast: size-1 dims stretch with stride 0.
    pub fn expand(&self, shape: &[usize]) -> Layout {
        let strides = self
            .shape
            .iter()
            .zip(shape)
            .zip(&self.strides)
            .map(|((&from, &to), &s)| if from == to { s } else { 0 })
            .collect();
        Layout {
            shape: Dims::from_slice(shape),
            strides,
            offset: self.offset,
        }
    }
    pub fn slice(&self, dim: usize, start: usize, end: usize, step: usize) -> Layout {
        let mut l = self.clone();
        let len = if end > start {
            (end - start).div_ceil(step)
        } else {
            0
        };
        l.shape[dim] = len;
        if len > 0 {
            l.offset += start * self.strides[dim];
        }
        l.strides[dim] *= step;
        l
    }
    /// A view with a new shape over the same elements, when the strides allow it without a copy.
    pub fn reshape_view(&self, shape: &[usize]) -> Option<Layout> {
        if self.is_contiguous() || self.numel() == 0 {
            return Some(Layout {
                shape: Dims::from_slice(shape),
                strides: contiguous_dims(shape),
                offset: self.offset,
            });
        }
        // ATen's computeStride: split or merge only dims that are contiguous with each other, so
        // e.g. squeezing a column of a matrix (`select`) stays a view.
        let (old, old_strides) = (&self.shape, &self.strides);
        let mut strides: Dims = smallvec::smallvec![0; shape.len()];
        let mut view_d = shape.len() as isize - 1;
        let mut chunk_base = *old_strides.last()?;
        let (mut tensor_numel, mut view_numel) = (1, 1);
        for d in (0..old.len()).rev() {
            tensor_numel *= old[d];
            if d == 0 || (old[d - 1] != 1 && old_strides[d - 1] != tensor_numel * chunk_base) {
                while view_d >= 0 && (view_numel < tensor_numel || shape[view_d as usize] == 1) {
                    strides[view_d as usize] = view_numel * chunk_base;
                    view_numel *= shape[view_d as usize];
                    view_d -= 1;
                }
                if view_numel != tensor_numel {
                    return None;
                }
                if d > 0 {
                    chunk_base = old_strides[d - 1];
                    tensor_numel = 1;
                    view_numel = 1;
                }
            }
        }
        (view_d == -1).then(|| Layout {
            shape: Dims::from_slice(shape),
            strides,
            offset: self.offset,
        })
    }
    /// Storage offsets of every element, row-major. Used by the strided copy kernel.
    pub fn for_each_offset(&self, mut f: impl FnMut(usize)) {
        let n = self.numel();
        if n == 0 {
            return;
        }
        let rank = self.rank();
        if rank == 0 {
            f(self.offset);
            return;
        }
        let mut idx = vec![0usize; rank];
        let mut off = self.offset;
        let inner = rank - 1;
        let (isize_, istride) = (self.shape[inner], self.strides[inner]);
        loop {
            let mut o = off;
            for _ in 0..isize_ {
                f(o);
                o += istride;
            }
            // carry into the outer dims
            let mut d = inner;
            loop {
                if d == 0 {
                    return;
                }
                d -= 1;
                idx[d] += 1;
                off += self.strides[d];
                if idx[d] < self.shape[d] {
                    break;
                }
                off -= self.strides[d] * self.shape[d];
                idx[d] = 0;
            }
        }
    }
}
