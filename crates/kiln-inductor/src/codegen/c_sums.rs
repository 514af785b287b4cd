//! Float sums in the eager kernel's order (`prim::SUM_LANES`, `prim::SUM_CHUNKED_FROM`), as C:
//! lane arrays filled in one walk over the operands and folded in halves, and a single long
//! sum in chunks on OpenMP threads. Squared deviations (`ReduceOp::SumSqDev`) walk the same
//! lanes with Welford's moments in each, and in tail lanes for the runs' tails
//! (`prim::SqDevState`'s order), merged in halves by Chan's formula. Generated results equal eager ones bit for bit (ARCHITECTURE.md
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
    text.push_str("  {\n");
    for (name, a) in sums {
        declare(text, name, a);
    }
    loops(text, outer, Threads::One);
    text.push_str("  {\n");
    lane_loops(text, (d, body), sums, "0", &n.to_string());
    text.push_str("  }\n");
    for (k, (name, a)) in sums.iter().enumerate() {
        fold_lanes(text, name, a);
        text.push_str(&store(k, &format!("{name}[0]")));
    }
    text.push_str("  }\n");
}

/// The state of the accumulator `name`: a sum's lane array; for squared deviations Welford's
/// lanes (`{name}_m` means, `{name}` squared deviations, `{name}_g` the full groups each lane
/// has seen) and tail lanes (`{name}_tn` counts, `_tm`, `_tq`; `{name}_tr` the tails each tail
/// lane in use has seen): `prim::SqDevState`'s order.
fn declare(text: &mut String, name: &str, a: &Accumulator) {
    let l = SUM_LANES;
    let arrays = match a.sqdev {
        true => ["_m", "", "_tn", "_tm", "_tq"]
            .iter()
            .map(|s| format!("{name}{s}"))
            .collect(),
        false => vec![name.to_string()],
    };
    for array in arrays {
        let _ = writeln!(
            text,
            "  {} {array}[{l}];\n  for (int64_t l = 0; l < {l}; l++) {array}[l] = {};",
            a.acc_t, a.init
        );
    }
    if a.sqdev {
        let _ = writeln!(text, "  double {name}_g = 0.0, {name}_tr = 0.0;");
    }
}

/// The statements adding the value `a.value` to lane `l` of the accumulator `name`, in a full
/// group (`full`) or a run's tail: the sum's step into the lane either way; for squared
/// deviations Welford's update (`prim::SqDevState::push`, the same operations in the same
/// order) with the reciprocal of the count every lane (tail lane) in use shares, `{name}_inv`
/// (`{name}_tinv`).
fn lane_add(name: &str, a: &Accumulator, full: bool) -> String {
    let v = &a.value;
    if !a.sqdev {
        return format!("    {name}[l] = {};\n", (a.step)(&format!("{name}[l]"), v));
    }
    let (m, q, inv, count) = match full {
        true => (
            format!("{name}_m"),
            name.to_string(),
            format!("{name}_inv"),
            String::new(),
        ),
        false => (
            format!("{name}_tm"),
            format!("{name}_tq"),
            format!("{name}_tinv"),
            format!("    {name}_tn[l] = {name}_tr;\n"),
        ),
    };
    format!(
        "    {{\n    const double x_ = (double){v};\n{count}    const double d_ = x_ - {m}[l];\n    \
         {m}[l] = {m}[l] + d_ * {inv};\n    {q}[l] = {q}[l] + d_ * (x_ - {m}[l]);\n    }}\n"
    )
}

