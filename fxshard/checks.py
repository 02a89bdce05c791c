"""Checks at ``fxshard.compile`` that every rank starts from the same model.

Each rank shards its own copy of the model and nothing is broadcast (see
``shard_parameters``), so ranks that built different models, or the same
model with different initial values, would train on a mix of them without
any error. Two small all-gathers over the mesh's group rule that out before
anything is sharded:

1. every rank's parameter list (names, shapes, dtypes, ``requires_grad``),
   as a count and a hash: ranks whose lists differ would issue different
   collectives in every graph;
2. one checksum per parameter, of its full local values (skipped with
   ``check_same_init=False``). The checksum is exact: the sum, modulo 2**64,
   of each element's bits times a weight that depends on its position, so it
   does not depend on the order of the summation (or the device) and a
   permutation changes it.

On a mismatch every rank raises the same ``ValueError``, naming the first
parameter that differs. Parameters on the meta device have no values and
are left out of the checksums.

A model built on the meta device gets its values after compile, through its
shards, and the first call checks what no check at compile could see: that
no two ranks hold the same rows of a weight (``check_distinct_rows``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fxshard.runtime import compat
from fxshard.runtime.plans import Param
from fxshard.runtime.topology import Topology

_CHUNK = 1 << 22  # elements per step of a checksum: bounds its temporary memory
_WEIGHT = 0x9E3779B97F4A7C15 - (1 << 64)  # odd, as int64: position weights that wrap differently per element
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _distinct(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Each parameter once (tied ones under their first name), in the order
    ``shard_parameters`` gives them."""
    seen: set[int] = set()
    out = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) not in seen:
            seen.add(id(param))
            out.append((name, param))
    return out


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """An int64 checksum of ``tensor``'s exact values (see the module docstring);
    0 for a tensor on the meta device."""
    if tensor.device.type == "meta":
        return torch.zeros((), dtype=torch.int64)
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    bits = flat.view(_BITS[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].to(torch.int64)
        position = torch.arange(start + 1, start + 1 + chunk.numel(), dtype=torch.int64, device=flat.device)
        total += (chunk * (position * _WEIGHT + 1)).sum()
    return total


def _layout(params: list[tuple[str, nn.Parameter]], whole: set[int]) -> list[str]:
    return [f"{name} {tuple(p.shape)} {str(p.dtype).replace('torch.', '')} requires_grad={p.requires_grad}"
            + (" no_shard" if id(p) in whole else "") + (f" {tuple(p.placements)}" if isinstance(p, DTensor) else "")
            for name, p in params]  # fmt: skip


def _hash64(lines: list[str]) -> int:
    return int.from_bytes(hashlib.sha256("\n".join(lines).encode()).digest()[:8], "little", signed=True)


def _all_gather(values: torch.Tensor, group: object, device: torch.device) -> torch.Tensor:
    """Every rank's ``values`` over ``group``, one row per rank (on the host)."""
    values = values.to(device)
    rows = [torch.empty_like(values) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, values, group=group)
    return torch.stack(rows).cpu()


def _first_difference(layouts: list[list[str]]) -> str:
    mine = layouts[0]
    for rank, other in enumerate(layouts[1:], start=1):
        for i in range(max(len(mine), len(other))):
            a = mine[i] if i < len(mine) else "(none)"
            b = other[i] if i < len(other) else "(none)"
            if a != b:
                return f"parameter {i}: rank 0 has {a}, rank {rank} has {b}"
    return "the parameter lists differ"


def check_same_model(
    model: nn.Module, topology: Topology, values: bool, whole: set[int], memory: int | None
) -> int | None:
    """Raise ``ValueError`` on every rank unless every rank of the mesh holds
    the same parameters (``whole``: the ids of those ``fxshard.no_shard``
    marked) and, with ``values``, the same initial values. Returns the
    smallest ``memory`` (device bytes, None for unknown) of all ranks, so that
    decisions made from it are the same on every rank."""
    if not topology.world.moves_data:
        return memory  # the fake group moves no data: nothing to compare
    params = _distinct(model)
    layout = _layout(params, whole)
    mine = -1 if memory is None else memory
    heads = _all_gather(torch.tensor([len(layout), _hash64(layout), mine, topology.expert_coordinate()],
                                     dtype=torch.int64), topology.world.pg, topology.device)  # fmt: skip
    memories, coordinates = heads[:, 2], heads[:, 3]
    smallest = None if bool((memories < 0).any()) else int(memories.min())
    heads = heads[:, :2]
    if not bool((heads == heads[0]).all()):
        layouts: list = [None] * topology.world.size
        dist.all_gather_object(layouts, layout, group=topology.world.pg)
        raise ValueError(
            f"fxshard.compile: the ranks hold different models ({_first_difference(layouts)}); every rank must "
            "build the same model (same architecture and configuration) before fxshard.compile"
        )
    if not values or not params:
        return smallest
    # A tensor-parallel parameter's TP-local piece: the ranks compared, one
    # data-parallel group, share a TP coordinate (see [Note: topology]).
    locals_ = [compat.local_tensor(p) if isinstance(p, DTensor) else p for _, p in params]
    sums = _all_gather(torch.stack([checksum(p) for p in locals_]).cpu(), topology.world.pg, topology.device)
    # An expert parameter's EP-local piece is compared among the ranks of one
    # EP coordinate: they hold the same experts (see [Note: expert-parallel parameters]).
    expert = torch.tensor([topology.is_expert(p) for _, p in params])
    first = torch.stack([sums[int((coordinates == c).nonzero()[0])] for c in coordinates.tolist()])
    expected = torch.where(expert, first, sums[0])
    differs = (sums != expected).any(0)
    if bool(differs.any()):
        i = int(differs.nonzero()[0])
        ranks = [r for r in range(topology.world.size) if sums[r, i] != expected[r, i]]
        raise ValueError(
            f"fxshard.compile: parameter {params[i][0]!r} holds different initial values on rank 0 and rank(s) "
            f"{ranks}; fxshard keeps each rank's own rows and broadcasts nothing. Seed every rank identically "
            "(torch.manual_seed(0)) before building the model, or load the same checkpoint on every rank, "
            "before fxshard.compile; check_same_init=False skips this check"
        )
    return smallest


# _like_a_draw counts the distinct values among a shard's first _SAMPLE and
# wants _DISTINCT: fewer cannot tell a draw from chance.
_SAMPLE, _DISTINCT = 64, 16


def _like_a_draw(local: torch.Tensor) -> torch.Tensor:
    """Whether a shard's values could tell a per-shard draw (a bool tensor:
    no host sync per parameter). Its rows must differ: one row repeated is a
    model's design (Mamba's ``A_log``, log(1..N) in every row), and a shard
    of one row cannot tell. And its first values must be many and distinct,
    as drawn values are: a weight one Adam step from a constant (a norm's,
    after a checkpoint's first step) holds two values, which two ranks'
    small shards share by chance."""
    if local.is_complex():
        local = torch.view_as_real(local)
    rows = local.flatten(1) if local.dim() > 1 else local.reshape(-1, 1)
    if rows.shape[0] < 2:
        return torch.zeros((), dtype=torch.bool, device=local.device)
    sample = local.reshape(-1)[:_SAMPLE].sort().values
    distinct = 1 + (sample[1:] != sample[:-1]).sum()
    return (rows != rows[:1]).any() & (distinct >= _DISTINCT)


def check_distinct_rows(params: Sequence[Param]) -> bool:
    """Raise ``ValueError`` on every rank of a group if two of its ranks hold
    the same rows of a sharded parameter whose values look drawn.

    Ranks hold different rows of one weight, so equal shards mean the values
    were drawn per shard with one seed: ``p.copy_(torch.randn_like(p))`` and
    other random ops that make new DTensors draw each rank's rows alike on a
    CPU mesh (DTensor's behaviour). Such rows never break symmetry, and
    training would go on without an error. Only shards whose values look
    drawn are compared (see :func:`_like_a_draw`). Shards of a group are
    compared among its ranks (an HSDP replica's shard group, the experts'
    group).
    Returns False, having checked nothing, while a shard is on the meta
    device (values come later, through ``to_empty``)."""
    if any(p.shard.local().is_meta for p in params):
        return False
    by_group: dict[str, list[Param]] = {}
    for p in params:
        plan = p.plan
        # Only what is the same on every rank decides the members (a rank's
        # empty shard does not): the all-gather below takes one row per member.
        if plan.replicated or plan.world_size < 2 or plan.device.type == "meta":
            continue
        by_group.setdefault(plan.group_name, []).append(p)
    for name, members in by_group.items():
        if compat.group_backend(name) == "fake":  # moves no data: nothing to compare
            continue
        rows = []
        for p in members:
            local = p.shard.local().detach()
            varied = _like_a_draw(local)
            rows.append(torch.stack([checksum(local), torch.full_like(varied, p.local_rows, dtype=torch.int64),
                                     varied.to(torch.int64)]))  # fmt: skip
        # ranks x members x (checksum, rows, varied)
        every = _all_gather(torch.stack(rows), compat.resolve_group(name), members[0].plan.device)
        for i, p in enumerate(members):
            seen: dict[tuple[int, int], int] = {}
            for rank in range(every.shape[0]):
                checksum_, rows_, varied = every[rank, i].tolist()
                if not varied:
                    continue
                if (checksum_, rows_) in seen:
                    raise ValueError(
                        f"fxshard: ranks {seen[checksum_, rows_]} and {rank} of the group that shards "
                        f"{p.fqn!r} hold the same rows of it: its values were drawn per shard with the same seed "
                        "(torch.randn_like(p) and other random ops that make a new DTensor draw each rank's rows "
                        "alike on a CPU mesh), so they never break symmetry. Draw in place instead "
                        "(p.normal_(), nn.init.*: fxshard draws the whole weight and keeps each rank's rows), or "
                        "write full values through the module's attribute (module.weight.copy_(full)). If the "
                        "rows are meant to repeat, check_same_init=False skips this check"
                    )
                seen[checksum_, rows_] = rank
    return True
