"""Schedule the lowered collectives: prefetch gathers, defer reduce waits.

[Note: prefetch by units]
After lowering, each all-gather sits right before its wait, and each wait
right before the gathered weight's first use: compute stalls on every
gather. This pass moves collectives, never compute:

- Units. Each bucketed unit gather (``fxshard::unit_gather``, one per unit
  of ``runtime/units.py``) is a schedule unit of its own. Per-parameter
  gathers left by ``lower_collectives`` are grouped, in the order of their
  waits (the order of first use), into units of about ``unit_bytes`` (256
  MiB where the user gave no ``unit_mb``). Both
  follow from the graph alone, so they are the same on every rank.
- Prefetch. Unit ``u``'s all-gathers (with the casts and pads that feed them,
  which read only graph inputs) move to just before the first wait of unit
  ``u - prefetch``: they run while that unit computes. Units within the
  first ``prefetch`` are issued at the start of the graph. Units whose waits
  no compute separates (an outlined block's call needs all of its units)
  count as one: ``u`` counts these stages, not units.
- Deferred reduce waits. A reduce-scatter's wait (and the slicing and cast
  after it, which only feed the graph's outputs) moves to just before the
  input of the reduce-scatter issued ``max_reduces_in_flight`` later is
  built (its cast, pad and layout, which lowering inserted), or to the end.
  The backward does not stall on it: the reduce ran while the later units'
  gradients were computed. Reduces that no compute separates (one outlined
  block's call completes several units' gradients) count as one. And at
  most ``max_reduces_in_flight`` of the reduce inputs that lowering builds
  are alive at once, since the wait frees its input before the next one is
  allocated (a reduce that sends a gradient as it is, with no cast or pad,
  has no input of its own). Placed just before the later reduce-scatter
  itself, one more was alive: another unit's gradients in the reduce
  dtype. A replicated parameter's gradient all-reduce is deferred the
  same way, and counts as a reduce.
- HSDP averages across replicas (see [Note: HSDP]). A unit's average starts
  in the op that waits for its reduce-scatter, and a per-parameter one
  right after that wait: either moves with the wait, as above, and does not
  count as a reduce. Its own wait (with the cast after it) moves to the end
  of the graph: it holds no buffer but the gradient the graph returns.

Collectives keep their relative order within each kind, and the pass is a
function of the graph, so every rank issues the same collectives in the same
order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxshard.passes.bucket import NBYTES
from fxshard.passes.lower import LOWERED, REPLICAS
from fxshard.passes.markers import nbytes
from fxshard.passes.runner import Recorded
from fxshard.passes.units import DEFAULT_UNIT_BYTES
from fxshard.runtime.units import (
    UNIT_GATHER,
    UNIT_GATHER_WAIT,
    UNIT_REDUCE,
    UNIT_REDUCE_REPLICAS,
    UNIT_REDUCE_WAIT,
    UNIT_REPLICAS_WAIT,
)

_funcol = torch.ops._c10d_functional
_ALL_GATHER = _funcol.all_gather_into_tensor.default
_REDUCE_SCATTER = _funcol.reduce_scatter_tensor.default
_ALL_REDUCE = _funcol.all_reduce.default  # a replicated parameter's gradient
_WAIT = _funcol.wait_tensor.default
# A collective (per parameter, or per unit) and the ops that wait for it.
# On an HSDP mesh a unit's reduce-scatter is waited for by the op that starts
# its average across replicas (see [Note: HSDP]).
_WAITS = {
    _ALL_GATHER: (_WAIT,),
    _REDUCE_SCATTER: (_WAIT,),
    _ALL_REDUCE: (_WAIT,),
    UNIT_GATHER: (UNIT_GATHER_WAIT,),
    UNIT_REDUCE: (UNIT_REDUCE_WAIT, UNIT_REDUCE_REPLICAS),
    UNIT_REDUCE_REPLICAS: (UNIT_REPLICAS_WAIT,),
}
_COMM = frozenset(_WAITS) | frozenset(w for waits in _WAITS.values() for w in waits)


@dataclass(frozen=True)
class Schedule:
    """What the pass did to one graph, for the summary."""

    units: tuple[tuple[str, ...], ...]  # all-gather node names per unit, in order
    prefetch: int
    deferred_reduces: int
    replica_waits_at_end: int = 0  # HSDP: averages across replicas waited for at the graph's end

    def format(self) -> str:
        replicas = (
            f"; {self.replica_waits_at_end} replica averages waited at the end" if self.replica_waits_at_end else ""
        )
        lines = [
            f"prefetch depth {self.prefetch}; {len(self.units)} units; {self.deferred_reduces} reduce waits deferred"
            + replicas
        ]
        lines += [f"  unit {i}: {len(u)} all-gathers ({', '.join(u[:4])}{', ...' if len(u) > 4 else ''})"
                  for i, u in enumerate(self.units)]  # fmt: skip
        return "\n".join(lines) + "\n"


def _wait_of(node: fx.Node) -> fx.Node | None:
    waits = [u for u in node.users if u.target in _WAITS.get(node.target, ())]
    return waits[0] if len(waits) == 1 else None


def _averages_replicas(node: fx.Node) -> bool:
    """An HSDP average across replicas: a unit's, or a lowered all-reduce tagged so (see [Note: HSDP])."""
    return node.target is UNIT_REDUCE_REPLICAS or (node.target is _ALL_REDUCE and bool(node.meta.get(REPLICAS)))


