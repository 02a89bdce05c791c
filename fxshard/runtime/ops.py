"""fxshard's custom ops: the markers that the graph passes find and lower.

[Note: unshard markers]
Reading a sharded parameter calls ``fxshard::unshard`` on the rank's local
shard. The op is opaque to dynamo and AOTAutograd, so it survives capture as
one node per read, carrying everything the passes need in its arguments: the
full dim-0 size, the group, the parameter's name and the dtypes. Its autograd
formula is ``fxshard::reduce_grad``, so the backward graph carries one reduce
marker per gathered parameter. The lowering pass replaces both markers with
``_c10d_functional`` collectives (see [Note: one definition of gather and
reduce]); run eagerly, the markers run those same collectives directly.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch

from fxshard.runtime import compat
from fxshard.runtime.collectives import gather_full, reduce_replicated, reduce_to_shard
from fxshard.runtime.rank_checks import check_collective

# [Note: accumulation without sync]
# ``model.set_requires_gradient_sync(False)`` (FSDP2's name) makes the calls
# that follow accumulate their full gradients unreduced, with no collective;
# the next call with sync on reduces its own gradient plus everything
# accumulated. The root picks a phase per call and passes it to each read's
# marker, so dynamo guards on it and compiles one graph per phase, with no
# host branch inside a graph:
# - SYNC: the gradient is reduced (reduce-scatter, or all-reduce for a
#   replicated parameter), as always;
# - ACCUMULATE: ``fxshard::accumulate_grad`` adds the full gradient into the
#   model's ``GradStore`` (in the reduce dtype) and gives the shard a zero
#   gradient;
# - FLUSH (sync on, gradients accumulated): ``fxshard::take_accumulated``
#   adds the stored sum to this call's gradient, releasing it, before the
#   reduce. Stored gradients that no read of this call took (a parameter
#   this micro-batch did not use) are reduced when the backward ends, in plan
#   order, eagerly, on the gather communicator. One graph runs the same reads
#   on every rank, so every rank reduces the same ones.
# Gradients reset after a micro-batch without sync (``zero_grad``, say) drop
# what it kept, as they would drop gradients kept in ``.grad``: the root
# compares the ``.grad`` tensors at its next call with those the backward
# left (``RootState.check_kept``).
SYNC, ACCUMULATE, FLUSH = 0, 1, 2


class GradStore:
    """One model's full gradients accumulated without sync, by plan index (see the Note)."""

    _ids = itertools.count()

    def __init__(self, reduce_leftover: Callable[[int, torch.Tensor], None], after_add: Callable[[], None]) -> None:
        self.id = next(self._ids)
        _STORES[self.id] = self
        self.grads: dict[int, torch.Tensor] = {}
        self._reduce_leftover = reduce_leftover  # (plan index, full gradient): reduce it into .grad
        self._after_add = after_add  # called when a backward that added gradients ends
        self._flush_queued = self._add_queued = False

    def add(self, index: int, grad: torch.Tensor, dtype: torch.dtype) -> None:
        if not self._add_queued:
            compat.queue_backward_callback(self._added)
            self._add_queued = True
        held = self.grads.get(index)
        if held is None:
            self.grads[index] = grad.to(dtype, copy=True)  # a compiled graph may reuse grad's memory
        else:
            held.add_(grad)

    def take(self, index: int, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if not self._flush_queued:
            compat.queue_backward_callback(self._reduce_leftovers)
            self._flush_queued = True
        held = self.grads.pop(index, None)
        return grad.to(dtype, copy=True) if held is None else held.add_(grad)

    def _added(self) -> None:
        self._add_queued = False
        self._after_add()

    def _reduce_leftovers(self) -> None:
        self._flush_queued = False
        for index in sorted(self.grads):
            self._reduce_leftover(index, self.grads.pop(index))


_STORES: weakref.WeakValueDictionary[int, GradStore] = weakref.WeakValueDictionary()


def _no_alias(out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    # A custom op's output may not alias its input (world size 1 gathers nothing).
    return out.clone() if out.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr() else out


@torch.library.custom_op("fxshard::unshard", mutates_args=())
def unshard(
    shard: torch.Tensor,
    dim0: int,
    world_size: int,
    group_name: str,
    reduce_group_name: str,
    param: str,
    dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    phase: int = SYNC,
    store: int = -1,
    index: int = -1,
) -> torch.Tensor:
    """All-gather ``shard`` into the full parameter ``param`` (see the Note).
    The gradient is reduced on ``reduce_group_name``: the same ranks as
    ``group_name``, another communicator, so that reduces overlap gathers.
    ``phase``, ``store`` and ``index``: see [Note: accumulation without sync]."""
    if world_size > 1:
        check_collective(group_name, lambda: f"all-gather of {param!r} ({dim0} rows) in {dtype or shard.dtype}")
    return _no_alias(gather_full(shard, dim0, world_size, group_name, dtype), shard)


@unshard.register_fake
def _unshard_fake(shard, dim0, world_size, group_name, reduce_group_name, param, dtype, reduce_dtype, *phase):
    return shard.new_empty((dim0, *shard.shape[1:]), dtype=dtype or shard.dtype)


@torch.library.custom_op("fxshard::reduce_grad", mutates_args=())
def reduce_grad(
    grad: torch.Tensor,
    local_rows: int,
    world_size: int,
    group_name: str,
    param: str,
    reduce_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Reduce-scatter the full gradient of ``param`` to this rank's rows, averaged."""
    if world_size > 1:
        check_collective(group_name, lambda: f"reduce-scatter of the gradient of {param!r} {tuple(grad.shape)}")
    return _no_alias(reduce_to_shard(grad, local_rows, world_size, group_name, reduce_dtype, out_dtype), grad)


@reduce_grad.register_fake
def _reduce_grad_fake(grad, local_rows, world_size, group_name, param, reduce_dtype, out_dtype):
    return grad.new_empty((local_rows, *grad.shape[1:]), dtype=out_dtype)


@torch.library.custom_op("fxshard::accumulate_grad", mutates_args=())
def accumulate_grad(
    grad: torch.Tensor, store: int, index: int, local_rows: int, reduce_dtype: torch.dtype, out_dtype: torch.dtype
) -> torch.Tensor:
    """Add the full gradient of parameter ``index`` into ``store``, unreduced;
    the shard's gradient from this call is zero (see [Note: accumulation without sync])."""
    _STORES[store].add(index, grad, reduce_dtype)
    return grad.new_zeros((local_rows, *grad.shape[1:]), dtype=out_dtype)


@accumulate_grad.register_fake
def _accumulate_grad_fake(grad, store, index, local_rows, reduce_dtype, out_dtype):
    return grad.new_empty((local_rows, *grad.shape[1:]), dtype=out_dtype)


@torch.library.custom_op("fxshard::take_accumulated", mutates_args=())
def take_accumulated(grad: torch.Tensor, store: int, index: int, reduce_dtype: torch.dtype) -> torch.Tensor:
    """``grad`` plus what ``store`` accumulated for parameter ``index``, in
    ``reduce_dtype``; the stored sum is released (see [Note: accumulation without sync])."""
    return _STORES[store].take(index, grad, reduce_dtype)


@take_accumulated.register_fake
def _take_accumulated_fake(grad, store, index, reduce_dtype):
    return grad.new_empty(grad.shape, dtype=reduce_dtype)


def _phase_backward(grad: torch.Tensor, phase: tuple, local_rows: int, out_dtype: torch.dtype,
                    reduce: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:  # fmt: skip
    """The gradient of a read in its phase: reduced, accumulated, or reduced with what was accumulated."""
    kind, store, index, reduce_dtype = phase
    if kind == ACCUMULATE:
        return accumulate_grad(grad, store, index, local_rows, reduce_dtype, out_dtype)
    if kind == FLUSH:
        grad = take_accumulated(grad, store, index, reduce_dtype)
    return reduce(grad)


def _unshard_setup(ctx, inputs, output):
    shard, _, world_size, _, reduce_group_name, param, _, reduce_dtype, *phase = inputs
    ctx.spec = (shard.shape[0], world_size, reduce_group_name, param, reduce_dtype, shard.dtype)
    kind, store, index = phase or (SYNC, -1, -1)
    ctx.phase = (kind, store, index, reduce_dtype or output.dtype)


def _unshard_backward(ctx, grad):
    local_rows, out_dtype = ctx.spec[0], ctx.spec[-1]
    out = _phase_backward(grad.contiguous(), ctx.phase, local_rows, out_dtype, lambda g: reduce_grad(g, *ctx.spec))
    return (out, *[None] * 10)


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup)


@torch.library.custom_op("fxshard::replicate", mutates_args=())
def replicate(
    local: torch.Tensor,
    world_size: int,
    group_name: str,
    param: str,
    dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    phase: int = SYNC,
    store: int = -1,
    index: int = -1,
) -> torch.Tensor:
    """The replicated parameter ``param`` in its compute dtype: nothing to
    gather; its gradient is all-reduced on ``group_name`` (see [Note:
    replicated parameters] in fxshard/plan.py; ``phase``: [Note: accumulation
    without sync])."""
    return _no_alias(gather_full(local, local.shape[0] if local.dim() else 1, 1, group_name, dtype), local)


@replicate.register_fake
def _replicate_fake(local, world_size, group_name, param, dtype, reduce_dtype, *phase):
    return local.new_empty(local.shape, dtype=dtype or local.dtype)


@torch.library.custom_op("fxshard::all_reduce_grad", mutates_args=())
def all_reduce_grad(
    grad: torch.Tensor,
    world_size: int,
    group_name: str,
    param: str,
    reduce_dtype: torch.dtype | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """All-reduce the gradient of the replicated ``param``, averaged."""
    if world_size > 1:
        check_collective(group_name, lambda: f"all-reduce of the gradient of {param!r} {tuple(grad.shape)}")
    return _no_alias(reduce_replicated(grad, world_size, group_name, reduce_dtype, out_dtype), grad)


@all_reduce_grad.register_fake
def _all_reduce_grad_fake(grad, world_size, group_name, param, reduce_dtype, out_dtype):
    return grad.new_empty(grad.shape, dtype=out_dtype)


def _replicate_setup(ctx, inputs, output):
    local, world_size, group_name, param, _, reduce_dtype, *phase = inputs
    ctx.spec = (world_size, group_name, param, reduce_dtype, local.dtype)
    kind, store, index = phase or (SYNC, -1, -1)
    ctx.phase = (kind, store, index, reduce_dtype or output.dtype)
    ctx.rows = local.shape[0] if local.dim() else None


def _replicate_backward(ctx, grad):
    grad = grad.contiguous()
    if ctx.rows is None:  # 0-dimensional: the store keeps it as one row
        grad = grad.reshape(1)
    out = _phase_backward(grad, ctx.phase, ctx.rows or 1, ctx.spec[-1], lambda g: all_reduce_grad(g, *ctx.spec))
    return (out.reshape(()) if ctx.rows is None else out, *[None] * 8)


replicate.register_autograd(_replicate_backward, setup_context=_replicate_setup)

UNSHARD = torch.ops.fxshard.unshard.default
REDUCE_GRAD = torch.ops.fxshard.reduce_grad.default
REPLICATE = torch.ops.fxshard.replicate.default
ACCUMULATE_GRAD = torch.ops.fxshard.accumulate_grad.default
TAKE_ACCUMULATED = torch.ops.fxshard.take_accumulated.default
ALL_REDUCE_GRAD = torch.ops.fxshard.all_reduce_grad.default
