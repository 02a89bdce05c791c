"""Plan the arena: where each collective buffer lives, from the graph's liveness.

[Note: arena plan]
After scheduling, each unit collective is a start node and a wait node. Its
arena buffers (the gather's cast input; see [Note: units and flat shards])
are alive from the start to the wait,
inclusive: the start writes them, the collective reads them on the
communication stream, and the wait is the last to need them. Two buffers whose
intervals intersect get disjoint byte ranges; others may share. Offsets come
from a greedy first fit, largest buffer first, each at the lowest aligned
offset free over its interval. The arena's size is the largest end, and it
is the largest over all of a model's graphs: graphs run one after another and
wait on their own collectives, so they share one buffer.

The plan is a function of the graph, so it is the same on every rank. The
pass writes the offsets into the start and wait nodes' arguments and reserves
the size in the runtime's ``Arena``.

The same pass estimates the graph's peak memory from liveness (``graph_peak``):
graph inputs, plus every tensor a node allocates, held from that node to its
last use (a view holds its base), plus the arena. A collective's output is
held from its start, which allocates it, not its wait. Inductor fuses pointwise
ops, so the real peak of a compiled graph is usually lower; the estimate
counts what the ATen graph materializes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx

from fxshard.passes.markers import nbytes
from fxshard.runtime.units import ARENA_ALIGN, UNIT_GATHER, UNIT_GATHER_WAIT, UNIT_REDUCE_WAIT, Units


@dataclass(frozen=True)
class ArenaBuffer:
    name: str  # "<start node>.in"
    nbytes: int
    first: int  # positions among the graph's nodes, inclusive
    last: int
    offset: int


@dataclass(frozen=True)
class GraphPeak:
    inputs: int  # bytes of graph inputs
    intermediates: int  # bytes of allocated tensors alive at the peak
    at: str  # the node where it peaks
    arena: int

    @property
    def total(self) -> int:
        return self.inputs + self.intermediates + self.arena


@dataclass(frozen=True)
class ArenaPlan:
    buffers: tuple[ArenaBuffer, ...]
    size: int
    peak: GraphPeak

    def format(self) -> str:
        mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
        p = self.peak
        lines = [
            f"arena: {len(self.buffers)} buffers, {mib(self.size)} MiB "
            f"(sum of buffers {mib(sum(b.nbytes for b in self.buffers))} MiB)",
            f"predicted peak: {mib(p.total)} MiB = inputs {mib(p.inputs)} + intermediates {mib(p.intermediates)} "
            f"(at {p.at}) + arena {mib(p.arena)}",
            f"  {'buffer':36} {'MiB':>9} {'interval':>13} {'offset':>12}",
        ]
        for b in self.buffers:
            lines.append(f"  {b.name:36} {mib(b.nbytes):>9} {f'[{b.first}, {b.last}]':>13} {b.offset:>12}")
        return "\n".join(lines) + "\n"


def _align(n: int) -> int:
    return -(-n // ARENA_ALIGN) * ARENA_ALIGN


def plan_offsets(buffers: Sequence[tuple[int, int, int]]) -> tuple[list[int], int]:
    """Offsets for ``(nbytes, first, last)`` buffers such that buffers alive
    at the same time never share a byte; and the total size."""
    offsets = [0] * len(buffers)
    placed: list[int] = []
    for i in sorted(range(len(buffers)), key=lambda i: (-buffers[i][0], buffers[i][1])):
        size, first, last = buffers[i]
        busy = sorted(
            (offsets[j], offsets[j] + _align(buffers[j][0]))
            for j in placed
            if buffers[j][1] <= last and first <= buffers[j][2]
        )
        offset = 0
        for start, end in busy:
            if offset + _align(size) <= start:
                break
            offset = max(offset, end)
        offsets[i] = offset
        placed.append(i)
    size = max((offsets[i] + _align(b[0]) for i, b in enumerate(buffers)), default=0)
    return offsets, size


def graph_peak(graph: fx.Graph, arena: int) -> GraphPeak:
    """Liveness estimate (see the Note), at the example sizes of a dynamic graph."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    base = {}  # node -> the node whose allocation it aliases
    for n in nodes:
        target = n.target
        is_view = isinstance(target, torch._ops.OpOverload) and target.is_view
        base[n] = base[n.args[0]] if is_view and n.args and isinstance(n.args[0], fx.Node) else n
    last_use = {n: pos[n] for n in nodes}
    for n in nodes:
        for a in n.all_input_nodes:
            b = base[a]
            last_use[b] = max(last_use[b], pos[n])
    inputs = sum(nbytes(n) for n in nodes if n.op == "placeholder")
    allocs: dict[int, int] = {}
    frees: dict[int, int] = {}
    for n in nodes:
        if n.op in ("call_function", "call_module", "call_method") and base[n] is n:
            at = pos[n.args[0]] if n.target in (UNIT_GATHER_WAIT, UNIT_REDUCE_WAIT) else pos[n]
            allocs[at] = allocs.get(at, 0) + nbytes(n)
            frees[last_use[n]] = frees.get(last_use[n], 0) + nbytes(n)
    live = peak = 0
    at = "-"
    for n in nodes:
        live += allocs.get(pos[n], 0)
        if live > peak:
            peak, at = live, n.name
        live -= frees.pop(pos[n], 0)
    return GraphPeak(inputs, peak, at, arena)


def plan_arena_pass(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, units: Units | None, record: list | None = None
) -> fx.GraphModule:
    """Assign arena offsets to the unit collectives of ``gm`` (see [Note: arena plan])."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    starts = [n for n in nodes if n.target == UNIT_GATHER]
    names, sizes = [], []
    for start in starts:
        (wait,) = start.users
        for size in units.gather_buffers(start.args[2]):
            names.append((start, f"{start.name}.in"))
            sizes.append((size, pos[start], pos[wait]))
    offsets, size = plan_offsets(sizes)
    by_start: dict[fx.Node, list[int]] = {}
    for (start, _), offset in zip(names, offsets):
        by_start.setdefault(start, []).append(offset)
    for start, offs in by_start.items():
        (wait,) = start.users
        for node in (start, wait):
            args = list(node.args)
            args[-1] = offs
            node.args = tuple(args)
    if units is not None:
        units.arena.reserve(size)
    buffers = tuple(ArenaBuffer(name, s[0], s[1], s[2], o) for (_, name), s, o in zip(names, sizes, offsets))
    plan = ArenaPlan(buffers, size, graph_peak(gm.graph, size))
    if record is not None:
        record.append(plan)
    return gm
