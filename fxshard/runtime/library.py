"""Runtime ops that compiled graphs call on every step, defined with one kernel each.

[Note: runtime ops without custom_op's wrappers]
``torch.library.custom_op`` runs each call of an op through Python layers
before the op's own function: an autograd kernel that looks for inputs that
require grad, then a backend kernel that checks that no output aliases an
input. That is about fifteen Python calls per call of the op. Compiled graphs
call the unit ops (gather, its wait, reduce, its wait, and on HSDP the
replicas' pair) for every unit in forward and backward, and the accumulation
and replicated-gradient ops for every parameter, on every step: host time
that grows with the number of units and parameters, and that a host-bound
step pays in full.

``runtime_op`` defines such an op with ``torch.library.Library`` directly:
its function is the ``CompositeExplicitAutograd`` kernel, which the
dispatcher calls for every backend (two Python calls per op), and its fake
implementation serves tracing. The name, the schema (inferred as
``custom_op`` infers it) and the ``pt2_compliant_tag`` are custom_op's, so
graphs, golden dumps and cached compilations are unchanged. What is given
up is custom_op's autograd kernel: these ops have no gradient, run inside
compiled graphs or backward formulas, and are never differentiated. In a
backward that builds a graph (``create_graph=True``) torch's fallback would
record what their functions compute and only warn, so there the backward
formulas call them through ``ops._NoSecondOrder``, which raises on a
backward through them, as custom_op's kernel did. Ops
with a gradient formula (the markers, ``fxshard::embedding``, the
sequencer's reads) keep ``custom_op``: they run once per lookup or graph
break, not per unit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

_LIB = torch.library.Library("fxshard", "FRAGMENT")


class RuntimeOp:
    """An op defined by ``runtime_op``: calling it calls the op, and
    ``register_fake`` registers its fake implementation, as with custom_op."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.default = getattr(torch.ops.fxshard, name).default

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.default(*args, **kwargs)

    def register_fake(self, fn: Callable) -> Callable:
        torch.library.register_fake(f"fxshard::{self.name}", fn, lib=_LIB)
        return fn


def runtime_op(name: str) -> Callable[[Callable], RuntimeOp]:
    """Define ``fxshard::<name>`` with the decorated function as its kernel
    (see [Note: runtime ops without custom_op's wrappers])."""

    def define(fn: Callable) -> RuntimeOp:
        schema = torch.library.infer_schema(fn, mutates_args=())
        _LIB.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        return RuntimeOp(name)

    return define
