"""GPU gates: the parity scenarios with NCCL on 2 GPUs, both compilers.

Skipped without 2 CUDA GPUs. Run on the device machine:
    NCCL_NVLS_ENABLE=0 python -m pytest tests/test_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from tests.distributed import check_results, run_ranks
from tests.parity import SCENARIOS, run_all

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]
# Every scenario under both compilers.
GPU_CHECKS = [*SCENARIOS, "eval_no_grad"] + [
    f"{name}@inductor" for name, sc in SCENARIOS.items() if sc.compile_kwargs.get("backend") == "aot_eager"
]


@pytest.fixture(scope="module")
def nccl_run():
    results = run_ranks(2, run_all, GPU_CHECKS, timeout=900, backend="nccl")
    check_results(results)
    return results


@pytest.mark.parametrize("check", GPU_CHECKS)
def test_nccl_parity(nccl_run, check):
    failures = [f"rank {r}:\n{res[check]}" for r, res in enumerate(nccl_run) if res[check] is not None]
    assert not failures, "\n".join(failures)
