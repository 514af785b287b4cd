#!/usr/bin/env bash
# One call on the GPU machine: the GPU compile tests, kiln-bench on CUDA (default and
# reduce-overhead) and PyTorch's rows for the same workloads, so the ratios come from one run.
#
# Here:   cargo build --release -p kiln-bench && cargo test --release --no-run -p kiln --test gpu_compile
#         mkdir -p carry/gpu && cp target/release/kiln-bench target/release/deps/gpu_compile-* carry/gpu/
#         (rename the test binary to carry/gpu/gpu_compile) && cp ../shared/bench/torch_baseline.py carry/
# There:  bash tools/device_gpu_bench.sh carry/gpu carry/torch_baseline.py
set -u
bin=${1:-carry/gpu}
torch_py=${2:-carry/torch_baseline.py}
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-cache}
nvidia-smi --query-gpu=name --format=csv,noheader
echo "== gpu_compile"; "$bin/gpu_compile" 2>&1 | tail -30
echo "== kiln-bench"
for m in default reduce-overhead; do
  "$bin/kiln-bench" sincos --device cuda --mode "$m" --quick 2>/dev/null
  "$bin/kiln-bench" adam --device cuda --mode "$m" --quick 2>/dev/null
done
echo "== torch"
timeout 240 python3 "$torch_py" ceilings sincos adam 2>&1 | grep -v Warning
