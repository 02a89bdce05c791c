"""The static buffer plan: an offset for every collective buffer of a graph.

[Note: static buffer plan]
When a whole training step is captured as a CUDA graph, every buffer that a
collective reads or writes has an address fixed at capture, the same on
every replay. ``plan_buffers`` lays those buffers out from the lowered and
scheduled graph:

- ``gather``: a unit's gathered output (allocated by ``fxshard::unit_gather``,
  returned by its wait), or a ``_c10d_functional`` all-gather's output.
  Alive from the start to the last read of its value or of any view of it.
- ``gather_input``: a funcol all-gather's input where the graph builds it (a
  cast or a pad of the shard). A unit gather sends its slots, or casts into
  its own output (see [Note: units and flat shards]): it has none.
- ``reduce_input``: a unit's rank-major gradients (the ``cat`` the graph
  builds), or a funcol reduce-scatter's input. Alive from the node that
  builds it to the wait (or its last read, if later).
- ``reduce_output``: a reduce's output (allocated by the start, returned by
  the wait). Alive from the start to its last read.

A shard sent as it is is a graph input, held by the caller: not planned.
Lifetimes come from the same liveness as the peak estimate
(``memory.liveness``). Intervals are node positions, inclusive: a buffer
freed by a node and one allocated by it never share memory.

How the plan is realized. Under capture the buffers come from the capture's
private memory pool: the caching allocator places them while capturing, and
every replay reuses those addresses. fxshard does not hold them in an arena
of its own: that would cost a copy out of it for every gather, since
Inductor may reuse a dead output's buffer in place for a later value, so no
graph value may alias memory Inductor does not own. The offsets are the
layout one arena would hold, ``total`` is the arena size the collectives
need, and the plan is what the memory prediction counts for communication
(see [Note: peak estimate]).

Offsets come from a deterministic offline allocator: buffers sorted by size,
largest first, then by start and name; each placed at the lowest
512-byte-aligned offset where it overlaps no placed buffer whose interval
intersects its own. It reads only the graph (node names, positions, sizes),
so recompiling the same graph gives the same plan.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import fx

from fxshard.passes.lower import PARAM
from fxshard.passes.markers import nbytes
from fxshard.passes.memory import Liveness, liveness
from fxshard.runtime.units import (
    UNIT_GATHER,
    UNIT_GATHER_WAIT,
    UNIT_REDUCE,
    UNIT_REDUCE_REPLICAS,
    UNIT_REDUCE_WAIT,
    UNIT_REPLICAS_WAIT,
)

ALIGN = 512  # bytes; the caching allocator's rounding
_funcol = torch.ops._c10d_functional
# A collective and the ops that wait for it. On an HSDP mesh a unit's
# reduce-scatter is waited for by the op that starts the average across
# replicas in place on its output, and that average's wait returns it.
_WAITS = {
    UNIT_GATHER: (UNIT_GATHER_WAIT,),
    UNIT_REDUCE: (UNIT_REDUCE_WAIT, UNIT_REDUCE_REPLICAS),
    _funcol.all_gather_into_tensor.default: (_funcol.wait_tensor.default,),
    _funcol.reduce_scatter_tensor.default: (_funcol.wait_tensor.default,),
    _funcol.all_reduce.default: (_funcol.wait_tensor.default,),  # a replicated parameter's gradient, or HSDP's
}


class BufferKind(enum.Enum):
    GATHER = "gather"
    GATHER_INPUT = "gather_input"
    REDUCE_INPUT = "reduce_input"
    REDUCE_OUTPUT = "reduce_output"


@dataclass(frozen=True)
class PlannedBuffer:
    name: str  # the node that holds it
    kind: BufferKind
    owner: str  # "unit <index>", or the parameter a funcol collective moves
    nbytes: int
    start: int  # node positions: alive from start to end, inclusive
    end: int
    start_node: str
    end_node: str
    offset: int  # bytes into the arena

    def alive_with(self, other: PlannedBuffer) -> bool:
        return self.start <= other.end and other.start <= self.end

    def shares_bytes(self, other: PlannedBuffer) -> bool:
        return self.offset < other.offset + other.nbytes and other.offset < self.offset + self.nbytes


@dataclass(frozen=True)
class BufferPlan:
    buffers: tuple[PlannedBuffer, ...]  # in graph order
    total: int  # arena bytes

    def format(self) -> str:
        if not self.buffers:
            return "static buffer plan: no collective buffers\n"
        rows = [(b.name, b.kind.value, b.owner, f"{b.nbytes / 2**20:.3f}",
                 f"[{b.start_node} {b.start} .. {b.end_node} {b.end}]", str(b.offset)) for b in self.buffers]  # fmt: skip
        header = ("name", "kind", "unit or param", "MiB", "interval", "offset")
        widths = [max(len(r[i]) for r in (header, *rows)) for i in range(len(header))]
        lines = [f"static buffer plan: {len(self.buffers)} buffers"]
        lines += ["  " + "  ".join(c.rjust(w) if i in (3, 5) else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
                  for r in (header, *rows)]  # fmt: skip
        lines.append(f"  total: {self.total / 2**20:.3f} MiB ({self.total} bytes)")
        return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class _Found:
    node: fx.Node
    kind: BufferKind
    owner: str
    nbytes: int
    start: int
    end: int


def _collective_buffers(graph: fx.Graph, live: Liveness) -> list[_Found]:
    """Every collective buffer (see the Note), unplaced."""
    found: dict[fx.Node, _Found] = {}
    for n in graph.nodes:
        if n.op != "call_function" or n.target not in _WAITS:
            continue
        waits = [u for u in n.users if u.target in _WAITS[n.target]]
        assert len(waits) == 1, f"fxshard: collective {n.name} has {len(waits)} waits; expected one"
        wait, is_unit = waits[0], n.target in (UNIT_GATHER, UNIT_REDUCE)
        owner = f"unit {n.args[2]}" if is_unit else str(n.meta.get(PARAM, n.name))
        gather = n.target in (UNIT_GATHER, _funcol.all_gather_into_tensor.default)
        # A unit op's start returns a token: the output is its wait's value
        # (on an HSDP mesh, the value of the replica average's wait).
        out = wait if is_unit else n
        if wait.target is UNIT_REDUCE_REPLICAS:
            (out,) = (u for u in wait.users if u.target is UNIT_REPLICAS_WAIT)
        size = nbytes(out)
        if n.target is UNIT_REDUCE:  # the collective writes the reduce dtype; the wait may cast
            size = max(size, out.meta["val"].numel() * n.args[0].meta["val"].element_size())
        kind = BufferKind.GATHER if gather else BufferKind.REDUCE_OUTPUT
        found[out] = _Found(out, kind, owner, size, live.pos[n], live.read[out])
        if n.target is UNIT_GATHER:
            continue
        base = live.base[n.args[0]]
        if base.op == "placeholder":
            continue
        # A tuple's element (a gradient an outlined block returns) exists from the tuple's node.
        made = base.args[0] if base.target is operator.getitem else base
        kind = BufferKind.GATHER_INPUT if gather else BufferKind.REDUCE_INPUT
        end = max(live.read[base], live.pos[wait])
        if base in found:  # one value sent twice
            end = max(end, found[base].end)
        found[base] = _Found(base, kind, owner, nbytes(base), live.pos[made], end)
    return list(found.values())


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def first_fit(items: Sequence[tuple[str, int, int, int]]) -> dict[str, int]:
    """Offsets for ``(name, nbytes, start, end)`` items (see the Note): the
    largest first; each at the lowest aligned offset free while it lives."""
    placed: list[tuple[int, int, int, int]] = []  # (start, end, offset, nbytes)
    offsets = {}
    for name, size, start, end in sorted(items, key=lambda i: (-i[1], i[2], i[0])):
        taken = sorted((o, o + n) for s, e, o, n in placed if s <= end and start <= e)
        offset = 0
        for lo, hi in taken:
            if offset + size <= lo:
                break
            offset = max(offset, _align(hi))
        offsets[name] = offset
        placed.append((start, end, offset, size))
    return offsets


def plan_buffers(gm: fx.GraphModule) -> BufferPlan:
    """The static buffer plan of a lowered and scheduled graph (see the Note)."""
    live = liveness(gm.graph)
    found = sorted(_collective_buffers(gm.graph, live), key=lambda f: (f.start, f.node.name))
    offsets = first_fit([(f.node.name, f.nbytes, f.start, f.end) for f in found])
    names = [n.name for n in gm.graph.nodes]
    buffers = tuple(PlannedBuffer(f.node.name, f.kind, f.owner, f.nbytes, f.start, f.end, names[f.start], names[f.end],
                                  offsets[f.node.name]) for f in found)  # fmt: skip
    return BufferPlan(buffers, _align(max((b.offset + b.nbytes for b in buffers), default=0)))
