"""Checks that parameters stay the user's after compile, run inside each
rank: writes, meta-device init, conversions and optimizers (see [Note:
writes to gathered parameters]). ``run_checks`` runs them by name.

Used by ``tests/test_params.py`` (gloo, CPU) and ``tests/test_gpu.py``
(NCCL, each rank's GPU).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import distribute_tensor

import fxshard
from examples.llama import RMSNorm, lm_loss, rope_tables
from fxshard.runtime import compat
from tests.helpers import models


def _device() -> torch.device:
    """This rank's device: its GPU under NCCL (tests/test_gpu.py), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _mlp() -> nn.Sequential:
    # Rows 5 and 3 shard unevenly at 2 and 3 ranks (rank 2 of 3 holds 1 row of 3).
    return nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).to(_device())


def _same(model: nn.Module, ref: nn.Module | list[torch.Tensor], what: str) -> None:
    expected = ref.parameters() if isinstance(ref, nn.Module) else ref
    for (name, p), q in zip(model.named_parameters(), expected):
        torch.testing.assert_close(
            p.detach().full_tensor(), q.detach().to(p.device), atol=0, rtol=0, msg=f"{what}: {name}"
        )


def _writes(model: nn.Module, seed: int) -> None:
    """Writes a user makes to ``module.weight``, each a different path."""
    device = _device()
    torch.manual_seed(seed)
    nn.init.trunc_normal_(model[0].weight, std=0.5)  # several in-place ops
    nn.init.zeros_(model[0].bias)
    model[2].weight.data.normal_()  # Hugging Face's _init_weights
    with torch.no_grad():
        model[2].weight[1] = 7.0  # __setitem__
        model[2].weight.data[0, 1:3].fill_(-2.0)  # a view of .data
        model[2].bias.copy_(torch.arange(3.0, device=device))
    model[0].bias.data = torch.linspace(0, 1, 5, device=device)  # .data = a full value


def _shard_writes(model: nn.Module, ref: nn.Module, seed: int) -> None:
    """Writes through the shards (``model.parameters()``), and the same writes
    to the unsharded reference."""
    shards = dict(model.named_parameters())
    full = torch.randn(5, 4, generator=torch.Generator().manual_seed(seed)).to(_device())
    shards["0.weight"].data = full  # a DTensor drops this; a ShardParameter keeps its rows
    ref[0].weight.data = full.clone()
    with torch.no_grad():
        shards["2.bias"].copy_(torch.tensor([1.0, 2.0, 3.0], device=full.device) * seed)
        ref[2].bias.copy_(torch.tensor([1.0, 2.0, 3.0], device=full.device) * seed)
        shards["2.weight"].mul_(2)
        ref[2].weight.mul_(2)
    shards["0.bias"].data.add_(0.5)  # an EMA swap's p.data.copy_, a manual SGD's p.data.add_
    ref[0].bias.data.add_(0.5)
    halved = ref[2].weight.detach() / 2  # a DTensor sharded like the shard (FSDP2's way to load values)
    shards["2.weight"].data = distribute_tensor(halved, shards["2.weight"].device_mesh, shards["2.weight"].placements)
    ref[2].weight.data = halved.clone()
    with pytest.raises(ValueError, match="full shape"):
        shards["0.bias"].data = torch.zeros(2)


def reinit_check(rank: int, world_size: int) -> dict:
    """``reset_parameters()`` with gradients enabled (it writes through the
    gathered value, under ``nn.init``'s own no_grad), on rows that shard
    unevenly, before and after the first call: the unsharded module's values."""
    torch.manual_seed(0)
    model = nn.Linear(3, 3, bias=True).to(_device())
    ref = copy.deepcopy(model)
    fxshard.compile(model, backend="aot_eager")
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(2)).to(_device())
    for seed in (1, 2):
        for m in (model, ref):
            torch.manual_seed(seed)
            m.reset_parameters()
        _same(model, ref, f"reset_parameters() #{seed}")
        model(x).sum().backward()
    return {}


