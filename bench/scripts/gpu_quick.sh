# A few NCCL parity checks on 2 GPUs (bench/scripts/gpu_quick.py).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
python bench/scripts/gpu_quick.py 2>&1 | grep -v Warning | tail -12
