"""fxshard against FSDP2, side by side, on the same model and data, each system in its own process.

    python bench/bench.py --model 1b --nproc-per-node 2 --out bench-1b.json
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 4 bench/bench.py --model 1b --out bench-1b.json
    python bench/bench.py --model 375m --batch 1 --systems fxshard_capturable,fxshard_graph --repeat 2
    python bench/bench.py --model 8b --fake-world 8 --systems fxshard,fsdp2_compile   # memory only
    python bench/bench.py --model tiny --device cpu --systems fxshard,fsdp2        # a smoke test (gloo)
    python bench/bench.py --model 8b --tp 2 --nproc-per-node 4 --systems fxshard,fsdp2_compile   # (dp 2, tp 2)
    python bench/bench.py --model tt_qwen3_moe_1b --ep 2 --nproc-per-node 4 --systems fxshard,fsdp2_compile

One process per system: a system leaves compile caches, allocator state,
streams and NCCL communicators behind, and these slowed the next system in
the same process. So a driver runs each system in a fresh
``torchrun --standalone --nproc-per-node N bench/bench.py --only-system X``
(``--fake-world``: a fresh ``python``), one after the other, ``--repeat K``
times interleaved (A B A B ...), and merges their JSON into ``--out`` (every
run kept, each with its ``run`` index; a failed run goes to ``failures`` and
the others still run). The driver is a plain ``python bench/bench.py``, or,
when started under torchrun with several systems, local rank 0 (the other
ranks exit at once; single host only). With one system under torchrun, the
ranks run it themselves.

Models (``--model``, bench/models.py): the example's Llama at 375M, 1B and
8B, Hugging Face's OLMoE (``moe``), and a hybrid of attention, Mamba-style
and MoE layers (``hybrid``); ``*tiny`` for a smoke test on CPU. Systems, each
on the same model, built from the same seed:
- ``fxshard``: ``fxshard.compile(model, mesh, mp_policy=...)`` (Inductor);
- ``fsdp2``: ``fully_shard`` on each block, then on the root;
- ``fsdp2_compile``: each block ``torch.compile``d, then ``fully_shard`` on
  each block and the root (torchtitan's order);
- ``fxshard_graph`` (not in the default set): the whole step (forward,
  backward, optimizer, zero_grad) in ``fxshard.cuda_graph``: two eager steps,
  a capture, then replays; the timed steps are replays only;
- ``fxshard_graph_none`` (not in the default set): ``fxshard_graph`` with
  ``zero_grad(set_to_none=True)``, the form the README recommends;
- ``fxshard_capturable`` (not in the default set): ``fxshard_graph``'s step
  uncaptured, so that the two differ by the graph alone;
- ``compile_graph`` (one GPU only, not in the default set): plain torch, no
  sharding: the model under ``torch.compile`` and bf16 autocast, the same
  step captured with ``torch.cuda.graph``. What the step's kernels cost
  without fxshard, a floor for ``fxshard_graph`` at world size 1;
- ``fxshard_flat``, ``fxshard_r2``: fxshard options (``FXSHARD_VARIANTS``).
``--strategy`` applies to every system, in its own spelling (``STRATEGIES``):
ZeRO-3, -2 and -1, a frozen tower sharded (with ``--frozen-layers N``, which
freezes the embedding and the first N blocks; fxshard's default replicates
it), and accumulation without sync (with ``--micro-batches K``); ``--mesh R,S``
is HSDP. ``--tp N``: tensor parallelism on a (dp = world / N, tp = N) mesh
named ("dp", "tp") (with ``--mesh R,S``: ("replicate", "shard", "tp")): every
system gets the model's TP plan (bench/models.py: torchtitan's Llama plan,
with sequence parallelism; ``--loss-parallel``: the logits sharded on the
vocabulary into a loss under ``loss_parallel()``, as torchtitan's default)
from ``parallelize_module(model, mesh["tp"], plan)``, then its data
parallelism over ``mesh["dp"]`` as above, in torchtitan's order (TP, then
each block compiled, then ``fully_shard``). ``--batch`` is then per
data-parallel rank: the ranks of one TP group train the same tokens.
``--ep N``: expert parallelism as torchtitan sets it up, for its MoE
models: a ("dp",) mesh of every rank and an ("efsdp", "ep") mesh with ep = N;
the model's own EP setup (experts ``Shard(0)`` on ep, the all-to-all token
dispatcher) for every system, then ``fxshard.compile(model, dense["dp"],
expert_mesh=sparse["efsdp"])``, or torchtitan's FSDP2 (each block compiled
(without torchtitan's ``capture_scalar_outputs``: see ``build``), ``fully_shard`` per block with expert weights
on efsdp through ``shard_placement_fn``, or their own ``fully_shard`` where
FSDP2 has no per-parameter mesh (torch 2.11), gradient division off and the loss
divided by the world size instead, so that every gradient is the mean over
all ranks as fxshard's is).
``--optimizer``: torch's default AdamW (foreach), fused AdamW, or
SGD with momentum. ``--fxshard-tree DIR`` runs fxshard from another commit's
files on this tree's models and step (bench/matrix.py uses it for the
baseline commit).
All use bf16 compute, fp32 gradient reduction and fp32 master weights
(``capturable=True`` and ``zero_grad(set_to_none=False)`` for the captured
systems); random tokens, the same per step and rank for every system.

Method: the step time is the median over the timed steps after the warm-up
steps (``MODELS``), each timed with ``time.perf_counter`` around the step and
a ``torch.cuda.synchronize()``, the loss read after it; the first step
(compile included) is reported separately. Peak memory per step from
``max_memory_allocated`` and ``max_memory_reserved`` (reserved holds a CUDA
graph's pool), reset after the model is built and sharded and after every
step. TFLOP/s per GPU = FLOPs per token (bench/models.py) x tokens per GPU /
step time, where tokens per GPU are the batch's tokens / tp: a TP group's
GPUs split its tokens' FLOPs, which count the parameters at full size.
``--profile N`` adds, per step over the last N steps, the GPU-busy time (the
union of all kernels) next to the step time, compute-busy, NCCL and exposed
NCCL time, and kernel time by kind (matmul, attention, optimizer, Triton,
NCCL, other). ``--profile-host`` adds the host side of the same steps:
the ops that take the most host time (self time per step, calls per step),
for a step the GPU waits on. Report the device, GPU count, torch and NCCL versions (in the
JSON's ``meta``) with every number; compare systems of one run side by side.
The driver prints a table and writes JSON; ``bench/plot.py`` draws it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
# --fxshard-tree=DIR: fxshard from DIR (a baseline commit's files), everything else from this tree,
# so that a baseline runs the same models, data and step code. Read before fxshard is imported.
FXSHARD_TREE = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--fxshard-tree=")), None)
if FXSHARD_TREE:
    sys.path.insert(0, str(Path(FXSHARD_TREE).resolve()))

import memtrace  # noqa: E402  (bench/memtrace.py: this script's folder is on sys.path)
from models import MODELS  # noqa: E402  (bench/models.py)

import fxshard  # noqa: E402
from fxshard.runtime import compat  # noqa: E402

SYSTEMS = ("fxshard", "fsdp2", "fsdp2_compile")
# fxshard variants, not in the default set: the keyword arguments each adds.
FXSHARD_VARIANTS = {
    "fxshard": {},
    "fxshard_flat": {"compile_blocks_once": False},  # every layer compiled inline
    "fxshard_r2": {"reduces_in_flight": 2},  # two reduce-scatters in flight, two reduce inputs alive
    "fxshard_capturable": {},  # fxshard_graph's step, uncaptured
    "fxshard_graph": {},  # the step in fxshard.cuda_graph
    "fxshard_graph_none": {},  # fxshard_graph with zero_grad(set_to_none=True) in the step
}
# Strategies (--strategy), each as fxshard and FSDP2 spell it: (fxshard.compile kwargs, fully_shard kwargs).
# FSDP2 has no ZeRO-1; its nearest, kept from forward to backward, is ZeRO-2. HSDP is --mesh R,S.
STRATEGIES = {
    "zero3": ({}, {}),
    "zero2": ({"zero_stage": 2}, {"reshard_after_forward": False}),
    "zero1": ({"zero_stage": 1}, {"reshard_after_forward": False}),
    # With --frozen-layers: fxshard's default replicates a frozen tower; this shards it, as FSDP2 does.
    "shard_frozen": ({"shard_frozen": True}, {}),
    # With --micro-batches: all micro-batches but the last keep gradients unreduced.
    "no_sync": ({}, {}),
}
OPTIMIZERS = ("adamw", "adamw_fused", "sgd")  # torch's default AdamW (foreach), fused AdamW, SGD with momentum
# Plain torch on one GPU, no sharding: the unsharded model under torch.compile
# and bf16 autocast, the step in torch.cuda.graph. A floor for fxshard_graph
# at world size 1: what the same kernels cost without fxshard.
REFERENCE = ("compile_graph",)
ALL_SYSTEMS = tuple(dict.fromkeys((*SYSTEMS, *FXSHARD_VARIANTS, *REFERENCE)))
# [Note: a step a CUDA graph can replay] A replay reuses the captured
# addresses and launches no host work: the optimizer keeps its step count on
# the GPU (AdamW capturable=True), and zero_grad keeps the gradient tensors
# (set_to_none=False; fxshard_graph_none zeroes them to None instead, so the
# captured backward's gradients become .grad in the graph's pool).
# fxshard_capturable runs fxshard_graph's step uncaptured.
CAPTURABLE = ("fxshard_capturable", "fxshard_graph", "fxshard_graph_none", "compile_graph")
GRAPHED = ("fxshard_graph", "fxshard_graph_none", "compile_graph")
GRAPH_WARMUP = 2  # fxshard.cuda_graph(warmup=...): eager calls; the next one captures, later ones replay
GRAPH_MEMORY_FIELDS = ("predicted_peak", "measured_peak", "pool_reserved", "persistent", "outside_free")
DEVICE = "cuda"
PROFILE = 0  # profile the last N steps (--profile)
PROFILE_HOST = False  # --profile-host: the profiled steps' host ops too
TRACE_DIR = os.environ.get("BENCH_TRACE_DIR")  # where rank 0 writes the profiled steps' Chrome trace
MEMORY_STEP = None  # the step whose allocations are traced to its peak (--memory-step)
MICRO_BATCHES = 1  # forward and backward per micro-batch of --batch, one optimizer step (--micro-batches)
FROZEN_LAYERS = 0  # the embedding and this many first layers frozen: a frozen tower (--frozen-layers)
STRATEGY = "zero3"  # --strategy
OPTIMIZER = "adamw_fused"  # --optimizer
MESH: tuple[int, ...] | None = None  # --mesh R,S: an HSDP mesh of R replicas of S shards
TP = 1  # --tp N: tensor parallelism over the last mesh dimension, of size N
LOSS_PARALLEL = False  # --loss-parallel: with --tp, vocab-sharded logits into the loss
EP = 1  # --ep N: expert parallelism, experts sharded over an ep mesh dimension of size N
LOSS_SCALE = 1.0  # the backward's loss over the reported one (FSDP2 under --ep: 1 / world size, see build)
CAPTURABLE_OPTIMIZER = False  # --capturable: every system's AdamW capturable, as a captured step's must be


FXSHARD_KWARGS: dict = {}
# torch.compile's own phase timers, as printed (see compat.compile_phase_times)
COMPILE_PHASES = ("bytecode_tracing", "aot_collect_metadata", "aot_trace_joint_graph", "create_aot_dispatcher_function",
                  "compile_fx_inner", "backward._backward_impl", "_compile.compile_inner")  # fmt: skip


def build(system: str, spec, mesh, tp_mesh=None, ep_meshes=None) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = spec.make()
    blocks = spec.blocks(model)
    if FROZEN_LAYERS:
        embed = model.embed if hasattr(model, "embed") else model.get_input_embeddings()
        embed.requires_grad_(False)
        for layer in list(blocks.children())[:FROZEN_LAYERS]:
            layer.requires_grad_(False)
    if system in REFERENCE:
        if dist.get_world_size() != 1:
            raise ValueError(f"{system} trains the unsharded model on one GPU: run it with --nproc-per-node 1")
        return torch.compile(model)
    if TP > 1:  # torchtitan's order: the TP plan first, then compile and data-parallel sharding over mesh["dp"]
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, tp_mesh, spec.tp_plan(model, LOSS_PARALLEL))
    expert_kwargs = {}
    if EP > 1:  # the model's own EP setup first, as torchtitan's trainer does
        ep_mesh, efsdp_mesh = ep_meshes
        spec.ep_plan(model, ep_mesh)
        expert_kwargs = {"expert_mesh": efsdp_mesh}
    fxshard_kwargs, fsdp2_kwargs = STRATEGIES[STRATEGY]
    if system in FXSHARD_VARIANTS:
        mp = fxshard.MixedPrecision(torch.bfloat16, torch.float32)
        return fxshard.compile(model, mesh, mp_policy=mp, **{**FXSHARD_KWARGS, **expert_kwargs, **fxshard_kwargs,
                                                            **FXSHARD_VARIANTS[system]})  # fmt: skip
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # Under EP, torchtitan's apply_compile sets dynamo's capture_scalar_outputs, so that the token dispatch's
    # split sizes (tolist) stay in the block's graph. On torch 2.11 Inductor's code for that graph then fails
    # its own runtime assert on the all-to-all's received token count ("RuntimeError: Eq(u0 + u1, 32768)"),
    # so it stays off here: each block's graph breaks at the dispatch, the code around it compiled.
    for key, block in list(blocks.named_children()):  # a ModuleList or, as torchtitan's, a ModuleDict
        if system == "fsdp2_compile":
            block = torch.compile(block)
            blocks.register_module(key, block)
        if EP > 1:
            from tests.helpers.ep_parity import fully_shard_block  # torchtitan's FSDP2 of a block under EP

            fully_shard_block(block, spec.expert_module(block), mesh, ep_meshes[1], mp_policy=mp, **fsdp2_kwargs)
        else:
            fully_shard(block, mesh=mesh, mp_policy=mp, **fsdp2_kwargs)
    fully_shard(model, mesh=mesh, mp_policy=mp, **fsdp2_kwargs)
    if EP > 1:
        # torchtitan's disable_fsdp_gradient_division: FSDP2 would average an expert's gradient over efsdp
        # alone; with no division and the loss over the world size, every gradient is the mean over all ranks.
        global LOSS_SCALE
        LOSS_SCALE = 1.0 / dist.get_world_size()
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                if DEVICE == "cpu":  # gloo has no PREMUL_SUM, which a divide factor of 1.0 still reduces with
                    module.set_force_sum_reduction_for_comms(True)
    return model


def make_optimizer(system: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """``--optimizer``, as a user builds it; a captured step keeps AdamW's step count on the GPU."""
    if OPTIMIZER == "sgd":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    fused = {"fused": True} if OPTIMIZER == "adamw_fused" else {}
    capturable = {"capturable": True} if system in CAPTURABLE or CAPTURABLE_OPTIMIZER else {}
    return torch.optim.AdamW(params, lr=3e-4, **fused, **capturable)