def reassign_check(rank: int, world_size: int) -> dict:
    """``self.embed.weight = self.output.weight`` after compile, as torchtitan's
    and Hugging Face's init of tied models does: the parameter assigned to
    itself changes nothing, as in PyTorch; another parameter raises, naming
    the fix (compile fixed what each module holds)."""
    torch.manual_seed(0)
    model = fxshard.compile(models.TinyLlama(tie=True).to(_device()), backend="aot_eager")
    tied = model.get_parameter("embed.weight")
    model.embed.weight = model.output.weight
    model.output.weight = tied
    assert model.get_parameter("embed.weight") is tied and model.get_parameter("output.weight") is tied
    with pytest.raises(ValueError, match="Tie or replace parameters before fxshard.compile"):
        model.norm.weight = model.output.weight
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # DTensors, as FSDP2's init loads
    with pytest.raises(NotImplementedError, match="without assign=True") as raised:
        model.load_state_dict(state, assign=True)  # would untie the embedding and output, unseen by the graph
    # Raised before torch's copy loop, which wrapped it in text about shapes that were equal.
    assert "dimensions" not in str(raised.value), raised.value
    model.load_state_dict(state)
    with pytest.raises(TypeError):  # a plain tensor is no parameter, as in PyTorch
        model.norm.weight = torch.ones(model.norm.weight.shape, device=_device())
    tokens = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(rank)).to(_device())
    lm_loss(model(tokens), tokens).backward()
    assert tied.grad is not None and model.get_parameter("output.weight") is tied
    return {}


def structure_check(rank: int, world_size: int) -> dict:
    """A submodule or parameter that joins the model after compile raises
    before it joins, wherever it joins (see [Note: parameters join before
    compile]); one that brings no parameter of its own passes. Unchecked, each
    rank trained its own copy of the newcomer, out of step, with no error."""
    torch.manual_seed(0)
    model = fxshard.compile(models.TinyLlama(tie=False).to(_device()), backend="aot_eager")
    before = dict(model.named_parameters())
    joins = {
        "a new head": lambda: setattr(model, "output", nn.Linear(24, 37)),
        "a new submodule": lambda: setattr(model, "extra", nn.Linear(24, 24)),
        "a layer appended": lambda: model.layers.append(nn.Linear(24, 24)),
        "a layer replaced": lambda: model.layers.__setitem__(0, nn.Linear(24, 24)),
        "add_module": lambda: model.layers[0].add_module("adapter", nn.Linear(24, 24)),
        "register_parameter": lambda: model.norm.register_parameter("scale", nn.Parameter(torch.ones(24))),
        "a new parameter attribute": lambda: setattr(model.layers[0], "gate", nn.Parameter(torch.ones(1))),
    }
    for what, join in joins.items():
        with pytest.raises(ValueError, match="before fxshard.compile"):
            join()
        assert dict(model.named_parameters()) == before, f"{what}: joined although it raised"
    # No parameter of their own: a module moved or shared within the model, one without parameters.
    model.layers[0].drop = nn.Dropout(0.0)
    model.head_alias = model.output
    model.empty = nn.Sequential()
    with pytest.raises(ValueError, match="before fxshard.compile"):  # watched from when it joined
        model.empty.append(nn.Linear(24, 24))
    assert dict(model.named_parameters()) == before
    tokens = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(rank)).to(_device())
    lm_loss(model(tokens), tokens).backward()
    assert all(p.grad is not None for p in model.parameters())
    plain = nn.Sequential()
    plain.append(nn.Linear(2, 2))  # other modules of the process are not watched
    return {}


def state_dict_aliases_check(rank: int, world_size: int, metas: tuple[bool, ...] = (False, True)) -> dict:
    """A state dict, or a ``to_local()`` view, taken after compile (and after
    ``to_empty`` and init, for a model built on the meta device) but before
    the first call keeps aliasing the parameters through training, as FSDP2's
    does: the first call gives the shards their units' slots, which must keep
    the shards' memory."""
    for meta in metas:
        torch.manual_seed(0)
        model = fxshard.compile(_meta_llama() if meta else models.TinyLlama().to(_device()), backend="aot_eager")
        if meta:
            model.to_empty(device=_device())
            init_weights(model)
        state, views = model.state_dict(), {n: p.to_local() for n, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        tokens = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(rank)).to(_device())
        for _ in range(2):
            lm_loss(model(tokens), tokens).backward()
            opt.step()
        for name, p in model.named_parameters():
            for what, held in (("state_dict()", state[name].to_local()), ("to_local()", views[name])):
                assert held.data_ptr() == p.to_local().data_ptr(), f"meta={meta}: {what} of {name} stopped aliasing"
                torch.testing.assert_close(held, p.to_local(), atol=0, rtol=0, equal_nan=True)
    return {}


