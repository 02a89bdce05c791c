"""Estimate a graph's peak memory from its liveness, and a training step's.

[Note: peak estimate]
``graph_peak`` walks the ATen graph in order with a running total of the
tensors alive; ``step_peak`` composes a training step from its graphs.

What a graph counts:

- Intermediates. A node's output is allocated at the node and freed after
  its last read. A view (an op whose output aliases its first argument, and
  ``wait_tensor``) holds its base instead; a tuple's elements are freed one
  by one after the last ``getitem`` of each. A collective's output is
  allocated by its start, not its wait (``fxshard::unit_gather_wait``,
  ``unit_reduce_wait`` and, on an HSDP mesh, ``unit_replicas_wait``, whose
  output the reduce-scatter's start allocated; a funcol collective allocates
  at itself).
- Fusion, approximated. A pointwise node (``torch.Tag.pointwise``) whose
  users, through views, are all pointwise or reductions, and that is not a
  graph output, is not materialized: Inductor computes it inside its users'
  kernels. Its inputs are read there instead, so they live that long.
- Inputs. A forward's or an inference graph's are the caller's: alive
  throughout. A backward frees its saved activations and tangents after
  their last read (AOTAutograd hands Inductor the list of them, and the
  compiled backward clears it), but holds the forward's inputs
  (``primals_*``: parameter shards and the user's inputs, which the caller
  holds).
- An outlined block's call (``invoke_subgraph``) adds, at the call, the
  body's own peak above the outputs it returns.

``step_peak`` is the larger of the forward's peak (whose outputs, at its
end, are the saved activations) and the backward's (whose inputs are those
activations), plus what the caller holds outside every graph.

What it leaves out: eager code around the compiled model (a loss computed
outside it, and that loss's backward), the optimizer and its states, an
earlier step's gradients, collective and library workspaces (NCCL, cuBLAS),
and the caching allocator's rounding and fragmentation. Fusion is a rule of
thumb: Inductor also fuses into a ``cat`` or a pad (counted here as
allocations) and reuses a dead buffer in place (a new allocation here), so
those push the estimate high; eager code around the model pushes it low.
The error has not been measured on a GPU yet (the target is 5% of a
captured step's measured peak); where it misses, the summary's list of the
largest tensors alive at the peak shows which values it counted.
"""

from __future__ import annotations

import json
import operator
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from fxshard.passes.markers import nbytes, value_nbytes
from fxshard.runtime.units import UNIT_GATHER_WAIT, UNIT_REDUCE_WAIT, UNIT_REPLICAS_WAIT

_WAIT_TENSOR = torch.ops._c10d_functional.wait_tensor.default
_ALLOCATED_BY_START = (UNIT_GATHER_WAIT, UNIT_REDUCE_WAIT, UNIT_REPLICAS_WAIT)  # args[0] is the start, or leads to it


def _start(node: fx.Node) -> fx.Node:
    """The start of the collective whose output the wait ``node`` returns: an
    HSDP average across replicas runs in place on its reduce-scatter's output."""
    start = node.args[0]
    return start.args[0] if node.target is UNIT_REPLICAS_WAIT else start


@dataclass(frozen=True)
class GraphPeak:
    inputs: int  # bytes of graph inputs alive at the peak
    intermediates: int  # bytes of allocated tensors alive at the peak
    at: str  # the node where it peaks
    largest: tuple[tuple[str, int], ...] = ()  # the largest tensors alive at the peak: (node, bytes)

    @property
    def total(self) -> int:
        return self.inputs + self.intermediates

    def format(self) -> str:
        mib = lambda b: f"{b / 2**20:.2f}"
        largest = ", ".join(f"{name} {mib(b)}" for name, b in self.largest)
        return (f"predicted peak: {mib(self.total)} MiB = inputs {mib(self.inputs)} + intermediates "
                f"{mib(self.intermediates)} (at {self.at}); largest alive, MiB: {largest or '-'}\n")  # fmt: skip


@dataclass(frozen=True)
class Liveness:
    """Where each node sits, whose memory it is, and when that memory is last read."""

    pos: dict[fx.Node, int]
    base: dict[fx.Node, fx.Node]  # node -> the node that allocated its memory (itself, for most)
    read: dict[fx.Node, int]  # node -> the last position its value is read, through views and fusion
    fused: frozenset[fx.Node]  # pointwise nodes Inductor computes inside their users (not materialized)


