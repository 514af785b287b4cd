#!/usr/bin/env bash
# Warm starts of a model's compile and first call in new processes (kiln-bench's compile child),
# several configurations interleaved round by round, so they share the device's and the host's
# moods: on the H200 host one configuration's warm starts spread over ±10 ms, more than most
# single changes, so compare medians of interleaved rounds from one call, never single runs.
#
#   bash tools/warm_starts.sh ROUNDS NAME=BINARY[,VAR=VALUE...] ...
#   e.g. (on the GPU machine, through tools/device_run.sh's sh: step)
#   bash tools/warm_starts.sh 6 before=carry/gpu/kiln-bench-before,KILN_CONV=generated \
#                               new=carry/gpu/kiln-bench,KILN_CONV=generated
#
# Each configuration gets a cache folder of its own, filled by a cold run first (round 0). The
# model is $WARM_KEY (default train:densenet121: batch 64 at 224x224 with Adam, --quick) on
# $WARM_DEVICE (default cuda; cpu runs the quick CPU shapes).
# With TRACE=1, a profiled warm run of each configuration follows, its Chrome trace saved as
# $OUT/trace-NAME.json (tools/trace_summary.py prints it). The last lines are the medians
# (tools/warm_summary.py).
set -u
rounds=$1; shift
key=${WARM_KEY:-train:densenet121}
out=${OUT:-/tmp/kiln-out}; mkdir -p "$out"
log="$out/warm_starts.log"; : >"$log"
one() { # config round [extra env...]
  local cfg=$1 i=$2; shift 2
  local spec=${cfg#*=} name=${cfg%%=*}
  local bin=${spec%%,*} vars=
  [ "$spec" != "$bin" ] && vars=${spec#*,}
  env ${vars//,/ } "$@" KILN_CACHE_DIR=/tmp/kiln-warm-$name "$bin" "compile-child:$key" \
    --device "${WARM_DEVICE:-cuda}" --mode default --quick 2>/dev/null | grep '^{' | sed "s/^/cfg=$name $i /" | tee -a "$log"
}
for cfg in "$@"; do rm -rf "/tmp/kiln-warm-${cfg%%=*}"; mkdir -p "/tmp/kiln-warm-${cfg%%=*}"; done
for cfg in "$@"; do one "$cfg" 0; done
for i in $(seq 1 "$rounds"); do for cfg in "$@"; do one "$cfg" "$i"; done; done
if [ "${TRACE:-0}" = 1 ]; then
  for cfg in "$@"; do
    one "$cfg" trace KILN_BENCH_PROFILE=4 KILN_BENCH_TRACE="$out/trace-${cfg%%=*}.json"
  done
fi
python3 "$(dirname "$0")/warm_summary.py" "$log"
