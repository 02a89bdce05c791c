"""FSDP + EP training against an unsharded reference and against FSDP2 + the same EP plan, inside each rank.

The meshes are torchtitan's two views of one data-parallel world: ``dp``
(every rank, for the non-expert parameters) and ``(efsdp, ep)`` (experts
``Shard(0)`` on ep, their shards over efsdp). Each rank trains three copies
of one MoE model, all from the same full weights. The model comes from the
scenario's ``EPModel``: ``EPModel`` itself is tests/helpers/ep_models.py's
MoE decoder; tests/helpers/ep_torchtitan.py's ``TorchtitanMoE`` is
torchtitan's own Qwen3-MoE or DeepSeek-V3. The three copies:
- fxshard: ``parallelize`` on ``sparse["ep"]``, then
  ``fxshard.compile(model, dense["dp"], expert_mesh=sparse["efsdp"])``;
- FSDP2: the same EP plan, then torchtitan's ``fully_shard`` of each block
  with a ``shard_placement_fn`` that puts expert weights on efsdp, and the
  gradient divide factor set to the data-parallel size, as torchtitan does;
- the reference: the full model, unsharded, on every rank: every
  data-parallel rank's batch, their losses averaged (``EPModel.reference_losses``).
Loss, every gradient (``full_tensor()``, compared relative to the largest
reference gradient) and the parameters after the AdamW steps (where the
reference gradient was non-zero at some step) must match, the reference's
at fp32 tolerance, FSDP2's too. With ``same_weights`` (torchtitan's models,
whose experts compute in bf16) the reference starts each step from
fxshard's full weights, keeping its own AdamW state, and parameters are
compared after every step; FSDP2 trains on its own throughout. The run also
checks that the routing left some local expert of some EP rank with no
tokens, so that case is exercised, not hoped for. Scenarios add bf16 mixed
precision (against the reference only the loss: see ``EPScenario``),
micro-batches without sync and clipping, activation checkpointing, frozen
parameters and ``no_shard``; checks (``CHECKS``) DCP across EP sizes, the
dump's marks and fxshard.cuda_graph's refusal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard

import fxshard
from examples.llama import lm_loss
from tests.helpers import ep_models, tp_parity
from tests.helpers.ep_torchtitan import TorchtitanMoE
from tests.helpers.parity import run_scenarios


@dataclass(frozen=True)
class EPModel:
    """One MoE model family as the scenarios use it: how to build it, put its
    experts on the ep mesh, feed it, and where its blocks, experts and routers
    are. This one is ep_models.MoEDecoder: 8 experts, top 2, of 6 tokens per rank."""

    tokens: tuple[int, int] = (1, 6)  # per data-parallel rank
    checkpoint: bool = False  # each block under activation checkpointing

    def make(self) -> nn.Module:
        """The full model (the caller seeds the generator)."""
        return ep_models.MoEDecoder(checkpoint=self.checkpoint)

    def parallelize(self, model: nn.Module, ep_mesh) -> nn.Module:
        """The model's own EP setup: experts ``Shard(0)`` on ``ep_mesh``, all-to-alls on it."""
        return ep_models.parallelize(model, ep_mesh)

    def batch(self, step: int, index: int, device: torch.device, micro: int = 0) -> Any:
        """Data-parallel rank ``index``'s batch at ``step``, its micro-batch ``micro``."""
        generator = torch.Generator().manual_seed(1000 * step + index + 100 * micro)
        return torch.randint(0, 37, self.tokens, generator=generator).to(device)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        return lm_loss(model(batch), batch)

    def reference_losses(self, ref: nn.Module, batches: list, ep: int) -> list[torch.Tensor]:
        """Each data-parallel rank's loss, from the unsharded reference."""
        return [self.loss(ref, b) for b in batches]

    def blocks(self, model: nn.Module) -> list[tuple[nn.Module, nn.Module | None]]:
        """FSDP2's units: each block, with the module holding its expert weights (None: a dense block)."""
        return [(block, block.moe.experts.inner) for block in model.layers]

    def is_expert(self, name: str) -> bool:
        """Whether the parameter named ``name`` is an expert weight (on the ep mesh)."""
        return ep_models.is_expert(name)

    def routed(self, ref: nn.Module, batch: Any) -> torch.Tensor:
        """The reference's per-expert token counts for ``batch``, per MoE layer: (layers, experts)."""
        counts: list[torch.Tensor] = []
        routers = [block.moe.router for block in ref.layers]
        hooks = [router.register_forward_hook(lambda m, i, out: counts.append(out[2])) for router in routers]
        try:
            with torch.no_grad():
                ref(batch)
        finally:
            for h in hooks:
                h.remove()
        return torch.stack(counts)


