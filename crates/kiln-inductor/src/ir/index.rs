//! Index expressions over loop variables, kept in a canonical form — a constant plus a sum of
//! `coefficient × atom`, where an atom is a loop variable, a floor division or a modulo — and
//! simplified with the variables' ranges, so that views compose into plain strided addresses:
//! reshaping a contiguous buffer and reading it back yields `i`, not `(i / n) * n + i % n`.
//! All indices are non-negative, so C's `/` and `%` are floor division and modulo.

use std::fmt::Write;

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Atom {
    Var(usize),
    Div(Box<Ix>, i64),
    Mod(Box<Ix>, i64),
    /// The index held into `lo..=hi`: where a pad reads its operand (the positions outside are
    /// replaced by the fill value, but the operand's expression is still evaluated there, and
    /// must read inside its buffers). A side the index cannot cross is `i64::MIN` / `i64::MAX`.
    Clamp(Box<Ix>, i64, i64),
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ix {
    pub constant: i64,
    /// (coefficient, atom), sorted by atom, no zero coefficients, no repeated atom.
    pub terms: Vec<(i64, Atom)>,
}

/// Loop variable extents: variable `v` ranges over `0..extents[v]`.
pub type Extents = [i64];

impl Ix {
    pub fn constant(c: i64) -> Ix {
        Ix {
            constant: c,
            terms: Vec::new(),
        }
    }

    pub fn var(v: usize) -> Ix {
        Ix::atom(Atom::Var(v))
    }

    fn atom(a: Atom) -> Ix {
        Ix {
            constant: 0,
            terms: vec![(1, a)],
        }
    }

    pub fn as_constant(&self) -> Option<i64> {
        self.terms.is_empty().then_some(self.constant)
    }

    pub fn add(&self, o: &Ix) -> Ix {
        let mut terms = self.terms.clone();
        terms.extend(o.terms.iter().cloned());
        normalize(self.constant + o.constant, terms)
    }

    pub fn add_const(&self, c: i64) -> Ix {
        self.add(&Ix::constant(c))
    }

    pub fn mul(&self, c: i64) -> Ix {
        if c == 0 {
            return Ix::constant(0);
        }
        Ix {
            constant: self.constant * c,
            terms: self.terms.iter().map(|(k, a)| (k * c, a.clone())).collect(),
        }
    }

    /// Whether loop variable `v` occurs anywhere in the expression.
    pub fn mentions(&self, v: usize) -> bool {
        self.terms.iter().any(|(_, a)| a.mentions(v))
    }

    /// `self - v` when `self` moves one by one with loop variable `v` and four consecutive values
    /// of `v` starting at a multiple of four give four consecutive values starting at a multiple
    /// of four: `v` occurs once, with coefficient 1, outside any division, modulo or clamp, and
    /// the constant and every other coefficient are multiples of four. A read at `self` by four
    /// lanes whose `v` are `4m..4m+4` is then one aligned four-element vector at `rest + 4m`.
    pub fn quad_in(&self, v: usize) -> Option<Ix> {
        let var = Atom::Var(v);
        let unit = self.terms.iter().any(|(k, a)| *k == 1 && *a == var);
        let rest_ok = self
            .terms
            .iter()
            .filter(|(_, a)| *a != var)
            .all(|(k, a)| k % 4 == 0 && !a.mentions(v));
        if !unit || !rest_ok || self.constant % 4 != 0 {
            return None;
        }
        let terms = self
            .terms
            .iter()
            .filter(|(_, a)| *a != var)
            .cloned()
            .collect();
        Some(Ix {
            constant: self.constant,
            terms,
        })
    }

    /// Smallest and largest value over the loop ranges.
    pub fn bounds(&self, ext: &Extents) -> (i64, i64) {
        let (mut lo, mut hi) = (self.constant, self.constant);
        for (k, a) in &self.terms {
            let (alo, ahi) = a.bounds(ext);
            if *k >= 0 {
                lo += k * alo;
                hi += k * ahi;
            } else {
                lo += k * ahi;
                hi += k * alo;
            }
        }
        (lo, hi)
    }

    /// Splits into (the part whose coefficients and constant `n` divides, the rest).
    fn split_multiple(&self, n: i64) -> (Ix, Ix) {
        let mut whole = Ix::constant(self.constant - self.constant.rem_euclid(n));
        let mut rest = Ix::constant(self.constant.rem_euclid(n));
        for (k, a) in &self.terms {
            if k % n == 0 {
                whole.terms.push((*k, a.clone()));
            } else {
                rest.terms.push((*k, a.clone()));
            }
        }
        (whole, rest)
    }

    /// Floor division by a positive constant.
    pub fn div(&self, n: i64, ext: &Extents) -> Ix {
        if n <= 1 {
            return self.clone();
        }
        let (whole, rest) = self.split_multiple(n);
        let (lo, hi) = rest.bounds(ext);
        let q = whole.exact_div(n);
        if lo >= 0 && hi < n {
            return q;
        }
        if let Some((a, y, _)) = self.factor(n, ext) {
            return y.div(n / a, ext);
        }
        if lo >= 0 {
            return q.add(&Ix::atom(Atom::Div(Box::new(rest), n)));
        }
        Ix::atom(Atom::Div(Box::new(self.clone()), n))
    }

    /// `self` as `a·y + r` for the largest proper divisor `a` of `n` (above 1) with `0 <= r < a`
    /// over the loop ranges and `y >= 0`: then `self / n == y / (n / a)` and `self % n ==
    /// a·(y % (n / a)) + r`. A strided slice of a padded row reads `(114·h + w + 1) / 228`
    /// with `w + 1 < 114`, which is `h / 2`. `None` when no divisor splits it so.
    fn factor(&self, n: i64, ext: &Extents) -> Option<(i64, Ix, Ix)> {
        let mut divisors: Vec<i64> = (2..)
            .take_while(|d| d * d <= n)
            .filter(|d| n % d == 0)
            .flat_map(|d| [d, n / d])
            .filter(|&d| d < n)
            .collect();
        divisors.sort_unstable_by(|a, b| b.cmp(a));
        divisors.into_iter().find_map(|a| {
            let (whole, rest) = self.split_multiple(a);
            let (lo, hi) = rest.bounds(ext);
            let y = whole.exact_div(a);
            (!whole.terms.is_empty() && lo >= 0 && hi < a && y.bounds(ext).0 >= 0)
                .then_some((a, y, rest))
        })
    }

    /// Modulo by a positive constant.
    pub fn rem(&self, n: i64, ext: &Extents) -> Ix {
        if n <= 1 {
            return Ix::constant(0);
        }
        let (_, rest) = self.split_multiple(n);
        let (lo, hi) = rest.bounds(ext);
        if lo >= 0 && hi < n {
            return rest;
        }
        if let Some((a, y, r)) = self.factor(n, ext) {
            return y.rem(n / a, ext).mul(a).add(&r);
        }
        if lo >= 0 {
            return Ix::atom(Atom::Mod(Box::new(rest), n));
        }
        Ix::atom(Atom::Mod(Box::new(self.clone()), n))
    }

    /// The index held into `lo..=hi` (`lo <= hi`); itself where its range already lies inside.
    pub fn held_in(&self, lo: i64, hi: i64, ext: &Extents) -> Ix {
        let (xlo, xhi) = self.bounds(ext);
        if xlo >= lo && xhi <= hi {
            return self.clone();
        }
        if xhi <= lo {
            return Ix::constant(lo);
        }
        if xlo >= hi {
            return Ix::constant(hi);
        }
        // only the side it can cross: a pad's tap `i + 1` over `0..n` is held below `n`, and its
        // generated index then compares once, not twice, per read
        let lo = if xlo >= lo { i64::MIN } else { lo };
        let hi = if xhi <= hi { i64::MAX } else { hi };
        Ix::atom(Atom::Clamp(Box::new(self.clone()), lo, hi))
    }

    /// The index with every clamp removed (`held_in`'s value before it was held), simplified
    /// again. Where a clamp changes an index, the pad or cat that held it replaces the value read
    /// there with its fill or another piece, so a *condition* inside that value may be decided
    /// at the unheld index: it only matters where the two agree. (A load keeps the held index:
    /// it must stay inside its buffer at every element.) Unheld, a stride-2 window tap's parity
    /// `(i + 1) % 2` is an affine residue that a split by parity makes constant
    /// (`codegen/cuda_residues.rs`).
    pub fn unclamped(&self, ext: &Extents) -> Ix {
        let mut out = Ix::constant(self.constant);
        for (k, a) in &self.terms {
            let free = match a {
                Atom::Var(_) => Ix::atom(a.clone()),
                Atom::Div(x, n) => x.unclamped(ext).div(*n, ext),
                Atom::Mod(x, n) => x.unclamped(ext).rem(*n, ext),
                Atom::Clamp(x, _, _) => x.unclamped(ext),
            };
            out = out.add(&free.mul(*k));
        }
        out
    }

    /// Each (loop variable, divisor) of a division or modulo in the expression whose operand
    /// moves with that variable by a step the divisor does not divide: the variables whose
    /// residues the expression depends on.
    pub fn residue_vars(&self, out: &mut Vec<(usize, i64)>) {
        for (_, a) in &self.terms {
            match a {
                Atom::Var(_) => {}
                Atom::Div(x, n) | Atom::Mod(x, n) => {
                    for (k, v) in x.unclamped_var_steps(1) {
                        if k % n != 0 && !out.contains(&(v, *n)) {
                            out.push((v, *n));
                        }
                    }
                    x.residue_vars(out);
                }
                Atom::Clamp(x, _, _) => x.residue_vars(out),
            }
        }
    }

    /// (step, variable) of each loop variable the expression adds, looking through clamps,
    /// each step times `scale`.
    fn unclamped_var_steps(&self, scale: i64) -> Vec<(i64, usize)> {
        let mut steps = Vec::new();
        for (k, a) in &self.terms {
            match a {
                Atom::Var(v) => steps.push((k * scale, *v)),
                Atom::Clamp(x, _, _) => steps.extend(x.unclamped_var_steps(k * scale)),
                Atom::Div(..) | Atom::Mod(..) => {}
            }
        }
        steps
    }

    /// The value at the loop variables `vars` (tests check simplified forms against it).
    #[cfg(test)]
    pub fn eval(&self, vars: &[i64]) -> i64 {
        self.constant
            + self
                .terms
                .iter()
                .map(|(k, a)| {
                    k * match a {
                        Atom::Var(v) => vars[*v],
                        Atom::Div(x, n) => x.eval(vars).div_euclid(*n),
                        Atom::Mod(x, n) => x.eval(vars).rem_euclid(*n),
                        Atom::Clamp(x, lo, hi) => x.eval(vars).clamp(*lo, *hi),
                    }
                })
                .sum::<i64>()
    }

    fn exact_div(&self, n: i64) -> Ix {
        Ix {
            constant: self.constant / n,
            terms: self.terms.iter().map(|(k, a)| (k / n, a.clone())).collect(),
        }
    }

    /// C source text, loop variable `v` written as `{prefix}{v}`.
    pub fn to_c(&self, prefix: &str) -> String {
        let mut s = String::new();
        for (k, a) in &self.terms {
            if !s.is_empty() {
                s.push_str(" + ");
            }
            let a = a.to_c(prefix);
            match k {
                1 => s.push_str(&a),
                _ => {
                    let _ = write!(s, "{k}*{a}");
                }
            }
        }
        if self.constant != 0 || s.is_empty() {
            if !s.is_empty() {
                s.push_str(" + ");
            }
            let _ = write!(s, "{}", self.constant);
        }
        s
    }
}

impl Atom {
    fn mentions(&self, v: usize) -> bool {
        match self {
            Atom::Var(w) => *w == v,
            Atom::Div(x, _) | Atom::Mod(x, _) | Atom::Clamp(x, _, _) => x.mentions(v),
        }
    }

    fn bounds(&self, ext: &Extents) -> (i64, i64) {
        match self {
            Atom::Var(v) => (0, ext[*v] - 1),
            Atom::Div(x, n) => {
                let (lo, hi) = x.bounds(ext);
                (lo.div_euclid(*n), hi.div_euclid(*n))
            }
            Atom::Mod(x, n) => {
                let (lo, hi) = x.bounds(ext);
                if lo >= 0 && hi < *n {
                    (lo, hi)
                } else {
                    (0, n - 1)
                }
            }
            Atom::Clamp(x, lo, hi) => {
                let (xlo, xhi) = x.bounds(ext);
                (xlo.clamp(*lo, *hi), xhi.clamp(*lo, *hi))
            }
        }
    }

    fn to_c(&self, prefix: &str) -> String {
        match self {
            Atom::Var(v) => format!("{prefix}{v}"),
            Atom::Div(x, n) => format!("(({}) / {n})", x.to_c(prefix)),
            Atom::Mod(x, n) => format!("(({}) % {n})", x.to_c(prefix)),
            // a side at i64::MIN / i64::MAX is one the value cannot cross (`Ix::held_in`)
            Atom::Clamp(x, lo, hi) => {
                let x = x.to_c(prefix);
                match (*lo == i64::MIN, *hi == i64::MAX) {
                    (true, _) => format!("(({x}) > {hi} ? {hi} : ({x}))"),
                    (_, true) => format!("(({x}) < {lo} ? {lo} : ({x}))"),
                    _ => format!("(({x}) < {lo} ? {lo} : (({x}) > {hi} ? {hi} : ({x})))"),
                }
            }
        }
    }
}

/// Merges repeated atoms, drops zero terms, and folds `c·n·(x / n) + c·(x % n)` into `c·x`.
fn normalize(constant: i64, mut terms: Vec<(i64, Atom)>) -> Ix {
    terms.sort_by(|a, b| a.1.cmp(&b.1));
    let mut merged: Vec<(i64, Atom)> = Vec::with_capacity(terms.len());
    for (k, a) in terms {
        match merged.last_mut() {
            Some((k0, a0)) if *a0 == a => *k0 += k,
            _ => merged.push((k, a)),
        }
    }
    merged.retain(|(k, _)| *k != 0);
    let mut out = Ix {
        constant,
        terms: merged,
    };
    loop {
        let mut folded = None;
        'search: for (i, (kd, ad)) in out.terms.iter().enumerate() {
            let Atom::Div(x, n) = ad else { continue };
            for (j, (km, am)) in out.terms.iter().enumerate() {
                if let Atom::Mod(y, m) = am {
                    if m == n && x == y && *kd == km * n {
                        folded = Some((i, j, (**x).mul(*km)));
                        break 'search;
                    }
                }
            }
        }
        let Some((i, j, replacement)) = folded else {
            return out;
        };
        let (hi, lo) = (i.max(j), i.min(j));
        out.terms.remove(hi);
        out.terms.remove(lo);
        out = out.add(&replacement);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys that differ in one word hash apart, and a map keyed by index expressions finds what
    /// it holds.
    #[test]
    fn index_keys_find_their_values() {
        let mut m: std::collections::HashMap<
            (usize, Vec<Ix>),
            usize,
            kiln_compile::fast_hash::Fast,
        > = Default::default();
        for n in 0..200usize {
            let idx = vec![
                Ix::var(n % 7).add_const(n as i64),
                Ix::constant(n as i64 / 3),
            ];
            m.insert((n, idx), n);
        }
        assert_eq!(m.len(), 200);
        for n in 0..200usize {
            let idx = vec![
                Ix::var(n % 7).add_const(n as i64),
                Ix::constant(n as i64 / 3),
            ];
            assert_eq!(m.get(&(n, idx)), Some(&n));
        }
    }

    #[test]
    fn reshape_round_trip_collapses_to_the_flat_index() {
        // a [6] buffer viewed as [2, 3] and read back flat: (i/3)*3 + i%3 == i
        let ext = [6];
        let i = Ix::var(0);
        let row = i.div(3, &ext);
        let col = i.rem(3, &ext);
        let flat = row.mul(3).add(&col);
        assert_eq!(flat, Ix::var(0));
        assert_eq!(flat.to_c("i"), "i0");
    }

    #[test]
    fn ranges_remove_needless_division_and_modulo() {
        // i0 in 0..4, i1 in 0..5: (i0*5 + i1) / 5 == i0 and % 5 == i1
        let ext = [4, 5];
        let flat = Ix::var(0).mul(5).add(&Ix::var(1));
        assert_eq!(flat.div(5, &ext), Ix::var(0));
        assert_eq!(flat.rem(5, &ext), Ix::var(1));
        // but not when the inner part can overflow the divisor
        let odd = Ix::var(0).mul(4).add(&Ix::var(1));
        assert!(matches!(odd.div(5, &ext).terms[0].1, Atom::Div(..)));
        assert_eq!(odd.bounds(&ext), (0, 16));
    }

    /// A common factor of the divisor whose remainder stays below it divides out: a step-2
    /// slice of a padded 114-wide row reads `(114·h + w + 1) / 228` with `w` in 0..112, which
    /// is `h / 2`, and its modulo `114·(h % 2) + w + 1`. The same expressions checked against
    /// plain integer arithmetic at every point of the loop space.
    #[test]
    fn common_factors_of_the_divisor_divide_out() {
        let ext = [112, 112];
        let (h, w) = (Ix::var(0), Ix::var(1));
        let x = h.mul(114).add(&w).add_const(1);
        let q = x.div(228, &ext);
        assert_eq!(q.to_c("i"), "((i0) / 2)");
        let r = x.rem(228, &ext);
        assert_eq!(r.to_c("i"), "i1 + 114*((i0) % 2) + 1");
        // with a clamped row, as a pad reads it
        let held = h.add_const(1).held_in(0, 111, &ext);
        let x2 = held.mul(114).add(&w).add_const(1);
        assert!(!x2.div(228, &ext).to_c("i").contains("228"));
        let eval = |e: &Ix, i0: i64, i1: i64| -> i64 { e.eval(&[i0, i1]) };
        for i0 in 0..112 {
            for i1 in 0..112 {
                let v = 114 * i0 + i1 + 1;
                assert_eq!(eval(&q, i0, i1), v / 228);
                assert_eq!(eval(&r, i0, i1), v % 228);
                let v2 = 114 * (i0 + 1).clamp(0, 111) + i1 + 1;
                assert_eq!(eval(&x2.div(228, &ext), i0, i1), v2 / 228);
                assert_eq!(eval(&x2.rem(228, &ext), i0, i1), v2 % 228);
            }
        }
        // a factor of 2 only: (57·h + w) / 114, still exact
        let y = h.mul(114).add(&w.mul(2));
        assert_eq!(y.div(228, &ext).to_c("i"), "((57*i0 + i1) / 114)");
        for i0 in 0..112 {
            for i1 in 0..112 {
                assert_eq!(eval(&y.div(228, &ext), i0, i1), (114 * i0 + 2 * i1) / 228);
                assert_eq!(eval(&y.rem(228, &ext), i0, i1), (114 * i0 + 2 * i1) % 228);
            }
        }
    }

    #[test]
    fn quad_in_finds_unit_stride_reads_of_the_innermost_variable() {
        // channels last [n, h, w, c] with c = 64: a window tap at (h + 1) / 2, c
        let ext = [2, 112, 112, 64];
        let (h, c) = (Ix::var(1), Ix::var(3));
        let tap = h.add_const(1).held_in(0, 111, &ext).div(2, &ext);
        let off = Ix::var(0).mul(200704).add(&tap.mul(3584)).add(&c);
        let rest = off
            .quad_in(3)
            .expect("unit stride in c, the rest a multiple of 4");
        assert!(!rest.mentions(3) && rest.mentions(1));
        assert_eq!(rest.add(&c), off);
        // c at a stride (a transposed read), c inside a division, an odd offset: no vector
        assert_eq!(c.mul(2).add(&h.mul(128)).quad_in(3), None);
        assert_eq!(c.div(2, &ext).add(&h.mul(32)).quad_in(3), None);
        assert_eq!(c.add(&h.mul(64)).add_const(1).quad_in(3), None);
        assert_eq!(c.add(&h.mul(66)).quad_in(3), None);
        // c also inside a clamp beside its unit term
        let clamped = c.add_const(1).held_in(0, 63, &ext);
        assert_eq!(c.add(&clamped.mul(64)).quad_in(3), None);
    }

    /// A stride-2 tap's parity, `clamp(h + 1) % 2`: unclamped, with `h = 2·j + 1`, a constant;
    /// its variable and divisor are what the body's residues name, and an index that moves by
    /// a multiple of the divisor names none.
    #[test]
    fn unclamped_parity_is_constant_in_a_residue_class() {
        let ext = [112];
        let tap = Ix::var(0).add_const(1).held_in(0, 111, &ext);
        let parity = tap.rem(2, &ext);
        assert!(parity.to_c("i").contains("111"));
        assert_eq!(parity.unclamped(&ext), Ix::var(0).add_const(1).rem(2, &ext));
        let mut found = Vec::new();
        parity.residue_vars(&mut found);
        tap.div(2, &ext).residue_vars(&mut found);
        assert_eq!(found, vec![(0, 2)]);
        // the odd rows of 112: h = 2·j + 1, j in 0..56
        let half = [56];
        let odd = Ix::var(0).mul(2).add_const(1);
        let tap = odd.add_const(1).held_in(0, 111, &half);
        assert_eq!(tap.rem(2, &half).unclamped(&half), Ix::constant(0));
        assert_eq!(tap.unclamped(&half).div(2, &half).to_c("i"), "i0 + 1");
        let mut none = Vec::new();
        Ix::var(0).mul(4).div(2, &half).residue_vars(&mut none);
        assert!(none.is_empty());
    }

    #[test]
    fn clamps_only_what_can_leave_the_range() {
        // i0 in 0..4: i0 - 1 reaches -1, i0 + 1 reaches 4, i0 stays in 0..=3
        let ext = [4];
        let i = Ix::var(0);
        assert_eq!(i.held_in(0, 3, &ext), i);
        let below = i.add_const(-1).held_in(0, 3, &ext);
        assert_eq!(below.bounds(&ext), (0, 2));
        // held on the side it can cross only
        assert_eq!(below.to_c("i"), "((i0 + -1) < 0 ? 0 : (i0 + -1))");
        let above = i.add_const(1).held_in(0, 3, &ext);
        assert_eq!(above.bounds(&ext), (1, 3));
        assert_eq!(above.to_c("i"), "((i0 + 1) > 3 ? 3 : (i0 + 1))");
        for v in 0..4 {
            assert_eq!(below.eval(&[v]), (v - 1).clamp(0, 3));
            assert_eq!(above.eval(&[v]), (v + 1).clamp(0, 3));
        }
        // both sides: an index over 0..6 held into 1..=3
        let wide = Ix::var(0).held_in(1, 3, &[6]);
        assert_eq!(wide.to_c("i"), "((i0) < 1 ? 1 : ((i0) > 3 ? 3 : (i0)))");
        // wholly outside: a constant
        assert_eq!(i.add_const(10).held_in(0, 3, &ext), Ix::constant(3));
        assert_eq!(i.add_const(-7).held_in(0, 3, &ext), Ix::constant(0));
    }
}