def init_through_shards_check(rank: int, world_size: int) -> dict:
    """Init through the shards themselves (``model.parameters()``, as
    torchtitan's ``init_weights`` does): with the same seed, the unsharded
    model's weights at any world size (see [Note: random init through the
    shards]); DTensor alone draws each rank's rows on its own."""
    inits = [lambda p: nn.init.normal_(p, std=0.02), lambda p: nn.init.uniform_(p, -0.1, 0.1),
             lambda p: nn.init.kaiming_uniform_(p, a=math.sqrt(5)) if p.dim() > 1 else nn.init.zeros_(p),
             lambda p: nn.init.xavier_normal_(p) if p.dim() > 1 else nn.init.ones_(p),
             lambda p: nn.init.trunc_normal_(p, std=0.02),
             lambda p: p.data.normal_(0, 0.02),  # through .data (once drew alike on every CPU rank)
             lambda p: nn.init.normal_(p.data, std=0.02)]  # fmt: skip
    torch.manual_seed(0)
    model = models.TinyLlama(tie=False).to(_device())
    ref = copy.deepcopy(model)
    fxshard.compile(model, backend="aot_eager")
    for i, init in enumerate(inits):
        for m in (model, ref):
            torch.manual_seed(i)
            for p in m.parameters():
                init(p)
        _same(model, ref, f"init #{i} through the shards")
    with pytest.raises(RuntimeError, match="leaf Variable"):  # grad mode: torch refuses it on any such leaf
        model.get_parameter("norm.weight").normal_()
    return {}


def _compiled_llama(backend: str) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """A compiled TinyLlama, its unsharded copy, and an AdamW for each."""
    torch.manual_seed(0)
    model = models.TinyLlama(tie=False).to(_device())
    ref = copy.deepcopy(model)
    fxshard.compile(model, backend=backend)
    return model, ref, torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)


def _every_rank_tokens(step: int, world_size: int) -> list[torch.Tensor]:
    return [torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(10 * step + r)).to(_device())
            for r in range(world_size)]  # fmt: skip


def outer_compile_check(rank: int, world_size: int, backend: str = "aot_eager") -> dict:
    """``torch.compile(model)`` over a compiled model, as users wrap models out
    of habit, trains as the model does (AOTAutograd refused the shards as
    inputs once: "expected DTensor, got ShardParameter"); ``backend`` for both."""
    model, ref, opt, ref_opt = _compiled_llama(backend)
    wrapped = torch.compile(model, backend=backend)
    for step in range(2):
        tokens = _every_rank_tokens(step, world_size)
        lm_loss(wrapped(tokens[rank]), tokens[rank]).backward()
        (sum(lm_loss(ref(t), t) for t in tokens) / world_size).backward()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, atol=2e-5, rtol=1e-4, msg=name)
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    # The outer compile skips fxshard's call: its own graph ran, as one.
    assert not model.fxshard_plan.sequenced, model.fxshard_plan.graph_break_reason
    return {}


def compiled_step_check(rank: int, world_size: int) -> dict:
    """A training step under the user's ``torch.compile`` (forward, backward
    and ``opt.step()`` in one compiled function, as torchtitan-style loops
    write it) trains as the model does, and fxshard's own graph runs."""
    model, ref, opt, ref_opt = _compiled_llama("aot_eager")

    @torch.compile(backend="aot_eager")
    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    for i in range(3):
        tokens = _every_rank_tokens(i, world_size)
        step(tokens[rank])
        (sum(lm_loss(ref(t), t) for t in tokens) / world_size).backward()
        ref_opt.step(), ref_opt.zero_grad()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, atol=1e-5, rtol=1e-4, msg=name)
    assert not model.fxshard_plan.sequenced and len(model.fxshard_plan.graphs) == 1, model.fxshard_plan.graphs
    return {}


