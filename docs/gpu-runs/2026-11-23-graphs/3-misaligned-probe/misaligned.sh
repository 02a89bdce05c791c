export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD CUDA_LAUNCH_BLOCKING=1
i=0
for spec in "bitwise-hybrid-fp32 det" "bitwise-hybrid-fp32 nodet" "llama-keep_full det" "llama-keep_full nodet" "bitwise-hybrid-fp32 det aot_eager" "accumulate-llama det"; do
  i=$((i+1)); timeout 200 torchrun --master-port $((29600+i)) --nproc-per-node 2 .probe/misaligned.py $spec > $OUT/probe$i.log 2>&1 &
done
wait
grep -h -A40 "RESULT" $OUT/probe*.log | grep -v "^\[rank" | head -150
