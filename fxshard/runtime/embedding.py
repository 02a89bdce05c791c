"""Embedding lookups that read only the rank's own rows of the table.

[Note: sharded lookups]
An embedding lookup reads a few rows of a large table: for a 128k-token
vocabulary, gathering the table moves 0.5B parameters for a forward that
reads 2048 rows, and the backward then reduce-scatters a gradient just as
large, at the very end of the backward, where nothing overlaps it. The
``shard_embedding`` pass replaces ``embedding(unshard(shard), tokens)`` (an
embedding that is the weight's only reader, with default options) by
``fxshard::embedding(tokens, shard, ...)``, which moves the tokens instead:

- Forward: all-gather every rank's token ids; look up the ids this rank's
  rows hold (rows ``[start, end)``, see [Note: one definition of gather and
  reduce]), zeros for the others; reduce-scatter (sum) the ``(world_size *
  tokens, dim)`` result, so each rank receives its own tokens' rows. Every
  row has exactly one nonzero contribution, so the sum is exact in any dtype.
- Backward: all-gather every rank's output gradient; accumulate the rows
  this rank holds into its shard's gradient in the reduce dtype, divided by
  the world size (the average the reduce-scatter takes elsewhere). The
  accumulation is ``embedding_dense_backward`` with every id this rank does
  not hold sent to one extra padding row, which it skips: it sorts the ids
  and sums each row's run, with no atomic adds and in a fixed order. An
  ``index_add_`` with those ids clamped onto the shard's first or last row
  (their gradients zeroed) made most of the adds, ``(world_size - 1) /
  world_size`` of them, contend for those two rows, in an order that
  varied from run to run.

The collectives are ``world_size * tokens * dim`` elements: 64 MiB in bf16
for 2048 tokens of dim 4096 on 4 ranks, against 1 GiB gathered (bf16) and
2 GiB reduced (fp32) for a table of 128k such rows.

Ranks must look up the same number of tokens, because NCCL collectives move
equal sizes. Each call first compares the counts on a CPU (gloo) group, an
all-gather of one integer that never touches the GPU stream. When they
differ, that call gathers the table and reduces its gradient as any weight
(``gather_full`` / ``reduce_to_shard``); every rank sees the same counts, so
every rank takes the same branch.

The forward's collectives run on the reduce group and the backward's on the
gather group: in a forward the reduce group is idle while the gather group
has the next units' all-gathers queued, and at the end of a backward it is
the other way round. NCCL runs one communicator's collectives in issue
order, so this keeps the lookups from waiting behind prefetched gathers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fxshard.runtime import compat, plans
from fxshard.runtime.collectives import average_replicas, gather_full, reduce_to_shard, shard_range
from fxshard.runtime.rank_checks import check_collective

_funcol = torch.ops._c10d_functional

# How many lookup forwards and backwards ran each way in this process (tests).
stats = {"sharded": 0, "gathered": 0}


def _same_count(n: int, world_size: int, count_group_name: str) -> bool:
    """Whether every rank looks up ``n`` tokens; "" (no count group: a fake
    process group, which moves no data) assumes so."""
    if not count_group_name:
        return True
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(counts, torch.tensor([n], dtype=torch.int64), group=compat.resolve_group(count_group_name))
    return all(int(c) == n for c in counts)


def _check_ids(indices: torch.Tensor, dim0: int, param: str) -> None:
    """Out-of-range ids fail as in ``F.embedding``: an error on CPU, a device
    assert on GPU (without a host sync). A sharded lookup would read zeros."""
    if indices.numel() == 0:
        return
    ok = (indices.min() >= 0) & (indices.max() < dim0)
    if indices.device.type == "cpu":
        if not bool(ok):
            raise IndexError(f"fxshard: an embedding index into {param!r} is out of range [0, {dim0})")
    else:
        compat.assert_async(ok, f"fxshard: an embedding index into {param!r} is out of range [0, {dim0})")


def _all_gather(t: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    return _funcol.wait_tensor(_funcol.all_gather_into_tensor(t.contiguous(), world_size, group_name))


def _local_ids(
    indices: torch.Tensor, dim0: int, world_size: int, group_name: str
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Every rank's ids, as rows of this rank's shard (clamped), whether the
    shard holds each one, and the shard's row count."""
    rank = dist.get_rank(compat.resolve_group(group_name))
    start, end = shard_range(dim0, world_size, rank)
    ids = _all_gather(indices.reshape(-1), world_size, group_name) - start
    hit = (ids >= 0) & (ids < end - start)
    return ids.clamp(0, max(end - start - 1, 0)), hit, end - start


