"""Reading a parameter: the property that gathers it, and the shards a root call hands to graphs.

[Note: two ways to read]
How a read inside a call of the root module gathers depends on the capture:
- The forward is one graph (``fullgraph=True`` succeeded on the first call):
  each read emits the ``fxshard::unshard`` marker on the rank's local shard,
  and the graph passes turn the markers into collectives inside the graph.
  One graph runs once per call on every rank, so every rank issues the same
  collectives.
- The forward breaks into several graphs with Python between them, which may
  branch on data (an MoE loop over the experts that received tokens). Then
  every read, compiled or eager, goes through the model's ``Sequencer``,
  which issues collectives in plan order whatever the reads were (see
  [Note: sequenced reads]).
The choice is made once, on the first call, before any collective runs, and
is the same on every rank: a graph break depends on the code, not the data.

[Note: plain tensors into compiled graphs]
Compiled graphs never see a DTensor. Each root call fills every owning
module's ``_fxshard_locals`` table: the local shards (one ``_ToLocal`` node
links their gradients back to the DTensor parameters; a call without sync,
which gives them none, reads detached leaves), or, for sequenced reads, the
call's anchors. The property reads from that table, so dynamo
lifts plain tensors as graph inputs. (torch 2.13 passes a DTensor's
DeviceMesh into graphs as an opaque value, which AOTAutograd cannot save for
backward inside activation-checkpoint regions.)

The property's code is never compiled as a frame of its own (see
``compat.skip_as_top_frame``); otherwise dynamo would compile it alone,
once per parameter, each time eager code reads a parameter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fxshard.module.shards import as_dtensor_grads, dtensor_metas
from fxshard.module.writes import ParameterLink, Source, gathered_parameter
from fxshard.module.zero1 import KeptParams
from fxshard.plan import ParamPlan
from fxshard.runtime import compat, plans
from fxshard.runtime.ops import ACCUMULATE, SYNC, kept, replicate, unshard
from fxshard.runtime.sequencer import seq_gather

ANCHOR, FROZEN_ANCHOR = "__fxshard_anchor__", "__fxshard_frozen_anchor__"  # keys in _fxshard_locals
# The call's phase, in _fxshard_locals: a constant that dynamo guards on, so
# each phase gets its own graph (see [Note: accumulation without sync]).
PHASE = "__fxshard_phase__"
KEPT = "__fxshard_kept__."  # + attribute name: ZeRO-1's full copy, in _fxshard_locals


def _gather(local: torch.Tensor, spec: ParamPlan, plan: int, index: int, phase: int = SYNC) -> torch.Tensor:
    """The marker that reads parameter ``index`` of ``plan`` (see [Note:
    markers name the plan]); ``phase``: see [Note: accumulation without sync]."""
    if spec.replicated:
        return replicate(local, plan, index, phase)
    return unshard(local, plan, index, phase)


def _read_replicated(local: torch.Tensor, spec: ParamPlan, plan: int, index: int, phase: int) -> torch.Tensor:
    """A replicated parameter inside a root call. Only a read that can get a
    gradient needs the marker (its backward all-reduces); a frozen one is
    the local tensor itself, cast at most (see [Note: replicated parameters]
    in fxshard/plan.py). Dynamo guards on ``requires_grad``, so unfreezing
    recompiles with the marker."""
    if local.requires_grad and torch.is_grad_enabled():
        return _gather(local, spec, plan, index, phase)
    return local.to(spec.dtype) if spec.dtype is not None else local


class _ToLocal(torch.autograd.Function):
    """The local tensors of many DTensor parameters in one autograd node; the
    backward wraps each local gradient back into a DTensor (as ``to_local``)."""

    @staticmethod
    def forward(ctx, *params: DTensor) -> tuple[torch.Tensor, ...]:
        ctx.set_materialize_grads(False)  # an unused parameter gets no gradient, not zeros
        ctx.metas = dtensor_metas(params)
        # A fresh view of each local tensor (an output must not be an input's
        # own tensor). Reading it directly, not through ``to_local`` (an
        # autograd function per call), saves an autograd call per parameter
        # on every step, and the step's first kernel waits for this loop.
        locals_ = [compat.local_tensor(p) for p in params]
        ctx.strides = [t.stride() for t in locals_]
        return tuple(t.view_as(t) for t in locals_)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple[DTensor | None, ...]:
        # Averaged over the whole mesh already, HSDP replicas included: the
        # reduces in the graphs do it (see [Note: HSDP]).
        laid_out = tuple(g if g is None or g.stride() == stride else _laid_out(g, stride)
                         for g, stride in zip(grads, ctx.strides))  # fmt: skip
        dtensor_grads = as_dtensor_grads(laid_out, ctx.metas)
        if torch.is_grad_enabled():  # create_graph: autograd records the accumulation
            return dtensor_grads
        return _accumulate(ctx.next_functions, dtensor_grads)


def _laid_out(grad: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``grad`` laid out as its shard (of strides ``stride``) where the
    optimizers' kernels would see a difference. Autograd lays a plain
    parameter's ``.grad`` out as the parameter (its layout contract), but
    for a DTensor it compares the global strides, not the local tensor's,
    which fused and foreach kernels compare across params, grads and
    states (but for dimensions of size 1). Inductor returns an empty
    gradient (a rank's shard of no rows) with zero strides, which the fused
    AdamW on CUDA refuses ("must have same dtype, device, and layout"), and
    a foreach kernel leaves its fast path for such a list."""
    if _compared(grad.shape, grad.stride()) == _compared(grad.shape, stride):
        return grad
    out = grad.new_empty_strided(grad.shape, stride)
    return out.copy_(grad) if grad.numel() else out


