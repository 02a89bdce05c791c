"""Finding fxshard's marker ops and the tensors derived from them in a graph."""

from __future__ import annotations

import torch
import torch.fx as fx

from fxshard.runtime import compat, plans
from fxshard.runtime.embedding import EMBEDDING
from fxshard.runtime.ops import ALL_REDUCE_GRAD, KEPT, REDUCE_GRAD, REPLICATE, SYNC, UNSHARD
from fxshard.runtime.sequencer import SEQ_GATHER, SEQ_GRAD

# Dtype casts count as views here: they only change how the full weight is read.
_CASTS = frozenset({torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default})


def nodes_in_call_order(gm: fx.GraphModule) -> list[fx.Node]:
    """``gm``'s nodes, with a subgraph's nodes (the body of a checkpointed
    region, which dynamo captures as a higher-order op) where it is taken:
    the order in which a step reads parameters. AOTAutograd inlines those
    bodies, so the graphs the later passes see read them in this order too."""
    nodes = []
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(sub := getattr(gm, str(node.target), None), fx.GraphModule):
            nodes.extend(nodes_in_call_order(sub))
        else:
            nodes.append(node)
    return nodes


def is_unshard(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (UNSHARD, torch.ops.fxshard.unshard)


def is_replicate(node: fx.Node) -> bool:
    """A read of a replicated parameter that may get a gradient (see [Note:
    replicated parameters] in fxshard/plan.py)."""
    return node.op == "call_function" and node.target in (REPLICATE, torch.ops.fxshard.replicate)


def is_kept(node: fx.Node) -> bool:
    """A read of ZeRO-1's full copy (see [Note: ZeRO-1] in fxshard/module/zero1.py)."""
    return node.op == "call_function" and node.target in (KEPT, torch.ops.fxshard.kept)


def is_sharded_read(node: fx.Node) -> bool:
    """A read of a sharded parameter, whose gradient a unit reduces: an unshard, or ZeRO-1's kept copy."""
    return is_unshard(node) or is_kept(node)


def is_weight_read(node: fx.Node) -> bool:
    """A marker that reads one parameter whole: an unshard, a kept copy or a replicated read."""
    return is_unshard(node) or is_kept(node) or is_replicate(node)


def is_all_reduce_grad(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (ALL_REDUCE_GRAD, torch.ops.fxshard.all_reduce_grad)


def is_embedding(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (EMBEDDING, torch.ops.fxshard.embedding)


# The ops that name a parameter's plan, by the number of tensors before
# their (plan, index) (see [Note: markers name the plan]).
_NAMING = {
    **dict.fromkeys(("unshard", "replicate", "reduce_grad", "all_reduce_grad", "accumulate_grad",
                     "take_accumulated", "seq_gather"), 1),
    **dict.fromkeys(("embedding", "embedding_backward", "seq_grad", "kept"), 2),
}  # fmt: skip


def _tensors_before_plan(node: fx.Node) -> int | None:
    target = node.target
    if node.op != "call_function" or not isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return None
    packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
    namespace, _, name = packet._qualified_op_name.partition("::")
    return _NAMING.get(name) if namespace == "fxshard" else None


def plan_index(node: fx.Node) -> tuple[int, int]:
    """A marker's (plan, index): the parameter's name in graphs."""
    tensors = _tensors_before_plan(node)
    if tensors is None:
        raise ValueError(f"fxshard: {node.format_node()} names no parameter")
    return node.args[tensors], node.args[tensors + 1]


def param_of(node: fx.Node) -> plans.ParamPlan:
    """The plan of the parameter a marker reads or reduces."""
    return plans.param(*plan_index(node))


def named_param(node: fx.Node) -> str | None:
    """The name of the parameter a node's op names, if it is a marker."""
    return param_of(node).fqn if _tensors_before_plan(node) is not None else None


def phase_of(node: fx.Node) -> int:
    """The phase of a read (see [Note: accumulation without sync] in fxshard/runtime/ops.py)."""
    at = (_tensors_before_plan(node) or 1) + 2
    return node.args[at] if len(node.args) > at else node.kwargs.get("phase", SYNC)


def is_seq_gather(node: fx.Node) -> bool:
    """A sequenced read (see [Note: sequenced reads]): the runtime gathers."""
    return node.op == "call_function" and node.target in (SEQ_GATHER, torch.ops.fxshard.seq_gather)


def is_seq_grad(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (SEQ_GRAD, torch.ops.fxshard.seq_grad)


def is_reduce(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (REDUCE_GRAD, torch.ops.fxshard.reduce_grad)


def value_nbytes(val: object) -> int:
    """Bytes of a node's value: a tensor, or a list or tuple of them (0 for
    anything else). Symbolic sizes count at their example values, without
    adding guards."""
    if isinstance(val, torch.Tensor):
        return compat.size_hint(val.numel()) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(value_nbytes(v) for v in val)
    return 0


def example_value(node: object) -> object:
    """The value a captured graph's node stands for (dynamo's
    ``example_value``, or ``val``); None for a non-node argument."""
    return node.meta.get("example_value", node.meta.get("val")) if isinstance(node, fx.Node) else None


def nbytes(node: fx.Node) -> int:
    """Bytes of the tensor a node produces (0 when unknown)."""
    return value_nbytes(node.meta.get("val"))


def is_view_like(node: fx.Node) -> bool:
    """An op whose output is a view or a cast of its first argument alone."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return False
    if node.target in _CASTS:
        return True
    return node.target.is_view and sum(isinstance(a, fx.Node) for a in node.args) == 1


def full_weight_views(unshard_node: fx.Node, exclude: set[fx.Node]) -> list[fx.Node]:
    """The unshard output and every view or cast of it, outside ``exclude``."""
    found, frontier = [], [unshard_node]
    while frontier:
        node = frontier.pop()
        found.append(node)
        frontier.extend(u for u in node.users if is_view_like(u) and u not in exclude and u not in found)
    return found
