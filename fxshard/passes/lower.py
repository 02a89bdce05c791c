"""Lower fxshard's marker ops to ``_c10d_functional`` collectives."""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from fxshard.passes.markers import (
    is_all_reduce_grad,
    is_kept,
    is_reduce,
    is_replicate,
    is_unshard,
    param_of,
    plan_index,
)
from fxshard.runtime import compat, plans
from fxshard.runtime.collectives import gather_full, reduce_replicated, reduce_to_shard

COPIED_META = ("nn_module_stack", "fwd_nn_module_stack", "stack_trace", "seq_nr")
LOWERED = "fxshard_lowered"  # node.meta key on every node lowering inserts
PARAM = "fxshard_param"  # node.meta key: the parameter whose marker a lowered node replaces
# node.meta key: an all-reduce that averages a reduced gradient over an HSDP
# mesh's replicas (see [Note: HSDP]); scheduling waits for it late.
REPLICAS = "fxshard_replicas"
_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default


@dataclass(frozen=True)
class Lowering:
    """Replace ``node`` by the graph of ``fn`` applied to its first argument."""

    node: fx.Node
    fn: functools.partial  # a collective of fxshard.runtime.collectives, its arguments bound by keyword


def plan_lowering(gm: fx.GraphModule) -> tuple[Lowering, ...]:
    plan = []
    for node in gm.graph.nodes:
        if is_unshard(node):
            p = param_of(node)
            fn = functools.partial(gather_full, dim0=p.dim0, world_size=p.world_size, group_name=p.group_name,
                                   dtype=p.dtype)  # fmt: skip
            plan.append(Lowering(node, fn))
        elif is_reduce(node):
            p = param_of(node)
            fn = functools.partial(
                reduce_to_shard, local_rows=plans.local_rows(*plan_index(node)), world_size=p.world_size,
                group_name=p.reduce_group_name, reduce_dtype=p.reduce_dtype, out_dtype=p.shard_dtype,
                replicas=p.replicas, replica_group_name=p.replica_group_name, presummed=p.presummed,
            )  # fmt: skip
            plan.append(Lowering(node, fn))
        elif is_replicate(node):  # a cast at most: world size 1 gathers nothing
            p = param_of(node)
            fn = functools.partial(gather_full, dim0=1, world_size=1, group_name=p.group_name, dtype=p.dtype)
            plan.append(Lowering(node, fn))
        elif is_all_reduce_grad(node):
            p = param_of(node)
            fn = functools.partial(
                reduce_replicated, world_size=p.world_size, group_name=p.reduce_group_name,
                reduce_dtype=p.reduce_dtype, out_dtype=p.shard_dtype, replicas=p.replicas,
                replica_group_name=p.replica_group_name,
            )  # fmt: skip
            plan.append(Lowering(node, fn))
    return tuple(plan)


def fake_value(target: Any, args: tuple, kwargs: dict, fake_mode: Any) -> Any:
    if fake_mode is None:
        return None
    unwrap = lambda n: n.meta.get("val") if isinstance(n, fx.Node) else n  # noqa: E731
    with fake_mode:
        return target(*fx.node.map_aggregate(args, unwrap), **fx.node.map_aggregate(kwargs, unwrap))


def _traced(lowering: Lowering, decompositions: dict | None, cache: dict) -> fx.GraphModule:
    """``lowering.fn`` traced to ATen on a meta input of the marker's input's
    layout. A model's layers repeat their shapes, so a graph's many lowerings
    trace a few distinct graphs (``make_fx`` dominated this pass)."""
    val, fn = lowering.node.args[0].meta["val"], lowering.fn
    layout = (*val.shape, *val.stride())
    key = (fn.func, fn.args, tuple(sorted(fn.keywords.items())), layout, val.dtype)
    static = all(type(d) is int for d in layout)  # a symbolic size hashes by no value
    if static and key in cache:
        return cache[key]
    meta_input = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device="meta")
    traced = compat.make_fx(fn, decomposition_table=decompositions)(meta_input)
    if static:
        cache[key] = traced
    return traced


