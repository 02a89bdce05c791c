"""The dynamo backend that runs fxshard's passes, then the chosen compiler.

One captured graph goes through three stages (see passes/README.md):
1. captured graph: ``dedupe_unshard``, ``shard_embedding`` (lookups that
   move tokens, not the table; see [Note: sharded lookups]);
2. joint graph (inside AOTAutograd): ``tag_unshard``, then torch's min-cut
   partitioner splits it into forward and backward;
3. forward, backward and inference graphs: ``bucket_collectives`` (one
   collective per unit), ``lower_collectives`` (the rest, per parameter),
   ``schedule_collectives`` (prefetch, deferred reduce waits); then the
   peak-memory estimate (``passes/memory.py``), and Inductor
   (``compile_fx_inner``) or nothing (``aot_eager``).

The units themselves are formed once, from the first captured graph's order
of first use (``passes/units.py:form_units``, laid out by ``Units.form``),
before AOTAutograd traces it.

Inductor keeps its own AOTAutograd setup, joint passes and partitioner: fxshard
plugs in through ``compile_fx``'s ``inner_compile`` hook and a scoped
``joint_custom_pre_pass``, never by patching torch globally.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from fxshard.passes.bucket import bucket_collectives_pass
from fxshard.passes.buffers import BufferPlan, plan_buffers
from fxshard.passes.dedupe import dedupe_unshard_pass
from fxshard.passes.dump import Dumper
from fxshard.passes.embedding import shard_embedding_pass
from fxshard.passes.lower import lower_collectives_pass
from fxshard.passes.markers import (
    full_weight_views,
    is_seq_gather,
    is_sharded_read,
    nodes_in_call_order,
    param_of,
)
from fxshard.passes.memory import GraphPeak, graph_peak, held_inputs, load_estimates, save_estimates
from fxshard.passes.outline import (
    OutlineRecord,
    outline_blocks_pass,
    reroute_saved_inputs_pass,
    resolve_call_inputs_pass,
    tag_body_inputs_pass,
)
from fxshard.passes.report import GraphReport, graph_report
from fxshard.passes.runner import GraphPass, run_passes
from fxshard.passes.schedule import Schedule, schedule_collectives_pass
from fxshard.passes.signature import collective_lines
from fxshard.passes.tagging import tag_unshard_pass
from fxshard.passes.units import form_units
from fxshard.runtime import compat
from fxshard.runtime.rank_checks import GraphAgreement
from fxshard.runtime.units import Units

log = logging.getLogger("fxshard")

COMPILERS = ("inductor", "aot_eager")


@dataclass(frozen=True)
class BackendSpec:
    """Everything the passes need to know, decided by ``fxshard.compile``."""

    compiler: str  # one of COMPILERS
    # The backward reads parameters again rather than saved from the forward:
    # ZeRO-3 gathers again; ZeRO-1 reads its kept copies, graph inputs. False: ZeRO-2 saves the gathered values.
    recompute_reads: bool
    rank: int
    world_size: int
    group_name: str
    debug_dir: str | None
    unit_bytes: int | None = None  # the user's unit_mb, in bytes; None: the default (units.py:unit_limit)
    prefetch: int = 1  # units gathered ahead of the one computing; 0 waits in place
    # Embedding lookups read only the rank's rows (see [Note: sharded lookups]);
    # False gathers embedding tables like any weight.
    sharded_embeddings: bool = False
    outline_blocks: bool = False  # compile each repeated block once (see [Note: outlined blocks])
    reduces_in_flight: int = 1  # gradient reduce-scatters running at once (see [Note: prefetch by units])
    params: str = ""  # the parameters' placements, reduces and lifetimes, as formatted for the summary
    explicit_units: tuple[tuple[str, ...], ...] = ()  # the user's units= groups, by parameter name
    disabled_passes: frozenset[str] = frozenset()  # FXSHARD_DISABLE_PASSES: skipped (bisecting)
    inductor_config: tuple[tuple[str, Any], ...] = ()  # FXSHARD_INDUCTOR_CONFIG: more Inductor options


@dataclass
class GraphRecord:
    """What fxshard did to one captured graph; filled in as torch compiles it.

    The forward, backward and inference graphs are the rewritten ones, as
    handed to the compiler. They stay None for a graph that torch loaded from
    its compile cache (the passes did not run in this process) or, for the
    backward, until the first backward call compiles it.
    """

    index: int
    captured: fx.GraphModule | None = None
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    inference: fx.GraphModule | None = None
    reports: dict[str, GraphReport] = field(default_factory=dict)
    schedules: dict[str, Schedule] = field(default_factory=dict)
    peaks: dict[str, GraphPeak] = field(default_factory=dict)  # the liveness estimate per phase
    backward_held: int | None = None  # bytes of the backward's inputs its caller holds (memory.held_inputs)
    estimates_file: str | None = (
        None  # where the estimates outlive the process (see [Note: estimates of cached graphs])
    )
    buffer_plans: dict[str, BufferPlan] = field(default_factory=dict)  # the static buffer plan per phase
    params: str = ""  # the parameters' plan, as formatted for the summary
    units: str = ""  # the model's units, as formatted for the summary
    sharded_lookups: tuple[str, ...] = ()  # embedding tables looked up without a gather
    outline: OutlineRecord = field(default_factory=OutlineRecord)
    full_weights_in_forward: dict[str, str] = field(default_factory=dict)  # forward node -> parameter
    saved_full_weights: tuple[str, ...] | None = None  # parameters; known once the backward is compiled
    collectives: tuple[str, ...] = ()  # the signature ranks agree on (see [Note: ranks agree on each graph])
    graph_break_reason: str | None = None  # why reads are sequenced, where they are

    def summary(self) -> str:
        parts = [f"graph {self.index}"]
        if self.graph_break_reason:
            parts.append(f"sequenced reads: the forward has graph breaks. Dynamo said: {self.graph_break_reason}\n")
        if self.params:
            parts.append(self.params)
        if self.units:
            parts.append(self.units)
        if self.sharded_lookups:
            parts.append(f"sharded embedding lookups (tokens move, not the table): {', '.join(self.sharded_lookups)}\n")
        if self.outline.bodies or self.outline.inline:  # also why nothing was outlined
            parts.append(self.outline.format())
        for phase, report in self.reports.items():
            parts.append(report.format())
            if phase in self.schedules:
                parts.append(f"[{phase} schedule] " + self.schedules[phase].format())
            if phase in self.peaks:
                parts.append(f"[{phase} memory] " + self.peaks[phase].format())
            if phase in self.buffer_plans:
                parts.append(f"[{phase} buffers] " + self.buffer_plans[phase].format())
        if self.saved_full_weights is not None:
            saved = ", ".join(self.saved_full_weights) or "none"
            parts.append(f"full weights saved from forward for backward: {saved}\n")
        return "\n".join(parts)


@functools.cache
def _source_digest() -> str:
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


class _JointTagPass(compat.CustomGraphPass):
    """Inductor's hook for ``tag_unshard_pass``; its uuid keys torch's caches."""

    def __init__(self, backend: FXShardBackend, dumper: Dumper | None) -> None:
        self.backend, self.dumper = backend, dumper

    def __call__(self, graph: fx.Graph) -> None:
        self.backend.tag_joint(graph.owning_module, (), self.dumper)

    def uuid(self) -> str:
        spec = self.backend.spec
        # A debug run must run the passes to dump them: make it miss the cache.
        nonce = uuid.uuid4().hex if spec.debug_dir else ""
        # The compiled graphs name their Units by id and index its units and
        # members: a cached graph fits only the same ones.
        units = self.backend.units
        layout = (units.id, tuple(u.names for u in units.units)) if units is not None else None
        return hashlib.sha256(f"{_source_digest()}|{spec}|{layout}|{nonce}".encode()).hexdigest()


class FXShardBackend:
    """A dynamo backend: ``backend(gm, example_inputs) -> callable``."""

    def __init__(self, spec: BackendSpec, units: Units | None = None, agreement: GraphAgreement | None = None) -> None:
        self.spec = spec
        self.agreement = agreement  # None: graphs run unchecked (one rank, a fake group)
        self.graph_break_reason: str | None = None  # set when reads go sequenced
        # Weak: torch keeps compiled functions, and through them their
        # backend, after the model is gone (in the frame's globals until its
        # cache entry dies); the model's plan holds the units.
        self._units = weakref.ref(units) if units is not None else None
        self.graphs: list[GraphRecord] = []
        self._policy = CheckpointPolicy.MUST_RECOMPUTE if spec.recompute_reads else CheckpointPolicy.MUST_SAVE

    @property
    def units(self) -> Units | None:
        """None: every parameter is gathered and reduced on its own."""
        if self._units is None:
            return None
        units = self._units()
        if units is None:
            raise RuntimeError("fxshard: this backend's model was freed; compile a live model")
        return units

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        record = GraphRecord(index=len(self.graphs), graph_break_reason=self.graph_break_reason,
                             params=self.spec.params)  # fmt: skip
        self.graphs.append(record)
        with compat.host_syncs_allowed(), compat.subgraph_schemas_cached():
            compiled = self._compile(record, gm, example_inputs)
        if self.agreement is None or not record.collectives:
            return compiled
        return _agree_first(compiled, self.agreement, f"graph {record.index}", record.collectives)

    def _compile(self, record: GraphRecord, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        dumper = None
        if self.spec.debug_dir:
            dumper = Dumper(Path(self.spec.debug_dir) / f"rank{self.spec.rank}" / f"graph{record.index}")
        captured = [GraphPass("dedupe_unshard", dedupe_unshard_pass)]
        if self.spec.sharded_embeddings:
            captured.append(GraphPass("shard_embedding", shard_embedding_pass))
        if self.spec.outline_blocks:
            captured.append(GraphPass("outline_blocks", outline_blocks_pass))
        record.captured, records = run_passes(
            gm, example_inputs, captured, phase="captured", dumper=dumper, disabled=self.spec.disabled_passes
        )
        record.sharded_lookups = records.get("shard_embedding", ())
        record.outline = records.get("outline_blocks", record.outline)
        if self.units is not None:
            if not self.units.assigned:  # from the first graph (see [Note: units and flat shards])
                # Reads inside a checkpointed region count too: else its weights got no unit and
                # were gathered one by one, all at the top of the forward graph.
                # Only the parameters units move: not the experts' (see [Note: expert-parallel parameters]).
                first_use = [param_of(n).fqn for n in nodes_in_call_order(record.captured)
                             if is_sharded_read(n) and param_of(n).fqn in self.units.params]  # fmt: skip
                self.units.form(form_units(self.units.params, first_use, self.spec.unit_bytes,
                                           self.spec.explicit_units, record.outline.weights))  # fmt: skip
            record.units = format_units(self.units)
        units = [u.names for u in self.units.units] if self.units is not None else []
        record.collectives = collective_lines(record.captured, units)
        compile_graph = functools.partial(self._compile_graph, record, dumper)
        if self.spec.compiler == "inductor":
            joint_pass = _JointTagPass(self, dumper)
            record.estimates_file = _estimates_file(joint_pass.uuid(), record.captured, example_inputs)
            patches = compat.inductor_config_patches(joint_pass, dict(self.spec.inductor_config))
            compiled = compat.compile_fx(record.captured, example_inputs, inner_compile=compile_graph,
                                         config_patches=patches)  # fmt: skip
            if not record.peaks:  # loaded from torch's cache: the passes did not run
                loaded = load_estimates(record.estimates_file)
                if loaded is not None:
                    record.peaks, record.backward_held = loaded
            return compiled

        def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any):
            joint = self.tag_joint(joint, joint_inputs, dumper)
            return compat.min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

        return compat.aot_autograd(
            fw_compiler=functools.partial(compile_graph, is_backward=False, is_inference=False),
            bw_compiler=functools.partial(compile_graph, is_backward=True),
            inference_compiler=functools.partial(compile_graph, is_inference=True),
            partition_fn=partition,
            keep_inference_input_mutations=True,
        )(record.captured, example_inputs)

    def tag_joint(self, joint: fx.GraphModule, joint_inputs: Any, dumper: Dumper | None) -> fx.GraphModule:
        unit_of = self.units.unit_names if self.units is not None else None
        tag = GraphPass("tag_unshard", functools.partial(tag_unshard_pass, policy=self._policy, unit_of=unit_of),
                        edits_graph=False)  # fmt: skip
        passes = [tag]
        if self.spec.outline_blocks:  # see [Note: outlined blocks]
            passes.insert(0, GraphPass("reroute_saved_inputs", reroute_saved_inputs_pass))
            if self._policy == CheckpointPolicy.MUST_RECOMPUTE:
                passes.insert(1, GraphPass("tag_body_inputs", tag_body_inputs_pass, edits_graph=False))
        return run_passes(
            joint, joint_inputs, passes, phase="joint", dumper=dumper, disabled=self.spec.disabled_passes
        )[0]

    def _compile_graph(
        self,
        record: GraphRecord,
        dumper: Dumper | None,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        **kwargs: Any,
    ) -> Any:
        # A backward compiles lazily, inside a step.
        with compat.host_syncs_allowed(), compat.subgraph_schemas_cached():
            return self._compile_phase(record, dumper, gm, example_inputs, **kwargs)

    def _compile_phase(
        self,
        record: GraphRecord,
        dumper: Dumper | None,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        **kwargs: Any,
    ) -> Any:
        phase = "backward" if kwargs.get("is_backward") else "inference" if kwargs.get("is_inference") else "forward"
        try:
            gm = self._own_passes(record, dumper, gm, example_inputs, phase)
        except Exception as error:
            if not compat.is_data_dependent(error):
                raise
            # Not a graph break of the model (the backend's data-dependent errors count as one: see
            # compat.is_graph_break), so it must not send the model to the sequenced path or be reported as one.
            raise RuntimeError(
                f"fxshard: its passes over graph {record.index} ({phase}) read a size that depends on "
                f"data ({compat.graph_break_reason(error)}). This is a bug in fxshard, not in the model: please "
                "report it with the FXSHARD_DUMP output"
            ) from error
        log.info("fxshard rank %d %s", self.spec.rank, record.reports[phase].format().splitlines()[0])
        if self.spec.compiler == "aot_eager":
            return compat.make_boxed_func(gm)
        return compat.compile_fx_inner(gm, example_inputs, **kwargs)

    def _own_passes(
        self, record: GraphRecord, dumper: Dumper | None, gm: fx.GraphModule, example_inputs: Sequence[Any], phase: str
    ) -> fx.GraphModule:
        """fxshard's passes over one traced graph of ``phase``, its estimates and buffer plan."""
        record.reports[phase] = graph_report(gm, phase)
        self._note_saved_full_weights(record, phase, gm)
        decompositions = compat.inductor_decompositions() if self.spec.compiler == "inductor" else None
        lower = functools.partial(lower_collectives_pass, decompositions=decompositions)
        # gloo: no gather in flight beside compute (see [Note: gloo gathers in place]).
        prefetch = 0 if compat.group_backend(self.spec.group_name) == "gloo" else self.spec.prefetch
        schedule = functools.partial(schedule_collectives_pass, unit_bytes=self.spec.unit_bytes,
                                     prefetch=prefetch, max_reduces_in_flight=self.spec.reduces_in_flight)  # fmt: skip
        passes = [
            GraphPass("bucket_collectives", functools.partial(bucket_collectives_pass, units=self.units)),
            GraphPass("lower_collectives", lower),
            GraphPass("schedule_collectives", schedule),
            # Last: it only adds resolves right before the body calls, wherever the schedule put them.
            GraphPass("resolve_call_inputs", resolve_call_inputs_pass),
        ]
        gm, records = run_passes(
            gm, example_inputs, passes, phase=phase, dumper=dumper, disabled=self.spec.disabled_passes
        )
        if "schedule_collectives" in records:
            record.schedules[phase] = records["schedule_collectives"]
        # A backward frees its saved activations as it goes; see [Note: peak estimate].
        record.peaks[phase] = graph_peak(gm.graph, free_inputs=phase == "backward")
        if phase == "backward":
            record.backward_held = held_inputs(gm.graph)
        if record.estimates_file is not None:
            save_estimates(record.estimates_file, record.peaks, record.backward_held)
        record.buffer_plans[phase] = plan_buffers(gm)
        setattr(record, phase, gm)
        if dumper:
            dumper.text("summary.txt", record.summary())
        return gm

    @staticmethod
    def _note_saved_full_weights(record: GraphRecord, phase: str, gm: fx.GraphModule) -> None:
        # The partitioner names the backward's saved inputs after the forward
        # nodes that produced them, so names tell what the forward saved.
        # Gathered values come from unshards, or on the sequenced path from
        # the sequencer's reads.
        if phase == "forward":
            record.full_weights_in_forward = {
                v.name: param_of(n).fqn
                for n in gm.graph.nodes
                if is_sharded_read(n) or is_seq_gather(n)
                for v in full_weight_views(n, set())
            }
        elif phase == "backward":
            inputs = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
            saved = {record.full_weights_in_forward[n]: None for n in inputs if n in record.full_weights_in_forward}
            record.saved_full_weights = tuple(saved)


