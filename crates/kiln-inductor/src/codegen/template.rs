//! Size-generic kernels for symbolic graphs. The kernels of one symbolic graph compiled at
//! different sizes (`kiln_compile::symbolic::context`) have the same text but for integer
//! constants: loop bounds, strides, offsets. Each such constant is fitted to an expression of the
//! graph's symbols (the fitter of `kiln_compile::symbolic::fit`) from the sizes seen so far, and
//! one kernel is generated with those expressions over size arguments (`s0`, `s1`, ...: read from
//! an `int64_t` array passed after the buffers in C, `long long` parameters after the buffers in
//! CUDA; see `SizeArgs`) and compiled once.
//!
//! Sound by checking, as the graphs are: at every size the kernel's text is generated as for a
//! static kernel and the size-generic kernel is used only if its expressions give exactly that
//! text's constants at this size; otherwise that size gets the static kernel. Size 1 (which a
//! symbolic graph now serves when its trace instantiates it) is checked the same way, and is never
//! a sample for fitting.
//!
//! Text-level and target-neutral: the C (`backend.rs`) and CUDA (`codegen/cuda.rs`) generators
//! template their kernels the same way (`c_expr` prints an expression in C syntax, which CUDA
//! shares); they differ only in how the size arguments reach the kernel.

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::{Mutex, OnceLock};

use kiln_compile::symbolic::context::SizeContext;
use kiln_compile::symbolic::fit::{fit, Sample};
use kiln_compile::symbolic::Expr;

use super::c::Kernel;

/// Stands for an integer literal in a kernel's text (a character C source never holds).
pub(crate) const HOLE: char = '\u{1}';

/// A kernel's text split at its integer literals: the text with each literal replaced by `HOLE`
/// (and the kernel's own name by `KNAME`), and the literals in order.
pub fn split_literals(k: &Kernel) -> (String, Vec<i64>) {
    split_text(&k.source.replace(&k.name, "KNAME"))
}

/// `src` split at its integer literals: the text with each literal replaced by `HOLE`, and the
/// literals in order.
pub fn split_text(src: &str) -> (String, Vec<i64>) {
    let b = src.as_bytes();
    let (mut text, mut lits) = (String::with_capacity(src.len()), Vec::new());
    let ident = |c: u8| c.is_ascii_alphanumeric() || c == b'_' || c == b'.';
    let mut i = 0;
    while i < b.len() {
        let starts = b[i].is_ascii_digit() && (i == 0 || !ident(b[i - 1]));
        if !starts {
            text.push(b[i] as char);
            i += 1;
            continue;
        }
        let mut j = i;
        while j < b.len() {
            let exp_sign = (b[j] == b'-' || b[j] == b'+')
                && j > i
                && matches!(b[j - 1], b'e' | b'E' | b'p' | b'P');
            if ident(b[j]) || exp_sign {
                j += 1;
            } else {
                break;
            }
        }
        let tok = &src[i..j];
        match tok.parse::<i64>() {
            Ok(v) if tok.bytes().all(|c| c.is_ascii_digit()) => {
                text.push(HOLE);
                lits.push(v);
            }
            _ => text.push_str(tok), // a float, a hex constant, a suffixed literal: structure
        }
        i = j;
    }
    (text, lits)
}

/// `e` in C, with floor division and modulo through helpers the template defines.
pub fn c_expr(e: &Expr) -> String {
    match e {
        Expr::Sym(s) => format!("s{s}"),
        Expr::Const(v) => format!("{v}LL"),
        Expr::Add(a, b) => format!("({} + {})", c_expr(a), c_expr(b)),
        Expr::Mul(a, b) => format!("({} * {})", c_expr(a), c_expr(b)),
        Expr::FloorDiv(a, b) => format!("kiln_floordiv({}, {})", c_expr(a), c_expr(b)),
        Expr::Mod(a, b) => format!("kiln_floormod({}, {})", c_expr(a), c_expr(b)),
        Expr::Min(a, b) => format!("kiln_min({}, {})", c_expr(a), c_expr(b)),
        Expr::Max(a, b) => format!("kiln_max({}, {})", c_expr(a), c_expr(b)),
    }
}

