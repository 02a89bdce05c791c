"""Golden graphs: the rewritten forward and backward graphs of small models, as text.

These pin what the passes produce today, node by node, so that a refactor
that should not change the graphs can show it does not. A change that is
meant to change them regenerates the files and shows the diff in review:

    FXSHARD_REGEN_GOLDEN=1 python -m pytest tests/test_golden_graphs.py

The text lists each parameter's plan and the units' members; then, per
captured graph, its inputs and fxshard's markers as captured (stage 1), and
its forward and backward as rewritten (stage 3): one line per node, with its
name, op target, arguments (nodes by name) and value's dtype and shape. It
leaves out what does not describe the graph: source lines and the model's
own ops at stage 1 (so editing model code changes little), object
addresses, and values that depend on what the process built before (the
plan table's and units' ids, process group names), which are replaced by
placeholders. Node names and decompositions follow torch's tracing, so a
torch upgrade may need a regeneration."""

from __future__ import annotations

import difflib
import functools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fxshard
from tests.helpers import models, runtime

GOLDEN = Path(__file__).parent / "golden"
REGEN = os.environ.get("FXSHARD_REGEN_GOLDEN") == "1"


def _no_shard_and_freeze(model: nn.Module) -> None:
    fxshard.no_shard(model.layers[0].mlp)
    fxshard.no_shard(model.norm.weight)
    for name, param in model.named_parameters():
        param.requires_grad_(not name.startswith("layers.1.attn."))


@dataclass(frozen=True)
class Case:
    """One golden file: a model compiled under the 4-rank fake group, then
    one forward and backward per entry of ``syncs`` (gradient sync on or off)."""

    options: dict = field(default_factory=dict)
    model: Callable[[], nn.Module] = models.TinyLlama
    prepare: Callable[[nn.Module], None] | None = None  # before compile: marks, freezing
    mesh: tuple[int, int] | None = None  # a (replicate, shard) mesh for HSDP; None: 1-D over the 4 ranks
    syncs: tuple[bool, ...] = (True,)


