"""What optimizer steps see of the shards: a step count, and checks before each step.

Optimizers are built after ``fxshard.compile``, so fxshard cannot hook one;
it uses torch's process-wide step hooks instead, each held by the objects
that need it (see [Note: process-wide effects] in fxshard/runtime/process.py).
After every step, the step count of each shard an optimizer holds moves
(part of a shard's ``written`` key: foreach and fused steps move no version
counter of a DTensor, see [Note: has it changed] in shards.py); before every
step, a check that the optimizer holds no parameter replaced by compile and
that no gradient waits unreduced.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from fxshard.module.shards import ShardParameter
from fxshard.runtime.process import HeldHook


def count_optimizer_steps(holder: object) -> None:
    """Count, from now on and while ``holder`` lives, the optimizer steps of
    every shard (``ShardParameter.optimizer_steps``, part of its ``written``
    key): foreach and fused steps write shards without moving any version
    counter."""
    _STEP_COUNT.hold(holder)


def _count_steps(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if isinstance(p, ShardParameter):
                p.optimizer_steps += 1


_STEP_COUNT = HeldHook.after_step(_count_steps)


# [Note: optimizers built before compile]
# ``fxshard.compile`` replaces each parameter object by a new one holding the
# shard (a DTensor cannot take over a plain tensor's object). An optimizer
# built before then holds the old objects, which no longer receive
# gradients: it would step nothing, silently. The old objects are recorded
# here, weakly, and a step of any optimizer that holds one raises. Nothing is
# checked once the old objects are gone, which they are unless such an
# optimizer keeps them.
_RETIRED: dict[int, tuple[weakref.ref, str]] = {}


def retire(old: torch.Tensor, fqn: str) -> None:
    """Record that ``old``, parameter ``fqn`` before compile, was replaced;
    checked at every optimizer step while its model's state lives (it holds
    the check: ``watch_unsynced``)."""
    key = id(old)
    _RETIRED[key] = (weakref.ref(old, lambda _, key=key: _RETIRED.pop(key, None)), fqn)


# Root states whose gradients may wait unreduced (see [Note: accumulation
# without sync] in fxshard/runtime/ops.py), weakly: a step of an optimizer
# holding such a model's parameters raises, as it would step on zeros.
_UNSYNCED: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()


def watch_unsynced(state: Any) -> None:
    """``state.pending()``: gradients wait; ``state.fqns``: its shards' ids -> names."""
    _UNSYNCED[id(state)] = state
    _STEP_CHECK.hold(state)


def _check_optimizer(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    for state in list(_UNSYNCED.values()):
        state.check_kept()
        if not state.pending():
            continue
        held = [state.fqns[id(p)] for g in optimizer.param_groups for p in g["params"] if id(p) in state.fqns]
        if held:
            raise ValueError(
                f"{type(optimizer).__name__}.step(): the gradients of {held[0]!r} and others were accumulated with "
                "model.set_requires_gradient_sync(False) and are not reduced yet; run the last micro-batch's "
                "backward after model.set_requires_gradient_sync(True), then step"
            )
    if not _RETIRED:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            entry = _RETIRED.get(id(p))
            if entry is not None and entry[0]() is p:
                raise ValueError(
                    f"this {type(optimizer).__name__} holds parameter {entry[1]!r} as it was before "
                    "fxshard.compile, which replaced it by a shard; it would train nothing. Build the "
                    "optimizer after compiling: model = fxshard.compile(model, mesh); "
                    "opt = torch.optim.AdamW(model.parameters())"
                )


_STEP_CHECK = HeldHook.before_step(_check_optimizer)
