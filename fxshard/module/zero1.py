"""ZeRO-1: sharded parameters held gathered between optimizer steps.

[Note: ZeRO-1]
With ``zero_stage=1`` each rank holds, beside its shards, a full copy of
every sharded parameter in the compute dtype (``KeptParams.full``).
Optimizer state and ``.grad`` stay sharded: the optimizer steps on the
shards, as at every stage. The copies are gathered at the start of the
first call of the root module after the shards changed, so once per step:
an optimizer step makes them stale, and so does any other write to a shard
(``load_state_dict``, ``copy_``, ``p.to_local().data = values``,
``fxshard.compile``'s write-through of gathered parameters), each seen as a
change of the shard's ``written`` key (see [Note: has it changed] in
fxshard/module/shards.py; foreach and fused optimizer steps move no
version counter of a DTensor, so a hook counts them:
``module.optimizers.count_optimizer_steps``).

Micro-batches of one step then gather nothing. A CUDA-graph capture always
records the gather, at the first call of the captured step: replays run no
Python to notice a step.

A graph reads each copy through ``fxshard::kept(shard, copy)``: the
lowering replaces the marker by the copy, a graph input, and the marker's
gradient is an unshard's (``fxshard::reduce_grad``), so ZeRO-1's
parameters join units like the other stages' and each unit's gradients
are reduce-scattered inside the backward graph, overlapped with the
backward's compute and freed as they go, not after the backward. The
graphs gather nothing: a unit of kept parameters only reduces. Its reads
are always tagged for recompute (see [Note: reshard by recompute]), so the
backward reads the copy itself, an input, never a saved intermediate,
which Inductor may reuse for another value. Without sync
(``set_requires_gradient_sync(False)``) the gradients go to the model's
gradient store, as other reads' do (see [Note: accumulation without
sync] in fxshard/runtime/ops.py). The gathers are coalesced: one
collective per run of parameters of one dtype, up to ``unit_mb`` (256 MiB
by default) of full values. A model on the sequenced path (graph breaks) gathers on every
call, as at the other stages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor

from fxshard.module.optimizers import count_optimizer_steps
from fxshard.module.shards import written
from fxshard.runtime import compat
from fxshard.runtime.collectives import gather_many
from fxshard.runtime.plans import Param


class KeptParams:
    """The full copies of one model's ZeRO-1 parameters (see the Note), by plan index."""

    def __init__(self, members: Sequence[Param], bucket_bytes: int) -> None:
        count_optimizer_steps(self)
        self.members = {p.index: p for p in members}  # by plan index
        self.bucket_bytes = bucket_bytes  # of gathered values per all-gather
        self.full: dict[int, torch.Tensor] = {}
        self.stale = True  # gather at the next refresh whatever the shards' state (a capture sets it)
        self._seen: tuple | None = None  # the shards' written keys at the last gather
        self.gathers = 0  # for tests and logs

    def refresh(self, params: list[DTensor]) -> None:
        """Gather the copies if a shard changed since the last gather (see the Note)."""
        mine = [params[i] for i in self.members]
        seen = tuple(map(written, mine))  # see [Note: has it changed]
        if not self.stale and seen == self._seen:
            return
        locals_ = {i: compat.local_tensor(p) for i, p in zip(self.members, mine)}
        # Not inference tensors, even when the first call is under inference_mode: training writes them later.
        with torch.inference_mode(False), torch.no_grad():
            for bucket in self._buckets(list(self.members)):
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

    def _buckets(self, indices: list[int]) -> list[list[int]]:
        """``indices`` in runs of one gather dtype and group (an expert's is
        the experts' group: see [Note: expert-parallel parameters]), each up to
        ``bucket_bytes`` of full values: one collective each, and a bounded
        transient buffer."""
        buckets: list[list[int]] = []
        size, key = 0, None
        for i in indices:
            spec = self.members[i].plan
            nbytes = math.prod(spec.shape) * spec.gather_dtype.itemsize
            if not buckets or (spec.gather_dtype, spec.group_name) != key or size + nbytes > self.bucket_bytes:
                buckets.append([])
                size, key = 0, (spec.gather_dtype, spec.group_name)
            buckets[-1].append(i)
            size += nbytes
        return buckets

    def drop(self) -> None:
        """Free the copies (the model went to sequenced reads, which gather per call)."""
        self.full.clear()
        self._seen, self.stale = None, True