/// How a target's kernels receive their size arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SizeArgs {
    /// C: a `void **args` function; the sizes are an `int64_t` array at `args[buffers]`.
    Array,
    /// CUDA: a `__global__` function of its buffers; the sizes are `long long` parameters after
    /// them (kernel parameters go by value: no array to allocate and copy per launch).
    Params,
}

/// The helpers `c_expr` calls, defined once per translation unit however many size-generic
/// kernels it holds (`QUAL` is `__device__` where they are called from device code).
const HELPERS: &str = "#ifndef KILN_SIZE_HELPERS
#define KILN_SIZE_HELPERS
static inline QUALint64_t kiln_floordiv(int64_t a, int64_t b) { int64_t q = a / b; return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q; }
static inline QUALint64_t kiln_floormod(int64_t a, int64_t b) { return a - kiln_floordiv(a, b) * b; }
static inline QUALint64_t kiln_min(int64_t a, int64_t b) { return a < b ? a : b; }
static inline QUALint64_t kiln_max(int64_t a, int64_t b) { return a > b ? a : b; }
#endif
";

/// A kernel's place in the graph it is generated for (`resolve`'s `place`): its index among the
/// graph's kernels, with the graph's node and kernel counts, which tell a forward and a backward
/// graph compiled for one size apart.
pub fn place(nodes: usize, kernels: usize, index: usize) -> u64 {
    ((nodes as u64) << 40) ^ ((kernels as u64) << 20) ^ index as u64
}

/// A size-generic kernel and the expression of each literal of its static text.
#[derive(Clone)]
struct Template {
    kernel: Kernel,
    exprs: Vec<Expr>,
}

#[derive(Default)]
struct Seen {
    /// (symbol values, literals) of the static kernels generated so far.
    points: Vec<(Vec<i64>, Vec<i64>)>,
    template: Option<Template>,
}

/// (symbolic graph, the kernel's place in the graph it is generated for, its text without literals):
/// a place's kernels at different sizes are one kernel's instances; another place with the same
/// text (the same block at another layer, with other channel counts) is another kernel.
type Key = (u64, u64, String);

fn registry() -> &'static Mutex<HashMap<Key, Seen>> {
    static R: OnceLock<Mutex<HashMap<Key, Seen>>> = OnceLock::new();
    R.get_or_init(Default::default)
}

/// What to compile for kernel `k`, generated at the sizes of `ctx` at `place` (the caller's name
/// for where in which graph it sits, equal across sizes): a size-generic kernel and the size
/// arguments to call it with, or `k` itself (with no size arguments). `how`: how the target's
/// kernels take size arguments.
pub fn resolve(ctx: &SizeContext, place: u64, k: &Kernel, how: SizeArgs) -> (Kernel, Vec<i64>) {
    let (text, lits) = split_literals(k);
    let mut reg = registry().lock().unwrap_or_else(|e| e.into_inner());
    let seen = reg.entry((ctx.graph_id, place, text.clone())).or_default();
    let instantiates = |t: &Template| {
        t.exprs.len() == lits.len()
            && t.exprs
                .iter()
                .zip(&lits)
                .all(|(e, &l)| e.eval(&ctx.values) == Some(l))
    };
    // kernels of identical text at other places of the graphs read other buffers: the template's
    // text with this kernel's buffers
    let with_inputs = |t: &Template| Kernel {
        inputs: k.inputs.clone(),
        ..t.kernel.clone()
    };
    if let Some(t) = seen.template.as_ref().filter(|t| instantiates(t)) {
        return (with_inputs(t), ctx.values.clone());
    }
    if ctx.values.iter().any(|&v| v < 2) {
        // a size-1 graph may run a symbolic entry (its trace instantiated it), but its kernels
        // simplify at 1 (unit loops, broadcast strides) in ways no other size shows: such a size
        // uses the template where it instantiates, and never joins a fit
        return (k.clone(), Vec::new());
    }
    if !seen.points.iter().any(|(v, _)| *v == ctx.values) {
        seen.points.push((ctx.values.clone(), lits.clone()));
    }
    if seen.points.len() < 2 {
        return (k.clone(), Vec::new());
    }
    // no template yet, or one fitted from too few sizes that this size contradicts: fit again
    // from every size seen
    let n = ctx.values.len();
    let exprs: Option<Vec<Expr>> = (0..lits.len())
        .map(|i| {
            let samples: Vec<Sample> = seen
                .points
                .iter()
                .map(|(v, l)| (v.as_slice(), l[i]))
                .collect();
            fit(&samples, n)
        })
        .collect();
    let Some(exprs) = exprs else {
        return (k.clone(), Vec::new());
    };
    let t = Template {
        kernel: build(&text, &exprs, n, &k.inputs, how),
        exprs,
    };
    if !instantiates(&t) {
        return (k.clone(), Vec::new());
    }
    seen.template = Some(t.clone());
    (with_inputs(&t), ctx.values.clone())
}

