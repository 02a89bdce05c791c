"""Merge repeated reads of one parameter in a captured graph."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.fx as fx

from fxshard.passes.markers import is_seq_gather, is_weight_read


def dedupe_unshard_pass(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> fx.GraphModule:
    """Give each parameter one unshard per captured graph.

    Matches: ``fxshard::unshard`` (or ``fxshard::replicate``, ``fxshard::seq_gather``) nodes with the same
    arguments, as produced by tied weights (an embedding reused as the output
    projection) or by reading one parameter twice (a parent reading a child's
    weight directly). Rewrites every later read to use the first; autograd then
    sums the gradients of all uses before a single reduce. Does nothing when
    each parameter is read once.
    """
    first: dict[tuple, fx.Node] = {}
    duplicates: list[tuple[fx.Node, fx.Node]] = []
    for node in gm.graph.nodes:
        if is_weight_read(node) or is_seq_gather(node):
            # The arguments after the shard (or anchor) name the parameter
            # (tied uses share one name). The shard nodes themselves may differ.
            key = (node.target, *node.args[1:], *sorted(node.kwargs.items()))
            if key in first:
                duplicates.append((node, first[key]))
            else:
                first[key] = node
    if not duplicates:
        return gm
    for node, keep in duplicates:
        node.replace_all_uses_with(keep)
        shard = node.args[0]
        gm.graph.erase_node(node)
        # Erase only what this pass made dead. Never run whole-graph dead-code
        # elimination on a captured graph: it holds side-effecting calls with
        # no users (dynamo inlines vmap's ``_vmap_decrement_nesting()``, say).
        if isinstance(shard, fx.Node) and not shard.users and shard.op == "call_method" and shard.target == "to_local":
            gm.graph.erase_node(shard)
    gm.graph.lint()
    return gm