def make_step(system: str, model: torch.nn.Module, opt: torch.optim.Optimizer, spec):
    """One training step, ``step(tokens) -> loss`` (see [Note: a step a CUDA graph can replay])."""
    set_to_none = system not in CAPTURABLE or system == "fxshard_graph_none"

    def train_step(tokens: torch.Tensor) -> torch.Tensor:
        losses, clock = [], PhaseClock()
        for i, micro in enumerate(tokens.chunk(MICRO_BATCHES)):
            if STRATEGY == "no_sync" and system not in REFERENCE:
                model.set_requires_gradient_sync(i == MICRO_BATCHES - 1)
            with torch.autocast(DEVICE, torch.bfloat16, enabled=system in REFERENCE), parallel_loss():
                loss = spec.loss(model, micro) / MICRO_BATCHES
                clock.lap("forward")
                (loss * LOSS_SCALE if LOSS_SCALE != 1.0 else loss).backward()
                clock.lap("backward")
            if isinstance(loss, DTensor):  # loss parallelism: a replicated DTensor
                loss = loss.to_local()
            losses.append(loss.detach())
        loss = torch.stack(losses).sum()
        opt.step()
        clock.lap("optimizer")
        opt.zero_grad(set_to_none=set_to_none)
        clock.lap("zero_grad")
        return loss

    if system not in GRAPHED:
        return train_step
    if system in REFERENCE:
        return PlainGraph(train_step)
    # Looked up here, not imported at the top: the script runs with an fxshard that predates it.
    cuda_graph = getattr(fxshard, "cuda_graph", None)
    if cuda_graph is None:
        raise RuntimeError(f"{system} needs fxshard.cuda_graph (fxshard/graphs.py), which this fxshard "
                           f"({fxshard.__file__}) lacks: update fxshard or leave {system} out of --systems")  # fmt: skip
    return cuda_graph(train_step, warmup=GRAPH_WARMUP)


