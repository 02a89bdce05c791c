"""Units: parameters gathered and reduced together, from padded shard slots.

[Note: units and flat shards]
A unit is a list of parameters that move together: one all-gather brings
all of their shards, and one reduce-scatter per reduce group (a unit of
several blocks has one per block; see [Note: a reduce per block] in
``passes/bucket.py``) takes their gradients. Its
layout depends only on the full shapes and the world size, so it is the same
on every rank:

- Each member ``i`` has ``chunk_i = ceil(dim0_i / world_size)`` rows per rank
  and ``row_i`` elements per row; its *slot* is ``chunk_i * row_i`` elements.
- A rank's flat shard is the members' slots end to end (``numel``
  elements), as the collectives see it, each starting at a multiple of
  ``MEMBER_ALIGN`` elements. So does each member's block of the gathered
  unit, which the graph reads in place: Inductor compiles an outlined
  block's body for 16-byte-aligned inputs and checks no view it is passed
  (a Mamba block's odd conv bias put the next member at an odd offset:
  "misaligned address" on an H200). In memory each member's slot is a
  buffer of its own (``Unit.slots``), and member ``i``'s local shard is its
  first ``local_rows_i * row_i`` elements (the rest is padding, never
  read). Shards are made in their slots (``in_slot``, at compile and at
  ``to_empty``), and ``Units.rehome`` adopts them as they are, so that what
  aliases a shard (a state dict taken before the first call) keeps tracking
  it; a shard that is not in its slot (the user gave the DTensor another
  local tensor) is copied into a new slot, which the DTensor then holds.
  Either way the parameter objects, and any optimizer holding them, are
  unchanged.
- A local shard starts its own storage (storage offset 0), never in the
  middle of a buffer shared with other members. A DTensor takes its
  wrapper's storage offset from its local tensor (every DTensor op's output
  does, ``detach`` in ``state_dict()`` included), and ``torch.save``
  recognizes a DTensor as a storage-less wrapper only by ``data_ptr() ==
  0``: a local at a nonzero offset makes ``torch.save`` read the wrapper's
  storage, which does not exist ("invalid python storage"). One buffer per
  slot costs nothing on the wire: the collectives take one input per
  member either way.
- The all-gather inputs are the slots themselves: no copy-in, unless the
  gather casts them to ``param_dtype`` (the cast is the copy). It is one
  coalesced all-gather of each member's slot, so its output is member-major
  already: member ``i``'s full parameter is the first ``dim0_i * row_i``
  elements of its ``world_size * slot_i`` block, and the graph reads it in
  place. There is no copy-out.
- A cast writes straight into the output, at this rank's slot of each
  member's block, and the all-gather runs in place (NCCL and gloo both take
  an input that is the rank's own chunk of the output, as FSDP2's does). So
  a gather needs no buffer but its output.
- The reduce-scatter input is the reverse: the full gradients laid out
  rank-major (``world_size x slots``) in the reduce dtype, and rank ``r``
  receives its slots, averaged (NCCL averages in the collective; other
  backends sum, and the wait divides in place). The wait casts to the shard
  dtype only where that differs. On an HSDP mesh the received slots are
  then all-reduced across the replicas in place before the cast (see
  [Note: HSDP] in ``collectives.py``). The graph builds that input itself (cast,
  pad, view, one ``cat``; ``bucket_collectives``), so Inductor fuses the cast
  into the copies: one pass over the gradients, which moves them faster
  than torch's ``_chunk_cat``.
- A graph that reads only some members still gathers the whole unit (from
  the members' current local shards); a backward reduces only the members
  whose gradients it computes.

Where the buffers live (communication has none of its own):

- On CUDA a gather's cast and its collective run on a side stream forked
  from the compute stream where the start is (``Units._side_stream``); the
  wait joins it back. The runtime keeps what they read and write referenced
  until the wait (gloo and NCCL alike).
- The reduce's rank-major input is a graph value. The wait op takes it as
  an argument, so the compiled graph keeps it alive, unwritten, until the
  collective is done.
- The *outputs* (the gathered unit, the reduced gradient slots) are fresh
  tensors, allocated by the start and returned by the wait: they are what
  the compute reads (the full parameters) and what the optimizer reads (the
  gradients), so they belong to the graph. Keeping them in a preallocated
  arena would cost a copy out of it for every gather and reduce, on every
  step, because a graph value that aliases memory Inductor does not own is
  unsafe (Inductor may reuse a dead input's buffer in place for a later
  value). The outputs are the sizes the liveness estimate already counts
  (``passes/memory.py``), and under CUDA-graph capture they come from the
  graph's private pool at fixed addresses, laid out by the static buffer
  plan (see [Note: static buffer plan] in ``passes/buffers.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fxshard.runtime import compat, plans
from fxshard.runtime.collectives import Replicas, chunk_rows
from fxshard.runtime.library import runtime_op
from fxshard.runtime.plans import ModelRuntime, Param
from fxshard.runtime.rank_checks import check_collective

log = logging.getLogger("fxshard")


MEMBER_ALIGN = 16  # elements: 16 bytes or more for every dtype


def slot_numel(shape: Sequence[int], world_size: int) -> int:
    """Elements of a member's slot: its padded rows per rank times its row (see the Note)."""
    return chunk_rows(shape[0], world_size) * math.prod(shape[1:])


