"""Sharding a module's parameters in place, and reading them back gathered.

[Note: gather on access]
Each parameter is replaced, in every module that owns it, by one
``nn.Parameter`` holding a ``Shard(0)`` DTensor; optimizers, gradient clipping
and ``state_dict`` see only shards. Each owning module's class is swapped for
a subclass whose property of the same name returns the *full* parameter,
produced by ``fxshard::unshard`` (see [Note: unshard markers]). So every read
gathers, wherever it happens: in the owner's forward, in a parent reading
``self.conv1d.weight`` for a fused kernel, in a custom op's arguments, after a
graph break, or with no compiler at all. ``module._parameters`` still holds the
shard, so ``parameters()`` and ``state_dict()`` keep their names.

The root's class also gets a ``forward`` defined here. Dynamo skips frames
whose code lives in torch (``nn.Sequential.forward``, say) when they are the
top frame, so the compiled top frame must be fxshard's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fxshard.policy import MixedPrecision
from fxshard.runtime.collectives import shard_range
from fxshard.runtime.ops import unshard


class FXShardModule:
    """Mixin of every module class that fxshard swapped in."""


class FXShardRoot(FXShardModule):
    """Mixin of the class of the module that ``fxshard.compile`` was called on."""


@dataclass(frozen=True)
class ParamShard:
    """How one parameter is sharded and gathered: everything an access needs."""

    fqn: str
    dim0: int
    world_size: int
    group_name: str
    dtype: torch.dtype | None  # gather and compute dtype; None keeps the shard's
    reduce_dtype: torch.dtype | None
    requires_grad: bool


def _gathering_property(attr: str, spec: ParamShard) -> property:
    def get(module: nn.Module) -> torch.Tensor:
        local = module._parameters[attr].to_local()
        return unshard(local, spec.dim0, spec.world_size, spec.group_name, spec.fqn, spec.dtype, spec.reduce_dtype)

    return property(get, doc=f"The full parameter {spec.fqn!r}, gathered from its shards.")


def _root_forward(base: type) -> object:
    def forward(self, *args, **kwargs):
        return base.forward(self, *args, **kwargs)

    return forward


def _swap_class(module: nn.Module, attrs: dict[str, ParamShard], root: bool) -> None:
    base = type(module)
    namespace: dict[str, object] = {name: _gathering_property(name, spec) for name, spec in attrs.items()}
    if root:
        namespace["forward"] = _root_forward(base)
    mixin = FXShardRoot if root else FXShardModule
    module.__class__ = type(f"FXShard{base.__name__}", (mixin, base), namespace)


def _shard_of(full: torch.Tensor, mesh: DeviceMesh, requires_grad: bool) -> nn.Parameter:
    world_size, rank = mesh.size(), mesh.get_local_rank()
    start, end = shard_range(full.shape[0], world_size, rank)
    local = full.detach()[start:end].clone()
    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
    return nn.Parameter(dt, requires_grad=requires_grad)


def shard_parameters(model: nn.Module, mesh: DeviceMesh, mp: MixedPrecision) -> tuple[ParamShard, ...]:
    """Shard every parameter of ``model`` in place; return the plan of each.

    A parameter owned by several modules (tied weights) becomes one shard,
    registered in every owner, and is named by its first owner's path.
    Assumes every rank holds the same initial values, as FSDP2 does: each rank
    keeps its rows without communicating.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    specs: dict[int, ParamShard] = {}
    for mod_name, mod in model.named_modules():
        for attr, param in mod._parameters.items():
            if param is None:
                continue
            owners.setdefault(id(param), []).append((mod, attr))
            if id(param) not in specs:
                fqn = f"{mod_name}.{attr}" if mod_name else attr
                dtype = mp.param_dtype if mp.param_dtype not in (None, param.dtype) else None
                specs[id(param)] = ParamShard(
                    fqn, param.shape[0], mesh.size(), mesh.get_group().group_name,
                    dtype, mp.reduce_dtype, param.requires_grad,
                )  # fmt: skip

    per_module: dict[nn.Module, dict[str, ParamShard]] = {}
    for key, mod_attrs in owners.items():
        spec = specs[key]
        first_mod, first_attr = mod_attrs[0]
        shard = _shard_of(first_mod._parameters[first_attr], mesh, spec.requires_grad)
        for mod, attr in mod_attrs:
            mod._parameters[attr] = shard
            per_module.setdefault(mod, {})[attr] = spec
    per_module.setdefault(model, {})
    for mod, attrs in per_module.items():
        _swap_class(mod, attrs, root=mod is model)
    return tuple(specs.values())
