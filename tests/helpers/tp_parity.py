"""FSDP + TP training against an unsharded reference and against FSDP2 + the same TP plan, inside each rank.

The mesh is (dp, tp) over every rank. Each rank trains three copies of one
model, all loaded from the same full weights:
- fxshard: ``parallelize_module`` on ``mesh["tp"]``, then ``fxshard.compile(model, mesh["dp"])``;
- FSDP2: the same TP plan, then ``fully_shard(model, mesh=mesh["dp"])``;
- the reference: the full model, unsharded, on every rank. It runs every
  data-parallel rank's batch and averages their losses: what data-parallel
  training must compute. The ranks of one TP group (one dp index) see the
  same batch.
Loss, every gradient (``full_tensor()``), the parameters after each AdamW
step and the placements must match; mismatches are collected, not raised,
so that every rank finishes the run and issues the same collectives.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import fxshard
from examples.llama import lm_loss
from tests.helpers import tp_models
from tests.helpers.parity import run_scenarios


@dataclass(frozen=True)
class TPScenario:
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[torch.Generator], torch.Tensor]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    compile_kwargs: dict = field(default_factory=dict)
    tp: int = 2
    steps: int = 3
    atol: float = 2e-5
    rtol: float = 1e-4
    # bf16: Adam turns rounding noise on a near-zero gradient into a full
    # +-lr step, so a few elements may differ; allow this fraction of them.
    outlier_fraction: float = 0.0
    # Against the fp32 reference only loss and gradients, loosely, where
    # fxshard computes in bf16 (FSDP2 is compared at the scenario's tolerance).
    reference_atol: float | None = None
    fsdp2: bool = True  # False where FSDP2 fails the case (say why)
    # >1: micro-batches, each with its own backward, then one optimizer step;
    # no_sync: all but the last under set_requires_gradient_sync(False).
    micro_batches: int = 1
    no_sync: bool = False
    clip_norm: float | None = None  # clip_grad_norm_ by mesh (see _clip), on every copy
    freeze: tuple[str, ...] = ()  # parameters (name prefixes) frozen in every copy
    sequence_parallel: bool = False  # the Llama plan with sequence parallelism
    replicas: int = 1  # >1: HSDP, a (dp_replicate, dp_shard, tp) mesh
    loss_parallel: bool = False  # vocab-sharded logits, the loss and backward under loss_parallel()


def _tokens(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 131, (2, 9), generator=gen)


def _tokens8(gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 131, (2, 8), generator=gen)  # sequence parallelism: even pieces of the sequence


def _mse(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


LLAMA = dict(make_model=tp_models.TPLlama, make_batch=_tokens, loss=lm_loss)
LLAMA1 = dict(LLAMA, make_model=functools.partial(tp_models.TPLlama, layers=1))  # compile time: 1 layer
ODD = dict(make_model=tp_models.OddMLP, make_batch=lambda g: torch.randn(3, 6, generator=g), loss=_mse)
BF16 = fxshard.MixedPrecision(torch.bfloat16, torch.float32)
BF16_TOLERANCES = dict(atol=3e-2, rtol=3e-2, outlier_fraction=0.01, reference_atol=5e-2)
SCENARIOS: dict[str, TPScenario] = {
    # Attention and MLP column- then row-wise, a vocab-parallel embedding and
    # a column-wise output (vocab 131: uneven TP pieces), ZeRO-3.
    "llama": TPScenario(**LLAMA1, compile_kwargs=dict(backend="aot_eager")),
    "llama_2_layers": TPScenario(**LLAMA, compile_kwargs=dict(backend="aot_eager")),
    # Out features 10, 11 and 3 (an empty shard), biases, a plain layer
    # among tensor-parallel ones; ZeRO-2, then small units with prefetch.
    "odd_zero2": TPScenario(**ODD, compile_kwargs=dict(backend="aot_eager", zero_stage=2)),
    "odd_units": TPScenario(**ODD, compile_kwargs=dict(backend="aot_eager", unit_mb=1e-4, prefetch=2)),
    # dp 1: the data-parallel group is this rank alone (collectives skipped).
    # The head's out features 3 leave TP rank 3 a piece of 0 rows, which
    # FSDP2 fails to reduce (torch 2.13: "_chunk_cat expects non-empty tensor").
    "odd_dp1_tp4": TPScenario(
        make_model=functools.partial(tp_models.OddMLP, hidden=12),
        make_batch=ODD["make_batch"],
        loss=_mse,
        compile_kwargs=dict(backend="aot_eager"),
        tp=4,
        fsdp2=False,
    ),
    "odd_dp1_tp2": TPScenario(**ODD, compile_kwargs=dict(backend="aot_eager")),  # at 2 ranks
    # Loss parallelism: vocab-sharded logits into the loss, as torchtitan's loss_parallel option.
    "llama_loss_parallel": TPScenario(**LLAMA1, compile_kwargs=dict(backend="aot_eager"), loss_parallel=True),
    "llama_sp_loss_parallel": TPScenario(
        **dict(LLAMA1, make_batch=_tokens8),
        compile_kwargs=dict(backend="inductor"),
        sequence_parallel=True,
        loss_parallel=True,
    ),  # fmt: skip
    "llama_zero1": TPScenario(**LLAMA1, compile_kwargs=dict(backend="aot_eager", zero_stage=1)),
    "odd_zero1": TPScenario(**ODD, compile_kwargs=dict(backend="aot_eager", zero_stage=1, unit_mb=1e-4)),
    # HSDP + TP at (2, 2, 2): 8 ranks.
    "llama_hsdp": TPScenario(**LLAMA1, compile_kwargs=dict(backend="aot_eager"), replicas=2),
    "odd_hsdp": TPScenario(**ODD, compile_kwargs=dict(backend="aot_eager", zero_stage=2), replicas=2),
    # Gradients accumulated without sync over 2 micro-batches, then clipped.
    # Frozen tensor-parallel parameters, sharded (shard_frozen=True).
    "odd_frozen": TPScenario(**ODD, compile_kwargs=dict(backend="aot_eager", shard_frozen=True), freeze=("a.", "c.")),
    # The default (shard_frozen=False) shards frozen TP parameters too, as FSDP2 does.
    "odd_frozen_default": TPScenario(**ODD, compile_kwargs=dict(backend="aot_eager"), freeze=("a.", "c.")),
    # Sequence parallelism: replicated norm weights, partial gradients over tp.
    "llama_sp": TPScenario(
        **dict(LLAMA1, make_batch=_tokens8), compile_kwargs=dict(backend="aot_eager"), sequence_parallel=True
    ),
    # Each layer under activation checkpointing.
    "llama_checkpoint": TPScenario(
        **dict(LLAMA1, make_model=functools.partial(tp_models.TPLlama, layers=1, checkpoint=True)),
        compile_kwargs=dict(backend="aot_eager"),
    ),  # fmt: skip
    "llama_no_sync_clip": TPScenario(
        **LLAMA1, compile_kwargs=dict(backend="aot_eager"), micro_batches=2, no_sync=True, clip_norm=0.5
    ),  # fmt: skip
    # Sequenced reads (see [Note: two ways to read]): every read gathers eagerly.
    "odd_eager": TPScenario(**ODD, compile_kwargs=dict(backend="eager")),
    "llama_inductor": TPScenario(**LLAMA1, compile_kwargs=dict(backend="inductor")),
    "llama_zero2": TPScenario(**LLAMA, compile_kwargs=dict(backend="aot_eager", zero_stage=2)),
    "llama_bf16": TPScenario(**LLAMA, compile_kwargs=dict(backend="aot_eager", mp_policy=BF16), **BF16_TOLERANCES),
    "llama_bf16_inductor": TPScenario(
        **LLAMA1, compile_kwargs=dict(backend="inductor", mp_policy=BF16), **BF16_TOLERANCES
    ),  # fmt: skip
}


def run_all(rank: int, world_size: int, names: list[str]) -> dict[str, str | None]:
    """Each named scenario or check, from a clean dynamo; None (passed) or what differed."""
    return run_scenarios(rank, world_size, names, train_and_compare, SCENARIOS, CHECKS)


class Mismatches:
    """Differences found, by where; compared per rank, raised after the run."""

    def __init__(self, sc: TPScenario) -> None:
        self.sc, self.found = sc, []

    def close(self, actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float | None = None) -> None:
        atol = self.sc.atol if atol is None else atol
        rtol = self.sc.rtol if atol == self.sc.atol else atol
        actual, expected = actual.float(), expected.float()
        if self.sc.outlier_fraction:
            off = ~torch.isclose(actual, expected, atol=atol, rtol=rtol)
            if off.float().mean() > self.sc.outlier_fraction or not torch.isfinite(actual).all():
                self.found.append(f"{what}: {int(off.sum())}/{off.numel()} elements differ")
            return
        try:
            torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
        except AssertionError as error:
            self.found.append(f"{what}: {error}")

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.found.append(what)


def _fsdp2(model: nn.Module, dp_mesh: Any, kwargs: dict) -> nn.Module:
    mp = kwargs.get("mp_policy")
    policy = MixedPrecisionPolicy(mp.param_dtype, mp.reduce_dtype) if mp is not None else MixedPrecisionPolicy()
    reshard = kwargs.get("zero_stage", 3) == 3
    if isinstance(model, tp_models.TPLlama):
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
    return fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)


def _clip(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over parameters on several meshes, as torchtitan
    clips them: torch's stacks every gradient's norm and refuses DTensors
    of different meshes (the (dp, tp) mesh of tensor-parallel parameters
    and the dp mesh of the others, under FSDP2 as under fxshard). The norm
    of each mesh's gradients, full, then the total of those."""
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    norms = [torch.nn.utils.get_total_norm(grads) for grads in by_mesh.values()]
    total = torch.linalg.vector_norm(torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]))
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    for grads in by_mesh.values():
        torch._foreach_mul_(grads, coef)
    return total


