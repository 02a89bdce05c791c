#!/usr/bin/env bash
# The CUDA-graph GPU gate (tests/test_cuda_graph_gpu.py), its groups run side
# by side, GATE_PARALLEL at a time (each a pytest of its own, its ranks on all
# GPUs; Inductor compiles on the CPU dominate, so they overlap well). Logs to $OUT,
# a line per case as it ends (-s), so a group cut off by GATE_TIMEOUT still shows
# how far it got.
#   OUT=/tmp/gate bash bench/scripts/gpu_graph_gate.sh
# FXSHARD_GATE_WORLD=1 runs it on one GPU (capture paths only, no communication).
set -u
OUT=${OUT:-/tmp/fxshard-gate}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:-$PWD}
declare -A groups=(
  [bitwise_core]="bitwise and not hf"
  [bitwise_hf]="bitwise and hf"
  [options]="keep_full or prefetch or reduces_in_flight or (accumulate and not strategies)"
  [strategies]="strategies"
  [memory]="memory"
  [errors]="error"
  [teardown]="destroy or reset_then"
)
selected=${GATE_GROUPS:-${!groups[@]}}  # e.g. GATE_GROUPS="memory errors"; FXSHARD_GATE_CASES=a,b runs only those cases
# Groups at once: all seven at 2 ranks; at 4 ranks, 24 processes compiling at
# once on 4 GPUs outran a 400 s limit (4 x H100), so two at a time there.
parallel=${GATE_PARALLEL:-$([ "${FXSHARD_GATE_WORLD:-2}" -ge 4 ] && echo 2 || echo 6)}
running=0
for g in $selected; do
  timeout "${GATE_TIMEOUT:-540}" python -m pytest -q -s -rA tests/test_cuda_graph_gpu.py -k "${groups[$g]}" \
    > "$OUT/gate-$g.log" 2>&1 &
  running=$((running + 1))
  if [ "$running" -ge "$parallel" ]; then wait -n; running=$((running - 1)); fi
done
wait
for g in $selected; do
  summary=$(grep -E '^[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' "$OUT/gate-$g.log" | tail -1)
  echo "== $g: ${summary:-no summary (cut off?): $(grep -c 'passed in' "$OUT/gate-$g.log") case lines passed, $(grep -c 'FAILED in' "$OUT/gate-$g.log") failed}"
done