def in_slot(local: torch.Tensor, shape: Sequence[int], world_size: int) -> torch.Tensor:
    """``local``'s values at the front of a zeroed slot buffer of its own:
    where a shard is made, so that ``Unit.rehome`` adopts it in place."""
    slot = torch.zeros(slot_numel(shape, world_size), dtype=local.dtype, device=local.device)
    view = slot[: local.numel()].view(local.shape)
    with torch.no_grad():
        view.copy_(local)
    return view


@dataclass(frozen=True)
class Member:
    param: Param
    chunk: int  # rows per rank, padded
    row: int  # elements per row
    offset: int  # of the slot in the rank's flat shard, in elements

    @property
    def slot(self) -> int:
        return self.chunk * self.row

    @property
    def numel(self) -> int:
        return self.param.shape[0] * self.row

    @property
    def local_numel(self) -> int:
        return self.param.local_rows * self.row


class Unit:
    """One unit's layout and this rank's slot buffers."""

    def __init__(self, index: int, groups: Sequence[Sequence[Param]], world_size: int) -> None:
        self.index = index
        self.world_size = world_size
        params = [p for group in groups for p in group]
        # Member indices of each reduce group (see [Note: a reduce per block]).
        bounds = [0, *itertools.accumulate(len(g) for g in groups)]
        self.reduce_groups = tuple(tuple(range(a, b)) for a, b in zip(bounds, bounds[1:]) if b > a)
        members, offset = [], 0
        for param in params:
            row = math.prod(param.shape[1:])
            chunk = chunk_rows(param.shape[0], world_size)  # slot_numel's

            offset = -(-offset // MEMBER_ALIGN) * MEMBER_ALIGN
            members.append(Member(param, chunk, row, offset))
            offset += chunk * row
        self.members = tuple(members)
        self.numel = offset
        first = params[0]
        self.shard_dtype, self.gather_dtype, self.device = first.shard_dtype, first.gather_dtype, first.device
        self.slots: tuple[torch.Tensor, ...] | None = None  # per member, set by ``rehome``
        self.in_slots = False  # every local shard starts its slot, as ``check_slots`` last found
        self._splits: dict[int | None, tuple[list[int], list[int]]] = {}  # see gathered_views

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.param.fqn for m in self.members)

    def gather_nbytes(self) -> int:
        return self.world_size * self.numel * self.gather_dtype.itemsize

    def rehome(self) -> None:
        """Give every member's local shard a slot buffer of its own, with the
        shard at its front (see the Note: never at an offset into a shared
        buffer). A shard made in its slot (``in_slot``) keeps its memory, so
        what aliases it (a state dict taken before the first call, a
        ``to_local()`` view) keeps tracking the parameter; any other is
        copied into a new slot, which the DTensor then holds."""
        slots = []
        with torch.no_grad():
            for m in self.members:
                local = m.param.shard.local()
                if _fills_slot(local, m, self.shard_dtype):
                    slots.append(local.new_empty(0).set_(local.untyped_storage(), 0, (m.slot,)))
                    continue
                slot = torch.zeros(m.slot, dtype=self.shard_dtype, device=self.device)
                view = slot[: m.local_numel].view(local.shape)
                view.copy_(local)
                m.param.shard.rehome(view)
                slots.append(slot)
        self.slots = tuple(slots)
        self.check_slots()

    def check_slots(self) -> None:
        """Whether every member's local shard still starts its slot: the user
        may have given a DTensor another local tensor since. Checked at each
        call of the root (``Units.check_slots``), not at each gather: a
        member at a time is host time that a unit's gathers in forward and
        backward would pay on every step."""
        slots = self.slots
        self.in_slots = slots is not None and all(_starts_slot(m, s) for m, s in zip(self.members, slots))

    def shard_slots(self) -> tuple[torch.Tensor, ...]:
        """This rank's slot of each member: the buffers themselves while every
        local shard starts its slot (``check_slots``); else padded copies."""
        if self.in_slots:
            return self.slots
        copies = []
        for m in self.members:
            copy = torch.zeros(m.slot, dtype=self.shard_dtype, device=self.device)
            copy[: m.local_numel].copy_(m.param.shard.local().reshape(-1))
            copies.append(copy)
        return tuple(copies)

    def gathered_views(self, out: torch.Tensor, rank: int | None = None) -> list[torch.Tensor]:
        """Each member's block of a gathered ``out`` (``world_size * slot``
        elements), or with ``rank`` that rank's slot in each block: one
        split, where a slice per member cost host time on every gather."""
        split = self._splits.get(rank)
        if split is None:  # the pieces, each after the gap before it where there is one
            ws, sizes, pick, end = self.world_size, [], [], 0
            for m in self.members:
                start = ws * m.offset + (0 if rank is None else rank * m.slot)
                if start > end:
                    sizes.append(start - end)
                pick.append(len(sizes))
                sizes.append(ws * m.slot if rank is None else m.slot)
                end = start + sizes[-1]
            if ws * self.numel > end:
                sizes.append(ws * self.numel - end)
            split = self._splits[rank] = (sizes, pick)
        sizes, pick = split
        pieces = out.split_with_sizes(sizes)
        return [pieces[i] for i in pick]


