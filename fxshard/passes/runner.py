"""One runner for every pass list: logs, times, dumps and can disable passes.

A pass is ``fn(gm, example_inputs) -> gm`` with its options bound when the
list is built (``functools.partial``); a pass that reports what it did
returns ``Recorded(gm, record)`` instead, and ``run_passes`` hands the records
back by pass name. The runner knows nothing about any one pass. ``FXSHARD_DISABLE_PASSES=name,name`` skips passes by name, for bisecting.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from fxshard.passes.dump import Dumper

log = logging.getLogger("fxshard")


@dataclass(frozen=True)
class Recorded:
    """A pass's graph and its record of what it did."""

    gm: fx.GraphModule
    record: Any


PassFn = Callable[[fx.GraphModule, Sequence[Any]], "fx.GraphModule | Recorded"]


@dataclass(frozen=True)
class GraphPass:
    name: str
    fn: PassFn
    edits_graph: bool = True  # False: it only sets node metadata (no code to regenerate)


def op_counts(gm: fx.GraphModule) -> Counter[str]:
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def _diff(before: Counter[str], after: Counter[str]) -> str:
    keys = sorted(set(before) | set(after))
    parts = [
        f"{k.split('.')[-2] if k.count('.') > 1 else k} {after[k] - before[k]:+d}"
        for k in keys
        if after[k] != before[k]
    ]
    return ", ".join(parts) or "no op-count change"


def run_passes(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    passes: Sequence[GraphPass],
    *,
    phase: str,
    dumper: Dumper | None,
    disabled: frozenset[str] = frozenset(),
) -> tuple[fx.GraphModule, dict[str, Any]]:
    """Apply ``passes`` in order to the ``phase`` graph (forward, backward...);
    return the graph and the records of the passes that returned one.
    Passes edit ``gm.graph``; its Python code is regenerated once, at the end
    (and before each dump), not after every pass: ``recompile`` generates
    and compiles the whole graph's code, a cost each extra call repeats."""
    records: dict[str, Any] = {}
    for index, graph_pass in enumerate(passes):
        if graph_pass.name in disabled:  # FXSHARD_DISABLE_PASSES, read by fxshard.compile
            log.warning("fxshard: pass %s disabled by FXSHARD_DISABLE_PASSES", graph_pass.name)
            continue
        if dumper:
            gm.recompile()
            dumper.graph(f"{phase}/{index:02d}_{graph_pass.name}.before", gm)
        counts = op_counts(gm)
        start = time.perf_counter()
        gm = graph_pass.fn(gm, example_inputs)
        if isinstance(gm, Recorded):
            gm, records[graph_pass.name] = gm.gm, gm.record
        elapsed_ms = (time.perf_counter() - start) * 1e3
        log.info("fxshard %s: %s took %.1f ms (%s)", phase, graph_pass.name, elapsed_ms, _diff(counts, op_counts(gm)))
        if dumper:
            gm.recompile()
            dumper.graph(f"{phase}/{index:02d}_{graph_pass.name}.after", gm)
    if any(p.edits_graph and p.name not in disabled for p in passes):
        gm.recompile()
    return gm, records
