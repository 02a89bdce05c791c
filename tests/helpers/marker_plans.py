"""Plan tables for hand-built graphs: what ``fxshard.compile`` registers for
a model, one parameter at a time (see [Note: markers name the plan])."""

from __future__ import annotations

import torch

from fxshard.runtime.plans import Lifetime, ModelRuntime, ParamPlan, Placement, PlanTable, Reduce

# Alive for the test session: the graphs' markers name them by id.
_LIVE: dict[tuple, ModelRuntime] = {}


def sharded(
    param: str,
    shape: tuple[int, ...],
    local_rows: int,
    world_size: int,
    group_name: str = "0",
    reduce_group_name: str = "1",
    dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> tuple[int, int]:
    """(plan, index) of ``param``, sharded over ``world_size`` ranks of which
    this one holds ``local_rows`` rows; one table per parameter, as a model has one."""
    key = (param, shape, local_rows, world_size, group_name, reduce_group_name, dtype, reduce_dtype)
    if key not in _LIVE:
        p = ParamPlan(param, Placement.SHARD, Reduce.REDUCE_SCATTER, Lifetime.LAST_USE, shape[0], world_size,
                      group_name, reduce_group_name, dtype, reduce_dtype, True, shape, torch.float32,
                      torch.device("cpu"))  # fmt: skip
        _LIVE[key] = ModelRuntime(PlanTable((p,), (local_rows,)))
    return _LIVE[key].table.id, 0
