"""fxshard's custom ops: the markers that the graph passes find and lower.

[Note: unshard markers]
Reading a sharded parameter calls ``fxshard::unshard`` on the rank's local
shard. The op is opaque to dynamo and AOTAutograd, so it survives capture as
one node per read, naming the parameter's plan by two integers (see [Note:
markers name the plan] in fxshard/runtime/plans.py). Its autograd
formula is ``fxshard::reduce_grad``, so the backward graph carries one reduce
marker per gathered parameter. The lowering pass replaces both markers with
``_c10d_functional`` collectives (see [Note: one definition of gather and
reduce]); run eagerly, the markers run those same collectives directly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.fx.node import has_side_effect

from fxshard.runtime import compat, plans
from fxshard.runtime.collectives import gather_full, reduce_replicated, reduce_to_shard
from fxshard.runtime.library import runtime_op
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
#   model's ``GradStore`` (in the reduce dtype) and gives the shard none, so
#   that no sharded gradient exists before the reduces of the call with sync
#   (as under FSDP2); when the backward ends, a shard without ``.grad`` gets
#   a zero one without memory (see [Note: a zero gradient without memory] in
#   fxshard/module/shards.py);
# - FLUSH (sync on, gradients accumulated): ``fxshard::take_accumulated``
#   adds the stored sum to this call's gradient, releasing it, before the
#   reduce. Stored gradients that no read of this call took (a parameter
#   this micro-batch did not use) are reduced when the backward ends, in plan
#   order, eagerly, on the gather communicator. One graph runs the same reads
#   on every rank, so every rank reduces the same ones.
# A parameter's gradient reset after a micro-batch without sync
# (``zero_grad``, ``p.grad = None``) drops what was kept for it, and only for
# it, as a reset drops gradients kept in ``.grad``: the root compares each
# ``.grad`` with the one the backward left, the zero ones included, at its
# next call, at the optimizer step and before a kept gradient is used (a
# reset may come between a forward and its backward). A change other than a
# reset (to values not all zero) raises: the kept gradients are outside
# ``.grad`` and cannot follow it (``RootState._drop_reset``).
SYNC, ACCUMULATE, FLUSH = 0, 1, 2


class GradStore:
    """One model's full gradients accumulated without sync, by plan index
    (see the Note); the markers of the model's reads find it through their
    plan's id (``plans.runtime``)."""

    def __init__(self, reduce_leftover: Callable[[int, torch.Tensor], None], after_add: Callable[[], None],
                 check: Callable[[list[int]], None]) -> None:  # fmt: skip
        self.grads: dict[int, torch.Tensor] = {}
        self._reduce_leftover = reduce_leftover  # (plan index, full gradient): reduce it into .grad
        self._added = compat.AtBackwardEnd(after_add)  # when a backward that added gradients ends
        self._leftovers = compat.AtBackwardEnd(self._reduce_leftovers)
        # Before a kept gradient is used: drops it if its .grad was reset
        # since, which may have happened between the forward and this backward.
        self._check = check

    def add(self, index: int, grad: torch.Tensor, dtype: torch.dtype) -> None:
        self._added.queue()
        if index in self.grads:
            self._check([index])
        held = self.grads.get(index)
        if held is None:
            self.grads[index] = grad.to(dtype, copy=True)  # a compiled graph may reuse grad's memory
        else:
            held.add_(grad)

    def take(self, index: int, grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        self._leftovers.queue()
        if index in self.grads:
            self._check([index])
        held = self.grads.pop(index, None)
        return grad.to(dtype, copy=True) if held is None else held.add_(grad)

    def _reduce_leftovers(self) -> None:
        if self.grads:
            self._check(list(self.grads))
        for index in sorted(self.grads):
            self._reduce_leftover(index, self.grads.pop(index))


def _no_alias(out: torch.Tensor, inp: torch.Tensor) -> torch.Tensor:
    # A custom op's output may not alias its input (world size 1 gathers
    # nothing), and is best not a view: uneven shards gather padded rows, and
    # autograd refuses in-place writes to a view made inside a custom op's
    # Function, which a full value read outside the forward gets from
    # ``nn.init`` or ``reset_parameters()`` (see [Note: writes to gathered
    # parameters]). In compiled graphs the passes replace these ops.
    aliased = out.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr()
    return out.clone() if aliased or out._base is not None else out


@torch.library.custom_op("fxshard::unshard", mutates_args=())
def unshard(shard: torch.Tensor, plan: int, index: int, phase: int = SYNC) -> torch.Tensor:
    """All-gather ``shard`` into the full parameter ``index`` of ``plan``
    (see the Note, and [Note: markers name the plan] in
    fxshard/runtime/plans.py). ``phase``: see [Note: accumulation without sync]."""
    p = plans.param(plan, index)
    if p.world_size > 1:
        check_collective(p.group_name, lambda: f"all-gather of {p.fqn!r} ({p.dim0} rows) in {p.dtype or shard.dtype}")
    return _no_alias(gather_full(shard, p.dim0, p.world_size, p.group_name, p.dtype), shard)


@unshard.register_fake
def _unshard_fake(shard, plan, index, phase=SYNC):
    p = plans.param(plan, index)
    return shard.new_empty((p.dim0, *shard.shape[1:]), dtype=p.dtype or shard.dtype)


@torch.library.custom_op("fxshard::reduce_grad", mutates_args=())
def reduce_grad(grad: torch.Tensor, plan: int, index: int) -> torch.Tensor:
    """Reduce-scatter the full gradient of parameter ``index`` of ``plan`` to
    this rank's rows, averaged, on its reduce group: the gather group's
    ranks on another communicator, so that reduces overlap gathers. On an
    HSDP mesh, then averaged over the replicas (see [Note: HSDP])."""
    p, rows = plans.param(plan, index), plans.local_rows(plan, index)
    if p.world_size > 1:
        check_collective(p.reduce_group_name,
                         lambda: f"reduce-scatter of the gradient of {p.fqn!r} {tuple(grad.shape)}")  # fmt: skip
    _check_replicas(p, rows)
    out = reduce_to_shard(grad, rows, p.world_size, p.reduce_group_name, p.reduce_dtype, p.shard_dtype,
                          p.replicas, p.replica_group_name, p.presummed)  # fmt: skip
    return _no_alias(out, grad)


def _check_replicas(p: plans.ParamPlan, rows: int) -> None:
    if p.replicas > 1:
        check_collective(p.replica_group_name,
                         lambda: f"all-reduce over {p.replicas} replicas of the gradient of {p.fqn!r} ({rows} rows)")  # fmt: skip


@reduce_grad.register_fake
def _reduce_grad_fake(grad, plan, index):
    p = plans.param(plan, index)
    return grad.new_empty((plans.local_rows(plan, index), *grad.shape[1:]), dtype=p.shard_dtype)


@runtime_op("accumulate_grad")
def accumulate_grad(grad: torch.Tensor, plan: int, index: int) -> None:
    """Add the full gradient of parameter ``index`` into ``plan``'s store,
    unreduced; the shard gets no gradient from this call (see [Note:
    accumulation without sync])."""
    plans.runtime(plan).store.add(index, grad, plans.param(plan, index).summed_dtype)


@accumulate_grad.register_fake
def _accumulate_grad_fake(grad, plan, index):
    return None


# Nothing reads its (absent) output: only this keeps it in a graph, through
# AOTAutograd's dead-code elimination and Inductor's.
has_side_effect(torch.ops.fxshard.accumulate_grad.default)


@runtime_op("take_accumulated")
def take_accumulated(grad: torch.Tensor, plan: int, index: int) -> torch.Tensor:
    """``grad`` plus what ``plan``'s store accumulated for parameter
    ``index``, in the reduce dtype; the stored sum is released (see [Note:
    accumulation without sync])."""
    return plans.runtime(plan).store.take(index, grad, plans.param(plan, index).summed_dtype)


@take_accumulated.register_fake
def _take_accumulated_fake(grad, plan, index):
    return grad.new_empty(grad.shape, dtype=plans.param(plan, index).summed_dtype)


def _phase_backward(grad: torch.Tensor, plan: int, index: int, phase: int,
                    reduce: Callable[[torch.Tensor, int, int], torch.Tensor]) -> torch.Tensor | None:  # fmt: skip
    """The gradient of a read in its phase: reduced, or reduced with what was
    accumulated; None where it is accumulated (the shard gets none)."""
    if phase == ACCUMULATE:  # no gradient for the shard, so nothing for a graph-building backward to record
        accumulate_grad(grad, plan, index)
        return None
    if phase == FLUSH:
        grad = _grad_op(take_accumulated, grad, plan, index)
    return _grad_op(reduce, grad, plan, index)


def _grad_op(op: Callable[[torch.Tensor, int, int], torch.Tensor], grad: torch.Tensor, plan: int,
             index: int) -> torch.Tensor:  # fmt: skip
    """``op(grad, plan, index)``; in a backward that builds a graph
    (``create_graph=True``), through ``_NoSecondOrder``: the runtime ops have
    no autograd kernel (see [Note: runtime ops without custom_op's wrappers]
    in fxshard/runtime/library.py), and torch's fallback would record what
    their functions compute, a collective's gradient included, and warn."""
    if torch.is_grad_enabled() and grad.requires_grad:
        return _NoSecondOrder.apply(grad, op, plan, index)
    return op(grad, plan, index)


class _NoSecondOrder(torch.autograd.Function):
    """A gradient op in a graph-building backward: its output joins the graph,
    and a backward through it raises (its own gradient has no formula)."""

    @staticmethod
    def forward(ctx, grad: torch.Tensor, op: Callable, plan: int, index: int) -> torch.Tensor:
        ctx.op = getattr(op, "name", getattr(op, "__name__", str(op)))
        return op(grad, plan, index)

    @staticmethod
    def backward(ctx, _: torch.Tensor) -> None:
        raise RuntimeError(
            f"fxshard: a backward through a parameter's gradient (double backward, after create_graph=True) "
            f"is not supported: {ctx.op} (a collective, or the gradient store) has no gradient formula"
        )


def _marker_setup(ctx, inputs, output):
    _, ctx.plan, ctx.index, *phase = inputs
    ctx.phase = phase[0] if phase else SYNC


def _unshard_backward(ctx, grad):
    return _phase_backward(grad.contiguous(), ctx.plan, ctx.index, ctx.phase, reduce_grad), None, None, None


unshard.register_autograd(_unshard_backward, setup_context=_marker_setup)


@torch.library.custom_op("fxshard::replicate", mutates_args=())
def replicate(local: torch.Tensor, plan: int, index: int, phase: int = SYNC) -> torch.Tensor:
    """The replicated parameter ``index`` of ``plan`` in its compute dtype:
    nothing to gather; its gradient is all-reduced on its reduce group (see
    [Note: replicated parameters] in fxshard/plan.py; ``phase``: [Note:
    accumulation without sync])."""
    p = plans.param(plan, index)
    return _no_alias(gather_full(local, local.shape[0] if local.dim() else 1, 1, p.group_name, p.dtype), local)


@replicate.register_fake
def _replicate_fake(local, plan, index, phase=SYNC):
    return local.new_empty(local.shape, dtype=plans.param(plan, index).dtype or local.dtype)


@runtime_op("all_reduce_grad")
def all_reduce_grad(grad: torch.Tensor, plan: int, index: int) -> torch.Tensor:
    """All-reduce the gradient of the replicated parameter ``index`` of ``plan``,
    averaged (on an HSDP mesh, over the replicas too)."""
    p = plans.param(plan, index)
    if p.world_size > 1:
        check_collective(p.reduce_group_name,
                         lambda: f"all-reduce of the gradient of {p.fqn!r} {tuple(grad.shape)}")  # fmt: skip
    _check_replicas(p, p.dim0)
    out = reduce_replicated(grad, p.world_size, p.reduce_group_name, p.reduce_dtype, p.shard_dtype, p.replicas,
                            p.replica_group_name)  # fmt: skip
    return _no_alias(out, grad)


@all_reduce_grad.register_fake
def _all_reduce_grad_fake(grad, plan, index):
    return grad.new_empty(grad.shape, dtype=plans.param(plan, index).shard_dtype)


def _replicate_backward(ctx, grad):
    grad = grad.contiguous()
    scalar = grad.dim() == 0  # the store keeps a 0-dimensional gradient as one row
    out = _phase_backward(grad.reshape(1) if scalar else grad, ctx.plan, ctx.index, ctx.phase, all_reduce_grad)
    return out.reshape(()) if scalar and out is not None else out, None, None, None


replicate.register_autograd(_replicate_backward, setup_context=_marker_setup)


@torch.library.custom_op("fxshard::kept", mutates_args=())
def kept(shard: torch.Tensor, full: torch.Tensor, plan: int, index: int, phase: int = SYNC) -> torch.Tensor:
    """ZeRO-1's read of parameter ``index`` of ``plan``: ``full``, the copy
    kept gathered between steps, with nothing to gather; its gradient goes to
    ``shard`` as an unshard's does (reduce-scattered, or kept without sync),
    so a graph's backward reduces it in the graph, overlapped, not after it
    (see [Note: ZeRO-1] in fxshard/module/zero1.py). Compiled graphs read
    ``full`` itself (``lower_collectives``); run eagerly, a copy, as a custom
    op's output must not alias its input."""
    return full.clone()


@kept.register_fake
def _kept_fake(shard, full, plan, index, phase=SYNC):
    return torch.empty_like(full)


def _kept_setup(ctx, inputs, output):
    _, _, ctx.plan, ctx.index, *phase = inputs
    ctx.phase = phase[0] if phase else SYNC


def _kept_backward(ctx, grad):
    return _phase_backward(grad.contiguous(), ctx.plan, ctx.index, ctx.phase, reduce_grad), None, None, None, None


kept.register_autograd(_kept_backward, setup_context=_kept_setup)

UNSHARD = torch.ops.fxshard.unshard.default
KEPT = torch.ops.fxshard.kept.default
REDUCE_GRAD = torch.ops.fxshard.reduce_grad.default
REPLICATE = torch.ops.fxshard.replicate.default
ACCUMULATE_GRAD = torch.ops.fxshard.accumulate_grad.default
TAKE_ACCUMULATED = torch.ops.fxshard.take_accumulated.default
ALL_REDUCE_GRAD = torch.ops.fxshard.all_reduce_grad.default
