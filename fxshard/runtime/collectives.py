"""The collectives of sharded training, written once as plain torch ops.

[Note: one definition of gather and reduce]
``gather_full``, ``reduce_to_shard`` and ``reduce_replicated`` are the only
definition of what an unshard and a reduce compute (a unit's reduce moves
the same values in one collective; see fxshard/runtime/units.py). The eager implementations of the ``fxshard::``
ops call them, and the lowering pass traces them (``make_fx``) and inlines the
result into compiled graphs, so eager and compiled runs cannot drift apart.

Sharding layout (the DTensor ``Shard(0)`` layout): with ``chunk =
ceil(dim0 / world_size)``, rank ``r`` holds rows ``[r*chunk, min((r+1)*chunk,
dim0))``, possibly none. Every rank pads its rows to ``chunk`` so that the
collectives move equal sizes; the padding is cut off after the collective.
World size 1 runs the same function with the collective skipped.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

_funcol = torch.ops._c10d_functional


def chunk_rows(dim0: int, world_size: int) -> int:
    """Rows each rank holds before padding (the last ranks may hold fewer)."""
    return -(-dim0 // world_size) if dim0 else 0


def shard_range(dim0: int, world_size: int, rank: int) -> tuple[int, int]:
    """The ``[start, end)`` rows of ``rank``'s shard; empty when start == end."""
    chunk = chunk_rows(dim0, world_size)
    return min(rank * chunk, dim0), min((rank + 1) * chunk, dim0)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return F.pad(t, [0, 0] * (t.dim() - 1) + [0, rows - t.shape[0]])


def gather_full(
    shard: torch.Tensor,
    dim0: int,
    world_size: int,
    group_name: str,
    dtype: torch.dtype | None,
) -> torch.Tensor:
    """Unshard: all-gather every rank's rows into the full parameter.

    The cast to ``dtype`` happens before the collective, so a bf16 compute
    dtype moves half the bytes of an fp32 shard.
    """
    if dtype is not None and shard.dtype != dtype:
        shard = shard.to(dtype)
    if world_size == 1:
        return shard
    chunk = chunk_rows(dim0, world_size)
    padded = _pad_rows(shard, chunk).contiguous()
    full = _funcol.wait_tensor(_funcol.all_gather_into_tensor(padded, world_size, group_name))
    return full if full.shape[0] == dim0 else full[:dim0]


def reduce_to_shard(
    grad: torch.Tensor,
    local_rows: int,
    world_size: int,
    group_name: str,
    reduce_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
    replicas: int = 1,
    replica_group_name: str = "",
    presummed: int = 1,
) -> torch.Tensor:
    """Reduce: reduce-scatter the full gradient and average it over the group,
    then, on an HSDP mesh, over the ``replicas`` (see [Note: HSDP]).
    ``presummed``: the ranks whose gradients ``grad`` already sums, divided
    out too (an expert's EP group: see [Note: expert-parallel parameters]).

    The sum runs in ``reduce_dtype`` (the gradient's own dtype when None); the
    result lands in ``out_dtype``, the shard's dtype.
    """
    if reduce_dtype is not None and grad.dtype != reduce_dtype:
        grad = grad.to(reduce_dtype)
    if world_size > 1:
        chunk = chunk_rows(grad.shape[0], world_size)
        padded = _pad_rows(grad, chunk * world_size).contiguous()
        grad = _funcol.wait_tensor(_funcol.reduce_scatter_tensor(padded, "sum", world_size, group_name))
        grad = grad / world_size
        if grad.shape[0] != local_rows:
            grad = grad[:local_rows]
    if presummed > 1:
        grad = grad / presummed
    grad = average_replicas(grad, replicas, replica_group_name)
    return grad.to(out_dtype) if grad.dtype != out_dtype else grad


