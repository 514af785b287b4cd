# Summarise an ncu --csv run (long format, a row per metric): totals by kernel name and launch shape;
# with `order` also every kernel in launch order. python3 tools/ncu_kernels.py NCU.csv [order]
import csv, sys, collections
rows = list(csv.reader(l for l in open(sys.argv[1]) if l.startswith('"')))
hdr = rows[0]
ix = {k: hdr.index(k) for k in ["ID", "Kernel Name", "Block Size", "Grid Size", "Metric Name", "Metric Value"]}
ks = collections.OrderedDict()
for r in rows[1:]:
    if len(r) < len(hdr) or r[0] == "ID":
        continue
    k = ks.setdefault(r[ix["ID"]], {"name": r[ix["Kernel Name"]][:70], "grid": r[ix["Grid Size"]], "block": r[ix["Block Size"]]})
    k[r[ix["Metric Name"]]] = float(r[ix["Metric Value"]].replace(",", ""))
order = len(sys.argv) > 2 and sys.argv[2] == "order"
tot = 0.0
agg = collections.defaultdict(lambda: [0, 0.0, 0.0])
for i, k in ks.items():
    t = k.get("gpu__time_duration.sum", 0) / 1e3
    b = k.get("dram__bytes_read.sum", 0) + k.get("dram__bytes_write.sum", 0)
    tot += t
    key = (k["name"], k["grid"], k["block"])
    agg[key][0] += 1; agg[key][1] += t; agg[key][2] += b
    if order:
        print(f"{i:>5} {t:8.2f} us {b/1e6:8.2f} MB  {k['grid']:>14} {k['block']:>12} {k['name']}")
print(f"total {tot:.1f} us over {len(ks)} kernels")
for (n, g, bl), (c, t, b) in sorted(agg.items(), key=lambda x: -x[1][1])[:60]:
    print(f"{c:4d}x {t:9.1f} us {b/1e6:9.2f} MB {g:>14} {bl:>12} {n}")
