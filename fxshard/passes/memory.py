"""Estimate a graph's peak memory from its liveness.

[Note: peak estimate]
``graph_peak`` counts graph inputs, plus every tensor a node allocates, held
from that node to its last use (a view holds its base). A collective's output
is held from its start, which allocates it, not its wait. Inductor fuses
pointwise ops, so the real peak of a compiled graph is usually lower; the
estimate counts what the ATen graph materializes. The debug dump's summary
and the benchmark's JSON report it.

Communication holds no memory of its own to plan: a gather's cast writes
into the gathered output, and the all-gather runs in place; a reduce's input
is a graph value (see [Note: units and flat shards]). An earlier design kept
the cast inputs in a preallocated arena at offsets planned from liveness; it
held up to two units' cast shards for the whole run (367 MiB per GPU on the
8B benchmark at 4 ranks) where FSDP2 holds none, and the in-place gather made
it unnecessary.
"""

from __future__ import annotations

from dataclasses import dataclass
import torch.fx as fx

from fxshard.passes.markers import nbytes
from fxshard.runtime.units import UNIT_GATHER_WAIT, UNIT_REDUCE_WAIT


@dataclass(frozen=True)
class GraphPeak:
    inputs: int  # bytes of graph inputs
    intermediates: int  # bytes of allocated tensors alive at the peak
    at: str  # the node where it peaks

    @property
    def total(self) -> int:
        return self.inputs + self.intermediates

    def format(self) -> str:
        mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
        return (f"predicted peak: {mib(self.total)} MiB = inputs {mib(self.inputs)} + intermediates "
                f"{mib(self.intermediates)} (at {self.at})\n")  # fmt: skip


def graph_peak(graph: fx.Graph) -> GraphPeak:
    """Liveness estimate (see the Note), at the example sizes of a dynamic graph."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    base = {}  # node -> the node whose allocation it aliases
    for n in nodes:
        is_view = getattr(n.target, "is_view", False) is True  # an aten overload that aliases its input
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
    return GraphPeak(inputs, peak, at)