def _device() -> torch.device:
    """Each rank's GPU under NCCL (tests/test_gpu.py), else the CPU."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def train_and_compare(rank: int, world_size: int, sc: TPScenario) -> list[str]:
    """Train ``sc`` three ways (see the module docstring); return the differences."""
    tp, device = sc.tp, _device()
    if sc.replicas > 1:  # HSDP + TP: fxshard and FSDP2 take the (dp_replicate, dp_shard) submesh
        grid = init_device_mesh(device.type, (sc.replicas, world_size // tp // sc.replicas, tp),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))  # fmt: skip
        mesh = {"dp": grid["dp_replicate", "dp_shard"], "tp": grid["tp"]}
    else:
        mesh = init_device_mesh(device.type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))
    dp, dp_rank = world_size // tp, rank // tp
    torch.manual_seed(0)
    ref = sc.make_model().to(device)
    full = ref.state_dict()
    copies = []
    for name, param in ref.named_parameters():
        param.requires_grad_(not name.startswith(sc.freeze))
    for _ in range(2 if sc.fsdp2 else 1):
        model = sc.make_model().to(device)
        model.load_state_dict(full)
        for name, param in model.named_parameters():
            param.requires_grad_(not name.startswith(sc.freeze))
        copies.append(tp_models.parallelize(model, mesh["tp"], sc.sequence_parallel, sc.loss_parallel))
    model = fxshard.compile(copies[0], mesh["dp"], **sc.compile_kwargs)
    others = [_fsdp2(copies[1], mesh["dp"], sc.compile_kwargs)] if sc.fsdp2 else []
    found = Mismatches(sc)
    for other in others:
        for (name, p), q in zip(model.named_parameters(), other.parameters()):
            found.check((p.placements, p.device_mesh.mesh_dim_names) == (q.placements, q.device_mesh.mesh_dim_names),
                        f"{name}: placements {p.placements} on {p.device_mesh.mesh_dim_names}, FSDP2's "
                        f"{q.placements} on {q.device_mesh.mesh_dim_names}")  # fmt: skip
    # eps=1e-6: see tests/helpers/parity.py (fp32 reduction-order noise near 1e-8).
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6) for m in (model, *others, ref)]
    for step in range(sc.steps):
        batches = [[sc.make_batch(torch.Generator().manual_seed(1000 * step + 10 * d + i)).to(device)
                    for i in range(sc.micro_batches)] for d in range(dp)]  # fmt: skip
        losses = [_micro_batches(m, batches[dp_rank], sc) for m in (model, *others)]
        ref_losses = [sum(sc.loss(ref(b), b) for b in per_rank) for per_rank in batches]
        (sum(ref_losses) / dp).backward()
        found.close(losses[0], ref_losses[dp_rank].detach(), f"step {step} loss", sc.reference_atol)
        for other_loss in losses[1:]:
            found.close(losses[0], other_loss, f"step {step} loss against FSDP2")
        for (name, p), r, *q in zip(model.named_parameters(), ref.parameters(), *(o.parameters() for o in others)):
            if r.grad is None:
                found.check(p.grad is None and all(o.grad is None for o in q), f"{name}: frozen, has a gradient")
                continue
            grad = p.grad.full_tensor()
            found.check(p.grad.placements == p.placements, f"step {step} {name}: grad placed {p.grad.placements}")
            found.close(grad, r.grad, f"step {step} grad of {name}", sc.reference_atol)
            for other in q:
                found.close(grad, other.grad.full_tensor(), f"step {step} grad of {name} against FSDP2")
        if sc.clip_norm is not None:
            norms = [_clip(list(m.parameters()), sc.clip_norm) for m in (model, *others, ref)]
            found.check(float(norms[-1]) > sc.clip_norm, f"step {step}: the reference's norm {norms[-1]} does not clip")
            for norm in norms[1:]:
                found.close(norms[0], norm, f"step {step} gradient norm", sc.reference_atol)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    if sc.compile_kwargs.get("zero_stage") == 1:
        found.check(any(p.kept for p in model.fxshard_plan.params), "ZeRO-1 kept no full copies")
    # TP's DTensor code traces into one graph with fxshard's reads: no silent fall to sequenced reads.
    eager = sc.compile_kwargs.get("backend") == "eager"
    found.check(model.fxshard_plan.sequenced == eager, f"sequenced reads: {model.fxshard_plan.graph_break_reason}")
    for (name, p), r, *q in zip(model.named_parameters(), ref.parameters(), *(o.parameters() for o in others)):
        value = p.detach().full_tensor()
        if sc.reference_atol is None:
            found.close(value, r.detach(), f"{name} after {sc.steps} steps")
        for other in q:
            found.close(value, other.detach().full_tensor(), f"{name} after {sc.steps} steps against FSDP2")
    return found.found


def _micro_batches(model: nn.Module, batches: list[torch.Tensor], sc: TPScenario) -> torch.Tensor:
    """The step's loss, each micro-batch with its own backward."""
    total = torch.zeros((), device=batches[0].device)
    for i, batch in enumerate(batches):
        if sc.no_sync:
            model.set_requires_gradient_sync(i == len(batches) - 1)
        with loss_parallel() if sc.loss_parallel else contextlib.nullcontext():
            logits = model(batch)
            if sc.loss_parallel and not (
                isinstance(logits, DTensor) and logits.placements[0].is_shard(-1 % logits.ndim)
            ):
                raise AssertionError(f"loss parallelism needs logits sharded on the vocabulary, got {logits!r:.200}")
            loss = sc.loss(logits, batch)
            loss.backward()
        if isinstance(loss, DTensor):  # loss parallelism: a replicated DTensor
            loss = loss.full_tensor()
        total = total + loss.detach().float()
    return total


