# 8B fxshard alone, each run with a cold Inductor/Triton cache: the default
# (with a kernel profile), then Inductor options that may cut compile time.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-bench-out}; mkdir -p $OUT
run() {  # name, FXSHARD_INDUCTOR_CONFIG, extra args
  export TORCHINDUCTOR_CACHE_DIR=/tmp/ind-$1 TRITON_CACHE_DIR=/tmp/ind-$1/triton FXSHARD_INDUCTOR_CONFIG=$2
  timeout 200 torchrun --nproc-per-node 4 bench/bench.py --model 8b --systems fxshard --out $OUT/knob-$1.json $3 \
    > $OUT/knob-$1.log 2>&1
  echo "== $1 ($2)"; grep -v Warning $OUT/knob-$1.log | grep "| fxshard\|phases\|profile per\|Error" | tail -4
}
run default "" "--profile 2"
run nopm "pattern_matcher=0"
run nopm-noat "pattern_matcher=0,triton.autotune_pointwise=0"
