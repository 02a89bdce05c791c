"""Golden graphs: TinyLlama's rewritten forward and backward, as text.

These pin what the passes produce today, node by node, so that a refactor
that should not change the graphs can show it does not. A change that is
meant to change them regenerates the files and shows the diff in review:

    FXSHARD_REGEN_GOLDEN=1 python -m pytest tests/test_golden_graphs.py

The text lists the units' members, then one line per node: its name, op target, arguments (nodes by
name) and value's dtype and shape. It leaves out what does not describe the
graph: source lines (so editing model code changes nothing), object
addresses, and names that depend on what the process built before (the
units' id, process group names), which are replaced by placeholders.
Node names and decompositions follow torch's tracing, so a torch upgrade
may need a regeneration.
"""

from __future__ import annotations

import difflib
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

import fxshard
from tests import models

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("FXSHARD_REGEN_GOLDEN") == "1"

# One compile each. The ids name the golden files.
OPTIONS = {
    "defaults": {},
    "keep_full_weights": {"reshard_after_forward": False},
    "bf16": {"mp_policy": fxshard.MixedPrecision(torch.bfloat16, torch.float32)},
    "flat": {"compile_blocks_once": False},
    "small_units_prefetch2": {"unit_mb": 0.003, "prefetch": 2},
}

_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.memory_format, torch.layout)


def _target(node: fx.Node) -> str:
    if node.op != "call_function":
        return node.op if node.op != "get_attr" else f"get_attr {node.target}"
    t = node.target
    if isinstance(t, (torch._ops.OpOverload, torch._ops.HigherOrderOperator)):
        return str(t)
    return fx.node._get_qualified_name(t)


class _Formatter:
    """Renders a graph; ``names`` maps run-dependent values to placeholders."""

    def __init__(self, names: dict[object, str]) -> None:
        self.names = names

    def arg(self, a: object) -> str:
        if isinstance(a, fx.Node):
            return a.name
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, dict):
            return "{" + ", ".join(f"{k!r}: {self.arg(v)}" for k, v in a.items()) + "}"
        if isinstance(a, slice):
            return f"slice({self.arg(a.start)}, {self.arg(a.stop)}, {self.arg(a.step)})"
        if isinstance(a, (int, str)) and not isinstance(a, bool) and a in self.names:
            return self.names[a]
        if isinstance(a, _PLAIN):
            return repr(a)
        return f"<{type(a).__name__}>"  # anything else would print an address

    def call_args(self, node: fx.Node) -> str:
        schema = getattr(node.target, "_schema", None)
        if node.target.__class__ is torch._ops.OpOverload and schema.name.startswith("fxshard::"):
            # fxshard's ops by argument name: they carry the sharding facts.
            names = [a.name for a in schema.arguments]
            parts = [f"{k}={self.arg(v)}" for k, v in zip(names, node.args)]
        else:
            parts = [self.arg(v) for v in node.args]
        parts += [f"{k}={self.arg(v)}" for k, v in node.kwargs.items()]
        return ", ".join(parts)

    def graph(self, gm: fx.GraphModule, title: str) -> list[str]:
        lines, bodies = [f"## {title}"], {}
        for node in gm.graph.nodes:
            val = node.meta.get("val")
            value = f"  # {_value(val)}" if val is not None else ""
            if node.op in ("placeholder", "get_attr"):
                lines.append(f"{node.name} = {_target(node)}{value}")
            elif node.op == "output":
                lines.append(f"return {self.arg(node.args[0])}")
            else:
                lines.append(f"{node.name} = {_target(node)}({self.call_args(node)}){value}")
            if node.op == "get_attr" and isinstance(getattr(gm, node.target), fx.GraphModule):
                bodies.setdefault(node.target, getattr(gm, node.target))
        for name, body in bodies.items():  # outlined blocks: compiled once, read by each call
            lines += ["", *self.graph(body, f"{title} / {name}")]
        return lines


def _value(val: object) -> str:
    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).removeprefix("torch.")
        return f"{dtype}{list(val.shape)}"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(_value(v) for v in val) + ")"
    return type(val).__name__


def render(model: torch.nn.Module) -> str:
    plan = model.fxshard_plan
    names: dict[object, str] = {plan.units.id: "<units>", dist.group.WORLD.group_name: "<group>"}
    names.update({p.reduce_group_name: "<reduce_group>" for p in plan.params})
    # Which parameters each unit index names, and what forward keeps for backward.
    lines = ["## units", *(f"{u.index}: {', '.join(u.names)}" for u in plan.units.units), ""]
    fmt = _Formatter(names)
    for record in plan.graphs:
        lines += [f"## graph {record.index} saves full weights: {', '.join(record.saved_full_weights) or 'none'}", ""]
        for phase in ("forward", "backward"):
            lines += [*fmt.graph(getattr(record, phase), f"graph {record.index} {phase}"), ""]
    text = "\n".join(lines)
    assert not _ADDRESS.search(text), _ADDRESS.search(text)
    return text


def compile_and_render(options: dict) -> str:
    torch.manual_seed(0)
    model = models.TinyLlama()
    fxshard.compile(model, backend="aot_eager", **options)
    tokens = torch.arange(18).reshape(2, 9) * 5 % 37
    model(tokens).sum().backward()
    return render(model)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_golden_graphs(fake_pg, name):
    text = compile_and_render(OPTIONS[name])
    path = GOLDEN / f"tiny_llama_{name}.txt"
    if REGEN:
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        return
    if not path.exists():
        pytest.fail(f"no golden file {path}; write it with FXSHARD_REGEN_GOLDEN=1")
    expected = path.read_text()
    if text != expected:
        diff = difflib.unified_diff(expected.splitlines(), text.splitlines(), str(path), "this run", lineterm="")
        pytest.fail(f"{name}: the rewritten graphs changed. If that is intended, regenerate with "
                    f"FXSHARD_REGEN_GOLDEN=1.\n" + "\n".join(diff), pytrace=False)  # fmt: skip
