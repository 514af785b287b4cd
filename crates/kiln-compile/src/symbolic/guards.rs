//! Guards on symbols: the facts about sizes a symbolic graph was compiled under (`s0 >= 1`, because
//! 0 is specialised; `s1 % 8 == 0` where a kernel relies on it; two input dimensions being one
//! symbol). Checking is evaluating each guard at the call's symbol values: a few integer
//! operations per guard, well under a microsecond.

use std::fmt;

use super::expr::Expr;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SymGuard {
    /// `expr >= bound`.
    AtLeast(Expr, i64),
    /// `expr % divisor == 0`.
    Divisible(Expr, i64),
    /// `a == b`.
    Equal(Expr, Expr),
}

impl SymGuard {
    pub fn holds(&self, syms: &[i64]) -> bool {
        match self {
            SymGuard::AtLeast(e, b) => e.eval(syms).is_some_and(|v| v >= *b),
            SymGuard::Divisible(e, d) => e
                .eval(syms)
                .and_then(|v| super::expr::floor_mod(v, *d))
                .is_some_and(|r| r == 0),
            SymGuard::Equal(a, b) => {
                matches!((a.eval(syms), b.eval(syms)), (Some(x), Some(y)) if x == y)
            }
        }
    }
}

impl fmt::Display for SymGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SymGuard::AtLeast(e, b) => write!(f, "{e} >= {b}"),
            SymGuard::Divisible(e, d) => write!(f, "{e} % {d} == 0"),
            SymGuard::Equal(a, b) => write!(f, "{a} == {b}"),
        }
    }
}

/// The first guard that fails at `syms`, in words (`s0 = 0 fails the guard s0 >= 1`).
pub fn first_failure(guards: &[SymGuard], syms: &[i64]) -> Option<String> {
    let g = guards.iter().find(|g| !g.holds(syms))?;
    let vals: Vec<String> = match g {
        SymGuard::AtLeast(e, _) | SymGuard::Divisible(e, _) => e.symbols(),
        SymGuard::Equal(a, b) => {
            let mut v = a.symbols();
            v.extend(b.symbols());
            v
        }
    }
    .into_iter()
    .map(|k| format!("s{k} = {}", syms.get(k).copied().unwrap_or(-1)))
    .collect();
    Some(format!("{} fails the guard {g}", vals.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_check_and_explain() {
        let gs = vec![
            SymGuard::AtLeast(Expr::sym(0), 2),
            SymGuard::Divisible(Expr::sym(1), 8),
            SymGuard::Equal(Expr::sym(0), Expr::sym(2)),
        ];
        assert!(gs.iter().all(|g| g.holds(&[4, 16, 4])));
        assert_eq!(
            first_failure(&gs, &[1, 16, 1]).as_deref(),
            Some("s0 = 1 fails the guard s0 >= 2")
        );
        assert_eq!(
            first_failure(&gs, &[4, 12, 4]).as_deref(),
            Some("s1 = 12 fails the guard s1 % 8 == 0")
        );
        assert!(first_failure(&gs, &[4, 8, 5]).is_some());
        assert_eq!(first_failure(&gs, &[4, 8, 4]), None);
    }
}
