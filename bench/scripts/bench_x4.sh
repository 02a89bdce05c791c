# The benchmark on GPUS GPUs (default 4): one torchrun per model; bench.py runs each system in a torchrun of its own.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-bench-out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1 > $OUT/env.txt
python -c "import torch; print(torch.__version__, torch.cuda.nccl.version())" >> $OUT/env.txt
for model in ${MODELS:-1b 8b}; do
  timeout ${MODEL_TIMEOUT:-420} torchrun --nproc-per-node ${GPUS:-4} bench/bench.py --model $model --out $OUT/bench-$model.json \
    $BENCH_ARGS > $OUT/bench-$model.log 2>&1
  grep -v Warning $OUT/bench-$model.log | grep "^|\|^fxshard\|^fsdp2\|Error\|GiB" | tail -${SHOW:-12}
done
python bench/plot.py $OUT/bench-*.json --out $OUT/bench.png 2>&1 | tail -2