def parallel_loss():
    """``loss_parallel()`` under ``--loss-parallel``: the vocab-sharded logits' loss and its backward."""
    if not LOSS_PARALLEL:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


HOST_PHASES: list[dict[str, float]] = []  # per uncaptured step: host seconds per phase (PhaseClock)


class PhaseClock:
    """Host time per phase of one step, with no synchronization: where a step
    is bound by the host (launches, Python), this is where its time goes."""

    def __init__(self) -> None:
        self.last, self.laps = time.perf_counter(), {}
        HOST_PHASES.append(self.laps)

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps[phase] = self.laps.get(phase, 0.0) + now - self.last
        self.last = now


class PlainGraph:
    """The reference's capture with torch alone: GRAPH_WARMUP eager calls,
    then one captured on a side stream (``torch.cuda.graph``) and replayed;
    every later call copies its tokens in and replays."""

    memory = None  # no prediction to report (see graph_memory)

    def __init__(self, fn) -> None:
        self.fn, self.calls, self.graph = fn, 0, None

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.graph is None and self.calls <= GRAPH_WARMUP:
            return self.fn(tokens)
        if self.graph is None:
            self.tokens, self.graph = tokens.clone(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.loss = self.fn(self.tokens)
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.loss

    def reset(self) -> None:
        self.graph = None


def tokens_for(step: int, rank: int, batch: int, vocab: int, seq: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (batch, seq), generator=gen).to(DEVICE)


def timed_steps(step, batches: list[torch.Tensor]) -> dict:
    """Runs ``step`` on each batch: times, losses, per-step peaks, and the
    profile and memory trace where asked for."""
    out: dict = dict(times=[], host=[], losses=[], peaks=[], reserved=[], profiler=None, traced=None, phases={})
    phase_times = getattr(compat, "compile_phase_times", lambda reset=False: {})  # absent at old baselines
    phase_times(reset=True)
    for i, tokens in enumerate(batches):
        if PROFILE and i == len(batches) - PROFILE:
            kinds = torch.profiler.ProfilerActivity
            activities = {kinds.CUDA if DEVICE == "cuda" else kinds.CPU, *([kinds.CPU] if PROFILE_HOST else [])}
            out["profiler"] = torch.profiler.profile(activities=list(activities))
            out["profiler"].__enter__()
        if MEMORY_STEP == i and DEVICE == "cuda":
            base = memtrace.start()
        start = time.perf_counter()
        loss = step(tokens)
        out["host"].append(time.perf_counter() - start)
        sync()
        out["times"].append(time.perf_counter() - start)
        out["losses"].append(loss.item())  # a graph's static output: read before the next call
        if MEMORY_STEP == i and DEVICE == "cuda":
            out["traced"] = memtrace.summary(base)
        if DEVICE == "cuda":
            out["peaks"].append(torch.cuda.max_memory_allocated())
            out["reserved"].append(torch.cuda.max_memory_reserved())
            torch.cuda.reset_peak_memory_stats()
        if i == 0:
            out["phases"] = phase_times()
    if out["profiler"] is not None:
        out["profiler"].__exit__(None, None, None)
    return out


def graph_memory(step) -> dict:
    """``step.memory`` of an ``fxshard.cuda_graph`` in GiB; empty if it has none."""
    memory = step.memory
    if memory is None:
        return {}
    values = {f: getattr(memory, f, None) for f in GRAPH_MEMORY_FIELDS}
    return {f: v / 2**30 if v is not None else None for f, v in values.items()}


def run_system(system: str, name: str, mesh, batch: int | None, tp_mesh=None, ep_meshes=None) -> dict:
    spec = MODELS[name]()
    warmup, steps = spec.warmup, spec.steps
    batch = batch or spec.batch
    if system in GRAPHED:
        warmup = max(warmup, GRAPH_WARMUP + 1)  # the timed steps are replays, never the capture
        if PROFILE > steps:
            raise ValueError(f"--profile {PROFILE} would profile {system}'s capture; at most {steps} for {name}")
    rank = dist.get_rank()
    model = build(system, spec, mesh, tp_mesh, ep_meshes)
    params = sum(p.numel() for p in model.parameters())
    flops_per_token = spec.flops_per_token(model)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(system, trained)
    step = make_step(system, model, opt, spec)
    dp_rank = rank // TP  # tp is the mesh's last dimension: the ranks of one TP group train the same tokens
    batches = [tokens_for(s, dp_rank, batch * MICRO_BATCHES, spec.vocab, spec.seq) for s in range(warmup + steps)]
    sync()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    try:
        run = timed_steps(step, batches)
        memory = graph_memory(step) if system in GRAPHED else {}
    finally:
        if system in GRAPHED:
            step.reset()  # frees the graph and its pool before the process group goes
    times, losses = run["times"], run["losses"]
    median = statistics.median(times[warmup:])
    tokens_per_gpu = batch * MICRO_BATCHES * spec.seq / TP  # a TP group's GPUs split its tokens' work
    flops = flops_per_token * tokens_per_gpu
    result = dict(
        model=name, system=system, params=params, batch=batch, micro_batches=MICRO_BATCHES, seq=spec.seq,
        world_size=dist.get_world_size(), strategy=STRATEGY, optimizer=OPTIMIZER, mesh=list(mesh.shape),
        tp=TP, sequence_parallel=TP > 1, loss_parallel=LOSS_PARALLEL, ep=EP,
        capturable=CAPTURABLE_OPTIMIZER or system in CAPTURABLE,
        frozen_layers=FROZEN_LAYERS, fxshard_tree=FXSHARD_TREE,
        warmup=warmup, step_ms=median * 1e3, tokens_per_s_per_gpu=tokens_per_gpu / median,
        tflops_per_gpu=flops / median / 1e12, peak_gib=max(run["peaks"], default=0) / 2**30,
        peak_reserved_gib=max(run["reserved"], default=0) / 2**30, first_step_s=times[0],
        loss_step10=losses[min(9, len(losses) - 1)], first_step_compile_s=run["phases"], losses=losses,
        host_ms=statistics.median(run["host"][warmup:]) * 1e3,
        host_phases_ms={k: statistics.median(p.get(k, 0.0) for p in HOST_PHASES[-steps:]) * 1e3
                        for k in ("forward", "backward", "optimizer", "zero_grad")} if len(HOST_PHASES) >= steps else {},
        step_times_ms=[t * 1e3 for t in times], step_peaks_gib=[p / 2**30 for p in run["peaks"]],
        step_reserved_gib=[p / 2**30 for p in run["reserved"]],
    )  # fmt: skip
    if system in GRAPHED:
        result["capture_step_s"] = times[GRAPH_WARMUP]
        result["graph_memory_gib"] = memory
    if run["traced"] is not None:
        result["memory_at_peak"] = run["traced"]
    if system in FXSHARD_VARIANTS:
        result.update(fxshard_plan_facts(model))
    if run["profiler"] is not None:
        result["profile"] = kernel_profile(run["profiler"], PROFILE)
        if PROFILE_HOST:
            result["host_ops"] = host_ops(run["profiler"], PROFILE)
        if TRACE_DIR and rank == 0:
            run["profiler"].export_chrome_trace(str(Path(TRACE_DIR) / f"trace-{name}-{system}.json"))
    return result


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _covered(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    total, j = 0.0, 0
    for a, b in intervals:
        while j < len(cover) and cover[j][1] <= a:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < b:
            total += min(b, cover[k][1]) - max(a, cover[k][0])
            k += 1
    return total


def host_ops(profiler, steps: int, top: int = 15) -> list[dict]:
    """The ops (and Python-level events: autograd nodes, compiled graphs'
    calls) with the most host self time in the profiled steps, per step."""
    events = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"name": e.key, "calls": e.count / steps, "self_ms": e.self_cpu_time_total / 1e3 / steps,
             "total_ms": e.cpu_time_total / 1e3 / steps} for e in events]  # fmt: skip


