#!/usr/bin/env bash
# One bench system under several NCCL settings, each a separate bench run
# (each system in its own process), so that the settings compare side by side
# in one device call. Logs and JSON to $OUT.
#   OUT=/tmp/v MODEL=375m BATCH=1 SYSTEM=fxshard_graph bash bench/scripts/nccl_variants.sh
set -u
OUT=${OUT:-/tmp/fxshard-nccl}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:-$PWD}
# name=environment (space-separated assignments; "default" sets nothing)
VARIANTS=${VARIANTS:-"default= simple=NCCL_PROTO=Simple ll128=NCCL_PROTO=LL128 noreg=NCCL_GRAPH_REGISTER=0"}
for v in $VARIANTS; do
  name=${v%%=*} envs=${v#*=}
  env ${envs//,/ } python bench/bench.py --model "${MODEL:-375m}" --batch "${BATCH:-1}" \
    --systems "${SYSTEM:-fxshard_graph}" --repeat "${REPEAT:-1}" --profile "${PROFILE:-3}" \
    --timeout "${TIMEOUT:-240}" --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "== $name ($envs): $(grep -E '^\| .*#' "$OUT/$name.log" | tr -s ' ' | cut -d'|' -f3,4 | tr '\n' ' ')"
  grep -E "profile per step" "$OUT/$name.log" | tail -"${REPEAT:-1}"
done
