"""The mesh, read once: which ranks shard, replicate and agree with each other.

[Note: topology]
``fxshard.compile`` takes a ``DeviceMesh`` and builds one ``Topology`` from
it (``Topology.from_mesh``), in the spirit of FSDP2's mesh-info records and
torchtitan's ``ParallelDims``. This module is the only code that reads a
mesh's dimensions, ranks or groups, or calls ``torch.distributed.new_group``;
everything else takes the topology, or the plain names and sizes it gives:
- ``shard``: the group parameters are sharded over, the mesh's last
  dimension (the mesh itself if 1-D). Gathers, reduce-scatters and the
  sharded embedding exchange run on it. ``rows`` says which rows of a
  parameter this rank holds on it: shards are cut, and full values written
  into them, by that answer (a ``ShardParameter`` keeps its own). Ops that
  get only a group's size and rank in their signature ask ``shard_range``,
  which ``rows`` delegates to.
- ``replicas``: HSDP's replicate dimension, the first of a 2-D (replicate,
  shard) mesh; None on a 1-D mesh or with one replica. Each reduced
  gradient is averaged across it (see [Note: HSDP]).
- ``world``: every rank of the mesh. Ranks check that they hold the same
  model, and agree on each graph's collectives, over it.
- side groups over the shard group's ranks, made on first use and shared by
  every compile on the same mesh group (``reduce_group``, ``count_group``,
  ``check_groups``): a new NCCL communicator per compile would hold GPU
  memory for the life of the process.
- ``tensor_parallel``: the TP meshes of parameters that are already
  DTensors (see [Note: tensor-parallel parameters]), each with the (dp, tp)
  mesh their shards live on; checked here to be orthogonal slices of one
  mesh whose ranks they cover together with the data-parallel mesh.
- ``experts``: with expert parallelism, the group expert parameters are
  sharded over (torchtitan's ``efsdp``: the ranks of this rank's
  data-parallel group that hold its experts), and their EP mesh is one of
  ``tensor_parallel``, marked ``expert``, whose (efsdp, ep) mesh covers the
  data-parallel group instead of the world (see [Note: expert-parallel
  parameters]).
The mesh may be a slice of a larger one, ``mesh["dp"]`` of a (dp, tp) mesh,
as FSDP2 takes it: each rank's slice holds only its own coordinate's ranks,
so ``from_mesh`` gathers every rank's groups (one collective over all
ranks, which every rank must enter, as it must enter ``new_group``) and
checks that the slices split the world.
The passes and the runtime's collectives take group names and sizes, plain
values, not this object: they are traced into graphs and compared across
ranks as text.

The mesh itself stays the parameters' home: their DTensors are built on it
(``placements`` gives where a parameter's shard lies), and ``fxshard_plan.mesh``
is the user's.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard

from fxshard.runtime import compat, rank_checks
from fxshard.runtime.collectives import Replicas, shard_range
from fxshard.runtime.tensor_parallel import TPLayout


@dataclass(frozen=True)
class Group:
    """One process group: its c10d name, size, this rank's index in it, and
    the group itself (for eager collectives that take one)."""

    name: str
    size: int
    rank: int
    pg: Any = None

    @staticmethod
    def of(mesh: DeviceMesh, dim: int = 0) -> Group:
        pg = mesh.get_group(dim)
        return Group(pg.group_name, mesh.size(dim), mesh.get_local_rank(dim), pg)

    @property
    def backend(self) -> str:
        return compat.group_backend(self.name)

    @property
    def moves_data(self) -> bool:
        """More than one rank, and not the fake group (tracing at large world
        sizes), which moves nothing: there is something to exchange or compare."""
        return self.size > 1 and self.backend != "fake"


@dataclass(frozen=True, eq=False)
class TPMesh:
    """The TP mesh of tensor-parallel parameters (see [Note: tensor-parallel
    parameters]) and the (dp, tp) mesh their shards live on."""

    mesh: DeviceMesh  # 1-D, the parameters' own
    spmd: DeviceMesh  # the data-parallel mesh's dimensions, then the TP mesh's
    # An EP mesh: its ranks lie inside the data-parallel group, and its
    # parameters are sharded over ``Topology.experts`` (see [Note:
    # expert-parallel parameters]); ``spmd`` is then (efsdp, ep).
    expert: bool = False

    @property
    def dims(self) -> tuple[str, ...]:
        return tuple(self.mesh.mesh_dim_names)


# Side groups made so far, per shard (or replicate) process group and kind.
_SIDE_GROUPS: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
# Compiles so far per world group: every rank compiles the same models in the
# same order, so the count names a model's keys in the store alike on every rank.
_COMPILES: dict[str, int] = {}


@dataclass(frozen=True, eq=False)
class Topology:
    """See [Note: topology]."""

    mesh: DeviceMesh  # the user's: parameters' DTensors live on it
    device: torch.device  # this rank's device of the mesh: where its shards live
    shard: Group
    replicas: Replicas | None
    world: Group
    _shard_mesh: DeviceMesh
    # The ranks of every shard group and of every replicate group of the
    # world, this rank's or not: ``new_group`` is collective over all ranks,
    # so a side group beside this rank's is made beside every rank's.
    _shard_groups: list[list[int]]
    _replicate_groups: list[list[int]]
    tensor_parallel: tuple[TPMesh, ...] = ()
    # Expert parallelism: the group expert parameters are sharded over, and
    # the user's mesh of it (its side groups are made from every rank's).
    experts: Group | None = None
    _expert_mesh: DeviceMesh | None = None

    @staticmethod
    def from_mesh(mesh: DeviceMesh, tp_params: tuple[tuple[str, Any], ...] = (),
                  expert_mesh: DeviceMesh | None = None) -> Topology:  # fmt: skip
        """Validate ``mesh`` and the TP meshes of ``tp_params``, the (name,
        parameter) pairs that are DTensors (raising ``ValueError`` that
        names the fix), and read them. Those whose mesh lies inside the
        data-parallel group are expert-parallel: sharded over ``expert_mesh``
        (see [Note: expert-parallel parameters])."""
        if not isinstance(mesh, DeviceMesh):
            raise ValueError(f"mesh must be a torch.distributed DeviceMesh or None, got {type(mesh).__name__}")
        if mesh.ndim not in (1, 2):
            raise ValueError(
                f"mesh must be 1-D (shard over it) or 2-D (replicate, shard) for HSDP, got a {mesh.ndim}-D mesh "
                f"{tuple(mesh.shape)}; pass the data-parallel submesh, e.g. mesh['dp'] or mesh['replicate', 'shard']"
            )
        if mesh.ndim == 2 and mesh.mesh_dim_names is None:
            raise ValueError(
                "a 2-D (HSDP) mesh needs named dimensions, replicate first: "
                "init_device_mesh(device_type, (replicas, shards), mesh_dim_names=('replicate', 'shard'))"
            )
        if mesh.device_type != "cpu" and torch.accelerator.is_available():
            device = torch.device(mesh.device_type, torch.accelerator.current_device_index())
        else:
            device = torch.device(mesh.device_type)
        shard_mesh = mesh if mesh.ndim == 1 else mesh[mesh.mesh_dim_names[1]]
        replicas = None
        if mesh.ndim == 2 and mesh.size(0) > 1:
            replicas = Replicas(mesh.size(0), mesh.get_group(0).group_name)
        world = Group.of(compat.flat_mesh(mesh))
        ep_params, tp_params = _split_expert_params(mesh, world, tp_params, expert_mesh)
        tensor_parallel = tuple(_tp_mesh(mesh, tp) for tp in _tp_meshes(tp_params))
        experts = None
        if ep_params:
            tensor_parallel += (_ep_mesh(mesh, world, _tp_meshes(ep_params), expert_mesh),)
            experts = Group.of(expert_mesh)
        groups = _groups_of_every_rank(mesh)
        return Topology(mesh, device, Group.of(shard_mesh), replicas, world, shard_mesh,
                        groups[-1], groups[0], tensor_parallel, experts, expert_mesh if ep_params else None)  # fmt: skip

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh parameters are sharded over (DTensor APIs take it)."""
        return self._shard_mesh

    def placements(self, sharded: bool, tp: TPLayout | None = None) -> list[Placement]:
        """A parameter's DTensor placements on ``mesh``: replicated on every
        dimension but the shard dimension, where it is sharded on dim 0 or whole.
        A tensor-parallel one's (``tp``) on ``spmd_mesh(tp)``: FSDP2's, its
        TP placements after the shard dimension's, which is a
        ``_StridedShard`` where TP already shards dim 0 (see [Note:
        tensor-parallel parameters])."""
        outer: list[Placement] = [Replicate()] * (self.mesh.ndim - 1 if tp is None or not tp.expert else 0)
        if tp is None:
            return [*outer, Shard(0) if sharded else Replicate()]
        dp: Placement = Replicate()
        if sharded:
            dp = compat.strided_shard(0, tp.size) if tp.strided else Shard(0)
        return [*outer, dp, *tp.placements]

    def spmd_mesh(self, tp: TPLayout | None) -> DeviceMesh:
        """The mesh a parameter's shard lives on: ``mesh``, or for a
        tensor-parallel one, ``mesh`` and its TP mesh concatenated."""
        return self.mesh if tp is None else self.tp_mesh(tp.mesh_dims).spmd

    def tp_coordinates(self) -> tuple[tuple[int, int], ...]:
        """This rank's (index, size) on each TP mesh: ranks of one
        data-parallel group hold the same pieces, of one TP group not; with
        expert parallelism, its (index, size) in ``experts`` too."""
        experts = ((self.experts.rank, self.experts.size),) if self.experts is not None else ()
        return tuple((t.mesh.get_local_rank(), t.mesh.size()) for t in self.tensor_parallel) + experts

    def expert_coordinate(self) -> int:
        """This rank's index on the EP mesh (0 without one): ranks of one
        coordinate hold the same experts."""
        return next((t.mesh.get_local_rank() for t in self.tensor_parallel if t.expert), 0)

    def tp_mesh(self, dims: tuple[str, ...]) -> TPMesh:
        return next(t for t in self.tensor_parallel if t.dims == dims)

    def tp_layout(self, param: Any) -> TPLayout:
        """A DTensor parameter's layout on its TP mesh (one of ``tensor_parallel``)."""
        tp = self.tp_mesh(tuple(param.device_mesh.mesh_dim_names))
        return TPLayout(tp.dims, tp.mesh.size(), tp.mesh.get_local_rank(), tuple(param.placements),
                        tuple(param.shape), tuple(param.stride()), tp.expert)  # fmt: skip

    def is_expert(self, param: Any) -> bool:
        """Whether ``param`` (before sharding) is a DTensor on the EP mesh (see
        [Note: expert-parallel parameters])."""
        names = tuple(getattr(param, "device_mesh", None) and param.device_mesh.mesh_dim_names or ())
        return any(t.expert and t.dims == names for t in self.tensor_parallel)

    def sharded_over(self, tp: TPLayout | None) -> Group:
        """The group a parameter is sharded over: the shard group, or an
        expert parameter's ``experts`` (see [Note: expert-parallel parameters])."""
        if tp is not None and tp.expert:
            assert self.experts is not None, f"rank {self.world.rank}: an expert parameter without experts"
            return self.experts
        return self.shard

    def piece(self, tp: TPLayout) -> tuple[slice, ...]:
        """Where this rank's TP-local tensor lies in the full parameter: on
        each dimension TP shards, DTensor's ``torch.chunk`` split, the same
        rule as ``rows`` (see [Note: tensor-parallel parameters])."""
        index = [slice(None)] * len(tp.shape)
        for placement in tp.placements:
            if placement.is_shard():
                dim = placement.dim % len(tp.shape)
                index[dim] = slice(*shard_range(tp.shape[dim], tp.size, tp.coordinate))
        return tuple(index)

    def rows(self, dim0: int, sharded: bool = True, tp: TPLayout | None = None) -> slice:
        """The rows of a parameter's ``dim0`` rows that this rank holds: its
        shard's on the group it is sharded over (``shard_range``; possibly
        none), or all of them for a parameter that is not sharded."""
        if not sharded:
            return slice(0, dim0)
        group = self.sharded_over(tp)
        return slice(*shard_range(dim0, group.size, group.rank))

    def reduce_group(self) -> str:
        """The group the reduce-scatters run on: the shard group's ranks again,
        on a communicator (an NCCL stream) of their own, so that they overlap
        the all-gathers of the backward."""
        return self.shard.name if self.shard.size == 1 else self._shard_side_group("reduce").group_name

    def expert_reduce_group(self) -> str:
        """``reduce_group`` of the group expert parameters are sharded over:
        collective over every rank where it is made (``_groups_of_every_rank``)."""
        assert self.experts is not None and self._expert_mesh is not None, f"rank {self.world.rank}: no experts"
        if self.experts.size == 1:
            return self.experts.name
        return _side_group(self.experts.pg, "reduce", _groups_of_every_rank(self._expert_mesh)[0], None).group_name

    def count_group(self) -> str:
        """A CPU group over the shard group's ranks, on which sharded embedding
        lookups compare token counts without touching the device stream (see
        [Note: sharded lookups]): the shard group itself where it is gloo, a
        gloo group beside it otherwise, and "" for the fake group, which moves no data."""
        if self.shard.backend == "fake":
            return ""
        if self.shard.backend == "gloo":
            return self.shard.name
        return self._shard_side_group("count", backend="gloo").group_name

    def check_groups(self) -> list[tuple[list[str], Any]]:
        """For FXSHARD_CHECK_COLLECTIVES (see [Note: checked collectives]):
        each group fxshard's collectives run on, with the gloo group over the
        same ranks that compares them first. Empty where nothing moves."""
        if not self.shard.moves_data:
            return []
        checked = [([self.shard.name, self.reduce_group()], self._shard_side_group("check", backend="gloo"))]
        if self.replicas is not None:
            replicate = _side_group(self.mesh.get_group(0), "check", self._replicate_groups, "gloo")
            checked.append(([self.replicas.group_name], replicate))
        return checked

    def agreement(self) -> rank_checks.GraphAgreement | None:
        """What compares each graph's collectives across ranks before it first
        runs (see [Note: ranks agree on each graph]): over every rank of the
        mesh, replicas included, since their gradients are averaged together.
        None where there is nothing to compare."""
        if not self.world.moves_data:
            return None
        n = _COMPILES[self.world.name] = _COMPILES.get(self.world.name, -1) + 1
        return rank_checks.GraphAgreement(compat.default_store(), f"fxshard/graphs/{self.world.name}/{n}",
                                          self.world.rank, self.world.size)  # fmt: skip

    def _shard_side_group(self, kind: str, backend: str | None = None) -> Any:
        """The ``kind`` group over the ranks of this rank's shard group."""
        return _side_group(self.shard.pg, kind, self._shard_groups, backend)


