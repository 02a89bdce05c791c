"""What ``fxshard.compile`` swaps in the user's module: parameters for shards, classes for gathering ones.

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

import builtins
import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fxshard.module import hf
from fxshard.module.optimizers import retire, watch_unsynced
from fxshard.module.reads import LocalShards, gathering_property
from fxshard.module.root import RootState
from fxshard.module.shards import HeldShard, shard_of
from fxshard.module.structure import watch
from fxshard.module.writes import parameter_of
from fxshard.module.zero1 import KeptParams
from fxshard.plan import ParamPlan
from fxshard.runtime import compat, process
from fxshard.runtime.plans import ModelRuntime, Param, PlanTable
from fxshard.runtime.sequencer import Sequencer
from fxshard.runtime.topology import Topology


class FXShardModule:
    """Mixin of every module class that fxshard swapped in."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        # ``to_empty``, ``.to``, ``.half``: into the shards themselves (see
        # RootState.take), so parameters, units and optimizers keep their tensors.
        return apply_to_shards(self, fn, self.__dict__[ROOT_STATE].take, recurse)

    def __setattr__(self, name: str, value: Any) -> None:
        params = self.__dict__.get("_parameters")
        current = params.get(name) if params is not None else None
        if current is not None and isinstance(current, DTensor):
            target = parameter_of(value)
            if target is current:
                return  # the parameter assigned to itself (a tie restated in init_weights): nothing changes
            if target is not None:
                fqn = self.__dict__[ROOT_STATE].fqns.get(id(current), name)
                raise ValueError(
                    f"assigning another parameter to {fqn!r} after fxshard.compile: compile fixed which "
                    "parameter each module holds (and so which weights are tied and how they are gathered). "
                    "Tie or replace parameters before fxshard.compile; to give a parameter new values, "
                    "use load_state_dict() without assign=True, or copy_() into it"
                )
        super().__setattr__(name, value)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        # Under torch.__future__.set_swap_module_params_on_conversion(True),
        # torch loads a parameter by swapping a new tensor into it
        # (Tensor.module_load, then torch.utils.swap_tensors): the shard would
        # become a plain DTensor that no longer knows its rows, with new
        # autograd state (hooks registered on it gone). Without assign=True
        # (refused for full values, see module/checkpoint.py), the swap loads
        # the same values that a copy does, so the shards take them in place
        # (the flag is torch's, for the process: see [Note: process-wide effects]).
        with process.loads_in_place():
            super()._load_from_state_dict(*args, **kwargs)

    def get_parameter(self, target: str) -> nn.Parameter:
        # The registered parameter, the shard, as ``named_parameters()`` gives
        # it; torch's ``getattr`` would give the gathered full value and refuse it.
        path, _, name = target.rpartition(".")
        param = self.get_submodule(path)._parameters.get(name)
        return param if param is not None else super().get_parameter(target)

    def __deepcopy__(self, memo: dict) -> nn.Module:
        raise NotImplementedError(
            "copy.deepcopy of a module that fxshard.compile sharded is not supported (its shards are tied to "
            "the model's units and process groups). For an EMA copy, keep copies of the shards: "
            "ema = [p.detach().clone() for p in model.parameters()], updated with "
            "torch._foreach_lerp_(ema, [p.detach() for p in model.parameters()], 1 - decay); "
            "or deepcopy the model before fxshard.compile and compile the copy too"
        )


def apply_to_shards(
    module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], take: Callable, recurse: bool = True
) -> nn.Module:
    """``nn.Module._apply`` for a module holding shards: ``fn`` of each shard
    is taken into the shard itself (``take``), so parameters, units and
    optimizers keep their objects (a shard materialized from the meta device
    is a new object, which ``take`` returns); children and buffers as usual."""
    if recurse:
        for child in module.children():
            child._apply(fn)
    for key, param in module._parameters.items():
        if param is not None:
            with torch.no_grad():
                replacement = take(param, fn(param), key)
            if replacement is not None:
                module._parameters[key] = replacement
    for key, buf in module._buffers.items():
        if buf is not None:
            module._buffers[key] = fn(buf)
    return module


PLAN = "_fxshard_plan"  # the ShardPlan, in the root's instance __dict__ (see _root_methods)


class FXShardRoot(FXShardModule):
    """Mixin of the class of the module that ``fxshard.compile`` was called on."""

    @property
    def fxshard_plan(self) -> Any:
        """The ``ShardPlan`` that ``fxshard.compile`` made."""
        return self.__dict__[PLAN]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: the backward passes of the calls that follow accumulate full
        gradients on each rank, with no collective; the next backward with
        True reduces them with its own (FSDP2's name; see [Note: accumulation
        without sync]). Every rank must make the same calls. ``recurse`` is
        accepted for FSDP2's signature: the whole model is one root here."""
        if not isinstance(requires_gradient_sync, bool):
            raise ValueError(f"set_requires_gradient_sync takes True or False, got {requires_gradient_sync!r}")
        state = self.__dict__[ROOT_STATE]
        state.sync = requires_gradient_sync


def _root_forward(self, *args, **kwargs):
    return _base.forward(self, *args, **kwargs)  # noqa: F821 - _base is in the copy's own globals


ROOT_STATE = "_fxshard_root_state"  # the root's RootState, in the instance __dict__ of every swapped module


