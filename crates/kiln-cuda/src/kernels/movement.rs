//! Pad and cat, as writes into views of the output: no kernel of their own, the elementwise
//! copy writes each source into the strided window of the output where it belongs.

use std::sync::Arc;

use kiln_core::shape::Layout;
use kiln_core::Result;

use super::elementwise::{self as ew, Scalars};
use crate::buffer::CudaBuffer;
use crate::device::CudaDevice;

/// Constant padding: fill with `value`, then copy the input into the interior window.
pub(crate) fn pad(
    dev: &Arc<CudaDevice>,
    (x, lx): (&CudaBuffer, &Layout),
    pads: &[(usize, usize)],
    value: f64,
    out: &CudaBuffer,
    out_shape: &[usize],
) -> Result<()> {
    let full = Layout::contiguous(out_shape);
    let scalars = Scalars {
        value,
        ..Scalars::default()
    };
    ew::launch(dev, &ew::full(), &[], out, &full, scalars)?;
    let mut window = full;
    for (d, &(before, _)) in pads.iter().enumerate() {
        window = window.slice(d, before, before + lx.shape[d], 1);
    }
    ew::launch(
        dev,
        &ew::identity(),
        &[(x, lx)],
        out,
        &window,
        Scalars::default(),
    )
}

/// Concatenation along `dim`: each input copied into its slice of the output.
pub(crate) fn cat(
    dev: &Arc<CudaDevice>,
    inputs: &[(&CudaBuffer, &Layout)],
    dim: usize,
    out: &CudaBuffer,
    out_shape: &[usize],
) -> Result<()> {
    let full = Layout::contiguous(out_shape);
    let mut at = 0;
    for &(b, l) in inputs {
        let len = l.shape[dim];
        let window = full.slice(dim, at, at + len, 1);
        ew::launch(
            dev,
            &ew::identity(),
            &[(b, l)],
            out,
            &window,
            Scalars::default(),
        )?;
        at += len;
    }
    Ok(())
}
