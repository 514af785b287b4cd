#!/usr/bin/env bash
# kiln's convolution engines side by side on the GPU machine, one call: each model workload's
# step (or call) with the engine forced to cuDNN, forced to kiln's generated kernels, and left to
# the default (auto: a compiled function with many distinct convolutions times both and chooses),
# then DenseNet-121's warm starts under each (tools/warm_starts.sh).
#
#   bash tools/device_run.sh sh:"bash tools/conv_engines.sh [ROUNDS]"   (carry: ["carry"])
#
# Rows: kiln-bench's JSON lines (eager rows dropped), each prefixed with its engine; the
# auto rows include the choice (conv_functions_generated, conv_choice_*).
set -u
b=${KILN_BENCH:-carry/gpu/kiln-bench}
rounds=${1:-5}
for engine in cudnn generated auto; do
  for w in resnet18 train_resnet18 train_densenet121; do
    KILN_CONV=$engine "$b" "$w" --device cuda --quick 2>&1 | grep '^{' | grep -v '"eager' |
      grep -E '"(call|train_step|cold_compile|conv_[a-z_]+|loss_max_abs_diff_vs_eager|max_rel_diff_vs_cpu)"' |
      sed "s/^/$engine: /"
  done
done
bash "$(dirname "$0")/warm_starts.sh" "$rounds" auto="$b" cudnn="$b,KILN_CONV=cudnn" \
  generated="$b,KILN_CONV=generated" | tail -3
