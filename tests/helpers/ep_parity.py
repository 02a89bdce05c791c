"""FSDP + EP training against an unsharded reference and against FSDP2 + the same EP plan, inside each rank.

The meshes are torchtitan's two views of one data-parallel world: ``dp``
(every rank, for the non-expert parameters) and ``(efsdp, ep)`` (experts
``Shard(0)`` on ep, their shards over efsdp). Each rank trains three copies
of one MoE decoder (tests/helpers/ep_models.py), all from the same full weights:
- fxshard: ``parallelize`` on ``sparse["ep"]``, then
  ``fxshard.compile(model, dense["dp"], expert_mesh=sparse["efsdp"])``;
- FSDP2: the same EP plan, then torchtitan's ``fully_shard`` of each block
  with a ``shard_placement_fn`` that puts expert weights on efsdp, and the
  gradient divide factor set to the data-parallel size, as torchtitan does;
- the reference: the full model, unsharded, on every rank: every
  data-parallel rank's batch, their losses averaged.
Loss, every gradient (``full_tensor()``, compared relative to the largest
reference gradient) and the parameters after each AdamW step (where the
reference gradient was non-zero at some step) must match. The run also
checks that the routing left some local expert of some EP rank with no
tokens, so that case is exercised, not hoped for.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard

import fxshard
from examples.llama import lm_loss
from tests.helpers import ep_models
from tests.helpers.parity import run_scenarios


@dataclass(frozen=True)
class EPScenario:
    compile_kwargs: dict = field(default_factory=dict)
    ep: int = 2
    steps: int = 3
    make_model: Callable[[], nn.Module] = ep_models.MoEDecoder
    tokens: tuple[int, int] = (1, 6)  # per data-parallel rank
    atol: float = 1e-5  # relative to the largest reference gradient
    rtol: float = 1e-4
    fsdp2: bool = True


SCENARIOS: dict[str, EPScenario] = {
    "moe": EPScenario(compile_kwargs=dict(backend="aot_eager")),
    "moe_zero2": EPScenario(compile_kwargs=dict(backend="aot_eager", zero_stage=2)),
    "moe_inductor": EPScenario(compile_kwargs=dict(backend="inductor")),
    # ep = dp: efsdp of one rank, every expert held whole by one rank.
    "moe_ep4": EPScenario(compile_kwargs=dict(backend="aot_eager"), ep=4),
}


def run_all(rank: int, world_size: int, names: list[str]) -> dict[str, str | None]:
    """Each named scenario or check, from a clean dynamo; None (passed) or what differed."""
    return run_scenarios(rank, world_size, names, train_and_compare, SCENARIOS, CHECKS)


def _fsdp2(model: ep_models.MoEDecoder, dp_mesh, efsdp_mesh) -> nn.Module:
    """torchtitan's ``apply_fsdp_to_decoder`` for EP > 1 (private FSDP2 APIs, as torchtitan imports them)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.fsdp._fully_shard._fsdp_init import _get_mesh_info

    dp_info, edp_info = _get_mesh_info(dp_mesh), _get_mesh_info(efsdp_mesh)
    for block in model.layers:
        experts = set(block.moe.experts.inner.parameters())

        def place(param: nn.Parameter, experts: set = experts) -> ShardPlacementResult:
            return ShardPlacementResult(Shard(0), edp_info if param in experts else dp_info)

        fully_shard(block, mesh=dp_mesh, shard_placement_fn=place)
    return fully_shard(model, mesh=dp_mesh)


def _fsdp2_expert_grads(model: nn.Module, ep: int) -> None:
    """FSDP2 averages expert gradients over efsdp only; torchtitan sets the
    divide factor to the data-parallel size (``set_gradient_divide_factor``),
    which gloo cannot run (NCCL's PreMulSum: "Cannot use ReduceOp.PREMUL_SUM
    with Gloo"). The same division, after the reduce."""
    for module in model.modules():
        if isinstance(module, ep_models.GroupedExperts):
            for p in module.parameters():
                p.grad.div_(ep)


