"""The root module's call: how it reads parameters, and what it keeps and clears around each call.

``RootState`` is one model's state, shared by every module whose class
fxshard swapped (see [Note: gather on access] in fxshard/module/swap.py).
Each call of the root runs through ``RootState.call``: it fills the local
shards for the call's reads, on one graph or through the sequencer (see
[Note: two ways to read] in fxshard/module/reads.py), switches to sequenced
reads at a graph break on the first call, and recovers from a call or a
backward that raised.
"""

from __future__ import annotations

import contextvars
import logging
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fxshard.checks import check_distinct_rows
from fxshard.module.optimizers import count_optimizer_steps, retire
from fxshard.module.reads import LocalShards
from fxshard.module.shards import shard_parameter, slot_backed
from fxshard.runtime import compat
from fxshard.runtime.ops import ACCUMULATE, FLUSH, SYNC, GradStore
from fxshard.runtime.plans import ModelRuntime, Param, Shard
from fxshard.runtime.topology import Topology
from fxshard.runtime.units import Units

if TYPE_CHECKING:
    from fxshard.passes.pipeline import FXShardBackend

log = logging.getLogger("fxshard")

# While set, every root module called appends itself: how ``fxshard.cuda_graph``
# learns which models a step runs.
CALLED_ROOTS: contextvars.ContextVar[list[nn.Module] | None] = contextvars.ContextVar(
    "fxshard_called_roots", default=None
)