def _is_lowered(node: fx.Node, *targets: object) -> bool:
    """A collective of one of ``targets`` that lowering or bucketing inserted, with its wait."""
    return node.target in targets and bool(node.meta.get(LOWERED)) and _wait_of(node) is not None


def _bytes(node: fx.Node) -> int:
    return node.meta[NBYTES] if NBYTES in node.meta else nbytes(node)


def _input_chain(node: fx.Node) -> list[fx.Node] | None:
    """``node``'s ancestors up to graph inputs, in graph order; None unless
    every one was inserted by lowering (casts and pads of a shard)."""
    found: set[fx.Node] = set()
    frontier = [a for a in node.all_input_nodes]
    while frontier:
        n = frontier.pop()
        if n in found or n.op == "placeholder" or n.op == "get_attr":
            continue
        if n.op != "call_function" or not n.meta.get(LOWERED) or n.target in _COMM:
            return None
        found.add(n)
        frontier.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(node.graph.nodes)}
    return sorted(found, key=order.__getitem__)


def schedule_collectives(
    graph: fx.Graph, unit_bytes: int | None, prefetch: int, max_reduces_in_flight: int
) -> Schedule:
    unit_bytes = DEFAULT_UNIT_BYTES if unit_bytes is None else unit_bytes
    gathers = [n for n in graph.nodes if _is_lowered(n, _ALL_GATHER, UNIT_GATHER)]
    order = {n: i for i, n in enumerate(graph.nodes)}
    gathers.sort(key=lambda g: order[_wait_of(g)])
    units: list[list[fx.Node]] = []
    size = unit_bytes
    for g in gathers:
        # A unit gather (bucketed) is a schedule unit of its own; per-parameter
        # gathers are grouped here by size.
        if size >= unit_bytes or g.target == UNIT_GATHER or units[-1][-1].target == UNIT_GATHER:
            units.append([])
            size = 0
        units[-1].append(g)
        size += _bytes(g)

    if prefetch > 0:
        stages = _stages(graph, units)
        first_of_stage = {}
        for u, stage in enumerate(stages):
            first_of_stage.setdefault(stage, u)
        moves = [[(g, _input_chain(g)) for g in unit] for unit in units]
        early = {n for u, unit in enumerate(moves) if stages[u] < prefetch
                 for g, chain in unit if chain is not None for n in (*chain, g)}  # fmt: skip
        start = next(n for n in graph.nodes if n.op not in ("placeholder", "get_attr") and n not in early)
        for u, unit in enumerate(moves):
            ahead = stages[u] - prefetch
            anchor = start if ahead < 0 else _wait_of(units[first_of_stage[ahead]][0])
            pos = {n: i for i, n in enumerate(graph.nodes)}
            for g, chain in unit:
                if chain is None:
                    continue
                for n in [*chain, g]:
                    if pos[n] > pos[anchor]:  # only ever earlier: users stay after
                        anchor.prepend(n)

    deferred = 0
    reduces = [n for n in graph.nodes
               if _is_lowered(n, _REDUCE_SCATTER, _ALL_REDUCE, UNIT_REDUCE) and not _averages_replicas(n)]  # fmt: skip
    output = next(n for n in graph.nodes if n.op == "output")
    order = {n: i for i, n in enumerate(graph.nodes)}  # only waits move below, never what builds an input
    built = [_built_from(rs, order) for rs in reduces]
    for i, rs in enumerate(reduces):
        later = i + max_reduces_in_flight
        # Reduces that no compute separates (one outlined block's call
        # completes the gradients of several units) count as one, as stages
        # do for gathers: the wait must have compute to hide behind.
        while later < len(reduces) and not _computes_between(rs, built[later]):
            later += 1
        anchor = built[later] if later < len(reduces) else output
        chain = _output_chain(_wait_of(rs), output, anchor)
        if chain is None:
            continue
        for n in chain:
            anchor.prepend(n)
        deferred += 1

    # HSDP: each average across replicas was started where its reduce's wait
    # now is (it moved with that wait, above); it holds no buffer but the
    # gradient it returns, so it is waited for at the end of the graph.
    at_end = 0
    for n in [n for n in graph.nodes if _averages_replicas(n) and _is_lowered(n, _ALL_REDUCE, UNIT_REDUCE_REPLICAS)]:
        chain = _output_chain(_wait_of(n), output, output)
        if chain is None:
            continue
        for c in chain:
            output.prepend(c)
        at_end += 1
    graph.lint()
    return Schedule(tuple(tuple(g.name for g in unit) for unit in units), prefetch, deferred, at_end)