@dataclass(frozen=True)
class EPScenario:
    compile_kwargs: dict = field(default_factory=dict)
    ep: int = 2
    steps: int = 3
    model: EPModel | TorchtitanMoE = EPModel()
    atol: float = 1e-5  # relative to the largest reference gradient
    rtol: float = 1e-4
    # bf16 (as tests/helpers/tp_parity.py): a fraction of elements may differ,
    # and against the fp32 reference only the loss, loosely: bf16 logits route
    # some tokens to other experts than the fp32 reference's (a near tie in
    # the top 2; 2 tokens of one layer at step 0 of moe_bf16), which changes
    # whole gradients (the gate's). FSDP2, computing in bf16 as fxshard,
    # routes alike: gradients and parameters are compared with it.
    outlier_fraction: float = 0.0
    reference_atol: float | None = None
    fsdp2: bool = True
    # >1: micro-batches, each with its own backward, then one optimizer step;
    # no_sync: all but the last under set_requires_gradient_sync(False).
    # Micro-batches need the family's batch(micro=...) (EPModel's).
    micro_batches: int = 1
    no_sync: bool = False
    clip_norm: float | None = None  # tp_parity._clip (by mesh, as torchtitan) on every copy
    # Parameters (name prefixes) frozen in every copy. fxshard keeps frozen
    # non-expert ones whole unless shard_frozen=True (FSDP2 shards them: their
    # placements are not compared then); frozen experts are sharded. Needs
    # the family's is_expert(name) (EPModel's).
    freeze: tuple[str, ...] = ()
    no_shard: tuple[str, ...] = ()  # modules fxshard.no_shard marks (FSDP2 shards them: placements not compared)
    # The reference starts each step from fxshard's full weights (its AdamW
    # state stays its own), and parameters are compared after every step:
    # for models whose bf16 compute turns fp32 noise in one step's update into
    # bf16 noise in the next step's gradients (tests/helpers/ep_torchtitan.py).
    same_weights: bool = False

    def __post_init__(self) -> None:
        # Micro-batches and frozen parameters are tested with EPModel only:
        # TorchtitanMoE gives one batch per step and names no expert weights.
        assert isinstance(self.model, EPModel) or (self.micro_batches == 1 and not self.freeze), self


BF16_TOLERANCES = dict(atol=3e-2, rtol=3e-2, outlier_fraction=0.01, reference_atol=5e-2)
SCENARIOS: dict[str, EPScenario] = {
    "moe": EPScenario(compile_kwargs=dict(backend="aot_eager")),
    "moe_zero2": EPScenario(compile_kwargs=dict(backend="aot_eager", zero_stage=2)),
    # ZeRO-1: the experts' full copies gathered over efsdp once per step, beside the others' over dp.
    "moe_zero1": EPScenario(compile_kwargs=dict(backend="aot_eager", zero_stage=1)),
    "moe_inductor": EPScenario(compile_kwargs=dict(backend="inductor")),
    # ep = dp: efsdp of one rank, every expert held whole by one rank.
    "moe_ep4": EPScenario(compile_kwargs=dict(backend="aot_eager"), ep=4),
    # bf16 parameters and compute, fp32 gradient reduction.
    "moe_bf16": EPScenario(compile_kwargs=dict(backend="aot_eager", mp_policy=tp_parity.BF16), **BF16_TOLERANCES),
    # 2 micro-batches, the first without sync, then clip_grad_norm_ over the dp and (efsdp, ep) meshes.
    "moe_no_sync_clip": EPScenario(
        compile_kwargs=dict(backend="aot_eager"), micro_batches=2, no_sync=True, clip_norm=0.5
    ),
    # Each block under activation checkpointing (eager, the backward runs its all-to-alls again).
    "moe_checkpoint": EPScenario(compile_kwargs=dict(backend="aot_eager"), model=EPModel(checkpoint=True)),
    # Frozen experts of one layer, and frozen non-expert parameters.
    "moe_frozen": EPScenario(
        compile_kwargs=dict(backend="aot_eager"), freeze=("layers.0.moe.experts.", "embed.", "layers.1.moe.shared.")
    ),
    # A non-expert module kept replicated (the router's gate and the shared expert of one layer).
    "moe_no_shard": EPScenario(
        compile_kwargs=dict(backend="aot_eager"), no_shard=("layers.0.moe.router", "layers.1.moe.shared")
    ),
    # torchtitan's own models, EP applied as its trainer does (tests/helpers/ep_torchtitan.py): 8 experts,
    # top 2, of 8 tokens per rank, so some expert of some EP rank receives no tokens.
    "qwen3_moe": EPScenario(
        compile_kwargs=dict(backend="aot_eager"), model=TorchtitanMoE("qwen3_moe", num_experts=8), same_weights=True
    ),
    "deepseek_v3": EPScenario(
        compile_kwargs=dict(backend="aot_eager"), model=TorchtitanMoE("deepseek_v3", seq_len=4), same_weights=True
    ),
}


