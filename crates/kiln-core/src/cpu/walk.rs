//! Elementwise operands read where they lie. A broadcast operand — a scalar, a bias or a
//! per-channel value `expand`ed to the output's shape (stride-0 dims) — or another strided view
//! was first copied to the output's size (`contig`) and then zipped: a ReLU's zero, or batch
//! norm's per-channel scale, cost a whole tensor written and read again. Here the operands are
//! walked together in rows: the longest run of trailing dims that every operand merges (each
//! steps through it by one fixed stride: 1, 0 or another), the remaining dims giving each row's
//! start. A piece of a row is handed to the kernel as a slice: the operand's own elements where
//! they are contiguous, else a small per-thread buffer filled with the repeated value or
//! gathered, in cache. Same elements, same operation per element: the results are the copied
//! operands' bit for bit.

use std::mem::MaybeUninit;

use super::alloc;
use crate::shape::Layout;
use crate::storage::StorageElement;

/// Fewest elements in a row for reading in place to pay; shorter rows are copied (`contig`).
const MIN_ROW: usize = 16;

/// Output elements per task.
const CHUNK: usize = 4096;

/// How operands of one shape are walked together: rows of `row` elements (the merged trailing
/// dims, stepped by each operand's stride of `row_dim`), started by the `outer` dims.
pub(super) struct Walk {
    row: usize,
    row_dim: usize,
    /// The remaining dims (not of size 1), outermost first.
    outer: Vec<usize>,
    shape: Vec<usize>,
}

/// One operand on a walk.
pub(super) struct Src<'a, T> {
    data: &'a [T],
    offset: usize,
    /// The operand's strides of the walk's outer dims.
    outer_strides: Vec<usize>,
    /// Its stride within a row: 1 (contiguous), 0 (one repeated value) or another.
    step: usize,
}

/// An elementwise kernel's operand: contiguous elements, or read in place on a walk.
pub(super) enum In<'a, T> {
    Flat(&'a [T]),
    Walked(Src<'a, T>),
}

impl Walk {
    /// A walk over `layouts` (all of one shape), when one of them is not contiguous and the
    /// rows they share are long enough; `None` means: copy the strided ones (`contig`).
    pub(super) fn new(layouts: &[&Layout]) -> Option<Walk> {
        let shape = &layouts.first()?.shape;
        let numel: usize = shape.iter().product();
        if numel == 0
            || layouts.iter().all(|l| l.is_contiguous())
            || layouts.iter().any(|l| l.shape != *shape)
        {
            return None;
        }
        // size-1 dims take no part; merge the rest from the innermost while every operand
        // steps through the merged run by one stride
        let dims: Vec<usize> = (0..shape.len()).filter(|&d| shape[d] != 1).collect();
        let (&row_dim, rest) = dims.split_last()?;
        let mut row = shape[row_dim];
        let mut split = rest.len();
        while split > 0 {
            let d = rest[split - 1];
            if !layouts
                .iter()
                .all(|l| l.strides[d] == l.strides[row_dim] * row)
            {
                break;
            }
            row *= shape[d];
            split -= 1;
        }
        (row >= MIN_ROW).then(|| Walk {
            row,
            row_dim,
            outer: rest[..split].to_vec(),
            shape: shape.to_vec(),
        })
    }

    /// `data` (laid out by `l`, of the walk's shape) as an operand: read in place, or, when it
    /// is contiguous, as its slice.
    pub(super) fn operand<'a, T: StorageElement>(&self, data: &'a [T], l: &Layout) -> In<'a, T> {
        if l.is_contiguous() {
            return In::Flat(&data[l.offset..][..self.numel()]);
        }
        In::Walked(Src {
            data,
            offset: l.offset,
            outer_strides: self.outer.iter().map(|&d| l.strides[d]).collect(),
            step: l.strides[self.row_dim],
        })
    }

    fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Where row `r` of operand `s` starts.
    fn row_start<T>(&self, s: &Src<'_, T>, mut r: usize) -> usize {
        let mut at = s.offset;
        for (&d, &stride) in self.outer.iter().zip(&s.outer_strides).rev() {
            let n = self.shape[d];
            at += (r % n) * stride;
            r /= n;
        }
        at
    }

    /// A new output of the walk's size, written piece by piece: `write(scratch, at, out)` for
    /// each piece of a row (`at`: the flat index of its first element), pieces of about `CHUNK`
    /// elements in parallel, each task with one `scratch` (the buffers `In::piece` fills).
    pub(super) fn fill<O: StorageElement + Send + Sync, S>(
        &self,
        scratch: impl Fn() -> S + Sync,
        write: impl Fn(&mut S, usize, &mut [MaybeUninit<O>]) + Sync,
    ) -> Vec<O> {
        let row = self.row;
        alloc::filled(self.numel(), CHUNK, |c, mut out| {
            let mut s = scratch();
            let mut at = c * CHUNK;
            while !out.is_empty() {
                let len = (row - at % row).min(out.len());
                let (piece, rest) = out.split_at_mut(len);
                write(&mut s, at, piece);
                at += len;
                out = rest;
            }
        })
    }
}

impl<T: StorageElement> In<'_, T> {
    /// The `len` elements at flat index `at` (within one row of `walk`), through `buf` when they
    /// are not contiguous in the operand.
    pub(super) fn piece<'s>(
        &'s self,
        walk: &Walk,
        at: usize,
        len: usize,
        buf: &'s mut Vec<T>,
    ) -> &'s [T] {
        match self {
            In::Flat(v) => &v[at..at + len],
            In::Walked(s) => {
                let start = walk.row_start(s, at / walk.row) + (at % walk.row) * s.step;
                match s.step {
                    1 => &s.data[start..start + len],
                    0 => {
                        buf.clear();
                        buf.resize(len, s.data[start]);
                        buf
                    }
                    step => {
                        buf.clear();
                        buf.extend(s.data[start..].iter().step_by(step).take(len));
                        buf
                    }
                }
            }
        }
    }
}