def _fills_slot(local: torch.Tensor, m: Member, dtype: torch.dtype) -> bool:
    """``local`` starts a storage of its own that holds its whole slot."""
    return (
        local.storage_offset() == 0
        and local.is_contiguous()
        and local.dtype == dtype
        and local.untyped_storage().nbytes() >= m.slot * dtype.itemsize
    )


def _starts_slot(m: Member, slot: torch.Tensor) -> bool:
    local = m.param.shard.local()
    return (
        local.untyped_storage().data_ptr() == slot.untyped_storage().data_ptr()
        and local.storage_offset() == slot.storage_offset()
        and local.is_contiguous()
        and local.dtype == slot.dtype
    )


class Units:
    """A model's units and the collectives in flight."""

    def __init__(
        self,
        model: ModelRuntime,
        params: Sequence[Param],
        world_size: int,
        group_name: str,
        reduce_group_name: str,
        replicas: Replicas | None = None,
    ) -> None:
        self.model = model  # which holds these units once formed, and names their layout
        self.params = {p.fqn: p for p in params}
        self.world_size = world_size
        self.group_name, self.reduce_group_name = group_name, reduce_group_name
        self.replicas = replicas  # HSDP: each reduce is averaged across them too (see [Note: HSDP])
        self.units: list[Unit] = []
        self.unit_of: dict[str, tuple[int, int]] = {}  # fqn -> (unit, member)
        self._pending: dict[tuple, tuple] = {}
        self._groups: dict[str, object] = {}  # group name -> ProcessGroup, resolved on first use
        self._nccl: dict[str, bool] = {}  # group name -> whether it is NCCL, on first use
        self._stream: torch.cuda.Stream | None = None  # see _side_stream
        self.id: int | None = None  # set when the units are formed

    def _register(self) -> None:
        """Take the id of this layout (the next free one if another live model's
        units of the same layout hold it): compiled graphs name the units by it,
        and torch caches them on disk (see [Note: one registry] in runtime/plans.py)."""
        layout = (self.world_size, [([(m.param.fqn, m.param.shape, m.param.local_rows, m.chunk, m.row, m.offset,
                                       m.param.shard_dtype, m.param.gather_dtype, m.param.reduce_dtype, m.param.device)
                                      for m in u.members], u.reduce_groups) for u in self.units])  # fmt: skip
        if self.replicas is not None:  # HSDP graphs average across replicas (see bucket_collectives)
            layout += (self.replicas.size,)
        self.id = self.model.name_units(self, repr(layout).encode())

    @property
    def assigned(self) -> bool:
        return bool(self.units)

    def form(self, units: Sequence[Sequence[Sequence[Param]]]) -> None:
        """Lay out the units that ``units`` list, each as its reduce groups
        (``passes/units.py`` forms them: which parameters move together is
        the passes' decision), once. ``rehome`` moves the shards into their
        slots later."""
        if self.units:
            raise RuntimeError("fxshard: a model's units are formed once")
        for index, groups in enumerate(units):
            unit = Unit(index, groups, self.world_size)
            self.units.append(unit)
            for j, m in enumerate(unit.members):
                self.unit_of[m.param.fqn] = (index, j)
        self._register()
        log.info("fxshard: %d units over %d parameters", len(self.units), len(self.unit_of))

    def unit_names(self, fqn: str) -> tuple[str, ...]:
        """The parameters gathered with ``fqn``: its unit's, or itself alone."""
        where = self.unit_of.get(fqn)
        return self.units[where[0]].names if where is not None else (fqn,)

    def rehome(self) -> None:
        """Move the shards into their units' slots. Called after the
        first call of the model ran as one graph: a model that takes
        sequenced reads never uses units. Until then a gather copies."""
        for unit in self.units:
            if unit.slots is None:
                unit.rehome()

    def check_slots(self) -> None:
        """Before each call of the root: which units' shards all still start
        their slots (``Unit.check_slots``). The gathers of the call and of its
        backward read the slots of those, and copy the others' shards. A
        shard replaced between a forward and its backward is not seen until
        the next call: that backward gathers what its forward did, as eager
        PyTorch computes a backward from the tensors its forward saved."""
        for unit in self.units:
            unit.check_slots()

    def _group(self, name: str) -> object:
        if name not in self._groups:
            self._groups[name] = compat.resolve_group(name)
        return self._groups[name]

    def reduce_layout(self, unit: int, members: Sequence[int]) -> tuple[int, torch.dtype]:
        """Elements per rank of a reduce of ``members`` of ``unit``, and its
        dtype: the members' slots end to end, then zeros up to a multiple of
        Inductor's row alignment. Inductor pads a buffer's unaligned rows (on
        GPUs); the collective reads the rank-major input flat, so its rows
        must be aligned already."""
        u = self.units[unit]
        dtype = u.members[0].param.reduce_dtype
        align = max(compat.inductor_row_alignment_bytes() // dtype.itemsize, 1)
        numel = sum(u.members[j].slot for j in members)
        return -(-numel // align) * align, dtype

    def _on_nccl(self, name: str) -> bool:
        """NCCL coalesces a unit's all-gathers and averages inside the
        reduce-scatter; gloo's coalesced all-gather corrupts the heap, and
        its AVG returns garbage (see ``compat.all_gather_coalesced_async``)."""
        if name not in self._nccl:
            self._nccl[name] = compat.group_backend(name) == "nccl"
        return self._nccl[name]

    # The runtime side of the unit ops (fxshard::unit_*), run by compiled graphs.

    def gather_start(self, unit: int) -> None:
        u = self.units[unit]
        ws = self.world_size
        key = ("gather", unit)
        if key in self._pending:  # one gather per unit per graph (bucket_collectives)
            raise RuntimeError(f"fxshard: unit {unit} gathered again before its previous gather's wait")
        check_collective(self.group_name, lambda: f"all-gather of unit {unit} ({', '.join(u.names)})")
        group = self._group(self.group_name)
        out = torch.empty(ws * u.numel, dtype=u.gather_dtype, device=u.device)
        sources = u.shard_slots()  # copies until ``rehome``: kept until the wait (see below)
        outputs = u.gathered_views(out)
        cast = u.gather_dtype != u.shard_dtype
        stream = self._side_stream(u.device) if cast else None
        if stream is not None:  # fork: the cast follows what the current stream issued before it
            stream.wait_stream(torch.cuda.current_stream(u.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if cast:  # into this rank's slot of each member's block; the all-gather runs in place
                inputs = u.gathered_views(out, group.rank())
                compat.foreach_copy_(inputs, sources)
            else:
                inputs = list(sources)
            work = compat.all_gather_coalesced_async(outputs, inputs, group, coalesce=self._on_nccl(self.group_name))
        # Everything the side stream reads stays referenced until the wait has
        # joined it to the current stream: the caching allocator would hand a
        # freed copy in ``sources`` to the next allocation on the current
        # stream while the cast still read it (the first step's forward
        # gathered garbage).
        self._pending[key] = (work, sources, out)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The side stream a gather's cast and collective are issued on (CUDA
        only; None elsewhere). The caller forks it from the current stream, so
        the cast of a prefetched unit runs beside the compute it was issued
        before, not ahead of it. The collective follows the cast on that
        stream, and its wait joins the current stream again. On the compute
        stream, the casts of both gathers of every unit would add their whole
        time to the step."""
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def gather_wait(self, unit: int) -> torch.Tensor:
        work, _, out = self._pending.pop(("gather", unit))
        work.wait()
        return out

    def reduce_start(self, unit: int, members: Sequence[int], inp: torch.Tensor) -> None:
        numel, dtype = self.reduce_layout(unit, members)
        if inp.dtype != dtype or inp.numel() != self.world_size * numel:
            raise RuntimeError(
                f"fxshard: unit {unit}'s reduce input is {inp.dtype} of shape {tuple(inp.shape)}; "
                f"expected {self.world_size} x {numel} {dtype}"
            )
        if not inp.is_contiguous():
            raise RuntimeError(
                f"fxshard: unit {unit}'s reduce input has strides {inp.stride()}; the collective "
                "reads it flat, so its rows must not be padded"
            )
        key = ("reduce", unit, tuple(members))
        if key in self._pending:
            raise RuntimeError(f"fxshard: unit {unit} reduced again before its previous reduce's wait")
        check_collective(self.reduce_group_name, lambda: f"reduce-scatter of unit {unit}'s gradients "
                         f"({', '.join(self.units[unit].members[j].param.fqn for j in members)})")  # fmt: skip
        out = torch.empty(numel, dtype=dtype, device=self.units[unit].device)
        work = compat.reduce_scatter_async(out, inp.view(-1), self._group(self.reduce_group_name),
                                           average=self._on_nccl(self.reduce_group_name))  # fmt: skip
        self._pending[key] = (work, inp, out)

    def reduce_wait(self, unit: int, members: Sequence[int], inp: torch.Tensor) -> torch.Tensor:
        out = self._reduced(unit, members, inp)
        if not self._on_nccl(self.reduce_group_name):
            out.div_(self.world_size)
        return out.to(self.units[unit].shard_dtype)

    def _reduced(self, unit: int, members: Sequence[int], inp: torch.Tensor) -> torch.Tensor:
        """Wait for the reduce-scatter of ``members`` of ``unit``; its output (the sum, or
        the average on NCCL), in the reduce dtype."""
        work, sent, out = self._pending.pop(("reduce", unit, tuple(members)))
        if inp.data_ptr() != sent.data_ptr():  # the graph would not keep what the collective reads alive
            raise RuntimeError(f"fxshard: unit {unit}'s reduce wait got another buffer than its start sent")
        work.wait()
        return out

    def replicas_start(self, unit: int, members: Sequence[int], inp: torch.Tensor) -> None:
        """HSDP: wait for the unit's reduce-scatter (on CUDA the current stream
        waits; the host does not) and start the all-reduce of its output across
        the replicas, in place, in the reduce dtype (see [Note: HSDP])."""
        out = self._reduced(unit, members, inp)
        key = ("replicas", unit, tuple(members))
        if key in self._pending:
            raise RuntimeError(f"fxshard: unit {unit} averaged again before its previous average's wait")
        replicas = self.replicas
        check_collective(replicas.group_name, lambda: f"all-reduce over {replicas.size} replicas of unit {unit}'s "
                         f"gradients ({', '.join(self.units[unit].members[j].param.fqn for j in members)})")  # fmt: skip
        work = compat.all_reduce_async(out, self._group(replicas.group_name),
                                       average=self._on_nccl(replicas.group_name))  # fmt: skip
        self._pending[key] = (work, out)

    def replicas_wait(self, unit: int, members: Sequence[int]) -> torch.Tensor:
        """The unit's gradient slots averaged over the whole mesh, in the shard dtype."""
        work, out = self._pending.pop(("replicas", unit, tuple(members)))
        work.wait()
        divisor = (1 if self._on_nccl(self.reduce_group_name) else self.world_size) * (
            1 if self._on_nccl(self.replicas.group_name) else self.replicas.size
        )
        if divisor != 1:
            out.div_(divisor)
        return out.to(self.units[unit].shard_dtype)

    def drain(self) -> int:
        """Wait for every collective still in flight and forget it; how many
        there were. Nothing is in flight between two calls of a model unless
        one raised (see [Note: a call that raises])."""
        left = list(self._pending.values())
        self._pending.clear()
        for work, *_ in left:  # what they read and write stays referenced until then
            work.wait()
        return len(left)


# [Note: a call that raises]
# A graph issues each collective and waits for it later in the same graph
# (one gather per unit per graph, the reduces before the graph ends). A call
# that raises in between (out of memory, a bad index, an interrupt) leaves
# its issued collectives in flight, and the next gather or reduce of the same
# unit would find its key taken. So the root drains the units when its
# outermost call raises, and before each outermost call (a backward that
# raised has no call of its own to end; ``module.root.RootState._recover``).
# Draining waits: an NCCL collective writes into its output until it is
# done, and the other ranks issued the same collectives where the error is
# the same on every rank (an error on one rank only leaves the others waiting
# in a collective, as in any SPMD program).
#
# A backward that raises gives no gradient: the reduces it issued are waited
# for and dropped, and the sequencer drops what it gave sequenced calls
# (``Sequencer.drop_failed_backward``), as ``zero_grad`` after the failure
# would. The engine drops the end-of-backward callbacks of a backward that
# raises, so what runs there is queued per backward (``compat.AtBackwardEnd``),
# never behind a flag that the failed backward would leave set.


def units_of(units_id: int) -> Units:
    return plans.runtime(units_id).units


# The ops compiled graphs call. Each start returns an empty token that its
# wait takes, so the graph orders them; the buffers stay in the runtime.


@runtime_op("unit_gather")
def unit_gather(shards: list[torch.Tensor], units: int, unit: int) -> torch.Tensor:
    """Start the all-gather of ``unit`` (``shards``: the members this graph
    reads, for ordering; the data comes from the unit's slots)."""
    u = units_of(units)
    u.gather_start(unit)
    return torch.empty(0, device=u.units[unit].device)


@unit_gather.register_fake
def _(shards, units, unit):
    return torch.empty(0, device=units_of(units).units[unit].device)


@runtime_op("unit_gather_wait")
def unit_gather_wait(token: torch.Tensor, units: int, unit: int) -> torch.Tensor:
    """Wait for the gather; return the members' full parameters, end to end
    in ``world_size * slot`` blocks (see [Note: units and flat shards])."""
    return units_of(units).gather_wait(unit)


@unit_gather_wait.register_fake
def _(token, units, unit):
    u = units_of(units)
    v = u.units[unit]
    return torch.empty(u.world_size * v.numel, dtype=v.gather_dtype, device=v.device)


@runtime_op("unit_reduce")
def unit_reduce(inp: torch.Tensor, units: int, unit: int, members: list[int]) -> torch.Tensor:
    """Start the reduce-scatter of ``members`` of ``unit``; ``inp`` is their
    full gradients laid out rank-major in the reduce dtype (``world_size x
    slots``, flat), built by the graph (see [Note: units and flat shards])."""
    u = units_of(units)
    u.reduce_start(unit, members, inp)
    return torch.empty(0, device=u.units[unit].device)


@unit_reduce.register_fake
def _(inp, units, unit, members):
    return torch.empty(0, device=units_of(units).units[unit].device)


@runtime_op("unit_reduce_wait")
def unit_reduce_wait(token: torch.Tensor, inp: torch.Tensor, units: int, unit: int, members: list[int]) -> torch.Tensor:
    """Wait for the reduce; return this rank's averaged gradient slots, end to
    end, in the shard dtype (the collective's own output where that is its dtype).
    ``inp`` is the start's input, passed again so that the compiled graph keeps
    it alive, unchanged, until the collective is done."""
    return units_of(units).reduce_wait(unit, members, inp)


@unit_reduce_wait.register_fake
def _(token, inp, units, unit, members):
    u = units_of(units)
    numel, _ = u.reduce_layout(unit, members)
    v = u.units[unit]
    return torch.empty(numel, dtype=v.shard_dtype, device=v.device)


@runtime_op("unit_reduce_replicas")
def unit_reduce_replicas(
    token: torch.Tensor, inp: torch.Tensor, units: int, unit: int, members: list[int]
) -> torch.Tensor:
    """HSDP: wait for the reduce-scatter that ``token`` started and start the
    all-reduce of its output across the replicas (see [Note: HSDP]); returns
    the token that ``unit_replicas_wait`` takes. ``inp``: as for ``unit_reduce_wait``."""
    u = units_of(units)
    u.replicas_start(unit, members, inp)
    return torch.empty(0, device=u.units[unit].device)


@unit_reduce_replicas.register_fake
def _(token, inp, units, unit, members):
    return torch.empty(0, device=units_of(units).units[unit].device)


@runtime_op("unit_replicas_wait")
def unit_replicas_wait(token: torch.Tensor, units: int, unit: int, members: list[int]) -> torch.Tensor:
    """Wait for the all-reduce across replicas; return this rank's gradient
    slots averaged over the whole mesh, end to end, in the shard dtype."""
    return units_of(units).replicas_wait(unit, members)


@unit_replicas_wait.register_fake
def _(token, units, unit, members):
    u = units_of(units)
    numel, _ = u.reduce_layout(unit, members)
    v = u.units[unit]
    return torch.empty(numel, dtype=v.shard_dtype, device=v.device)


UNIT_GATHER = torch.ops.fxshard.unit_gather.default
UNIT_GATHER_WAIT = torch.ops.fxshard.unit_gather_wait.default
UNIT_REDUCE = torch.ops.fxshard.unit_reduce.default
UNIT_REDUCE_WAIT = torch.ops.fxshard.unit_reduce_wait.default
UNIT_REDUCE_REPLICAS = torch.ops.fxshard.unit_reduce_replicas.default
UNIT_REPLICAS_WAIT = torch.ops.fxshard.unit_replicas_wait.default