# One compile each; a graph break or a call in another phase adds graphs. The keys name the golden files.
CASES = {
    "tiny_llama_defaults": Case(),
    "tiny_llama_keep_full_weights": Case({"reshard_after_forward": False}),
    "tiny_llama_bf16": Case({"mp_policy": fxshard.MixedPrecision(torch.bfloat16, torch.float32)}),
    "tiny_llama_flat": Case({"compile_blocks_once": False}),
    "tiny_llama_small_units_prefetch2": Case({"unit_mb": 0.003, "prefetch": 2}),
    # ZeRO-1: the graphs read the full copies in place (fxshard::kept) and
    # reduce by units in the backward; the gather after each optimizer step
    # runs eagerly, outside the graphs; tests/test_parity.py (ws2-zero1) checks values.
    "tiny_llama_zero1": Case({"zero_stage": 1}),
    # HSDP: sharded over the inner 2 ranks of a 2 x 2 mesh; each unit's
    # reduce is averaged across the replicas inside the backward.
    "tiny_llama_hsdp_2x2": Case(mesh=(2, 2)),
    # Replicated parameters: marked (a module and a parameter), and frozen
    # ones (shard_frozen=False), read without a gather.
    "tiny_llama_no_shard_frozen": Case(prepare=_no_shard_and_freeze),
    # Sharded lookups (sharded_embeddings=True, the default) need a table read
    # only through F.embedding: TinyLlama's is tied to the output projection,
    # so the cases above gather it.
    "tiny_llama_untied_sharded_lookups": Case(model=functools.partial(models.TinyLlama, tie=False)),
    # Accumulation (see [Note: accumulation without sync]): a call without
    # sync compiles the ACCUMULATE graph (graph 0), the next call with sync
    # the FLUSH graph (graph 1). A SYNC call's graph is tiny_llama_defaults's.
    "tiny_llama_accumulate_then_flush": Case(syncs=(False, True)),
    # Sequenced reads: fxshard::seq_gather and seq_grad in the graphs on
    # either side of the break; the sequencer's collectives run outside them.
    "tiny_llama_graph_break": Case(model=models.TinyLlamaGraphBreak),
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

    def graph(self, gm: fx.GraphModule, title: str, keep: Callable[[fx.Node], bool] | None = None) -> list[str]:
        """``keep``: the nodes to list (default all; a filtered graph lists no return)."""
        lines, bodies = [f"## {title}"], {}
        for node in gm.graph.nodes:
            if keep is not None and not keep(node):
                continue
            val = node.meta.get("val", node.meta.get("example_value"))  # the latter in captured graphs
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


def _is_input_or_marker(node: fx.Node) -> bool:
    """A captured graph's input, or one of fxshard's ops (see [Note: unshard
    markers]); the rest of a captured graph is the model's code as dynamo
    traced it, named after its source's variables."""
    return node.op == "placeholder" or getattr(node.target, "namespace", None) == "fxshard"


def _value(val: object) -> str:
    if isinstance(val, torch.Tensor):
        dtype = str(val.dtype).removeprefix("torch.")
        return f"{dtype}{list(val.shape)}"
    if isinstance(val, (list, tuple)):
        return "(" + ", ".join(_value(v) for v in val) + ")"
    return type(val).__name__


def _placeholders(plan: fxshard.ShardPlan) -> dict[object, str]:
    """Run-dependent values in graphs: the plan table's and the units' ids
    (hashes of content that names process groups), and the process groups'
    names, which count the groups the process made before."""
    names: dict[object, str] = {runtime.state(plan).table.id: "<plan>"}
    if plan.units is not None and plan.units.id is not None:
        names[plan.units.id] = "<units>"
    names[dist.group.WORLD.group_name] = "<world_group>"
    for dim, dim_name in enumerate(plan.mesh.mesh_dim_names or ("shard",)):
        names[plan.mesh.get_group(dim).group_name] = f"<{dim_name}_group>"
    for p in plan.params:  # the reduce communicator beside the shard group
        names.setdefault(p.reduce_group_name, "<reduce_group>")
    return names


def render(model: torch.nn.Module) -> str:
    plan = model.fxshard_plan
    names = _placeholders(plan)
    # Each parameter's plan by the index markers name it by (placement,
    # reduce, lifetime: what no graph shows for ZeRO-1's copies or HSDP's
    # replicas), which parameters each unit index names, and what forward
    # keeps for backward. Then each graph at stage 1, captured with fxshard's
    # markers (see fxshard/passes/README.md), and at stage 3, rewritten.
    table = runtime.state(plan).table
    lines = ["## params", *(f"{i}: {p.describe()}; rank 0 holds {rows} rows"
                            for i, (p, rows) in enumerate(zip(table.params, table.local_rows)))]  # fmt: skip
    lines += ["", "## units", *(f"{u.index}: {', '.join(u.names)}" for u in plan.units.units), ""]
    fmt = _Formatter(names)
    for record in plan.graphs:
        lines += [f"## graph {record.index} saves full weights: {', '.join(record.saved_full_weights) or 'none'}", ""]
        lines += [*fmt.graph(record.captured, f"graph {record.index} captured: inputs and markers",
                             keep=_is_input_or_marker), ""]  # fmt: skip
        for phase in ("forward", "backward"):
            lines += [*fmt.graph(getattr(record, phase), f"graph {record.index} {phase}"), ""]
    text = "\n".join(lines)
    assert not _ADDRESS.search(text), _ADDRESS.search(text)
    leaked = [v for v in names if isinstance(v, int) and str(v) in text]
    assert not leaked, f"run-dependent ids in the text: {leaked}"
    return text


def compile_and_render(case: Case) -> str:
    torch.manual_seed(0)
    model = case.model()
    if case.prepare is not None:
        case.prepare(model)
    mesh = None
    if case.mesh is not None:
        mesh = init_device_mesh("cpu", case.mesh, mesh_dim_names=("replicate", "shard"))
    fxshard.compile(model, mesh, backend="aot_eager", **case.options)
    tokens = torch.arange(18).reshape(2, 9) * 5 % 37
    for sync in case.syncs:
        model.set_requires_gradient_sync(sync)
        model(tokens).sum().backward()
    return render(model)


@pytest.mark.parametrize("name", list(CASES))
def test_golden_graphs(fake_pg, name):
    text = compile_and_render(CASES[name])
    path = GOLDEN / f"{name}.txt"
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