def _tp_meshes(params: tuple[tuple[str, Any], ...]) -> tuple[DeviceMesh, ...]:
    """The meshes of the DTensor parameters ``params``, each once, by
    dimension names; one at most (see [Note: tensor-parallel parameters])."""
    meshes: dict[tuple, DeviceMesh] = {}
    for name, param in params:
        mesh = param.device_mesh
        seen = meshes.setdefault(tuple(mesh.mesh_dim_names or ()), mesh)
        if seen != mesh or len(meshes) > 1:
            raise ValueError(
                f"parameter {name!r} is sharded over the mesh {mesh.mesh_dim_names}, and other parameters over "
                f"{next(iter(meshes))}; fxshard supports one TP mesh (expert parallelism, or TP over several "
                "meshes, is not supported yet). Apply parallelize_module with one mesh, mesh['tp']"
            )
    return tuple(meshes.values())


def _split_expert_params(mesh: DeviceMesh, world: Group, params: tuple[tuple[str, Any], ...],
                         expert_mesh: DeviceMesh | None) -> tuple[tuple[tuple[str, Any], ...], tuple[tuple[str, Any], ...]]:  # fmt: skip
    """``params`` (DTensor parameters) as (expert-parallel, tensor-parallel):
    a parameter whose mesh's ranks all lie in this rank's data-parallel
    group (``world``, of ``mesh``) is an expert's, sharded over
    ``expert_mesh`` (see [Note: expert-parallel parameters]); one on a mesh
    of one rank is taken as TP unless ``expert_mesh`` is given, and one on
    a dimension of ``mesh`` itself is left to the TP checks (which say
    which mesh to pass). Raises ``ValueError`` where expert parameters come
    without ``expert_mesh``, or it without them."""
    dims = set(mesh.mesh_dim_names or ())
    groups = {mesh.get_group(dim).group_name for dim in range(mesh.ndim) if mesh.size(dim) > 1}

    def on_mesh(p: Any) -> bool:
        """Whether ``p`` is on a dimension of ``mesh``, by name or by group.
        At ep = dp DeviceMesh gives sparse['ep'] the group of dense['dp'] (the
        world's): a named mesh beside ``expert_mesh`` is the EP mesh then."""
        names = set(p.device_mesh.mesh_dim_names or ())
        if dims & names:
            return True
        return p.device_mesh.get_group(0).group_name in groups and (expert_mesh is None or not names)

    candidates = {name: p for name, p in params if not on_mesh(p)}
    if world.size == 1:  # every mesh is inside: expert_mesh says which
        inside = {name for name in candidates if expert_mesh is not None}
    else:
        ranks = set(dist.get_process_group_ranks(world.pg))
        inside = {name for name, p in candidates.items()
                  if set(dist.get_process_group_ranks(p.device_mesh.get_group(0))) <= ranks
                  and (p.device_mesh.size() > 1 or expert_mesh is not None)}  # fmt: skip
    if inside and expert_mesh is None:
        name = sorted(inside)[0]
        raise ValueError(
            f"parameter {name!r} is a DTensor on a mesh {candidates[name].device_mesh.mesh_dim_names} whose ranks lie "
            "inside the data-parallel mesh passed to fxshard.compile: expert parallelism. Pass the mesh its "
            "experts are sharded over as well: fxshard.compile(model, mesh['dp'], expert_mesh=sparse['efsdp']), "
            "with sparse = init_device_mesh(device_type, (dp // ep, ep), mesh_dim_names=('efsdp', 'ep')) and the "
            "experts on sparse['ep'], as torchtitan's ParallelDims builds them"
        )
    if expert_mesh is not None and not inside:
        raise ValueError(
            "expert_mesh was given, but no parameter is a DTensor on a mesh inside the data-parallel mesh (an EP "
            "mesh); put the experts on the EP mesh first (distribute_tensor(..., sparse['ep'], [Shard(0)])), or "
            "leave expert_mesh out"
        )
    return (tuple((n, p) for n, p in params if n in inside), tuple((n, p) for n, p in params if n not in inside))