def gather_many(shards: list[torch.Tensor], dim0s: list[int], world_size: int, group_name: str,
                dtype: torch.dtype) -> list[torch.Tensor]:  # fmt: skip
    """``gather_full`` of several shards in ``dtype``, in one all-gather:
    each rank's padded rows of every shard, laid end to end."""
    shards = [s.to(dtype) for s in shards]
    if world_size == 1:
        return shards
    chunks = [chunk_rows(d, world_size) for d in dim0s]
    mine = torch.cat([_pad_rows(s, c).reshape(-1) for s, c in zip(shards, chunks)])
    every = _funcol.wait_tensor(_funcol.all_gather_into_tensor(mine, world_size, group_name))
    every = every.view(world_size, every.numel() // world_size)  # explicit: -1 fails when it is empty
    out, start = [], 0
    for s, d, c in zip(shards, dim0s, chunks):
        n = c * math.prod(s.shape[1:])
        out.append(every[:, start : start + n].reshape(world_size * c, *s.shape[1:])[:d])
        start += n
    return out


def reduce_replicated(
    grad: torch.Tensor,
    world_size: int,
    group_name: str,
    reduce_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
    replicas: int = 1,
    replica_group_name: str = "",
) -> torch.Tensor:
    """Reduce the gradient of a replicated parameter: all-reduce it and
    average it over the group, then over the ``replicas`` of an HSDP mesh, in
    ``reduce_dtype``; the result in ``out_dtype``."""
    if reduce_dtype is not None and grad.dtype != reduce_dtype:
        grad = grad.to(reduce_dtype)
    if world_size > 1:
        grad = _funcol.wait_tensor(_funcol.all_reduce(grad.contiguous(), "sum", group_name))
        grad = grad / world_size
    grad = average_replicas(grad, replicas, replica_group_name)
    return grad.to(out_dtype) if grad.dtype != out_dtype else grad


def average_replicas(grad: torch.Tensor, replicas: int, group_name: str) -> torch.Tensor:
    """``grad``, a gradient reduced inside one replica, averaged over the
    ``replicas`` of an HSDP mesh (one all-reduce on ``group_name``, in its
    dtype); itself for one replica (see [Note: HSDP])."""
    if replicas == 1:
        return grad
    return _funcol.wait_tensor(_funcol.all_reduce(grad.contiguous(), "sum", group_name)) / replicas


def any_rank(flags: torch.Tensor, world_size: int, group_name: str) -> list[bool]:
    """For each flag, whether it is set on any rank (one all-reduce; reads back to the host)."""
    flags = flags.to(torch.int32)
    if world_size > 1:
        flags = _funcol.wait_tensor(_funcol.all_reduce(flags, "max", group_name))
    return [bool(f) for f in flags.tolist()]


# [Note: HSDP]
# On a 2-D (replicate, shard) mesh each replica group runs 1-D sharded
# training unchanged: gathers and reduce-scatters stay inside the shard
# dimension (inside a node, where the mesh is laid out so). A gradient
# reduced there is the average over its replica group; an all-reduce of it
# across the replicate dimension, divided by the number of replicas, makes
# it the average over the whole mesh. That all-reduce is part of every
# reduce, wherever the reduce runs, so a gradient is final when its reduce
# returns and nothing averages after the backward:
# - A unit's reduce in a graph (``bucket_collectives``) is three ops.
#   ``fxshard::unit_reduce`` starts the reduce-scatter;
#   ``fxshard::unit_reduce_replicas``, where a 1-D graph waits for it
#   (``schedule_collectives`` puts that wait ``reduces_in_flight`` reduces
#   later), waits for it and starts the all-reduce of its output, in place,
#   in the reduce dtype; ``fxshard::unit_replicas_wait``, at the end of the
#   graph, returns the gradients in the shard dtype. So each unit's average
#   runs beside the backward of the units after it, as FSDP2's does, and the
#   compute stream waits where it waited on a 1-D mesh, plus once at the end.
#   The all-reduce needs no buffer but the gradient the graph returns anyway,
#   so a late wait costs no memory; the reduce-scatter's input is freed where
#   it was (at most ``reduces_in_flight`` alive). It cannot start before the
#   reduce-scatter's wait, since it reads its output.
# - Any other reduce in a graph (a parameter in no unit, a replicated one,
#   a shard dimension of 1, which has no units) is ``reduce_to_shard`` or
#   ``reduce_replicated`` with ``average_replicas`` traced in: the lowering
#   tags that all-reduce ``REPLICAS`` and the schedule treats it alike
#   (started where the shard-group reduce is waited for, waited at the end).
# - A sharded embedding lookup's backward (``fxshard::embedding_backward``)
#   averages inside the op: it is typically the backward's last gradient,
#   with nothing left to overlap.
# - Reads outside a root call (eager markers) and the sequencer's reduces
#   at the end of a backward call the same functions: sequenced reads
#   overlap no reduce with the backward anyway (see [Note: sequenced reads]).
# So ``module.reads._ToLocal`` hands the graphs' gradients through as they are.
# Without sync nothing is reduced, so nothing is averaged; the call with
# sync reduces the sum once, and averages it then: once per synced step.
# The unit ops wait on the device stream only (no host sync), so a captured
# step captures them; FXSHARD_CHECK_COLLECTIVES compares each of them, and
# each eager one, across the replicate group's ranks (a gloo group over each
# column of the mesh). Graph signatures name the averages, which covers the
# per-parameter ones lowered into graphs, as for every lowered collective.
class Replicas:
    """The replicate dimension of an HSDP mesh: its size and group."""

    def __init__(self, size: int, group_name: str) -> None:
        self.size, self.group_name = size, group_name