def run_all(rank: int, world_size: int, names: list[str]) -> dict[str, str | None]:
    """Each named scenario or check, from a clean dynamo; None (passed) or what differed."""
    return run_scenarios(rank, world_size, names, train_and_compare, SCENARIOS, CHECKS)


def _fsdp2(
    model: nn.Module, family: EPModel, dp_mesh, efsdp_mesh, mp: fxshard.MixedPrecision | None = None
) -> nn.Module:
    """torchtitan's ``apply_fsdp_to_decoder`` for EP > 1."""
    policy = MixedPrecisionPolicy(mp.param_dtype, mp.reduce_dtype) if mp is not None else MixedPrecisionPolicy()
    for block, inner in family.blocks(model):
        fully_shard_block(block, inner, dp_mesh, efsdp_mesh, mp_policy=policy)
    return fully_shard(model, mesh=dp_mesh, mp_policy=policy)


def fully_shard_block(block: nn.Module, experts: nn.Module | None, dp_mesh, efsdp_mesh, **kwargs: Any) -> None:
    """torchtitan's ``fully_shard`` of one block under EP: the block over dp,
    the expert weights of ``experts`` (if any) ``Shard(0)`` over efsdp, through
    ``shard_placement_fn``'s per-parameter mesh (private FSDP2 APIs, as
    torchtitan imports them). FSDP2 without per-parameter meshes (torch 2.11)
    gets torchtitan's earlier form: the experts' module sharded on its own
    over efsdp, then the block over dp."""
    if experts is None:
        fully_shard(block, mesh=dp_mesh, **kwargs)
        return
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
        from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info
    except ImportError:
        fully_shard(experts, mesh=efsdp_mesh, **kwargs)
        fully_shard(block, mesh=dp_mesh, **kwargs)
        return
    dp_info, edp_info = _get_mesh_info(dp_mesh), _get_mesh_info(efsdp_mesh)
    params = set(experts.parameters())

    def place(param: nn.Parameter) -> ShardPlacementResult:
        return ShardPlacementResult(Shard(0), edp_info if param in params else dp_info)

    fully_shard(block, mesh=dp_mesh, shard_placement_fn=place, **kwargs)


def _fsdp2_expert_grads(model: nn.Module, family: EPModel, ep: int) -> None:
    """FSDP2 averages expert gradients over efsdp only; torchtitan sets the
    divide factor to the data-parallel size (``set_gradient_divide_factor``),
    which gloo cannot run (NCCL's PreMulSum: "Cannot use ReduceOp.PREMUL_SUM
    with Gloo"). The same division, after the reduce (frozen experts have no gradient)."""
    for _, inner in family.blocks(model):
        for p in inner.parameters() if inner is not None else ():
            if p.grad is not None:
                p.grad.div_(ep)


