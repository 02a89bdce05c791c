# 8B on 4 GPUs: fxshard and FSDP2 + compile with a kernel profile of the last 2 steps; then fxshard with prefetch=2.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-bench-out}; mkdir -p $OUT
timeout 300 torchrun --nproc-per-node 4 bench/bench.py --model 8b --systems fxshard,fsdp2_compile --profile 2 \
  --out $OUT/profile-8b.json > $OUT/profile-8b.log 2>&1
grep -v Warning $OUT/profile-8b.log | grep "^|\|^fxshard\|profile per step\|Error" | tail -12
timeout 200 torchrun --nproc-per-node 4 bench/bench.py --model 8b --systems fxshard --prefetch 2 \
  --out $OUT/bench-8b-prefetch2.json > $OUT/bench-8b-prefetch2.log 2>&1
grep -v Warning $OUT/bench-8b-prefetch2.log | grep "^|\|^fxshard\|Error" | tail -4