def _received(ref: ep_models.MoEDecoder, batches: list[torch.Tensor], ep: int) -> torch.Tensor:
    """Per layer, EP group and expert: the tokens its expert receives from the
    group's ranks, from the reference's routing of each rank's batch."""
    ids: list[torch.Tensor] = []
    hooks = [block.moe.router.register_forward_hook(lambda m, i, out: ids.append(out[2])) for block in ref.layers]
    with torch.no_grad():
        for batch in batches:
            ref(batch)
    for h in hooks:
        h.remove()
    layers = len(ref.layers)
    counts = torch.stack(ids).view(len(batches), layers, -1)  # (rank, layer, expert)
    groups = counts.view(len(batches) // ep, ep, layers, -1).sum(1)  # ranks r*ep .. r*ep+ep-1 form an EP group
    return groups


def _device() -> torch.device:
    """Each rank's GPU under NCCL (tests/test_gpu.py), else the CPU."""
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def train_and_compare(rank: int, world_size: int, sc: EPScenario) -> list[str]:
    device = _device()
    dense = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))
    sparse = init_device_mesh(device.type, (world_size // sc.ep, sc.ep), mesh_dim_names=("efsdp", "ep"))
    torch.manual_seed(0)
    ref = sc.make_model().to(device)
    full = ref.state_dict()
    copies = []
    for _ in range(2 if sc.fsdp2 else 1):
        model = sc.make_model().to(device)
        model.load_state_dict(full)
        copies.append(ep_models.parallelize(model, sparse["ep"]))
    model = fxshard.compile(copies[0], dense["dp"], expert_mesh=sparse["efsdp"], **sc.compile_kwargs)
    others = [_fsdp2(copies[1], dense["dp"], sparse["efsdp"])] if sc.fsdp2 else []
    found: list[str] = []

    def close(actual: torch.Tensor, expected: torch.Tensor, what: str, scale: float = 1.0) -> None:
        try:
            torch.testing.assert_close(actual / scale, expected / scale, atol=sc.atol, rtol=sc.rtol)
        except AssertionError as error:
            found.append(f"{what}: {error}")

    for other in others:
        for (name, p), q in zip(model.named_parameters(), other.parameters()):
            mine, theirs = (p.placements, p.device_mesh.mesh_dim_names), (q.placements, q.device_mesh.mesh_dim_names)
            if mine != theirs:
                found.append(f"{name}: placements {mine}, FSDP2's {theirs}")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6) for m in (model, *others, ref)]
    moved = {name: torch.zeros_like(p, dtype=torch.bool) for name, p in ref.named_parameters()}
    empty = 0
    for step in range(sc.steps):
        batches = [torch.randint(0, 37, sc.tokens, generator=torch.Generator().manual_seed(1000 * step + d)).to(device)
                   for d in range(world_size)]  # fmt: skip
        empty += int((_received(ref, batches, sc.ep) == 0).sum())
        losses = []
        for m in (model, *others):
            loss = lm_loss(m(batches[rank]), batches[rank])
            loss.backward()
            losses.append(loss.detach())
        for other in others:
            _fsdp2_expert_grads(other, sc.ep)
        ref_losses = [lm_loss(ref(b), b) for b in batches]
        (sum(ref_losses) / world_size).backward()
        for i, loss in enumerate(losses):
            close(loss, ref_losses[rank].detach(), f"step {step} loss of {'fxshard' if i == 0 else 'FSDP2'}")
        scale = max(float(r.grad.abs().max()) for r in ref.parameters())
        for (name, p), r, *q in zip(model.named_parameters(), ref.parameters(), *(o.parameters() for o in others)):
            moved[name] |= r.grad != 0
            if p.grad is None:
                found.append(f"step {step} {name}: no gradient")
                continue
            grad = p.grad.full_tensor()
            close(grad, r.grad, f"step {step} grad of {name}", scale)
            for other in q:
                close(grad, other.grad.full_tensor(), f"step {step} grad of {name} against FSDP2", scale)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    if not empty:
        found.append("the routing gave every local expert tokens at every step: the empty case was not exercised")
    if model.fxshard_plan.sequenced:
        found.append(f"sequenced reads: {model.fxshard_plan.graph_break_reason}")
    for (name, p), r, *q in zip(model.named_parameters(), ref.parameters(), *(o.parameters() for o in others)):
        value, where = p.detach().full_tensor(), moved[name]
        close(value[where], r.detach()[where], f"{name} after {sc.steps} steps")
        for other in q:
            close(value, other.detach().full_tensor(), f"{name} after {sc.steps} steps against FSDP2")
    return found


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


CHECKS: dict[str, Callable[[int, int], None]] = {"different_init": different_init_check}