def _received(ref: nn.Module, family: EPModel, batches: list, ep: int) -> torch.Tensor:
    """Per EP group, layer and expert: the tokens its expert receives from the
    group's ranks, from the reference's routing of each rank's batch."""
    counts = torch.stack([family.routed(ref, batch) for batch in batches])  # (rank, layer, expert)
    return counts.view(len(batches) // ep, ep, *counts.shape[1:]).sum(1)  # ranks r*ep .. r*ep+ep-1 form an EP group


def _device() -> torch.device:
    """Each rank's GPU under NCCL (tests/test_gpu.py), else the CPU."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def train_and_compare(rank: int, world_size: int, sc: EPScenario) -> list[str]:
    device = _device()
    dense = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    sparse = init_device_mesh(device.type, (world_size // sc.ep, sc.ep), mesh_dim_names=("efsdp", "ep"))
    family = sc.model
    torch.manual_seed(0)
    ref = family.make().to(device)
    full = ref.state_dict()
    for name, param in ref.named_parameters():
        param.requires_grad_(not name.startswith(sc.freeze))
    copies = []
    for _ in range(2 if sc.fsdp2 else 1):
        model = family.make().to(device)
        model.load_state_dict(full)
        for name, param in model.named_parameters():
            param.requires_grad_(not name.startswith(sc.freeze))
        copies.append(family.parallelize(model, sparse["ep"]))
    for name in sc.no_shard:
        fxshard.no_shard(copies[0].get_submodule(name))
    model = fxshard.compile(copies[0], dense["dp"], expert_mesh=sparse["efsdp"], **sc.compile_kwargs)
    if sc.compile_kwargs.get("zero_stage") == 1:  # the experts' full copies too, gathered over efsdp
        kept = {p.fqn: p.kept for p in model.fxshard_plan.params}
        assert all(kept.values()), f"ZeRO-1 keeps every sharded parameter gathered: {kept}"
    mp = sc.compile_kwargs.get("mp_policy")
    others = [_fsdp2(copies[1], family, dense["dp"], sparse["efsdp"], mp)] if sc.fsdp2 else []
    found = tp_parity.Mismatches(sc)

    def close(actual: torch.Tensor, expected: torch.Tensor, what: str, scale: float = 1.0,
              atol: float | None = None) -> None:  # fmt: skip
        found.close(actual.float() / scale, expected.float() / scale, what, atol)

    for other in others:
        for (name, p), q in zip(model.named_parameters(), other.parameters()):
            mine, theirs = (p.placements, p.device_mesh.mesh_dim_names), (q.placements, q.device_mesh.mesh_dim_names)
            frozen_whole = name.startswith(sc.freeze) and not sc.compile_kwargs.get("shard_frozen")
            whole = name.startswith(sc.no_shard) or (frozen_whole and not family.is_expert(name))
            if whole:
                found.check(mine == ((Replicate(),), ("dp",)), f"{name}: kept whole, yet placed {mine}")
            elif mine != theirs:
                found.check(False, f"{name}: placements {mine}, FSDP2's {theirs}")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6) for m in (model, *others, ref)]
    moved = {name: torch.zeros_like(p, dtype=torch.bool) for name, p in ref.named_parameters()}
    empty = 0

    def compare_parameters(when: str) -> None:
        for (name, p), r, *q in zip(model.named_parameters(), ref.parameters(), *(o.parameters() for o in others)):
            value, where = p.detach().full_tensor(), moved[name]
            if r.grad is None and not r.requires_grad:
                where = torch.ones_like(where)  # frozen: unchanged, everywhere
            if sc.reference_atol is None:
                close(value[where], r.detach()[where], f"{name} {when}")
            for other in q:
                close(value, other.detach().full_tensor(), f"{name} {when} against FSDP2")

    for step in range(sc.steps):
        # batches[d][i]: data-parallel rank d's micro-batch i.
        micros = range(sc.micro_batches)
        batches = [[family.batch(step, d, device, micro=i) for i in micros] for d in range(world_size)]
        empty += sum(int((_received(ref, family, [b[i] for b in batches], sc.ep) == 0).sum()) for i in micros)
        if sc.same_weights:
            with torch.no_grad():
                for p, r in zip(model.parameters(), ref.parameters()):
                    r.copy_(p.full_tensor())
        losses = [_micro_batches(m, family, batches[rank], sc, device) for m in (model, *others)]
        for other in others:
            _fsdp2_expert_grads(other, family, sc.ep)
        # Per rank, the sum over its micro-batches of the reference's losses.
        per_micro = [family.reference_losses(ref, [b[i] for b in batches], sc.ep) for i in micros]
        ref_losses = [sum(per_rank) for per_rank in zip(*per_micro)]
        (sum(ref_losses) / world_size).backward()
        for i, loss in enumerate(losses):
            close(loss, ref_losses[rank].detach(), f"step {step} loss of {'fxshard' if i == 0 else 'FSDP2'}",
                  atol=sc.reference_atol)  # fmt: skip
        scale = max(float(r.grad.abs().max()) for r in ref.parameters() if r.grad is not None)
        for (name, p), r, *q in zip(model.named_parameters(), ref.parameters(), *(o.parameters() for o in others)):
            if r.grad is None:
                found.check(p.grad is None and all(o.grad is None for o in q), f"{name}: frozen, has a gradient")
                continue
            moved[name] |= r.grad != 0
            if p.grad is None:
                found.check(False, f"step {step} {name}: no gradient")
                continue
            found.check(p.grad.dtype == torch.float32, f"step {step} {name}: gradient of {p.grad.dtype}")
            grad = p.grad.full_tensor()
            if sc.reference_atol is None:
                close(grad, r.grad, f"step {step} grad of {name}", scale)
            for other in q:
                close(grad, other.grad.full_tensor(), f"step {step} grad of {name} against FSDP2", scale)
        if sc.clip_norm is not None:
            norms = [tp_parity._clip(list(m.parameters()), sc.clip_norm) for m in (model, *others, ref)]
            found.check(float(norms[-1]) > sc.clip_norm, f"step {step}: the reference's norm {norms[-1]} does not clip")
            for norm in norms[:-1]:
                close(norm, norms[-1], f"step {step} gradient norm", atol=sc.reference_atol)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if sc.same_weights:
            compare_parameters(f"after step {step}")
    if not empty:
        found.check(False, "the routing gave every local expert tokens at every step: the empty case was not exercised")
    found.check(not model.fxshard_plan.sequenced, f"sequenced reads: {model.fxshard_plan.graph_break_reason}")
    if not sc.same_weights:
        compare_parameters(f"after {sc.steps} steps")
    return found.found


def _micro_batches(
    model: nn.Module, family: EPModel, batches: list, sc: EPScenario, device: torch.device
) -> torch.Tensor:
    """The step's loss, each micro-batch with its own backward."""
    total = torch.zeros((), device=device)
    for i, batch in enumerate(batches):
        if sc.no_sync:
            model.set_requires_gradient_sync(i == len(batches) - 1)
        loss = family.loss(model, batch)
        loss.backward()
        total = total + loss.detach().float()
    return total


def different_init_check(rank: int, world_size: int) -> None:
    """The same-init check compares an expert's EP-local piece among the
    ranks of one EP coordinate (rank 0 and 2 hold experts 0-3, 1 and 3
    experts 4-7): EP ranks legitimately differ, those ranks must not."""
    import pytest

    dense = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    sparse = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("efsdp", "ep"))

    def model(perturb: bool) -> nn.Module:
        torch.manual_seed(0)
        m = ep_models.parallelize(ep_models.MoEDecoder(layers=1), sparse["ep"])
        if perturb and rank == 2:
            with torch.no_grad():
                m.layers[0].moe.experts.inner.w2.to_local()[1, 0, 0] += 1
        return m

    fxshard.compile(model(False), dense["dp"], expert_mesh=sparse["efsdp"], backend="aot_eager")
    with pytest.raises(ValueError, match=r"'layers.0.moe.experts.inner.w2' holds different initial values.*\[2\]"):
        fxshard.compile(model(True), dense["dp"], expert_mesh=sparse["efsdp"], backend="aot_eager")