/// The size-generic kernel: `text` with each `HOLE` replaced by its expression, taking the size
/// arguments as `how` says, named by the hash of the result.
fn build(text: &str, exprs: &[Expr], num_syms: usize, inputs: &[usize], how: SizeArgs) -> Kernel {
    let mut body = String::with_capacity(text.len() + 64);
    let mut it = exprs.iter();
    for ch in text.chars() {
        match ch {
            HOLE => match it.next() {
                Some(Expr::Const(v)) => {
                    let _ = write!(body, "{v}");
                }
                Some(e) => body.push_str(&c_expr(e)),
                None => {}
            },
            c => body.push(c),
        }
    }
    let (body, qual) = match how {
        SizeArgs::Array => (with_size_array(&body, num_syms), ""),
        SizeArgs::Params => (with_size_params(&body, num_syms), "__device__ "),
    };
    let source = format!("{}{body}", HELPERS.replace("QUAL", qual));
    let name = format!("ks_{:016x}", xxhash_rust::xxh3::xxh3_64(source.as_bytes()));
    Kernel {
        source: source.replace("KNAME", &name),
        name,
        inputs: inputs.to_vec(),
        member: None,
    }
}

/// `s0`, `s1`, ... read from the `int64_t` array after the buffers of a `void **args` function.
fn with_size_array(body: &str, num_syms: usize) -> String {
    // the buffers are args[0..n]: the size array is args[n]
    let nargs = body
        .match_indices("args[")
        .filter_map(|(at, _)| {
            let rest = &body[at + 5..];
            rest[..rest.find(']')?].parse::<usize>().ok()
        })
        .max()
        .map_or(0, |m| m + 1);
    let mut prologue = format!("\n  const int64_t *kiln_sizes = (const int64_t *)args[{nargs}];\n");
    for s in 0..num_syms {
        let _ = writeln!(prologue, "  const int64_t s{s} = kiln_sizes[{s}];");
    }
    body.replacen("(void **args) {", &format!("(void **args) {{{prologue}"), 1)
}

/// `s0`, `s1`, ... as `long long` parameters after the last parameter of `KNAME(...)`.
fn with_size_params(body: &str, num_syms: usize) -> String {
    let params: String = (0..num_syms)
        .map(|s| format!(", const long long s{s}"))
        .collect();
    with_params(body, "KNAME", &params, "").unwrap_or_else(|| body.to_string())
}

/// Where the parameters of the first `name(...)` in `body` lie: the bytes between its
/// parentheses (a definition's parameters hold none: types and names only).
pub(crate) fn param_list(body: &str, name: &str) -> Option<std::ops::Range<usize>> {
    let open = body.find(&format!("{name}("))? + name.len() + 1;
    Some(open..open + body[open..].find(')')?)
}

