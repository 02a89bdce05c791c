"""Parameters that join a compiled model later raise.

[Note: parameters join before compile]
``fxshard.compile`` shards the parameters that the model holds then. A
parameter that joins later, through a new or replaced submodule (a new head,
``resize_token_embeddings``, a PEFT adapter, ``weight_norm``) or
``register_parameter``, would be a plain tensor on every rank, trained on
that rank's batch alone: the ranks drift apart, and nothing says so. FSDP2
and DDP register their parameters once too, and say nothing either.

Torch's registration hooks see every such registration, before it takes
effect. On a module of a compiled model, one that brings a parameter that is
not already one of that model's shards raises, naming the fix. One that
brings none passes (a ``Dropout``, a module moved within the model, a child
set to None), and the modules it brings are watched from then on.

The hooks are process-wide (see [Note: process-wide effects]): held by the
compiled models, registered with the first and removed with the last.
Registration is rare after compile; each costs a dictionary lookup.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn

from fxshard.runtime.process import HeldHook

# Each module of a compiled model -> (its root, the ids of the root's shards now).
_WATCHED: weakref.WeakKeyDictionary[nn.Module, tuple[weakref.ref, weakref.WeakMethod]] = weakref.WeakKeyDictionary()


def watch(model: nn.Module, held: Any) -> None:
    """Raise on registrations into ``model`` that bring parameters which
    ``held()`` (the ids of the model's shards now) does not list."""
    entry = (weakref.ref(model), weakref.WeakMethod(held))  # weak: a value must not keep its key alive
    for module in model.modules():
        _WATCHED[module] = entry
    _MODULE_HOOK.hold(model)
    _PARAMETER_HOOK.hold(model)


def _entry(module: nn.Module) -> tuple[nn.Module, Any] | None:
    if torch.compiler.is_compiling():
        # A module made and registered inside a traced forward (Hugging Face
        # models do): traced, the lookup made dynamo guard on every watched
        # module's state, and recompile on every call.
        return None
    entry = _WATCHED.get(module)
    if entry is None:
        return None
    root, held = entry[0](), entry[1]()
    return None if root is None or held is None else (root, held)


def _where(root: nn.Module, module: nn.Module, name: str) -> str:
    path = next((n for n, m in root.named_modules(remove_duplicate=False) if m is module), None)
    return name if not path else f"{path}.{name}"


_FIX = (
    "fxshard.compile sharded the parameters the model held then; a parameter that joins later would train on "
    "each rank's batch alone, out of step across ranks. Add or replace submodules that hold parameters (a new "
    "head, resize_token_embeddings, PEFT adapters, weight_norm) before fxshard.compile; to give existing "
    "parameters new values, use load_state_dict() or copy_() into them"
)


def _on_module(module: nn.Module, name: str, child: nn.Module | None) -> None:
    found = _entry(module)
    if found is None or child is None:
        return None
    root, held = found
    ids = held()
    new = [n for n, p in child.named_parameters() if id(p) not in ids]
    if new:
        shown = ", ".join(new[:3]) + (f" and {len(new) - 3} more" if len(new) > 3 else "")
        kind = type(child)
        kind_name = kind.__name__ if kind.__module__.startswith("torch.") else f"{kind.__module__}.{kind.__qualname__}"
        raise ValueError(
            f"fxshard: {kind_name} set as {_where(root, module, name)!r} after fxshard.compile holds "
            f"parameters that the compiled model does not ({shown}). {_FIX}"
        )
    entry = _WATCHED[module]
    for sub in child.modules():
        _WATCHED[sub] = entry
    return None


def _on_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    found = _entry(module)
    if found is None or param is None:
        return None
    root, held = found
    if id(param) not in held():
        raise ValueError(f"fxshard: parameter {_where(root, module, name)!r} registered after fxshard.compile. {_FIX}")
    return None


_MODULE_HOOK = HeldHook.on_module_registration(_on_module)
_PARAMETER_HOOK = HeldHook.on_parameter_registration(_on_parameter)