def writes_check(rank: int, world_size: int, zero_stage: int = 3) -> dict:
    """``zero_stage=1``: the writes must reach the kept full copies too (see [Note: ZeRO-1])."""
    torch.manual_seed(0)
    model = _mlp()
    ref = copy.deepcopy(model)
    fxshard.compile(model, backend="aot_eager", zero_stage=zero_stage)
    _writes(model, seed=1)
    _writes(ref, seed=1)
    _shard_writes(model, ref, seed=1)
    _same(model, ref, "before the first call")
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2)).to(_device())
    torch.testing.assert_close(model(x), ref(x))
    model(x).sum().backward()  # the first call moves the shards into their units' slots
    _writes(model, seed=3)
    _writes(ref, seed=3)
    _shard_writes(model, ref, seed=3)
    _same(model, ref, "after a step")
    torch.testing.assert_close(model(x), ref(x), msg="the next call must compute with the written values")
    model.get_parameter("2.bias").data.add_(1.0)  # the only write: ZeRO-1 must see it
    ref[2].bias.data.add_(1.0)
    torch.testing.assert_close(model(x), ref(x), msg="a write through p.data alone")
    return {}


def held_values_check(rank: int, world_size: int, zero_stage: int = 3) -> dict:
    """A ``module.weight`` value held across changes (see [Note: writes to
    gathered parameters]): usable while its parameter is unchanged (the first
    call moving the shard into a unit's slot is no change), a write through
    an alias of it lands, and once an optimizer step or another write changed
    the parameter, any use raises instead of reading or writing back old values."""
    torch.manual_seed(0)
    model = fxshard.compile(_mlp(), backend="aot_eager", zero_stage=zero_stage, unit_mb=0.0001)
    held = model[2].weight
    alias = held.data
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2)).to(_device())
    model(x).sum().backward()
    torch.testing.assert_close(held, model[2].weight)
    with torch.no_grad():
        alias.mul_(2.0)
    torch.testing.assert_close(held, model[2].weight, msg="a write through an alias renews the held value")
    stale = "read .* before the parameter changed.*Read the attribute again"
    for write in (lambda p: p.data.mul_(1.0), lambda p: p.mul_(1.0)):  # in place on the shard itself
        value = model[2].weight
        with torch.no_grad():
            write(model.get_parameter("2.weight"))
        with pytest.raises(ValueError, match=stale):
            value.sum()
    torch.optim.SGD(model.parameters(), lr=0.1).step()  # fused optimizers bump no version: counted by a hook
    after_step = model[2].weight.detach().clone()
    with pytest.raises(ValueError, match=stale), torch.no_grad():
        held.mul_(1.0)  # would put the values before the step back
    torch.testing.assert_close(model[2].weight, after_step)
    fresh = model[2].weight
    with torch.no_grad():
        model[2].weight.add_(1.0)  # another value writes the shard
        with pytest.raises(ValueError, match=stale):
            fresh.sum()
    return {}


def storage_swaps_check(rank: int, world_size: int) -> dict:
    """New memory for the same values is no change, and new memory for new
    values is one (see [Note: has it changed]). A shard given another local
    tensor moves into its unit's slot at the first call (on the ranks whose
    rows fill less than the slot, here rank 1 at 2 ranks): a value held
    across the move alone is current, but one held across the move and an
    optimizer step is stale, on every rank. A gradient whose local tensor
    gets other memory (``.data =``, which moves no version counter) makes a
    gathered gradient held across it stale."""
    torch.manual_seed(0)
    model = fxshard.compile(_mlp(), backend="aot_eager", unit_mb=0.0001)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2)).to(_device())
    shard = model.get_parameter("2.weight")
    # Not in its slot, as a shard whose local tensor was replaced is (units.Units.rehome).
    compat.replace_local_tensor(shard, shard.to_local().clone())
    held, moved_only = model[2].weight, model[2].weight
    model(x).sum().backward()
    torch.testing.assert_close(moved_only, model[2].weight, msg="a move is no change")
    grad = model[2].weight.grad
    with torch.no_grad():
        shard.grad.to_local().data = torch.zeros_like(shard.grad.to_local())
    with pytest.raises(ValueError, match="full gradient of '2.weight' was read .* before the gradient changed"):
        grad.sum()
    torch.optim.AdamW(model.parameters(), lr=0.1, fused=True).step()
    with pytest.raises(ValueError, match="read .* before the parameter changed.*Read the attribute again"):
        held.sum()
    return {}


