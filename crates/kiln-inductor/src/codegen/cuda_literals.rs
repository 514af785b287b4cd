//! Kernels of one static graph that differ only in integer literals share one build. A network
//! repeats its blocks at other channel counts and spatial sizes (DenseNet-121's 58 dense layers,
//! ResNet's four stages), and each repeat's kernels are the same text but for loop bounds,
//! strides and divisors: 443 single kernels of DenseNet-121's training step were 52 texts. NVRTC
//! spends its time per kernel (optimizer and ptxas: 1.1 s for the largest), so each text is built
//! once, over its differing literals as parameters, and every member is launched with its own
//! values.
//!
//! Sound by construction: the shared kernel is the member's text with some literals read from
//! parameters holding exactly those literals (`fill` writes both texts from one split, and a test
//! checks that a member's values give back its text). Literals that C needs as constants — the
//! size of a `__shared__` array, an unroll count, launch bounds — are part of the key, never a
//! parameter. A parameter every member fits in 32 bits is read as an `int`, so a kernel's
//! narrowed index arithmetic stays 32-bit.
//!
//! A launch of several members (side by side, `horizontal.rs`, or in sequence) is its
//! dispatcher and its members' device functions: one text for the key. Most of DenseNet-121's
//! training-step launches are such dispatchers (195 of 255 kernels: two dense layers' batch-norm
//! passes side by side, ...), and they repeat at other channel counts as the single kernels do
//! (61 texts). A shared dispatcher takes every parameter and passes each device function (its
//! own copy, named after the dispatcher) the ones its text reads. Fewer kernels also means a
//! faster warm start: the driver loads modules and looks up functions one at a time.
//!
//! A divisor that became a parameter costs a division sequence per element where a constant
//! cost a multiply and a shift (DenseNet-121's training step 39.3 → 41.2 ms with plain runtime
//! divisors). The flat-index splits (`rem % n; rem /= n`, of a non-negative 32-bit index) take
//! a multiplier and shift computed on the host instead (`magic`: exact below 2^31).

use std::collections::HashMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

use kiln_core::device::MAX_KERNEL_PARAMS;

use super::cuda_sizes::Resolved;
use super::template::{param_list, split_text, with_params, HOLE};

/// Lines whose literals C reads as constant expressions: they key a group, never vary in it.
const CONSTANT_CONTEXTS: [&str; 3] = ["__shared__", "#pragma", "__launch_bounds__"];

/// Fewest distinct kernels in a graph for its kernels to share builds. Sharing trades step time
/// for compile time: with the magic divisions, 2.6-3.6% on DenseNet-121's and ResNet-18's
/// training steps (loops bounded by a parameter, other divisions by one; about 1% once short
/// loops keep constant bounds, `SMALL_LOOP`) against a quarter to a third of DenseNet-121's cold
/// compile (H200, same call: 6.79 → 5.13 s, 40.0 → 41.1 ms). A graph this large is where the
/// compile is long enough to matter (DenseNet-121: 143 and 336 single kernels in its forward and
/// backward graphs; ResNet-18: 17 and 44, which keep theirs). Max-autotune, which puts the step
/// first, never shares.
pub(crate) const SHARE_FROM_KERNELS: usize = 100;

/// Kernels launched through a shared build so far in this process.
static SHARED: AtomicU64 = AtomicU64::new(0);

/// Launches of several members (horizontal or sequential) launched through a shared build.
static SHARED_WITH_MEMBERS: AtomicU64 = AtomicU64::new(0);

/// How many planned kernels so far were given a shared build instead of their own (each member
/// of each group counted once per compile): single kernels, then launches of several members.
pub fn shared_kernels() -> (u64, u64) {
    (
        SHARED.load(Ordering::Relaxed),
        SHARED_WITH_MEMBERS.load(Ordering::Relaxed),
    )
}

/// `SHARE_FROM_KERNELS`, or `KILN_SHARE_KERNELS_FROM` (0 shares in every static graph: how the
/// GPU tests run shared kernels on graphs of a few kernels).
pub(crate) fn share_from() -> usize {
    std::env::var("KILN_SHARE_KERNELS_FROM")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(SHARE_FROM_KERNELS)
}