def dcp_check(rank: int, world_size: int) -> None:
    """DCP: a checkpoint saved at (dp 2, tp 2), after a step, loads into
    fxshard at dp 4 without TP, at (dp 1, tp 4), and into FSDP2 at
    (dp 2, tp 2), each holding the saved full weights."""
    grid = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp4 = init_device_mesh("cpu", (1, 4), mesh_dim_names=("dp", "tp"))
    _dcp_across(rank, (grid["dp"], grid["tp"]), {"dp 4": (init_device_mesh("cpu", (4,)), None, False),
                                                 "(dp 1, tp 4)": (tp4["dp"], tp4["tp"], False),
                                                 "FSDP2 (dp 2, tp 2)": (grid["dp"], grid["tp"], True)})  # fmt: skip


def dcp_hsdp_check(rank: int, world_size: int) -> None:
    """DCP with HSDP + TP: a checkpoint saved at (2, 2, 2), after a step,
    loads into fxshard at (dp 4, tp 2) and at dp 8 without TP, and into
    FSDP2 at (2, 2, 2)."""
    names = ("dp_replicate", "dp_shard", "tp")
    grid = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=names)
    hsdp = grid["dp_replicate", "dp_shard"]
    dp4 = init_device_mesh("cpu", (4, 2), mesh_dim_names=("dp", "tp"))
    _dcp_across(rank, (hsdp, grid["tp"]), {"(dp 4, tp 2)": (dp4["dp"], dp4["tp"], False),
                                           "dp 8": (init_device_mesh("cpu", (8,)), None, False),
                                           "FSDP2 (2, 2, 2)": (hsdp, grid["tp"], True)})  # fmt: skip


