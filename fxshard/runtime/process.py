"""Every effect fxshard has on the process beyond the models it makes.

[Note: process-wide effects]
torch offers no per-model way to do the six things below, so each is done
through this module and nowhere else (``tests/test_layout.py`` checks it):
- **Optimizer step hooks** (``HeldHook``): torch has no per-parameter step
  hook, and the optimizer is built after ``fxshard.compile``, so a model
  cannot register on it. Each hook is registered while an object that needs
  it lives (a model's state, a shard, ZeRO-1's copies) and removed with the
  last one (``fxshard/module/optimizers.py``: the step count and the pre-step check).
  A captured step also records, for the length of its warm-up
  (``before_each_step``), which optimizers step.
- **Module and parameter registration hooks** (``HeldHook``): torch has no
  per-module hook for a child's registration, and the modules that hold no
  parameter keep their own class. Held by the compiled models, as above
  (``fxshard/module/structure.py``: [Note: parameters join before compile]).
- **The foreach type** (``foreach_type``): torch's optimizers and
  ``clip_grad_norm_`` take their foreach paths only for exact types in a
  private registry, where DTensor registers itself. fxshard's shards are a
  DTensor subclass, so it registers that class once, for the process: it is
  a type, not an object, and a registered type changes nothing for others.
- **A reset at exit and before ``destroy_process_group``** (``at_exit``,
  ``before_destroy``) of every captured CUDA graph: NCCL hangs destroying a
  communicator that a live graph still uses, and the interpreter's exit
  destroys them in no fixed order.
- **Parameter swaps on conversion, off during a load** (``loads_in_place``):
  under ``torch.__future__.set_swap_module_params_on_conversion(True)``,
  ``load_state_dict`` swaps a new tensor into each parameter, which a shard
  cannot take (``fxshard/module/swap.py``). The flag is torch's, for the
  process; it is off for the length of one module's own load and set back.
- **State per process group**, which lives as long as the group, not a
  model, and so stays where it is used: the count of compiles per world
  group that names each model's keys in the store alike on every rank
  (``topology._COMPILES``), the side groups made per shard group
  (``topology._SIDE_GROUPS``, weak) and the gloo groups that
  ``FXSHARD_CHECK_COLLECTIVES`` checks on (``rank_checks._CHECK_GROUPS``).
  None of them changes what the process does for anything but fxshard.
"""

from __future__ import annotations

import atexit
import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from fxshard.runtime import compat


class HeldHook:
    """One of torch's process-wide hooks, held by the objects that need it:
    registered while one of them lives, removed once the last is gone (see
    [Note: process-wide effects])."""

    def __init__(self, register: Callable[[Callable], Any], hook: Callable) -> None:
        self.register, self.hook = register, hook
        self.handle: Any = None
        # By id (holders may be tensors, whose == is elementwise), while each lives.
        self.holders: dict[int, weakref.ref] = {}

    @staticmethod
    def before_step(hook: Callable) -> HeldHook:
        """``hook(optimizer, args, kwargs)`` before every optimizer step."""
        return HeldHook(register_optimizer_step_pre_hook, hook)

    @staticmethod
    def after_step(hook: Callable) -> HeldHook:
        """``hook(optimizer, args, kwargs)`` after every optimizer step."""
        return HeldHook(register_optimizer_step_post_hook, hook)

    @staticmethod
    def on_module_registration(hook: Callable) -> HeldHook:
        """``hook(module, name, child)`` before any module registers a child."""
        return HeldHook(register_module_module_registration_hook, hook)

    @staticmethod
    def on_parameter_registration(hook: Callable) -> HeldHook:
        """``hook(module, name, param)`` before any module registers a parameter."""
        return HeldHook(register_module_parameter_registration_hook, hook)

    @property
    def count(self) -> int:
        return len(self.holders)

    def hold(self, holder: object) -> None:
        key = id(holder)
        held = self.holders.get(key)
        if held is not None and held() is holder:
            return
        self.holders[key] = weakref.ref(holder, lambda ref, key=key: self._release(key, ref))
        if self.handle is None:
            self.handle = self.register(self.hook)

    def _release(self, key: int, ref: weakref.ref) -> None:
        if self.holders.get(key) is ref:
            del self.holders[key]
        if not self.holders and self.handle is not None:
            self.handle.remove()
            self.handle = None


@contextlib.contextmanager
def before_each_step(hook: Callable) -> Iterator[None]:
    """``hook(optimizer, args, kwargs)`` before every optimizer step inside the block."""
    handle = register_optimizer_step_pre_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def foreach_type(cls: type) -> None:
    """Let torch's foreach optimizer and utility paths take ``cls`` as they
    take DTensor (see [Note: process-wide effects])."""
    compat.register_foreach_type(cls)


@contextlib.contextmanager
def loads_in_place() -> Iterator[None]:
    """``load_state_dict`` copies into parameters for the length of the
    block, as without ``set_swap_module_params_on_conversion(True)`` (see
    [Note: process-wide effects])."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(False)
    try:
        yield
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def at_exit(fn: Callable[[], None]) -> None:
    """Call ``fn`` when the interpreter exits."""
    atexit.register(fn)


def before_destroy(fn: Callable[[], None]) -> bool:
    """Have ``destroy_process_group()`` call ``fn`` first (once per default
    group; call again after each init). False where torch has no such point."""
    return compat.call_before_destroy(fn)