/// Fewest kernels of one text worth a shared build (each shared literal costs its members a
/// parameter and the compiler a constant; two repeats already halve the build).
const MIN_MEMBERS: usize = 2;

/// Device helpers for a division by a parameter `d` through its `magic` multiplier `m` and
/// shift `l`: exact for 0 <= x < 2^31.
const DIVISION_HELPERS: &str = "#ifndef KILN_MAGIC_DIVISION
#define KILN_MAGIC_DIVISION
static __device__ __forceinline__ int kiln_quo(int x, long long m, long long l) { return (int)(((unsigned long long)(unsigned)x * (unsigned long long)m) >> l); }
static __device__ __forceinline__ int kiln_rem(int x, int d, long long m, long long l) { return x - kiln_quo(x, m, l) * d; }
#endif
";

/// The multiplier and shift that divide by `d` (1 <= d < 2^31) every `x` in [0, 2^31): with
/// `k = ceil(log2 d)`, `m = ceil(2^(31+k) / d)` and `x / d = (x * m) >> (31 + k)` (Granlund and
/// Montgomery's round-up method for 31-bit dividends: `m d - 2^(31+k) < d <= 2^k`). `m` is
/// below 2^33, so `x * m` fits in 64 bits.
fn magic(d: i64) -> (i64, i64) {
    let d = d.max(1) as u128;
    let k = 128 - (d - 1).leading_zeros() as u128; // ceil(log2 d); 0 for d = 1
    let shift = 31 + k;
    let m = (1u128 << shift).div_ceil(d);
    (m as i64, shift as i64)
}

/// `kiln_quo` on the host, for the test of `magic`.
#[cfg(test)]
fn quotient(x: i64, (m, l): (i64, i64)) -> i64 {
    ((x as u64 as u128 * m as u64 as u128) >> l) as i64
}

/// `body` with each flat-index split by parameter `s<j>` (`rem % s<j>; rem /= s<j>;` as
/// `c::split_index` writes it) through that parameter's magic numbers, for the parameters in
/// `divisors`; the others stay divisions.
fn magic_splits(body: &str, divisors: &[usize]) -> String {
    let mut out = body.to_string();
    for &j in divisors {
        for rem in ["rem", "rem_row"] {
            let from = format!("= {rem} % s{j}; {rem} /= s{j};");
            let to = format!(
                "= kiln_rem({rem}, s{j}, s{j}_m, s{j}_l); {rem} = kiln_quo({rem}, s{j}_m, s{j}_l);"
            );
            out = out.replace(&from, &to);
        }
    }
    out
}

/// A resolved kernel's texts split at their integer literals (`template::split_text`): the
/// definitions of the device functions it calls (a horizontal or sequential launch's members,
/// each renamed `KNAME_f<i>` in order), then its `__global__` definition (renamed `KNAME`). A
/// single kernel is one text. `None` for a kernel whose device functions call each other (a
/// call is rewritten only in the `__global__` definition).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Split {
    texts: Vec<String>,
    /// Each text's literals, in order.
    lits: Vec<Vec<i64>>,
}

fn split(r: &Resolved) -> Option<Split> {
    let rename = |s: &str| {
        let mut s = s.to_string();
        for (i, (name, _)) in r.device_fns.iter().enumerate() {
            s = s.replace(name.as_str(), &format!("KNAME_f{i}"));
        }
        s.replace(&r.name, "KNAME")
    };
    let (texts, lits): (Vec<String>, Vec<Vec<i64>>) = r
        .device_fns
        .iter()
        .map(|(_, def)| def.as_str())
        .chain([r.source.as_str()])
        .map(|s| split_text(&rename(s)))
        .unzip();
    let (defs, kernel) = texts.split_at(texts.len() - 1);
    // each definition names itself once and calls nothing; the kernel calls each of them
    let leaf = |d: &String| d.matches("KNAME").count() == 1;
    let calls = (0..defs.len()).all(|i| kernel[0].contains(&format!("KNAME_f{i}(")));
    (defs.iter().all(leaf) && calls).then_some(Split { texts, lits })
}

/// Where a hole of a split kernel sits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hole {
    /// In a constant context: keys its group.
    Constant,
    /// The bound of a `for` loop (`... < HOLE;`): keys its group when at most `SMALL_LOOP`,
    /// so a short loop keeps the constant trip count its full unrolling needs.
    LoopBound,
    Free,
}