/// The lane loops of `prim::SUM_LANES`'s order over the innermost reduced dim `d`, from `start`
/// to `end` (C expressions): `body` computes each accumulator's value at `i{d} = c + l`, added to
/// its lane `l` (one walk over the operands for all of them, `lane_sums`). The lanes are
/// independent, so the loop over a full group of lanes is vectorized as it stands (no
/// reassociation); the group's body is written twice, for full groups then the tail.
fn lane_loops(
    text: &mut String,
    (d, body): (usize, &str),
    accs: &[(&str, &Accumulator)],
    start: &str,
    end: &str,
) {
    let l = SUM_LANES;
    let lane = |full: bool| {
        let adds: String = accs
            .iter()
            .map(|(name, a)| lane_add(name, a, full))
            .collect();
        format!("    const int64_t i{d} = c + l;\n{body}{adds}")
    };
    // Welford's lanes have each seen one more value: one reciprocal for the group; the tail
    // lanes in use one more each when the run has a tail
    let sqdev = || accs.iter().filter(|(_, a)| a.sqdev).map(|(name, _)| name);
    let group: String = sqdev()
        .map(|name| {
            format!("  {name}_g = {name}_g + 1.0;\n  const double {name}_inv = 1.0 / {name}_g;\n")
        })
        .collect();
    let tail: String = sqdev()
        .map(|name| {
            format!(
                "  double {name}_tinv = 0.0;\n  if (c < {end}) {{ {name}_tr = {name}_tr + 1.0; \
                 {name}_tinv = 1.0 / {name}_tr; }}\n"
            )
        })
        .collect();
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
            "  for (; c + {l} <= {end}; c += {l}) {{\n{group}  #pragma omp simd\n  for (int64_t l = \
             0; l < {l}; l++)\n  {{\n{}  }}\n  }}",
            lane(true)
        );
    }
    let _ = writeln!(
        text,
        "{tail}  for (int64_t l = 0; c + l < {end}; l++)\n  {{\n{}  }}",
        lane(false)
    );
}

/// The function folding a `double` lane array of a sum in halves into its element 0
/// (`fold_sum_definition`), which a unit defines once for all its kernels' sums.
pub(crate) const FOLD_SUM: &str = "kiln_fold_sum";

/// The function folding Welford's lane arrays in halves into their elements 0
/// (`fold_sqdev_definition`), defined once per unit like `FOLD_SUM`.
pub(crate) const FOLD_SQDEV: &str = "kiln_fold_sqdev";

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

/// `FOLD_SQDEV`'s definition, and the merge of two parts' moments it and the chunked order use
/// (`kiln_merge_sqdev`: `prim::SqDevState::merge`, the same operations in the same order). The
/// fold merges the lanes (each `*g` values) in halves, the tail lanes (`tn`, `tm`, `tq`) in
/// halves, then the tail lanes' result into the lanes', leaving the count in `*g`, the mean in
/// `m[0]` and the squared deviations in `q[0]`.
pub(crate) fn fold_sqdev_definition() -> String {
    let l = SUM_LANES;
    format!(
        "__attribute__((unused)) static inline void kiln_merge_sqdev(double *n, double *m, \
         double *q, double bn, double bm, double bq) {{\n  if (bn == 0.0) return;\n  if (*n == \
         0.0) {{ *n = bn; *m = bm; *q = bq; return; }}\n  const double count = *n + bn;\n  \
         const double d = bm - *m;\n  const double mean = *m + d * (bn / count);\n  const \
         double m2 = *q + bq + d * d * (*n * bn / count);\n  *n = count; *m = mean; *q = m2;\n\
         }}\n__attribute__((noinline, unused)) static void {FOLD_SQDEV}(double *g, double *m, \
         double *q, double *tn, double *tm, double *tq) {{\n  double n[{l}];\n  for (int64_t l \
         = 0; l < {l}; l++) n[l] = *g;\n  for (int64_t h = {h}; h > 0; h /= 2)\n    for (int64_t \
         l = 0; l < h; l++) {{\n      kiln_merge_sqdev(&n[l], &m[l], &q[l], n[l + h], m[l + h], \
         q[l + h]);\n      kiln_merge_sqdev(&tn[l], &tm[l], &tq[l], tn[l + h], tm[l + h], tq[l + \
         h]);\n    }}\n  kiln_merge_sqdev(&n[0], &m[0], &q[0], tn[0], tm[0], tq[0]);\n  *g = \
         n[0];\n}}\n",
        h = l / 2
    )
}

