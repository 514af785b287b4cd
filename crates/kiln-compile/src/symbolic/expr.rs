//! Symbolic sizes: a small integer expression type over symbols (`s0`, `s1`, ...), with the
//! operations sizes are made of (+, *, floor division, modulo, min, max), light simplification and
//! evaluation. Target-neutral: code generators print it their own way through `Expr::visit`-style
//! matching; `Display` prints it as Python would (`s0*s1`, `(s0 + 1)//2`).

use std::fmt;

/// A symbol: an input dimension the graph is compiled for at any size (see `SymGraph`).
pub type SymId = usize;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Expr {
    Sym(SymId),
    Const(i64),
    Add(Box<Expr>, Box<Expr>),
    Mul(Box<Expr>, Box<Expr>),
    /// Floor division (rounds toward negative infinity, as Python's `//`).
    FloorDiv(Box<Expr>, Box<Expr>),
    /// The remainder of `FloorDiv` (the sign of the divisor).
    Mod(Box<Expr>, Box<Expr>),
    Min(Box<Expr>, Box<Expr>),
    Max(Box<Expr>, Box<Expr>),
}

impl Expr {
    pub fn sym(s: SymId) -> Expr {
        Expr::Sym(s)
    }
    pub fn int(v: i64) -> Expr {
        Expr::Const(v)
    }
    pub fn plus(self, o: Expr) -> Expr {
        Expr::Add(Box::new(self), Box::new(o)).simplify()
    }
    pub fn times(self, o: Expr) -> Expr {
        Expr::Mul(Box::new(self), Box::new(o)).simplify()
    }
    pub fn floor_div(self, o: Expr) -> Expr {
        Expr::FloorDiv(Box::new(self), Box::new(o)).simplify()
    }
    pub fn modulo(self, o: Expr) -> Expr {
        Expr::Mod(Box::new(self), Box::new(o)).simplify()
    }
    pub fn min(self, o: Expr) -> Expr {
        Expr::Min(Box::new(self), Box::new(o)).simplify()
    }
    pub fn max(self, o: Expr) -> Expr {
        Expr::Max(Box::new(self), Box::new(o)).simplify()
    }

    pub fn as_const(&self) -> Option<i64> {
        match self {
            Expr::Const(v) => Some(*v),
            _ => None,
        }
    }

    /// The value at `syms` (symbol `k` has value `syms[k]`); `None` on a division by zero, an
    /// overflow, or a symbol without a value.
    pub fn eval(&self, syms: &[i64]) -> Option<i64> {
        let bin = |a: &Expr, b: &Expr| Some((a.eval(syms)?, b.eval(syms)?));
        match self {
            Expr::Sym(s) => syms.get(*s).copied(),
            Expr::Const(v) => Some(*v),
            Expr::Add(a, b) => bin(a, b).and_then(|(x, y)| x.checked_add(y)),
            Expr::Mul(a, b) => bin(a, b).and_then(|(x, y)| x.checked_mul(y)),
            Expr::FloorDiv(a, b) => bin(a, b).and_then(|(x, y)| floor_div(x, y)),
            Expr::Mod(a, b) => bin(a, b).and_then(|(x, y)| floor_mod(x, y)),
            Expr::Min(a, b) => bin(a, b).map(|(x, y)| x.min(y)),
            Expr::Max(a, b) => bin(a, b).map(|(x, y)| x.max(y)),
        }
    }

    /// The symbols this expression reads, ascending, without repeats.
    pub fn symbols(&self) -> Vec<SymId> {
        let mut out = Vec::new();
        self.collect_symbols(&mut out);
        out.sort_unstable();
        out.dedup();
        out
    }

    fn collect_symbols(&self, out: &mut Vec<SymId>) {
        match self {
            Expr::Sym(s) => out.push(*s),
            Expr::Const(_) => {}
            Expr::Add(a, b)
            | Expr::Mul(a, b)
            | Expr::FloorDiv(a, b)
            | Expr::Mod(a, b)
            | Expr::Min(a, b)
            | Expr::Max(a, b) => {
                a.collect_symbols(out);
                b.collect_symbols(out);
            }
        }
    }

