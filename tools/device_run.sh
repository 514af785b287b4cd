#!/usr/bin/env bash
# One call on the GPU machine: named steps run in order, each with its wall time, its whole log
# under $OUT (or /tmp/kiln-out) and its last lines on stdout, so tests, kiln-bench and PyTorch's
# baseline come from the same run on the same GPU.
#
# Here:   cargo build --release --workspace --tests
#         mkdir -p carry/gpu; cp the test binaries (target/release/deps/NAME-HASH → carry/gpu/NAME)
#         and target/release/kiln-bench into carry/gpu; strip them; cp ../shared/bench/*.py carry/
# There:  bash tools/device_run.sh STEP...   (carry: ["carry"])
#
# Steps: gpu_compile gpu_ops cuda_memory compile_ops (the op suite with KILN_TEST_DEVICE=cuda)
#        compile_ops_mode:MODE (the op suite on the GPU compiled in MODE: reduce-overhead,
#        max-autotune, max-autotune-no-cudagraphs; one test at a time, since a mode that records
#        CUDA graphs refuses other threads' work on the device while it records)
#        cuda_test:NAME (any test binary in carry/gpu with KILN_TEST_DEVICE=cuda, 240 s at most)
#        bench:WORKLOAD[:MODE] (kiln-bench on cuda; MODE default, reduce-overhead, eager, ...)
#        quick:WORKLOAD (kiln-bench on cuda with --quick: fewer steps before its cold compile)
#        cpu:WORKLOAD (kiln-bench on the host's CPU cores: numpy_fn, sincos, adam, regional)
#        before:WORKLOAD[:MODE] (the same with carry/gpu/kiln-bench-before: a build of an earlier
#        commit, for a before/after pair from one call)
#        torch:W1,W2,... (torch_baseline.py) jax:W1,W2,... (jax_baseline.py) bert_minilm
#        bench_all:W1,W2,... (tools/bench_all.sh: kiln, torch and JAX rows into $OUT/bench.jsonl)
#        py:SCRIPT (a python script carried in carry/)
#        env:NAME=VALUE (exported for the steps after it, e.g. env:KILN_COMPILE_THREADS=8)
#        sh:COMMAND (a shell command, e.g. sh:du -sh ~/.nv, or warm starts of two builds
#        interleaved: sh:"bash tools/warm_starts.sh 6 before=carry/gpu/kiln-bench-before
#        new=carry/gpu/kiln-bench", each NAME=BINARY[,VAR=VALUE...])
set -u
bin=carry/gpu
out=${OUT:-/tmp/kiln-out}
mkdir -p "$out"
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-cache}
# the digits (cuda_memory's training run) when ../shared is not beside the tree there:
# cp ../shared/data/digits.csv.gz carry/
if [ -z "${KILN_DIGITS:-}" ] && [ ! -f ../shared/data/digits.csv.gz ] && [ -f carry/digits.csv.gz ]; then
  export KILN_DIGITS=$PWD/carry/digits.csv.gz
fi
export PYTHONUNBUFFERED=1
# the CUDA libraries live in PyTorch's pip folders
site=$(python3 -c 'import site; print(site.getsitepackages()[0])' 2>/dev/null)
for d in "$site"/nvidia/*/lib; do LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}"; done
export LD_LIBRARY_PATH
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader

run_step() {
  local step=$1 log
  n=$((n + 1))
  # numbered, so a step given twice keeps both logs
  log="$out/$(printf %02d $n)_$(echo -n "$step" | tr -c 'A-Za-z0-9_.=-' '_' | cut -c1-60).log"
  local t0=$SECONDS
  case $step in
    gpu_compile | gpu_ops | cuda_memory) "$bin/$step" >"$log" 2>&1 ;;
    compile_ops) KILN_TEST_DEVICE=cuda "$bin/compile_ops" >"$log" 2>&1 ;;
    compile_ops_mode:*) KILN_TEST_DEVICE=cuda KILN_TEST_MODE="${step#compile_ops_mode:}" \
      timeout 400 "$bin/compile_ops" --test-threads=1 >"$log" 2>&1 ;;
    cuda_test:*) KILN_TEST_DEVICE=cuda timeout 240 "$bin/${step#cuda_test:}" >"$log" 2>&1 ;;
    bert_minilm) "$bin/bert_minilm" >"$log" 2>&1 ;;
    bench:*)
      IFS=: read -r _ w m <<<"$step"
      "$bin/kiln-bench" "$w" --device cuda --mode "${m:-default}" >"$log" 2>&1 ;;
    quick:*) "$bin/kiln-bench" "${step#quick:}" --device cuda --quick >"$log" 2>&1 ;;
    cpu:*) "$bin/kiln-bench" "${step#cpu:}" --device cpu >"$log" 2>&1 ;;
    before:*)
      IFS=: read -r _ w m <<<"$step"
      "$bin/kiln-bench-before" "$w" --device cuda --mode "${m:-default}" >"$log" 2>&1 ;;
    torch:*) timeout 400 python3 carry/torch_baseline.py $(echo "${step#torch:}" | tr , ' ') \
      2>&1 | grep -v -i warning >"$log" ;;
    jax:*) timeout 300 python3 carry/jax_baseline.py $(echo "${step#jax:}" | tr , ' ') \
      2>&1 | grep -v -i warning >"$log" ;;
    bench_all:*) bash tools/bench_all.sh $(echo "${step#bench_all:}" | tr , ' ') >"$log" 2>&1 ;;
    py:*) timeout 400 python3 "carry/${step#py:}" >"$log" 2>&1 ;;
    env:*) export "${step#env:}"; echo "${step#env:}" >"$log" ;;
    sh:*) bash -c "${step#sh:}" >"$log" 2>&1 ;;
    *) echo "unknown step $step" >"$log" ;;
  esac
  echo "== $step: exit $?, $((SECONDS - t0)) s"
  case $step in
    bench:* | quick:* | cpu:* | before:* | torch:* | jax:*) grep '^{' "$log" | cut -c1-200 ;;
    bench_all:* | py:* | sh:*) tail -n 40 "$log" ;;
    env:*) ;;
    *) tail -n 25 "$log" ;;
  esac
}

n=0
for s in "$@"; do run_step "$s"; done
# at most 8 files come back: the logs travel as one archive
tar -czf "$out/logs.tgz" -C "$out" $(cd "$out" && ls *.log) && rm -f "$out"/*.log
