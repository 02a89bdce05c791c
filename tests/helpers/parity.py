"""Sharded training against an unsharded reference, run inside each rank.

Each rank trains the fxshard model on its own batch. The reference is the
same model, unsharded, in the same process: it sees every rank's batch and
averages their gradients, which is what data-parallel training must compute.
Loss, every gradient and the parameters after each AdamW step must match.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fxshard
from examples.llama import lm_loss
from tests.helpers import models, runtime

ATOL, RTOL = 2e-5, 1e-4


@dataclass(frozen=True)
class Scenario:
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], Any]
    loss: Callable[[Any, Any], torch.Tensor]
    compile_kwargs: dict = field(default_factory=dict)
    freeze: tuple[str, ...] = ()
    forwards_per_step: int = 1  # >1: several forwards, one backward
    # >1: micro-batches, each with its own backward, then one optimizer step;
    # no_sync: all but the last under set_requires_gradient_sync(False).
    micro_batches: int = 1
    no_sync: bool = False
    atol: float = ATOL
    rtol: float = RTOL
    # bf16: Adam turns rounding noise on a near-zero gradient into a full
    # +-lr step, so a few elements may differ; allow this fraction of them.
    outlier_fraction: float = 0.0
    clip_norm: float | None = None  # clip_grad_norm_ on the shards and on the reference
    prepare: Callable[[nn.Module], Any] | None = None  # applied to model and reference, before compile
    steps: int = 3
    units: Callable[[nn.Module], list[nn.Module]] | None = None  # fxshard.compile(units=...) of the model
    # How fxshard must read (see [Note: two ways to read]): True, sequenced
    # (graph breaks); False, one graph; None, not checked.
    sequenced: bool | None = None
    # Compare parameters after the steps only at elements whose reference
    # gradient exceeded this at some step (None: every element). Adam turns
    # rounding noise on a zero gradient (a dead ReLU, a bias before a norm)
    # into a step of about lr, so those elements say nothing about sharding.
    param_grad_floor: float | None = None
    # HSDP: a (replicas, world_size // replicas) mesh named ("replicate", "shard").
    replicas: int | None = None
    # A (world_size // tp, tp) mesh named ("dp", "tp"), the model compiled on
    # mesh["dp"], as FSDP2 takes a 2-D mesh's slice: each tp coordinate's
    # ranks are a data-parallel group of their own (the model has no TP plan).
    tp: int | None = None


def _tokens(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 37, (2, 9), generator=gen)


def _mse(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _ragged_tokens(gen: torch.Generator) -> torch.Tensor:
    """Even steps: 9 tokens per row on every rank. Odd steps: 5 + rank, so
    ranks look up different token counts (the generator's seed encodes the
    step and rank; see train_and_compare)."""
    seed = gen.initial_seed()
    step, rank = seed // 1000, seed % 1000 // 10
    return torch.randint(0, 37, (2, 9 if step % 2 == 0 else 5 + rank), generator=gen)


def _labeled_tokens(gen: torch.Generator) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 41, (2, 9), generator=gen)
    return {"tokens": tokens, "labels": tokens}


def _returned_loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return out  # the model computed the loss from labels=


LLAMA = dict(make_model=models.TinyLlama, make_batch=_tokens, loss=lm_loss)


def _checkpointed(graph_break: bool = True, reentrant: bool = False, backend: str = "aot_eager") -> Scenario:
    """models.CheckpointedLlama: checkpointing in eager code, recomputed on the sequenced path."""
    return Scenario(make_model=lambda: models.CheckpointedLlama(graph_break, reentrant), make_batch=_tokens,
                    loss=lm_loss, compile_kwargs=dict(backend=backend), sequenced=True, steps=2)  # fmt: skip


UNTIED = dict(make_model=lambda: models.TinyLlama(tie=False), loss=lm_loss)
MAMBA = dict(make_model=models.MambaStyle, make_batch=lambda g: torch.randn(2, 7, 10, generator=g), loss=_mse)
SCENARIOS: dict[str, Scenario] = {
    "llama_tied": Scenario(**LLAMA, compile_kwargs=dict(backend="aot_eager"), clip_norm=0.5, sequenced=False),
    "llama_tied_keep_full": Scenario(**LLAMA, compile_kwargs=dict(backend="aot_eager", reshard_after_forward=False)),
    "llama_tied_inductor": Scenario(**LLAMA, compile_kwargs=dict(backend="inductor", compile_blocks_once=False)),
    "llama_eager_accessors": Scenario(**LLAMA, compile_kwargs=dict(backend="eager")),
    "mamba_direct_reads": Scenario(**MAMBA, compile_kwargs=dict(backend="aot_eager")),
    "mamba_direct_reads_inductor": Scenario(**MAMBA, compile_kwargs=dict(backend="inductor")),
    "uneven_and_empty": Scenario(
        make_model=models.Uneven,
        make_batch=lambda g: torch.randn(3, 5, generator=g),
        loss=_mse,
        compile_kwargs=dict(backend="aot_eager"),
    ),
    "uneven_and_empty_keep_full": Scenario(
        make_model=models.Uneven,
        make_batch=lambda g: torch.randn(3, 5, generator=g),
        loss=_mse,
        compile_kwargs=dict(backend="aot_eager", reshard_after_forward=False),
    ),
    # Untied embedding: the lookup moves tokens, not the table (see [Note:
    # sharded lookups]); with ragged token counts it gathers on odd steps.
    "llama_untied_ragged": Scenario(
        **UNTIED, make_batch=_ragged_tokens, compile_kwargs=dict(backend="aot_eager"), steps=4
    ),
    "embedding_empty_shard": Scenario(
        make_model=models.SmallVocab,
        make_batch=lambda g: torch.randint(0, 3, (2, 7), generator=g),
        loss=_mse,
        compile_kwargs=dict(backend="aot_eager"),
    ),
    "frozen": Scenario(**LLAMA, compile_kwargs=dict(backend="aot_eager"), freeze=("embed.", "layers.0.attn.")),
    "frozen_sharded": Scenario(
        **LLAMA, compile_kwargs=dict(backend="aot_eager", shard_frozen=True), freeze=("embed.", "layers.0.attn.")
    ),
    # Replicated parameters (fxshard.no_shard): a whole layer and the final
    # norm, beside sharded ones in one unit; clip_grad_norm_ over both kinds.
    "no_shard": Scenario(
        **LLAMA,
        compile_kwargs=dict(backend="aot_eager", unit_mb=0.003),
        prepare=lambda m: (fxshard.no_shard(m.layers[0]), fxshard.no_shard(m.norm.weight)),
        clip_norm=0.5,
    ),
    # Replicated reads inside outlined layers, in bf16.
    "no_shard_bf16": Scenario(
        **UNTIED,
        make_batch=_tokens,
        atol=3e-2,
        rtol=3e-2,
        outlier_fraction=0.01,
        compile_kwargs=dict(backend="aot_eager", mp_policy=fxshard.MixedPrecision(torch.bfloat16, torch.float32)),
        prepare=lambda m: [fxshard.no_shard(layer.mlp) for layer in m.layers],
        sequenced=False,
    ),
    "scalar_parameter": Scenario(
        make_model=models.Scaled,
        make_batch=lambda g: torch.randn(3, 5, generator=g),
        loss=_mse,
        compile_kwargs=dict(backend="aot_eager"),
    ),
    "whole_reads_inductor": Scenario(
        make_model=models.Tempered,
        make_batch=lambda g: torch.randn(3, 5, generator=g),
        loss=_mse,
        compile_kwargs=dict(backend="inductor"),
        prepare=lambda m: fxshard.no_shard(m.gate),
    ),
    "transposed_parameter": Scenario(
        make_model=models.Transposed,
        make_batch=lambda g: torch.randn(3, 7, generator=g),
        loss=_mse,
        compile_kwargs=dict(backend="aot_eager"),
    ),
    "graph_breaks_no_shard": Scenario(
        make_model=models.GraphBreaks,
        make_batch=lambda g: torch.randn(4, 6, generator=g),
        loss=_mse,
        compile_kwargs=dict(backend="aot_eager"),
        prepare=lambda m: fxshard.no_shard(m.second),
        sequenced=True,
    ),
    "graph_breaks": Scenario(
        make_model=models.GraphBreaks,
        make_batch=lambda g: torch.randn(4, 6, generator=g),
        loss=_mse,
        compile_kwargs=dict(backend="aot_eager"),
        sequenced=True,
    ),
    "routed_experts": Scenario(
        make_model=models.RoutedExperts,
        make_batch=lambda g: torch.randn(1, 3, 6, generator=g),
        loss=_mse,
        compile_kwargs=dict(backend="aot_eager"),
        sequenced=True,
    ),
    "two_forwards_one_backward": Scenario(**LLAMA, compile_kwargs=dict(backend="aot_eager"), forwards_per_step=2),
    # Activation checkpointing that runs eagerly on the sequenced path, its
    # recompute after the call (see [Note: recomputes read through the
    # sequencer]): a graph break inside each checkpointed block, torch's
    # default non-reentrant checkpoint and the reentrant one, and the eager
    # backend. Each raised CheckpointError or aborted a rank before.
    "checkpoint_graph_break": _checkpointed(),
    "checkpoint_graph_break_reentrant": _checkpointed(reentrant=True),
    "checkpoint_eager_backend": _checkpointed(graph_break=False, backend="eager"),
    # Gradient accumulation over 3 micro-batches: reducing each one, and
    # reducing only the last (set_requires_gradient_sync(False) before the
    # others; see [Note: accumulation without sync]).
    "accumulate_sync_each": Scenario(**LLAMA, compile_kwargs=dict(backend="aot_eager"), micro_batches=3),
    "accumulate_no_sync": Scenario(
        **LLAMA,
        compile_kwargs=dict(backend="aot_eager", unit_mb=0.003, compile_blocks_once=False),
        micro_batches=3,
        no_sync=True,
        clip_norm=0.5,
    ),
    # Replicated and frozen parameters, bf16, an untied table (gathered, not
    # looked up sharded, while accumulating), outlined layers.
    "accumulate_no_sync_mixed": Scenario(
        **UNTIED,
        make_batch=_tokens,
        atol=3e-2,
        rtol=3e-2,
        outlier_fraction=0.01,
        compile_kwargs=dict(backend="aot_eager", mp_policy=fxshard.MixedPrecision(torch.bfloat16, torch.float32)),
        prepare=lambda m: fxshard.no_shard(m.layers[0].mlp),
        freeze=("layers.1.attn.",),
        micro_batches=3,
        no_sync=True,
    ),
    "accumulate_no_sync_uneven": Scenario(
        make_model=models.Uneven,
        make_batch=lambda g: torch.randn(3, 5, generator=g),
        loss=_mse,
        compile_kwargs=dict(backend="aot_eager"),
        micro_batches=2,
        no_sync=True,
    ),
    "accumulate_no_sync_sequenced": Scenario(
        make_model=models.GraphBreaks,
        make_batch=lambda g: torch.randn(4, 6, generator=g),
        loss=_mse,
        compile_kwargs=dict(backend="aot_eager"),
        prepare=lambda m: fxshard.no_shard(m.second),
        micro_batches=3,
        no_sync=True,
        sequenced=True,
    ),
    "mixed_precision_bf16": Scenario(
        **LLAMA,
        atol=3e-2,
        rtol=3e-2,
        outlier_fraction=0.01,
        compile_kwargs=dict(backend="aot_eager", mp_policy=fxshard.MixedPrecision(torch.bfloat16, torch.float32)),
    ),
    # Small units, two stages in flight: casts, bucketing and prefetch; the
    # layers outlined (Inductor compiles one body). llama_tied_inductor
    # compiles flat graphs (compile_blocks_once=False).
    "mixed_precision_bf16_inductor": Scenario(
        **UNTIED,
        make_batch=_tokens,
        atol=3e-2,
        rtol=3e-2,
        outlier_fraction=0.01,
        compile_kwargs=dict(
            backend="inductor",
            mp_policy=fxshard.MixedPrecision(torch.bfloat16, torch.float32),
            unit_mb=0.003,
            prefetch=2,
            compile_blocks_once=True,
        ),
    ),
    # Units (one all-gather each, a reduce-scatter per block) at several sizes and
    # prefetch depths, in flat graphs (an outlined layer is never split);
    # the default 256 MiB makes each small model one unit.
    "units_per_param_prefetch0": Scenario(
        **LLAMA, compile_kwargs=dict(backend="aot_eager", unit_mb=1e-6, prefetch=0, compile_blocks_once=False)
    ),
    "units_small_prefetch2": Scenario(
        **LLAMA,
        compile_kwargs=dict(backend="aot_eager", unit_mb=0.003, prefetch=2, compile_blocks_once=False),
        clip_norm=0.5,
    ),
    "units_explicit": Scenario(  # nested: layers.0.attn is a unit inside the unit of layers.0
        **LLAMA,
        compile_kwargs=dict(backend="aot_eager", unit_mb=0.002),
        units=lambda m: [m.layers[0], m.layers[0].attn, m.layers[1]],
    ),
    # Each layer a call of one compiled body (see [Note: outlined blocks]);
    # the default, explicit here since blocks_once_gathers_again checks it.
    "blocks_once": Scenario(
        **LLAMA, compile_kwargs=dict(backend="aot_eager", unit_mb=0.003, prefetch=2, compile_blocks_once=True)
    ),
    # The default options on a plain nn.Sequential: its activations are alike
    # blocks without weights (see [Note: outlined blocks]) and Inductor compiles.
    "sequential_defaults": Scenario(
        make_model=lambda: nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)),
        make_batch=lambda g: torch.randn(8, 32, generator=g),
        loss=_mse,
    ),
    # Attention, Mamba-style direct reads and grouped-expert MoE in one
    # graph, the loss computed inside forward: what a CUDA graph can capture.
    "hybrid": Scenario(
        make_model=models.Hybrid,
        make_batch=_labeled_tokens,
        loss=_returned_loss,
        compile_kwargs=dict(backend="aot_eager"),
        sequenced=False,
    ),
    # HSDP (see [Note: HSDP]): sharded within the "shard" dimension, averaged
    # across the "replicate" one. Replicated and frozen parameters, units,
    # accumulation without sync and clipping; then bf16 with sharded lookups
    # of ragged token counts; then sequenced reads.
    "hsdp": Scenario(
        **LLAMA,
        compile_kwargs=dict(backend="aot_eager", unit_mb=0.003),
        prepare=lambda m: fxshard.no_shard(m.layers[0].mlp),
        freeze=("layers.1.attn.",),
        micro_batches=2,
        no_sync=True,
        clip_norm=0.5,
        replicas=2,
        sequenced=False,
    ),
    "hsdp_no_sync_bf16": Scenario(
        **UNTIED,
        make_batch=_ragged_tokens,
        atol=3e-2,
        rtol=3e-2,
        outlier_fraction=0.01,
        compile_kwargs=dict(backend="aot_eager", mp_policy=fxshard.MixedPrecision(torch.bfloat16, torch.float32)),
        micro_batches=2,
        no_sync=True,
        replicas=2,
    ),
    # Each unit's average across replicas runs inside the backward graph (see
    # [Note: HSDP]): with every micro-batch synced (the graph of the SYNC
    # phase, which the two above never run), untied with sharded lookups, a
    # replicated norm and a frozen layer; then ZeRO-2, each way; then Inductor.
    "hsdp_sync_each": Scenario(
        **UNTIED,
        make_batch=_tokens,
        compile_kwargs=dict(backend="aot_eager", unit_mb=0.003),
        prepare=lambda m: fxshard.no_shard(m.norm),
        freeze=("layers.0.attn.",),
        micro_batches=2,
        clip_norm=0.5,
        replicas=2,
        sequenced=False,
    ),
    "hsdp_zero2": Scenario(
        **LLAMA,
        compile_kwargs=dict(backend="aot_eager", unit_mb=0.003, zero_stage=2),
        prepare=lambda m: fxshard.no_shard(m.layers[0].mlp),
        freeze=("layers.1.attn.",),
        micro_batches=2,
        replicas=2,
        sequenced=False,
    ),
    "hsdp_zero2_no_sync": Scenario(
        **UNTIED,
        make_batch=_tokens,
        compile_kwargs=dict(backend="aot_eager", zero_stage=2),
        prepare=lambda m: fxshard.no_shard(m.norm),
        micro_batches=3,
        no_sync=True,
        replicas=2,
        sequenced=False,
    ),
    "hsdp_inductor": Scenario(
        **UNTIED,
        make_batch=_tokens,
        compile_kwargs=dict(backend="inductor", unit_mb=0.003),
        prepare=lambda m: fxshard.no_shard(m.norm),
        micro_batches=2,
        replicas=2,
        sequenced=False,
    ),
    "hsdp_sequenced": Scenario(
        make_model=models.GraphBreaks,
        make_batch=lambda g: torch.randn(4, 6, generator=g),
        loss=_mse,
        compile_kwargs=dict(backend="aot_eager"),
        prepare=lambda m: fxshard.no_shard(m.second),
        micro_batches=2,
        no_sync=True,
        replicas=2,
        sequenced=True,
    ),
    # ZeRO-1 (see [Note: ZeRO-1]): full copies gathered once per step, two
    # micro-batches each reduced; replicated and frozen parameters beside;
    # clipping. Then empty shards, and bf16 HSDP, each accumulating without sync.
    "zero1": Scenario(
        **LLAMA,
        compile_kwargs=dict(backend="aot_eager", zero_stage=1, unit_mb=0.003),  # several buckets
        prepare=lambda m: fxshard.no_shard(m.layers[0].mlp),
        freeze=("layers.1.attn.",),
        micro_batches=2,
        clip_norm=0.5,
        sequenced=False,
    ),
    # Inductor: the kept copies are graph inputs that the backward reads in
    # place, in outlined layers too (none saved as an intermediate Inductor may reuse).
    "zero1_inductor": Scenario(
        **LLAMA,
        compile_kwargs=dict(backend="inductor", zero_stage=1, unit_mb=0.003),
        micro_batches=2,
        sequenced=False,
    ),
    "zero1_uneven": Scenario(  # empty shards (at 4 ranks) in coalesced gathers and reduces
        make_model=models.Uneven,
        make_batch=lambda g: torch.randn(3, 5, generator=g),
        loss=_mse,
        compile_kwargs=dict(backend="aot_eager", zero_stage=1, unit_mb=1e-4),
        micro_batches=2,
        no_sync=True,
    ),
    "zero1_bf16_hsdp": Scenario(
        **UNTIED,
        make_batch=_tokens,
        atol=3e-2,
        rtol=3e-2,
        outlier_fraction=0.01,
        compile_kwargs=dict(
            backend="aot_eager", zero_stage=1, mp_policy=fxshard.MixedPrecision(torch.bfloat16, torch.float32)
        ),
        micro_batches=2,
        no_sync=True,
        replicas=2,
    ),
    # Side groups (the reduce communicator, ZeRO-1's kept copies) beside each slice's own group.
    "dp_submesh": Scenario(**LLAMA, compile_kwargs=dict(backend="aot_eager", unit_mb=0.003), tp=2),
    "dp_submesh_zero1": Scenario(
        **UNTIED, make_batch=_tokens, compile_kwargs=dict(backend="aot_eager", zero_stage=1), tp=2
    ),
    "hsdp_one_replica": Scenario(**LLAMA, compile_kwargs=dict(backend="aot_eager", unit_mb=0.003), replicas=1),
    "uneven_units_prefetch1": Scenario(
        make_model=models.Uneven,
        make_batch=lambda g: torch.randn(3, 5, generator=g),
        loss=_mse,
        compile_kwargs=dict(backend="aot_eager", unit_mb=1e-4, prefetch=1),
    ),
}


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str, sc: Scenario) -> None:
    if sc.outlier_fraction:
        off = ~torch.isclose(actual, expected, atol=sc.atol, rtol=sc.rtol)
        assert off.float().mean() <= sc.outlier_fraction, f"{what}: {int(off.sum())}/{off.numel()} elements differ"
        assert torch.isfinite(actual).all(), f"{what}: non-finite values"
        return
    torch.testing.assert_close(actual, expected, atol=sc.atol, rtol=sc.rtol, msg=lambda m: f"{what}: {m}")


def _recording(mismatches: list[str]) -> Callable[..., None]:
    """A ``_close`` that records a mismatch and goes on: every rank then
    finishes the run and issues the same collectives, where raising on one
    rank (a loss compare is per rank) would leave the others waiting."""

    def close(actual: torch.Tensor, expected: torch.Tensor, what: str, sc: Scenario) -> None:
        try:
            _close(actual, expected, what, sc)
        except AssertionError as error:
            mismatches.append(str(error))

    return close


def _call(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(batch)


def _to(batch: Any, device: torch.device) -> Any:
    return {k: v.to(device) for k, v in batch.items()} if isinstance(batch, dict) else batch.to(device)


def _step_loss(model: nn.Module, batches: list, sc: Scenario) -> torch.Tensor:
    return sum(sc.loss(_call(model, b), b) for b in batches)


def _reference(sc: Scenario) -> nn.Module:
    model = sc.make_model()
    for name, param in model.named_parameters():
        param.requires_grad_(not name.startswith(sc.freeze))
    if "mp_policy" in sc.compile_kwargs:  # compute where fxshard computes: bf16 weights
        model = model.to(sc.compile_kwargs["mp_policy"].param_dtype)
    return model


def hsdp_mesh(device: torch.device, world_size: int, replicas: int) -> DeviceMesh:
    assert world_size % replicas == 0, f"{replicas} replicas do not divide {world_size} ranks"
    return init_device_mesh(device.type, (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))


def dp_mesh(device: torch.device, world_size: int, tp: int | None) -> DeviceMesh | None:
    """``mesh["dp"]`` of a (dp, tp) mesh over every rank; None without ``tp``."""
    if not tp:
        return None
    assert world_size % tp == 0, f"tp {tp} does not divide {world_size} ranks"
    return init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))["dp"]


def _device(rank: int) -> torch.device:
    return torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")


def train_and_compare(rank: int, world_size: int, sc: Scenario, mismatches: list[str] | None = None) -> dict:
    """Train ``sc`` sharded and unsharded; raise at the first difference, or,
    with ``mismatches``, append each difference to it and finish the run."""
    device, steps = _device(rank), sc.steps
    close = _close if mismatches is None else _recording(mismatches)
    torch.manual_seed(0)
    model = sc.make_model().to(device)
    for name, param in model.named_parameters():
        param.requires_grad_(not name.startswith(sc.freeze))
    torch.manual_seed(0)
    ref = _reference(sc).to(device)
    ref.load_state_dict({k: v.to(p.dtype) for (k, v), p in zip(model.state_dict().items(), ref.state_dict().values())})
    master = [p.detach().float().clone().requires_grad_(p.requires_grad) for p in ref.parameters()]
    # Per parameter, the elements compared after the steps: all of a frozen
    # one; where the gradient ever exceeded param_grad_floor, of the others.
    compared = [torch.full_like(m, sc.param_grad_floor is None or not m.requires_grad, dtype=torch.bool)
                for m in master]  # fmt: skip
    if sc.prepare is not None:
        sc.prepare(model)
        sc.prepare(ref)
    mesh = hsdp_mesh(device, world_size, sc.replicas) if sc.replicas else dp_mesh(device, world_size, sc.tp)
    fxshard.compile(model, **sc.compile_kwargs, **({"units": sc.units(model)} if sc.units else {}),
                    **({"mesh": mesh} if mesh is not None else {}))  # fmt: skip
    # The ranks whose gradients this rank's are averaged with: its data-parallel group.
    dp_ranks = [r for r in range(world_size) if r % (sc.tp or 1) == rank % (sc.tp or 1)]
    # eps=1e-6, not 1e-8: Adam's g / (|g| + eps) would turn fp32 reduction-order
    # noise on gradients near 1e-8 into update differences of ~1e-5 that grow
    # step by step; with 1e-6 they stay ~1e-7 and the fp32 tolerance holds.
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, eps=1e-6)
    ref_opt = torch.optim.AdamW([p for p in master if p.requires_grad], lr=1e-2, eps=1e-6)
    for step in range(steps):
        per_step = sc.forwards_per_step * sc.micro_batches
        gens = [torch.Generator().manual_seed(1000 * step + 10 * r + i) for r in range(world_size)
                for i in range(per_step)]  # fmt: skip
        batches = [_to(sc.make_batch(g), device) for g in gens]
        per_rank = [batches[r * per_step : (r + 1) * per_step] for r in range(world_size)]
        mine = per_rank[rank]
        micro = [mine[i : i + sc.forwards_per_step] for i in range(0, per_step, sc.forwards_per_step)]
        loss = 0
        for i, part in enumerate(micro):
            if sc.no_sync:
                model.set_requires_gradient_sync(i == len(micro) - 1)
            micro_loss = _step_loss(model, part, sc)
            micro_loss.backward()
            loss = loss + micro_loss.detach()
        ref_losses = {r: _step_loss(ref, per_rank[r], sc) for r in dp_ranks}
        (sum(ref_losses.values()) / len(dp_ranks)).backward()
        close(loss.detach().float(), ref_losses[rank].detach().float(), f"step {step} loss", sc)
        for (name, p), q, m, mask in zip(model.named_parameters(), ref.parameters(), master, compared):
            if q.grad is None:
                assert p.grad is None, f"{name}: frozen parameter got a gradient"
                continue
            assert p.grad.dtype == p.dtype, f"{name}: grad dtype {p.grad.dtype}, shard dtype {p.dtype}"
            close(p.grad.full_tensor(), q.grad.float(), f"step {step} grad of {name}", sc)
            m.grad = q.grad.float()
            if sc.param_grad_floor is not None:
                mask |= m.grad.abs() > sc.param_grad_floor
        if sc.clip_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), sc.clip_norm)
            ref_norm = torch.nn.utils.clip_grad_norm_([m for m in master if m.grad is not None], sc.clip_norm)
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            close(norm, ref_norm, f"step {step} clip_grad_norm_", sc)
            assert ref_norm > sc.clip_norm, "the test must actually clip"
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()  # a parameter unused next step must not keep this step's gradient
        ref.zero_grad()
        with torch.no_grad():
            for q, m in zip(ref.parameters(), master):
                q.copy_(m)
    for (name, p), m, mask in zip(model.named_parameters(), master, compared):
        close(p.detach().full_tensor()[mask], m.detach()[mask], f"param {name} after {steps} steps", sc)
    state, ref_state = model.state_dict(), ref.state_dict()
    assert list(state) == list(ref_state), "state_dict keys must keep their names"
    named = {n: (m, mask) for (n, _), m, mask in zip(ref.named_parameters(), master, compared)}
    for key, value in state.items():
        if key in named:
            m, mask = named[key]
            close(value.full_tensor()[mask], m.detach()[mask], f"state_dict[{key!r}]", sc)
    if sc.sequenced is not None:
        assert model.fxshard_plan.sequenced == sc.sequenced, f"expected sequenced={sc.sequenced}"
    return {"graphs": model.fxshard_plan.graphs, "model": model}


def eval_no_grad_check(rank: int, world_size: int) -> dict:
    """Forward under no_grad gathers, matches the reference, and reduces nothing."""
    device = _device(rank)
    torch.manual_seed(0)
    model = models.TinyLlama().to(device)
    ref = copy.deepcopy(model)
    fxshard.compile(model, backend="aot_eager")
    for length in (9, 5):
        tokens = torch.randint(0, 37, (2, length), generator=torch.Generator().manual_seed(rank + length)).to(device)
        with torch.no_grad():
            out = model(tokens)
        torch.testing.assert_close(out, ref(tokens), atol=ATOL, rtol=RTOL)
    reports = [g.reports["inference"] for g in model.fxshard_plan.graphs]
    assert reports and all(r.count("reduce") == 0 and r.count("unshard") > 0 for r in reports), reports
    assert all(p.grad is None for p in model.parameters())
    return {}


def routed_experts_check(rank: int, world_size: int) -> dict:
    """Ranks route tokens to different experts, so they read different
    parameters; they still issue the same collectives and match the reference."""
    model = train_and_compare(rank, world_size, SCENARIOS["routed_experts"])["model"]
    seen: list = [None] * world_size
    dist.all_gather_object(seen, (model.experts_used, runtime.state(model).sequencer.gathers))
    if world_size > 1:
        assert len({tuple(s) for s, _ in seen}) > 1, f"every rank chose the same experts: {seen}"
    assert len({n for _, n in seen}) == 1, f"ranks issued different numbers of gathers: {seen}"
    return {}


def sharded_lookup_check(rank: int, world_size: int) -> dict:
    """llama_untied_ragged, and the way each lookup ran: the embedding is
    never gathered in the graphs; the lookups are sharded on steps where every
    rank has the same token count and gathered on the others."""
    from fxshard.runtime import embedding

    before = dict(embedding.stats)
    model = train_and_compare(rank, world_size, SCENARIOS["llama_untied_ragged"])["model"]
    ran = {k: embedding.stats[k] - before[k] for k in before}
    if world_size == 1:
        assert ran == {"sharded": 0, "gathered": 0}, ran
        return {}
    # 4 steps, a forward and a backward each: 2 steps sharded, 2 gathered.
    assert ran == {"sharded": 4, "gathered": 4}, ran
    graphs = model.fxshard_plan.graphs
    assert graphs and all(g.sharded_lookups == ("embed.weight",) for g in graphs), [g.sharded_lookups for g in graphs]
    assert "embed.weight" not in model.fxshard_plan.units.unit_of
    return {}


def blocks_once_check(rank: int, world_size: int) -> dict:
    """blocks_once, and how it compiled: both layers call one body; the
    backward gathers every weight the forward gathered but the last unit's,
    so the bodies save no full weight for backward."""
    model = train_and_compare(rank, world_size, SCENARIOS["blocks_once"])["model"]
    plan = model.fxshard_plan
    (record,) = plan.graphs
    assert record.outline.bodies == [["layers.0", "layers.1"]], record.outline
    if world_size == 1:
        return {}
    kept = plan.units.units[-1].names
    assert record.saved_full_weights == kept, (record.saved_full_weights, kept)
    forward = {s.param for s in record.reports["forward"].sites if s.kind == "unshard"}
    backward = {s.param for s in record.reports["backward"].sites if s.kind == "unshard"}
    assert backward == forward - set(kept), sorted(forward - set(kept) - backward)
    return {}


def _holders(obj: Any, depth: int = 30) -> str:
    """A chain of referrers from ``obj`` up to a module or a thread's frame:
    what keeps it alive (for the failure message)."""
    import gc
    import types

    mods = {id(m.__dict__): n for n, m in list(sys.modules.items()) if m is not None and n != "__main__"}
    parent: dict[int, int | None] = {id(obj): None}
    objs, frontier, root = {id(obj): obj}, [obj], None
    for _ in range(depth):
        nxt: list = []
        for o in frontier:
            for r in gc.get_referrers(o):
                if id(r) in parent or r is frontier or r is nxt or r is parent or r is objs:
                    continue
                if isinstance(r, types.FrameType) and r.f_code.co_filename == __file__:
                    continue
                parent[id(r)], objs[id(r)] = id(o), r
                if id(r) in mods or isinstance(r, types.FrameType):
                    root = id(r)
                    break
                nxt.append(r)
            if root is not None:
                break
        if root is not None or not nxt:
            break
        frontier = nxt
    chain, key = [], root
    while key is not None:
        r = objs[key]
        chain.append(f"module {mods[key]}" if key in mods else f"{type(r).__module__}.{type(r).__qualname__}")
        key = parent[key]
    return " <- ".join(reversed(chain)) if chain else "no root found"


def dropped_model_check(rank: int, world_size: int) -> dict:
    """A compiled, trained model that the user drops frees everything:
    its units (and so its flat shards), and on GPUs every byte it allocated,
    flat and with outlined blocks. torch keeps compiled functions after their
    model is gone; the benchmark found 8 GiB of an 8B model left behind."""
    import gc
    import weakref

    from examples.llama import Llama, LlamaConfig

    device = _device(rank)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    for blocks in (False, True):
        gc.collect()
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        torch.manual_seed(0)
        model = Llama(LlamaConfig(vocab=64, dim=64, layers=3, heads=4, hidden=96)).to(device)
        fxshard.compile(model, mp_policy=fxshard.MixedPrecision(torch.bfloat16, torch.float32), backend=backend,
                        compile_blocks_once=blocks)  # fmt: skip
        opt = torch.optim.AdamW(model.parameters())
        for step in range(2):
            tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(step)).to(device)
            lm_loss(model(tokens), tokens).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        units = weakref.ref(model.fxshard_plan.units) if model.fxshard_plan.units is not None else lambda: None
        del model, opt, tokens
        gc.collect()
        alive = units()
        assert alive is None, f"blocks={blocks}: the dropped model's units are alive: {_holders(alive)}"
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            left = torch.cuda.memory_allocated(device) - before
            assert left <= 0, f"blocks={blocks}: the dropped model left {left} bytes allocated"
    return {}


def _registry() -> tuple[dict[str, Callable[[int, int], Any]], dict[str, Scenario]]:
    from tests.helpers.hf_parity import HF_CHECKS, HF_SCENARIOS

    checks = {"eval_no_grad": eval_no_grad_check, "routed_experts_differ": routed_experts_check,
              "sharded_lookups": sharded_lookup_check, "blocks_once_gathers_again": blocks_once_check,
              "dropped_model_frees_memory": dropped_model_check,
              **HF_CHECKS}  # fmt: skip
    return checks, {**SCENARIOS, **HF_SCENARIOS}


def run_all(rank: int, world_size: int, names: list[str]) -> dict[str, str | None]:
    """Run each named check; map its name to None (passed) or the failure."""
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 parity: no TF32 on GPUs
    torch.backends.cudnn.allow_tf32 = False
    return run_each(rank, world_size, names, _run_one)


def _run_one(rank: int, world_size: int, name: str) -> None:
    base, _, compiler = name.partition("@")  # "llama_tied@inductor": another compiler
    checks, scenarios = _registry()
    if base in checks:
        checks[base](rank, world_size)
        return
    sc = scenarios[base]
    if compiler:
        sc = dataclasses.replace(sc, compile_kwargs={**sc.compile_kwargs, "backend": compiler})
    train_and_compare(rank, world_size, sc)


_TAIL = 30  # traceback lines printed where a case fails


def run_each(
    rank: int, world_size: int, names: list[str], run: Callable[[int, int, str], Any]
) -> dict[str, str | None]:
    """``run(rank, world_size, name)`` for each name, each from a clean dynamo;
    map each name to None (passed) or its traceback."""
    results: dict[str, str | None] = {}
    for name in names:
        # On stderr, which pytest shows when a rank dies: the check it was in.
        print(f"[rank {rank}/{world_size}] {name} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            run(rank, world_size, name)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
        print(
            f"[rank {rank}/{world_size}] {name} {'passed' if results[name] is None else 'FAILED'} "
            f"in {time.perf_counter() - start:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        if results[name] is not None:
            # Now, not only in the results: a rank that fails mid-step leaves the
            # others waiting in a collective, and a time limit then cuts the run
            # off before any results are reported.
            tail = "".join(f"[rank {rank}/{world_size}]   {line}\n" for line in results[name].splitlines()[-_TAIL:])
            print(tail, end="", file=sys.stderr, flush=True)
        torch._dynamo.reset()
    return results


def run_scenarios(rank: int, world_size: int, names: list[str], train: Callable[[int, int, Any], list[str]],
                  scenarios: dict[str, Any], checks: dict[str, Callable[[int, int], None]]) -> dict[str, str | None]:  # fmt: skip
    """``run_each`` over ``names``: a check of ``checks`` runs as it is, a
    scenario of ``scenarios`` through ``train(rank, world_size, scenario)``,
    which returns the differences it found (none: passed)."""

    def run(rank: int, world_size: int, name: str) -> None:
        if name in checks:
            checks[name](rank, world_size)
            return
        found = train(rank, world_size, scenarios[name])
        assert not found, "\n".join(found[:20])

    return run_each(rank, world_size, names, run)
