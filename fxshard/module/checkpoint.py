"""State dicts of a compiled model: what plain PyTorch accepts, fxshard accepts.

[Note: full state dicts into shards]
``model.state_dict()`` holds each parameter's ``Shard(0)`` DTensor, so
``torch.save``/``load_state_dict`` of it, and ``torch.distributed.checkpoint``
(which reshards DTensors between world sizes by their placements and global
shape), work as for FSDP2. A *full* state dict (plain tensors: a plain
model's, or a Hugging Face checkpoint's) would fail in ``load_state_dict``:
torch copies each value into the parameter with ``param.copy_(value)``, and a
DTensor refuses a plain tensor. So a load pre-hook on the root replaces each
plain value of a sharded parameter by a DTensor of this rank's rows of it,
laid out as the parameter is. Torch then checks keys and shapes as usual
(strict or not) and copies each value into the existing local shard, in
place: the parameter objects, the shards' slots (see [Note: units and flat
shards]) and any optimizer keep holding the same tensors. A value of another
shape is left as it is, for torch's usual size-mismatch error.

[Note: whose shards a state dict holds]
A sharded state dict holds one rank's rows; loaded on another rank, its
values fit the shapes (where shards are even) and would replace that rank's
rows with the saver's, silently: a ``torch.save`` by rank 0 alone, loaded by
every rank. So ``state_dict()`` records, in the state dict's metadata (which
``torch.save`` keeps), the shard rank and count it was taken on, and a load
of sharded values taken on another shard rank raises, naming the fix. Full
state dicts and DCP, which reshard, are unaffected. HSDP replicas hold the
same shards, so only the shard dimension counts; ranks of one TP group hold
different pieces, so their TP coordinate counts too.

A dict built from the state dict loses that metadata: peft's
``get_peft_model_state_dict``, or ``{k: v for k, v in sd.items()}``. Each
DTensor value still says where it was taken: ``torch.save`` pickles its
DeviceMesh with the saving rank's coordinate, which ``get_coordinate()``
returns after ``torch.load``. So a sharded value whose mesh is laid out as
the parameter's and whose coordinate on a sharded dimension is not this
rank's raises too.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fxshard.module.shards import ShardParameter, rows_of

_SHARD = "fxshard_shard"  # state dict metadata: (shard rank, shard count, *TP (rank, size)) it was taken on


def install(model: nn.Module, shard_rank: int, shard_count: int, tp: tuple[tuple[int, int], ...] = ()) -> None:
    """Let ``model`` (the compiled root) load full state dicts, and refuse
    another rank's shards (see the Notes). ``tp``: the (rank, size) of this
    rank on each TP mesh, whose ranks hold different pieces too."""
    taken_on = (shard_rank, shard_count, *tp)

    def stamp(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        local_metadata[_SHARD] = taken_on

    model.register_state_dict_post_hook(stamp)
    model.register_load_state_dict_pre_hook(functools.partial(_check_and_shard, taken_on))


def _check_and_shard(here: tuple, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                     local_metadata: dict, *args: Any) -> None:  # fmt: skip
    saved = local_metadata.get(_SHARD)
    if saved is not None and tuple(saved) != here:
        names = [prefix + n for n, p in module.named_parameters(remove_duplicate=False)
                 if _is_shard(state_dict.get(prefix + n)) and isinstance(p, DTensor)]  # fmt: skip
        if names:
            raise ValueError(f"this state dict holds the shards of rank {_where(saved)} ({names[0]!r} and others), "
                             f"and this is rank {_where(here)}: {_FIX}")  # fmt: skip
    for name, param in module.named_parameters(remove_duplicate=False):
        value = state_dict.get(prefix + name)
        if isinstance(param, DTensor) and _is_shard(value) and _taken_elsewhere(value, param):
            raise ValueError(
                f"the value of {prefix + name!r} is a shard taken at mesh coordinate "
                f"{tuple(value.device_mesh.get_coordinate())}, and this rank is at "
                f"{tuple(param.device_mesh.get_coordinate())} (a file saved by one rank, loaded by all; see [Note: "
                f"whose shards a state dict holds] in fxshard/module/checkpoint.py): {_FIX}"
            )
    _shard_full_values(module, state_dict, prefix, local_metadata, *args)


_FIX = (
    "loading it would give this rank another rank's rows. Save and load a file per rank "
    "(torch.save(model.state_dict(), f'model-{rank}.pt')), use torch.distributed.checkpoint (any world size), or "
    "save a full state dict (get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))"
)


def _taken_elsewhere(value: DTensor, param: DTensor) -> bool:
    """Whether ``value`` holds the shard of another coordinate than this
    rank's on a dimension it is sharded on (see the Note)."""
    ours, theirs = param.device_mesh, value.device_mesh
    if theirs is ours or theirs.mesh.shape != ours.mesh.shape or not torch.equal(theirs.mesh, ours.mesh):
        return False  # this process's own value, or another layout (torch's own checks apply)
    here, there = ours.get_coordinate(), theirs.get_coordinate()
    if here is None or there is None:
        return False
    return any(p.is_shard() and here[d] != there[d] for d, p in enumerate(value.placements))


def _shard_full_values(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict,
                       strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:  # fmt: skip
    # load_state_dict passes a copy of the user's dict: replacing values here
    # leaves theirs untouched.
    assign = local_metadata.get("assign_to_params_buffers", False)
    for name, param in module.named_parameters(remove_duplicate=False):
        key = prefix + name
        value = state_dict.get(key)
        if not isinstance(param, ShardParameter) or not isinstance(value, torch.Tensor):
            continue
        if assign:  # raised here, before torch's copy loop wraps it in text about shapes
            raise NotImplementedError(
                f"load_state_dict(assign=True) into a model that fxshard.compile sharded would replace the shard "
                f"of {key!r} with another tensor, which fxshard's graphs do not read; call load_state_dict without "
                "assign=True, which copies into the existing shards (each rank's rows of a full tensor, a DTensor "
                "shard as it is)"
            )
        if _is_full(value, param):
            state_dict[key] = rows_of(value, param)


def _where(taken_on: Any) -> str:
    where = f"{taken_on[0]} of {taken_on[1]}"
    return where + "".join(f", TP rank {r} of {n}" for r, n in taken_on[2:])


def _is_shard(value: Any) -> bool:
    """A DTensor holding rows of its tensor (replicated ones are the same on every rank)."""
    return isinstance(value, DTensor) and any(p.is_shard() for p in value.placements)


def _is_full(value: Any, param: DTensor) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape
