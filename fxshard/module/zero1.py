"""ZeRO-1: sharded parameters held gathered between optimizer steps.

[Note: ZeRO-1]
With ``zero_stage=1`` each rank holds, beside its shards, a full copy of
every sharded parameter in the compute dtype (``KeptParams.full``).
Optimizer state and ``.grad`` stay sharded: the optimizer steps on the
shards, as at every stage. The copies are gathered at the start of the
first call of the root module after the shards changed, so once per step:

- an optimizer step makes them stale, seen as a change of the shard's
  count of optimizer steps (``module.optimizers.count_optimizer_steps``: fused
  optimizers write the shards without bumping any version counter);
- so does any other write to a shard (``load_state_dict``, ``copy_``,
  ``fxshard.compile``'s write-through of gathered parameters), seen as a
  change of the DTensor's or its local tensor's version counter.

Micro-batches of one step then gather nothing. A CUDA-graph capture always
records the gather, at the first call of the captured step: replays run no
Python to notice a step.

Compiled graphs read the copies as plain inputs (no ``fxshard::unshard``
marker, so no units), and ``_KeptFull``'s backward reduce-scatters the
gradients to their shards after the graph's backward (not overlapped with
it). Until then every full gradient is alive, in the compute dtype, as in
DeepSpeed's stage 1: ZeRO-1 spends that memory, and the copies, to gather
nothing per micro-batch. Gathers and reduces are coalesced: one collective
per run of parameters of one dtype, up to ``unit_mb`` of full values.
Without sync (``set_requires_gradient_sync(False)``) the backward keeps
each full gradient in the model's gradient store, in the reduce dtype, and
the next backward with sync adds it before its reduce, as graphs' reads do
(see [Note: accumulation without sync] in fxshard/runtime/ops.py). A model
on the sequenced path (graph breaks) gathers on every call, as at the other
stages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from fxshard.module.optimizers import count_optimizer_steps
from fxshard.module.shards import as_dtensor_grads, dtensor_metas, versions
from fxshard.runtime import compat
from fxshard.runtime.collectives import Replicas, gather_many, reduce_many
from fxshard.runtime.ops import ACCUMULATE, FLUSH, GradStore
from fxshard.runtime.plans import Param
from fxshard.runtime.rank_checks import GraphAgreement


class KeptParams:
    """The full copies of one model's ZeRO-1 parameters (see the Note), by plan index."""

    def __init__(self, members: Sequence[Param], replicas: Replicas | None, bucket_bytes: int) -> None:
        count_optimizer_steps(self)
        self.members = {p.index: p for p in members}  # by plan index
        self.bucket_bytes = bucket_bytes  # of gathered values per all-gather or reduce-scatter
        self.replicas = replicas
        self.full: dict[int, torch.Tensor] = {}
        self.stale = True  # gather at the next refresh whatever the shards' state (a capture sets it)
        self._seen: tuple | None = None  # version counters at the last gather
        self.gathers = 0  # for tests and logs
        # Compares, across ranks, which copies a backward reduces, before it
        # reduces (see _KeptFull.backward); None on one rank or the fake group.
        self.agreement: GraphAgreement | None = None

    def refresh(self, params: list[DTensor]) -> None:
        """Gather the copies if a shard changed since the last gather (see the Note)."""
        mine = [params[i] for i in self.members]
        locals_ = {i: compat.local_tensor(p) for i, p in zip(self.members, mine)}
        # Objects too: to_empty and .data assignments replace tensors, whose new counters start over
        # (see [Note: has it changed]).
        seen = tuple((id(p), id(local), versions(p), p.optimizer_steps) for p, local in zip(mine, locals_.values()))
        if not self.stale and seen == self._seen:
            return
        # Not inference tensors, even when the first call is under inference_mode: training writes them later.
        with torch.inference_mode(False), torch.no_grad():
            for bucket in self._buckets(list(self.members), lambda s: s.gather_dtype):
                first = self.members[bucket[0]].plan
                gathered = gather_many([locals_[i] for i in bucket], [self.members[i].plan.dim0 for i in bucket],
                                       first.world_size, first.group_name, first.gather_dtype)  # fmt: skip
                for i, full in zip(bucket, gathered):
                    held = self.full.get(i)
                    if held is None:
                        # Never the shard itself (world size 1): graphs must not alias the optimizer's tensor.
                        aliased = full.untyped_storage().data_ptr() == locals_[i].untyped_storage().data_ptr()
                        self.full[i] = full.clone() if aliased else full.contiguous()
                    else:
                        held.copy_(full)
        self.gathers += 1
        self._seen, self.stale = seen, False

    def _buckets(self, indices: list[int], dtype: Any) -> list[list[int]]:
        """``indices`` in runs of one ``dtype(spec)``, each up to ``bucket_bytes``
        of full values: one collective each, and a bounded transient buffer."""
        buckets: list[list[int]] = []
        size, key = 0, None
        for i in indices:
            spec = self.members[i].plan
            nbytes = math.prod(spec.shape) * dtype(spec).itemsize
            if not buckets or dtype(spec) != key or size + nbytes > self.bucket_bytes:
                buckets.append([])
                size, key = 0, dtype(spec)
            buckets[-1].append(i)
            size += nbytes
        return buckets

    def drop(self) -> None:
        """Free the copies (the model went to sequenced reads, which gather per call)."""
        self.full.clear()
        self._seen, self.stale = None, True

    def reads(self, params: list[DTensor], phase: int, store: GradStore) -> dict[int, torch.Tensor]:
        """Each kept parameter's full copy for one call: through ``_KeptFull``
        (its gradient reduce-scattered into the shard's, or kept in
        ``store`` in the ``phase`` of a call without sync) where it trains and
        grad is enabled, else the copy itself, detached."""
        trained = [i for i in self.members if params[i].requires_grad] if torch.is_grad_enabled() else []
        out = {i: self.full[i].detach() for i in self.members}
        if trained:
            views = _KeptFull.apply(self, trained, phase, store, *(params[i] for i in trained))
            out.update(zip(trained, views))
        return out


