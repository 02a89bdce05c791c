"""Compiled, sharded training matches unsharded training on 1 to 4 gloo ranks."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import check_results, run_ranks, selected
from tests.helpers.parity import SCENARIOS, run_all

# routed_experts runs inside routed_experts_differ, llama_untied_ragged inside
# sharded_lookups, blocks_once inside blocks_once_gathers_again.
INSIDE_CHECKS = ("routed_experts", "llama_untied_ragged", "blocks_once")
CHECKS = [*(name for name in SCENARIOS if name not in INSIDE_CHECKS), "eval_no_grad", "routed_experts_differ",
          "sharded_lookups", "blocks_once_gathers_again"]  # fmt: skip
# CPU time on 2 cores: world size 2 runs every check, inductor (C++ compiles)
# included; 1, 3 and 4 run the checks whose shard layout changes with the
# world size (empty and ragged shards, tied and direct reads, units).
INDUCTOR_WORLD_SIZES = (2,)
LAYOUT_CHECKS = ("llama_tied", "mamba_direct_reads", "uneven_and_empty", "units_small_prefetch2",
                 "uneven_units_prefetch1", "sharded_lookups", "embedding_empty_shard", "zero1", "zero1_uneven")  # fmt: skip
MULTI_RANK_CHECKS = ("sharded_lookups", "embedding_empty_shard")
# HSDP: 4 ranks as 2 x 2; at 2 ranks as 2 x 1 (every parameter whole in each
# replica, so gradients are averaged across replicas only). At 2 x 2 the last
# (bf16, sharded lookups of ragged token counts) runs under [Note: full_cpu]
# and on the GPUs at 2 x 1.
HSDP_CHECKS = ("hsdp", "hsdp_sequenced", "zero1_bf16_hsdp", "hsdp_no_sync_bf16", "hsdp_sync_each", "hsdp_zero2",
               "hsdp_zero2_no_sync", "hsdp_inductor")  # fmt: skip
# A slice of a (dp, tp) mesh: 2 x 2 at 4 ranks, 1 x 2 at 2 (every data-parallel group one rank).
SUBMESH_CHECKS = ("dp_submesh", "dp_submesh_zero1")


# llama_tied_inductor (flat graphs under Inductor, 33 s on 2 cores) runs on the
# GPUs and under [Note: full_cpu]. Inductor still compiles flat graphs here in
# mamba_direct_reads_inductor (its blocks are not outlined) and outlined
# layers in mixed_precision_bf16_inductor.
# accumulate_sync_each and frozen_sharded are today's paths under another
# schedule; accumulate_no_sync_sequenced also reads a replicated layer on the
# sequenced path, as graph_breaks_no_shard does. The GPU gate runs them all.
# no_shard_bf16: replicated reads in outlined layers are also checked in
# test_graph_structure; accumulate_no_sync_uneven (empty shards while
# accumulating) runs under [Note: full_cpu] and on the GPU gate.
# mamba_direct_reads_inductor: Mamba's direct reads run at every world size
# under aot_eager, and Inductor's flat graphs in the zoo's Inductor seeds.
# units_explicit and units_per_param_prefetch0: their unit layouts and
# schedules are checked on graphs in test_graph_structure.
# zero1_inductor: ZeRO-1 reads and reduces under Inductor; the GPU gate runs it (strategies-zero1-*).
# whole_reads_inductor (31 s on 2 cores with a cold Inductor cache): replicated
# reads run by default under aot_eager (no_shard), Inductor by default in
# mixed_precision_bf16_inductor; the GPU gate runs it.
# Each of the next ones repeats, at 2 ranks, what a check kept by default
# makes (10-20 s each on 2 cores): llama_tied_keep_full (uneven_and_empty_keep_full
# keeps full weights), hybrid (its attention, direct reads, grouped experts and
# loss inside forward: llama_tied, mamba_direct_reads, test_torchtitan's
# deepseek_v3 and the Hugging Face models; the GPU gate and the CUDA graph
# tests run it), accumulate_no_sync_mixed (accumulate_no_sync,
# and hsdp's replicated and frozen parameters without sync), mixed_precision_bf16
# (mixed_precision_bf16_inductor), eval_no_grad (test_hf_models'
# hf_eval_changing_lengths, and test_graph_structure's no_grad graph),
# two_forwards_one_backward (test_fsdp2_conformance's double_forward_nested_checkpoint),
# units_small_prefetch2 (small units with prefetch=2 in blocks_once_gathers_again and
# mixed_precision_bf16_inductor; units of flat graphs in accumulate_no_sync; its
# schedule on graphs in test_graph_structure).
FULL_CPU_CHECKS = ("llama_tied_inductor", "zero1_inductor", "accumulate_sync_each", "frozen_sharded", "graph_breaks_no_shard",
                   "no_shard_bf16", "accumulate_no_sync_uneven", "mamba_direct_reads_inductor", "units_explicit",
                   "units_per_param_prefetch0", "llama_tied_keep_full", "hybrid", "accumulate_no_sync_mixed",
                   "mixed_precision_bf16", "eval_no_grad", "two_forwards_one_backward", "units_small_prefetch2",
                   "whole_reads_inductor")  # fmt: skip
# At 2 ranks (2 x 1, and 1 x 2 for hsdp_one_replica and dp_submesh_zero1) hsdp
# runs by default: HSDP without sharding, gradients averaged across replicas
# only (tests/test_fsdp2_conformance.py's hsdp_train_parity counts on it). The
# others add little to it, to 2 x 2 and to the 1-D checks; the GPU gate runs them all.
WS2_FULL_CPU = ("hsdp_no_sync_bf16", "hsdp_sequenced", "hsdp_one_replica", "zero1_bf16_hsdp", "hsdp_sync_each",
                "hsdp_zero2", "hsdp_zero2_no_sync", "hsdp_inductor", "dp_submesh_zero1")  # fmt: skip
# World size 4 is 4 processes on 2 cores: by default it runs only what needs 4
# ranks (empty shards: rank 3 holds none of these parameters' rows; HSDP 2 x 2;
# a 2 x 2 slice); the rest of its layout checks run under [Note: full_cpu] and
# on the GPUs at 2. ZeRO-2's HSDP averages are ZeRO-3's (hsdp), kept through
# backward: hsdp_zero2 runs under [Note: full_cpu]; so does zero1_bf16_hsdp
# (30 s), whose averages across replicas test_graph_structure checks on
# ZeRO-1's graphs. mamba_direct_reads runs at world sizes 1 to 3 (its empty
# conv shard at 4 is uneven_and_empty's, read directly). The 2 x 2 slice
# trains by default in tests/test_tensor_parallel.py (mesh["dp"] of (dp 2, tp 2),
# ZeRO-1 and 3), and tests/test_topology.py checks its side groups on 4 ranks.
WS4_DEFAULT = ("uneven_and_empty", "embedding_empty_shard", "zero1_uneven", "hsdp", "hsdp_sequenced", "hsdp_sync_each")
# World sizes 1 and 3 run, by default, the checks whose layout changes most
# there (empty and ragged shards, tied and direct reads); the unit schedules
# and ZeRO-1 on the full model run at 2.
WS1_WS3_FULL_CPU = ("units_small_prefetch2", "zero1")
# ZeRO-1's ragged and empty shards (zero1_uneven) run at 1, 2 and 4.
WS3_FULL_CPU = ("zero1_uneven",)


def _slower(world_size: int, check: str) -> bool:
    return (
        check in FULL_CPU_CHECKS
        or (world_size == 4 and check not in WS4_DEFAULT)
        or (world_size == 2 and check in WS2_FULL_CPU)
        or (world_size in (1, 3) and check in WS1_WS3_FULL_CPU)
        or (world_size == 3 and check in WS3_FULL_CPU)
    )


def _checks_for(world_size: int) -> list[str]:
    if world_size in INDUCTOR_WORLD_SIZES:
        return CHECKS
    # Ranks must route differently, and lookups are sharded only across ranks:
    # world size 1 has nothing to compare. The lookup checks run at 2 and 4
    # (uneven rows at both, an empty shard at 4).
    checks = [c for c in LAYOUT_CHECKS if world_size == 4 or c not in MULTI_RANK_CHECKS]
    four = (*HSDP_CHECKS, *SUBMESH_CHECKS) if world_size == 4 else ()
    return checks + (["routed_experts_differ"] if world_size > 1 else []) + list(four)


def _cases() -> list:
    """(world size, check): a test for each check at each world size it runs at."""
    return [
        pytest.param(ws, check, id=f"ws{ws}-{check}", marks=[pytest.mark.full_cpu] if _slower(ws, check) else [])
        for ws in (1, 2, 3, 4)
        for check in _checks_for(ws)
    ]


@pytest.fixture(scope="module")
def parity_run(request):
    """Every selected check of one world size, in one set of ranks."""
    world_size = request.param
    results = run_ranks(world_size, run_all, selected(request, "check", parity_run=world_size), timeout=900)
    check_results(results)
    return results


@pytest.mark.parametrize("parity_run, check", _cases(), indirect=["parity_run"], scope="module")
def test_matches_unsharded_reference(parity_run, check):
    failures = [f"rank {r}:\n{res[check]}" for r, res in enumerate(parity_run) if res[check] is not None]
    assert not failures, "\n".join(failures)
