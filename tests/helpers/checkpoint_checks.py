"""Checkpoint checks of a compiled model, run inside each rank: torch.save
and resume, full state dicts, the full export, DCP saved at one world size
(or HSDP mesh shape) and resumed at another. What each shows is said in
``tests/test_checkpoint.py``.

Used by ``tests/test_checkpoint.py`` (gloo, CPU) and ``tests/test_gpu.py``
(NCCL, each rank's GPU).
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

import fxshard
from examples.llama import lm_loss
from tests.helpers import models

ATOL, RTOL = 2e-5, 1e-4
GLOBAL_BATCH = 6  # divisible by 1, 2 and 3: every world size trains on the same global batch


def _tokens(step: int, rank: int, world_size: int) -> torch.Tensor:
    full = torch.randint(0, 37, (GLOBAL_BATCH, 9), generator=torch.Generator().manual_seed(step))
    per = GLOBAL_BATCH // world_size
    return full[rank * per : (rank + 1) * per]


def _inputs(step: int, rank: int, world_size: int) -> torch.Tensor:
    full = torch.randn(GLOBAL_BATCH, 5, generator=torch.Generator().manual_seed(100 + step))
    per = GLOBAL_BATCH // world_size
    return full[rank * per : (rank + 1) * per]


def _device() -> torch.device:
    """This rank's device: its GPU under NCCL (tests/test_gpu.py), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-6)  # eps: see tests/helpers/parity.py