def _dcp_across(rank: int, save_at: tuple[Any, Any], load_at: dict[str, tuple[Any, Any, bool]]) -> None:
    """Train the odd model one step on ``save_at`` (data-parallel mesh, TP
    mesh), save it with DCP, and load it on each of ``load_at``'s (data-parallel
    mesh, TP mesh or None, FSDP2 instead of fxshard): every load holds the
    saved full weights."""
    import shutil
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder)
    make = functools.partial(tp_models.OddMLP, hidden=12)  # row-wise inputs even at tp 4
    torch.manual_seed(0)
    full = make().state_dict()

    def loaded(mesh: Any, tp_mesh: Any, fsdp2: bool = False) -> nn.Module:
        model = make()
        model.load_state_dict(full)
        model = tp_models.parallelize(model, tp_mesh) if tp_mesh is not None else model
        return _fsdp2(model, mesh, {}) if fsdp2 else fxshard.compile(model, mesh, backend="aot_eager")

    saved = loaded(*save_at)
    opt = torch.optim.AdamW(saved.parameters(), lr=1e-2)
    batch_seed = rank // save_at[1].size()  # one batch per data-parallel rank
    saved(torch.randn(3, 6, generator=torch.Generator().manual_seed(batch_seed))).pow(2).mean().backward()
    opt.step()
    dcp.save(saved.state_dict(), checkpoint_id=folder[0])
    expected = {k: v.full_tensor() for k, v in saved.state_dict().items()}
    for where, (mesh, tp_mesh, fsdp2) in load_at.items():
        model = loaded(mesh, tp_mesh, fsdp2)
        state = model.state_dict()
        dcp.load(state, checkpoint_id=folder[0])
        model.load_state_dict(state)
        for key, value in model.state_dict().items():
            what = f"{where} {key}"
            torch.testing.assert_close(value.full_tensor(), expected[key], msg=lambda m, what=what: f"{what}: {m}")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder[0])