/// Longest loop whose bound stays a constant (a reduction's per-thread walk over a few
/// elements, a pooling window). DenseNet-121's training step, alternating runs in one call:
/// 40.1-40.3 ms with short loops keyed against 40.8-41.1 ms with every bound a parameter
/// (static kernels: 39.3-40.0 ms), for 3 more builds of 55 and a cold compile 0.5 s longer.
const SMALL_LOOP: i64 = 64;

/// For each hole of `text` (a split kernel), where it sits.
fn holes(text: &str) -> Vec<Hole> {
    let mut out = Vec::new();
    for line in text.split('\n') {
        let constant = CONSTANT_CONTEXTS.iter().any(|c| line.contains(c));
        let is_loop = line.contains("for (");
        for (at, _) in line.match_indices(HOLE) {
            out.push(match (constant, is_loop && line[..at].ends_with("< ")) {
                (true, _) => Hole::Constant,
                (false, true) => Hole::LoopBound,
                (false, false) => Hole::Free,
            });
        }
    }
    out
}

/// `text` with its holes filled in order: hole `i` by `literal(i)`.
fn fill(text: &str, literal: impl Fn(usize) -> String) -> String {
    let mut out = String::with_capacity(text.len() + 64);
    let mut hole = 0;
    for ch in text.chars() {
        if ch == HOLE {
            out.push_str(&literal(hole));
            hole += 1;
        } else {
            out.push(ch);
        }
    }
    out
}

/// A group's shared kernel: its `__global__` definition and its device functions (name,
/// definition), named by the hash of all of them, and the parameters whose magic numbers its
/// launches pass after the sizes, in order.
struct Shared {
    name: String,
    source: String,
    device_fns: Vec<(String, String)>,
    divisors: Vec<usize>,
}

/// The shared kernel of a group: its texts (`Split::texts`) with each hole of `param` read from
/// its parameter (`param[i] = Some(j)`: `s<j>`, holes numbered across the texts in order), the
/// others filled from `lits` (equal in every member); `narrow[j]`: parameter `j` is read as an
/// `int`. Flat-index splits by a narrow parameter in a 32-bit function go through magic numbers.
/// The `__global__` function takes every parameter by value after its buffers (`s<j>_arg`,
/// then `s<j>_m`, `s<j>_l` for each divisor); each device function takes the ones its own text
/// reads after its own parameters, and the kernel's calls pass them along. `None` for a text
/// whose definitions could not take parameters (no `NAME(...)` to add them to).
fn shared_kernel(
    texts: &[String],
    lits: &[i64],
    param: &[Option<usize>],
    narrow: &[bool],
) -> Option<Shared> {
    // each text filled: (body, the parameters it reads, those it divides by)
    let mut filled: Vec<(String, Vec<usize>, Vec<usize>)> = Vec::with_capacity(texts.len());
    let mut first = 0;
    for text in texts {
        let n = text.matches(HOLE).count();
        let holes = param.get(first..first + n)?;
        let body = fill(text, |i| match holes[i] {
            Some(j) => format!("s{j}"),
            None => lits[first + i].to_string(),
        });
        first += n;
        let mut reads: Vec<usize> = holes.iter().flatten().copied().collect();
        reads.sort_unstable();
        reads.dedup();
        // a 32-bit function (`Cuda::narrow_index`) splits `int` indices, which are below 2^31
        let divisors: Vec<usize> = match body.contains("long long rem") {
            true => Vec::new(),
            false => reads
                .iter()
                .copied()
                .filter(|&j| narrow[j] && body.contains(&format!("% s{j}; ")))
                .collect(),
        };
        let body = magic_splits(&body, &divisors);
        filled.push((body, reads, divisors));
    }
    let (kernel, defs) = filled.split_last()?;
    let locals = |reads: &mut dyn Iterator<Item = usize>| {
        let mut prologue = String::new();
        for j in reads {
            let t = if narrow[j] { "int" } else { "long long" };
            let _ = write!(prologue, "\n  const {t} s{j} = ({t})s{j}_arg;");
        }
        prologue
    };
    let helpers = |divisors: &[usize]| match divisors.is_empty() {
        true => "",
        false => DIVISION_HELPERS,
    };
    let mut device_fns = Vec::with_capacity(defs.len());
    let mut body = kernel.0.clone();
    for (i, (def, reads, divisors)) in defs.iter().enumerate() {
        let f = format!("KNAME_f{i}");
        let (params, args) = passed(reads, divisors);
        let def = with_params(def, &f, &params, &locals(&mut reads.iter().copied()))?;
        device_fns.push((f.clone(), format!("{}{def}", helpers(divisors))));
        body = with_call_args(&body, &format!("{f}("), &args)?;
    }
    // the kernel takes every parameter, and the magic numbers of every divisor of any text
    let mut divisors: Vec<usize> = filled.iter().flat_map(|f| f.2.iter().copied()).collect();
    divisors.sort_unstable();
    divisors.dedup();
    let all: Vec<usize> = (0..narrow.len()).collect();
    let (params, _) = passed(&all, &divisors);
    let body = with_params(&body, "KNAME", &params, &locals(&mut all.iter().copied()))?;
    let source = format!("{}{body}", helpers(&kernel.2));
    let mut hashed = source.clone();
    for (_, def) in &device_fns {
        hashed.push_str(def);
    }
    let name = format!("kl_{:016x}", xxhash_rust::xxh3::xxh3_64(hashed.as_bytes()));
    Some(Shared {
        source: source.replace("KNAME", &name),
        device_fns: device_fns
            .into_iter()
            .map(|(f, def)| (f.replace("KNAME", &name), def.replace("KNAME", &name)))
            .collect(),
        name,
        divisors,
    })
}