class RootState:
    """How the root module's calls read parameters (see [Note: two ways to read])."""

    def __init__(self, shards: LocalShards, runtime: ModelRuntime, sequenced: bool, gathered: tuple[Param, ...],
                 topology: Topology, fqns: dict[int, str]) -> None:  # fmt: skip
        # What the model's graphs find by id (see [Note: one registry]); held here, with the model.
        self.runtime = runtime
        self.shards, self.sequencer, self.sequenced = shards, runtime.sequencer, sequenced
        # The plans that read markers name (see [Note: markers name the plan]).
        self.table, self.stored_table = runtime.table, runtime.stored
        self.gathered = gathered  # the parameters that graphs gather, for units (fxshard/runtime/units.py)
        self.topology = topology  # the mesh the shards live on and are sharded over
        self.fqns = fqns  # id of each shard -> its parameter's name
        # id of a shard on the meta device -> (it, the shard that replaced it)
        self.materialized: dict[int, tuple[weakref.ref, DTensor]] = {}
        self.calls = 0
        self.sync = True  # set_requires_gradient_sync (see [Note: accumulation without sync])
        self.store = runtime.store = GradStore(self.sequencer.reduce_one, self._note_kept, self._drop_reset)
        self.sequencer.after_hold = self._note_kept
        self.sequencer.check_held = self._drop_reset
        # plan index -> key of its .grad, as the last backward without sync left it
        self._kept_grads: dict[int, tuple[int, ...] | None] = {}
        self._zeroed: list[Shard] = []  # given a zero .grad without memory (see [Note: a zero gradient without memory])
        self.graph_break_reason: str | None = None  # what dynamo said, when reads went sequenced
        self.backend: FXShardBackend | None = None  # see attach
        self.units: Units | None = None
        self._depth = 0  # root calls running, nested ones included
        self.input_dtype: torch.dtype | None = None  # MixedPrecision.cast_forward_inputs: floating inputs cast to it
        self.check_rows = False  # check_same_init: the first call checks that no two ranks hold the same rows

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
        device = self.topology.device
        if new.device != device:
            raise ValueError(
                f"parameter {fqn!r} lives on this rank's mesh device {device}; fxshard cannot move it to "
                f"{new.device}. Move the model before fxshard.compile, or materialize it there with "
                f"model.to_empty(device={str(device)!r})"
            )
        if old.is_meta:  # to_empty: memory, and no values yet
            made = self.materialized.get(id(param))
            if made is None or made[0]() is not param:
                replacement = shard_parameter(slot_backed(applied, self.topology), param.requires_grad, param.rows)
                replacement.mark_empty()
                count_optimizer_steps(replacement)  # a step writes it (see [Note: has it changed])
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

    def _note_kept(self) -> None:
        # Graphs' and sequenced calls' alike: with .grad None, a reset would not show.
        kept = {*self.store.grads, *self.sequencer.held()}
        for index in kept:
            shard = self.sequencer.params[index].shard
            if shard.hold_zero_grad():
                self._zeroed.append(shard)
        # See [Note: has it changed]. Holding no gradient alive: zero_grad sets None or
        # writes in place, both seen.
        self._kept_grads = {index: self.sequencer.params[index].shard.grad_key() for index in kept}

    def _drop_reset(self, indexes: list[int]) -> None:
        """Drop the gradients kept without sync of each of ``indexes`` whose
        ``.grad`` was reset since the backward that kept them (None, or zeros:
        ``zero_grad`` either way), as a reset drops ``.grad`` in unsharded
        training; raise for one changed otherwise, which the kept gradients,
        held outside ``.grad``, cannot follow."""
        params, reset = self.sequencer.params, []
        for k in indexes:
            key = self._kept_grads.get(k, False)
            if key is False or params[k].shard.grad_key() == key:
                continue
            grad = params[k].shard.grad()
            # A host sync, only where .grad changed.
            if grad is not None and compat.local_tensor(grad).any():
                raise ValueError(
                    f"fxshard: the .grad of {params[k].fqn!r} was changed after micro-batches without sync "
                    "(set_requires_gradient_sync(False)), other than by a reset. Their gradients are kept outside "
                    ".grad until the micro-batch with sync, so the change cannot apply to them. Change gradients "
                    "(scale, clip) after the micro-batch with sync, or reset them: zero_grad(), p.grad = None"
                )
            reset.append(k)
        if not reset:
            return
        names = ", ".join(repr(params[k].fqn) for k in reset[:3]) + (", ..." if len(reset) > 3 else "")
        log.warning(f"fxshard: the .grad of {len(reset)} parameter(s) ({names}) was reset (zero_grad) after "
                    "micro-batches without sync; dropping the gradients kept for them, as their .grad was")  # fmt: skip
        for k in reset:
            self.store.grads.pop(k, None)
            del self._kept_grads[k]
        self.sequencer.drop_held(reset)

    def check_kept(self) -> None:
        """Drop the gradients kept without sync of each parameter whose
        ``.grad`` was reset since, and only those (``_drop_reset``; see
        [Note: accumulation without sync] in runtime/ops.py); once none are
        kept, no zero gradient without memory stays ``.grad``."""
        kept = {*self.store.grads, *self.sequencer.held()}
        if kept or self._kept_grads:  # the default path (no accumulation) stops here
            self._check_kept(kept)
        if self._zeroed and not self.pending():
            for shard in self._zeroed:
                shard.release_zero_grad(materialize=True)
            self._zeroed.clear()

    def _check_kept(self, kept: set[int]) -> None:
        for k in [k for k in self._kept_grads if k not in kept]:  # used since: no baseline any more
            del self._kept_grads[k]
            self.sequencer.params[k].shard.forget_release()
        unfinished = [] if compat.in_backward() else [k for k in kept if k not in self._kept_grads]
        if unfinished:
            # Added by a backward that raised before it ended (no baseline):
            # dropped, as that backward's other gradients are (see _recover).
            for k in unfinished:
                self.store.grads.pop(k, None)
            self.sequencer.drop_held(unfinished)
        self._drop_reset(list(self._kept_grads))

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
        if self.check_rows:
            self.check_rows = not check_distinct_rows(self.sequencer.params)
        if self.sequenced:
            return self._sequenced_call(module, base, args, kwargs)
        if self.units is not None:
            self.units.check_slots()  # once per call, not per gather
        try:
            with self.shards.scope(self._phase()):
                out = base.__call__(module, *args, **kwargs)
        except Exception as error:
            if not compat.is_user_error(error):
                self._note_mixed_precision(error)
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
        # The sequencer gathers on one group (see [Note: expert-parallel parameters]).
        if self.topology.experts is not None:
            raise NotImplementedError(
                "fxshard: the forward of a model with expert parallelism has a graph break, and sequenced reads "
                "do not support expert parameters yet (they are sharded over another group). Remove the graph "
                f"break (the EP all-to-alls trace into one graph). Dynamo said: {reason}"
            ) from error
        log.warning("fxshard: the forward has graph breaks; reads go through the sequencer "
                    "(no reshard, reduces at the end of backward). Dynamo said: %s", reason)  # fmt: skip
        if self.shards.kept is not None:  # the sequencer gathers on every call
            self.shards.kept.drop()
        self.graph_break_reason = reason
        self.backend.graph_break_reason = reason  # for the summaries of the graphs to come
        nn.Module.compile(module, backend=self.backend, fullgraph=False)  # the class's compile is the user's no-op
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
            self._note_mixed_precision(error)
            raise
        raise failed

    def _note_mixed_precision(self, error: Exception) -> None:
        """A dtype mismatch under mixed precision: FSDP2 casts each
        fully_shard module's inputs, fxshard the root call's only, so a
        tensor made inside the model meets a cast weight uncast
        (docs/limits.md). Torch's message names neither cause nor fix."""
        message = str(error) if isinstance(error, RuntimeError) else ""
        # "expected scalar type BFloat16 but found Float": batch_norm's, for its fp32 running statistics.
        if self.input_dtype is not None and ("dtype" in message or "scalar type" in message):
            error.add_note(
                f"fxshard: mixed precision casts the root call's floating-point inputs to {self.input_dtype}, "
                "not each unit's or module's inputs as FSDP2 does: a tensor made inside the model (a buffer, "
                f"a new tensor) reaches a {self.input_dtype} weight in its own dtype. Cast it where the model "
                "makes it (x.to(weight.dtype)). Buffers keep their dtype, as under FSDP2: BatchNorm's fp32 "
                f"running statistics meet its {self.input_dtype} weight"
            )