def aliases_input(node: fx.Node) -> bool:
    """Whether ``node``'s output is the memory of its first argument (a view)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.target is _WAIT_TENSOR:
        return True
    target = node.target
    return isinstance(target, torch._ops.OpOverload) and any(r.alias_info is not None for r in target._schema.returns)


def _has_tag(node: fx.Node, *tags: torch.Tag) -> bool:
    return isinstance(node.target, torch._ops.OpOverload) and any(t in node.target.tags for t in tags)


def _is_fused(node: fx.Node) -> bool:
    if not _has_tag(node, torch.Tag.pointwise):
        return False
    users, seen = list(node.users), set()
    while users:
        u = users.pop()
        if u in seen:
            continue
        seen.add(u)
        if aliases_input(u):
            users.extend(u.users)
        elif u.op == "output" or not _has_tag(u, torch.Tag.pointwise, torch.Tag.reduction):
            return False
    return True


def liveness(graph: fx.Graph) -> Liveness:
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    base: dict[fx.Node, fx.Node] = {}
    for n in nodes:
        base[n] = base[n.args[0]] if aliases_input(n) else n
    fused = frozenset(n for n in nodes if _is_fused(n))
    read: dict[fx.Node, int] = {}
    for n in reversed(nodes):
        # A user that computes nothing of its own (a view, a getitem, a fused
        # node) reads its input wherever its own value is read.
        passes = lambda u: u in fused or base[u] is not u or u.target is operator.getitem
        read[n] = max([pos[n], *(read[u] if passes(u) else pos[u] for u in n.users)])
    return Liveness(pos, base, read, fused)


def _blocks(graph: fx.Graph, live: Liveness, free_inputs: bool) -> list[tuple[int, int, int, str, bool]]:
    """Every allocation: (first position, last position, bytes, node, is an input)."""
    end = len(live.pos) - 1
    blocks = []
    for n, p in live.pos.items():
        if n.op == "placeholder":
            held = not free_inputs or n.name.startswith("primals")
            blocks.append((0, end if held else live.read[n], nbytes(n), n.name, True))
        elif n.op not in ("call_function", "call_module", "call_method") or n.target is operator.getitem:
            continue  # a getitem's memory is its tuple's element
        elif live.base[n] is not n or n in live.fused:  # a view, or computed inside its users
            continue
        elif isinstance(n.meta.get("val"), (list, tuple)):
            for i, v in enumerate(n.meta["val"]):
                items = [u for u in n.users if u.target is operator.getitem and u.args[1] == i]
                blocks.append(
                    (p, max((live.read[u] for u in items), default=p), value_nbytes(v), f"{n.name}[{i}]", False)
                )
        else:
            start = live.pos[_start(n)] if n.target in _ALLOCATED_BY_START else p
            blocks.append((start, live.read[n], nbytes(n), n.name, False))
        if n.target is torch.ops.higher_order.invoke_subgraph:
            body = getattr(graph.owning_module, n.args[0].target, None) if graph.owning_module is not None else None
            if isinstance(body, fx.GraphModule):
                extra = graph_peak(body.graph).intermediates - nbytes(n)
                blocks.append((p, p, max(extra, 0), f"{n.name} (body)", False))
    return blocks


def graph_peak(graph: fx.Graph, *, free_inputs: bool = False) -> GraphPeak:
    """Liveness estimate (see the Note), at the example sizes of a dynamic
    graph. ``free_inputs``: the graph is a backward, which frees its inputs
    but the forward's own after their last read."""
    live = liveness(graph)
    blocks = _blocks(graph, live, free_inputs)
    allocs: dict[int, int] = {}
    frees: dict[int, int] = {}
    for start, last, size, _, _ in blocks:
        allocs[start] = allocs.get(start, 0) + size
        frees[last] = frees.get(last, 0) + size
    total = peak = 0
    at = 0
    for p in range(len(live.pos)):
        total += allocs.get(p, 0)
        if total > peak:
            peak, at = total, p
        total -= frees.get(p, 0)
    alive = [b for b in blocks if b[0] <= at <= b[1] and b[2]]
    inputs = sum(b[2] for b in alive if b[4])
    largest = tuple((b[3], b[2]) for b in sorted(alive, key=lambda b: (-b[2], b[3]))[:4])
    names = [n.name for n in live.pos]
    return GraphPeak(inputs, peak - inputs, names[at] if peak else "-", largest)


def step_peak(forward: GraphPeak, backward: GraphPeak | None, held_outside: int = 0) -> int:
    """A training step's predicted peak, in bytes (see the Note): the larger
    of the forward's and the backward's (None: not compiled yet), plus
    ``held_outside``, what the caller holds through the step that no graph
    counts (optimizer states, gradients kept from an earlier step)."""
    return max(forward.total, backward.total if backward is not None else 0) + held_outside


def step_transient(record: Any) -> int | None:
    """What a training step of one captured graph (a ``GraphRecord``) adds
    to the memory its caller holds, in bytes: the larger of the forward's
    intermediates and the backward's peak less the forward inputs it holds
    (parameter shards and the user's inputs, which the caller holds anyway).
    None when no estimate exists for the graph."""
    forward = record.peaks.get("forward") or record.peaks.get("inference")
    if forward is None:
        return None
    backward = record.peaks.get("backward")
    if backward is None or record.backward_held is None:
        return forward.intermediates
    return max(forward.intermediates, backward.total - record.backward_held)


def held_inputs(graph: fx.Graph) -> int:
    """Bytes of a backward's inputs that the caller holds (see the Note)."""
    return sum(nbytes(n) for n in graph.nodes if n.op == "placeholder" and n.name.startswith("primals"))


# [Note: estimates of cached graphs]
# When torch loads a compiled graph from its compile cache (AOTAutograd's),
# fxshard's passes do not run, so there is nothing to estimate from. Each
# estimate is therefore also written to a small JSON file in torch's cache
# folder, named by what decides the compiled graph (fxshard's cache key,
# the captured graph's code, the input shapes), and read back on a hit.


def save_estimates(path: str, peaks: dict[str, GraphPeak], backward_held: int | None) -> None:
    data = {"peaks": {k: [p.inputs, p.intermediates, p.at, p.largest] for k, p in peaks.items()},
            "backward_held": backward_held}  # fmt: skip
    tmp = f"{path}.{os.getpid()}.tmp"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)  # a reader never sees half a file


def load_estimates(path: str) -> tuple[dict[str, GraphPeak], int | None] | None:
    try:
        with open(path) as f:
            data = json.load(f)
        peaks = {k: GraphPeak(int(a), int(b), str(at), tuple((str(n), int(size)) for n, size in largest))
                 for k, (a, b, at, largest) in data["peaks"].items()}  # fmt: skip
        held = data["backward_held"]
        return peaks, None if held is None else int(held)
    except (OSError, ValueError, KeyError, TypeError):
        return None