def empty_then_stepped_check(rank: int, world_size: int) -> dict:
    """A shard that ``to_empty`` left uninitialized and that only an optimizer
    step wrote (foreach and fused steps move no version counter) is written:
    ``module.weight`` reads the shards, not an empty tensor."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    fxshard.compile(model, backend="aot_eager")
    model.to_empty(device=_device())
    model(torch.randn(6, 4, device=_device())).sum().backward()
    torch.optim.AdamW(model.parameters(), lr=0.1, fused=True).step()
    shard = model.get_parameter("2.weight")
    assert not shard.uninitialized, "a step wrote it"
    # to_empty's memory may hold NaNs, and so may what a step makes of it.
    torch.testing.assert_close(model[2].weight, shard.full_tensor(), atol=0, rtol=0, equal_nan=True)
    return {}


def swap_load_check(rank: int, world_size: int) -> dict:
    """``load_state_dict`` under ``torch.__future__.set_swap_module_params_on_conversion(True)``
    (which some libraries set for the whole process) loads the full values into
    the shards in place: the parameters stay the same objects and of the same
    class, keep their hooks and their optimizer, and training goes on as the
    unsharded model's does."""
    torch.manual_seed(0)
    ref = _mlp()
    model = fxshard.compile(copy.deepcopy(ref), backend="aot_eager")
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (model, ref)]
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2)).to(_device())
    seen = []
    model.get_parameter("0.weight").register_hook(lambda grad: seen.append(grad.shape))
    params = [(p, type(p)) for p in model.parameters()]
    values = {k: v.detach() + 1 for k, v in ref.state_dict().items()}
    ref.load_state_dict(values)
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.load_state_dict(values)
        assert torch.__future__.get_swap_module_params_on_conversion(), "the user's flag is kept"
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    assert [(p, type(p)) for p in model.parameters()] == params, "the same parameters, of the same class"
    assert torch.equal(model[0].weight, ref[0].weight), "module.weight reads the loaded values"
    for step in range(2):
        losses = [m(x).pow(2).sum() for m in (model, ref)]
        for loss, opt in zip(losses, opts):
            loss.backward()
            opt.step()
            opt.zero_grad()
        torch.testing.assert_close(losses[0], losses[1], msg=f"step {step} loss")
    assert len(seen) == 2, f"the hook on 0.weight ran {len(seen)} times in 2 backwards"
    # Trained, not loaded: the average over ranks may round an ulp away from the
    # reference's gradient (at 3 ranks, on some CPUs), which Adam carries into the step.
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().full_tensor(), q.detach(), atol=1e-5, rtol=1e-4,
                                   msg=f"after 2 steps: {name}")  # fmt: skip
    return {}


def grads_through_attribute_check(rank: int, world_size: int, zero_stage: int = 3) -> dict:
    """``module.weight.grad`` is the parameter's full gradient, as in PyTorch
    (see [Note: writes to gathered parameters]): read, written in place,
    assigned and deleted, sharded (uneven rows) and replicated (``no_shard``),
    each compared with the unsharded model doing the same; gradient hooks
    registered through ``module.weight`` run."""
    torch.manual_seed(0)
    model = _mlp()
    ref = copy.deepcopy(model)
    fxshard.no_shard(model[0].bias)
    fxshard.compile(model, backend="aot_eager", zero_stage=zero_stage)
    assert model[2].weight.grad is None and model[0].bias.grad is None
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2)).to(_device())
    accumulated = []
    for m in (model, ref):
        m[2].weight.register_hook(lambda g: g * 2)  # on the value it would never run
        m[0].bias.register_post_accumulate_grad_hook(lambda p: accumulated.append(p.grad is not None))
        m(x).pow(2).sum().backward()
    assert accumulated == [True, True], accumulated
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        module, attr = name.split(".")
        got = getattr(model[int(module)], attr).grad
        torch.testing.assert_close(got, getattr(ref[int(module)], attr).grad, msg=f"{name}.grad read")
    # A hand-written zero_grad's first line: the gradient's own flag, the parameter's untouched.
    for m in (model, ref):
        assert m[2].weight.grad.requires_grad_(False).requires_grad is False
        assert m[2].weight.requires_grad
    held = model[2].weight.grad
    with torch.no_grad():
        for m in (model, ref):
            m[2].weight.grad[1:] = 0.0  # e.g. freezing rows of an embedding
            m[0].bias.grad.mul_(3.0)
            m[0].weight.grad = torch.full_like(m[0].weight.grad, 0.5)
        del model[2].bias.grad
        ref[2].bias.grad = None
    with pytest.raises(ValueError, match=r"full gradient of '2.weight' was read .* before the gradient changed"):
        held.sum()
    held = model[0].weight.grad
    with torch.no_grad():
        model.get_parameter("0.weight").grad.mul_(1.0)  # in place on the DTensor (clip_grad_norm_ does so)
    with pytest.raises(ValueError, match="before the gradient changed"):
        held.sum()
    assert model.get_parameter("2.bias").grad is None
    with pytest.raises(ValueError, match="full gradient's shape"):
        model[0].weight.grad = torch.zeros(3)
    # fp32 tolerance, not equality: the written values are exact, but the rest is an
    # average over ranks, which may round an ulp away from the reference (at 3 ranks,
    # on some CPUs).
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        got = None if p.grad is None else p.grad.full_tensor()
        torch.testing.assert_close(got, q.grad, msg=f"{name}: the shard's gradient after writes")
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(
            p.detach().full_tensor(), q.detach(), msg=f"after a step on written gradients: {name}"
        )
    return {}


