"""Sequenced reads: the same collectives on every rank, whatever the data does.

[Note: sequenced reads]
A model whose forward cannot be captured as one graph runs partly as eager
Python between graphs. That Python may branch on data: an MoE layer that
calls only the experts that received tokens reads a different set of
parameters on each rank, and possibly in a different order. If gathers
followed reads one to one, ranks would issue different collectives and hang,
or pair the wrong buffers. So for such models every read goes through a
``Sequencer``, which decides what is gathered, and when, from the plan alone:

- Forward: one call of the root module gathers every parameter of the plan
  exactly once, in plan order (registration order, identical on every rank).
  A read of parameter ``k`` gathers, in order, every parameter up to ``k``
  not gathered yet; when the call returns, the rest are gathered and dropped.
  A parameter read again in the same call gets the tensor gathered first.
  A call with grad keeps its gathered weights until its backward ends, so
  activation checkpointing recomputes without gathering again.
- Backward: each read returns its gradient to the sequencer, which sums the
  gradients per (call, parameter). When the backward pass ends, every
  trainable parameter of every call since the last backward is reduced, in
  plan order, a zero gradient where this rank produced none. The reduced
  shard is added to the DTensor parameter's ``.grad``. A replicated
  parameter is read without a gather and its gradient all-reduced, in the
  same order.

The sequence of collectives is then a function of the number of root calls
and backward passes, never of the data. The price: gathered weights are kept
until backward ends (no reshard) and reduces wait for the end of backward
(no overlap), plus one small all-reduce and host sync per backward. Models captured as one graph do not take this path; their graphs
hold their collectives (see fxshard/passes/README.md).

[Note: recomputes read through the sequencer]
Activation checkpointing around code with a graph break runs eagerly, and
recomputes in backward, after the call returned. A read there finds no
call's anchor in the module's table. Read as outside a call, it would
gather on its own: a collective in data-dependent order (an MoE loop) and,
under non-reentrant checkpointing, other saved tensors than the forward's
(torch's CheckpointError, which reached one rank and aborted the others).
So a read outside a call during a backward, while calls wait for theirs,
takes a waiting call's anchor (``recompute_anchor``) and reads its kept
weights like the forward did. The flush is queued in that backward: a
reentrant checkpoint's gradients arrive in a backward nested in it, whose
end is too early. A backward that recomputes a call and gives it no
gradient (``autograd.grad`` of an input-gradient penalty) leaves the call
waiting for the backward of the loss.

The ops ``fxshard::seq_gather`` and ``fxshard::seq_grad`` are how compiled
graphs call in. Their tensor argument is the root call's *anchor*, a one-element
CPU tensor holding the call's number: it ties a gradient arriving in backward
to the call whose forward gathered it, inside compiled graphs too.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from fxshard.runtime import compat, plans
from fxshard.runtime.collectives import Replicas, any_rank, gather_full, reduce_replicated, reduce_to_shard

log = logging.getLogger("fxshard")

# Calls with grad waiting for a backward, each holding the gathered weights,
# past which a call warns (once): an evaluation loop without no_grad.
_PENDING_WARN = 4


@dataclass
class _Call:
    id: int
    grad: bool  # grad mode when the call began
    sync: bool = True  # False: its gradients are kept for the next call with sync
    next: int = 0  # plan index of the next gather
    full: dict[int, torch.Tensor] = field(default_factory=dict)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    anchors: tuple[torch.Tensor, ...] = ()  # (anchor, frozen anchor): what recomputes in backward read with
    recomputed: bool = False  # read by a recompute in backward, which queued the flush


class Sequencer:
    """Issues one model's gathers and reduces in plan order (see the Note)."""

    def __init__(
        self,
        plan: int,
        params: Sequence[plans.Param],
        world_size: int,
        group_name: str,
        replicas: Replicas | None = None,
    ) -> None:
        """``plan``: the id of the model's plan table, which the ops of
        sequenced reads carry (the model's ``plans.ModelRuntime`` holds the
        sequencer); ``params`` in its order."""
        self.params = tuple(params)
        self.world_size, self.group_name = world_size, group_name
        self.replicas = replicas  # HSDP: gradients are averaged across them too (see [Note: HSDP])
        self.plan = plan
        self._calls = itertools.count()
        self._current: _Call | None = None
        self._pending: dict[int, _Call] = {}  # grad-mode calls whose reduces wait for backward
        self._flush = compat.AtBackwardEnd(self.flush)
        self._held: dict[int, torch.Tensor] = {}  # gradients of calls without sync, summed per parameter
        self.after_hold: Callable[[], None] | None = None  # called when a flush kept gradients
        self.check_held: Callable[[list[int]], None] | None = None  # before held gradients are used: see GradStore
        self.gathers = self.reduces = 0  # collectives issued, for tests and logs
        self._warned = False  # about calls piling up without a backward

    @contextlib.contextmanager
    def call(self, sync: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """One call of the root module; yields (anchor, frozen anchor).
        ``sync`` False keeps the call's gradients unreduced for the next call
        with sync (see [Note: accumulation without sync] in runtime/ops.py)."""
        if self._current is not None:
            raise RuntimeError("the fxshard model was called from inside its own forward")
        call = _Call(next(self._calls), torch.is_grad_enabled(), sync)
        anchor = torch.full((1,), float(call.id), dtype=torch.float64, requires_grad=call.grad)
        frozen = torch.full((1,), float(call.id), dtype=torch.float64)
        call.anchors = (anchor, frozen)
        self._current = call
        try:
            yield anchor, frozen
            self._gather_through(call, len(self.params) - 1)  # only on success: see the Note
        finally:
            self._current = None
        if call.grad and any(p.shard.trainable() for p in self.params):
            self._pending[call.id] = call  # keeps its weights for recomputes in backward
            if len(self._pending) == _PENDING_WARN and not self._warned:
                self._warned = True
                log.warning(
                    "fxshard: %d calls of the model with grad enabled wait for a backward, and with sequenced reads "
                    "(graph breaks) each keeps the model's gathered weights until a backward ends. Run calls "
                    "without a backward (evaluation) under torch.no_grad()",
                    len(self._pending),
                )
        else:
            call.full.clear()

    def _gather_through(self, call: _Call, k: int) -> None:
        while call.next <= k:
            p = self.params[call.next]
            ranks = 1 if p.plan.replicated else self.world_size
            call.full[call.next] = gather_full(p.shard.local().detach(), p.plan.dim0, ranks, self.group_name,
                                               p.plan.dtype)  # fmt: skip
            self.gathers += not p.plan.replicated
            call.next += 1

    def recompute_anchor(self, trained: bool) -> torch.Tensor | None:
        """The anchor for a read outside any call of the root module during
        a backward, or None. Such a read is activation checkpointing's
        recompute of a call whose backward this is (see [Note: recomputes
        read through the sequencer]); None where no call waits for its
        backward, or outside one (the read then gathers, as any read outside
        a call does)."""
        if self._current is not None or not self._pending or not compat.in_backward():
            return None
        calls = list(self._pending.values())
        if len({c.sync for c in calls}) > 1:
            raise RuntimeError(
                "fxshard: activation checkpointing recomputed a block in a backward through several calls of the "
                "model, some with set_requires_gradient_sync(False) and some without, and a model with graph "
                "breaks cannot tell which call a recompute belongs to. Call backward after each forward"
            )
        # Every pending call is reduced by the flush at the end of this
        # backward, and a sum of reduced gradients is the reduce of their
        # sum: the gradient may go to any of them.
        call = calls[-1]
        # Queued here, in the backward that runs the recompute: a reentrant
        # checkpoint's gradients arrive in a backward of its own, nested in
        # this one, whose end is too early for the flush (see add_grad).
        self._flush.queue()
        call.recomputed = True
        return call.anchors[0] if trained else call.anchors[1]

    def read(self, call_id: int, k: int) -> torch.Tensor:
        call = self._current
        if call is not None and call.id == call_id:
            self._gather_through(call, k)
        else:  # a recompute in backward (activation checkpointing): the call's weights are kept
            call = self._pending.get(call_id)
            if call is None or k not in call.full:
                raise RuntimeError(
                    f"fxshard: parameter {self.params[k].fqn!r} was read through a graph of call {call_id} "
                    "after that call and its backward ended; read parameters inside model(...)"
                )
        # Always a copy: a compiled graph may write into an op's output or reuse
        # its memory after the last use, and the kept tensor must stay intact
        # for later reads and recomputes (at world size 1 it is the shard itself).
        return call.full[k].clone()

    def add_grad(self, call_id: int, k: int, grad: torch.Tensor) -> None:
        call = self._pending.get(call_id)
        if call is None:
            raise RuntimeError(
                f"fxshard: a gradient for {self.params[k].fqn!r} arrived for a call whose backward already ran; "
                "backward through one forward twice (retain_graph=True) is not supported"
            )
        dtype = self.params[k].plan.reduce_dtype or grad.dtype
        if k in call.grads:
            call.grads[k] += grad.to(dtype)
        else:
            call.grads[k] = grad.to(dtype, copy=True)  # a compiled graph may reuse grad's memory
        if not call.recomputed:  # a recompute queued the flush in the outermost backward (recompute_anchor)
            self._flush.queue()

    def flush(self) -> None:
        """Reduce every pending call's gradients, in plan order (see the Note)."""
        trainable = [k for k, p in enumerate(self.params) if p.shard.trainable()]
        if self._held and self.check_held is not None:
            self.check_held(list(self._held))
        for call_id in sorted(self._pending):
            call = self._pending[call_id]
            if call.recomputed and not call.grads:
                # A backward recomputed it and gave it no gradient: autograd.grad() of an
                # input-gradient penalty. Every rank runs the same; its backward comes later.
                call.recomputed = False
                continue
            del self._pending[call_id]
            call.full.clear()
            if not call.sync:  # no collective: hold the gradients for a call with sync
                for k, grad in call.grads.items():
                    if k in self._held:
                        self._held[k] += grad
                    else:
                        self._held[k] = grad
                if self.after_hold is not None:
                    self.after_hold()
                continue
            for k, grad in self._held.items():
                call.grads[k] = call.grads[k] + grad if k in call.grads else grad
            self._held.clear()
            # Which parameters got a gradient on some rank: the others keep
            # grad None, as in unsharded training (AdamW skips them).
            # Over the whole mesh (HSDP: both dimensions), so that every rank reduces the same ones.
            got = any_rank(torch.tensor([k in call.grads for k in trainable], device=self.params[0].shard.local().device),
                           self.world_size, self.group_name)  # fmt: skip
            if self.replicas is not None:
                got = any_rank(torch.tensor(got, device=self.params[0].shard.local().device), self.replicas.size,
                               self.replicas.group_name)  # fmt: skip
            for k, anywhere in zip(trainable, got):
                if not anywhere:
                    continue
                p = self.params[k]
                grad = call.grads.pop(k, None)
                if grad is None:
                    local = p.shard.local()
                    grad = local.new_zeros(p.shape, dtype=p.plan.reduce_dtype or p.plan.dtype or local.dtype)
                self.reduce_one(k, grad)

    def drop_failed_backward(self) -> int:
        """After a backward that raised (its flush never ran), drop the
        gradients it gave the calls it reached, as ``zero_grad`` after a failed
        step would: a later flush must not reduce them with the next step's.
        How many calls; ask outside any backward."""
        if not self._flush.abandoned():
            return 0
        failed = [call_id for call_id, call in self._pending.items() if call.grads]
        for call_id in failed:
            self._pending.pop(call_id).full.clear()
        return len(failed)

    def drop_held(self, indexes: Iterable[int]) -> None:
        """Drop the gradients held for these parameters."""
        for k in indexes:
            self._held.pop(k, None)

    def held(self) -> list[int]:
        """The parameters whose gradients calls without sync left for a call with sync."""
        return list(self._held)

    def pending(self) -> bool:
        """Whether gradients of calls without sync wait for a call with sync."""
        return bool(self._held) or any(not c.sync for c in self._pending.values())

    def reduce_one(self, k: int, grad: torch.Tensor) -> None:
        """Reduce parameter ``k``'s full gradient into its ``.grad``."""
        p = self.params[k]
        grad = grad.reshape(p.shape)
        # HSDP: averaged over the replicas too, in the reduce dtype, as graphs do (see [Note: HSDP]).
        replicas = (self.replicas.size, self.replicas.group_name) if self.replicas is not None else ()
        if p.plan.replicated:
            shard = reduce_replicated(grad, self.world_size, self.group_name, p.plan.reduce_dtype, p.shard_dtype,
                                      *replicas)  # fmt: skip
        else:
            shard = reduce_to_shard(grad, p.local_rows, self.world_size, self.group_name, p.plan.reduce_dtype,
                                    p.shard_dtype, *replicas)  # fmt: skip
        self.reduces += 1
        p.shard.add_grad(shard)


@torch.library.custom_op("fxshard::seq_gather", mutates_args=())
def seq_gather(anchor: torch.Tensor, plan: int, index: int) -> torch.Tensor:
    """The full parameter ``index`` of ``plan``, gathered by the model's sequencer (see the Note)."""
    return plans.runtime(plan).sequencer.read(int(anchor.item()), index)


@seq_gather.register_fake
def _seq_gather_fake(anchor, plan, index):
    p = plans.param(plan, index)
    return torch.empty(p.shape, dtype=p.gather_dtype, device=p.device)


@torch.library.custom_op("fxshard::seq_grad", mutates_args=())
def seq_grad(grad: torch.Tensor, anchor: torch.Tensor, plan: int, index: int) -> torch.Tensor:
    """Hand the gradient of a sequenced read to the sequencer; returns the
    anchor's (zero) gradient."""
    plans.runtime(plan).sequencer.add_grad(int(anchor.item()), index, grad)
    return torch.zeros_like(anchor)


@seq_grad.register_fake
def _seq_grad_fake(grad, anchor, plan, index):
    return torch.empty_like(anchor)


def _seq_gather_setup(ctx, inputs, output):
    anchor, plan, index = inputs
    ctx.save_for_backward(anchor)
    ctx.key = (plan, index)


def _seq_gather_backward(ctx, grad):
    if torch.is_grad_enabled() and grad.requires_grad:
        # create_graph: the sequencer reduces gradients outside autograd, so
        # .grad would silently hold no graph (a gradient penalty on it: zero).
        raise RuntimeError(
            f"fxshard: a backward with create_graph=True reached the gradient of {plans.param(*ctx.key).fqn!r}, "
            "which fxshard reduces outside autograd: the gradient it gives .grad cannot be differentiated "
            "again. A penalty on gradients with respect to the inputs works: take them with "
            "torch.autograd.grad(out, inputs, create_graph=True), which leaves the parameters' gradients "
            "to the backward of the loss"
        )
    (anchor,) = ctx.saved_tensors
    return seq_grad(grad.contiguous(), anchor, *ctx.key), None, None


seq_gather.register_autograd(_seq_gather_backward, setup_context=_seq_gather_setup)

SEQ_GATHER = torch.ops.fxshard.seq_gather.default
SEQ_GRAD = torch.ops.fxshard.seq_grad.default
