//! `Display` that prints like PyTorch: `tensor([[1.0000, 2.0000], ...])`, summarized past 1000 elements.

use crate::{DType, Tensor};

const EDGE: usize = 3;
const SUMMARIZE_ABOVE: usize = 1000;

fn fmt_values(vals: &[f64], dtype: DType) -> Vec<String> {
    if dtype == DType::Bool {
        return vals
            .iter()
            .map(|&v| {
                if v != 0.0 {
                    "True".into()
                } else {
                    "False".into()
                }
            })
            .collect();
    }
    if !dtype.is_float() {
        return vals.iter().map(|&v| format!("{}", v as i64)).collect();
    }
    let finite: Vec<f64> = vals.iter().copied().filter(|v| v.is_finite()).collect();
    let max = finite.iter().fold(0f64, |a, v| a.max(v.abs()));
    let min_nz = finite
        .iter()
        .filter(|v| **v != 0.0)
        .fold(f64::INFINITY, |a, v| a.min(v.abs()));
    let integral = finite.iter().all(|v| v.fract() == 0.0);
    // torch/_tensor_str.py: sci mode when max/min > 1000 or max > 1e8 (integral values included),
    // or, for non-integral values, min < 1e-4
    let sci = max > 1e8
        || (min_nz < 1e-4 && min_nz.is_finite() && !integral)
        || (min_nz.is_finite() && max / min_nz > 1000.0);
    vals.iter()
        .map(|&v| {
            if v.is_nan() {
                "nan".into()
            } else if v.is_infinite() {
                if v > 0.0 {
                    "inf".into()
                } else {
                    "-inf".into()
                }
            } else if integral && !sci {
                format!("{v:.0}.")
            } else if sci {
                let s = format!("{v:.4e}");
                // Rust prints 1.0000e-5; PyTorch prints 1.0000e-05
                match s.split_once('e') {
                    Some((m, e)) => {
                        let (sign, digits) = if let Some(d) = e.strip_prefix('-') {
                            ('-', d)
                        } else {
                            ('+', e)
                        };
                        format!("{m}e{sign}{digits:0>2}")
                    }
                    None => s,
                }
            } else {
                format!("{v:.4}")
            }
        })
        .collect()
}

/// Indices shown along a dim of size n: all, or the first and last EDGE with a gap marker (None).
fn shown(n: usize, summarize: bool) -> Vec<Option<usize>> {
    if summarize && n > 2 * EDGE {
        (0..EDGE)
            .map(Some)
            .chain([None])
            .chain((n - EDGE..n).map(Some))
            .collect()
    } else {
        (0..n).map(Some).collect()
    }
}

#[allow(clippy::too_many_arguments)] // a recursive printer threads its context through
fn render(
    out: &mut String,
    shape: &[usize],
    strides: &[usize],
    base: usize,
    cells: &[String],
    width: usize,
    summarize: bool,
    indent: usize,
) {
    if shape.is_empty() {
        out.push_str(&format!("{:>width$}", cells[base]));
        return;
    }
    out.push('[');
    let idx = shown(shape[0], summarize);
    for (k, i) in idx.iter().enumerate() {
        if k > 0 {
            out.push(',');
            if shape.len() == 1 {
                out.push(' ');
            } else {
                out.push_str(&"\n".repeat(shape.len() - 1));
                out.push_str(&" ".repeat(indent + 1));
            }
        }
        match i {
            Some(i) => render(
                out,
                &shape[1..],
                &strides[1..],
                base + i * strides[0],
                cells,
                width,
                summarize,
                indent + 1,
            ),
            None => out.push_str("..."),
        }
    }
    out.push(']');
}

impl std::fmt::Display for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // printing a traced tensor needs its values: a graph break, as print() is in torch.compile
        let vals = self.to_vec_f64().map_err(|_| std::fmt::Error)?;
        let cells = fmt_values(&vals, self.dtype());
        // PyTorch sizes the columns by the finite values only; nan/inf are never padded
        let width = cells
            .iter()
            .zip(&vals)
            .filter(|(_, v)| v.is_finite())
            .map(|(c, _)| c.len())
            .max()
            .unwrap_or(0);
        let summarize = self.numel() > SUMMARIZE_ABOVE;
        let strides = crate::shape::contiguous_strides(self.shape());
        let mut body = String::new();
        if self.numel() == 0 && self.rank() > 0 {
            body.push_str("[]");
        } else {
            render(
                &mut body,
                self.shape(),
                &strides,
                0,
                &cells,
                width,
                summarize,
                "tensor(".len(),
            );
        }
        write!(f, "tensor({body}")?;
        if self.numel() == 0 && self.rank() > 1 {
            let dims: Vec<String> = self.shape().iter().map(|d| d.to_string()).collect();
            write!(f, ", size=({})", dims.join(", "))?;
        }
        if !matches!(self.dtype(), DType::F32 | DType::I64 | DType::Bool) {
            write!(f, ", dtype=torch.{}", self.dtype().torch_name())?;
        }
        if self.requires_grad() {
            write!(f, ", requires_grad=True")?;
        }
        write!(f, ")")
    }
}