def _compared(shape: torch.Size, stride: tuple[int, ...]) -> tuple[int, ...]:
    """The strides that fused and foreach kernels compare: those of dimensions of more than one element."""
    return tuple(st for size, st in zip(shape, stride) if size != 1)


# [Note: gradients into .grad without AccumulateGrad]
# Autograd hands each leaf's gradient to its ``AccumulateGrad`` node, which
# detaches it (or adds it to ``.grad``) before it becomes ``.grad``. On a
# DTensor that is a dispatch through DTensor's Python per parameter per
# backward: host time FSDP2 does not spend, since it sets each ``.grad``
# itself. ``_ToLocal``'s backward does what ``AccumulateGrad`` would, on the
# local tensors, and hands autograd None for each gradient it took. It
# leaves a gradient to autograd where what ``AccumulateGrad`` does around
# the accumulation matters, or might: a backward that builds a graph
# (``create_graph``), ``autograd.grad()`` (it returns gradients and leaves
# ``.grad`` alone), a leaf this backward does not accumulate into
# (``backward(inputs=...)`` naming others), a parameter with hooks of its own
# (``register_hook``, ``register_post_accumulate_grad_hook``: fxshard's zero
# ``.grad`` of [Note: a zero gradient without memory] among them), and a
# ``.grad`` of another kind than the gradient (assigned by the user).
# On a device with streams it leaves one gradient to autograd as well: the
# engine makes the stream that called ``backward()`` wait for the streams
# of the leaves it accumulated into (torch's Note [Streaming backwards]), and
# that one leaf, accumulated after the others were written on this node's
# stream, keeps the wait for all of them (a forward run on a side stream,
# its backward called from another, reads every ``.grad`` safely).
# Hooks registered on the ``AccumulateGrad`` node itself see None for a
# gradient taken here (autograd still runs the node); FSDP2's sharded
# parameters are not in the autograd graph at all.
def _accumulate(edges: tuple, grads: tuple[DTensor | None, ...]) -> tuple[DTensor | None, ...]:
    """Set or add each of ``grads`` (one per edge, to its parameter's
    ``AccumulateGrad``) into its parameter's ``.grad`` where the Note allows;
    what is left for autograd (None where taken)."""
    left = list(grads)
    stream_kept = False  # the leaf left to autograd for the streams' wait (see the Note)
    for i, ((node, _), grad) in enumerate(zip(edges, grads)):
        if grad is None or node is None:
            continue
        accumulates = compat.accumulates_into(node)
        if accumulates is None:  # no leaf's .grad takes gradients in this backward
            break
        if not accumulates:
            continue
        if not stream_kept and grad.device.type != "cpu":
            stream_kept = True
            continue
        param = node.variable
        spec = compat.dtensor_spec(param)
        # Another spec than the parameter's own: the gradient's dtype differs,
        # and the engine casts it before AccumulateGrad.
        if param._backward_hooks or param._post_accumulate_grad_hooks or compat.dtensor_spec(grad) is not spec:
            continue
        held = param.grad
        if held is None:
            param.grad = grad
        elif type(held) is type(grad) and compat.dtensor_spec(held) == spec:
            compat.local_tensor(held).add_(compat.local_tensor(grad))
        else:
            continue
        left[i] = None
    return tuple(left)


