"""Tag the joint graph so the partitioner reshards after forward.

[Note: reshard by recompute]
AOTAutograd's partitioner decides which forward values the backward graph
reads. Left alone it saves the full, gathered weights (or views of them), so
nothing would be resharded. Tagging the chain from shard to full weight
``MUST_RECOMPUTE`` makes it save the shard (a graph input, free to keep) and
re-run the unshard in the backward graph: a second all-gather instead of a
saved full weight. Views and casts of the full weight are tagged too; left
untagged, the partitioner may save one of them instead (a transposed weight
is as large as the weight). ``MUST_SAVE`` keeps full weights for backward
(``reshard_after_forward=False``). ZeRO-1's reads of its kept copies are
always ``MUST_RECOMPUTE``: the backward then reads the copy, a graph input.

One exception to resharding: the unit the forward gathers last (typically
the final norm and the output projection) is kept. The backward reads it
first, right away, so a reshard would free it only to gather it again with
nothing to overlap the gather with, and peak memory there is the same
either way (FSDP2 does the same for its root module).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from fxshard.passes.markers import full_weight_views, is_kept, is_unshard, param_of


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes of a joint graph that depend on a tangent (the backward part)."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" and "tangents" in node.name:
            found.add(node)
        elif any(isinstance(a, fx.Node) and a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def tag_unshard_graph(
    graph: fx.Graph, policy: CheckpointPolicy, unit_of: Callable[[str], Collection[str]] | None = None
) -> int:
    """Tag every unshard, and its forward views, with ``policy``; return the
    count. With ``unit_of`` (a parameter's unit, as parameter names) and
    ``MUST_RECOMPUTE``, the unit of the forward's last unshard is kept."""
    in_backward = backward_nodes(graph)
    unshards = [n for n in graph.nodes if is_unshard(n) and n not in in_backward]
    keep: Collection[str] = ()
    if unit_of is not None and policy == CheckpointPolicy.MUST_RECOMPUTE and unshards and in_backward:
        keep = unit_of(param_of(unshards[-1]).fqn)
    for node in unshards:
        tag = CheckpointPolicy.MUST_SAVE if param_of(node).fqn in keep else policy
        for chain_node in full_weight_views(node, exclude=in_backward):
            chain_node.meta["recompute"] = tag
    # ZeRO-1's kept copies are inputs, free to save; a saved intermediate
    # would be one Inductor may reuse (see [Note: ZeRO-1] in fxshard/module/zero1.py).
    for node in [n for n in graph.nodes if is_kept(n) and n not in in_backward]:
        for chain_node in full_weight_views(node, exclude=in_backward):
            chain_node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    return len(unshards)


def tag_unshard_pass(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    policy: CheckpointPolicy,
    unit_of: Callable[[str], Collection[str]] | None = None,
) -> fx.GraphModule:
    """Matches every ``fxshard::unshard`` of a joint graph; sets recompute tags
    (see [Note: reshard by recompute]). Does nothing without unshards."""
    tag_unshard_graph(gm.graph, policy, unit_of)
    return gm
