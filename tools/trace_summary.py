"""A Chrome trace's spans (kiln::profile's save_chrome_trace) of depth <= D per thread, in time order,
ms from the first: tools/trace_summary.py TRACE [D=2] [MIN_MS=0.3]."""
import json, sys
path = sys.argv[1]; D = int(sys.argv[2]) if len(sys.argv) > 2 else 2
minus = float(sys.argv[3]) if len(sys.argv) > 3 else 0.3  # ms
ev = json.load(open(path))["traceEvents"]
t0 = min(e["ts"] for e in ev)
by = {}
for e in ev: by.setdefault(e["tid"], []).append(e)
for tid, es in sorted(by.items()):
    es.sort(key=lambda e: (e["ts"], -e["dur"]))
    stack = []
    print(f"== thread {tid}: {len(es)} spans")
    for e in es:
        while stack and stack[-1] <= e["ts"]: stack.pop()
        d = len(stack)
        stack.append(e["ts"] + e["dur"])
        if d <= D and e["dur"] / 1000 >= minus:
            print(f"{(e['ts']-t0)/1000:8.2f} {e['dur']/1000:8.2f}  {'  '*d}{e['name'][:90]} [{e['cat']}]")
