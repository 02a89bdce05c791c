"""A captured graph's collectives, one line each: what ranks compare before
the graph first runs (see [Note: ranks agree on each graph])."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from fxshard.passes.markers import (
    example_value,
    is_embedding,
    is_kept,
    is_replicate,
    is_unshard,
    nodes_in_call_order,
    param_of,
    phase_of,
)
from fxshard.runtime.plans import ParamPlan

# See [Note: accumulation without sync] in fxshard/runtime/ops.py.
_PHASES = {0: "", 1: " (accumulated: no collective)", 2: " (with the accumulated sum)"}


def _dtype(value: object) -> str:
    return str(value).replace("torch.", "") if value is not None else "as stored"


def _line(node: fx.Node) -> str | None:
    if is_unshard(node):
        p = param_of(node)
        val = example_value(node)
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else "?"
        reduced = isinstance(val, torch.Tensor) and val.requires_grad
        gradient = (
            f", gradient reduce-scattered in {_dtype(p.reduce_dtype)}{_replicas(p)}" if reduced else ", no gradient"
        )
        gradient += _PHASES[phase_of(node)] if reduced else ""
        return f"all-gather of {p.fqn!r} {shape} in {_dtype(p.dtype)}{gradient}"
    if is_kept(node):  # ZeRO-1: nothing gathered in the graph (see [Note: ZeRO-1] in fxshard/module/zero1.py)
        p = param_of(node)
        val = example_value(node)
        reduced = isinstance(val, torch.Tensor) and val.requires_grad
        gradient = f"gradient reduce-scattered in {_dtype(p.reduce_dtype)}{_replicas(p)}" if reduced else "no gradient"
        return f"ZeRO-1's kept copy of {p.fqn!r} in {_dtype(p.dtype)}, {gradient}{_PHASES[phase_of(node)] if reduced else ''}"
    if is_replicate(node):
        p = param_of(node)
        val = example_value(node)
        reduced = isinstance(val, torch.Tensor) and val.requires_grad
        gradient = f", gradient all-reduced in {_dtype(p.reduce_dtype)}{_replicas(p)}" if reduced else ", no gradient"
        gradient += _PHASES[phase_of(node)] if reduced else ""
        return f"replicated {p.fqn!r} in {_dtype(p.dtype)}{gradient}"
    if is_embedding(node):
        p = param_of(node)
        return f"sharded lookup in {p.fqn!r} (dim0 {p.dim0}) in {_dtype(p.dtype)}{_replicas(p)}"
    return None


def _replicas(p: ParamPlan) -> str:
    """HSDP: each reduce then averages across the replicas (see [Note: HSDP])."""
    return f", then averaged over {p.replicas} replicas" if p.replicas > 1 else ""


def _lines(gm: fx.GraphModule) -> list[str]:
    """Markers inside a subgraph (a checkpointed region) count where the
    subgraph is taken."""
    return [line for node in nodes_in_call_order(gm) if (line := _line(node)) is not None]


def collective_lines(gm: fx.GraphModule, units: Sequence[Sequence[str]] = ()) -> tuple[str, ...]:
    """The captured graph's collective markers in graph order, then the
    units that bucket them (each unit's parameters: ranks must agree on them too); () when the graph issues no collective itself
    (sequenced reads, or world size 1)."""
    lines = _lines(gm)
    lines.extend(f"unit {i}: {', '.join(names)}" for i, names in enumerate(units) if lines)
    return tuple(lines)
