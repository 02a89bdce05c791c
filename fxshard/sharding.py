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

import builtins
import contextvars
import logging
import types
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fxshard.module import hf
from fxshard.module.optimizers import retire, watch_unsynced
from fxshard.module.reads import LocalShards, gathering_property
from fxshard.module.shards import shard_of, shard_parameter, slot_backed
from fxshard.module.writes import parameter_of
from fxshard.module.zero1 import KeptParams
from fxshard.plan import ParamPlan
from fxshard.runtime import compat
from fxshard.runtime.collectives import shard_range
from fxshard.runtime.ops import ACCUMULATE, FLUSH, SYNC, GradStore
from fxshard.runtime.plans import PlanTable
from fxshard.runtime.sequencer import SeqEntry, Sequencer
from fxshard.runtime.topology import Group, Topology
from fxshard.runtime.units import ParamInfo, Units

if TYPE_CHECKING:
    from fxshard.passes.pipeline import FXShardBackend

log = logging.getLogger("fxshard")

# While set, every root module called appends itself: how ``fxshard.cuda_graph``
# learns which models a step runs.
CALLED_ROOTS: contextvars.ContextVar[list[nn.Module] | None] = contextvars.ContextVar(
    "fxshard_called_roots", default=None
)


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


class RootState:
    """How the root module's calls read parameters (see [Note: two ways to read])."""

    def __init__(self, shards: LocalShards, sequencer: Sequencer, sequenced: bool, infos: tuple[ParamInfo, ...],
                 device: torch.device, fqns: dict[int, str], table: PlanTable) -> None:  # fmt: skip
        self.shards, self.sequencer, self.sequenced = shards, sequencer, sequenced
        # The plans that read markers name (see [Note: markers name the plan]); held here, with the model.
        self.table, self.stored_table = table, table.as_stored()
        self.infos = infos  # per distinct parameter, for units (fxshard/runtime/units.py)
        self.device = device
        self.fqns = fqns  # id of each shard -> its parameter's name
        # id of a shard on the meta device -> (it, the shard that replaced it)
        self.materialized: dict[int, tuple[weakref.ref, DTensor]] = {}
        self.calls = 0
        self.sync = True  # set_requires_gradient_sync (see [Note: accumulation without sync])
        self.store = GradStore(table.id, sequencer.reduce_one, self._note_kept)
        sequencer.after_hold = self._note_kept
        self._kept_grads: tuple | None = None  # the .grad tensors as the last backward without sync left them
        self.graph_break_reason: str | None = None  # what dynamo said, when reads went sequenced
        self.backend: FXShardBackend | None = None  # see attach
        self.units: Units | None = None
        self._depth = 0  # root calls running, nested ones included
        self.input_dtype: torch.dtype | None = None  # MixedPrecision.cast_forward_inputs: floating inputs cast to it

    def attach(self, backend: FXShardBackend | None, units: Units | None) -> None:
        """The compiler the root's calls run through (None for
        ``backend="eager"``), and the units its graphs gather (None at one
        rank): the first call moves the shards into the units' slots, a
        graph break on it recompiles allowing breaks."""
        self.backend, self.units = backend, units

    def take(self, param: DTensor, applied: Any, attr: str) -> DTensor | None:
        """Take ``applied``, what ``nn.Module._apply``'s function made of the
        shard ``param``, into ``param`` itself; or, for a shard on the meta
        device, return the parameter that replaces it (a DTensor keeps the
        device it was made on), the same one for every module sharing it."""
        if applied is param:
            return None
        fqn = self.fqns.get(id(param), attr)
        if not isinstance(applied, DTensor) or applied.dtype != param.dtype:
            raise ValueError(
                f"parameter {fqn!r} is a {param.dtype} shard; fxshard.compile fixed its dtype, so the model "
                f"cannot be converted to {getattr(applied, 'dtype', type(applied).__name__)} now. Convert it "
                "before fxshard.compile (model.to(dtype)), or compute in another dtype with "
                "mp_policy=fxshard.MixedPrecision(param_dtype=...)"
            )
        new, old = compat.local_tensor(applied), compat.local_tensor(param)
        if new.device != self.device:
            raise ValueError(
                f"parameter {fqn!r} lives on this rank's mesh device {self.device}; fxshard cannot move it to "
                f"{new.device}. Move the model before fxshard.compile, or materialize it there with "
                f"model.to_empty(device={str(self.device)!r})"
            )
        if old.is_meta:  # to_empty: memory, and no values yet
            made = self.materialized.get(id(param))
            if made is None or made[0]() is not param:
                replacement = shard_parameter(slot_backed(applied), param.requires_grad)
                replacement.mark_empty()
                made = self.materialized[id(param)] = (weakref.ref(param), replacement)
                retire(param, fqn)
                self.fqns[id(replacement)] = fqn
            return made[1]
        if new is not old:
            old.copy_(new)
        return None

    def call(self, module: nn.Module, base: type, args: tuple, kwargs: dict) -> Any:
        called = CALLED_ROOTS.get()
        if called is not None:
            called.append(module)
        if self.input_dtype is not None:
            args, kwargs = self._cast_inputs(args), self._cast_inputs(kwargs)
        # Logging and prints in the forward are not graph breaks for fxshard's
        # compiles (see compat.debug_calls_in_traces).
        with compat.debug_calls_in_traces():
            return self._call(module, base, args, kwargs)

    def _cast_inputs(self, value: Any) -> Any:
        """Floating-point tensors in ``value`` (tensors, and lists, tuples and
        dicts of them) in ``input_dtype``; everything else as it is."""
        if isinstance(value, torch.Tensor):
            return value.to(self.input_dtype) if value.is_floating_point() else value
        if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
            return type(value)(self._cast_inputs(v) for v in value)
        if type(value) is dict:
            return {k: self._cast_inputs(v) for k, v in value.items()}
        return value

    def _phase(self) -> int:
        if not torch.is_grad_enabled():
            return SYNC  # no gradient: the graph of no phase (inference)
        if not self.sync:
            return ACCUMULATE
        return FLUSH if self.store.grads else SYNC

    def pending(self) -> bool:
        """Whether gradients accumulated without sync wait for a call with sync."""
        return bool(self.store.grads) or self.sequencer.pending()

    def _grads_now(self) -> tuple:
        grads = [p.grad for p in self.shards.parameters()]
        return tuple(None if g is None else (id(g), g._version, compat.local_tensor(g)._version) for g in grads)

    def _note_kept(self) -> None:
        self._kept_grads = self._grads_now()

    def check_kept(self) -> None:
        """Drop the gradients kept without sync if ``.grad`` was reset since
        (see [Note: accumulation without sync] in runtime/ops.py)."""
        if not self.pending() or self._kept_grads is None or self._grads_now() == self._kept_grads:
            return
        log.warning("fxshard: gradients were reset (zero_grad) after micro-batches without sync; dropping the "
                    "gradients kept for those micro-batches, as their .grad was")  # fmt: skip
        self.store.grads.clear()
        self.sequencer.drop_held()
        self._kept_grads = None

    def _sequenced_call(self, module: nn.Module, base: type, args: tuple, kwargs: dict) -> Any:
        with self.sequencer.call(self.sync) as (anchor, frozen), self.shards.anchors(anchor, frozen):
            return base.__call__(module, *args, **kwargs)

    def _call(self, module: nn.Module, base: type, args: tuple, kwargs: dict) -> Any:
        outermost = self._depth == 0 and not compat.in_backward()
        if outermost:
            self._recover(after_raise=False)
        self._depth += 1
        try:
            return self._outer_call(module, base, args, kwargs)
        except BaseException:
            if outermost:
                self._recover(after_raise=True)
            raise
        finally:
            self._depth -= 1

    def _recover(self, after_raise: bool) -> None:
        """Clear what a call or a backward that raised left behind (see
        [Note: a call that raises] in fxshard/runtime/units.py): wait for its
        collectives in flight, and drop the gradients a failed backward gave
        sequenced calls. Before a call, this finds what a backward left."""
        in_flight = self.units.drain() if self.units is not None else 0
        failed = self.sequencer.drop_failed_backward()
        if (in_flight or failed) and not after_raise:
            log.warning("fxshard: the last backward raised; its gradients are dropped (%d collectives in flight "
                        "waited for). Zero the gradients before the next step, as after any failed backward: "
                        ".grad may hold part of it", in_flight)  # fmt: skip

    def _outer_call(self, module: nn.Module, base: type, args: tuple, kwargs: dict) -> Any:
        self.check_kept()
        if self.sequenced:
            return self._sequenced_call(module, base, args, kwargs)
        try:
            with self.shards.scope(self._phase(), self.store):
                out = base.__call__(module, *args, **kwargs)
        except Exception as error:
            if not compat.is_user_error(error):
                return self._on_graph_break(error, module, base, args, kwargs)
            failed = error
        else:
            if self.calls == 0 and self.units is not None:
                self.units.rehome()  # the model runs as one graph: units are used
            self.calls += 1
            return out
        # Outside the except block, so that the user's exception is not
        # chained to dynamo's.
        self._raise_eagerly(failed, module, base, args, kwargs)

    def _on_graph_break(self, error: Exception, module: nn.Module, base: type, args: tuple, kwargs: dict) -> Any:
        if not compat.is_graph_break(error):
            raise error
        reason = compat.graph_break_reason(error)
        if self.calls or self.backend is None:
            raise NotImplementedError(
                "fxshard: a graph break appeared after the first call (a recompile for new input shapes or "
                "modes). fxshard chooses how to gather on the first call, the same on every rank, and cannot "
                "switch later. Make the first call representative (same mode and code path), or remove the "
                f"graph break. Dynamo said: {reason}"
            ) from error
        log.warning("fxshard: the forward has graph breaks; reads go through the sequencer "
                    "(no reshard, reduces at the end of backward). Dynamo said: %s", reason)  # fmt: skip
        if self.shards.kept is not None:  # the sequencer gathers on every call
            self.shards.kept.drop()
        self.graph_break_reason = reason
        self.backend.graph_break_reason = reason  # for the summaries of the graphs to come
        module.compile(backend=self.backend, fullgraph=False)
        self.sequenced = True
        return self._outer_call(module, base, args, kwargs)

    def _raise_eagerly(self, failed: Exception, module: nn.Module, base: type, args: tuple, kwargs: dict) -> None:
        """Raise what the user's forward raises, as it raises it. Dynamo
        reports an exception of the traced code as its own error (``failed``),
        so the call runs again uncompiled, reading through the sequencer: the
        same collectives on every rank, whatever the code reads before it
        raises. Should it not raise, dynamo's error stands."""
        try:
            with torch.compiler.set_stance("force_eager"):
                self._sequenced_call(module, base, args, kwargs)
        except Exception as error:
            error.add_note(f"fxshard: raised by the model's forward, run uncompiled after dynamo stopped at it "
                           f"({compat.graph_break_reason(failed)})")  # fmt: skip
            raise
        raise failed


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

    methods = {"forward": forward, "__call__": __call__}
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
    entries: list[SeqEntry] = []
    infos: list[ParamInfo] = []
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
        entries.append(_seq_entry(first_mod, first_attr, spec, topology.shard))
        if not spec.replicated and not spec.kept:  # units gather and reduce shards that graphs gather
            infos.append(_param_info(first_mod, first_attr, spec, topology.shard))
    per_module.setdefault(model, {})
    table = PlanTable(tuple(plans[key] for key in owners), tuple(e.local_rows for e in entries), count_group_name)
    index = {spec.fqn: i for i, spec in enumerate(table.params)}
    replicas = topology.replicas
    sequencer = Sequencer(table.id, entries, topology.shard.size, topology.shard.name, replicas)
    kept = {i: spec for i, spec in enumerate(table.params) if spec.kept}
    kept_rows = {i: table.local_rows[i] for i in kept}
    shards = LocalShards(list(owners.values()), KeptParams(kept, kept_rows, replicas, bucket_bytes) if kept else None)
    state = RootState(shards, sequencer, sequenced, tuple(infos), topology.device, fqns, table)
    watch_unsynced(state)
    for mod, attrs in per_module.items():
        props = {a: gathering_property(a, spec, index[spec.fqn], table.id, state.stored_table.id)
                 for a, spec in attrs.items()}  # fmt: skip
        _swap_class(mod, props, state, root=mod is model)
    return state