def _ep_mesh(mesh: DeviceMesh, world: Group, meshes: tuple[DeviceMesh, ...], expert_mesh: DeviceMesh) -> TPMesh:
    """The EP mesh of expert parameters (``meshes``, one), checked against
    ``expert_mesh``: both 1-D and named, dimensions of one mesh, and together
    over exactly the data-parallel group's ranks (torchtitan's (efsdp, ep))."""
    if len(meshes) != 1 or meshes[0].ndim != 1 or meshes[0].mesh_dim_names is None:
        raise ValueError(
            f"fxshard shards expert parameters of one 1-D named EP mesh; they are on {len(meshes)} meshes "
            f"{[m.mesh_dim_names for m in meshes]}. Apply the EP plan with one mesh, sparse['ep']"
        )
    if mesh.ndim != 1:
        raise NotImplementedError("HSDP with expert parallelism is not supported yet: pass a 1-D data-parallel mesh")
    if not isinstance(expert_mesh, DeviceMesh) or expert_mesh.ndim != 1 or expert_mesh.mesh_dim_names is None:
        raise ValueError(
            f"expert_mesh must be a 1-D named DeviceMesh, the data-parallel dimension beside the EP mesh "
            f"(sparse['efsdp'] of a ('efsdp', 'ep') mesh), got {expert_mesh!r}"
        )
    ep = meshes[0]
    try:
        spmd = compat.concatenate_meshes([expert_mesh, ep])
    except RuntimeError as error:
        raise ValueError(
            f"the EP mesh {ep.mesh_dim_names} and expert_mesh {expert_mesh.mesh_dim_names} must be dimensions of "
            f"one mesh (torch says: {error}); make both from one init_device_mesh(device_type, (dp // ep, ep), "
            "mesh_dim_names=('efsdp', 'ep')): sparse['efsdp'] and sparse['ep']"
        ) from error
    if sorted(spmd.mesh.flatten().tolist()) != sorted(dist.get_process_group_ranks(world.pg)):
        raise ValueError(
            f"expert_mesh {expert_mesh.mesh_dim_names} ({expert_mesh.size()}) and the EP mesh {ep.mesh_dim_names} "
            f"({ep.size()}) must cover exactly the ranks of the data-parallel mesh {mesh.mesh_dim_names} "
            f"({mesh.size()}): experts are sharded over what EP leaves of it, as torchtitan's efsdp"
        )
    return TPMesh(ep, spmd, expert=True)