def kernel_profile(profiler, steps: int) -> dict:
    """Per step, from the GPU kernels of the profiled steps (ms): time with
    any kernel running (GPU busy: compute, NCCL, copies), time with any
    compute kernel running, NCCL kernel time, NCCL time with no compute kernel
    running (exposed communication), and the largest kernels.

    A CUDA graph's replay is one ``cudaGraphLaunch`` on the host; CUPTI's
    kernel activity, which the profiler reads, still lists each kernel of the
    replay on the torch and CUDA versions this was written against. Where it
    does not, the profile has no kernels and says so in ``note``."""
    kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    nccl = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
    compute = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()]
    nccl_u, compute_u = _union(nccl), _union(compute)
    nccl_ms = sum(b - a for a, b in nccl_u) / 1e3
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name[:90]] = by_name.get(e.name[:90], 0.0) + (e.time_range.end - e.time_range.start) / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:40]
    ordered = sorted(kernels, key=lambda e: e.time_range.start)
    gaps, reach, last = [], None, None
    by_transition: dict[str, list[float]] = {}  # idle by (stream change, kinds before and after): [count, ms]
    for e in ordered:  # idle stretches: no kernel running between two kernels
        if reach is not None and e.time_range.start > reach:
            gap = (e.time_range.start - reach) / 1e3
            gaps.append((gap, last.name[:60], e.name[:60]))
            streams = "same stream" if last.device_resource_id == e.device_resource_id else "other stream"
            key = f"{streams}, {kernel_kind(last.name)} -> {kernel_kind(e.name)}"
            entry = by_transition.setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] += gap
        if reach is None or e.time_range.end > reach:
            reach, last = e.time_range.end, e
    by_kind: dict[str, float] = {}
    for e in kernels:
        kind = kernel_kind(e.name)
        by_kind[kind] = by_kind.get(kind, 0.0) + (e.time_range.end - e.time_range.start) / 1e3
    result = dict(
        gpu_busy_ms=sum(b - a for a, b in _union(spans)) / 1e3 / steps,
        compute_busy_ms=sum(b - a for a, b in compute_u) / 1e3 / steps,
        nccl_ms=nccl_ms / steps,
        exposed_nccl_ms=(nccl_ms - _covered(nccl_u, compute_u) / 1e3) / steps,
        kernels_per_step=len(kernels) / steps,
        top_kernels_ms={k: v / steps for k, v in top},
        by_kind_ms={k: v / steps for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        idle_ms=sum(g for g, *_ in gaps) / steps,
        idle_gaps=len(gaps) / steps,
        largest_gaps_ms=[list(g) for g in sorted(gaps, reverse=True)[: 4 * steps]],  # ms, kernel before, after
        idle_by_transition={
            k: [n / steps, ms / steps] for k, (n, ms) in sorted(by_transition.items(), key=lambda kv: -kv[1][1])[:12]
        },  # fmt: skip
        streams=len({e.device_resource_id for e in kernels}),
    )
    if not kernels:
        result["note"] = "the profiler listed no GPU kernels (CPU run, or CUDA graph replays not itemized)"
    return result


# Kernel name fragments -> the kind a profile sums them under (first match wins).
KERNEL_KINDS = (("nccl", ("nccl",)), ("matmul", ("nvjet", "gemm", "cutlass", "xmma", "cublas")),
                ("attention", ("sdpa", "flash", "fmha", "attention")), ("optimizer", ("multi_tensor_apply",)),
                ("triton", ("triton_",)))  # fmt: skip


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, parts in KERNEL_KINDS if any(p in lowered for p in parts)), "other")


