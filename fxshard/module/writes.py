"""Writes to a parameter's gathered value read from the module reach its shard.

[Note: writes to gathered parameters]
Outside the model's forward, ``module.weight`` is the full parameter,
gathered from the shards (see [Note: gather on access]). In plain PyTorch a
write to it changes the parameter, so here it must change the shards:
``nn.init.trunc_normal_(module.weight)``, ``module.weight.data.normal_()``
(Hugging Face's ``_init_weights``), ``module.weight.copy_(full)``,
``module.weight[0] = 1`` or ``module.weight.data = full``. The value read is
a ``GatheredParameter``: a plain tensor whose ``__torch_function__`` runs
each function as usual, then, if the function wrote the value or an alias
of it (its version counter moved, or ``.data =`` gave it other storage),
copies this rank's rows into its local shard. Every rank runs the same code,
so every rank writes its own rows: after ``nn.init.normal_(w)`` with the same
seed, the full parameter is what the unsharded model would hold, at any
world size. Views and ``.data`` of the value are ``GatheredParameter`` too,
so a write through them lands as well.

A value held across a change of its parameter (``w = module.weight``, then
an optimizer step, or a write to the shard by other means) is a stale copy,
where plain PyTorch's would be the parameter itself: read, it would give the
old values, and written, it would put them back over the change. So each
value knows the shard it came from and that shard's ``written`` key at
the read (``Source``; see [Note: has it changed] in shards.py: it moves with
an optimizer step too, which may move no version counter); any use once it
moved raises, naming the fix: read ``module.weight`` again. A write through
the value (or an alias of it) moves the key itself and renews it.
A CUDA-graph replay steps the optimizer without any hook: values held across
replays are not checked.

The value's ``.grad`` is the parameter's gradient, full, as in PyTorch
(``ParameterLink``): reading it gathers the shard's ``.grad`` (``None`` where
the shard has none), writes to it land in the shard's ``.grad`` as writes to
the value land in the shard, and assigning or deleting it sets the shard's.
Without this, torch answers ``.grad`` of a non-leaf with ``None`` and drops
what is assigned to it: ``model.fc.weight.grad`` would read ``None`` after
a backward, and ``model.embed.weight.grad[:n] = 0`` would change nothing.
A gathered gradient held across a change of the shard's gradient (a
backward, ``zero_grad``) raises on use, as a held value does. Gradient hooks
registered on the value (``register_hook``,
``register_post_accumulate_grad_hook``) are registered on the shard, which
is in the autograd graph: on the value they would never run. They receive
the shard's reduced gradient, a DTensor, as FSDP2's do.

[Note: a write in each direction]
A gathered value and its shard are two tensors holding the same rows, so a
write to either must reach the other or make it stale. The two directions
are handled apart, with the same key (``written``, see [Note: has it
changed] in shards.py):
- value to shard: a function run on the value (or an alias) that changed
  its key wrote it, and its rows go to the shard at once
  (``GatheredParameter.__torch_function__``; a gathered gradient's go to
  the shard's ``.grad``). The write happens in fxshard's sight, and the
  shard is the parameter, which the optimizer and the next call read.
- shard to value: a write to the shard happens where fxshard does not run
  (an optimizer step, a state dict load, code on ``model.parameters()``),
  so the values gathered from it cannot be updated then; each finds out at
  its next use, by comparing the shard's key with the one at its read
  (``Source``, ``GradSource``), and raises.
One route would need either a copy of every shard write into every value
gathered from it (fxshard does not know the values the user holds, and it
would gather on every write), or the value to be the shard, which it is
only where the parameter is replicated and frozen (no ``Source``).

Meta-device init builds on this: after ``model.to_empty(device=...)`` a
parameter has no values yet, so reading it returns an uninitialized full
tensor without a collective, and the first write makes it initialized. The
model's own init (``reset_parameters()``, ``init_weights()``) then holds
one full parameter at a time, never the full model.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fxshard.module.optimizers import count_optimizer_steps
from fxshard.module.shards import STORAGE, ShardParameter, copy_rows, rows_of, written
from fxshard.runtime import compat

Sink = Callable[[torch.Tensor], None]  # writes a gathered value's rows into the shard


class Source:
    """The shard a gathered value was read from, and its state at the read
    (see [Note: writes to gathered parameters])."""

    def __init__(self, param: ShardParameter, fqn: str) -> None:
        count_optimizer_steps(param)
        self.param, self.fqn = param, fqn
        self.state = written(param)  # see [Note: has it changed]

    def check(self) -> None:
        if not self.param.unwritten_since(self.state):
            raise ValueError(
                f"this full value of {self.fqn!r} was read (module.{self.fqn.rpartition('.')[2]}) before the "
                "parameter changed (an optimizer step, or a write to it); fxshard gathers a copy on each read, "
                "so a value held across a change is stale, where PyTorch's would be the parameter itself. "
                "Read the attribute again after the change, or .clone() the value to keep a snapshot"
            )

    def renew(self) -> None:
        self.state = written(self.param)


class GatheredParameter(torch.Tensor):
    """A full parameter read outside the forward; writes to it reach the shard
    (see [Note: writes to gathered parameters])."""

    _fxshard_sink: Sink
    _fxshard_root: torch.Tensor  # a plain alias of the gathered storage
    _fxshard_source: Source | GradSource | None  # None: the value is the local tensor itself (replicated)
    _fxshard_link: ParameterLink | None  # the whole value read from ``module.weight``; None for its aliases

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _LINKED and isinstance(args[0], GatheredParameter) and args[0]._fxshard_link is not None:
            return args[0]._fxshard_link.forward(func, args[1:], kwargs)
        if func in _REQUIRES_GRAD and isinstance(args[0], GatheredParameter):
            owner = args[0]._fxshard_sink.__self__
            if isinstance(owner, ParameterLink):
                # A gradient's value: a leaf in PyTorch, whose flag is its own
                # (a hand-written zero_grad calls grad.requires_grad_(False)).
                with compat.disable_torch_function_subclass():
                    return func(*args, **kwargs)
            # Freezing the value read is freezing the parameter, as in PyTorch
            # (the value itself is not a leaf).
            flag = args[1] if len(args) > 1 else kwargs.get("requires_grad", True)
            owner.requires_grad_(flag)
            return args[0] if func is torch.Tensor.requires_grad_ else None
        seen = [a for a in _tensor_args(args, kwargs) if isinstance(a, GatheredParameter)]
        for a in seen:
            if a._fxshard_source is not None:
                a._fxshard_source.check()
        with compat.disable_torch_function_subclass():
            before = [written(a) for a in seen]  # see [Note: has it changed]
            out = func(*args, **kwargs)
            for a, key in zip(seen, before):
                now = written(a)
                if now == key:
                    continue
                # Other memory (``.data =``): the new values are ``a`` itself; else
                # ``func`` wrote through ``a`` into the gathered value.
                a._fxshard_sink(a if now[STORAGE] != key[STORAGE] else a._fxshard_root)
                if a._fxshard_source is not None:
                    a._fxshard_source.renew()
        return _wrap_aliases(out, seen)


_REQUIRES_GRAD = (torch.Tensor.requires_grad_, torch.Tensor.requires_grad.__set__)
_GRAD_GET, _GRAD_SET, _GRAD_DEL = torch.Tensor.grad.__get__, torch.Tensor.grad.__set__, torch.Tensor.grad.__delete__
_HOOKS = (torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook)
_LINKED = (_GRAD_GET, _GRAD_SET, _GRAD_DEL, *_HOOKS)  # what the whole value forwards to its parameter


def _tensor_args(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
        elif isinstance(value, torch.Tensor):
            found.append(value)
    return found


def _wrap_aliases(out: Any, seen: list[GatheredParameter]) -> Any:
    """Outputs that share a gathered value's storage (views, ``.data``, an
    in-place op's result) stay ``GatheredParameter``; the rest are plain."""
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap_aliases(o, seen) for o in out)
    if not isinstance(out, torch.Tensor) or isinstance(out, GatheredParameter) or not seen:
        return out
    ptr = out.untyped_storage().data_ptr() if out.layout == torch.strided else None
    for a in seen:
        if ptr is not None and ptr == a._fxshard_root.untyped_storage().data_ptr():
            return gathered_parameter(out, a._fxshard_root, a._fxshard_sink, a._fxshard_source)
    return out


