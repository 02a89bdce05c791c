"""A captured graph's collectives, one line each: what ranks compare before
the graph first runs (see [Note: ranks agree on each graph])."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from fxshard.passes.lower import op_arguments
from fxshard.passes.markers import example_value, is_replicate, is_unshard
from fxshard.runtime.embedding import EMBEDDING

# See [Note: accumulation without sync] in fxshard/runtime/ops.py.
_PHASES = {0: "", 1: " (accumulated: no collective)", 2: " (with the accumulated sum)"}


def _dtype(value: object) -> str:
    return str(value).replace("torch.", "") if value is not None else "as stored"


def _line(node: fx.Node) -> str | None:
    if is_unshard(node):
        a = op_arguments(node)
        val = example_value(node)
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else "?"
        reduced = isinstance(val, torch.Tensor) and val.requires_grad
        gradient = f", gradient reduce-scattered in {_dtype(a['reduce_dtype'])}" if reduced else ", no gradient"
        gradient += _PHASES[a.get("phase", 0)] if reduced else ""
        return f"all-gather of {a['param']!r} {shape} in {_dtype(a['dtype'])}{gradient}"
    if is_replicate(node):
        a = op_arguments(node)
        val = example_value(node)
        reduced = isinstance(val, torch.Tensor) and val.requires_grad
        gradient = f", gradient all-reduced in {_dtype(a['reduce_dtype'])}" if reduced else ", no gradient"
        gradient += _PHASES[a.get("phase", 0)] if reduced else ""
        return f"replicated {a['param']!r} in {_dtype(a['dtype'])}{gradient}"
    if node.op == "call_function" and node.target is EMBEDDING:
        a = op_arguments(node)
        return f"sharded lookup in {a['param']!r} (dim0 {a['dim0']}) in {_dtype(a['dtype'])}"
    return None


def _lines(gm: fx.GraphModule) -> list[str]:
    """Markers inside a subgraph (a checkpointed region) count where the
    subgraph is taken."""
    lines = []
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(sub := getattr(gm, str(node.target), None), fx.GraphModule):
            lines.extend(_lines(sub))
        elif (line := _line(node)) is not None:
            lines.append(line)
    return lines


def collective_lines(gm: fx.GraphModule, units: Sequence[Sequence[str]] = ()) -> tuple[str, ...]:
    """The captured graph's collective markers in graph order, then the
    units that bucket them (each unit's parameters: ranks must agree on them too); () when the graph issues no collective itself
    (sequenced reads, or world size 1)."""
    lines = _lines(gm)
    lines.extend(f"unit {i}: {', '.join(names)}" for i, names in enumerate(units) if lines)
    return tuple(lines)