/// The parameters a function reading `reads` and dividing by `divisors` takes (`, const long
/// long s<j>_arg`..., then `, const long long s<j>_m, const long long s<j>_l`...) and the
/// arguments a call passes them with.
fn passed(reads: &[usize], divisors: &[usize]) -> (String, String) {
    let (mut params, mut args) = (String::new(), String::new());
    for j in reads {
        let _ = write!(params, ", const long long s{j}_arg");
        let _ = write!(args, ", s{j}_arg");
    }
    for j in divisors {
        let _ = write!(params, ", const long long s{j}_m, const long long s{j}_l");
        let _ = write!(args, ", s{j}_m, s{j}_l");
    }
    (params, args)
}

/// `body` with `args` after the last argument of every call that opens with `call` (`f(`);
/// arguments may hold parentheses (a sequential launch's casts). `None` if a call never closes.
fn with_call_args(body: &str, call: &str, args: &str) -> Option<String> {
    let mut out = String::with_capacity(body.len() + args.len() * 2);
    let mut rest = body;
    while let Some(at) = rest.find(call) {
        let inner = at + call.len();
        let mut depth = 1usize;
        let close = rest[inner..].char_indices().find_map(|(i, c)| {
            match c {
                '(' => depth += 1,
                ')' => depth -= 1,
                _ => {}
            }
            (depth == 0).then_some(inner + i)
        })?;
        out.push_str(&rest[..close]);
        out.push_str(args);
        rest = &rest[close..];
    }
    out.push_str(rest);
    Some(out)
}

