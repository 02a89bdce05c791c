"""Lower the markers of parameters that belong to a unit: one collective per unit.

See [Note: units and flat shards] in ``runtime/units.py`` for the layout.
In a forward, backward or inference graph:

- The ``fxshard::unshard`` markers of one unit become one ``fxshard::unit_gather``
  (start) and one ``fxshard::unit_gather_wait``, placed before the unit's first
  marker. Each marker's uses then read a slice of the wait's output, viewed
  as the full parameter. A unit is gathered whole even where the graph reads
  only some of its members.
- The ``fxshard::reduce_grad`` markers of one unit become one
  ``fxshard::unit_reduce`` and its wait, placed where the last of the unit's
  gradients is complete. Each marker's uses read a slice of the wait's output,
  viewed as the local shard's gradient.

Markers of parameters in no unit (world size 1, or parameters the first graph
never read) are left for ``lower_collectives``. The arena offsets start as
zeros; ``plan_arena`` fills them in after scheduling.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx

from fxshard.passes.lower import COPIED_META, LOWERED, fake_value, op_arguments
from fxshard.passes.markers import is_reduce, is_unshard
from fxshard.runtime import compat
from fxshard.runtime.units import UNIT_GATHER, UNIT_GATHER_WAIT, UNIT_REDUCE, UNIT_REDUCE_WAIT, Units

NBYTES = "fxshard_bytes"  # node.meta key: bytes a unit collective moves (its output, all ranks)
_aten = torch.ops.aten


def _group(graph: fx.Graph, units: Units, match) -> dict[int, list[tuple[int, fx.Node]]]:
    found: dict[int, list[tuple[int, fx.Node]]] = {}
    for node in graph.nodes:
        if match(node):
            where = units.unit_of.get(op_arguments(node)["param"])
            if where is not None:
                found.setdefault(where[0], []).append((where[1], node))
    return found


class _Inserter:
    def __init__(self, graph: fx.Graph, fake_mode: Any, like: fx.Node) -> None:
        self.graph, self.fake_mode = graph, fake_mode
        self.meta = {k: like.meta[k] for k in COPIED_META if k in like.meta}

    def __call__(self, target: Any, *args: Any) -> fx.Node:
        node = self.graph.call_function(target, args)
        node.meta.update(self.meta)
        node.meta[LOWERED] = True
        node.meta["val"] = fake_value(target, node.args, node.kwargs, self.fake_mode)
        return node


def bucket_collectives_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, units: Units | None) -> fx.GraphModule:
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
        offsets = [0] * len(units.gather_buffers(u))
        with graph.inserting_before(first):
            new = _Inserter(graph, fake_mode, first)
            token = new(UNIT_GATHER, shards, units.id, u, offsets)
            full = new(UNIT_GATHER_WAIT, token, units.id, u, offsets)
            full.meta[NBYTES] = token.meta[NBYTES] = unit.gather_nbytes()
            views: dict[int, fx.Node] = {}
            for j, _ in found:
                if j not in views:
                    m = unit.members[j]
                    start = ws * m.offset
                    views[j] = new(_aten.view.default, new(_aten.slice.Tensor, full, 0, start, start + m.numel),
                                   list(m.info.shape))  # fmt: skip
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
        members = sorted(by_member)
        last = max((n for _, n in found), key=order.__getitem__)
        offsets = [0] * len(units.reduce_buffers(u, members))
        with graph.inserting_before(last):
            new = _Inserter(graph, fake_mode, last)
            grads = [by_member[j][0].args[0] for j in members]
            token = new(UNIT_REDUCE, grads, units.id, u, members, offsets)
            flat = new(UNIT_REDUCE_WAIT, token, units.id, u, members, offsets)
            token.meta[NBYTES] = flat.meta[NBYTES] = units.reduce_buffers(u, members)[0]
            start, views = 0, {}
            for j in members:
                m = unit.members[j]
                local_shape = [m.info.local_rows, *m.info.shape[1:]]
                views[j] = new(_aten.view.default, new(_aten.slice.Tensor, flat, 0, start, start + m.local_numel),
                               local_shape)  # fmt: skip
                start += m.slot
        for j in members:
            (node,) = by_member[j]
            node.replace_all_uses_with(views[j])
            graph.erase_node(node)
    graph.lint()
    return gm
