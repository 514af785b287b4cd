#!/usr/bin/env bash
# Every GPU workload in one run on one GPU: kiln-bench on CUDA in each compile mode, then PyTorch's
# and JAX's baselines for the same workloads, so the ratios come from one machine and one run.
# Every JSON row goes into $OUT/bench.jsonl tagged with its "source" (kiln, torch, jax, meta) and,
# for kiln, the mode of the run ("mode_run"); tools/bench_table.py turns it into
# $OUT/bench_table.md; each step's whole log travels in $OUT/bench_logs.tgz.
#
# Here:   cargo build --release -p kiln-bench && mkdir -p carry/gpu && cp target/release/kiln-bench carry/gpu/
#         cp ../shared/bench/torch_baseline.py ../shared/bench/jax_baseline.py carry/
# There:  bash tools/bench_all.sh [WORKLOAD...]          (carry: ["carry"])
#         WORKLOAD: regional adam sincos resnet18 bert train_resnet18 train_densenet121 (the default: all)
# Env:    MODES  kiln's and torch's compile modes (default "default reduce-overhead max-autotune");
#         TORCH_MODES  torch's modes, if not MODES (its max-autotune compiles take minutes);
#         PARTS  which sides run (default "kiln torch jax"); STEP_TIMEOUT seconds per step (default 900);
#         DEVICE (default cuda), KILN_ARGS (more kiln-bench options; a CPU smoke test of this
#         script: DEVICE=cpu KILN_ARGS=--quick PARTS=kiln BIN=target/release/kiln-bench);
#         KILN_BENCH_MINILM_DIR  all-MiniLM-L6-v2's model.safetensors, tokenizer.json, config.json
#         (else carry/minilm when there; else the minilm rows are skipped with a message).
# A device call lasts at most 10 minutes: split the workloads over calls (`bench_all.sh bert`, then
# `PARTS=kiln bench_all.sh train_densenet121`, ...) and give bench_table.py all the bench.jsonl files.
set -u
here=$(cd "$(dirname "$0")" && pwd)
bin=${BIN:-carry/gpu/kiln-bench}
torch_py=${TORCH_PY:-carry/torch_baseline.py}
jax_py=${JAX_PY:-carry/jax_baseline.py}
modes=${MODES:-default reduce-overhead max-autotune}
torch_modes=${TORCH_MODES:-$modes}
parts=${PARTS:-kiln torch jax}
step_timeout=${STEP_TIMEOUT:-900}
device=${DEVICE:-cuda}
kiln_args=${KILN_ARGS:-}
out=${OUT:-/tmp/kiln-out}
workloads=("$@")
[ ${#workloads[@]} -eq 0 ] && workloads=(regional adam sincos resnet18 bert train_resnet18 train_densenet121)

mkdir -p "$out/bench_logs"
jsonl="$out/bench.jsonl"
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-cache}
export PYTHONUNBUFFERED=1
if [ -z "${KILN_BENCH_MINILM_DIR:-}" ] && [ -f carry/minilm/model.safetensors ]; then
  export KILN_BENCH_MINILM_DIR=$PWD/carry/minilm
fi
# the CUDA libraries live in PyTorch's pip folders (as tools/device_run.sh finds them)
site=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)
for d in "$site"/nvidia/*/lib; do [ -d "$d" ] && LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; done
export LD_LIBRARY_PATH

gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)
echo "{\"source\": \"meta\", \"gpu\": \"$gpu\", \"date\": \"$(date -u +%F)\", \"modes\": \"$modes\", \"torch_modes\": \"$torch_modes\"}" >>"$jsonl"
echo "bench_all: ${workloads[*]} on ${gpu:-no GPU found}; modes: $modes; parts: $parts"

# Runs one step: its stdout's JSON lines tagged into bench.jsonl, everything into its log.
# The children of the tools must not append to $OUT/results.jsonl themselves: OUT is unset for them.
step() {
  local name=$1 tag=$2
  shift 2
  local log="$out/bench_logs/$name.log" t0=$SECONDS rc
  env -u OUT timeout "$step_timeout" "$@" >"$log" 2>&1
  rc=$?
  grep '^{' "$log" | sed "s/^{/{\"source\": $tag, /" >>"$jsonl"
  echo "== $name: exit $rc, $((SECONDS - t0)) s, $(grep -c '^{' "$log") rows$(grep -q '"error"' "$log" && echo ', with errors')"
}

in_list() { local x=$1; shift; for y in "$@"; do [ "$x" = "$y" ] && return 0; done; return 1; }

if in_list kiln $parts; then
  for w in "${workloads[@]}"; do
    for m in $modes; do
      step "kiln_${w}_$m" "\"kiln\", \"mode_run\": \"$m\"" "$bin" "$w" --device "$device" --mode "$m" $kiln_args
    done
  done
fi
if in_list torch $parts; then
  step torch '"torch"' env MODES="$torch_modes" python3 "$torch_py" "${workloads[@]}"
fi
if in_list jax $parts; then
  jw=()
  for w in "${workloads[@]}"; do in_list "$w" regional adam sincos && jw+=("$w"); done
  [ ${#jw[@]} -gt 0 ] && step jax '"jax"' python3 "$jax_py" "${jw[@]}"
fi

python3 "$here/bench_table.py" "$jsonl" --all --out "$out/bench_table.md" \
  && cat "$out/bench_table.md"
tar -czf "$out/bench_logs.tgz" -C "$out" bench_logs && rm -rf "$out/bench_logs"
