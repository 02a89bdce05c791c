"""Readable debug dumps of graphs, one folder per compiled graph and rank.

Each graph file lists one node a line, ``name: dtype[shape] = op(args)``, with
the module path the node came from (and, for fxshard's markers, the
parameter they name; for the model's own collectives, TP's or EP's, their
process group) as a trailing comment, followed by the graph's Python code
(``print_readable``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

from fxshard.passes.lower import LOWERED
from fxshard.passes.markers import named_param


def module_path(node: fx.Node) -> str:
    """The innermost module a node came from, as a dotted path ('' if unknown)."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return ""
    path, _cls = list(stack.values())[-1]
    return dotted_path(str(path))


def dotted_path(path: str) -> str:
    """A module path as dynamo records it (``L['self'].layers[0]``), dotted
    (``layers.0``)."""
    path = re.sub(r"^L\['self'\]\.?", "", path)
    path = re.sub(r"\._(?:modules|parameters)\['([^']+)'\]", r".\1", path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = re.sub(r"\['([^']+)'\]", r".\1", path)
    return path.strip(".")


def describe_value(val: Any) -> str:
    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).replace("torch.", "")
        return f"{dtype}[{', '.join(str(s) for s in val.shape)}]"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(describe_value(v) for v in val) + ")"
    return type(val).__name__ if val is not None else "None"


def _target_name(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}"
    return getattr(target, "__name__", str(target))


def _model_collective(node: fx.Node) -> str | None:
    """For a functional collective that the model's own code issued (DTensor's
    for tensor parallelism, an all-to-all for expert parallelism), the name
    of its process group ('' for a wait); None for any other node. fxshard's
    collectives are ``fxshard.*`` ops, or these where lowering made them."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "_c10d_functional":
        return None
    if node.meta.get(LOWERED):
        return None
    names = [a for a in node.args if isinstance(a, str)]
    return names[-1] if target._opname != "wait_tensor" and names else ""


def format_graph(gm: fx.GraphModule) -> str:
    lines = []
    for node in gm.graph.nodes:
        val = describe_value(node.meta.get("val", node.meta.get("example_value")))
        args = ", ".join(str(a) for a in node.args)
        kwargs = "".join(f", {k}={v}" for k, v in node.kwargs.items())
        if node.op == "placeholder":
            text = f"{node.name}: {val} = input"
        elif node.op == "output":
            text = f"return {args}"
        else:
            text = f"{node.name}: {val} = {_target_name(node)}({args}{kwargs})"
        notes = [module_path(node)]
        if (param := named_param(node)) is not None:  # markers name it by (plan, index)
            notes.append(f"param {param}")
        if (group := _model_collective(node)) is not None:
            notes.append(f"the model's collective (TP/EP), not fxshard's: group {group}" if group else
                         "the wait of the model's collective, not fxshard's")  # fmt: skip
        if "recompute" in node.meta:
            notes.append(f"recompute={node.meta['recompute'].name}")
        note = "; ".join(n for n in notes if n)
        lines.append(f"{text}    # {note}" if note else text)
    return "\n".join(lines) + "\n"


class Dumper:
    """Writes the dumps of one compiled graph under ``root``."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def graph(self, name: str, gm: fx.GraphModule) -> None:
        path = self.root / f"{name}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        code = gm.print_readable(print_output=False)
        path.write_text(format_graph(gm) + "\n# ---- Python code ----\n" + code)

    def text(self, name: str, content: str) -> None:
        (self.root / name).write_text(content)