    /// One step of rewriting at the root (children are already simple, as the constructors build
    /// bottom-up): constants folded, identities (x+0, x*1, x*0, x//1, x%1) removed, constants
    /// moved right so `2*s0` and `s0*2` print and compare alike.
    pub fn simplify(self) -> Expr {
        if self.symbols().is_empty() {
            if let Some(v) = self.eval(&[]) {
                return Expr::Const(v);
            }
        }
        match self {
            Expr::Add(a, b) => match (*a, *b) {
                (Expr::Const(0), x) | (x, Expr::Const(0)) => x,
                (c @ Expr::Const(_), x) => Expr::Add(Box::new(x), Box::new(c)),
                // (x + c1) + c2 -> x + (c1 + c2)
                (Expr::Add(x, c1), Expr::Const(c2)) if c1.as_const().is_some() => {
                    let c = c1.as_const().unwrap_or(0).saturating_add(c2);
                    Expr::Add(x, Box::new(Expr::Const(c))).simplify()
                }
                (x, y) => Expr::Add(Box::new(x), Box::new(y)),
            },
            Expr::Mul(a, b) => match (*a, *b) {
                (Expr::Const(0), _) | (_, Expr::Const(0)) => Expr::Const(0),
                (Expr::Const(1), x) | (x, Expr::Const(1)) => x,
                (c @ Expr::Const(_), x) => Expr::Mul(Box::new(x), Box::new(c)),
                (Expr::Mul(x, c1), Expr::Const(c2)) if c1.as_const().is_some() => {
                    let c = c1.as_const().unwrap_or(1).saturating_mul(c2);
                    Expr::Mul(x, Box::new(Expr::Const(c))).simplify()
                }
                (x, y) => Expr::Mul(Box::new(x), Box::new(y)),
            },
            Expr::FloorDiv(a, b) => match (*a, *b) {
                (x, Expr::Const(1)) => x,
                (x, y) => Expr::FloorDiv(Box::new(x), Box::new(y)),
            },
            Expr::Mod(a, b) => match (*a, *b) {
                (_, Expr::Const(1)) => Expr::Const(0),
                (x, y) => Expr::Mod(Box::new(x), Box::new(y)),
            },
            Expr::Min(a, b) if a == b => *a,
            Expr::Max(a, b) if a == b => *a,
            e => e,
        }
    }
}

pub fn floor_div(x: i64, y: i64) -> Option<i64> {
    if y == 0 {
        return None;
    }
    let q = x.checked_div(y)?;
    Some(if (x % y != 0) && ((x < 0) != (y < 0)) {
        q - 1
    } else {
        q
    })
}

pub fn floor_mod(x: i64, y: i64) -> Option<i64> {
    x.checked_sub(floor_div(x, y)?.checked_mul(y)?)
}

impl fmt::Display for Expr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let atom = |e: &Expr| match e {
            Expr::Sym(_) | Expr::Const(_) | Expr::Min(..) | Expr::Max(..) => format!("{e}"),
            _ => format!("({e})"),
        };
        match self {
            Expr::Sym(s) => write!(f, "s{s}"),
            Expr::Const(v) => write!(f, "{v}"),
            Expr::Add(a, b) => match b.as_const() {
                Some(c) if c < 0 => write!(f, "{a} - {}", -(c as i128)),
                _ => write!(f, "{a} + {b}"),
            },
            Expr::Mul(a, b) => write!(f, "{}*{}", atom(a), atom(b)),
            Expr::FloorDiv(a, b) => write!(f, "{}//{}", atom(a), atom(b)),
            Expr::Mod(a, b) => write!(f, "{}%{}", atom(a), atom(b)),
            Expr::Min(a, b) => write!(f, "min({a}, {b})"),
            Expr::Max(a, b) => write!(f, "max({a}, {b})"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evaluates_with_floor_semantics() {
        let e = Expr::sym(0).plus(Expr::int(-3)).floor_div(Expr::int(2));
        assert_eq!(e.eval(&[10]), Some(3));
        assert_eq!(e.eval(&[2]), Some(-1), "(2-3)//2 rounds down");
        assert_eq!(Expr::sym(0).modulo(Expr::int(4)).eval(&[-1]), Some(3));
        assert_eq!(Expr::sym(0).floor_div(Expr::int(0)).eval(&[3]), None);
        assert_eq!(
            Expr::sym(1).eval(&[3]),
            None,
            "an unbound symbol has no value"
        );
        let m = Expr::sym(0).min(Expr::sym(1)).max(Expr::int(5));
        assert_eq!(m.eval(&[3, 9]), Some(5));
        assert_eq!(m.eval(&[7, 9]), Some(7));
    }

    #[test]
    fn simplifies_constants_and_identities() {
        assert_eq!(
            Expr::int(2).times(Expr::int(3)).plus(Expr::int(1)),
            Expr::int(7)
        );
        assert_eq!(Expr::sym(0).plus(Expr::int(0)), Expr::sym(0));
        assert_eq!(Expr::sym(0).times(Expr::int(1)), Expr::sym(0));
        assert_eq!(Expr::sym(0).times(Expr::int(0)), Expr::int(0));
        assert_eq!(Expr::sym(0).floor_div(Expr::int(1)), Expr::sym(0));
        assert_eq!(
            Expr::int(2).times(Expr::sym(0)),
            Expr::sym(0).times(Expr::int(2))
        );
        let e = Expr::sym(0).plus(Expr::int(2)).plus(Expr::int(-5));
        assert_eq!(e, Expr::sym(0).plus(Expr::int(-3)));
        assert_eq!(e.to_string(), "s0 - 3");
        let p = Expr::sym(0).times(Expr::sym(1)).times(Expr::int(4));
        assert_eq!(p.to_string(), "(s0*s1)*4");
        assert_eq!(p.symbols(), vec![0, 1]);
        assert_eq!(
            Expr::sym(0)
                .plus(Expr::int(1))
                .floor_div(Expr::int(2))
                .to_string(),
            "(s0 + 1)//2"
        );
    }
}
