"""FSDP + EP (see [Note: expert-parallel parameters]): parity against an
unsharded reference and FSDP2 + the same EP plan on gloo ranks, and the
combinations fxshard refuses, each with a clear error."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import fxshard
from fxshard.runtime import compat
from tests.conftest import _reset
from tests.helpers import ep_models
from tests.helpers.distributed import check_results, run_ranks, selected
from tests.helpers.ep_parity import run_all

# CPU time on 2 cores: 4 ranks at (ep 2, efsdp 2) under ZeRO-3 (aot_eager),
# 3 steps, where the routing leaves some expert of some EP rank without
# tokens, the same-init check per EP coordinate, the dump's marks of the
# all-to-alls, and fxshard.cuda_graph's refusal. Under [Note: full_cpu]:
# ZeRO-2 and ZeRO-1, Inductor, ep 4 (efsdp of one rank), bf16 mixed precision,
# accumulation without sync with clipping over both meshes, activation
# checkpointing, frozen expert and non-expert parameters, no_shard beside
# the experts, DCP across EP sizes, without EP and into FSDP2, and
# torchtitan's own Qwen3-MoE and DeepSeek-V3 with its AllToAllTokenDispatcher
# (tests/helpers/ep_torchtitan.py; about 3 minutes each on 2 shared cores:
# a whole decoder's compile on 4 ranks).
DEFAULT = {4: ("moe", "different_init", "dump_marks", "cuda_graph_refuses")}
FULL_CPU = {4: ("moe_zero2", "moe_zero1", "moe_inductor", "moe_ep4", "moe_bf16", "moe_no_sync_clip", "moe_checkpoint",
                "moe_frozen", "moe_no_shard", "dcp", "qwen3_moe", "deepseek_v3")}  # fmt: skip


def _cases() -> list:
    return [pytest.param(ws, name, id=f"ws{ws}-{name}", marks=[pytest.mark.full_cpu] if slow else [])
            for ws in (4,) for slow, names in ((False, DEFAULT[ws]), (True, FULL_CPU[ws])) for name in names]  # fmt: skip


@pytest.fixture(scope="module")
def ep_run(request):
    """Every selected scenario of one world size, in one set of ranks."""
    world_size = request.param
    results = run_ranks(world_size, run_all, selected(request, "name", ep_run=world_size), timeout=900)
    check_results(results)
    return results


@pytest.mark.parametrize("ep_run, name", _cases(), indirect=["ep_run"], scope="module")
def test_matches_reference_and_fsdp2(ep_run, name):
    failures = [f"rank {r}:\n{res[name]}" for r, res in enumerate(ep_run) if res[name] is not None]
    assert not failures, "\n".join(failures)


# Refusals: on a fake process group of 4 ranks, before anything is sharded.


@pytest.fixture(scope="module")
def fake_pg():
    _reset()
    dist.init_process_group("fake", store=compat.fake_store(), rank=0, world_size=4)
    yield 4
    _reset()


def _meshes():
    dense = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
    sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    return dense, sparse


def test_experts_need_the_expert_mesh(fake_pg):
    dense, sparse = _meshes()
    model = ep_models.parallelize(ep_models.MoEDecoder(layers=1), sparse["ep"])
    with pytest.raises(ValueError, match=r"expert parallelism.*expert_mesh=sparse\['efsdp'\]"):
        fxshard.compile(model, dense["dp"])


def test_expert_mesh_needs_experts(fake_pg):
    dense, sparse = _meshes()
    with pytest.raises(ValueError, match="no parameter is a DTensor on a mesh inside"):
        fxshard.compile(ep_models.MoEDecoder(layers=1), dense["dp"], expert_mesh=sparse["efsdp"])


def test_expert_mesh_must_complete_the_data_parallel_mesh(fake_pg):
    """efsdp x ep must be the data-parallel group: here ep's ranks with the whole dp mesh again."""
    dense, sparse = _meshes()
    model = ep_models.parallelize(ep_models.MoEDecoder(layers=1), sparse["ep"])
    with pytest.raises(ValueError, match="must be dimensions of one mesh|must cover exactly"):
        fxshard.compile(model, dense["dp"], expert_mesh=dense["dp"])


@pytest.mark.parametrize("kwargs, match", [(dict(backend="eager"), "backend='eager'")])
def test_refuses_what_is_not_supported_yet(fake_pg, kwargs, match):
    dense, sparse = _meshes()
    model = ep_models.parallelize(ep_models.MoEDecoder(layers=1), sparse["ep"])
    with pytest.raises(NotImplementedError, match=match):
        fxshard.compile(model, dense["dp"], expert_mesh=sparse["efsdp"], **kwargs)


def test_refuses_no_shard_experts(fake_pg):
    """Experts kept whole (no_shard of the MoE, or of the whole model) are
    refused, naming the fix; no_shard of plain modules beside them trains
    (ep_parity's moe_no_shard)."""
    dense, sparse = _meshes()
    model = ep_models.parallelize(ep_models.MoEDecoder(layers=1), sparse["ep"])
    fxshard.no_shard(model.layers[0].moe)
    with pytest.raises(ValueError, match=r"expert-parallel parameter 'layers.0.moe.experts.inner.w1' would be kept "
                                         r"replicated.*leave it unmarked"):  # fmt: skip
        fxshard.compile(model, dense["dp"], expert_mesh=sparse["efsdp"])
