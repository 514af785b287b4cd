"""Medians of tools/warm_starts.sh's lines (cfg=NAME ROUND {json}): the warm rounds (1 on) of each
configuration in ms, with the time reading cubins, loading modules and looking functions up
(summed over threads), and the cold round's seconds."""
import json
import re
import statistics
import sys

runs = {}
for line in open(sys.argv[1]):
    m = re.match(r"cfg=(\S+) (\S+) (\{.*\})", line)
    if m:
        runs.setdefault(m[1], []).append((m[2], json.loads(m[3])))
for name, rows in runs.items():
    warm = [j for i, j in rows if i not in ("0", "trace")]
    cold = [j for i, j in rows if i == "0"]
    if not warm:
        continue
    ms = [j["seconds"] * 1e3 for j in warm]
    med = lambda k: statistics.median(j.get(k, 0) * 1e3 for j in warm)
    print(
        f"{name}: warm median {statistics.median(ms):.1f} ms (min {min(ms):.1f}, max {max(ms):.1f}, "
        f"{len(ms)} runs: {' '.join(f'{x:.1f}' for x in ms)}); cubin reads {med('cubin_read_secs'):.1f} ms, "
        f"module loads {med('module_load_secs'):.1f}, lookups {med('function_lookup_secs'):.1f}"
        + (f"; cold {cold[0]['seconds']:.2f} s" if cold else "")
    )