def _step(model: nn.Module, rank: int) -> None:
    """One AdamW step on this rank's batch."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randint(0, 37, (1, 6), generator=torch.Generator().manual_seed(rank))
    lm_loss(model(batch), batch).backward()
    opt.step()


def dcp_check(rank: int, world_size: int) -> None:
    """DCP: a checkpoint saved at (efsdp 2, ep 2), after a step, loads into
    fxshard at ep 4 (efsdp 1), into fxshard at dp 4 without EP (experts
    whole, sharded as any parameter), and into FSDP2 + EP at (efsdp 2, ep 2),
    each holding the saved full weights."""
    import shutil
    import tempfile

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    folder = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(folder)
    dense = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    sparse = {ep: init_device_mesh("cpu", (world_size // ep, ep), mesh_dim_names=("efsdp", "ep")) for ep in (2, 4)}
    torch.manual_seed(0)
    full = ep_models.MoEDecoder(layers=1).state_dict()

    def loaded(ep: int | None, fsdp2: bool = False) -> nn.Module:
        model = ep_models.MoEDecoder(layers=1)
        model.load_state_dict(full)
        if ep is None:
            return fxshard.compile(model, dense["dp"], backend="aot_eager")
        model = ep_models.parallelize(model, sparse[ep]["ep"])
        if fsdp2:
            return _fsdp2(model, EPModel(), dense["dp"], sparse[ep]["efsdp"])
        return fxshard.compile(model, dense["dp"], expert_mesh=sparse[ep]["efsdp"], backend="aot_eager")

    saved = loaded(2)
    _step(saved, rank)
    dcp.save(saved.state_dict(), checkpoint_id=folder[0])
    expected = {k: v.full_tensor() for k, v in saved.state_dict().items()}
    changed = [k for k, v in expected.items() if not torch.equal(v, full[k])]
    assert "layers.0.moe.experts.inner.w1" in changed, changed  # the step moved the experts
    for where, (ep, fsdp2) in {"ep 4": (4, False), "dp 4 without EP": (None, False),
                               "FSDP2 (efsdp 2, ep 2)": (2, True)}.items():  # fmt: skip
        model = loaded(ep, fsdp2)
        state = model.state_dict()
        dcp.load(state, checkpoint_id=folder[0])
        model.load_state_dict(state)
        for key, value in model.state_dict().items():
            what = f"{where} {key}"
            torch.testing.assert_close(value.full_tensor(), expected[key], msg=lambda m, what=what: f"{what}: {m}")
        _step(model, rank)  # and it trains on from there
    dist.barrier()
    if rank == 0:
        shutil.rmtree(folder[0])


def dump_marks_check(rank: int, world_size: int) -> None:
    """The debug dump marks the model's all-to-alls (the dispatch, the
    combine, and their backward) as the model's collectives on the ep group,
    never fxshard's gathers and reduces (on dp and efsdp)."""
    import tempfile
    from pathlib import Path

    dense = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    sparse = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("efsdp", "ep"))
    folder = Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    model = ep_models.parallelize(ep_models.MoEDecoder(layers=1), sparse["ep"])
    model = fxshard.compile(model, dense["dp"], expert_mesh=sparse["efsdp"], backend="aot_eager", debug_dir=folder)
    _step(model, rank)
    dumps = sorted(folder.rglob("*.after.txt"))
    lines = [line for path in dumps for line in path.read_text().splitlines()]
    alls = [line for line in lines if "= _c10d_functional.all_to_all_single(" in line]
    marked = [line for line in lines if "the model's collective (TP/EP), not fxshard's" in line]
    groups = {line.split("not fxshard's: group ")[1].split(";")[0] for line in marked if "_c10d_functional." in line}
    # The counts' and the tokens' dispatch and the combine in the forward, the latter two's backward.
    assert len(alls) >= 5 and all(line in marked for line in alls), (dumps, alls)
    fxshard_groups = {dense["dp"].get_group().group_name, sparse["efsdp"].get_group().group_name}
    assert len(groups) == 1 and not groups & fxshard_groups, (groups, fxshard_groups)
    assert any("fxshard.unit_gather(" in line for line in lines)
    assert not any("fxshard." in line and "the model's collective" in line for line in lines)


def cuda_graph_check(rank: int, world_size: int) -> None:
    """fxshard.cuda_graph refuses an EP model, naming why: the dispatch's
    host reads of the split sizes. The check runs where a captured step's
    warm-up ends, before any capture (on CPU the first call already refuses:
    CUDA graphs need CUDA)."""
    import pytest

    from fxshard import graphs

    dense = init_device_mesh("cpu", (world_size,), mesh_dim_names=("dp",))
    sparse = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("efsdp", "ep"))
    model = ep_models.parallelize(ep_models.MoEDecoder(layers=1), sparse["ep"])
    model = fxshard.compile(model, dense["dp"], expert_mesh=sparse["efsdp"], backend="aot_eager")
    with pytest.raises(ValueError, match=r"MoEDecoder has expert-parallel parameters.*split sizes on the host"):
        graphs.CapturedStep(lambda: None, 1)._check_ran([model], [])


CHECKS: dict[str, Callable[[int, int], None]] = {"different_init": different_init_check, "dcp": dcp_check,
                                                 "dump_marks": dump_marks_check,
                                                 "cuda_graph_refuses": cuda_graph_check}  # fmt: skip
