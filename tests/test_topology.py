"""The mesh is read once, into a Topology (see [Note: topology])."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import fxshard
from fxshard.runtime import compat
from fxshard.runtime.topology import Topology
from tests.conftest import _reset
from tests.helpers import models
from tests.helpers.distributed import check_results, run_ranks


@pytest.fixture
def fake_world():
    """A fake process group of ``n`` ranks (this process is rank 5 where it has one)."""

    def init(n: int) -> None:
        _reset()
        dist.init_process_group("fake", store=compat.fake_store(), rank=min(5, n - 1), world_size=n)

    yield init
    _reset()


def test_hsdp_mesh_names_each_group_once(fake_world):
    fake_world(8)
    mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
    topology = Topology.from_mesh(mesh)
    assert (topology.shard.size, topology.shard.rank) == (4, 1)  # rank 5 is (1, 1)
    assert topology.shard.name == mesh.get_group("shard").group_name
    assert (topology.replicas.size, topology.replicas.group_name) == (2, mesh.get_group("replicate").group_name)
    assert (topology.world.size, topology.world.rank) == (8, 5)
    assert topology.placements(sharded=True) == [Replicate(), Shard(0)]
    assert topology.placements(sharded=False) == [Replicate(), Replicate()]
    assert topology.rows(10) == slice(3, 6) and topology.rows(10, sharded=False) == slice(0, 10)
    assert topology.rows(2) == slice(1, 2) and topology.rows(1) == slice(1, 1)  # uneven: a rank may hold none
    assert not topology.shard.moves_data and topology.agreement() is None  # the fake group moves nothing
    # Side groups: one per mesh group and kind, whatever the number of topologies read from it.
    again = Topology.from_mesh(mesh)
    reduce = topology.reduce_group()
    assert again.reduce_group() == reduce != topology.shard.name
    assert dist.get_process_group_ranks(compat.resolve_group(reduce)) == [4, 5, 6, 7]


def test_one_replica_and_1d_meshes_have_no_replicas(fake_world):
    fake_world(4)
    one = Topology.from_mesh(init_device_mesh("cpu", (1, 4), mesh_dim_names=("replicate", "shard")))
    flat = Topology.from_mesh(init_device_mesh("cpu", (4,)))
    assert one.replicas is None and flat.replicas is None
    assert flat.placements(sharded=True) == [Shard(0)] and flat.world.size == flat.shard.size == 4


@pytest.mark.parametrize(
    "shape, names, error",
    [
        ((2, 2, 2), ("a", "b", "c"), "got a 3-D mesh"),
        ((2, 4), None, "needs named dimensions"),
    ],
)
def test_meshes_fxshard_cannot_use_are_refused_with_the_fix(fake_world, shape, names, error):
    fake_world(8)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    with pytest.raises(ValueError, match=error):
        fxshard.compile(models.TinyLlama(), mesh, backend="aot_eager")


def test_the_plan_keeps_the_topology_it_was_built_on(fake_world):
    fake_world(4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = fxshard.compile(models.TinyLlama(), mesh, backend="aot_eager")
    plan = model.fxshard_plan
    assert plan.mesh is mesh and plan.shard_mesh.size() == 2 == plan.topology.shard.size
    assert {(p.world_size, p.group_name, p.replicas) for p in plan.params} == {(2, plan.topology.shard.name, 2)}


def test_a_slice_of_a_larger_mesh_needs_ranks_that_move_data(fake_world):
    fake_world(8)
    mesh = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    with pytest.raises(ValueError, match="fake process group cannot tell"):
        Topology.from_mesh(mesh["dp"])


def _slice_groups(rank: int, world_size: int) -> tuple:
    topology = Topology.from_mesh(init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["dp"])
    ranks = dist.get_process_group_ranks
    (names, check), *_ = topology.check_groups()
    return (topology.shard.size, topology.world.size, ranks(compat.resolve_group(topology.reduce_group())),
            ranks(check), topology.rows(5))  # fmt: skip


def test_a_slice_of_a_larger_mesh_makes_side_groups_beside_each_slice():
    """mesh["dp"] of a (dp 2, tp 2) mesh: ranks 0 and 2 are one data-parallel
    group, 1 and 3 another; each side group is made beside each slice's own."""
    results = run_ranks(4, _slice_groups)
    check_results(results)
    for rank, (shard, world, reduce, check, rows) in enumerate(results):
        mine = [rank % 2, rank % 2 + 2]
        assert (shard, world, reduce, check) == (2, 2, mine, mine)
        assert rows == (slice(0, 3) if rank < 2 else slice(3, 5))


def _hsdp_slice_groups(rank: int, world_size: int) -> tuple:
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    topology = Topology.from_mesh(mesh["dp_replicate", "dp_shard"])
    ranks = dist.get_process_group_ranks
    (_, shard_check), (_, replicate_check) = topology.check_groups()
    return (topology.replicas.size, ranks(topology.world.pg), ranks(compat.resolve_group(topology.reduce_group())),
            ranks(shard_check), ranks(replicate_check))  # fmt: skip


@pytest.mark.full_cpu  # 8 processes: the 2-D slice above covers the gathered groups by default
def test_an_hsdp_slice_of_a_3d_mesh_makes_side_groups_beside_each_slice():
    """mesh["dp_replicate", "dp_shard"] of a (2, 2, 2) mesh with tp last
    (rank = 4 r + 2 s + t): each tp coordinate's four ranks are one HSDP
    group; shard groups run along s, replicate groups along r."""
    results = run_ranks(8, _hsdp_slice_groups)
    check_results(results)
    for rank, (replicas, world, reduce, shard_check, replicate_check) in enumerate(results):
        r, s, t = rank // 4, rank // 2 % 2, rank % 2
        shard = [4 * r + t, 4 * r + 2 + t]
        assert (replicas, world, reduce, shard_check) == (2, [t, 2 + t, 4 + t, 6 + t], shard, shard)
        assert replicate_check == [2 * s + t, 4 + 2 * s + t]