/// `body` with `params` after the last parameter of `name(...)`'s definition (its parameters
/// hold no parentheses: types and names only) and `prologue` first in its body; `None` when
/// `body` defines no `name(...) {`.
pub(crate) fn with_params(body: &str, name: &str, params: &str, prologue: &str) -> Option<String> {
    let close = param_list(body, name)?.end;
    let brace = close + body[close..].find('{')? + 1;
    Some(format!(
        "{}{params}{}{prologue}{}",
        &body[..close],
        &body[close..brace],
        &body[brace..]
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn integer_literals_are_split_from_the_rest() {
        let k = Kernel {
            name: "k_12ab".into(),
            source: "void k_12ab(void **args) { float* b0 = args[0]; for (int64_t i0 = 0; i0 < 48; i0++) out[i0*3 + 2] = b0[i0] * 2.5f + 1e-5f + x1; }".into(),
            inputs: vec![],
            member: None,
        };
        let (text, lits) = split_literals(&k);
        assert_eq!(lits, vec![0, 0, 48, 3, 2]);
        let text = text.replace(HOLE, "#");
        assert!(
            text.starts_with("void KNAME(void **args) { float* b0 = args[#];"),
            "{text}"
        );
        assert!(text.contains("* 2.5f + 1e-5f + x1"), "{text}");
    }
}

#[cfg(test)]
mod size_one {
    use super::*;

    /// A kernel as the generator writes it at size `n`: a loop over 3n elements reading at an
    /// offset n (`unit` writes the loop-free text a generator makes when a loop has one trip).
    fn kernel(n: i64, unit: bool) -> Kernel {
        let body = if unit {
            "b1[0] = b0[1] * 2.0f;".to_string()
        } else {
            format!(
                "for (int64_t i0 = 0; i0 < {}; i0++) b1[i0] = b0[i0 + {n}] * 2.0f;",
                3 * n
            )
        };
        let source = format!(
            "void KN(void **args) {{ float* b0 = (float*)args[0]; float* b1 = (float*)args[1]; {body} }}"
        );
        let name = format!("k_{:016x}", xxhash_rust::xxh3::xxh3_64(source.as_bytes()));
        Kernel {
            source: source.replace("KN", &name),
            name,
            inputs: vec![0],
            member: None,
        }
    }

    fn at(n: i64) -> SizeContext {
        SizeContext {
            graph_id: u64::MAX - 1, // no symbolic graph of a real compile has this id
            values: vec![n],
        }
    }

    #[test]
    fn size_1_uses_the_template_only_where_it_instantiates() {
        let (k4, s4) = resolve(&at(4), 0, &kernel(4, false), SizeArgs::Array);
        assert!(
            s4.is_empty() && k4.source == kernel(4, false).source,
            "first size: static"
        );
        let (k6, s6) = resolve(&at(6), 0, &kernel(6, false), SizeArgs::Array);
        assert_eq!(s6, vec![6]);
        assert!(k6.name.starts_with("ks_"), "{}", k6.source);
        // the same text at 1, with 3 and 1 in its holes: the size-generic kernel, called at 1
        let (k1, s1) = resolve(&at(1), 0, &kernel(1, false), SizeArgs::Array);
        assert_eq!((k1.name.as_str(), s1), (k6.name.as_str(), vec![1]));
        // the loop-free text of size 1 is no instance of it: its own static kernel
        let (u, su) = resolve(&at(1), 0, &kernel(1, true), SizeArgs::Array);
        assert!(su.is_empty() && u.source == kernel(1, true).source);
        let (k9, s9) = resolve(&at(9), 0, &kernel(9, false), SizeArgs::Array);
        assert_eq!((k9.name.as_str(), s9), (k6.name.as_str(), vec![9]));
    }
}