def loss_outside_forward_check(rank: int, world_size: int, zero_stage: int = 3) -> dict:
    """A loss term on ``module.weight`` computed outside the forward (a
    penalty on the weights) reaches the shards' gradients, sharded and
    replicated (``no_shard``), as in the unsharded model; a frozen one reads
    the replicated tensor itself."""
    torch.manual_seed(0)
    model = _mlp()
    ref = copy.deepcopy(model)
    fxshard.no_shard(model[0])
    model[0].weight.requires_grad_(False)
    ref[0].weight.requires_grad_(False)
    fxshard.compile(model, backend="aot_eager", zero_stage=zero_stage)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2)).to(_device())
    for m in (model, ref):
        penalty = 0.1 * m[2].weight.pow(2).sum() + m[0].bias.abs().sum() + m[2].bias.sum()
        (m(x).pow(2).sum() + penalty).backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        got = None if p.grad is None else p.grad.full_tensor()
        torch.testing.assert_close(got, q.grad, msg=f"{name}: gradient with a penalty outside the forward")
    frozen = model.get_parameter("0.weight")
    assert model[0].weight.data_ptr() == frozen.to_local().data_ptr(), "a frozen replicated read copied"
    return {}


def freeze_through_attribute_check(rank: int, world_size: int) -> dict:
    """``module.weight.requires_grad_(False)`` (or ``= False``) freezes the
    parameter, as in PyTorch, though the value read is a gathered copy."""
    torch.manual_seed(0)
    model = fxshard.compile(_mlp(), backend="aot_eager")
    assert model[2].weight.requires_grad_(False) is not None
    model[0].bias.requires_grad = False
    assert not model[2]._parameters["weight"].requires_grad and not model[0]._parameters["bias"].requires_grad
    model(torch.randn(6, 4, device=_device())).sum().backward()
    trained = {name for name, p in model.named_parameters() if p.grad is not None}
    assert trained == {"0.weight", "2.bias"}, trained
    return {}


def zero1_fused_step_check(rank: int, world_size: int) -> dict:
    """A fused optimizer writes the shards without bumping any version
    counter: ZeRO-1's full copies must still be gathered again after its
    step (the shards' step count, ``module.optimizers.count_optimizer_steps``)."""
    torch.manual_seed(0)
    model = _mlp()
    ref = copy.deepcopy(model)
    fxshard.compile(model, backend="aot_eager", zero_stage=1)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=0.1, fused=True) for m in (model, ref))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(2)).to(_device())  # alike on every rank
    for step in range(3):
        out, ref_out = model(x), ref(x)
        torch.testing.assert_close(out, ref_out, msg=f"step {step}: the copies must hold the stepped weights")
        out.sum().backward(), ref_out.sum().backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    return {}


