"""FSDP + TP (see [Note: tensor-parallel parameters]): parity against an
unsharded reference and FSDP2 + the same TP plan on gloo ranks, and the
combinations fxshard refuses, each with a clear error."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

import fxshard
from fxshard.runtime import compat
from tests.conftest import _reset
from tests.helpers import tp_models
from tests.helpers.distributed import check_results, run_ranks, selected
from tests.helpers.tp_parity import run_all

# CPU time on 2 cores: 4 ranks run, in one set of ranks, a 1-layer Llama
# plan with sequence parallelism at (dp 2, tp 2) under ZeRO-3 and the odd
# sizes under ZeRO-1 (an empty shard), frozen TP parameters under the
# default shard_frozen=False, loss parallelism (vocab-sharded logits) and
# the dump's marks. Under [Note: full_cpu]: the odd sizes under ZeRO-2 (ZeRO-3's
# reads kept through backward; tests/test_zoo.py's drawn strategies train
# ZeRO-2), the plan without sequence parallelism, at two layers, under Inductor, ZeRO-2, bf16
# and activation checkpointing; small units with prefetch, sequenced reads,
# frozen TP parameters, dp 1 at tp 4 (a TP piece of 0 rows, which FSDP2
# fails), accumulation without sync with clipping, DCP across TP sizes,
# sequence and loss parallelism under Inductor, the Llama plan under ZeRO-1, (dp 1, tp 2) at 2 ranks,
# and HSDP + TP at (2, 2, 2) on 8 ranks, DCP included.
DEFAULT = {
    4: ("llama_sp", "odd_zero1", "odd_frozen_default", "llama_loss_parallel", "dump_marks"),
    2: (),
    8: (),
}
FULL_CPU = {4: ("odd_zero2", "llama", "llama_2_layers", "llama_zero2", "llama_inductor", "llama_bf16", "llama_bf16_inductor",
                "llama_checkpoint", "odd_units", "odd_eager", "odd_frozen", "odd_dp1_tp4", "llama_no_sync_clip",
                "dcp", "llama_sp_loss_parallel", "llama_zero1"), 2: ("odd_dp1_tp2",), 8: ("llama_hsdp", "odd_hsdp", "dcp_hsdp")}  # fmt: skip


def _cases() -> list:
    return [pytest.param(ws, name, id=f"ws{ws}-{name}", marks=[pytest.mark.full_cpu] if slow else [])
            for ws in (4, 2, 8) for slow, names in ((False, DEFAULT[ws]), (True, FULL_CPU[ws])) for name in names]  # fmt: skip


@pytest.fixture(scope="module")
def tp_run(request):
    """Every selected scenario of one world size, in one set of ranks."""
    world_size = request.param
    results = run_ranks(world_size, run_all, selected(request, "name", tp_run=world_size), timeout=900)
    check_results(results)
    return results


@pytest.mark.parametrize("tp_run, name", _cases(), indirect=["tp_run"], scope="module")
def test_matches_reference_and_fsdp2(tp_run, name):
    failures = [f"rank {r}:\n{res[name]}" for r, res in enumerate(tp_run) if res[name] is not None]
    assert not failures, "\n".join(failures)


# Refusals: on a fake process group of 4 ranks, before anything is sharded.


@pytest.fixture(scope="module")
def fake_pg():
    """One fake world for every refusal: DTensor's sharding cache keys specs
    by mesh layout, not process group, so a parameter that parallelize_module
    made in a later world came back on the mesh of a destroyed one (torch 2.13)."""
    _reset()
    dist.init_process_group("fake", store=compat.fake_store(), rank=0, world_size=4)
    yield 4
    _reset()


def _tp_model(mesh) -> nn.Module:
    return tp_models.parallelize(tp_models.OddMLP(), mesh["tp"])


def _mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def test_refuses_replicated_tp_parameters(fake_pg):
    mesh = _mesh()
    model = _tp_model(mesh)
    fxshard.no_shard(model.a)
    with pytest.raises(ValueError, match=r"'a.weight' would be kept replicated.*\(fxshard.no_shard"):
        fxshard.compile(model, mesh["dp"])


@pytest.mark.parametrize("which", ["full", "tp", None])
def test_names_the_data_parallel_mesh(fake_pg, which):
    """The whole (dp, tp) mesh (taken for HSDP), the TP mesh itself, or none."""
    mesh = _mesh()
    given = {"full": mesh, "tp": mesh["tp"], None: None}[which]
    match = "pass the data-parallel mesh" if which is None else r"already sharded over the mesh passed.*mesh\['dp'\]"
    with pytest.raises(ValueError, match=match):
        fxshard.compile(_tp_model(mesh), given)


def test_refuses_a_mesh_not_covering_every_rank(fake_pg):
    mesh = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("pp", "dp", "tp"))
    with pytest.raises(ValueError, match="cover 2 of the 4 ranks"):
        fxshard.compile(_tp_model(mesh), mesh["dp"])


def test_refuses_2d_tp_and_several_tp_meshes(fake_pg):
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("dp", "ep", "tp"))
    model = tp_models.OddMLP()
    model.a.weight = nn.Parameter(distribute_tensor(model.a.weight.detach(), mesh["ep", "tp"], [Shard(0), Shard(1)]))
    with pytest.raises(ValueError, match="1-D TP mesh"):
        fxshard.compile(model, mesh["dp"])
    model = parallelize_module(tp_models.OddMLP(), mesh["tp"], {"a": ColwiseParallel()})
    parallelize_module(model, mesh["ep"], {"c": ColwiseParallel()})
    with pytest.raises(ValueError, match="one TP mesh"):
        fxshard.compile(model, mesh["dp"])


@pytest.mark.parametrize("placement", [Partial(), "strided"])
def test_refuses_partial_and_strided_parameters(fake_pg, placement):
    mesh = _mesh()
    model = tp_models.OddMLP()
    placement = compat.strided_shard(0, 2) if placement == "strided" else placement
    local = model.a.weight.detach()
    model.a.weight = nn.Parameter(DTensor.from_local(local, mesh["tp"], [placement]))
    with pytest.raises(ValueError, match=r"'a.weight' is a DTensor placed .*Shard\(k\) or Replicate\(\)"):
        fxshard.compile(model, mesh["dp"])


def test_refuses_fsdp2_models(fake_pg):
    mesh = _mesh()
    model = fully_shard(_tp_model(mesh), mesh=mesh["dp"])
    with pytest.raises(ValueError, match="already sharded by FSDP2's fully_shard"):
        fxshard.compile(model, mesh["dp"])


def test_refuses_meta_device_tp_parameters(fake_pg):
    mesh = _mesh()
    with torch.device("meta"):
        model = tp_models.OddMLP()
    model = parallelize_module(model, mesh["tp"], {"a": ColwiseParallel()})
    with pytest.raises(ValueError, match="meta device"):
        fxshard.compile(model, mesh["dp"])


# One rank, a (1, 1) mesh: the paths of a compiled model that need no peers.


@pytest.fixture
def one_rank(no_dist):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    full = tp_models.OddMLP()
    model = tp_models.OddMLP()
    model.load_state_dict(full.state_dict())
    return fxshard.compile(_tp_model_of(model, mesh), mesh["dp"], backend="aot_eager"), full


def _tp_model_of(model, mesh):
    return tp_models.parallelize(model, mesh["tp"])


def test_one_rank_reads_writes_and_describes(one_rank):
    model, full = one_rank
    x = torch.randn(3, 6)
    torch.testing.assert_close(model(x), full(x))
    # Outside a root call a TP parameter reads as its shard, as under FSDP2.
    assert model.a.weight is model.get_parameter("a.weight")
    assert model.a.weight.device_mesh.mesh_dim_names == ("dp", "tp")
    # A full state dict loads into the pieces, and nn.init writes through them.
    with torch.no_grad():
        full.a.weight.mul_(2)
    model.load_state_dict(full.state_dict())
    torch.testing.assert_close(model.a.weight.full_tensor(), full.a.weight)
    torch.manual_seed(1)
    torch.nn.init.normal_(model.c.weight)
    torch.manual_seed(1)
    torch.testing.assert_close(model.c.weight.full_tensor(), torch.nn.init.normal_(torch.empty(11, 6)))
    described = [p.describe() for p in model.fxshard_plan.params]
    assert "a.weight [10, 6] (TP-local [10, 6]) float32: (Shard(0), Shard(dim=0) on tp (1))," in described[0], described


def test_one_rank_debug_dump(no_dist, tmp_path):
    """The dump of a TP model: its plan names each parameter's placements on (dp, tp)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    model = fxshard.compile(_tp_model_of(tp_models.OddMLP(), mesh), mesh["dp"], backend="aot_eager",
                            debug_dir=tmp_path)  # fmt: skip
    model(torch.randn(3, 6)).sum().backward()
    plan = (tmp_path / "rank0" / "plan.txt").read_text()
    assert "b.weight [6, 10] (TP-local [6, 10]) float32: (Shard(0), Shard(dim=1) on tp (1))" in plan, plan
    assert "d.weight [6, 11] float32: Shard(0)" in plan, plan  # a plain parameter beside them
    assert len(list((tmp_path / "rank0").iterdir())) > 1  # the graphs' dumps beside the plan