/// Rewrites `resolved` (a static graph's kernels, in order) so that kernels of one text but for
/// some integer literals name one shared kernel, each with its values of those literals as its
/// size arguments — when the graph has `min_kernels` distinct single kernels or more
/// (`SHARE_FROM_KERNELS`). A launch of several members (horizontal or sequential) is one text
/// with its members' device functions: launches whose members differ only in literals (the
/// dense layers' batch-norm passes side by side, at each layer's channel count) share a
/// dispatcher and its device functions. Size-generic kernels and texts with fewer than
/// `MIN_MEMBERS` distinct members are left as they are.
pub(crate) fn share_literals(resolved: &mut [Resolved], min_kernels: usize) {
    let fixed_sizes = |r: &&Resolved| r.sizes.is_empty();
    let mut names: Vec<&str> = resolved
        .iter()
        .filter(fixed_sizes)
        .filter(|r| r.device_fns.is_empty())
        .map(|r| r.name.as_str())
        .collect();
    names.sort_unstable();
    names.dedup();
    if names.len() < min_kernels {
        return;
    }
    // (texts, literals that key the group) -> (member indices, each member's literals)
    type Key = (Vec<String>, Vec<i64>);
    let mut groups: HashMap<Key, Vec<(usize, Vec<i64>)>> = HashMap::new();
    for (i, r) in resolved.iter().enumerate().filter(|(_, r)| fixed_sizes(r)) {
        let Some(Split { texts, lits }) = split(r) else {
            continue;
        };
        let kinds: Vec<Hole> = texts.iter().flat_map(|t| holes(t)).collect();
        let lits: Vec<i64> = lits.concat();
        if kinds.len() != lits.len() {
            continue;
        }
        // the literals that key the group, each with its hole (a short loop's bound may be
        // keyed in one member and free in another: the positions keep them apart)
        let fixed: Vec<i64> = lits
            .iter()
            .zip(&kinds)
            .enumerate()
            .filter(|(_, (&v, &k))| {
                k == Hole::Constant || (k == Hole::LoopBound && v <= SMALL_LOOP)
            })
            .flat_map(|(h, (&v, _))| [h as i64, v])
            .collect();
        groups.entry((texts, fixed)).or_default().push((i, lits));
    }
    for ((texts, _), members) in groups {
        let mut distinct: Vec<&Vec<i64>> = members.iter().map(|(_, l)| l).collect();
        distinct.sort();
        distinct.dedup();
        if distinct.len() < MIN_MEMBERS {
            continue;
        }
        let first = &members[0].1;
        // one parameter per distinct column of values: holes that agree in every member (a
        // dim's extent as a loop bound, a divisor and a stride) are one value, so the compiler
        // still sees `rem % n` and `rem / n` share a divisor
        let mut columns: Vec<Vec<i64>> = Vec::new();
        let param: Vec<Option<usize>> = (0..first.len())
            .map(|h| {
                let col: Vec<i64> = members.iter().map(|(_, l)| l[h]).collect();
                if col.iter().all(|&v| v == first[h]) {
                    return None;
                }
                Some(match columns.iter().position(|c| *c == col) {
                    Some(j) => j,
                    None => {
                        columns.push(col);
                        columns.len() - 1
                    }
                })
            })
            .collect();
        let narrow: Vec<bool> = columns
            .iter()
            .map(|c| c.iter().all(|&v| i32::try_from(v).is_ok()))
            .collect();
        let Some(shared) = shared_kernel(&texts, first, &param, &narrow) else {
            continue;
        };
        // a launch's parameters stay within what every driver accepts
        let buffers = param_count(&resolved[members[0].0]);
        if buffers + columns.len() + 2 * shared.divisors.len() > MAX_KERNEL_PARAMS {
            continue;
        }
        let counter = match texts.len() {
            1 => &SHARED,
            _ => &SHARED_WITH_MEMBERS,
        };
        counter.fetch_add(members.len() as u64, Ordering::Relaxed);
        for (m, (i, _)) in members.iter().enumerate() {
            let mut sizes: Vec<i64> = columns.iter().map(|c| c[m]).collect();
            for &j in &shared.divisors {
                let (mul, shift) = magic(columns[j][m]);
                sizes.extend([mul, shift]);
            }
            resolved[*i] = Resolved {
                name: shared.name.clone(),
                source: shared.source.clone(),
                device_fns: shared.device_fns.clone(),
                sizes,
            };
        }
    }
}

/// How many parameters a kernel's `__global__` definition takes; 0 where its definition is
/// not found.
fn param_count(r: &Resolved) -> usize {
    param_list(&r.source, &r.name).map_or(0, |at| r.source[at].split(',').count())
}

#[cfg(test)]
mod tests {
    use kiln_compile::graph::Graph;
    use kiln_core::prim::{BinaryOp, UnaryOp};

    use super::*;
    use crate::codegen::cuda::Cuda;
    use crate::test_graphs::{binary, input, kernels, unary};

    /// exp(x) + y over [rows, cols] for each shape: kernels of one text but for the sizes.
    fn graph(shapes: &[[usize; 2]]) -> Graph {
        let mut g = Graph::default();
        for s in shapes {
            let x = input(&mut g, s);
            let y = input(&mut g, s);
            let e = unary(&mut g, UnaryOp::Exp, x);
            let o = binary(&mut g, BinaryOp::Add, e, y);
            g.outputs.push(o);
        }
        g
    }