def _tp_mesh(mesh: DeviceMesh, tp: DeviceMesh) -> TPMesh:
    """``tp``, the mesh of tensor-parallel parameters, checked against
    ``mesh``, the data-parallel one: 1-D, named, another dimension of the
    same mesh, and together with ``mesh`` over every rank, so that the
    ranks holding one TP piece are exactly a data-parallel group."""
    names = tp.mesh_dim_names
    # A dimension of one rank may be the default group itself, on either mesh.
    groups = {mesh.get_group(dim).group_name for dim in range(mesh.ndim) if mesh.size(dim) > 1}
    same_names = set(names or ()) & set(mesh.mesh_dim_names or ())
    if same_names or any(tp.get_group(dim).group_name in groups for dim in range(tp.ndim)):
        given = mesh.mesh_dim_names or tuple(mesh.shape)
        raise ValueError(
            f"parameters are already sharded over the mesh passed to fxshard.compile: they are DTensors on "
            f"{names or tuple(tp.shape)}, part of the mesh {given} that compile was given, and fxshard shards plain "
            "parameters over it. For tensor parallelism, pass the data-parallel dimension beside the TP one: "
            "mesh['dp'] of a (dp, tp) mesh (mesh['dp_replicate', 'dp_shard'] with HSDP). Otherwise pass the model "
            "before fully_shard or distribute_tensor"
        )
    if tp.ndim != 1 or names is None:
        raise ValueError(
            f"fxshard shards tensor-parallel parameters on a 1-D TP mesh with a named dimension; this one is "
            f"{tp.ndim}-D {tuple(tp.shape)} named {names} (EP with TP, or TP over 2 dimensions, is not supported). "
            "Apply parallelize_module on mesh['tp'] of init_device_mesh(device_type, (dp, tp), "
            "mesh_dim_names=('dp', 'tp'))"
        )
    if mesh.mesh_dim_names is None:
        raise ValueError(
            f"the data-parallel mesh needs a named dimension beside the TP mesh {names}: pass mesh['dp'] of "
            "init_device_mesh(device_type, (dp, tp), mesh_dim_names=('dp', 'tp'))"
        )
    try:
        spmd = compat.concatenate_meshes([mesh, tp])
    except RuntimeError as error:
        raise ValueError(
            f"the TP mesh {names} and the data-parallel mesh {mesh.mesh_dim_names} must be dimensions of one "
            f"mesh (torch says: {error}); make both from one init_device_mesh(device_type, (dp, tp), "
            "mesh_dim_names=('dp', 'tp')): mesh['dp'] and mesh['tp']"
        ) from error
    if spmd.mesh.numel() != dist.get_world_size():
        raise ValueError(
            f"the data-parallel mesh {mesh.mesh_dim_names} ({mesh.size()}) and the TP mesh {names} "
            f"({tp.size()}) cover {spmd.mesh.numel()} of the {dist.get_world_size()} ranks; fxshard supports "
            "tensor parallelism on a (dp, tp) mesh over every rank (pipeline or context parallelism beside it "
            "is not supported)"
        )
    return TPMesh(tp, spmd)


