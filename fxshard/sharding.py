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

[Note: reads outside compiled graphs]
Real models break graphs, and dynamo then runs parts of them eagerly, such as
an MoE loop over only the experts that received tokens. A read there must not
gather once per loop iteration: the count would differ between ranks, and
the ranks would hang or pair the wrong buffers. So the property works two ways:
- traced by dynamo, it emits the ``fxshard::unshard`` marker that the passes
  lower (one gather per parameter per graph);
- run eagerly, it gathers through ``EagerReads``: once per parameter per
  call of the root module, cached until the call returns. Autograd then sums
  every use into one reduce. The number and order of gathers follow the
  program order of first reads, which is the same on every rank.
The property's code is never compiled as a frame of its own (see
``compat.skip_as_top_frame``); otherwise dynamo would compile it alone,
once per parameter, each time eager code reads a parameter.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from fxshard.policy import MixedPrecision
from fxshard.runtime import compat
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


def _gather(shard: DTensor, spec: ParamShard) -> torch.Tensor:
    return unshard(
        shard.to_local(), spec.dim0, spec.world_size, spec.group_name, spec.fqn, spec.dtype, spec.reduce_dtype
    )


class EagerReads:
    """Gathers for parameter reads that run eagerly, cached per root call.

    See [Note: reads outside compiled graphs]. One instance per compiled
    model; ``scope()`` wraps each call of the root module.
    """

    def __init__(self) -> None:
        self._cache: dict[tuple[str, bool], torch.Tensor] | None = None

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        outer, self._cache = self._cache, {}
        try:
            yield
        finally:
            self._cache = outer

    @torch.compiler.disable  # eager by definition: dynamo must not compile its frames either
    def read(self, shard: DTensor, spec: ParamShard) -> torch.Tensor:
        if self._cache is None:  # outside a call of the model: every read gathers
            return _gather(shard, spec)
        key = (spec.fqn, torch.is_grad_enabled())
        if key not in self._cache:
            self._cache[key] = _gather(shard, spec)
        return self._cache[key]


def _gathering_property(attr: str, spec: ParamShard, reads: EagerReads) -> property:
    def get(module: nn.Module) -> torch.Tensor:
        shard = module._parameters[attr]
        if torch.compiler.is_compiling():
            return _gather(shard, spec)
        return reads.read(shard, spec)

    compat.skip_as_top_frame(get.__code__)
    return property(get, doc=f"The full parameter {spec.fqn!r}, gathered from its shards.")


def _root_methods(base: type, reads: EagerReads) -> dict[str, object]:
    def forward(self, *args, **kwargs):
        return base.forward(self, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        with reads.scope():
            return base.__call__(self, *args, **kwargs)

    return {"forward": forward, "__call__": __call__}


def _swap_class(module: nn.Module, attrs: dict[str, ParamShard], root: bool, reads: EagerReads) -> None:
    base = type(module)
    namespace: dict[str, object] = {name: _gathering_property(name, spec, reads) for name, spec in attrs.items()}
    if root:
        namespace.update(_root_methods(base, reads))
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
    reads = EagerReads()
    for mod, attrs in per_module.items():
        _swap_class(mod, attrs, root=mod is model, reads=reads)
    return tuple(specs.values())