def _root_methods(base: type) -> dict[str, object]:
    """The root's ``forward``, a copy of ``_root_forward`` with its own code
    object and its own globals. Dynamo stores each function it compiles in
    the globals of the frame it compiled (``__compiled_fn_<n>``), and keeps
    its cache on the code object: a ``forward`` that every root shared, with
    this module's globals, kept every compiled model, its shards and its
    units alive for the life of the process, ``torch._dynamo.reset()`` or
    not. The copy's globals die with the class.

    The class holds nothing of the model's: caches keep classes (Python's
    ``inspect`` memoizes lookups by class), so the root's state, which holds
    its modules and units, lives on the instance (``ROOT_STATE``)."""
    code = _root_forward.__code__.replace()
    forward = types.FunctionType(code, {"__builtins__": builtins, "__name__": __name__, "_base": base}, "forward")
    forward.__qualname__ = f"FXShard{base.__name__}.forward"

    def __call__(self, *args, **kwargs):
        return self.__dict__[ROOT_STATE].call(self, base, args, kwargs)

    # A user's torch.compile over the model (wrapped out of habit) skips the
    # call: fxshard's own graph runs, rewritten, as without it. Traced
    # through, torch 2.11's dynamo fails inside fxshard's bookkeeping.
    __call__ = compat.not_traced(__call__, reason=(
        "fxshard.compile compiled this model already and runs its own graph, so torch.compile(model) calls it "
        "untraced; under fullgraph=True that is an error. Drop fullgraph=True, or the outer torch.compile"))  # fmt: skip

    def compile(self, *args, **kwargs):  # noqa: A001 - nn.Module.compile, as users call it
        # fxshard compiled the module already; torch's would replace its
        # graph (gathers, units, reduces) with a plain compile of the model.
        warnings.warn(
            "fxshard: model.compile() after fxshard.compile does nothing: the model is compiled already and runs "
            "fxshard's own graph. Remove the call; compile options go to fxshard.compile (backend=...)",
            stacklevel=2,
        )

    methods = {"forward": forward, "__call__": __call__, "compile": compile}
    if hf.takes_state_dict(getattr(base, "save_pretrained", None)):
        methods["save_pretrained"] = hf.save_pretrained_method(base)
    return methods


def _swap_class(module: nn.Module, properties: dict[str, property], state: RootState, root: bool) -> None:
    base = type(module)
    namespace: dict[str, object] = dict(properties)
    if root:
        namespace.update(_root_methods(base))
    module.__dict__[ROOT_STATE] = state
    mixin = FXShardRoot if root else FXShardModule
    module.__class__ = type(f"FXShard{base.__name__}", (mixin, base), namespace)


def shard_parameters(
    model: nn.Module,
    plans: dict[int, ParamPlan],
    topology: Topology,
    sequenced: bool,
    bucket_bytes: int,
    count_group_name: str = "",
) -> RootState:
    """Shard every parameter of ``model`` in place as ``plans`` (by the
    parameter's id) says; return the root's state. ``topology``: the mesh
    the DTensors live on and are sharded over; its replicas are what the
    sequencer and ZeRO-1's copies average gradients across (HSDP; graphs'
    reduces average themselves: see [Note: HSDP]). ``bucket_bytes``: the size of ZeRO-1's
    coalesced gathers and reduces (see [Note: ZeRO-1]). ``count_group_name``:
    where sharded lookups compare token counts (see [Note: sharded lookups]). ``sequenced`` starts with
    sequenced reads (eager runs). Shards live on the topology's device: the
    parameters' device, or the mesh's for parameters on the meta device
    (materialized later by ``to_empty``).

    A parameter owned by several modules (tied weights) becomes one shard,
    registered in every owner, and is named by its first owner's path.
    Assumes every rank holds the same initial values, as FSDP2 does: each rank
    keeps its rows without communicating.
    """
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in model.modules():
        for attr, param in mod._parameters.items():
            if param is not None:
                owners.setdefault(id(param), []).append((mod, attr))

    per_module: dict[nn.Module, dict[str, ParamPlan]] = {}
    params: list[Param] = []  # the one run-time record of each distinct parameter, in plan order
    fqns: dict[int, str] = {}
    for key, mod_attrs in owners.items():
        spec = plans[key]
        first_mod, first_attr = mod_attrs[0]
        old = first_mod._parameters[first_attr]
        shard = shard_of(old, topology, spec)
        retire(old, spec.fqn)
        fqns[id(shard)] = spec.fqn
        for mod, attr in mod_attrs:
            mod._parameters[attr] = shard
            per_module.setdefault(mod, {})[attr] = spec
        rows = shard.rows.stop - shard.rows.start
        params.append(Param(len(params), spec, rows, HeldShard(first_mod, first_attr)))
    per_module.setdefault(model, {})
    table = PlanTable(tuple(p.plan for p in params), tuple(p.local_rows for p in params), count_group_name)
    model_runtime = ModelRuntime(table)  # gives the table its id (see [Note: one registry])
    index = {spec.fqn: i for i, spec in enumerate(table.params)}
    replicas = topology.replicas
    model_runtime.sequencer = Sequencer(table.id, params, topology.shard.size, topology.shard.name, replicas)
    kept = [p for p in params if p.plan.kept]
    shards = LocalShards(list(owners.values()), KeptParams(kept, bucket_bytes) if kept else None)
    # Units gather and reduce the shards that graphs gather, and reduce ZeRO-1's (see [Note: ZeRO-1]);
    # not the experts', sharded over another group (see [Note: expert-parallel parameters]).
    gathered = tuple(p for p in params if not p.plan.replicated and not (p.plan.tp is not None and p.plan.tp.expert))
    state = RootState(shards, model_runtime, sequenced, gathered, topology, fqns)
    watch_unsynced(state)
    for mod, attrs in per_module.items():
        props = {a: gathering_property(a, spec, index[spec.fqn], table.id, state.stored_table.id,
                                       topology.tp_mesh(spec.tp.mesh_dims).mesh if spec.tp else None)
                 for a, spec in attrs.items()}  # fmt: skip
        _swap_class(mod, props, state, root=mod is model)
    watch(model, shards.held_ids)  # see [Note: parameters join before compile]
    return state