def _inline(graph: fx.Graph, lowering: Lowering, fake_mode: Any, decompositions: dict | None, cache: dict) -> None:
    node = lowering.node
    source = node.args[0]
    traced = _traced(lowering, decompositions, cache)
    env: dict[fx.Node, fx.Node] = {}
    result = source
    with graph.inserting_before(node):
        for sub in traced.graph.nodes:
            if sub.op == "placeholder":
                env[sub] = source
            elif sub.op == "output":
                result = env[sub.args[0]]
            else:
                new = graph.node_copy(sub, lambda n: env[n])
                new.meta = {k: node.meta[k] for k in COPIED_META if k in node.meta}
                new.meta[LOWERED] = True  # what schedule_collectives may move
                new.meta[PARAM] = param_of(node).fqn  # names the buffer in the static buffer plan
                if new.target is _ALL_REDUCE and _on_replicas(new, param_of(node)):
                    new.meta[REPLICAS] = True
                new.meta["val"] = fake_value(new.target, new.args, new.kwargs, fake_mode)
                env[sub] = new
        if result is source and node.meta.get("val") is not None:
            # Nothing to gather or cast (world size 1, a replicated parameter
            # in its own dtype): the read would be the input itself. AOTAutograd
            # took the marker's output for a fresh tensor, so a saved one is a
            # donated buffer, which Inductor may overwrite in the backward: the
            # parameter became exp(parameter). A copy keeps it fresh.
            result = graph.call_function(torch.ops.aten.clone.default, (source,))
            result.meta = {k: node.meta[k] for k in COPIED_META if k in node.meta}
            result.meta.update({LOWERED: True, PARAM: param_of(node).fqn})
            result.meta["val"] = fake_value(result.target, result.args, result.kwargs, fake_mode)
    node.replace_all_uses_with(result)
    graph.erase_node(node)


def _read_kept(graph: fx.Graph, kept: list[fx.Node]) -> None:
    """ZeRO-1's reads read the kept copies, graph inputs, in place: they are
    kept across steps, and the joint graph's tags made the backward read them
    as saved inputs, never as saved intermediates that Inductor may reuse
    (see [Note: ZeRO-1] in fxshard/module/zero1.py). A graph output that is
    a read or a view of one (``return y, self.lin.weight.T``; a saved view
    the tags missed) gets a copy: AOTAutograd took it for a fresh tensor,
    which its user or Inductor may write."""
    aliases = set(kept)
    for node in graph.nodes:
        if node.op == "call_function" and node.args and node.args[0] in aliases and _is_view(node):
            aliases.add(node)
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    copies: dict[fx.Node, fx.Node] = {}

    def copy(arg: fx.Node) -> fx.Node:
        if arg not in aliases:
            return arg
        if arg not in copies:
            with graph.inserting_before(output):
                copies[arg] = graph.call_function(torch.ops.aten.clone.default, (arg,))
            copies[arg].meta = {k: arg.meta[k] for k in (*COPIED_META, "val") if k in arg.meta}
        return copies[arg]

    output.args = fx.node.map_arg(output.args, copy)
    for node in kept:
        node.replace_all_uses_with(node.args[1])
        graph.erase_node(node)


def _is_view(node: fx.Node) -> bool:
    """An op whose output may share its first argument's storage: a view, or an item of a view's list (split)."""
    target = node.target
    if target is operator.getitem:
        return True
    return isinstance(target, torch._ops.OpOverload) and target.is_view


def _on_replicas(node: fx.Node, p: plans.ParamPlan) -> bool:
    """Whether the all-reduce ``node`` runs across ``p``'s replicas."""
    return p.replicas > 1 and node.args[2] == p.replica_group_name


def lower_collectives_pass(
    gm: fx.GraphModule, example_inputs: Sequence[Any], *, decompositions: dict | None = None
) -> fx.GraphModule:
    """Replace each ``fxshard::unshard`` with its all-gather, each ``fxshard::kept``
    with the kept copy it reads, each
    ``fxshard::reduce_grad`` with its reduce-scatter, each ``fxshard::replicate``
    with its cast and each ``fxshard::all_reduce_grad`` with its all-reduce, in place.
    On an HSDP mesh a reduce adds its all-reduce across replicas, tagged
    ``REPLICAS`` (see [Note: HSDP]).

    The replacement is ``gather_full`` / ``reduce_to_shard`` traced to ATen
    and ``_c10d_functional`` ops (see [Note: one definition of gather and
    reduce]): cast, pad, collective, ``wait_tensor``, slice. Each collective's
    wait sits right before the collective's first use; scheduling them earlier
    or later is a later pass's job. ``decompositions`` is the table of the
    compiler that runs next (Inductor expects its decomposed op set, e.g. no
    ``aten._to_copy``). Does nothing on a graph without markers.
    """
    kept = [n for n in gm.graph.nodes if is_kept(n)]
    if kept:
        _read_kept(gm.graph, kept)
    plan = plan_lowering(gm)
    if not plan:
        if kept:
            gm.graph.lint()
        return gm
    fake_mode = compat.detect_fake_mode(example_inputs)
    cache: dict = {}
    for lowering in plan:
        _inline(gm.graph, lowering, fake_mode, decompositions, cache)
    gm.graph.lint()
    return gm