class LocalShards:
    """The plain local tensors that compiled graphs read, one per parameter.

    See [Note: plain tensors into compiled graphs]. Each owning module holds
    ``_fxshard_locals``, a dict (attribute name -> local tensor) that this
    refreshes at the start of every call of the root module and empties after.
    """

    def __init__(self, owners: list[list[tuple[nn.Module, str]]], kept: KeptParams | None) -> None:
        self.kept = kept  # ZeRO-1's full copies (see [Note: ZeRO-1] in fxshard/module/zero1.py)
        self._owners = owners  # per distinct parameter, every (module, attribute) holding it
        self._modules = list({id(m): m for pairs in owners for m, _ in pairs}.values())
        for module in self._modules:
            module.__dict__["_fxshard_locals"] = {}

    def held_ids(self) -> set[int]:
        """The ids of the parameters the owners hold now (see [Note: parameters join before compile])."""
        return {id(module._parameters.get(attr)) for (module, attr), *_ in self._owners}

    def parameters(self) -> list[DTensor]:
        """Each distinct parameter, as its owner holds it now; a clear error
        for one that was replaced or is still on the meta device."""
        params = []
        for (module, attr), *_ in self._owners:
            param = module._parameters.get(attr)
            if not isinstance(param, DTensor):
                raise ValueError(
                    f"parameter {attr!r} of {type(module).__name__} was replaced after fxshard.compile "
                    f"(it is now {type(param).__name__}); load values with load_state_dict() or copy_() "
                    "into the existing shards instead of assigning new parameters. Calls that swap in other "
                    "parameters (torch.func.functional_call, stateless reparametrizations) are not supported"
                )
            if compat.local_tensor(param).is_meta:
                raise ValueError(
                    f"parameter {attr!r} of {type(module).__name__} is still on the meta device; materialize "
                    "the model before calling it: model.to_empty(device=...), then its own init "
                    "(reset_parameters() or init_weights())"
                )
            params.append(param)
        return params

    @contextlib.contextmanager
    def _filled(self, values: dict[tuple[nn.Module, str], torch.Tensor]) -> Iterator[None]:
        for (module, key), value in values.items():
            module.__dict__["_fxshard_locals"][key] = value
        try:
            yield
        finally:
            for module in self._modules:
                module.__dict__["_fxshard_locals"].clear()

    def scope(self, phase: int) -> contextlib.AbstractContextManager[None]:
        """The local shards, ZeRO-1's full copies and the call's phase, for the duration of one call."""
        params = self.parameters()
        locals_: list[torch.Tensor | None] = [None] * len(params)
        trained = [i for i, p in enumerate(params) if p.requires_grad]
        if trained and torch.is_grad_enabled() and phase == ACCUMULATE:
            # The shards get no gradient: the store takes it (see [Note:
            # accumulation without sync]). Leaves, not _ToLocal's views:
            # AOTAutograd detaches a non-leaf input whose gradient is None,
            # and a graph whose inputs are all detached has no backward.
            for i in trained:
                locals_[i] = compat.local_tensor(params[i]).detach().requires_grad_()
        elif trained and torch.is_grad_enabled():
            for i, local in zip(trained, _ToLocal.apply(*(params[i] for i in trained))):
                locals_[i] = local
        for i, p in enumerate(params):
            if locals_[i] is None:
                locals_[i] = p.to_local().detach()
        values: dict = {pair: local for pairs, local in zip(self._owners, locals_) for pair in pairs}
        if self.kept is not None:
            self.kept.refresh(params)
            values.update({(m, KEPT + attr): full for i, full in self.kept.full.items()
                           for m, attr in self._owners[i]})  # fmt: skip
        values.update({(m, PHASE): phase for m in self._modules})
        return self._filled(values)

    def anchors(self, anchor: torch.Tensor, frozen: torch.Tensor) -> contextlib.AbstractContextManager[None]:
        """The sequencer's anchors, for the duration of one sequenced call."""
        return self._filled({(m, key): value for m in self._modules
                             for key, value in ((ANCHOR, anchor), (FROZEN_ANCHOR, frozen))})  # fmt: skip


