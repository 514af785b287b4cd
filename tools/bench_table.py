#!/usr/bin/env python3
"""kiln vs PyTorch vs JAX side by side: reads the JSON lines of kiln-bench, torch_baseline.py and
jax_baseline.py, pairs kiln's rows with torch's by (workload, variant, metric), and writes a markdown
table with the ratios kiln/torch (same variant) and kiln/torch-best (torch's best variant for that
workload and metric), plus JAX's best for the same workload and metric.

    python3 tools/bench_table.py OUT/bench.jsonl              (lines tagged "source", as bench_all.sh writes)
    python3 tools/bench_table.py --kiln k.jsonl --torch ../shared/bench/torch-*.jsonl --jax ../shared/bench/jax-*.jsonl
    python3 tools/bench_table.py ... --write-benchmarks BENCHMARKS.md   (replaces the marked section)
    python3 tools/bench_table.py --self-test

Rows shown: a (variant, metric) of a workload when torch or JAX reports that metric for that
workload (cold_compile, call, train_step, step, ...), or, for a workload they lack, for any. "torch best" is torch's best variant of that
workload and metric (variants with a size suffix, `eager_64M`, are compared among themselves);
`--all` adds kiln's other rows (counts,
differences from eager) in a second table. A key measured several times (the eager rows come
with every mode's kiln-bench run) shows the median. Times are converted to kiln's unit. For times
a ratio below 1 means kiln is faster; for rates (GB/s, TFLOP/s) above 1.
"""
import argparse
import datetime
import json
import os
import re
import statistics
import sys
import tempfile

TIME = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
RATE = {"GB/s": 1e9, "TB/s": 1e12, "GFLOP/s": 1e9, "TFLOP/s": 1e12}
SOURCES = ("kiln", "torch", "jax")
BEGIN, END = "<!-- bench_all:begin -->", "<!-- bench_all:end -->"
TITLE = "## All GPU workloads: kiln vs PyTorch vs JAX in one run (issue 8: kiln's Inductor on the GPU)"


def convert(value, unit, to_unit):
    """`value` in `unit` expressed in `to_unit`; None when the units do not convert."""
    if unit == to_unit:
        return value
    for table in (TIME, RATE):
        if unit in table and to_unit in table:
            return value * table[unit] / table[to_unit]
    return None


def better(unit):
    """min for times, max for rates, None when a unit has no better direction (counts, bytes)."""
    if unit in TIME:
        return min
    if unit in RATE:
        return max
    return None


def load(path, source=None):
    """(rows, meta, errors) of one JSON-lines file. A line's own "source" wins over `source`."""
    rows, meta, errors = [], [], []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                d = json.loads(line)
            except ValueError:
                print(f"bench_table: {path}:{n}: not JSON, skipped", file=sys.stderr)
                continue
            src = d.pop("source", source)
            if src not in SOURCES and src != "meta":
                print(f"bench_table: {path}:{n}: no source (pass the file with --kiln/--torch/--jax)",
                      file=sys.stderr)
                continue
            if "error" in d:
                errors.append((src, d.get("workload", "?"), str(d["error"])))
            elif all(k in d for k in ("workload", "variant", "metric", "value", "unit")):
                if d["value"] is None:
                    continue
                rows.append(dict(source=src, workload=d["workload"], variant=d["variant"],
                                 metric=d["metric"], value=float(d["value"]), unit=d["unit"]))
            else:
                d.pop("mode_run", None)
                meta.append((src, d))
    return rows, meta, errors


def combine(rows):
    """{(source, workload, variant, metric): (median value, unit)}, in first-appearance order."""
    vals, units = {}, {}
    for r in rows:
        key = (r["source"], r["workload"], r["variant"], r["metric"])
        vals.setdefault(key, []).append(r["value"])
        units.setdefault(key, r["unit"])
    return {k: (statistics.median(v), units[k]) for k, v in vals.items()}


def size_group(variant):
    """A variant's problem size (`eager_64M`, `copy_64M_new_buffer` → `64M`), '' for none: a best-of
    compares variants of one size only."""
    m = re.search(r"(?:^|_)(\d+[KMG])(?:_|$)", variant)
    return m.group(1) if m else ""


def best_of(cells, source, workload, variant, metric, unit):
    """(value in `unit`, variant) of `source`'s best variant for workload/metric among the variants
    of `variant`'s size group, or None."""
    pick = better(unit)
    if pick is None:
        return None
    found = []
    for (s, w, v, m), (val, u) in cells.items():
        if (s, w, m) == (source, workload, metric) and size_group(v) == size_group(variant):
            c = convert(val, u, unit)
            if c is not None:
                found.append((c, v))
    if not found:
        return None
    return pick(found, key=lambda t: t[0])


