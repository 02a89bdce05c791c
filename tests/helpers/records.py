"""Run-time parameter records (``fxshard.runtime.plans.Param``) for tests
that build units or a sequencer without a model."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fxshard.runtime.plans import Lifetime, Param, ParamPlan, Placement, Reduce


class StubShard:
    """A shard held in this object (``plans.Shard``), or none (``value`` None)."""

    def __init__(
        self,
        value: torch.Tensor | None = None,
        trainable: bool = True,
        add_grad: Callable[[torch.Tensor], None] | None = None,
    ) -> None:
        self.value, self._trainable, self._add_grad = value, trainable, add_grad

    def local(self) -> torch.Tensor | None:
        return self.value

    def rehome(self, tensor: torch.Tensor) -> None:
        self.value = tensor

    def add_grad(self, grad: torch.Tensor) -> None:
        if self._add_grad is not None:
            self._add_grad(grad)

    def trainable(self) -> bool:
        return self._trainable


def param(
    index: int,
    fqn: str,
    shape: Sequence[int],
    local_rows: int,
    *,
    world_size: int = 2,
    shard_dtype: torch.dtype = torch.float32,
    dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    shard: StubShard | None = None,
) -> Param:
    """A sharded parameter's record: ``dtype`` gathers (None keeps the
    shard's), ``reduce_dtype`` reduces (None: the gather dtype)."""
    shape = tuple(shape)
    plan = ParamPlan(fqn, Placement.SHARD, Reduce.REDUCE_SCATTER, Lifetime.LAST_USE, shape[0], world_size, "0", "1",
                     dtype, reduce_dtype, True, shape, shard_dtype, torch.device("cpu"))  # fmt: skip
    return Param(index, plan, local_rows, shard or StubShard())
