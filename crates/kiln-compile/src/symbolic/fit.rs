//! Fitting a slot's value to an expression of the symbols, from traces at several sizes.
//!
//! The candidates are the forms sizes take in shape code, simplest first: a constant; an affine
//! form `c0 + Σ ci·si`; a product of symbols times a constant, plus a constant (flattening, random
//! offsets); `(si + k)//d` and `c·((si + k)//d)` (strided convolutions and pooling); `si % d`. A
//! candidate is accepted only if it reproduces every sample. A wrong fit that happens to match
//! every sample is not unsound: each later size is traced again and must match the expression
//! exactly (`SymGraph::instantiates`) before the compiled graph runs at it.

use super::expr::{Expr, SymId};

/// One trace: the symbols' values and the slot's value there.
pub type Sample<'a> = (&'a [i64], i64);

pub fn fit(samples: &[Sample], num_syms: usize) -> Option<Expr> {
    let (first, x0) = *samples.first()?;
    if samples.iter().all(|&(_, x)| x == x0) {
        return Some(Expr::int(x0));
    }
    let checks = |e: &Expr| samples.iter().all(|&(s, x)| e.eval(s) == Some(x));
    if let Some(e) = affine(samples, num_syms).filter(|e| checks(e)) {
        return Some(e);
    }
    // the symbols whose change moved the value: the only ones worth trying
    let moving: Vec<SymId> = (0..num_syms)
        .filter(|&k| samples.iter().any(|&(s, _)| s[k] != first[k]))
        .collect();
    for subset in subsets(&moving) {
        if subset.len() < 2 {
            continue;
        }
        let prod = |s: &[i64]| subset.iter().try_fold(1i64, |p, &k| p.checked_mul(s[k]));
        if let Some(e) = scaled_plus_const(samples, &prod, || product_expr(&subset)) {
            if checks(&e) {
                return Some(e);
            }
        }
    }
    for &k in &moving {
        for d in [2i64, 3, 4, 8, 16, 32, 64] {
            for shift in -(2 * d + 8)..=(2 * d + 8) {
                let q = |s: &[i64]| super::expr::floor_div(s[k].checked_add(shift)?, d);
                let base = || Expr::sym(k).plus(Expr::int(shift)).floor_div(Expr::int(d));
                if let Some(e) = scaled_plus_const(samples, &q, base) {
                    if checks(&e) {
                        return Some(e);
                    }
                }
            }
            let e = Expr::sym(k).modulo(Expr::int(d));
            if checks(&e) {
                return Some(e);
            }
        }
    }
    None
}

/// `c0 + Σ ci·si`, each ci read from two samples that differ in symbol i alone (the probes make
/// such pairs), or, with one symbol moving, from any two samples where it differs.
fn affine(samples: &[Sample], num_syms: usize) -> Option<Expr> {
    let (s0, x0) = samples[0];
    let mut coef = vec![0i64; num_syms];
    for (k, c) in coef.iter_mut().enumerate() {
        let moved = samples.iter().any(|&(s, _)| s[k] != s0[k]);
        if !moved {
            continue;
        }
        let pair = samples
            .iter()
            .find(|&&(s, _)| s[k] != s0[k] && (0..num_syms).all(|j| j == k || s[j] == s0[j]))?;
        let (dx, ds) = (pair.1 - x0, pair.0[k] - s0[k]);
        if dx % ds != 0 {
            return None;
        }
        *c = dx / ds;
    }
    let c0 = x0 - (0..num_syms).map(|k| coef[k] * s0[k]).sum::<i64>();
    let mut e = Expr::int(c0);
    for (k, &c) in coef.iter().enumerate().rev() {
        if c != 0 {
            e = Expr::sym(k).times(Expr::int(c)).plus(e);
        }
    }
    Some(e)
}

/// `c·f(s) + e` with c and e integers solved from two samples where f differs.
fn scaled_plus_const(
    samples: &[Sample],
    f: &dyn Fn(&[i64]) -> Option<i64>,
    base: impl Fn() -> Expr,
) -> Option<Expr> {
    let (s0, x0) = samples[0];
    let f0 = f(s0)?;
    let (s1, x1) = *samples.iter().find(|&&(s, _)| f(s) != Some(f0))?;
    let f1 = f(s1)?;
    let (dx, df) = (x1 - x0, f1 - f0);
    if dx % df != 0 || dx == 0 {
        return None;
    }
    let c = dx / df;
    let e = x0 - c * f0;
    Some(base().times(Expr::int(c)).plus(Expr::int(e)))
}

fn product_expr(syms: &[SymId]) -> Expr {
    let mut it = syms.iter();
    let first = it.next().map_or(Expr::int(1), |&k| Expr::sym(k));
    it.fold(first, |e, &k| e.times(Expr::sym(k)))
}

/// All subsets of `v` (at most 2^6: symbols beyond six are not combined into products).
fn subsets(v: &[SymId]) -> Vec<Vec<SymId>> {
    let v = &v[..v.len().min(6)];
    (1u32..(1 << v.len()))
        .map(|m| {
            (0..v.len())
                .filter(|i| m & (1 << i) != 0)
                .map(|i| v[i])
                .collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fit_fn(points: &[Vec<i64>], f: impl Fn(&[i64]) -> i64) -> Option<Expr> {
        let samples: Vec<Sample> = points.iter().map(|p| (p.as_slice(), f(p))).collect();
        fit(&samples, points[0].len())
    }

    /// A base point, one probe per symbol, and one with all symbols moved.
    fn probes(base: &[i64]) -> Vec<Vec<i64>> {
        let mut v = vec![base.to_vec()];
        for k in 0..base.len() {
            let mut p = base.to_vec();
            p[k] += 3 + 2 * k as i64;
            v.push(p);
        }
        v.push(
            base.iter()
                .enumerate()
                .map(|(k, x)| x + 5 + k as i64)
                .collect(),
        );
        v
    }

    #[test]
    fn fits_the_forms_shape_code_makes() {
        let pts = probes(&[8, 12]);
        type Case = (Box<dyn Fn(&[i64]) -> i64>, &'static str);
        let cases: Vec<Case> = vec![
            (Box::new(|s| s[0]), "s0"),
            (Box::new(|s| 3 * s[1] + 2), "s1*3 + 2"),
            (Box::new(|s| s[0] + s[1]), "s0 + s1"),
            (Box::new(|s| s[0] * s[1] * 12), "(s0*s1)*12"),
            (Box::new(|s| s[0] * s[1] * 4 + 7), "((s0*s1)*4) + 7"),
            (
                Box::new(|s| (s[1] - 1).div_euclid(2) + 1),
                "(s1 - 1)//2 + 1",
            ),
            (
                Box::new(|s| 64 * ((s[0] + 1).div_euclid(2))),
                "((s0 + 1)//2)*64",
            ),
            (Box::new(|_| 9), "9"),
        ];
        for (f, _) in &cases {
            let e = fit_fn(&pts, f).expect("a fit");
            // the fit must reproduce the function away from the samples too
            for a in 2..40 {
                for b in 2..40 {
                    assert_eq!(e.eval(&[a, b]), Some(f(&[a, b])), "{e} at ({a}, {b})");
                }
            }
        }
    }

    #[test]
    fn refuses_what_no_candidate_explains() {
        let pts = probes(&[8, 12]);
        assert_eq!(fit_fn(&pts, |s| s[0] * s[0] * s[0] + 1), None);
    }
}
