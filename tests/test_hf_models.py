"""Hugging Face transformers models train with one fxshard.compile call.

Gloo, one process per rank, each rank on different data; the same loss,
gradients and updated parameters as unsharded training. World size 3 runs
the models whose parameter reads differ between ranks (MoE expert loops).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from tests.helpers.distributed import check_results, run_ranks, selected  # noqa: E402
from tests.helpers.hf_parity import CHECKPOINTED, HF_CHECKS, HF_SCENARIOS  # noqa: E402

# The checkpointed scenarios run inside their *_gathers_once checks.
ALL = [name for name in HF_SCENARIOS if name not in CHECKPOINTED] + list(HF_CHECKS)
# CPU time on 2 cores: Mixtral with transformers' default grouped_mm experts
# (data-independent) runs on the GPUs only (tests/test_gpu.py).
# Qwen3 with reentrant checkpointing runs there too.
GPU_ONLY = ("hf_mixtral", "hf_qwen3_gradient_checkpointing_reentrant_gathers_once")
# CPU time: Qwen3 is Llama with q/k norms, and Jamba's mixer is Mamba's (Jamba took
# 186 of the 253 s of this group: dynamo retraces transformers at each graph
# break); they run on the GPUs and under [Note: full_cpu].
# llama_block_checkpoint_gathers_once (the example's Llama, each block under torch's checkpoint) checks
# what hf_llama_gradient_checkpointing_gathers_once checks on transformers' checkpointed Llama, which
# also trains as hf_llama does, against the same reference.
FULL_CPU_ONLY = ("hf_qwen3", "hf_mamba", "hf_jamba", "llama_block_checkpoint_gathers_once", "hf_llama")
# World size 3 (uneven shards; ranks route tokens to different experts) takes
# 60 s for the expert loop alone on 2 cores, and ~5 minutes for all of these:
# [Note: full_cpu]. tests/test_parity.py's routed_experts_differ runs at 3.
WORLD_SIZE_3 = ("hf_mixtral_expert_loop", "hf_llama", "hf_qwen3", "hf_mamba", "hf_mamba2", "hf_jamba")
FULL_CPU = [pytest.mark.full_cpu]
CASES = [
    *(
        pytest.param(2, name, id=f"ws2-{name}", marks=FULL_CPU if name in FULL_CPU_ONLY else [])
        for name in ALL
        if name not in GPU_ONLY
    ),
    *(pytest.param(3, name, id=f"ws3-{name}", marks=FULL_CPU) for name in WORLD_SIZE_3),
]


@pytest.fixture(scope="module")
def hf_run(request):
    """Every selected model of one world size, in one set of ranks."""
    from tests.helpers.parity import run_all

    world_size = request.param
    results = run_ranks(world_size, run_all, selected(request, "check", hf_run=world_size), timeout=900)
    check_results(results)
    return results


@pytest.mark.parametrize("hf_run, check", CASES, indirect=["hf_run"], scope="module")
def test_hf_model_matches_unsharded(hf_run, check):
    failures = [f"rank {r}:\n{res[check]}" for r, res in enumerate(hf_run) if res[check] is not None]
    assert not failures, "\n".join(failures)