def _groups_of_every_rank(mesh: DeviceMesh) -> list[list[list[int]]]:
    """Per dimension of ``mesh``, the ranks of each of its groups across the
    world. A mesh over every rank lists them itself. A submesh (``mesh["dp"]``
    of a (dp, tp) mesh) holds only this rank's coordinate: every rank then
    sends its own groups' ranks, and they must split the world, each rank in
    one group per dimension (see [Note: topology])."""
    world = dist.get_world_size()
    if mesh.mesh.numel() == world:
        return [mesh.mesh.movedim(dim, -1).reshape(-1, mesh.size(dim)).tolist() for dim in range(mesh.ndim)]
    if compat.group_backend(mesh.get_group(0).group_name) == "fake":
        raise ValueError(f"mesh covers {mesh.mesh.numel()} of the {world} ranks, and the fake process group "
                         "cannot tell which ranks the others' meshes hold: pass a mesh over all ranks")  # fmt: skip
    mine = [dist.get_process_group_ranks(mesh.get_group(dim)) for dim in range(mesh.ndim)]
    every: list[Any] = [None] * world
    dist.all_gather_object(every, (mesh.mesh.flatten().tolist(), mine))
    covered = sorted(r for ranks in {tuple(m) for m, _ in every} for r in ranks)
    if covered != list(range(world)):
        raise ValueError(
            f"the ranks' meshes must split the {world} ranks, each rank in one; they hold "
            f"{sorted({tuple(m) for m, _ in every})}. Pass each rank its slice of one mesh over all ranks, "
            "e.g. mesh['dp'] of init_device_mesh(device_type, (dp, tp), mesh_dim_names=('dp', 'tp'))"
        )
    return [[list(g) for g in sorted({tuple(groups[dim]) for _, groups in every})] for dim in range(mesh.ndim)]


def _side_group(key: Any, kind: str, rank_lists: list[list[int]], backend: str | None) -> Any:
    """The ``kind`` group beside process group ``key`` over the ranks of
    this rank's list: the one made for an earlier compile while it lives,
    else a new one. ``new_group`` is collective over all ranks, so every
    rank makes the group of every list, in mesh order, and keeps its own."""
    made = _SIDE_GROUPS.setdefault(key, {})
    side = made.get(kind)
    if side is None or not compat.group_is_live(side):
        rank = dist.get_rank()
        for ranks in rank_lists:
            group = dist.new_group(ranks, backend=backend)
            if rank in ranks:
                side = made[kind] = group
    return side
