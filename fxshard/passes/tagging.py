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
(``reshard_after_forward=False``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from fxshard.passes.markers import full_weight_views, is_unshard


def backward_nodes(graph: fx.Graph) -> set[fx.Node]:
    """Nodes of a joint graph that depend on a tangent (the backward part)."""
    found: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder" and "tangents" in node.name:
            found.add(node)
        elif any(isinstance(a, fx.Node) and a in found for a in node.all_input_nodes):
            found.add(node)
    return found


def tag_unshard_graph(graph: fx.Graph, policy: CheckpointPolicy) -> int:
    """Tag every unshard, and its forward views, with ``policy``; return the count."""
    in_backward = backward_nodes(graph)
    tagged = 0
    for node in graph.nodes:
        if is_unshard(node):
            for chain_node in full_weight_views(node, exclude=in_backward):
                chain_node.meta["recompute"] = policy
            tagged += 1
    return tagged


def tag_unshard_pass(gm: fx.GraphModule, example_inputs: Sequence[Any], *, policy: CheckpointPolicy) -> fx.GraphModule:
    """Matches every ``fxshard::unshard`` of a joint graph; sets recompute tags
    (see [Note: reshard by recompute]). Does nothing without unshards."""
    tag_unshard_graph(gm.graph, policy)
    return gm