def fxshard_plan_facts(model: torch.nn.Module) -> dict:
    try:
        return _plan_facts(model)
    except AttributeError as error:  # a baseline commit's plan (--fxshard-tree) may lack some of these
        return {"plan_facts": f"not read: {error}"}


def _plan_facts(model: torch.nn.Module) -> dict:
    """Units and the predicted peak from fxshard's plan (see the README's
    debug dumps): the largest graph's liveness estimate (inputs and
    intermediates) plus AdamW's two fp32 states per element of a trained
    shard (a frozen parameter has none)."""
    plan = model.fxshard_plan
    graph_peaks = {f"graph{g.index}.{phase}": p.total for g in plan.graphs for phase, p in g.peaks.items()}
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    units = plan.units.units if plan.units is not None else []
    return dict(
        units=len(units),
        unit_mib=[u.gather_nbytes() / 2**20 for u in units],
        graph_peaks_gib={k: v / 2**30 for k, v in graph_peaks.items()},
        predicted_peak_gib=(max(graph_peaks.values()) + 2 * shard_bytes) / 2**30 if graph_peaks else None,
        outlined=[g.outline.format().strip() for g in plan.graphs],
    )


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def table(results: list[dict]) -> str:
    head = (
        "| model | system | step ms | tokens/s/GPU | TFLOP/s/GPU | peak GiB | reserved GiB | first step s | loss@10 |"
    )
    rows = [head, "|" + "---|" * 9]
    for r in results:
        run = f" #{r['run'] + 1}" if "run" in r else ""
        tp = f", tp {r['tp']}" if r.get("tp", 1) > 1 else ""
        tp += f", ep {r['ep']}" if r.get("ep", 1) > 1 else ""
        rows.append(
            f"| {r['model']} ({r['params'] / 1e9:.2f}B, batch {r['batch']}{tp}) | {r['system']}{run} | {r['step_ms']:.1f} | "
            f"{r['tokens_per_s_per_gpu']:.0f} | {r['tflops_per_gpu']:.0f} | {r['peak_gib']:.2f} | "
            f"{r.get('peak_reserved_gib', 0):.2f} | {r['first_step_s']:.1f} | {r['loss_step10']:.4f} |"
        )
    for r in results:
        rows.extend("\n" + line for line in details(r))
    return "\n".join(rows)