def build(rows, include_all=False):
    """The table as records: (comparable, kiln_only). Each record: workload, variant, metric, unit,
    kiln, torch, ratio, torch_best (value, variant), ratio_best, jax_best (value, variant)."""
    cells = combine(rows)
    compared = {(w, m) for (s, w, _, m) in cells if s in ("torch", "jax")}
    # a workload the baselines lack (all-MiniLM-L6-v2) shows the metrics they report elsewhere
    covered = {w for (w, _) in compared}
    headline = {m for (_, m) in compared}
    order = []
    for (s, w, v, m) in cells:
        if s in ("kiln", "torch") and (w, v, m) not in order:
            order.append((w, v, m))
    # workloads grouped, in the order they first appear
    wl = []
    for w, _, _ in order:
        if w not in wl:
            wl.append(w)
    order.sort(key=lambda k: wl.index(k[0]))
    comparable, kiln_only = [], []
    for w, v, m in order:
        k = cells.get(("kiln", w, v, m))
        t = cells.get(("torch", w, v, m))
        unit = (k or t)[1]
        rec = dict(workload=w, variant=v, metric=m, unit=unit,
                   kiln=k[0] if k else None, torch=None, ratio=None,
                   torch_best=None, ratio_best=None, jax_best=None)
        if t is not None:
            rec["torch"] = convert(t[0], t[1], unit)
        if rec["kiln"] is not None and rec["torch"]:
            rec["ratio"] = rec["kiln"] / rec["torch"]
        rec["torch_best"] = best_of(cells, "torch", w, v, m, unit)
        rec["jax_best"] = best_of(cells, "jax", w, v, m, unit)
        if rec["kiln"] is not None and rec["torch_best"] and rec["torch_best"][0]:
            rec["ratio_best"] = rec["kiln"] / rec["torch_best"][0]
        if (w, m) in compared or (w not in covered and m in headline):
            comparable.append(rec)
        elif include_all and k is not None:
            kiln_only.append(rec)
    return comparable, kiln_only


def fmt(x):
    if x is None:
        return "—"
    a = abs(x)
    if a != 0 and (a < 0.01 or a >= 1e6):
        return f"{x:.3g}"
    if a >= 100:
        return f"{x:.1f}"
    return f"{x:.4g}" if a < 1 else f"{x:.3f}".rstrip("0").rstrip(".")


def fmt_best(b):
    return "—" if b is None else f"{fmt(b[0])} ({b[1]})"


def render(comparable, kiln_only, meta, errors):
    out = []
    seen = set()
    for src, d in meta:
        s = ", ".join(f"{k} {v}" for k, v in d.items())
        if s and (src, s) not in seen:
            seen.add((src, s))
            out.append(f"- {src}: {s}")
    if out:
        out.append("")
    out.append("| workload | variant | metric | unit | kiln | torch | kiln/torch | torch best | kiln/torch best | JAX best |")
    out.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in comparable:
        out.append("| " + " | ".join([r["workload"], r["variant"], r["metric"], r["unit"], fmt(r["kiln"]),
                                      fmt(r["torch"]), fmt(r["ratio"]), fmt_best(r["torch_best"]),
                                      fmt(r["ratio_best"]), fmt_best(r["jax_best"])]) + " |")
    if kiln_only:
        out += ["", "kiln's other rows:", "", "| workload | variant | metric | value | unit |", "|---|---|---|---|---|"]
        for r in kiln_only:
            out.append(f"| {r['workload']} | {r['variant']} | {r['metric']} | {fmt(r['kiln'])} | {r['unit']} |")
    if errors:
        out += ["", "Errors:", ""]
        out += [f"- {s} `{w}`: {e}" for s, w, e in errors]
    return "\n".join(out) + "\n"


def write_section(path, body, title=TITLE):
    """Puts `body` between the markers in `path` (replacing what was there), or appends a new
    section with `title` and the markers."""
    text = open(path).read() if os.path.exists(path) else ""
    block = f"{BEGIN}\n{body}{END}"
    if BEGIN in text and END in text and text.index(BEGIN) < text.index(END):
        a, b = text.index(BEGIN), text.index(END) + len(END)
        text = text[:a] + block + text[b:]
    else:
        date = datetime.date.today().isoformat()
        text = text.rstrip("\n") + f"\n\n{title}\n\n{date}; `bash tools/bench_all.sh` on the GPU machine, " \
            f"then `python3 tools/bench_table.py`.\n\n{block}\n"
    with open(path, "w") as f:
        f.write(text)