def gathering_property(attr: str, spec: ParamPlan, index: int, plan: int, as_stored: int,
                       tp_mesh: DeviceMesh | None = None) -> property:  # fmt: skip
    """``plan``: the id of the model's plan table, which the markers of reads
    in a root call name; ``as_stored``: the same plans in the stored dtype,
    for reads outside one. ``tp_mesh``: a tensor-parallel parameter's TP mesh."""
    tp = spec.tp
    shape = torch.Size(tp.shape) if tp is not None else None

    def as_tp(value: torch.Tensor) -> torch.Tensor:
        """A gathered TP-local tensor as the TP module computes on it (see
        [Note: tensor-parallel parameters]); any other value as it is."""
        if tp is None:
            return value
        return DTensor.from_local(value, tp_mesh, tp.placements, run_check=False, shape=shape, stride=tp.stride)

    def get(module: nn.Module) -> torch.Tensor:
        table = module._fxshard_locals
        if ANCHOR in table:  # sequenced reads (see [Note: two ways to read])
            anchor = table[ANCHOR] if module._parameters[attr].requires_grad else table[FROZEN_ANCHOR]
            return as_tp(seq_gather(anchor, plan, index))
        if attr in table:  # inside a root call: the compute dtype, read by the graph
            phase = table[PHASE]
            if spec.kept:  # ZeRO-1: the full copy, already gathered (see [Note: ZeRO-1] in fxshard/module/zero1.py)
                local, full = table[attr], table[KEPT + attr]
                return as_tp(kept(local, full, plan, index, phase))
            if spec.replicated:
                return _read_replicated(table[attr], spec, plan, index, phase)
            return as_tp(_gather(table[attr], spec, plan, index, phase))
        # A recompute in backward of a call with sequenced reads (see [Note:
        # recomputes read through the sequencer] in runtime/sequencer.py).
        anchor = None
        if compat.in_backward():
            anchor = plans.runtime(plan).sequencer.recompute_anchor(module._parameters[attr].requires_grad)
        if anchor is not None:
            return as_tp(seq_gather(anchor, plan, index))
        if tp is not None:  # outside a root call: the shard itself, as FSDP2's (see the Note)
            return module._parameters[attr]
        # Outside one (init, a submodule called directly, a read after
        # training): the parameter as stored, and writes to it land in the
        # shard (see [Note: writes to gathered parameters]).
        param = module._parameters[attr]
        link = ParameterLink(param, spec.fqn, gather_stored)
        if spec.replicated and not (param.requires_grad and torch.is_grad_enabled()):
            local = compat.local_tensor(param)  # the full tensor: writes land in it
            return gathered_parameter(local, local, param.write_full, None, link)
        # A value that can get a gradient (a loss term on the weights outside
        # the forward, say) reads through the marker, whose backward reduces
        # it into the shard's .grad; the local tensor itself is no leaf of it.
        if param.uninitialized:  # materialized from meta, never written: no values to gather
            full = torch.empty(spec.shape, dtype=spec.shard_dtype, device=spec.device)
        else:
            # HSDP: the marker's reduce averages across replicas too (see [Note: HSDP]).
            # ``_ToLocal``, not ``to_local()``: a backward that builds a graph
            # (create_graph) must keep the shard's gradient in it, so that a
            # backward through that gradient reaches the marker's formula
            # (which raises); torch before 2.13 (seen on 2.11) wraps it in a
            # new leaf DTensor there, and the graph stops short of the op.
            (local,) = _ToLocal.apply(param)
            full = _gather(local, spec, as_stored, index)
        source = Source(param, spec.fqn)
        return gathered_parameter(full, full, param.write_full, source, link)

    def gather_stored(local: torch.Tensor) -> torch.Tensor:
        """A local tensor shaped like the shard (its gradient), full; a
        replicated one is full already, and writes to it land in place."""
        return local if spec.replicated else _gather(local, spec, as_stored, index)

    compat.skip_as_top_frame(get.__code__)
    return property(get, doc=f"The full parameter {spec.fqn!r}, gathered from its shards.")