def details(r: dict) -> list[str]:
    """The lines under the table for one result."""
    name, lines = f"{r['system']} {r['model']}", []
    if "profile" in r:
        p = r["profile"]
        lines.append(f"{name} profile per step: GPU busy {p.get('gpu_busy_ms', 0):.1f} of {r['step_ms']:.1f} ms, "
                     f"compute busy {p['compute_busy_ms']:.1f} ms, NCCL {p['nccl_ms']:.1f} ms, "
                     f"exposed NCCL {p['exposed_nccl_ms']:.1f} ms" + (f" ({p['note']})" if "note" in p else ""))  # fmt: skip
        if p.get("by_kind_ms"):
            kinds = ", ".join(f"{k} {v:.2f}" for k, v in p["by_kind_ms"].items())
            lines.append(f"{name} kernel ms per step by kind ({p['kernels_per_step']:.0f} kernels): {kinds}")
        if p.get("largest_gaps_ms"):
            largest = "; ".join(f"{g:.2f} after {a} before {b}" for g, a, b in p["largest_gaps_ms"][:6])
            lines.append(f"{name} GPU idle between kernels per step: {p['idle_ms']:.2f} ms in "
                         f"{p['idle_gaps']:.0f} gaps; largest: {largest}")  # fmt: skip
        if p.get("idle_by_transition"):
            where = "; ".join(f"{k}: {n:.0f} gaps, {ms:.2f} ms" for k, (n, ms) in p["idle_by_transition"].items())
            lines.append(f"{name} idle per step by transition ({p['streams']} streams): {where}")
    if r.get("host_ops"):
        ops = "; ".join(f"{o['name']} {o['self_ms']:.2f} ({o['calls']:.0f} calls)" for o in r["host_ops"])
        lines.append(f"{name} host self ms per step by op: {ops}")
    if "host_ms" in r:
        lines.append(f"{name} host time per step until the call returned: {r['host_ms']:.2f} ms")
    if r.get("host_phases_ms"):
        phases = ", ".join(f"{k} {v:.1f}" for k, v in r["host_phases_ms"].items())
        lines.append(f"{name} host ms per phase (no sync, uncaptured steps): {phases}")
    phases = r.get("first_step_compile_s") or {}
    if phases:
        shown = ", ".join(f"{k} {phases[k]:.1f}" for k in COMPILE_PHASES if k in phases)
        lines.append(f"{name} first step, compile phases (s): {shown}")
    if r.get("step_peaks_gib"):
        lines.append(f"{name} peak GiB per step: " + " ".join(f"{p:.2f}" for p in r["step_peaks_gib"]))
    if r.get("step_reserved_gib"):
        lines.append(f"{name} reserved GiB per step: " + " ".join(f"{p:.2f}" for p in r["step_reserved_gib"]))
    if "memory_at_peak" in r:
        lines.append(memtrace.format_summary(r["system"], r["memory_at_peak"]))
    if r.get("predicted_peak_gib") is not None:
        lines.append(f"{name}: {r['units']} units, predicted peak {r['predicted_peak_gib']:.2f} GiB "
                     f"(measured {r['peak_gib']:.2f})")  # fmt: skip
    if "capture_step_s" in r:
        memory = ", ".join(f"{k} {v:.2f}" for k, v in r["graph_memory_gib"].items() if v is not None)
        lines.append(f"{name}: capture step {r['capture_step_s']:.1f} s; graph memory GiB: {memory or 'not reported'}")
    return lines


def repeats(results: list[dict]) -> str:
    """Each system's step times over the repeated runs, in run order."""
    by_system: dict[str, list[float]] = {}
    for r in results:
        by_system.setdefault(r["system"], []).append(r["step_ms"])
    return "\n".join(f"{s}: step ms per run {' '.join(f'{t:.1f}' for t in ts)} (median {statistics.median(ts):.1f})"
                     for s, ts in by_system.items())  # fmt: skip


