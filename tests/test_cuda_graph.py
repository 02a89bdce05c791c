"""``fxshard.cuda_graph`` errors that need no GPU: CUDA graphs need CUDA
tensors and an NCCL group. The rest of the feature is gated on GPUs in
tests/test_cuda_graph_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests import cuda_graph_checks as checks
from tests.distributed import check_results, run_ranks


@pytest.mark.full_cpu  # 13 s on 2 cores; the one-rank test below checks the same error
def test_cpu_model_on_two_gloo_ranks():
    """The Hybrid on CPU, 2 gloo ranks: an error at the capture at the
    latest, before its collectives; the model then trains without the graph."""
    check_results(run_ranks(2, checks.error_cpu_tensors, timeout=300))


def test_cpu_model_without_process_group(no_dist, monkeypatch):
    """``fxshard.compile(model)`` with no process group (a one-rank gloo group)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    checks.error_cpu_tensors(0, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gloo_group_with_cuda_tensors(no_dist):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.cuda.set_device(0)
    checks.error_gloo_group_on_cuda(0, 1)
