"""GPU gates: every parity scenario with NCCL on 2 GPUs, under both compilers.

Skipped without 2 CUDA GPUs. On the device machine, ``bench/scripts/nccl_gate.sh``
runs the groups side by side (all of core in one pytest no longer fits one 600 s
call); one group alone, where ``-s`` shows each check's progress line as it
ends, so a run cut off still says how far it got:
    NCCL_NVLS_ENABLE=0 python -m pytest tests/test_gpu.py -s -k core1   # core2, core3, hf
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.checkpoint_checks import dcp_resume, two_rank_checks
from tests.helpers.distributed import check_results, run_ranks
from tests.helpers.param_checks import run_checks
from tests.helpers.parity import SCENARIOS, Scenario, run_all

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"),
]

try:
    import transformers  # noqa: F401

    from tests.helpers.hf_parity import HF_CHECKS, HF_SCENARIOS
except ImportError:
    HF_CHECKS, HF_SCENARIOS = {}, {}


def _both_compilers(scenarios: dict[str, Scenario], checks: list[str]) -> list[str]:
    aot_eager = [n for n, sc in scenarios.items() if sc.compile_kwargs.get("backend") == "aot_eager"]
    return [*scenarios, *checks] + [f"{n}@inductor" for n in aot_eager]


_CORE = _both_compilers(
    SCENARIOS, ["eval_no_grad", "routed_experts_differ", "sharded_lookups", "dropped_model_frees_memory"]
)
GROUPS = {
    **{f"core{i + 1}": _CORE[i::3] for i in range(3)},  # thirds, each one run of 2 ranks
    "hf": _both_compilers(HF_SCENARIOS, list(HF_CHECKS)),
}
CASES = [(group, check) for group, checks in GROUPS.items() for check in checks]
_results: dict[str, list] = {}


def _group_results(group: str) -> list:
    if group not in _results:
        results = run_ranks(2, run_all, GROUPS[group], timeout=900, backend="nccl")
        check_results(results)
        _results[group] = results
    return _results[group]


@pytest.mark.parametrize("group, check", CASES, ids=[f"{g}-{c}" for g, c in CASES])
def test_nccl_parity(group, check):
    results = _group_results(group)
    failures = [f"rank {r}:\n{res[check]}" for r, res in enumerate(results) if res[check] is not None]
    assert not failures, "\n".join(failures)


# Parameters and checkpoints on NCCL: the same checks as on gloo, on each rank's GPU.
def test_nccl_writes_meta_init_and_conversions():
    names = [
        "writes",
        "optimizer_before_compile",
        "conversions",
        "meta_init_trains",
        "identical_rows",
        "outer_compile_inductor",
        "compiled_step",
    ]
    check_results(run_ranks(2, run_checks, names, timeout=600, backend="nccl"))
    check_results(run_ranks(1, run_checks, ["meta_init"], timeout=600, backend="nccl"))


def test_nccl_checkpoint_round_trip(tmp_path):
    """torch.save and resume, full state dicts, the full export, and DCP saved
    at 2 GPUs and resumed at 1 under Inductor."""
    path = str(tmp_path)
    results = run_ranks(2, two_rank_checks, path, timeout=600, backend="nccl")
    check_results(results)
    failures = [f"rank {r} {name}:\n{res[name]}" for r, res in enumerate(results)
                for name in ("torch_save", "full_load", "full_export") if res[name] is not None]  # fmt: skip
    assert not failures, "\n".join(failures)
    check_results(run_ranks(1, dcp_resume, path, results[0]["dcp_saved"], "inductor", timeout=600, backend="nccl"))


def test_nccl_zoo_seeds():
    """The zoo's CI seeds (tests/test_zoo.py) at 2 GPUs, under both compilers."""
    from tests.helpers.zoo import failures, run_seeds

    seeds_of = {"aot_eager": [37, 92, 137, 180, 131, 195], "inductor": [4, 59, 34]}  # tests/test_zoo.py's CI seeds
    for backend, seeds in seeds_of.items():
        results = run_ranks(2, run_seeds, seeds, backend, timeout=600, backend="nccl")
        check_results(results)
        failed = failures(results)
        assert not failed, "\n\n".join(f"seed {s}: {m}" for s, m in sorted(failed.items()))


def test_nccl_tensor_parallel():
    """FSDP + TP (tests/test_tensor_parallel.py's scenarios) with NCCL, where
    fxshard's gathers and TP's collectives run on two process groups: at
    (dp 2, tp 2) on 4 GPUs, at (dp 1, tp 2) on 2."""
    from tests.helpers.tp_parity import run_all as tp_run_all

    world = 4 if torch.cuda.device_count() >= 4 else 2
    names = [
        "llama_sp",
        "odd_zero2",
        "odd_zero1",
        "llama_inductor",
        "llama_bf16_inductor",
        "llama_no_sync_clip",
        "odd_units",
        "llama_loss_parallel",
        "llama_sp_loss_parallel",
    ]
    results = run_ranks(world, tp_run_all, names + (["odd_dp1_tp4"] if world == 4 else ["odd_dp1_tp2"]),
                        timeout=900, backend="nccl")  # fmt: skip
    check_results(results)
    failures = [f"rank {r} {name}:\n{err}" for r, res in enumerate(results) for name, err in res.items() if err]
    assert not failures, "\n".join(failures)


def test_nccl_expert_parallel():
    """FSDP + EP (tests/test_expert_parallel.py's scenarios) with NCCL: the
    model's all-to-alls with data-dependent splits on the ep group beside
    fxshard's collectives on dp and efsdp; at (efsdp 2, ep 2) and ep 4 on 4
    GPUs, at ep 2 on 2: ZeRO-3, 2 and 1, Inductor, bf16, accumulation without
    sync with clipping, activation checkpointing, frozen and no_shard parts."""
    from tests.helpers.ep_parity import run_all as ep_run_all

    world = 4 if torch.cuda.device_count() >= 4 else 2
    names = ["moe", "moe_zero2", "moe_zero1", "moe_inductor", "moe_bf16", "moe_no_sync_clip", "moe_checkpoint", "moe_frozen",
             "moe_no_shard"] + (["moe_ep4"] if world == 4 else [])  # fmt: skip
    results = run_ranks(world, ep_run_all, names, timeout=900, backend="nccl")
    check_results(results)
    failures = [f"rank {r} {name}:\n{err}" for r, res in enumerate(results) for name, err in res.items() if err]
    assert not failures, "\n".join(failures)