def optimizer_before_compile_check(rank: int, world_size: int) -> dict:
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters())
    fxshard.compile(model, backend="aot_eager")
    model(torch.randn(2, 4, device=_device())).sum().backward()
    with pytest.raises(ValueError, match=r"'0.weight' as it was before fxshard.compile.*after compiling"):
        opt.step()
    torch.optim.AdamW(model.parameters()).step()  # one built after compile steps
    return {}


def conversions_check(rank: int, world_size: int) -> dict:
    model = fxshard.compile(_mlp(), backend="aot_eager")
    before = [p.detach().full_tensor() for p in model.parameters()]
    params = list(model.parameters())
    assert model.float() is model and model.to(_device()) is model  # no change: nothing to do
    assert all(p is q for p, q in zip(model.parameters(), params))
    with pytest.raises(ValueError, match=r"'0.weight' is a torch.float32 shard.*before fxshard.compile"):
        model.half()
    with pytest.raises(ValueError, match="cannot be converted to torch.bfloat16"):
        model.to(torch.bfloat16)
    with pytest.raises(NotImplementedError, match="EMA"):
        copy.deepcopy(model)
    _same(model, before, "a refused conversion changes nothing")
    return {}


def init_weights(model: nn.Module) -> None:
    """A torchtitan-style init of the test Llama: every value set again,
    buffers included (``to_empty`` leaves them uninitialized too)."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.trunc_normal_(module.weight, std=0.02)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
    cfg = model.cfg
    cos, sin = rope_tables(cfg.dim // cfg.heads, cfg.max_len)
    model.rope_cos, model.rope_sin = cos.to(_device()), sin.to(_device())


def _meta_llama() -> nn.Module:
    with torch.device("meta"):
        return models.TinyLlama()


def identical_rows_check(rank: int, world_size: int) -> dict:
    """A weight drawn per shard with one seed (``torch.randn_like(p)`` makes a
    new DTensor, which draws every CPU rank's rows alike) would never break
    symmetry: the first call raises on every rank, naming the weight and the
    fix, and runs once the weight is drawn in place. On GPUs DTensor draws
    each rank's rows apart, and nothing raises. Neither a weight whose rows
    are one row repeated by design (Mamba's ``A_log``) nor one of two values
    (a norm's, one Adam step from ones) ever raises."""
    model = fxshard.compile(_meta_llama(), backend="aot_eager")
    tokens = torch.zeros(1, 3, dtype=torch.long, device=_device())
    with pytest.raises(ValueError, match="meta device.*to_empty"):  # a call before the values: checked later
        model(tokens)
    model.to_empty(device=_device())
    torch.manual_seed(0)
    init_weights(model)
    wq = model.get_parameter("layers.0.attn.wq.weight")
    wk = model.get_parameter("layers.0.attn.wk.weight")
    with torch.no_grad():
        wq.copy_(torch.randn_like(wq))
        # As Mamba's A_log = log(arange(1, N + 1)).expand(rows, N): every rank's rows alike
        wk.copy_(torch.arange(1, wk.shape[1] + 1, dtype=wk.dtype, device=_device()).log().expand(wk.shape))
        # Two values, as one Adam step from ones leaves (1 -+ lr), and every rank's rows alike:
        # a norm's few rows, and a larger weight's.
        norm = model.get_parameter("layers.0.attn_norm.weight")
        norm.copy_(torch.tensor([0.99, 1.01], device=_device()).repeat(norm.shape[0] // 2))
        wv = model.get_parameter("layers.0.attn.wv.weight")
        signs = torch.randint(
            0, 2, (wv.shape[0] // world_size, wv.shape[1]), generator=torch.Generator().manual_seed(0)
        )
        wv.copy_((1 + 0.02 * signs - 0.01).repeat(world_size, 1).to(_device()))
    if _device().type == "cpu":
        with pytest.raises(ValueError, match=r"ranks 0 and 1 .* 'layers\.0\.attn\.wq\.weight' hold the same rows"):
            model(tokens)
        with torch.no_grad():
            wq.normal_()
    model(tokens)  # checked once, then as any call
    return {}


def meta_init_check(rank: int, world_size: int, train: bool, zero_stage: int = 3) -> dict:
    """Meta model, compile, ``to_empty``, the model's own init: the same full
    weights as the unsharded model's init with the same seed, at any world size."""
    ref = _meta_llama().to_empty(device=_device())
    ref.output.weight = ref.embed.weight  # torch's to_empty unties them; fxshard keeps the one shard
    torch.manual_seed(0)
    init_weights(ref)
    model = fxshard.compile(_meta_llama(), backend="aot_eager", zero_stage=zero_stage)
    shards = list(model.parameters())
    assert all(p.to_local().is_meta for p in shards)
    with pytest.raises(ValueError, match="meta device.*to_empty"):
        model(torch.zeros(1, 3, dtype=torch.long, device=_device()))
    early = torch.optim.AdamW(model.parameters())
    model.to_empty(device=_device())
    torch.manual_seed(0)
    init_weights(model)
    assert len(list(model.parameters())) == len(shards)
    if train:  # an optimizer must be built after to_empty, as in plain PyTorch
        with pytest.raises(ValueError, match="as it was before"):
            early.step()
    assert not any(p.uninitialized for p in model.parameters()), "every parameter was written"
    if not train:  # init through the shards themselves counts as written too
        again = fxshard.compile(_meta_llama(), backend="aot_eager", zero_stage=zero_stage).to_empty(device=_device())
        with torch.no_grad():
            for q in again.parameters():
                q.fill_(1.0)
            again.norm.weight[0] = 5.0  # a write through the gathered value keeps the other values
        expected = torch.ones(again.norm.weight.shape, device=_device())
        expected[0] = 5.0
        torch.testing.assert_close(again.get_parameter("norm.weight").full_tensor(), expected)
    for name, p in model.named_parameters():
        rows = p.to_local().shape[0]
        assert rows == math.ceil(p.shape[0] / world_size) or rows < p.shape[0], f"{name}: not a shard"
    _same(model, ref, f"init at world size {world_size}")
    if train:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        for step in range(2):
            tokens = [torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(10 * step + r)).to(_device())
                      for r in range(world_size)]  # fmt: skip
            loss = lm_loss(model(tokens[rank]), tokens[rank])
            loss.backward()
            sum(lm_loss(ref(t), t) for t in tokens).div(world_size).backward()
            for (name, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, atol=2e-5, rtol=1e-4, msg=name)
            opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    return {}


def run_checks(rank: int, world_size: int, names: list[str]) -> dict:
    checks = {"writes": writes_check, "reinit": reinit_check, "reassign": reassign_check, "structure": structure_check,
              "state_dict_aliases": state_dict_aliases_check, "init_through_shards": init_through_shards_check,
              "state_dict_aliases_meta": lambda r, ws: state_dict_aliases_check(r, ws, metas=(True,)),
              "state_dict_aliases_not_meta": lambda r, ws: state_dict_aliases_check(r, ws, metas=(False,)),
              "outer_compile": outer_compile_check, "identical_rows": identical_rows_check,
              "compiled_step": compiled_step_check,
              "optimizer_before_compile": optimizer_before_compile_check,
              "outer_compile_inductor": lambda r, ws: outer_compile_check(r, ws, backend="inductor"),
              "conversions": conversions_check, "meta_init": lambda r, ws: meta_init_check(r, ws, train=False),
              "meta_init_trains": lambda r, ws: meta_init_check(r, ws, train=True),
              "writes_zero1": lambda r, ws: writes_check(r, ws, zero_stage=1), "held_values": held_values_check,
              "freeze_through_attribute": freeze_through_attribute_check, "zero1_fused_step": zero1_fused_step_check,
              "grads_through_attribute": grads_through_attribute_check,
              "storage_swaps": storage_swaps_check, "swap_load": swap_load_check, "empty_then_stepped": empty_then_stepped_check,
              "loss_outside_forward": loss_outside_forward_check,
              "loss_outside_forward_zero1": lambda r, ws: loss_outside_forward_check(r, ws, zero_stage=1),
              "grads_through_attribute_zero1": lambda r, ws: grads_through_attribute_check(r, ws, zero_stage=1),
              "held_values_zero1": lambda r, ws: held_values_check(r, ws, zero_stage=1),
              "meta_init_trains_zero1": lambda r, ws: meta_init_check(r, ws, train=True, zero_stage=1)}  # fmt: skip
    for name in names:
        checks[name](rank, world_size)
        torch._dynamo.reset()
    return {}