class _KeptFull(torch.autograd.Function):
    """The full copies of several kept parameters in one autograd node; the
    backward reduce-scatters each gradient to this rank's rows (averaged,
    then across replicas for HSDP) and wraps it as the DTensor's gradient.
    Without sync it keeps the full gradients in the model's store instead,
    as graphs' reads do (see [Note: accumulation without sync] in
    fxshard/runtime/ops.py), and the next call with sync reduces the sum."""

    @staticmethod
    def forward(ctx, kept: KeptParams, indices: list[int], phase: int, store: GradStore, *params: DTensor) -> tuple:
        ctx.set_materialize_grads(False)
        ctx.kept, ctx.indices, ctx.phase, ctx.store = kept, indices, phase, store
        ctx.metas = dtensor_metas(params)
        return tuple(kept.full[i].view_as(kept.full[i]) for i in indices)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple:
        kept = ctx.kept
        got = {i: g for i, g in zip(ctx.indices, grads) if g is not None}
        if ctx.phase == ACCUMULATE:  # kept whole; the shards' gradients from this call are zero
            for i, g in got.items():
                ctx.store.add(i, g, kept.members[i].plan.summed_dtype)
            zeros = [_zero_shard(kept, i) if i in got else None for i in ctx.indices]
            return (None, None, None, None, *as_dtensor_grads(tuple(zeros), ctx.metas, None))
        if ctx.phase == FLUSH:
            got = {i: ctx.store.take(i, g, kept.members[i].plan.summed_dtype) for i, g in got.items()}
        if kept.agreement is not None:
            # The reduces coalesce what got a gradient: ranks whose graphs
            # differ (a branch on the rank) would pair one parameter's
            # gradient with another's. Graphs read the copies as plain
            # inputs, so the graphs' own agreement does not see them.
            kept.agreement.check("ZeRO-1's reduce after backward",
                                 ("ZeRO-1 reduce", *(f"gradient of {kept.members[i].plan.fqn!r}" for i in got)))  # fmt: skip
        shards: list[torch.Tensor | None] = [None] * len(grads)
        where = {i: j for j, i in enumerate(ctx.indices)}
        for bucket in kept._buckets(list(got), lambda s: s.summed_dtype):
            s = kept.members[bucket[0]].plan
            reduced = reduce_many([got[i] for i in bucket], [kept.members[i].local_rows for i in bucket], s.world_size,
                                  s.reduce_group_name, s.summed_dtype,
                                  [kept.members[i].plan.shard_dtype for i in bucket])  # fmt: skip
            for i, shard in zip(bucket, reduced):
                shards[where[i]] = shard
        return (None, None, None, None, *as_dtensor_grads(tuple(shards), ctx.metas, kept.replicas))


def _zero_shard(kept: KeptParams, index: int) -> torch.Tensor:
    spec = kept.members[index].plan
    return torch.zeros((kept.members[index].local_rows, *spec.shape[1:]), dtype=spec.shard_dtype, device=spec.device)
