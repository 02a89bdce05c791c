"""Embedding lookups that move tokens, not the table (see [Note: sharded lookups])."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch.fx as fx
import torch.nn.functional as F

from fxshard.passes.markers import example_value, is_unshard, param_of, phase_of, plan_index
from fxshard.passes.runner import Recorded
from fxshard.runtime.embedding import EMBEDDING
from fxshard.runtime.ops import SYNC

_EMBEDDING_SIGNATURE = inspect.signature(F.embedding)
_DEFAULTS = {"padding_idx": None, "max_norm": None, "scale_grad_by_freq": False, "sparse": False}


def _plain_lookup(user: fx.Node, weight: fx.Node) -> fx.Node | None:
    """The token ids of ``user`` if it is ``F.embedding(ids, weight)`` with
    default options (no padding row, renorm, frequency scaling or sparse grad)."""
    if user.op != "call_function" or user.target is not F.embedding:
        return None
    try:
        bound = _EMBEDDING_SIGNATURE.bind(*user.args, **user.kwargs)
    except TypeError:
        return None
    args = bound.arguments
    if args.get("weight") is not weight or args.get("input") is weight:
        return None
    if any(args.get(name, default) != default for name, default in _DEFAULTS.items()):
        return None
    return args["input"] if isinstance(args["input"], fx.Node) else None


def shard_embedding_pass(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Recorded:
    """Replace each embedding lookup that is its table's only reader by
    ``fxshard::embedding`` on the local shard. A table read any other way
    (tied to an output projection, say) keeps its gather. The record is the
    tables looked up sharded."""
    graph = gm.graph
    sharded: list[str] = []
    for node in list(graph.nodes):
        if not is_unshard(node) or not node.users:
            continue
        p = param_of(node)
        val = example_value(node)
        # Outside the SYNC phase the gradient is accumulated, not reduced: the
        # table is gathered (see [Note: accumulation without sync]).
        # A tensor-parallel table is looked up by TP's own masked lookup, on a DTensor.
        if p.world_size == 1 or p.tp is not None or val is None or val.dim() != 2 or phase_of(node) != SYNC:
            continue
        lookups = [(user, _plain_lookup(user, node)) for user in node.users]
        if any(ids is None for _, ids in lookups):
            continue
        for user, ids in lookups:
            with graph.inserting_before(user):
                new = graph.call_function(EMBEDDING, (ids, node.args[0], *plan_index(node)))
            new.meta = dict(user.meta)
            user.replace_all_uses_with(new)
            graph.erase_node(user)
        graph.erase_node(node)
        sharded.append(p.fqn)
    graph.lint()
    return Recorded(gm, tuple(sharded))