/// The lanes of the accumulator `name` folded in halves into element 0: through `FOLD_SUM` for
/// a sum (the same adds in the same order), `FOLD_SQDEV` for squared deviations, in place
/// otherwise.
fn fold_lanes(text: &mut String, name: &str, a: &Accumulator) {
    if a.sqdev {
        let _ = writeln!(
            text,
            "  {FOLD_SQDEV}(&{name}_g, {name}_m, {name}, {name}_tn, {name}_tm, {name}_tq);"
        );
        return;
    }
    let fold = (a.step)(&format!("{name}[l]"), &format!("{name}[l + h]"));
    if fold == format!("{name}[l] + (double){name}[l + h]") {
        let _ = writeln!(text, "  {FOLD_SUM}({name});");
        return;
    }
    let _ = writeln!(text, "  for (int64_t h = {}; h > 0; h /= 2)", SUM_LANES / 2);
    let _ = writeln!(
        text,
        "    for (int64_t l = 0; l < h; l++) {name}[l] = {fold};"
    );
}

/// A single long float sum (or squared deviations) in `prim::SUM_CHUNKED_FROM`'s chunked order
/// (the eager kernel's): the chunks lane-summed on OpenMP threads into partials arrays, then
/// added (merged) in order into `total`. `(d, n)`: the innermost reduced dim (the runs); `outer`:
/// the other reduced dims, flattened into a run index. Opens a block the caller closes after
/// storing `total`.
pub(super) fn chunked_sum(
    text: &mut String,
    (body, acc): (&str, &Accumulator),
    (d, n): (usize, usize),
    outer: &[(usize, usize)],
) {
    let chunk = SUM_CHUNK;
    let runs: usize = outer.iter().map(|o| o.1).product();
    // whole runs per chunk, or pieces per run
    let (per, pieces) = if n <= chunk {
        (chunk / n.max(1), 1)
    } else {
        (1, n.div_ceil(chunk))
    };
    let chunks = runs.div_ceil(per) * pieces;
    // a chunk's result: its sum, or its count, mean and squared deviations
    let results = match acc.sqdev {
        true => vec!["acc_g", "acc_m[0]", "acc[0]"],
        false => vec!["acc[0]"],
    };
    let _ = writeln!(text, "  {{");
    for (k, _) in results.iter().enumerate() {
        let _ = writeln!(
            text,
            "  double *part{k} = (double *)malloc({chunks} * sizeof(double));"
        );
    }
    let _ = writeln!(
        text,
        "  #pragma omp parallel for schedule(static)\n  for (int64_t ch = 0; ch < {chunks}; ch++) \
         {{"
    );
    declare(text, "acc", acc);
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
    lane_loops(text, (d, body), &[("acc", acc)], end.0, &end.1);
    let _ = writeln!(text, "  }}");
    fold_lanes(text, "acc", acc);
    for (k, r) in results.iter().enumerate() {
        let _ = writeln!(text, "  part{k}[ch] = {r};");
    }
    let _ = writeln!(text, "  }}");
    if acc.sqdev {
        let _ = writeln!(
            text,
            "  double total_n = 0.0, total_m = 0.0, total = 0.0;\n  for (int64_t ch = 0; ch < \
             {chunks}; ch++) kiln_merge_sqdev(&total_n, &total_m, &total, part0[ch], part1[ch], \
             part2[ch]);"
        );
    } else {
        let _ = writeln!(
            text,
            "  double total = 0.0;\n  for (int64_t ch = 0; ch < {chunks}; ch++) total += \
             part0[ch];"
        );
    }
    for (k, _) in results.iter().enumerate() {
        let _ = writeln!(text, "  free(part{k});");
    }
}