def parse_args() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, from {', '.join(ALL_SYSTEMS)}")
    parser.add_argument("--out", default=None, help="JSON file")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke test with gloo")
    parser.add_argument("--batch", type=int, default=None, help="batch per GPU (default: the model's, in MODELS)")
    parser.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="processes per system (default: torchrun's, else the GPU count; 2 on CPU)",
    )
    parser.add_argument("--repeat", type=int, default=1, help="run the system list this many times, interleaved")
    parser.add_argument("--timeout", type=float, default=None, help="seconds one system's run may take")
    parser.add_argument(
        "--only-system",
        choices=ALL_SYSTEMS,
        default=None,
        help="run this system in this process (what the driver starts)",
    )
    parser.add_argument("--prefetch", type=int, default=None, help="fxshard.compile(prefetch=...)")
    parser.add_argument("--profile", type=int, default=0, help="profile the GPU kernels of the last N steps")
    parser.add_argument("--profile-host", action="store_true",
                        help="with --profile: the host ops of those steps too (host self time per op)")  # fmt: skip
    parser.add_argument("--micro-batches", type=int, default=None,
                        help="micro-batches of --batch per optimizer step, each with its backward; each reduces "
                        "its gradients, or only the last with --strategy no_sync")  # fmt: skip
    parser.add_argument("--frozen-layers", type=int, default=0,
                        help="freeze the embedding and this many first layers (a frozen tower): fxshard "
                        "replicates them, or shards them with --strategy shard_frozen, as FSDP2 does")  # fmt: skip
    parser.add_argument("--strategy", choices=sorted(STRATEGIES), default="zero3",
                        help="each system's spelling of it: see STRATEGIES")  # fmt: skip
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw_fused",
                        help="adamw: torch's default AdamW (foreach); adamw_fused; sgd: SGD with momentum")  # fmt: skip
    parser.add_argument("--capturable", action="store_true",
                        help="AdamW(capturable=True) for every system, not only the captured ones (a fair baseline)")  # fmt: skip
    parser.add_argument("--mesh", default=None, help="R,S: an HSDP mesh of R replicas of S shards (default: 1-D)")
    parser.add_argument("--tp", type=int, default=None,
                        help="N: tensor parallelism, a (dp = world / N, tp = N) mesh, the model's TP plan for "
                        "every system (default: none)")  # fmt: skip
    parser.add_argument("--ep", type=int, default=None,
                        help="N: expert parallelism, experts sharded over an ep mesh dimension of size N, with "
                        "the model's own EP setup for every system (torchtitan's MoE models; default: none)")  # fmt: skip
    parser.add_argument("--loss-parallel", action="store_true",
                        help="with --tp: the logits sharded on the vocabulary, the loss under loss_parallel()")  # fmt: skip
    parser.add_argument("--fxshard-tree", default=None,
                        help="import fxshard from this folder (a baseline commit's files, see bench/matrix.py)")  # fmt: skip
    parser.add_argument("--unit-mb", type=float, default=None, help="fxshard.compile(unit_mb=...)")
    parser.add_argument(
        "--fake-world",
        type=int,
        default=None,
        help="one process, a fake process group of this many ranks: memory, and host time between trees "
        "of one system (no communication runs, and the systems train on different numbers, so losses and "
        "the times of two systems mean nothing)",
    )
    parser.add_argument(
        "--memory-step",
        type=int,
        default=None,
        help="trace this step's allocations and report who holds its peak (bench/memtrace.py); "
        "pick a warm-up step, since recording slows it",
    )
    return parser, parser.parse_args()


# Options the driver passes on to each system's process as they were given.
FORWARDED = ("model", "device", "batch", "prefetch", "unit_mb", "profile", "profile_host", "memory_step", "fake_world",
             "frozen_layers", "micro_batches", "strategy", "optimizer", "mesh", "tp", "ep", "loss_parallel", "fxshard_tree",
             "capturable")  # fmt: skip
# What an outer torchrun sets for its workers; the driver's own torchrun sets its own.
TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # fmt: skip


def child_command(args: argparse.Namespace, system: str, out: Path) -> list[str]:
    flags = [f"--only-system={system}", f"--out={out}"]
    for key in FORWARDED:
        value = getattr(args, key, None)
        if value is True:
            flags.append(f"--{key.replace('_', '-')}")
        elif value not in (None, 0, False):
            flags.append(f"--{key.replace('_', '-')}={value}")
    script = str(Path(__file__).resolve())
    if args.fake_world:
        return [sys.executable, script, *flags]
    nproc = args.nproc_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    nproc = nproc or (torch.cuda.device_count() if args.device == "cuda" else 2)
    return [*torchrun(nproc), script, *flags]


def torchrun(nproc: int) -> list[str]:
    """The torchrun command that starts each system, with BENCH_TORCHRUN_ARGS
    added (``--numa-binding=node``: each rank on the CPUs near its GPU)."""
    extra = shlex.split(os.environ.get("BENCH_TORCHRUN_ARGS", ""))
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *extra]