    fn resolved(g: &Graph) -> Vec<Resolved> {
        let t = Cuda {
            horizontal: false,
            ..Cuda::new(132)
        };
        kernels(&t, g)
            .iter()
            .map(|(k, _)| Resolved::of(k))
            .collect()
    }

    /// Three sizes of one chain: one shared kernel, each member launched with its own sizes;
    /// filled with a member's values, the split text gives back that member's kernel exactly.
    #[test]
    fn kernels_differing_in_sizes_share_one_build() {
        let g = graph(&[[64, 96], [64, 160], [128, 96]]);
        let before = resolved(&g);
        assert_eq!(before.len(), 3);
        let mut after = before.clone();
        share_literals(&mut after, 0);
        assert!(after.iter().all(|r| r.name == after[0].name), "one build");
        assert!(after[0].name.starts_with("kl_"));
        assert!(after[0].source.contains("const long long s0_arg"));
        assert!(after[0].source.contains("const int s0 = (int)s0_arg;"));
        let sizes: Vec<&Vec<i64>> = after.iter().map(|r| &r.sizes).collect();
        assert!(sizes.iter().all(|s| !s.is_empty()));
        assert_ne!(sizes[0], sizes[1]);
        for b in &before {
            assert_eq!(filled_back(b), vec![b.source.clone()]);
        }
    }

    /// A kernel's texts (`split`) filled with its own literals, names given back: its device
    /// functions' definitions, then its own.
    fn filled_back(r: &Resolved) -> Vec<String> {
        let Some(Split { texts, lits }) = split(r) else {
            panic!("{} does not split", r.name);
        };
        texts
            .iter()
            .zip(&lits)
            .map(|(t, l)| {
                let mut back = fill(t, |i| l[i].to_string());
                for (i, (name, _)) in r.device_fns.iter().enumerate().rev() {
                    back = back.replace(&format!("KNAME_f{i}"), name);
                }
                back.replace("KNAME", &r.name)
            })
            .collect()
    }

    /// Stages of two chains side by side (`exp(x) + c` over [r, 96] and `tanh(y) * c` over
    /// [r, 160]), each at its own row count `r` and reading the stage before through `c`, the
    /// sum of its first output: a horizontal launch per stage.
    fn side_by_side(rows: &[usize]) -> Graph {
        let mut g = Graph::default();
        let mut c = input(&mut g, &[]);
        for &r in rows {
            let x = input(&mut g, &[r, 96]);
            let y = input(&mut g, &[r, 160]);
            let cx = crate::test_graphs::expand(&mut g, c, &[r, 96]);
            let cy = crate::test_graphs::expand(&mut g, c, &[r, 160]);
            let e = unary(&mut g, UnaryOp::Exp, x);
            let a = binary(&mut g, BinaryOp::Add, e, cx);
            let t = unary(&mut g, UnaryOp::Tanh, y);
            let b = binary(&mut g, BinaryOp::Mul, t, cy);
            g.outputs.extend([a, b]);
            c = crate::test_graphs::sum(&mut g, a, &[0, 1]);
        }
        g.outputs.push(c);
        g
    }

    /// Launches of several members whose texts differ only in literals share one dispatcher
    /// and its device functions, named after it; each launch passes its own sizes, and each
    /// original launch's texts are its split texts filled with its own literals.
    #[test]
    fn launches_of_members_differing_in_sizes_share_one_build() {
        let g = side_by_side(&[64, 128, 192, 256]);
        let before: Vec<Resolved> = kernels(&Cuda::new(132), &g)
            .iter()
            .map(|(k, _)| Resolved::of(k))
            .collect();
        let launches: Vec<&Resolved> = before.iter().filter(|r| r.device_fns.len() == 2).collect();
        assert!(launches.len() >= 3, "{}", before.len());
        let mut after = before.clone();
        let counted = shared_kernels().1;
        share_literals(&mut after, 0);
        assert!(shared_kernels().1 >= counted + 3);
        let shared: Vec<&Resolved> = after.iter().filter(|r| r.device_fns.len() == 2).collect();
        assert_eq!(shared.len(), launches.len());
        let name = &shared[1].name;
        assert!(name.starts_with("kl_"), "{name}");
        let mut sizes: Vec<&Vec<i64>> = Vec::new();
        for r in shared.iter().skip(1) {
            assert_eq!(&r.name, name, "one build");
            assert!(!r.sizes.is_empty());
            for (i, (f, def)) in r.device_fns.iter().enumerate() {
                assert_eq!(f, &format!("{name}_f{i}"));
                assert!(def.contains(&format!("void {f}(")), "{def}");
                assert!(def.contains("_arg"), "{def}");
                // the dispatcher passes the device function its parameters
                assert!(r.source.contains(&format!("{f}(")), "{}", r.source);
            }
            sizes.push(&r.sizes);
        }
        sizes.dedup();
        assert!(sizes.len() >= 2, "{sizes:?}");
        for r in &launches {
            let mut originals = vec![];
            originals.extend(r.device_fns.iter().map(|(_, d)| d.clone()));
            originals.push(r.source.clone());
            assert_eq!(filled_back(r), originals);
        }
    }