def _built_from(reduce: fx.Node, order: dict[fx.Node, int]) -> fx.Node:
    """The first node, in graph order, of what lowering inserted to build
    ``reduce``'s input (casts, pads, the rank-major layout); ``reduce`` itself
    where it sends a gradient as it is."""
    chain, frontier = [reduce], list(reduce.all_input_nodes)
    while frontier:
        n = frontier.pop()
        if n.op == "call_function" and n.meta.get(LOWERED) and n.target not in _COMM and n not in chain:
            chain.append(n)
            frontier.extend(n.all_input_nodes)
    return min(chain, key=order.__getitem__)


def _is_compute(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target not in _COMM and not node.meta.get(LOWERED)


def _computes_between(first: fx.Node, last: fx.Node) -> bool:
    """Whether a compute node lies strictly between ``first`` and ``last``."""
    node = first.next
    while node is not last and node.op != "output":
        if _is_compute(node):
            return True
        node = node.next
    return False


def _stages(graph: fx.Graph, units: list[list[fx.Node]]) -> list[int]:
    """Each unit's stage: consecutive units whose waits no compute separates
    (one op needs them all, such as an outlined block's call) are one stage,
    and prefetch counts stages, so that a block's units are all issued while
    the previous block computes."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    stages: list[int] = []
    previous = None
    for unit in units:
        at = pos[_wait_of(unit[0])]
        between = nodes[previous + 1 : at] if previous is not None else []
        computes = any(_is_compute(n) for n in between)
        stages.append(stages[-1] + computes if stages else 0)
        previous = at
    return stages


def _output_chain(wait: fx.Node, output: fx.Node, anchor: fx.Node) -> list[fx.Node] | None:
    """``wait`` and everything computed from it, in graph order, if all of it
    only feeds the graph's output and can move to just before ``anchor``.
    An HSDP average across replicas started from it moves with it, and its
    own wait stays where it is (see [Note: HSDP])."""
    found, frontier = {wait}, [] if _averages_replicas(wait) else [wait]
    while frontier:
        for user in frontier.pop().users:
            if user is output or user in found:
                continue
            if _averages_replicas(user):
                found.add(user)
                continue
            if user.op != "call_function" or user.target in _COMM:
                return None
            found.add(user)
            frontier.append(user)
    order = {n: i for i, n in enumerate(wait.graph.nodes)}
    if any(order[a] >= order[anchor] for n in found for a in n.all_input_nodes if a not in found):
        return None
    return sorted(found, key=order.__getitem__)


def schedule_collectives_pass(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    unit_bytes: int | None,
    prefetch: int,
    max_reduces_in_flight: int = 1,
) -> Recorded:
    """Matches lowered ``_c10d_functional`` all-gathers and reduce-scatters
    with their waits; moves them (see [Note: prefetch by units]). Does nothing
    on a graph without collectives. The record is the ``Schedule``."""
    return Recorded(gm, schedule_collectives(gm.graph, unit_bytes, prefetch, max_reduces_in_flight))