def dump_marks_check(rank: int, world_size: int) -> None:
    """The debug dump tells TP's collectives, which stay as DTensor put them,
    from fxshard's: each names its TP group, and no fxshard op is marked."""
    import tempfile
    from pathlib import Path

    device = _device()
    mesh = init_device_mesh(device.type, (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    folder = Path(tempfile.mkdtemp())
    model = tp_models.parallelize(tp_models.OddMLP().to(device), mesh["tp"])
    model = fxshard.compile(model, mesh["dp"], backend="aot_eager", debug_dir=folder)
    model(torch.randn(3, 6, device=device)).pow(2).mean().backward()
    lines = [line for path in sorted(folder.rglob("*.after.txt")) for line in path.read_text().splitlines()]
    marked = [line for line in lines if "the model's collective (TP/EP), not fxshard's" in line]
    groups = {line.split("not fxshard's: group ")[1].split(";")[0] for line in marked if "_c10d_functional." in line}
    # One group, TP's (DeviceMesh may name an equal group of an earlier mesh), never fxshard's dp group.
    assert marked and len(groups) == 1 and mesh["dp"].get_group().group_name not in groups, marked
    assert any("fxshard.unit_gather(" in line for line in lines)
    assert not any("fxshard." in line and "the model's collective" in line for line in lines)


CHECKS: dict[str, Callable[[int, int], None]] = {"dcp": dcp_check, "dcp_hsdp": dcp_hsdp_check,
                                                 "dump_marks": dump_marks_check}  # fmt: skip
