"""What a graph gathers and reduces, where, and at what cost: the summary
written to ``summary.txt`` in the debug dumps and kept on ``model.fxshard_plan``."""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from fxshard.passes.markers import (
    is_all_reduce_grad,
    is_reduce,
    is_replicate,
    is_seq_gather,
    is_seq_grad,
    is_unshard,
    nbytes,
    param_of,
)


@dataclass(frozen=True)
class CollectiveSite:
    """One unshard or reduce of one parameter in one graph.

    ``position`` is the marker's index among the graph's compute nodes. For an
    unshard, ``first_use``/``last_use`` are the first and last nodes reading the
    full parameter: after ``last_use`` it is released. For a reduce,
    ``ready_after`` is the node that completes the gradient.
    """

    # "unshard" or "reduce"; "replica" (a replicated read, nothing gathered) or
    # "allreduce" (its gradient); "seq_read" or "seq_grad" hand over to the sequencer
    kind: str
    param: str
    node: str
    position: int
    ready_after: str
    first_use: str
    last_use: str
    nbytes: int  # bytes of the full tensor that the collective assembles or reduces


@dataclass(frozen=True)
class GraphReport:
    phase: str  # "forward", "backward" or "inference"
    num_nodes: int
    sites: tuple[CollectiveSite, ...]

    def count(self, kind: str) -> int:
        return sum(s.kind == kind for s in self.sites)

    def nbytes(self, kind: str) -> int:
        return sum(s.nbytes for s in self.sites if s.kind == kind)

    def format(self) -> str:
        head = (
            f"[{self.phase}] {self.num_nodes} compute nodes; "
            f"{self.count('unshard')} parameters gathered ({self.nbytes('unshard') / 2**20:.2f} MiB), "
            f"{self.count('reduce')} reduce-scattered ({self.nbytes('reduce') / 2**20:.2f} MiB)"
        )
        if self.count("replica") or self.count("allreduce"):
            head += (f"; {self.count('replica')} replicated reads, {self.count('allreduce')} all-reduced "
                     f"({self.nbytes('allreduce') / 2**20:.2f} MiB)")  # fmt: skip
        if self.count("seq_read") or self.count("seq_grad"):
            head += f"; {self.count('seq_read')} sequenced reads, {self.count('seq_grad')} sequenced gradients"
        rows = [f"  {'kind':8} {'param':40} {'at':>5} {'MiB':>8}  placement"]
        for s in self.sites:
            if s.kind == "replica":
                where = f"replicated {s.node}: nothing gathered"
            elif s.kind == "unshard":
                where = f"gather {s.node}; first use {s.first_use}; released after {s.last_use}"
            elif s.kind.startswith("seq"):
                where = f"{s.node}: the sequencer gathers (or takes the gradient), in plan order"
            else:
                where = f"reduce {s.node}; after gradient {s.ready_after} is complete"
            rows.append(f"  {s.kind:8} {s.param:40} {s.position:>5} {s.nbytes / 2**20:>8.3f}  {where}")
        return "\n".join([head, *rows]) + "\n"


def graph_report(gm: fx.GraphModule, phase: str) -> GraphReport:
    """Analyse a graph that still has its marker ops (before lowering)."""
    order = [n for n in gm.graph.nodes if n.op == "call_function"]
    index = {n: i for i, n in enumerate(order)}
    sites = []
    for node in order:
        if is_unshard(node):
            users = sorted(node.users, key=lambda u: index.get(u, len(order)))
            first, last = (users[0].name, users[-1].name) if users else ("-", "-")
            sites.append(CollectiveSite("unshard", param_of(node).fqn, node.name, index[node],
                                        node.args[0].name, first, last, nbytes(node)))  # fmt: skip
        elif is_seq_gather(node) or is_seq_grad(node):
            kind = "seq_read" if is_seq_gather(node) else "seq_grad"
            sites.append(CollectiveSite(kind, param_of(node).fqn, node.name, index[node], "-", "-", "-", nbytes(node)))
        elif is_replicate(node):
            sites.append(CollectiveSite("replica", param_of(node).fqn, node.name, index[node],
                                        node.args[0].name, "-", "-", nbytes(node)))  # fmt: skip
        elif is_reduce(node) or is_all_reduce_grad(node):
            grad = node.args[0]
            sites.append(CollectiveSite("reduce" if is_reduce(node) else "allreduce", param_of(node).fqn, node.name, index[node],
                                        grad.name, "-", "-", nbytes(grad)))  # fmt: skip
    return GraphReport(phase, len(order), tuple(sites))
