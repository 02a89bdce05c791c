"""GPU gate of ``fxshard.cuda_graph``: full training steps captured as one
CUDA graph, on 2 GPUs with NCCL.

Skipped without 2 CUDA GPUs. Each group is one launch of 2 ranks that runs
all its cases (tests/helpers/cuda_graph_checks.py); each case is reported on its own:
    NCCL_NVLS_ENABLE=0 python -m pytest -s tests/test_cuda_graph_gpu.py

(``-s`` prints a line as each case ends, so a run that is cut off still shows
how far it got.)

- bitwise: the example Llama, the Hybrid (tests/helpers/models.py), Hugging Face
  Llama and Mamba2, each in fp32 and in bf16 mixed precision: 20 steps
  through a plain loop and through ``fxshard.cuda_graph``; losses, shards and
  optimizer states bitwise equal;
- options: ``reshard_after_forward=False``, ``prefetch`` 0 and 2 and
  ``reduces_in_flight=2`` on the Llama; gradient accumulation (3 micro-batches
  in one captured step) on the Llama and the Hybrid;
- strategies: bf16 and fp32 ZeRO-3, ZeRO-1, HSDP, and accumulation without
  sync under them;
- memory: the predicted peak within 5% of the one measured at capture;
- errors: each raised before any collective of the capture;
- teardown: the process group destroyed with a captured graph alive; reset
  and capture again.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers import cuda_graph_checks as checks
from tests.helpers.distributed import check_results, run_ranks

# FXSHARD_GATE_WORLD=1 runs the gate on one GPU: the capture paths, not the
# communication (a one-rank NCCL collective is a copy).
WORLD = int(os.environ.get("FXSHARD_GATE_WORLD", "2"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs"),
]

BITWISE = [name for name in checks.CASES if name.startswith("bitwise-")]
GROUPS = {
    "bitwise_core": [n for n in BITWISE if not n.startswith("bitwise-hf_")],
    "bitwise_hf": [n for n in BITWISE if n.startswith("bitwise-hf_")],
    # Options in two launches: all 17 in one outran a 300 s limit beside the other groups.
    "options": [n for n in checks.CASES if n.startswith(("llama-", "accumulate-")) and "strategies" not in n],
    "strategies": [n for n in checks.CASES if "strategies" in n],
    "memory": [n for n in checks.CASES if n.startswith("memory-")],
    "errors": list(checks.ERRORS),
}
# FXSHARD_GATE_CASES=a,b: only these cases, to finish a group that a time limit cut off.
_ONLY = {n for n in os.environ.get("FXSHARD_GATE_CASES", "").split(",") if n}
if _ONLY:
    GROUPS = {g: [n for n in names if n in _ONLY] for g, names in GROUPS.items()}
CASES = [(group, name) for group, names in GROUPS.items() for name in names]
_results: dict[str, list] = {}


def _group_results(group: str) -> list:
    if group not in _results:
        results = run_ranks(WORLD, checks.run_cases, GROUPS[group], timeout=900, backend="nccl")
        check_results(results)
        _results[group] = results
    return _results[group]


@pytest.mark.parametrize("group, name", CASES, ids=[name for _, name in CASES])
def test_cuda_graph(group, name):
    results = _group_results(group)
    failures = [f"rank {r}:\n{res[name]}" for r, res in enumerate(results) if res[name] is not None]
    assert not failures, "\n".join(failures)


def test_destroy_process_group_without_reset():
    """Within the timeout: a hang in NCCL's teardown or the graph's destructor fails here."""
    check_results(run_ranks(WORLD, checks.destroy_without_reset, timeout=120, backend="nccl"))


def test_reset_then_capture_again():
    check_results(run_ranks(WORLD, checks.reset_and_capture_again, timeout=300, backend="nccl"))