    /// The magic numbers divide exactly: every divisor to 5000 and some large ones, at the
    /// dividends around each multiple and at random ones below 2^31.
    #[test]
    fn magic_numbers_divide_every_31_bit_index_exactly() {
        let mut seed = 0x9e3779b97f4a7c15u64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % (1 << 31)) as i64
        };
        let divisors = (1..=5000).chain([6272, 50176, 100352, 1 << 20, (1 << 31) - 1]);
        for d in divisors {
            let mg = magic(d);
            assert!(mg.0 > 0 && mg.0 < (1 << 33), "{d}: {mg:?}");
            let mut xs = vec![0, 1, (1 << 31) - 1, (1 << 31) - 2];
            for q in [1, 2, 3, 1000, ((1i64 << 31) - 1) / d] {
                xs.extend([q * d - 1, q * d, q * d + 1]);
            }
            xs.extend((0..200).map(|_| next()));
            for x in xs.into_iter().filter(|&x| (0..1 << 31).contains(&x)) {
                assert_eq!(quotient(x, mg), x / d, "{x} / {d}");
            }
        }
    }

    /// A 32-bit kernel's flat-index splits by a shared size read the magic numbers, passed
    /// after the sizes.
    #[test]
    fn shared_divisors_split_indices_through_magic_numbers() {
        let g = graph(&[[64, 96], [64, 160], [128, 96]]);
        let mut after = resolved(&g);
        share_literals(&mut after, 0);
        let src = &after[0].source;
        assert!(src.contains("kiln_rem(rem, s"), "{src}");
        assert!(!src.contains("rem % s"), "{src}");
        let cols = src.matches("_arg,").count() + src.matches("_arg)").count();
        let magics = src.matches("_m, const long long").count();
        assert_eq!(after[0].sizes.len(), cols + 2 * magics, "{src}");
    }

    /// A graph with fewer distinct kernels than the threshold keeps its kernels.
    #[test]
    fn small_graphs_keep_their_kernels() {
        let g = graph(&[[64, 96], [64, 160], [128, 96]]);
        let before = resolved(&g);
        let mut after = before.clone();
        share_literals(&mut after, SHARE_FROM_KERNELS);
        assert!(after.iter().zip(&before).all(|(a, b)| a.name == b.name));
    }

    /// One size alone, or the same size twice (one kernel already), is left as it is.
    #[test]
    fn a_text_of_one_member_keeps_its_kernel() {
        let g = graph(&[[64, 96], [64, 96]]);
        let before = resolved(&g);
        let mut after = before.clone();
        share_literals(&mut after, 0);
        for (a, b) in after.iter().zip(&before) {
            assert_eq!(a.name, b.name);
            assert!(a.sizes.is_empty());
        }
    }

    /// Literals C needs as constants are never parameters: a `__shared__` array's length and
    /// launch bounds key the group; a loop's bound does when the loop is short.
    #[test]
    fn constant_contexts_are_not_holes_that_vary() {
        let text = format!(
            "__global__ void __launch_bounds__({HOLE}) KNAME(float *b0) {{\n  __shared__ double p[{HOLE}];\n  for (int i = {HOLE}; i < {HOLE}; i++) {{}}\n}}"
        );
        assert_eq!(
            holes(&text),
            vec![Hole::Constant, Hole::Constant, Hole::Free, Hole::LoopBound]
        );
    }
}