@torch.library.custom_op("fxshard::embedding", mutates_args=())
def embedding(indices: torch.Tensor, shard: torch.Tensor, plan: int, index: int) -> torch.Tensor:
    """``F.embedding(indices, full)`` where ``full`` is parameter ``index`` of
    ``plan`` gathered from ``shard``, reading only this rank's rows (see the Note)."""
    p, count_group = plans.param(plan, index), plans.table(plan).count_group_name
    _check_ids(indices, p.dim0, p.fqn)
    if not _same_count(indices.numel(), p.world_size, count_group):
        stats["gathered"] += 1
        return F.embedding(indices, gather_full(shard, p.dim0, p.world_size, p.group_name, p.dtype))
    stats["sharded"] += 1
    ids, hit, rows = _local_ids(indices, p.dim0, p.world_size, p.reduce_group_name)
    out_dtype = p.dtype or shard.dtype
    if rows:
        found = F.embedding(ids, shard).to(out_dtype).masked_fill(~hit.unsqueeze(1), 0)
    else:
        found = shard.new_zeros((ids.shape[0], shard.shape[1]), dtype=out_dtype)
    out = _funcol.wait_tensor(_funcol.reduce_scatter_tensor(found, "sum", p.world_size, p.reduce_group_name))
    return out.view(*indices.shape, shard.shape[1])


@embedding.register_fake
def _(indices, shard, plan, index):
    return shard.new_empty((*indices.shape, shard.shape[1]), dtype=plans.param(plan, index).dtype or shard.dtype)


@torch.library.custom_op("fxshard::embedding_backward", mutates_args=())
def embedding_backward(grad: torch.Tensor, indices: torch.Tensor, plan: int, index: int) -> torch.Tensor:
    """The gradient of ``fxshard::embedding`` with respect to the shard,
    averaged over the ranks (on an HSDP mesh, over the replicas too: see
    [Note: HSDP]), in the shard's dtype."""
    p, count_group = plans.param(plan, index), plans.table(plan).count_group_name
    local_rows = plans.local_rows(plan, index)
    dim = grad.shape[-1]
    acc = p.reduce_dtype or grad.dtype
    grad = grad.reshape(-1, dim)
    if p.replicas > 1:
        check_collective(p.replica_group_name, lambda: f"all-reduce over {p.replicas} replicas of the gradient "
                         f"of {p.fqn!r} ({local_rows} rows)")  # fmt: skip
    if not _same_count(indices.numel(), p.world_size, count_group):
        stats["gathered"] += 1
        full = torch.ops.aten.embedding_dense_backward(grad.to(acc), indices.reshape(-1), p.dim0, -1, False)
        return reduce_to_shard(full, local_rows, p.world_size, p.reduce_group_name, p.reduce_dtype, p.shard_dtype,
                               p.replicas, p.replica_group_name)  # fmt: skip
    stats["sharded"] += 1
    ids, hit, rows = _local_ids(indices, p.dim0, p.world_size, p.group_name)
    grads = _all_gather(grad, p.world_size, p.group_name).to(acc)
    if rows:  # ids this rank does not hold go to padding row ``local_rows``, which is skipped (see the Note)
        padded = torch.where(hit, ids, local_rows)
        out = torch.ops.aten.embedding_dense_backward(grads, padded, local_rows + 1, local_rows, False)[:local_rows]
    else:
        out = grads.new_zeros((local_rows, dim))
    out = average_replicas(out.div_(p.world_size), p.replicas, p.replica_group_name)
    return out.to(p.shard_dtype)


@embedding_backward.register_fake
def _(grad, indices, plan, index):
    return grad.new_empty((plans.local_rows(plan, index), grad.shape[-1]), dtype=plans.param(plan, index).shard_dtype)


def _setup(ctx, inputs, output):
    indices, _, ctx.plan, ctx.index = inputs
    ctx.save_for_backward(indices)


def _backward(ctx, grad):
    (indices,) = ctx.saved_tensors
    return None, embedding_backward(grad, indices, ctx.plan, ctx.index), None, None


embedding.register_autograd(_backward, setup_context=_setup)

EMBEDDING = torch.ops.fxshard.embedding.default
EMBEDDING_BACKWARD = torch.ops.fxshard.embedding_backward.default
