"""The collectives of sharded training, written once as plain torch ops.

[Note: one definition of gather and reduce]
``gather_full``, ``reduce_to_shard`` and ``reduce_replicated`` are the only
definition of what an unshard and a reduce compute. The eager implementations of the ``fxshard::``
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
) -> torch.Tensor:
    """Reduce: reduce-scatter the full gradient and average it over the group.

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


def reduce_many(grads: list[torch.Tensor], local_rows: list[int], world_size: int, group_name: str,
                reduce_dtype: torch.dtype, out_dtypes: list[torch.dtype]) -> list[torch.Tensor]:  # fmt: skip
    """``reduce_to_shard`` of several full gradients, summed in ``reduce_dtype``,
    in one reduce-scatter: rank r's padded rows of every gradient, end to end."""
    grads = [g.to(reduce_dtype) for g in grads]
    if world_size == 1:
        return [g.to(o) for g, o in zip(grads, out_dtypes)]
    chunks = [chunk_rows(g.shape[0], world_size) for g in grads]
    parts = [_pad_rows(g, c * world_size).reshape(world_size, c * math.prod(g.shape[1:]))
             for g, c in zip(grads, chunks)]  # fmt: skip
    flat = torch.cat(parts, dim=1).reshape(-1)
    mine = _funcol.wait_tensor(_funcol.reduce_scatter_tensor(flat, "sum", world_size, group_name)) / world_size
    out, start = [], 0
    for g, c, rows, part, o in zip(grads, chunks, local_rows, parts, out_dtypes):
        n = part.shape[1]
        out.append(mine[start : start + n].view(c, *g.shape[1:])[:rows].to(o))
        start += n
    return out


def reduce_replicated(
    grad: torch.Tensor,
    world_size: int,
    group_name: str,
    reduce_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Reduce the gradient of a replicated parameter: all-reduce it and
    average it over the group, in ``reduce_dtype``; the result in ``out_dtype``."""
    if reduce_dtype is not None and grad.dtype != reduce_dtype:
        grad = grad.to(reduce_dtype)
    if world_size > 1:
        grad = _funcol.wait_tensor(_funcol.all_reduce(grad.contiguous(), "sum", group_name))
        grad = grad / world_size
    return grad.to(out_dtype) if grad.dtype != out_dtype else grad


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
# reduced there is the average over its replica group; one all-reduce of
# every reduced gradient across the replicate dimension, averaged, makes it
# the average over the whole mesh. It runs where every reduced gradient
# passes once: the backward of the node that hands the local shards to the
# graphs (``sharding._ToLocal``), and the sequencer's reduce. The all-reduce
# runs in the shard's dtype, once per backward, after the graph's backward
# (no overlap with it).
class Replicas:
    """The replicate dimension of an HSDP mesh: its size and group."""

    def __init__(self, size: int, group_name: str) -> None:
        self.size, self.group_name = size, group_name

    def average(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tensor averaged over the replicas: one all-reduce per dtype."""
        out: list[torch.Tensor] = list(grads)
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, g in enumerate(grads):
            by_dtype.setdefault(g.dtype, []).append(i)
        for indices in by_dtype.values():
            flat = torch.cat([grads[i].reshape(-1) for i in indices])
            flat = _funcol.wait_tensor(_funcol.all_reduce(flat, "sum", self.group_name)) / self.size
            for i, part in zip(indices, flat.split([grads[i].numel() for i in indices])):
                out[i] = part.view(grads[i].shape)
        return out
