"""AOTAutograd and FX tracing: the backend that traces the joint graph and
its partitioner, ``make_fx`` and the fake mode of a trace, sizes that may be
symbolic, and ``invoke_subgraph`` (the higher-order op of a body traced once
and called many times)."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

__all__ = [
    "aot_autograd",
    "detect_fake_mode",
    "invoke_subgraph_op",
    "is_higher_order_op",
    "make_boxed_func",
    "make_fx",
    "min_cut_rematerialization_partition",
    "size_hint",
    "subgraph_schemas_cached",
]


def invoke_subgraph_op() -> Any:
    """torch's ``invoke_subgraph`` higher-order op (a call of a subgraph that
    AOTAutograd and Inductor compile once per body), or None without it."""
    return getattr(torch.ops.higher_order, "invoke_subgraph", None)


# Schemas of invoke_subgraph calls, per body graph (see below).
_SUBGRAPH_SCHEMAS: weakref.WeakKeyDictionary[torch.fx.GraphModule, dict] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def subgraph_schemas_cached(op: Any = None) -> Iterator[None]:
    """Before torch 2.12 (no ``get_functionalize_schema_entry`` on the
    invoke_subgraph cache), every call of ``invoke_subgraph`` traces its body
    again to build the op's schema, once under functionalization and once
    under autograd, so AOTAutograd's joint trace of outlined layers took
    longer than that of the same layers inline, the cost outlining exists to
    save. The schema depends on the body graph and the operands' types only,
    so inside this scope (fxshard's compiles) it is computed once per body
    graph and operand layout; outside it torch's own ``gen_schema`` runs.
    Later torch caches it itself; this does nothing there. ``op``: the
    higher-order op (tests pass their own)."""
    op = invoke_subgraph_op() if op is None else op
    hop = type(op)
    if op is None or _torch_caches_subgraph_schemas() or getattr(hop.gen_schema, "_fxshard_cached", False):
        yield  # nothing to cache, or an enclosing scope caches already
        return
    own = "gen_schema" in hop.__dict__
    uncached = hop.gen_schema

    def gen_schema(self: Any, subgraph: Any, identifier: Any, *operands: Any) -> Any:
        keys = [_operand_key(o) for o in operands]
        if not isinstance(subgraph, torch.fx.GraphModule) or None in keys:
            return uncached(self, subgraph, identifier, *operands)
        key = (identifier, tuple(keys))
        schemas = _SUBGRAPH_SCHEMAS.setdefault(subgraph, {})
        if key not in schemas:
            schemas[key] = uncached(self, subgraph, identifier, *operands)
        return schemas[key]

    gen_schema._fxshard_cached = True
    hop.gen_schema = gen_schema
    try:
        yield
    finally:
        if own:
            hop.gen_schema = uncached
        else:
            del hop.gen_schema


def _torch_caches_subgraph_schemas() -> bool:
    from torch._guards import InvokeSubgraphCache

    return hasattr(InvokeSubgraphCache, "get_functionalize_schema_entry")


def _operand_key(value: Any) -> Any:
    """What a schema may depend on, of one operand; None where that is not
    plain data (symbolic sizes: no cache)."""
    if isinstance(value, torch.Tensor):
        sizes = (*value.shape, *value.stride())
        if not all(type(n) is int for n in sizes):
            return None
        return ("tensor", sizes, value.dtype, str(value.device), value.requires_grad)
    if isinstance(value, (int, float, bool)) and not isinstance(value, torch.SymInt):
        return (type(value).__name__, value)
    return None


def is_higher_order_op(target: Any) -> bool:
    return isinstance(target, torch._ops.HigherOrderOperator)


def size_hint(value: Any) -> int:
    """An int for a size that may be symbolic (dynamic shapes): its example
    value, read without adding a guard (``int()`` on a SymInt would guard
    and so cause recompiles). A size that depends on data (an unbacked
    symbol: the tokens an expert-parallel all-to-all receives) has no example
    value; each such symbol counts as Inductor's ``unbacked_symint_fallback``,
    as torch's ``optimization_hint`` counts it, on every torch (2.11's
    ``hint_int`` raises instead): the estimate is a guess, the same on every rank."""
    if isinstance(value, int):
        return value
    from torch.fx.experimental import symbolic_shapes

    hint = getattr(symbolic_shapes, "optimization_hint", None) or getattr(symbolic_shapes, "hint_int", None)
    try:
        if hint is None:  # pragma: no cover - neither name in this torch
            return int(value.node.hint)
        return int(hint(value))
    except symbolic_shapes.GuardOnDataDependentSymNode:
        return _unbacked_size_hint(value)


def _unbacked_size_hint(value: torch.SymInt) -> int:
    """``size_hint`` of a size with unbacked symbols: backed symbols at their
    example values, unbacked ones at Inductor's fallback."""
    from torch._inductor import config

    env, expr = value.node.shape_env, value.node.expr
    expr = env.replace(expr)
    values = env.backed_var_to_val if hasattr(env, "backed_var_to_val") else env.var_to_val  # renamed in 2.12
    subs = {s: values.get(s, config.unbacked_symint_fallback) for s in expr.free_symbols}
    return int(expr.xreplace(subs))