def host_placement() -> dict:
    """Where this rank's process runs: how many CPUs it may use, the CPU it
    is on now and that CPU's NUMA node. Host-bound steps of one system differ
    by up to 1.5x from one process to the next (every host phase alike, the
    optimizer's included); this is what to compare them by."""
    cpu = node = None
    with contextlib.suppress(OSError, IndexError, ValueError):
        cpu = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[36])
        node = next(int(p.name[4:]) for p in Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*"))
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return dict(cpus=affinity, cpu=cpu, numa_node=node)


def run_child(command: list[str], timeout: float | None) -> int:
    """Runs one system's process; on a timeout, stops it (torchrun stops its workers on SIGTERM)."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
    proc = subprocess.Popen(command, env=env)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"timed out after {timeout} s: {' '.join(command)}", flush=True)
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        return 124


def drive(args: argparse.Namespace, systems: list[str]) -> int:
    """Runs each system in a process of its own, ``--repeat`` times
    interleaved, and merges their JSON; returns the number of failed runs."""
    meta: dict = {}
    results, failures = [], []

    def write() -> None:  # after every run, so that a later failure keeps the earlier results
        if args.out:
            meta.update(processes="one per system and run", systems=systems, repeat=args.repeat)
            Path(args.out).write_text(json.dumps(dict(meta=meta, results=results, failures=failures), indent=1))

    order = [(run, system) for run in range(args.repeat) for system in systems]
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for run, system in order:
            out = Path(tmp) / f"{run}-{system}.json"
            command = child_command(args, system, out)
            print(f"== {system}, run {run + 1} of {args.repeat}: {' '.join(command)}", flush=True)
            returncode = run_child(command, args.timeout)
            if returncode == 0 and out.exists():
                child = json.loads(out.read_text())
                meta = meta or child["meta"]
                results.extend({**r, "run": run} for r in child["results"])
            else:
                failures.append(dict(system=system, run=run, returncode=returncode))
                print(f"== {system}, run {run + 1}: failed (exit status {returncode})", flush=True)
            write()
    if results:
        print(table(results))
    if args.repeat > 1 and results:
        print("\n" + repeats(results))
    for f in failures:
        print(f"failed: {f['system']}, run {f['run'] + 1}, exit status {f['returncode']}")
    return len(failures)


def run_one(args: argparse.Namespace, system: str) -> None:
    """Runs one system in this process (and its torchrun siblings)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.fake_world:
        if DEVICE == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("fake", store=compat.fake_store(), rank=0, world_size=args.fake_world)
    elif DEVICE == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    tp_mesh = ep_meshes = None
    if EP > 1:  # torchtitan's dense ("dp",) and sparse ("efsdp", "ep") meshes over the same ranks
        if dist.get_world_size() % EP:
            raise ValueError(f"--ep {EP} does not divide {dist.get_world_size()} ranks")
        dense = init_device_mesh(DEVICE, (dist.get_world_size(),), mesh_dim_names=("dp",))
        sparse = init_device_mesh(DEVICE, (dist.get_world_size() // EP, EP), mesh_dim_names=("efsdp", "ep"))
        mesh, ep_meshes = dense["dp"], (sparse["ep"], sparse["efsdp"])
    elif TP > 1:  # ("dp", "tp") or ("replicate", "shard", "tp"); the systems shard data-parallel over the rest
        if dist.get_world_size() % TP or (MESH and MESH[0] * MESH[1] * TP != dist.get_world_size()):
            raise ValueError(f"--tp {TP}{f' --mesh {args.mesh}' if MESH else ''} does not divide "
                             f"{dist.get_world_size()} ranks")  # fmt: skip
        names = ("replicate", "shard") if MESH else ("dp",)
        grid = init_device_mesh(DEVICE, (*(MESH or (dist.get_world_size() // TP,)), TP), mesh_dim_names=(*names, "tp"))
        mesh, tp_mesh = grid[names], grid["tp"]
    elif MESH is None:
        mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
    else:
        mesh = init_device_mesh(DEVICE, MESH, mesh_dim_names=("replicate", "shard"))
    cuda = DEVICE == "cuda"
    meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu", gpus=dist.get_world_size(),
                torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else "-",
                precision="bf16 compute, fp32 reduce",
                nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"), fxshard_kwargs=FXSHARD_KWARGS,
                fake_world=args.fake_world, fxshard_tree=FXSHARD_TREE,
                torchrun_args=os.environ.get("BENCH_TORCHRUN_ARGS"),
                alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"))  # fmt: skip
    placement = [host_placement()]
    if not args.fake_world:
        placement = [None] * dist.get_world_size()
        dist.all_gather_object(placement, host_placement())
    meta["host_placement"] = placement  # per rank
    result = run_system(system, args.model, mesh, args.batch, tp_mesh, ep_meshes)
    if dist.get_rank() == 0:
        print(table([result]), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(dict(meta=meta, results=[result]), indent=1))
    dist.destroy_process_group()


def main() -> None:
    parser, args = parse_args()
    global DEVICE, PROFILE, PROFILE_HOST, MEMORY_STEP, FROZEN_LAYERS, MICRO_BATCHES, STRATEGY, OPTIMIZER, MESH
    global CAPTURABLE_OPTIMIZER, TP, LOSS_PARALLEL, EP
    DEVICE = args.device
    MICRO_BATCHES = args.micro_batches or 1
    FROZEN_LAYERS = args.frozen_layers
    STRATEGY, OPTIMIZER, CAPTURABLE_OPTIMIZER = args.strategy, args.optimizer, args.capturable
    MESH = tuple(int(n) for n in args.mesh.split(",")) if args.mesh else None
    TP, LOSS_PARALLEL = args.tp or 1, args.loss_parallel
    if TP > 1 and MODELS[args.model]().tp_plan is None:
        parser.error(f"--tp: {args.model} has no TP plan (ModelSpec.tp_plan in bench/models.py; the Llamas have one)")
    EP = args.ep or 1
    if EP > 1 and MODELS[args.model]().ep_plan is None:
        parser.error(f"--ep: {args.model} has no expert-parallel setup (ModelSpec.ep_plan in bench/models.py; "
                     f"torchtitan's MoE models have one)")  # fmt: skip
    if EP > 1 and (TP > 1 or MESH):
        parser.error("--ep with --tp or --mesh: not benchmarked (fxshard refuses EP with TP or HSDP)")
    if LOSS_PARALLEL and TP == 1:
        parser.error("--loss-parallel shards the logits over the tp mesh dimension: give --tp too")
    PROFILE, PROFILE_HOST = args.profile, args.profile_host
    if PROFILE_HOST and not PROFILE:
        parser.error("--profile-host profiles the steps that --profile N names: give --profile too")
    MEMORY_STEP = args.memory_step
    for key, value in (("prefetch", args.prefetch), ("unit_mb", args.unit_mb)):
        if value is not None:
            FXSHARD_KWARGS[key] = value
    systems = [args.only_system] if args.only_system else args.systems.split(",")
    if unknown := set(systems) - set(ALL_SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}; choose from {', '.join(ALL_SYSTEMS)}")
    if DEVICE == "cpu" and (graphed := [s for s in systems if s in GRAPHED]):
        parser.error(f"{', '.join(graphed)} captures a CUDA graph, which needs --device cuda; "
                     f"leave it out of --systems on CPU (fxshard_capturable runs the same step uncaptured)")  # fmt: skip
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: give 1 or more")
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    if args.only_system or (under_torchrun and len(systems) == 1 and args.repeat == 1):
        run_one(args, systems[0])
        return
    if under_torchrun and os.environ.get("WORLD_SIZE") != os.environ.get("LOCAL_WORLD_SIZE"):
        parser.error("several systems under a multi-node torchrun: start one torchrun per system (--systems X)")
    if under_torchrun and os.environ.get("LOCAL_RANK") != "0":
        return  # local rank 0 drives; see the module docstring
    sys.exit(1 if drive(args, systems) else 0)


if __name__ == "__main__":
    main()