def self_test():
    """Checks pairing, medians, unit conversion, best-of and ratios against values recomputed here
    from the inputs, then pairs a fake kiln file (torch's rows, values doubled) with the shared
    torch file when it is there."""
    def row(src, w, v, m, val, unit):
        return dict(source=src, workload=w, variant=v, metric=m, value=val, unit=unit)

    rows = [
        row("kiln", "toy", "eager", "call", 2.0, "ms"),
        row("kiln", "toy", "eager", "call", 4.0, "ms"),  # a second run: the median counts
        row("kiln", "toy", "default", "call", 1.5, "ms"),
        row("kiln", "toy", "default", "cold_compile", 3.0, "s"),
        row("kiln", "toy", "default", "max_abs_diff_vs_eager", 1e-6, "abs"),
        row("kiln", "toy", "default", "bandwidth", 500.0, "GB/s"),
        row("torch", "toy", "eager", "call", 2500.0, "us"),  # another unit
        row("torch", "toy", "default", "call", 1.2, "ms"),
        row("torch", "toy", "reduce-overhead", "call", 0.8, "ms"),
        row("torch", "toy", "default", "cold_compile", 6.0, "s"),
        row("torch", "toy", "default", "bandwidth", 1.0, "TB/s"),
        row("jax", "toy", "jit", "call", 900.0, "us"),
        row("torch", "other", "eager", "call", 7.0, "ms"),  # no kiln row: still listed
        row("kiln", "solo", "default", "call", 5.0, "ms"),  # a workload torch lacks: headline metrics
        row("kiln", "solo", "default", "graph_breaks", 0.0, "count"),
        row("kiln", "toy", "default_64M", "call", 9.0, "ms"),  # another size: its own best
        row("torch", "toy", "eager_64M", "call", 12.0, "ms"),
        row("torch", "toy", "default_64M", "call", 6.0, "ms"),
    ]
    comparable, kiln_only = build(rows, include_all=True)
    by = {(r["workload"], r["variant"], r["metric"]): r for r in comparable}
    close = lambda a, b: a is not None and b is not None and abs(a - b) <= 1e-12 * max(1.0, abs(b))

    eager = by[("toy", "eager", "call")]
    assert close(eager["kiln"], statistics.median([2.0, 4.0])), eager
    assert close(eager["torch"], 2500.0 * 1e-6 / 1e-3), eager
    assert close(eager["ratio"], eager["kiln"] / eager["torch"]), eager
    torch_calls = {"eager": 2.5, "default": 1.2, "reduce-overhead": 0.8}
    best_v = min(torch_calls, key=torch_calls.get)
    assert eager["torch_best"][1] == best_v and close(eager["torch_best"][0], torch_calls[best_v]), eager
    assert close(eager["ratio_best"], eager["kiln"] / torch_calls[best_v]), eager
    assert eager["jax_best"][1] == "jit" and close(eager["jax_best"][0], 0.9), eager
    d = by[("toy", "default", "call")]
    assert close(d["ratio"], 1.5 / 1.2) and close(d["ratio_best"], 1.5 / 0.8), d
    bw = by[("toy", "default", "bandwidth")]  # a rate: higher is better, TB/s → GB/s
    assert close(bw["torch"], 1000.0) and close(bw["ratio"], 0.5), bw
    ro = by[("toy", "reduce-overhead", "call")]  # torch only
    assert ro["kiln"] is None and ro["ratio"] is None and close(ro["torch"], 0.8), ro
    assert ("other", "eager", "call") in by
    assert size_group("copy_64M_new_buffer") == "64M" and size_group("matmul_bfloat16_tf32=False") == ""
    big = by[("toy", "default_64M", "call")]
    assert big["torch_best"] == (6.0, "default_64M") and close(big["ratio_best"], 9.0 / 6.0), big
    assert [(r["workload"], r["metric"]) for r in kiln_only] == \
        [("toy", "max_abs_diff_vs_eager"), ("solo", "graph_breaks")], kiln_only
    solo = by[("solo", "default", "call")]
    assert solo["torch"] is None and solo["torch_best"] is None and solo["ratio_best"] is None, solo
    assert ("toy", "default", "max_abs_diff_vs_eager") not in by
    text = render(comparable, kiln_only, [], [("kiln", "toy", "boom")])
    assert "| toy | default | call | ms | 1.5 | 1.2 | 1.25 | 0.8 (reduce-overhead) | 1.875 | 0.9 (jit) |" in text, text
    assert "- kiln `toy`: boom" in text

    # a file round trip: tagged lines, an error line, a meta line, untagged lines with --torch
    with tempfile.TemporaryDirectory() as tmp:
        tagged = os.path.join(tmp, "bench.jsonl")
        with open(tagged, "w") as f:
            f.write(json.dumps(dict(source="torch", torch="2.11", gpu="X")) + "\n")
            f.write(json.dumps(dict(source="kiln", workload="toy", variant="eager", metric="call",
                                    value=3.0, unit="ms", device="cuda")) + "\n")
            f.write(json.dumps(dict(source="kiln", workload="bad", error="failed")) + "\n")
            f.write("not json\n")
        plain = os.path.join(tmp, "torch.jsonl")
        with open(plain, "w") as f:
            f.write(json.dumps(dict(workload="toy", variant="eager", metric="call", value=1.5, unit="ms")) + "\n")
        r1, m1, e1 = load(tagged)
        r2, m2, e2 = load(plain, "torch")
        assert len(r1) == 1 and len(r2) == 1 and e1 == [("kiln", "bad", "failed")], (r1, e1)
        assert m1 == [("torch", {"torch": "2.11", "gpu": "X"})], m1
        (rec,), _ = build(r1 + r2)
        assert close(rec["ratio"], 2.0), rec

        # BENCHMARKS.md: the section is appended once, then replaced in place
        md = os.path.join(tmp, "B.md")
        with open(md, "w") as f:
            f.write("# Benchmarks\n\n## Older\n\ntext\n")
        write_section(md, "first\n")
        write_section(md, "second\n")
        t = open(md).read()
        assert t.count(BEGIN) == 1 and "second" in t and "first" not in t and "## Older" in t, t

    # the shared torch file, paired with a fake kiln file of its rows doubled
    here = os.path.dirname(os.path.abspath(__file__))
    shared = os.path.join(here, "..", "..", "shared", "bench")
    torch_files = sorted(f for f in os.listdir(shared) if f.startswith("torch-") and f.endswith(".jsonl")) \
        if os.path.isdir(shared) else []
    if torch_files:
        trows, _, _ = load(os.path.join(shared, torch_files[-1]), "torch")
        fake = [dict(r, source="kiln", value=2 * r["value"]) for r in trows]
        comparable, _ = build(trows + fake)
        tcells = combine(trows)
        assert len(comparable) == len(tcells), (len(comparable), len(tcells))
        for r in comparable:
            if r["torch"]:
                assert close(r["ratio"], 2.0), r
            pick = better(r["unit"])
            if pick is not None:
                want = pick(v for (_, w, var, m), (v, _) in tcells.items()
                            if (w, m) == (r["workload"], r["metric"])
                            and size_group(var) == size_group(r["variant"]))
                assert close(r["torch_best"][0], want), (r, want)
        print(f"self-test: ok ({len(comparable)} rows of {torch_files[-1]} paired)")
    else:
        print("self-test: ok (no ../shared/bench/torch-*.jsonl beside the repository: shared-file check skipped)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", help="JSON-lines files whose lines carry \"source\"")
    for s in SOURCES:
        ap.add_argument(f"--{s}", action="append", default=[], metavar="FILE", help=f"untagged {s} rows")
    ap.add_argument("--all", action="store_true", help="also kiln's rows that torch and JAX lack")
    ap.add_argument("--out", help="write the table here (default: stdout)")
    ap.add_argument("--write-benchmarks", metavar="MD", help="put the table into this markdown file's section")
    ap.add_argument("--title", default=TITLE, help="the section's heading, when it is new")
    ap.add_argument("--self-test", action="store_true")
    a = ap.parse_args()
    if a.self_test:
        self_test()
        return 0
    rows, meta, errors = [], [], []
    inputs = [(f, None) for f in a.files] + [(f, s) for s in SOURCES for f in getattr(a, s)]
    if not inputs:
        ap.error("no input files")
    for path, src in inputs:
        r, m, e = load(path, src)
        rows += r
        meta += m
        errors += e
    comparable, kiln_only = build(rows, a.all)
    text = render(comparable, kiln_only, meta, errors)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    if a.write_benchmarks:
        write_section(a.write_benchmarks, text, a.title)
    if not a.out and not a.write_benchmarks:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