def test_one_rank_cuda_graph_refuses(one_rank):
    from fxshard import graphs

    model, _ = one_rank
    with pytest.raises(ValueError, match="tensor-parallel parameters"):
        graphs.CapturedStep(lambda: None, 1)._check_ran([model], [])


def test_tp_ranks_form_the_same_units():
    """Uneven TP pieces (66 and 65 rows of a vocab of 131) count alike, so
    both TP ranks close a unit (and its reduce groups, of a quarter of the
    unit's size) at the same parameter: in a unit of at most 5230 bytes,
    the embedding's share (4192 bytes) and ``w`` (1024) fit, where the
    66-row piece counted as itself (4224) would leave ``w`` out."""
    from fxshard.passes.units import form_units
    from fxshard.runtime.plans import Param
    from fxshard.runtime.tensor_parallel import TPLayout
    from tests.helpers import records

    formed = []
    for coordinate, rows in ((0, 66), (1, 65)):
        layout = TPLayout(("tp",), 2, coordinate, (Shard(0),), (131, 16), (16, 1))
        embed = records.param(0, "embed", (rows, 16), -(-rows // 2))
        embed = Param(0, dataclasses.replace(embed.plan, tp=layout), embed.local_rows, embed.shard)
        params = {"embed": embed, "w": records.param(1, "w", (16, 16), 8)}
        formed.append([[[p.fqn for p in group] for group in unit] for unit in form_units(params, ["embed", "w"], 5230)])
    assert formed[0] == formed[1] == [[["embed"], ["w"]]], formed