def _seq_entry(module: nn.Module, attr: str, spec: ParamPlan, shard: Group) -> SeqEntry:
    def local() -> torch.Tensor:
        return module._parameters[attr].to_local().detach()

    def add_grad(grad: torch.Tensor) -> None:
        param = module._parameters[attr]
        if param.grad is None:
            param.grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False,
                                            shape=param.shape, stride=param.stride())  # fmt: skip
        else:
            param.grad.to_local().add_(grad)

    start, end = shard_range(spec.dim0, shard.size, shard.rank)
    if spec.replicated:
        start, end = 0, spec.dim0

    def trainable() -> bool:
        return module._parameters[attr].requires_grad

    return SeqEntry(spec.fqn, spec.dim0, end - start, spec.shape, spec.dtype, spec.reduce_dtype, spec.shard_dtype,
                    trainable, local, add_grad, spec.replicated)  # fmt: skip


def _param_info(module: nn.Module, attr: str, spec: ParamPlan, shard: Group) -> ParamInfo:
    def local() -> torch.Tensor:
        return compat.local_tensor(module._parameters[attr])

    def rehome(tensor: torch.Tensor) -> None:
        compat.replace_local_tensor(module._parameters[attr], tensor)

    start, end = shard_range(spec.dim0, shard.size, shard.rank)
    gather_dtype = spec.dtype or spec.shard_dtype
    return ParamInfo(spec.fqn, spec.shape, end - start, spec.shard_dtype, gather_dtype,
                     spec.reduce_dtype or gather_dtype, spec.device, local, rehome)  # fmt: skip
