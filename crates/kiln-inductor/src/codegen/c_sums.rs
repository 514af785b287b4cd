//! Float sums in the eager kernel's order (`prim::SUM_LANES`, `prim::SUM_CHUNKED_FROM`), as C:
//! lane arrays filled in one walk over the operands and folded in halves, and a single long
//! sum in chunks on OpenMP threads. Generated sums equal eager ones bit for bit (ARCHITECTURE.md
//! invariant 2); reduction, row (`c_rows.rs`) and sibling (`c_siblings.rs`) kernels use them.

use std::fmt::Write;

use kiln_core::prim::{SUM_CHUNK, SUM_LANES};

use super::c::{loops, one_size, split_index, Accumulator};
use super::c_horizontal::Threads;

/// Sums in `prim::SUM_LANES`'s order, in one walk: over the reduced loops `outer`, then the
/// innermost reduced dim `d` of extent `n`, whose element k of each run goes into lane k % L of
/// each sum's lane array (`sums`: its C name and accumulator), the lanes then folded in halves
/// and `store(k, folded)` written for sum k. The order of the eager kernel, so generated sums
/// equal eager ones bit for bit. Integer literals are only n and L, so a size-generic kernel
/// fits n like any loop bound. A reduction kernel has one sum, a row kernel one per reduction,
/// a sibling kernel several (`codegen/c_siblings.rs`).
pub(crate) fn lane_sums(
    text: &mut String,
    (outer, (d, n)): (&[(usize, usize)], (usize, usize)),
    body: &str,
    sums: &[(&str, &Accumulator)],
    store: impl Fn(usize, &str) -> String,
) {
    let l = SUM_LANES;
    text.push_str("  {\n");
    for (name, a) in sums {
        let _ = writeln!(text, "  {} {name}[{l}];", a.acc_t);
        let _ = writeln!(
            text,
            "  for (int64_t l = 0; l < {l}; l++) {name}[l] = {};",
            a.init
        );
    }
    loops(text, outer, Threads::One);
    text.push_str("  {\n");
    let adds: Vec<LaneAdd<'_>> = sums
        .iter()
        .map(|(name, a)| (*name, a.value.as_str(), a.step))
        .collect();
    lane_loops(text, (d, body), &adds, "0", &n.to_string());
    text.push_str("  }\n");
    for (k, (name, a)) in sums.iter().enumerate() {
        fold_lanes(text, name, a.step);
        text.push_str(&store(k, &format!("{name}[0]")));
    }
    text.push_str("  }\n");
}

/// One lane array a lane loop adds to: its C name, the value added, and how (`acc = step(acc, v)`).
type LaneAdd<'a> = (&'a str, &'a str, fn(&str, &str) -> String);