# [Note: gloo gathers in place]
# On gloo (CPU runs and the tests) every gather waits where it is issued:
# with gathers in flight beside compute, a 3-layer Transformer with
# activation checkpointing aborted intermittently with "malloc(): unaligned
# tcache chunk detected" or a segfault at 2 ranks, under Inductor and
# aot_eager, and not with prefetch=0. gloo's coalesced all-gather corrupts
# the heap the same way in plain torch, when two of a group's worker
# threads run collectives at once (compat.all_gather_coalesced_async).
# The prefetch aborts no longer reproduce, so their cause is not shown to
# be the same; docs/notes/gloo-heap/ has the reproducer and the evidence.
# NCCL keeps the prefetch.


def _estimates_file(cache_key: str, captured: fx.GraphModule, example_inputs: Sequence[Any]) -> str:
    # Not every input with a shape is a tensor: tensor parallelism's DeviceMesh.
    inputs = [(tuple(x.shape), x.dtype, tuple(x.stride())) if isinstance(x, torch.Tensor) else x
              for x in example_inputs]  # fmt: skip
    key = hashlib.sha256(f"{cache_key}|{captured.code}|{inputs}".encode()).hexdigest()
    return str(Path(compat.torch_cache_dir()) / "fxshard" / "estimates" / f"{key}.json")


def _agree_first(compiled: Any, agreement: GraphAgreement, graph: str, lines: tuple[str, ...]) -> Any:
    """``compiled``, checking on its first call that every rank runs the same
    collectives (see [Note: ranks agree on each graph]). Dynamo calls what a
    backend returns before the graph runs, with the graph's inputs."""
    agreed = False

    def run(*args: Any) -> Any:
        nonlocal agreed
        if not agreed:
            agreement.check(graph, lines)
            agreed = True
        return compiled(*args)

    return run


def format_units(units: Units) -> str:
    if not units.units:
        return "units: none (every parameter gathered on its own)\n"
    lines = [
        f"units: {len(units.units)}, one all-gather each, and one reduce-scatter per block or group of blocks (or one)"
    ]
    for u in units.units:
        names = u.names
        shown = ", ".join(names[:4]) + (f", ... ({len(names)} parameters)" if len(names) > 4 else "")
        reduces = f", {len(u.reduce_groups)} reduces" if len(u.reduce_groups) > 1 else ""
        lines.append(
            f"  unit {u.index}: {u.gather_nbytes() / 2**20:.2f} MiB gathered{reduces}, {u.gather_dtype}: {shown}"
        )
    return "\n".join(lines) + "\n"
