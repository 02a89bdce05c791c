#!/usr/bin/env bash
# The NCCL gate (tests/test_gpu.py), its groups run side by side, each on a
# pair of GPUs (round robin over the GPUs present; two groups may share a
# pair: the models are small and Inductor's compiles on the CPU dominate).
# Logs to $OUT, a line per check as it ends (-s), so a group cut off by
# GATE_TIMEOUT still shows how far it got.
#   OUT=/tmp/gate bash bench/scripts/nccl_gate.sh
# GATE_GROUPS picks groups: core1 core2 core3 hf params (parameters,
# checkpoints, the zoo) tt (torchtitan's models, tests/test_torchtitan.py)
# outline (outlined layers' inputs, tests/test_outline_inputs.py)
# tp (FSDP + TP) ep (FSDP + EP), the last two on every GPU present.
# GATE_GPUS=2 uses the first two GPUs only (the 2-GPU meshes of tp and ep).
set -u
OUT=${OUT:-/tmp/fxshard-nccl-gate}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:-$PWD}
declare -A groups=(
  [core1]="core1" [core2]="core2" [core3]="core3" [hf]="hf"
  [params]="writes_meta or checkpoint_round or zoo_seeds"
  [tp]="tensor_parallel" [ep]="expert_parallel" [tt]="model_gpu" [outline]="on_gpus"
)
declare -A files=([tt]="tests/test_torchtitan.py" [outline]="tests/test_outline_inputs.py")
selected=${GATE_GROUPS:-core1 core2 core3 hf params tt outline tp ep}
gpus=${GATE_GPUS:-$(nvidia-smi -L | wc -l)}
pair=0
for g in $selected; do
  if [ "$g" = tp ] || [ "$g" = ep ]; then
    visible=$(seq -s, 0 $((gpus - 1)))
  else
    visible=$((2 * pair % gpus)),$(((2 * pair + 1) % gpus))
    pair=$((pair + 1))
  fi
  CUDA_VISIBLE_DEVICES=$visible timeout "${GATE_TIMEOUT:-560}" \
    python -m pytest -q -s -rA "${files[$g]:-tests/test_gpu.py}" -k "${groups[$g]}" > "$OUT/nccl-$g.log" 2>&1 &
done
wait
for g in $selected; do
  summary=$(grep -E '^[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' "$OUT/nccl-$g.log" | tail -1)
  echo "== $g: ${summary:-no summary (cut off?)}"
done