def gathered_parameter(value: torch.Tensor, root: torch.Tensor, sink: Sink, source: Source | GradSource | None,
                       link: ParameterLink | None = None) -> GatheredParameter:  # fmt: skip
    """``value`` (an alias of ``root``) as a ``GatheredParameter`` whose
    writes go to ``sink``; ``source``: the shard it was gathered from, shared
    by its aliases (None where ``root`` is the local tensor itself);
    ``link``: its parameter, for the whole value read from the module."""
    with compat.disable_torch_function_subclass():
        wrapped = value.as_subclass(GatheredParameter)
    wrapped._fxshard_root, wrapped._fxshard_sink, wrapped._fxshard_source = root, sink, source
    wrapped._fxshard_link = link
    return wrapped


def parameter_of(value: Any) -> nn.Parameter | None:
    """The parameter ``value`` is: a parameter itself, or the whole value
    read from ``module.weight`` (its ``ParameterLink``); None otherwise."""
    if isinstance(value, GatheredParameter):
        return value._fxshard_link.param if value._fxshard_link is not None else None
    return value if isinstance(value, nn.Parameter) else None


class ParameterLink:
    """What a parameter's gathered value read outside the forward forwards to
    the parameter: ``.grad``, the shard's gradient gathered, and gradient
    hooks (see [Note: writes to gathered parameters]). ``gather`` makes the
    full tensor of a local one, as the value's read does."""

    def __init__(self, param: ShardParameter, fqn: str, gather: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.param, self.fqn, self.gather = param, fqn, gather

    def forward(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if func == _GRAD_GET:
            return self.read()
        if func in _HOOKS:
            return getattr(self.param, func.__name__)(*args, **kwargs)
        self.assign(args[0] if func == _GRAD_SET else None)
        return None

    def read(self) -> GatheredParameter | None:
        grad = self.param.grad
        if grad is None:
            return None
        local = compat.local_tensor(grad)
        full = self.gather(local)
        source = None if full is local else GradSource(self.param, self.fqn)
        return gathered_parameter(full, full, self._write_rows, source)

    def _write_rows(self, full: torch.Tensor) -> None:
        copy_rows(full, self.param, compat.local_tensor(self.param.grad))

    def assign(self, value: torch.Tensor | None) -> None:
        if value is None or isinstance(value, DTensor):
            self.param.grad = value  # torch checks a DTensor's spec
            return
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(self.param.shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"the gradient of {self.fqn!r} (shape {tuple(self.param.shape)}) was given a value of shape "
                f"{got}; give it the full gradient's shape (each rank keeps its own rows), or a DTensor "
                "sharded like the parameter"
            )
        # A copy: a DTensor's local tensor must start its storage (see
        # [Note: units and flat shards] in fxshard/runtime/units.py).
        self.param.grad = rows_of(value, self.param).clone()


class GradSource:
    """The shard gradient a gathered gradient was read from, and its state
    at the read: any change since (another tensor, an in-place write) makes
    the gathered copy stale."""

    def __init__(self, param: ShardParameter, fqn: str) -> None:
        self.param, self.fqn = param, fqn
        self.state = self._now()

    def _now(self) -> tuple[weakref.ref | None, tuple | None]:
        # See [Note: has it changed]: the reference rules out another gradient
        # made where a freed one was (a zero_grad, then a backward).
        grad = self.param.grad
        return (None, None) if grad is None else (weakref.ref(grad), written(grad))

    def check(self) -> None:
        (ref, key), (now_ref, now_key) = self.state, self._now()
        same = ref is not None and now_ref is not None and ref() is now_ref() and key == now_key
        if not same:
            raise ValueError(
                f"this full gradient of {self.fqn!r} was read (module.{self.fqn.rpartition('.')[2]}.grad) before "
                "the gradient changed (a backward, zero_grad, or a write to it); fxshard gathers a copy on each "
                "read, so one held across a change is stale. Read .grad again after the change, or .clone() it "
                "to keep a snapshot"
            )

    def renew(self) -> None:
        self.state = self._now()
