export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi -L; python -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
CUDA_VISIBLE_DEVICES=0,1 timeout 540 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k core > $OUT/core.txt 2>&1 &
CUDA_VISIBLE_DEVICES=2,3 timeout 540 python -m pytest -q -p no:cacheprovider tests/test_gpu.py -k hf > $OUT/hf.txt 2>&1 &
wait
tail -5 $OUT/core.txt; tail -5 $OUT/hf.txt
grep -E "FAILED|Error" $OUT/core.txt $OUT/hf.txt | head -20
