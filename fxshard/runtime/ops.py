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

import torch

from fxshard.runtime.collectives import gather_full, reduce_replicated, reduce_to_shard
from fxshard.runtime.rank_checks import check_collective


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
) -> torch.Tensor:
    """All-gather ``shard`` into the full parameter ``param`` (see the Note).
    The gradient is reduced on ``reduce_group_name``: the same ranks as
    ``group_name``, another communicator, so that reduces overlap gathers."""
    if world_size > 1:
        check_collective(group_name, lambda: f"all-gather of {param!r} ({dim0} rows) in {dtype or shard.dtype}")
    return _no_alias(gather_full(shard, dim0, world_size, group_name, dtype), shard)


@unshard.register_fake
def _unshard_fake(shard, dim0, world_size, group_name, reduce_group_name, param, dtype, reduce_dtype):
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


def _unshard_setup(ctx, inputs, output):
    shard, _, world_size, _, reduce_group_name, param, _, reduce_dtype = inputs
    ctx.spec = (shard.shape[0], world_size, reduce_group_name, param, reduce_dtype, shard.dtype)


def _unshard_backward(ctx, grad):
    return (reduce_grad(grad.contiguous(), *ctx.spec), None, None, None, None, None, None, None)


unshard.register_autograd(_unshard_backward, setup_context=_unshard_setup)


@torch.library.custom_op("fxshard::replicate", mutates_args=())
def replicate(
    local: torch.Tensor,
    world_size: int,
    group_name: str,
    param: str,
    dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
) -> torch.Tensor:
    """The replicated parameter ``param`` in its compute dtype: nothing to
    gather; its gradient is all-reduced on ``group_name`` (see [Note:
    replicated parameters] in fxshard/plan.py)."""
    return _no_alias(gather_full(local, local.shape[0] if local.dim() else 1, 1, group_name, dtype), local)


@replicate.register_fake
def _replicate_fake(local, world_size, group_name, param, dtype, reduce_dtype):
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
    local, world_size, group_name, param, _, reduce_dtype = inputs
    ctx.spec = (world_size, group_name, param, reduce_dtype, local.dtype)


def _replicate_backward(ctx, grad):
    return (all_reduce_grad(grad.contiguous(), *ctx.spec), None, None, None, None, None)


replicate.register_autograd(_replicate_backward, setup_context=_replicate_setup)

UNSHARD = torch.ops.fxshard.unshard.default
REDUCE_GRAD = torch.ops.fxshard.reduce_grad.default
REPLICATE = torch.ops.fxshard.replicate.default
ALL_REDUCE_GRAD = torch.ops.fxshard.all_reduce_grad.default
