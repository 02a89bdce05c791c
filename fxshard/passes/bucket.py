"""Lower the markers of parameters that belong to a unit: one collective per unit.

See [Note: units and flat shards] in ``runtime/units.py`` for the layout.
In a forward, backward or inference graph:

- The ``fxshard::unshard`` markers of one unit become one ``fxshard::unit_gather``
  (start) and one ``fxshard::unit_gather_wait``, placed before the unit's first
  marker. Each marker's uses then read a slice of the wait's output, viewed
  as the full parameter. A unit is gathered whole even where the graph reads
  only some of its members.
- In the unit a forward keeps for backward (``MUST_SAVE``; see [Note: reshard
  by recompute]; with ``reshard_after_forward=False``, every unit), the
  one-dimensional members (norm weights, biases), smallest first and up to
  1/16 of the unit in all, read a copy instead: a saved view of the final norm's weight
  (a few KiB) kept the whole gathered output projection (one of the largest
  weights) alive until the norm's gradient, which came after that unit's
  reduce input was built, at the backward's peak. Inductor keeps the copy
  while another view of the unit is saved (``remove_noop_ops``), which is
  the case that pins.
- The ``fxshard::reduce_grad`` markers of one reduce group of a unit (the
  whole unit, or one of its blocks) become one ``fxshard::unit_reduce`` and
  its wait, placed where the last of the group's gradients is complete.
  Each marker's uses read a slice of the wait's output, viewed as the local
  shard's gradient. On an HSDP mesh the wait is
  ``fxshard::unit_reduce_replicas``, which starts the average across
  replicas, and ``fxshard::unit_replicas_wait`` returns the gradients (see
  [Note: HSDP] in ``runtime/collectives.py``).

[Note: a reduce per block]
A unit joins consecutive blocks (layers compiled once) up to its limit
(``unit_mb``, by default at most an eighth of the model: see
``passes/units.py:unit_limit``), so that the host issues few gathers, the
costliest runtime op per call.
Its reduce does not have to wait for the whole unit: each block's
gradients are complete when that block's backward returns. Reduced as one,
every gradient of the unit stayed alive until the last block's, beside the
whole unit's reduce input in the reduce dtype (twice the compute dtype's
size), and that was the backward's peak: on OLMoE at 4 ranks, a unit of
three layers held a 624 MiB reduce input beside its three layers'
gradients. Reduced per block, a block's gradients and reduce input are
freed as the next block computes, as under FSDP2 with a unit per block,
and the reduce starts earlier, so more of it overlaps compute. A reduce
costs the host less than a gather, so this keeps a unit's one gather and
splits only its reduce (the gathered unit itself still spans its blocks).
Still, each reduce costs the host a collective call and its wait whatever
its size, and a small model's step is bound by the host: a reduce per
block of the 375M benchmark model (24 MiB blocks) made its step slower.
So a reduce covers consecutive blocks up to at least a quarter of
``unit_mb`` (of 256 MiB by default, whatever the unit's limit): a reduce
per block where blocks are that large (OLMoE's, 1B's), a few per unit
where they are small. Units without blocks (the rest of the
model, all of it where no layers are compiled once: torchtitan's MoE models)
reduce their parameters in first-use order in groups of the same size,
whose gradients also complete near one another: reduced as one, a unit of
torchtitan's Qwen3-MoE at 4 ranks held a 552 MiB reduce input at the
backward's peak. The user's ``units=`` reduce as one.

Markers of parameters in no unit (world size 1, or parameters the first graph
never read) are left for ``lower_collectives``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from fxshard.passes.lower import COPIED_META, LOWERED, fake_value
from fxshard.passes.markers import is_reduce, is_unshard, param_of
from fxshard.runtime import compat
from fxshard.runtime.units import (
    UNIT_GATHER,
    UNIT_GATHER_WAIT,
    UNIT_REDUCE,
    UNIT_REDUCE_REPLICAS,
    UNIT_REDUCE_WAIT,
    UNIT_REPLICAS_WAIT,
    Member,
    Unit,
    Units,
)

NBYTES = "fxshard_bytes"  # node.meta key: bytes a unit collective moves (its output, all ranks)
_aten = torch.ops.aten
_prims = torch.ops.prims


def _group(graph: fx.Graph, units: Units, match) -> dict[int, list[tuple[int, fx.Node]]]:
    found: dict[int, list[tuple[int, fx.Node]]] = {}
    for node in graph.nodes:
        if match(node):
            where = units.unit_of.get(param_of(node).fqn)
            if where is not None:
                found.setdefault(where[0], []).append((where[1], node))
    return found


class _Inserter:
    def __init__(self, graph: fx.Graph, fake_mode: Any, like: fx.Node) -> None:
        self.graph, self.fake_mode = graph, fake_mode
        self.meta = {k: like.meta[k] for k in COPIED_META if k in like.meta}

    def __call__(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        node = self.graph.call_function(target, args, kwargs)
        node.meta.update(self.meta)
        node.meta[LOWERED] = True
        node.meta["val"] = fake_value(target, node.args, node.kwargs, self.fake_mode)
        return node


def _copied_members(unit: Unit, found: list[tuple[int, fx.Node]], ws: int) -> set[int]:
    """Members of a unit the forward keeps for backward that read a copy: the
    one-dimensional ones, smallest first, up to 1/16 of the gathered unit in
    all (see the module's doc)."""
    if not any(node.meta.get("recompute") == CheckpointPolicy.MUST_SAVE for _, node in found):
        return set()
    copied, total = set(), 0
    vectors = {j for j, _ in found if len(unit.members[j].param.shape) == 1}
    for j in sorted(vectors, key=lambda j: unit.members[j].numel):
        total += unit.members[j].numel
        if 16 * total > ws * unit.numel:
            break
        copied.add(j)
    return copied


def _rank_major(
    new: _Inserter, members: Sequence[Member], grads: Sequence[fx.Node], ws: int, row: int, dtype: torch.dtype
) -> fx.Node:
    """The reduce-scatter input, built in the graph: each gradient in the
    reduce dtype, padded to ``ws * chunk`` rows, viewed ``(ws, slot)``, and
    the members concatenated along dim 1, so row ``r`` is rank ``r``'s slots,
    then zeros up to ``row`` elements (see ``Units.reduce_layout``).
    Inductor fuses the cast and pad into the concatenation's copies; where
    one member needs neither, the input is the gradient itself."""
    parts = []
    for m, g in zip(members, grads):
        if not g.meta["val"].is_contiguous():
            g = new(_aten.clone.default, g, memory_format=torch.contiguous_format)
        rows = new(_aten.view.default, g, [m.param.shape[0], m.row])
        if g.meta["val"].dtype != dtype:
            rows = new(_prims.convert_element_type.default, rows, dtype)
        pad = ws * m.chunk - m.param.shape[0]
        if pad:
            rows = new(_aten.constant_pad_nd.default, rows, [0, 0, 0, pad], 0.0)
        parts.append(new(_aten.view.default, rows, [ws, m.slot]))
    tail = row - sum(m.slot for m in members)
    if tail:
        device = grads[0].meta["val"].device
        parts.append(new(_aten.full.default, [ws, tail], 0.0, dtype=dtype, device=device))
    return parts[0] if len(parts) == 1 else new(_aten.cat.default, parts, 1)


def bucket_collectives_pass(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, units: Units | None
) -> fx.GraphModule:
    if units is None or not units.assigned:
        return gm
    graph = gm.graph
    fake_mode = compat.detect_fake_mode(example_inputs)
    order = {n: i for i, n in enumerate(graph.nodes)}
    ws = units.world_size

    for u, found in sorted(_group(graph, units, is_unshard).items()):
        unit = units.units[u]
        first = min((n for _, n in found), key=order.__getitem__)
        shards = list({n.args[0]: None for _, n in sorted(found, key=lambda f: order[f[1]])})
        with graph.inserting_before(first):
            new = _Inserter(graph, fake_mode, first)
            token = new(UNIT_GATHER, shards, units.id, u)
            full = new(UNIT_GATHER_WAIT, token, units.id, u)
            full.meta[NBYTES] = token.meta[NBYTES] = unit.gather_nbytes()
            copied = _copied_members(unit, found, ws)
            views: dict[int, fx.Node] = {}
            for j, _ in found:
                if j not in views:
                    m = unit.members[j]
                    start = ws * m.offset
                    views[j] = new(_aten.view.default, new(_aten.slice.Tensor, full, 0, start, start + m.numel),
                                   list(m.param.shape))  # fmt: skip
                    if j in copied:
                        views[j] = new(_aten.clone.default, views[j])  # saved without pinning the unit
        for j, node in found:  # only now: inserting before an erased node corrupts the graph
            node.replace_all_uses_with(views[j])
            graph.erase_node(node)

    for u, found in sorted(_group(graph, units, is_reduce).items()):
        unit = units.units[u]
        by_member: dict[int, list[fx.Node]] = {}
        for j, node in found:
            by_member.setdefault(j, []).append(node)
        if any(len(nodes) > 1 for nodes in by_member.values()):
            raise RuntimeError(f"fxshard: two reduces of one parameter in one graph (unit {u}); expected one")
        for group in unit.reduce_groups:  # see [Note: a reduce per block]
            members = [j for j in group if j in by_member]
            if members:
                _bucket_reduce(graph, units, u, members, by_member, order, fake_mode)
    graph.lint()
    return gm


def _bucket_reduce(
    graph: fx.Graph,
    units: Units,
    u: int,
    members: list[int],
    by_member: dict[int, list[fx.Node]],
    order: dict[fx.Node, int],
    fake_mode: Any,
) -> None:
    """One reduce of ``members`` of unit ``u``, whose ``fxshard::reduce_grad``
    markers are ``by_member``'s, placed at the last of them."""
    unit, ws = units.units[u], units.world_size
    last = max((by_member[j][0] for j in members), key=order.__getitem__)
    numel, dtype = units.reduce_layout(u, members)
    with graph.inserting_before(last):
        new = _Inserter(graph, fake_mode, last)
        grads = [by_member[j][0].args[0] for j in members]
        inp = _rank_major(new, [unit.members[j] for j in members], grads, ws, numel, dtype)
        token = new(UNIT_REDUCE, inp, units.id, u, members)
        if units.replicas is None:
            flat = new(UNIT_REDUCE_WAIT, token, inp, units.id, u, members)
        else:  # HSDP: then the average across replicas (see [Note: HSDP])
            averaging = new(UNIT_REDUCE_REPLICAS, token, inp, units.id, u, members)
            flat = new(UNIT_REPLICAS_WAIT, averaging, units.id, u, members)
        token.meta[NBYTES] = flat.meta[NBYTES] = ws * numel * dtype.itemsize
        start, views = 0, {}
        for j in members:
            m = unit.members[j]
            local_shape = [m.param.local_rows, *m.param.shape[1:]]
            views[j] = new(_aten.view.default, new(_aten.slice.Tensor, flat, 0, start, start + m.local_numel),
                           local_shape)  # fmt: skip
            start += m.slot
    for j in members:
        (node,) = by_member[j]
        node.replace_all_uses_with(views[j])
        graph.erase_node(node)
