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
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fxshard.params import local_rows


def install(model: nn.Module) -> None:
    """Let ``model`` (the compiled root) load full state dicts (see the Note)."""
    model.register_load_state_dict_pre_hook(_shard_full_values)


def _shard_full_values(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict,
                       strict: bool, missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:  # fmt: skip
    # load_state_dict passes a copy of the user's dict: replacing values here
    # leaves theirs untouched.
    assign = local_metadata.get("assign_to_params_buffers", False)
    for name, param in module.named_parameters(remove_duplicate=False):
        key = prefix + name
        value = state_dict.get(key)
        if not isinstance(param, DTensor) or not _is_full(value, param):
            continue
        if assign:
            raise NotImplementedError(
                f"load_state_dict(assign=True) of a full tensor ({key!r}) into a model that fxshard.compile "
                "sharded would replace its shards; call load_state_dict without assign=True, which copies "
                "each rank's rows into the existing shards"
            )
        state_dict[key] = _rows_of(value, param)


def _is_full(value: Any, param: DTensor) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.shape == param.shape


def _rows_of(full: torch.Tensor, param: DTensor) -> DTensor:
    """This rank's rows of ``full`` (all of them, replicated), as a DTensor laid out like ``param``."""
    local = full.detach()[slice(*local_rows(param))] if full.dim() else full.detach()
    return DTensor.from_local(local.to(param.device), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride())  # fmt: skip
