#!/usr/bin/env bash
# Warm starts of DenseNet-121 training (generated convolutions) under several glibc malloc
# settings, interleaved, each with the process's page faults and CPU time (KILN_BENCH_PROC): how
# kiln-core's host_memory.rs was found (BENCHMARKS.md, twenty-fifth session). On the GPU machine:
#   B=carry/gpu/kiln-bench bash tools/malloc_warm_starts.sh
# KILN_MALLOC=0 is set for every configuration, so kiln's own setting stays out of the comparison.
export KILN_CONV=generated
B=${B:-carry/gpu/kiln-bench}
export KILN_MALLOC=0
declare -A envs=([a]="" [pad]="MALLOC_TOP_PAD_=67108864" [mmap]="MALLOC_MMAP_THRESHOLD_=33554432" [all]="MALLOC_TOP_PAD_=67108864 MALLOC_TRIM_THRESHOLD_=134217728 MALLOC_MMAP_THRESHOLD_=33554432")
for c in a pad mmap all; do rm -rf /tmp/kf-$c; env ${envs[$c]} KILN_CACHE_DIR=/tmp/kf-$c $B compile-child:train:densenet121 --device cuda --mode default --quick >/dev/null 2>&1; done
for i in 1 2 3 4 5 6 7; do for c in a pad mmap all; do
  r=$(env ${envs[$c]} KILN_BENCH_PROC=1 KILN_CACHE_DIR=/tmp/kf-$c $B compile-child:train:densenet121 --device cuda --mode default --quick 2>&1)
  echo "$c $(echo "$r" | grep -o '"seconds":[0-9.]*' | cut -d: -f2) $(echo "$r" | grep -o 'faults minor [0-9]*' | awk '{print $3}') $(echo "$r" | grep -o 'CPU user [0-9.]* s sys [0-9.]*' | awk '{print $3, $6}')"
done; done > /tmp/faults.txt
python3 - <<'P'
import statistics as st, collections
d=collections.defaultdict(list)
for l in open('/tmp/faults.txt'):
    c,s,f,u,sy=l.split(); d[c].append((float(s)*1e3,int(f),float(u),float(sy)))
for c,v in d.items():
    print(c, 'median %.1f ms' % st.median(x[0] for x in v), 'runs', ' '.join('%.1f'%x[0] for x in v), '| faults median', st.median(x[1] for x in v), '| user %.3f sys %.3f' % (st.median(x[2] for x in v), st.median(x[3] for x in v)))
P