def _llama_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        tokens = _tokens(step, rank, ws).to(_device())
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _uneven_steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[torch.Tensor]:
    """Losses averaged over the ranks: each world size splits one global batch evenly."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    losses = []
    for step in steps:
        loss = model(_inputs(step, rank, ws).to(_device())).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.cpu() / ws)
    return losses


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    # A copy: a replicated parameter's full_tensor() is its live local tensor.
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone().cpu()
            for k, v in model.state_dict().items()}  # fmt: skip


def _full_optim(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone().cpu()
                           for k, v in s.items()} for p, s in opt.state.items()}  # fmt: skip


def _close(actual, expected, what: str, exact: bool = False) -> None:
    tol = dict(atol=0, rtol=0) if exact else dict(atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(actual, expected, **tol, msg=lambda m: f"{what}: {m}")


def _compiled(make: type | object, seed: int, backend: str = "aot_eager", whole: tuple[str, ...] = (),
              mesh: DeviceMesh | None = None, zero_stage: int = 3) -> nn.Module:  # fmt: skip
    """``make()`` compiled, with the submodules named in ``whole`` kept replicated (``fxshard.no_shard``)."""
    torch.manual_seed(seed)
    model = make().to(_device())
    for name in whole:
        fxshard.no_shard(model.get_submodule(name))
    return fxshard.compile(model, mesh, backend=backend, zero_stage=zero_stage)


# Checkpoints hold replicated parameters beside sharded ones: the Llama's
# second MLP, and Uneven's layer b when saved (sharded again when resumed).
LLAMA_WHOLE = ("layers.1.mlp",)


def torch_save_resumes(rank: int, world_size: int) -> dict[str, nn.Module]:
    """torch.save of the sharded state dict works before the first call and
    after steps; loading it into a fresh compiled model resumes exactly.
    Returns its compiled models for the next checks (each compile costs seconds)."""
    model = _compiled(models.TinyLlama, 0, whole=LLAMA_WHOLE)
    assert dict(model.named_parameters())["layers.1.mlp.w1.weight"].placements[0].is_replicate()
    opt = _adamw(model)
    before = io.BytesIO()
    torch.save(model.state_dict(), before)
    _llama_steps(model, opt, range(2))
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, saved)
    expected = _llama_steps(model, opt, range(2, 4))

    fresh = _compiled(models.TinyLlama, 1, whole=LLAMA_WHOLE)  # other weights, until loaded
    fresh_opt = _adamw(fresh)
    saved.seek(0)
    state = torch.load(saved, weights_only=False)
    fresh.load_state_dict(state["model"])
    fresh_opt.load_state_dict(state["optim"])
    _close(torch.tensor(_llama_steps(fresh, fresh_opt, range(2, 4))), torch.tensor(expected), "losses", exact=True)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        _close(q.to_local(), p.to_local(), f"{name} after resuming", exact=True)

    before.seek(0)
    untrained = _compiled(models.TinyLlama, 2, whole=LLAMA_WHOLE)
    untrained.load_state_dict(torch.load(before, weights_only=False))
    torch.manual_seed(0)
    for name, value in models.TinyLlama().state_dict().items():
        _close(
            untrained.state_dict()[name].full_tensor().cpu(), value, f"{name} saved before the first call", exact=True
        )
    return {"trained": fresh, "untrained": untrained}


def another_ranks_file_raises(rank: int, world_size: int, model: nn.Module) -> None:
    """A ``torch.save`` of rank 0's sharded state dict, loaded on every rank:
    rank 0 loads it, the others raise instead of taking rank 0's rows (see
    [Note: whose shards a state dict holds]). A dict built from it has no
    metadata (peft's ``get_peft_model_state_dict``, a comprehension): each
    DTensor's pickled mesh still says whose shard it is."""
    before = {n: p.to_local().clone() for n, p in model.named_parameters()}
    for state, error in ((model.state_dict(), f"shards of rank 0 of {world_size}.*this is rank {rank}"),
                         (dict(model.state_dict().items()), r"shard taken at mesh coordinate \(0,\).*this rank is at")):  # fmt: skip
        loaded = _rank0_file(state)
        if rank == 0:
            model.load_state_dict(loaded)
            continue
        with pytest.raises(ValueError, match=error):
            model.load_state_dict(loaded)
        for name, p in model.named_parameters():
            _close(p.to_local(), before[name], f"{name} after the refused load", exact=True)
    torch.manual_seed(0)
    whole = fxshard.compile(fxshard.no_shard(models.Uneven().to(_device())), backend="aot_eager")
    whole.load_state_dict(_rank0_file(whole.state_dict()))  # replicated: alike on every rank


def _rank0_file(state: dict) -> dict:
    """``state`` as rank 0 saved it with ``torch.save``, loaded on every rank."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    files = [buffer.getvalue()]
    dist.broadcast_object_list(files, src=0)
    return torch.load(io.BytesIO(files[0]), weights_only=False)


def full_state_dict_loads_into_shards(rank: int, world_size: int, model: nn.Module) -> None:
    """A full, plain state dict loads into the existing shards (same tensors,
    same slots), with torch's strict key and shape errors."""
    torch.manual_seed(3)
    plain = models.TinyLlama()  # other weights than ``model``'s
    full = {k: v.clone() for k, v in plain.state_dict().items()}
    opt = _adamw(model)
    _llama_steps(model, opt, range(1))  # after the first call: shards live in their units' slots
    locals_before = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    params_before = [id(p) for p in model.parameters()]

    model.load_state_dict(full)
    for name, value in full.items():
        _close(model.state_dict()[name].full_tensor().cpu(), value, f"{name} loaded from a full state dict", exact=True)
    assert {n: p.to_local().data_ptr() for n, p in model.named_parameters()} == locals_before, "shards replaced"
    assert [id(p) for p in opt.param_groups[0]["params"]] == params_before
    units = model.fxshard_plan.units
    assert all(u.shard_slots() is u.slots for u in units.units), "a loaded shard left its slot"

    wrong = dict(full, **{"norm.weight": torch.ones(5)})
    with pytest.raises(RuntimeError, match=r"size mismatch for norm.weight"):
        model.load_state_dict(wrong)
    missing = {k: v for k, v in full.items() if k != "norm.weight"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "norm.weight"'):
        model.load_state_dict(missing)
    assert model.load_state_dict(missing, strict=False).missing_keys == ["norm.weight"]
    assert isinstance(full["norm.weight"], torch.Tensor) and not isinstance(full["norm.weight"], DTensor)

    # Training goes on from the loaded weights as the plain model's would.
    ref = models.TinyLlama().to(_device())
    ref.load_state_dict(full)
    tokens = _tokens(7, rank, world_size).to(_device())
    _close(model(tokens), ref(tokens), "logits after loading")


def full_export_loads_into_plain_model(rank: int, world_size: int, model: nn.Module) -> None:
    """get_model_state_dict(full_state_dict, cpu_offload) gives rank 0 a plain
    state dict that the unsharded model loads, strict."""
    exported = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    full = _full(model)
    if rank != 0:
        assert exported == {}, "cpu_offload gives the full state dict to rank 0 only"
        return
    plain = models.TinyLlama()
    plain.load_state_dict(exported)
    assert not any(isinstance(v, DTensor) for v in exported.values())
    for name, value in plain.state_dict().items():
        _close(value, full[name], f"exported {name}", exact=True)


def dcp_save(rank: int, world_size: int, path: str) -> dict:
    """Train Uneven, save model and AdamW state with DCP, and continue."""
    model = _compiled(models.Uneven, 0, whole=("b",))
    opt = _adamw(model)
    _uneven_steps(model, opt, range(3))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = {"params": _full(model), "optim": _full_optim(model, opt)}
    losses = _uneven_steps(model, opt, range(3, 5))
    return {**saved, "losses": torch.stack(losses), "final": _full(model)}


def dcp_resume(rank: int, world_size: int, path: str, saved: dict, backend: str, mesh: DeviceMesh | None = None,
               zero_stage: int = 3) -> None:  # fmt: skip
    """Load the checkpoint at this world size (or on ``mesh``) and continue training."""
    model = _compiled(models.Uneven, 1, backend, mesh=mesh, zero_stage=zero_stage)
    opt = _adamw(model)
    if zero_stage == 1:  # full copies of the seed-1 weights exist before the load
        with torch.no_grad():
            model(_inputs(0, rank, world_size).to(_device()))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    for name, value in _full(model).items():
        _close(value, saved["params"][name], f"{name} loaded at world size {world_size}", exact=True)
    loaded = _full_optim(model, opt)
    assert loaded.keys() == saved["optim"].keys()
    for name, state in saved["optim"].items():
        for key in ("exp_avg", "exp_avg_sq", "step"):
            _close(loaded[name][key], state[key], f"optimizer {key} of {name}", exact=True)
    _close(torch.stack(_uneven_steps(model, opt, range(3, 5))), saved["losses"], "losses after resuming")
    for name, value in _full(model).items():
        _close(value, saved["final"][name], f"{name} after resuming at world size {world_size}")


def two_rank_checks(rank: int, world_size: int, path: str) -> dict:
    import traceback

    results: dict = {}
    built: dict[str, nn.Module] = {}

    def model(name: str, seed: int) -> nn.Module:  # torch_save's, or a new one where it failed
        if name not in built:
            built[name] = _compiled(models.TinyLlama, seed, whole=LLAMA_WHOLE)
            _llama_steps(built[name], _adamw(built[name]), range(1))
        return built[name]

    checks = {"torch_save": lambda: built.update(torch_save_resumes(rank, world_size)),
              "full_load": lambda: full_state_dict_loads_into_shards(rank, world_size, model("untrained", 2)),
              "full_export": lambda: full_export_loads_into_plain_model(rank, world_size, model("trained", 0)),
              "another_ranks_file": lambda: another_ranks_file_raises(rank, world_size, model("trained", 0))}  # fmt: skip
    for name, check in checks.items():
        try:
            check()
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    torch._dynamo.reset()
    results["dcp_saved"] = dcp_save(rank, world_size, path)
    return results


def _hsdp_mesh(shape: tuple[int, int]) -> DeviceMesh:
    return init_device_mesh(_device().type, shape, mesh_dim_names=("replicate", "shard"))


def hsdp_reshapes(rank: int, world_size: int, path: str) -> None:
    """A DCP checkpoint of an HSDP model (2 x 2 mesh) loads at 1 x 4 and 4 x 1
    (the latter at ZeRO-1), optimizer state included, and training goes on
    as it would have."""
    model = _compiled(models.Uneven, 0, whole=("b",), mesh=_hsdp_mesh((2, 2)))
    opt = _adamw(model)
    _uneven_steps(model, opt, range(3))
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    saved = {"params": _full(model), "optim": _full_optim(model, opt)}
    saved.update(losses=torch.stack(_uneven_steps(model, opt, range(3, 5))), final=_full(model))
    # 4 x 1 resumes at ZeRO-1: the load must reach its full copies (see [Note: ZeRO-1]).
    for shape, zero_stage in (((1, 4), 3), ((4, 1), 1)):
        torch._dynamo.reset()
        dcp_resume(rank, world_size, path, saved, "aot_eager", mesh=_hsdp_mesh(shape), zero_stage=zero_stage)