/// The lane loops of `prim::SUM_LANES`'s order over the innermost reduced dim `d`, from `start`
/// to `end` (C expressions): `body` computes each lane array's value at `i{d} = c + l`, added to
/// its lane `l` (one walk over the operands for all of them, `lane_sums`). The lanes are
/// independent, so the loop over a full group of lanes is vectorized as it stands (no
/// reassociation); the group's body is written twice, for full groups then the tail.
fn lane_loops(
    text: &mut String,
    (d, body): (usize, &str),
    accs: &[LaneAdd<'_>],
    start: &str,
    end: &str,
) {
    let l = SUM_LANES;
    let adds: String = accs
        .iter()
        .map(|(acc, value, step)| {
            let add = step(&format!("{acc}[l]"), value);
            format!("    {acc}[l] = {add};\n")
        })
        .collect();
    let lane = format!("    const int64_t i{d} = c + l;\n{body}{adds}");
    let _ = writeln!(text, "  int64_t c = {start};");
    // a run known to be shorter than a group has no full group: the vector loop would be dead
    // code that the C compiler still optimizes. Not for one size of a symbolic graph, whose
    // kernels must read alike at every size to become one size-generic kernel
    let short = match (start.parse::<usize>(), end.parse::<usize>()) {
        (Ok(a), Ok(b)) => b.saturating_sub(a) < l && one_size(),
        _ => false,
    };
    if !short {
        let _ = writeln!(
            text,
            "  for (; c + {l} <= {end}; c += {l}) {{\n  #pragma omp simd\n  for (int64_t l = 0; \
             l < {l}; l++)\n  {{\n{lane}  }}\n  }}"
        );
    }
    let _ = writeln!(
        text,
        "  for (int64_t l = 0; c + l < {end}; l++)\n  {{\n{lane}  }}"
    );
}

/// The function folding a `double` lane array of a sum in halves into its element 0
/// (`fold_sum_definition`), which a unit defines once for all its kernels' sums.
pub(crate) const FOLD_SUM: &str = "kiln_fold_sum";

/// `FOLD_SUM`'s definition: the fold `fold_lanes` writes for a sum, as a function of its own.
/// Not inlined: a unit of many small sums (a model's bias gradients, eight to a kernel) compiled
/// a fold loop per sum, a fifth of its build.
pub(crate) fn fold_sum_definition() -> String {
    format!(
        "__attribute__((noinline, unused)) static void {FOLD_SUM}(double *acc) {{\n  for \
         (int64_t h = {}; h > 0; h /= 2)\n    for (int64_t l = 0; l < h; l++) acc[l] = acc[l] + \
         acc[l + h];\n}}\n",
        SUM_LANES / 2
    )
}

/// The lanes of the array `acc` folded in halves into `acc[0]`: through `FOLD_SUM` for a sum
/// (the same adds in the same order), in place otherwise.
fn fold_lanes(text: &mut String, acc: &str, step: fn(&str, &str) -> String) {
    let fold = step(&format!("{acc}[l]"), &format!("{acc}[l + h]"));
    if fold == format!("{acc}[l] + (double){acc}[l + h]") {
        let _ = writeln!(text, "  {FOLD_SUM}({acc});");
        return;
    }
    let _ = writeln!(text, "  for (int64_t h = {}; h > 0; h /= 2)", SUM_LANES / 2);
    let _ = writeln!(
        text,
        "    for (int64_t l = 0; l < h; l++) {acc}[l] = {fold};"
    );
}

/// A single long float sum in `prim::SUM_CHUNKED_FROM`'s chunked order (the eager kernel's):
/// the chunks lane-summed on OpenMP threads into a partials array, then added in order into
/// `total`. `(d, n)`: the innermost reduced dim (the runs); `outer`: the other reduced dims,
/// flattened into a run index. Opens a block the caller closes after storing `total`.
pub(super) fn chunked_sum(
    text: &mut String,
    (body, value): (&str, &str),
    acc_t: &str,
    (d, n): (usize, usize),
    outer: &[(usize, usize)],
    step: fn(&str, &str) -> String,
) {
    let (l, chunk) = (SUM_LANES, SUM_CHUNK);
    let runs: usize = outer.iter().map(|o| o.1).product();
    // whole runs per chunk, or pieces per run
    let (per, pieces) = if n <= chunk {
        (chunk / n.max(1), 1)
    } else {
        (1, n.div_ceil(chunk))
    };
    let chunks = runs.div_ceil(per) * pieces;
    let _ = writeln!(
        text,
        "  {{\n  double *part = (double *)malloc({chunks} * sizeof(double));\n  #pragma omp \
         parallel for schedule(static)\n  for (int64_t ch = 0; ch < {chunks}; ch++) {{\n  {acc_t} \
         acc[{l}];\n  for (int64_t l = 0; l < {l}; l++) acc[l] = 0.0;"
    );
    let end = if pieces == 1 {
        let _ = writeln!(
            text,
            "  const int64_t first = ch * {per}, last = first + {per} < {runs} ? first + {per} : \
             {runs};\n  for (int64_t r = first; r < last; r++) {{"
        );
        ("0", n.to_string())
    } else {
        let _ = writeln!(
            text,
            "  {{\n  const int64_t r = ch / {pieces}, start = (ch % {pieces}) * {chunk};\n  const \
             int64_t end = start + {chunk} < {n} ? start + {chunk} : {n};"
        );
        ("start", "end".to_string())
    };
    // the run index as the outer reduced dims' indices
    if !outer.is_empty() {
        split_index(text, "r", outer, "  ", "rem");
    }
    lane_loops(text, (d, body), &[("acc", value, step)], end.0, &end.1);
    let _ = writeln!(text, "  }}");
    fold_lanes(text, "acc", step);
    let _ = writeln!(
        text,
        "  part[ch] = acc[0];\n  }}\n  double total = 0.0;\n  for (int64_t ch = 0; ch < \
         {chunks}; ch++) total += part[ch];\n  free(part);"
    );
}
