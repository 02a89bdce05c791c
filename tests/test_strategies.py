"""Replicated parameters (fxshard.no_shard, frozen ones) and HSDP meshes:
the plan, its dump, the memory fallback, and unfreezing after compile (gloo, CPU)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import fxshard
from examples.llama import lm_loss
from fxshard import plan as plan_module
from fxshard.runtime import compat
from fxshard.runtime.collectives import gather_many
from tests.helpers import models, runtime
from tests.helpers.distributed import check_results, run_ranks


def test_plan_is_dumped(fake_pg, tmp_path):
    model = models.TinyLlama(tie=False)
    model.layers[0].requires_grad_(False)
    fxshard.no_shard(model.norm)
    fxshard.compile(model, backend="aot_eager", debug_dir=tmp_path, reshard_after_forward=False)
    text = (tmp_path / "rank0" / "plan.txt").read_text()
    # "<index> <name> ...": graphs' markers name each parameter by its index.
    head, _, by_index = text.partition(f"plan {runtime.state(model).table.id}, by index:\n")
    assert head.startswith("parameters: ")  # the counts per kind first
    numbered = [line.split(maxsplit=2) for line in by_index.splitlines()]
    lines = {name: line for _, name, line in numbered}
    assert [int(i) for i, *_ in numbered] == list(range(len(numbered)))
    assert [name for _, name, _ in numbered] == [p.fqn for p in model.fxshard_plan.params]
    assert (
        "Replicate(), compute/reduce float32/float32, gradient none, gathered value always"
        in lines["layers.0.attn.wq.weight"]
    )
    assert "Replicate(), compute/reduce float32/float32, gradient all-reduce" in lines["norm.weight"]
    assert (
        "Shard(0), compute/reduce float32/float32, gradient reduce-scatter, gathered value until backward"
        in (lines["layers.1.mlp.w1.weight"])
    )
    assert len(lines) == len(model.fxshard_plan.params)


def test_hsdp_shards_within_the_inner_dimension(fake_pg, tmp_path):
    """A 2-D mesh is (replicate, shard): parameters are sharded over the inner
    dimension and replicated over the outer one; the dump says so. The
    numbers are checked against the reference in test_parity (hsdp*)."""
    with pytest.raises(ValueError, match="mesh_dim_names=\\('replicate', 'shard'\\)"):
        fxshard.compile(nn.Linear(4, 4), init_device_mesh("cpu", (2, 2)))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("outer", "inner"))  # any names: replicate first
    model = models.TinyLlama(tie=False)
    fxshard.no_shard(model.norm)
    fxshard.compile(model, mesh, backend="aot_eager", debug_dir=tmp_path)
    w1 = model.layers[0].mlp.w1._parameters["weight"]
    assert w1.placements == (Replicate(), Shard(0)) and w1.device_mesh is mesh
    assert w1.to_local().shape[0] == -(-w1.shape[0] // 2)  # rank 0's rows of 2 shards, not 4
    assert model.norm._parameters["weight"].placements == (Replicate(), Replicate())
    plan = model.fxshard_plan
    assert plan.shard_mesh.size() == 2 and all(p.world_size == 2 and p.replicas == 2 for p in plan.params)
    text = (tmp_path / "rank0" / "plan.txt").read_text()
    assert "(Replicate(), Shard(0)), gradient reduce-scatter, then all-reduce over 2 replicas" in text
    assert "(Replicate(), Replicate()), gradient all-reduce, then all-reduce over 2 replicas" in text
    lm_loss(model(torch.randint(0, 37, (2, 9))), torch.randint(0, 37, (2, 9))).backward()
    assert w1.grad.placements == (Replicate(), Shard(0))


def _mlp() -> nn.Module:
    """For the checks of ZeRO-1's gathers and of accumulation's phases, memory
    and resets, which do not depend on the layers: it compiles in a tenth of
    TinyLlama's time (TinyLlama's accumulating graphs are
    tests/test_golden_graphs.py's; tests/test_parity.py trains them and ZeRO-1)."""
    return nn.Sequential(nn.Linear(6, 10), nn.ReLU(), nn.Linear(10, 5))


def test_zero1_gathers_once_per_step_and_after_writes(no_dist, monkeypatch):
    """ZeRO-1's full copies are gathered at the first call after an optimizer
    step (fused AdamW bumps no version counter: the step hook sees it) or
    after a write to the shards, never per micro-batch; they hold the
    parameters' values; accumulation without sync is refused."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.manual_seed(0)
    model = fxshard.compile(_mlp(), backend="aot_eager", zero_stage=1)
    plan = model.fxshard_plan
    assert plan.zero_stage == 1 and all(p.kept and p.lifetime.value == "always" for p in plan.params)
    kept = runtime.state(plan).shards.kept
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    x = torch.randn(4, 6)

    def copies_match() -> None:
        params = runtime.state(plan).shards.parameters()
        for i in kept.members:
            torch.testing.assert_close(kept.full[i], params[i].full_tensor(), atol=0, rtol=0)

    with torch.inference_mode():  # the copies must not be inference tensors, which training could not refresh
        model(x)
    for _ in range(2):
        for _ in range(3):
            model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    assert kept.gathers == 2  # at the inference call, and after the first step
    with torch.no_grad():
        model(x)
    assert kept.gathers == 3
    copies_match()
    model.load_state_dict({k: torch.full(v.shape, 0.5) for k, v in model.state_dict().items()})
    model(x)
    assert kept.gathers == 4 and bool((kept.full[0] == 0.5).all())
    with torch.no_grad():
        model[0].weight.mul_(2)  # written through the gathered parameter into the shard
    model(x)
    assert kept.gathers == 5
    copies_match()
    # Without sync the full gradients are kept, not reduced, and nothing is gathered again.
    model.set_requires_gradient_sync(False)
    model(x).pow(2).mean().backward()
    assert kept.gathers == 5 and set(kept.members) <= set(runtime.state(plan).store.grads)
    model.set_requires_gradient_sync(True)
    model(x).pow(2).mean().backward()
    assert kept.gathers == 5 and not runtime.state(plan).store.grads


class _ReturnsWeights(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.b(self.a(x)).sum(), self.a.weight.T, self.b.weight[1:3], self.a.bias


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_zero1_outputs_never_alias_the_kept_copies(no_dist, monkeypatch, backend):
    """Graphs read ZeRO-1's kept copies in place; a forward that returns a
    weight, or a view of one, returns a copy, with and without grad: a write
    to it must not reach the kept copy, which the next micro-batch reads
    (before, a returned view was the kept copy itself)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    torch.manual_seed(0)
    model = fxshard.compile(_ReturnsWeights(), backend=backend, zero_stage=1)
    kept = runtime.state(model.fxshard_plan).shards.kept
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            _, *weights = model(torch.randn(3, 4))
        before = {i: full.clone() for i, full in kept.full.items()}
        with torch.no_grad():
            for w in weights:
                w.mul_(0)
        assert all(torch.equal(kept.full[i], before[i]) for i in before), f"grad={grad}: a write reached a kept copy"


def test_coalesced_gather_takes_empty_and_one_dimensional_parameters(fake_pg):
    """ZeRO-1's coalesced gather on shapes that ``reshape(-1)`` trips on: no
    elements, no rows on this rank, one dimension (fake group: shapes only)."""
    group = dist.group.WORLD.group_name
    shards = [torch.empty(0, 8), torch.empty(1, 0), torch.randn(1), torch.randn(2, 3)]  # rank 0 of 4
    full = gather_many(shards, [0, 4, 3, 7], 4, group, torch.bfloat16)
    assert [tuple(t.shape) for t in full] == [(0, 8), (4, 0), (3,), (7, 3)]
    assert all(t.dtype == torch.bfloat16 for t in full)


def test_frozen_that_do_not_fit_are_sharded(fake_pg, monkeypatch, caplog):
    """Replicating frozen parameters is the default only while they fit."""
    monkeypatch.setattr(plan_module, "FROZEN_REPLICATE_SHARE", 0.0)
    model = models.TinyLlama(tie=False)
    model.layers.requires_grad_(False)
    with caplog.at_level(logging.WARNING, logger="fxshard"):
        fxshard.compile(model, backend="aot_eager")
    assert "sharding them" in caplog.text and "shard_frozen=True" in caplog.text
    assert all(p.placement.value == "Shard(0)" for p in model.fxshard_plan.params)


def _unfreeze_later(rank: int, world_size: int) -> dict:
    """A module frozen at compile (so replicated) and unfrozen later gets its
    gradient all-reduced, as the unsharded reference's (on the small MLP)."""
    torch.manual_seed(0)
    model, ref = _mlp(), _mlp()
    ref.load_state_dict(model.state_dict())
    model[2].requires_grad_(False)
    fxshard.compile(model, backend="aot_eager")
    plan = {p.fqn: p for p in model.fxshard_plan.params}
    assert plan["2.weight"].placement.value == "Replicate()" and plan["0.weight"].placement.value == "Shard(0)"
    batches = [torch.randn(4, 6, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    model(batches[rank]).pow(2).mean().backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n.startswith("2."))
    model.zero_grad()
    model[2].requires_grad_(True)
    model(batches[rank]).pow(2).mean().backward()
    (sum(ref(b).pow(2).mean() for b in batches) / world_size).backward()
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), refs[name].grad, atol=2e-5, rtol=1e-4, msg=name)
    return {}


def _micro_step(model, sync: bool) -> None:
    model.set_requires_gradient_sync(sync)
    model(torch.randn(4, 6)).pow(2).mean().backward()


def test_accumulation_without_sync_compiles_one_graph_per_phase(fake_pg):
    """Micro-batches without sync run a graph with no reduce (their full
    gradients go to the store); the one with sync runs a graph that adds
    them before its reduces; each compiles once."""
    from fxshard.runtime.ops import ACCUMULATE_GRAD, TAKE_ACCUMULATED

    model = _mlp()
    fxshard.compile(model, backend="aot_eager")
    for _ in range(2):
        _micro_step(model, False)
        _micro_step(model, False)
        _micro_step(model, True)
    accumulate, flush = model.fxshard_plan.graphs
    n = len(model.fxshard_plan.params)
    assert accumulate.reports["backward"].count("reduce") == 0
    assert len([x for x in accumulate.backward.graph.nodes if x.target == ACCUMULATE_GRAD]) == n
    assert len([x for x in flush.backward.graph.nodes if x.target == TAKE_ACCUMULATED]) == n
    assert flush.reports["backward"].count("reduce") == n
    assert "(accumulated: no collective)" in accumulate.collectives[0]
    assert not runtime.state(model).pending()
    _micro_step(model, True)  # no accumulation before it: the plain graph
    assert len(model.fxshard_plan.graphs) == 3
    assert model.fxshard_plan.graphs[2].reports["backward"].count("reduce") == n


def test_optimizer_step_before_the_sync_backward_raises(fake_pg):
    model = _mlp()
    fxshard.compile(model, backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters())
    _micro_step(model, False)
    with pytest.raises(ValueError, match=r"set_requires_gradient_sync\(True\)"):
        opt.step()
    _micro_step(model, True)
    opt.step()
    with pytest.raises(ValueError, match="True or False"):
        model.set_requires_gradient_sync(0)


def _storage_bytes(tensors) -> int:
    return sum(t.untyped_storage().nbytes() for t in tensors)


@pytest.mark.parametrize("zero_stage", [3, 1])
def test_accumulation_without_sync_holds_no_sharded_gradients(fake_pg, zero_stage):
    """Between micro-batches without sync the gradient memory alive is the
    kept full gradients (in the reduce dtype), as under FSDP2: each shard's
    .grad is one zero element (see [Note: a zero gradient without memory]),
    not 1/world of the model in the shard dtype. A byte count. Under the
    benchmark's mixed precision (bf16 compute, fp32 reduce and shards)."""
    model = _mlp()
    fxshard.compile(model, backend="aot_eager", zero_stage=zero_stage,
                    mp_policy=fxshard.MixedPrecision(torch.bfloat16, torch.float32))  # fmt: skip
    params = list(model.parameters())
    shard_bytes = _storage_bytes(p.to_local() for p in params)
    for _ in range(2):
        _micro_step(model, False)
        grads = [p.grad.to_local() for p in params]
        assert _storage_bytes(grads) == sum(p.element_size() for p in params)  # one element each
        assert not any(g.any() for g in grads)
        kept = runtime.state(model).store.grads.values()
        assert _storage_bytes(kept) == sum(p.numel() * 4 for p in params)  # every full gradient, fp32
    _micro_step(model, True)
    assert _storage_bytes(p.grad.to_local() for p in params) >= shard_bytes
    assert not runtime.state(model).store.grads


def test_a_reset_leaves_no_zero_gradient_without_memory(fake_pg):
    """zero_grad(set_to_none=False) after a micro-batch without sync drops the
    kept gradients; the zero .grad without memory it zeroed becomes a real
    zero gradient by the optimizer step, which reads it (a fused optimizer
    reads a gradient as contiguous memory: the expanded zero, as garbage)."""
    model = _mlp()
    fxshard.compile(model, backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters())
    _micro_step(model, False)
    opt.zero_grad(set_to_none=False)
    opt.step()
    assert not runtime.state(model).pending()
    for p in model.parameters():
        grad = p.grad.to_local()
        assert grad.is_contiguous() and grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()
        assert not grad.any()


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(6, 5)
        self.a = nn.Linear(5, 3)
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, head: str) -> torch.Tensor:
        return getattr(self, head)(torch.tanh(self.body(x)))


class _TwoHeadsBreak(_TwoHeads):
    """With a graph break: its reads go through the sequencer (see [Note: two ways to read])."""

    def forward(self, x: torch.Tensor, head: str) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        torch._dynamo.graph_break()
        return getattr(self, head)(h)


def _leftovers(rank: int, world_size: int, zero_stage: int = 3) -> dict:
    """Head ``a`` is used only by the micro-batches without sync: the graph
    with sync takes nothing for it, and its sum is reduced when that
    backward ends. Gradients match the unsharded sum over ranks."""
    torch.manual_seed(0)
    model, ref = _TwoHeads(), _TwoHeads()
    ref.load_state_dict(model.state_dict())
    fxshard.compile(model, backend="aot_eager", zero_stage=zero_stage)
    xs = [[torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * r + i)) for i in range(3)]
          for r in range(world_size)]  # fmt: skip
    heads = ("a", "a", "b")
    for i, head in enumerate(heads):
        model.set_requires_gradient_sync(i == 2)
        model(xs[rank][i], head).pow(2).mean().backward()
    (sum(ref(x, h).pow(2).mean() for r in range(world_size) for x, h in zip(xs[r], heads)) / world_size).backward()
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), refs[name].grad, atol=2e-5, rtol=1e-4, msg=name)
    assert not runtime.state(model).pending()
    return {}


def _zero_grad(set_to_none: bool) -> Callable[[nn.Module, torch.optim.Optimizer], None]:
    return lambda model, opt: opt.zero_grad(set_to_none=set_to_none)


def _reset_one(how: str) -> Callable[[nn.Module, torch.optim.Optimizer], None]:
    """Reset one parameter's ``.grad``, as a user may between micro-batches."""

    def reset(model: nn.Module, opt: torch.optim.Optimizer) -> None:
        param = dict(model.named_parameters())["body.weight"]
        if how == "none":
            param.grad = None
        else:
            param.grad.zero_()

    return reset


def _reset_between(rank: int, world_size: int, reset: Callable[[nn.Module, torch.optim.Optimizer], None],
                   zero_stage: int = 3, cls: type[_TwoHeads] = _TwoHeads, syncs: tuple[bool, ...] = (False, True),
                   after_forward: bool = False) -> dict:  # fmt: skip
    """A reset of ``.grad`` after a micro-batch without sync drops what that
    micro-batch kept for the parameters it reset, and only for those: the
    same steps and resets on an unsharded model give the same gradients.
    ``after_forward``: the reset comes between the next micro-batch's
    forward and its backward."""
    torch.manual_seed(0)
    model, ref = cls(), cls()
    ref.load_state_dict(model.state_dict())
    fxshard.compile(model, backend="aot_eager", zero_stage=zero_stage)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    xs = [[torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * r + i)) for i in range(2)]
          for r in range(world_size)]  # fmt: skip
    xs = [[x[i % 2] for i in range(len(syncs))] for x in xs]
    for i, sync in enumerate(syncs):
        model.set_requires_gradient_sync(sync)
        losses = model(xs[rank][i], "a").pow(2).mean(), sum(ref(xs[r][i], "a").pow(2).mean() for r in range(world_size))
        if i == 1 and after_forward:
            reset(model, opt)
            reset(ref, ref_opt)
        losses[0].backward()
        (losses[1] / world_size).backward()
        if i == 0:
            assert runtime.state(model).sequenced == (cls is _TwoHeadsBreak)
            if not after_forward:
                reset(model, opt)
                reset(ref, ref_opt)
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        expected = refs[name].grad if refs[name].grad is not None else torch.zeros_like(refs[name])
        got = p.grad.full_tensor() if p.grad is not None else torch.zeros_like(refs[name])
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4, msg=name)
    assert not runtime.state(model).pending()
    opt.step()
    return {}


def _changed_between(rank: int, world_size: int) -> dict:
    """``.grad`` holding a synced micro-batch's gradient, then scaled after
    one without sync: the kept gradient is outside ``.grad`` and cannot be
    scaled with it, so the next call raises rather than drop or keep it."""
    torch.manual_seed(0)
    model = _TwoHeads()
    fxshard.compile(model, backend="aot_eager")
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(rank))
    for sync in (True, False):
        model.set_requires_gradient_sync(sync)
        model(x, "a").pow(2).mean().backward()
    dict(model.named_parameters())["body.weight"].grad.mul_(0.5)
    model.set_requires_gradient_sync(True)
    with pytest.raises(ValueError, match="'body.weight' was changed after micro-batches without sync.*after the micro"):
        model(x, "a")
    return {}


def _marks_differ(rank: int, world_size: int) -> dict:
    model = models.TinyLlama()
    if rank == 0:
        fxshard.no_shard(model.norm)
    with pytest.raises(ValueError, match="ranks hold different models.*no_shard"):
        fxshard.compile(model, backend="aot_eager")
    return {}


def _gloo_gathers(rank: int, world_size: int) -> dict:
    """gloo's coalesced all-gather corrupts the heap when two of a group's
    worker threads run one at once (docs/notes/gloo-heap/; a CPU run aborted
    with "malloc(): unaligned tcache chunk" 1 time in 5). On a gloo group the
    schedule keeps no gather in flight beside another, whatever ``prefetch``
    says, and a unit's members are gathered one all-gather each."""
    calls, original = [], compat.all_gather_coalesced_async

    def gather(outs, inps, group, coalesce):
        calls.append((len(outs), coalesce))
        return original(outs, inps, group, coalesce)

    compat.all_gather_coalesced_async = gather
    try:
        model = models.TinyLlama(layers=1)  # flat graphs: one layer holds every kind of read
        fxshard.compile(model, backend="aot_eager", prefetch=2, compile_blocks_once=False)
        model(torch.randint(0, 37, (2, 9))).sum().backward()
    finally:
        compat.all_gather_coalesced_async = original
    (record,) = model.fxshard_plan.graphs
    assert record.schedules["forward"].prefetch == 0 and record.schedules["backward"].prefetch == 0
    assert any(n > 1 for n, _ in calls), calls  # units of several members were gathered
    assert not any(c for _, c in calls), calls
    return {}


# The checks that need two ranks, run in one set of ranks (process start-up
# and imports cost seconds each).
TWO_RANK_CHECKS = {
    "unfrozen_after_compile_is_all_reduced": lambda r, w: _unfreeze_later(r, w),
    "kept_gradients_no_read_took_are_reduced": lambda r, w: _leftovers(r, w),
    "zero_grad_drops_kept_gradients": lambda r, w: _reset_between(r, w, _zero_grad(True)),
    "zero_grad_in_place_drops_kept_gradients": lambda r, w: _reset_between(r, w, _zero_grad(False)),
    # A reset of one parameter's .grad drops what was kept for it, not the others'.
    "grad_none_on_one_drops_its_kept_gradient_only": lambda r, w: _reset_between(r, w, _reset_one("none")),
    "grad_zeroed_on_one_drops_its_kept_gradient_only": lambda r, w: _reset_between(r, w, _reset_one("zero")),
    # ZeRO-1's kept copies keep and reduce gradients as the other stages' reads do.
    "kept_gradients_no_read_took_are_reduced_zero1": lambda r, w: _leftovers(r, w, zero_stage=1),
    "zero_grad_drops_kept_gradients_zero1": lambda r, w: _reset_between(r, w, _zero_grad(True), zero_stage=1),
    # Sequenced reads keep gradients outside .grad too; .grad was None, and zero_grad left no trace.
    "zero_grad_drops_kept_gradients_sequenced": lambda r, w: _reset_between(r, w, _zero_grad(True), cls=_TwoHeadsBreak),
    "zero_grad_in_place_drops_kept_gradients_sequenced": lambda r, w: _reset_between(
        r, w, _zero_grad(False), cls=_TwoHeadsBreak
    ),
    "grad_none_on_one_drops_its_kept_gradient_only_sequenced": lambda r, w: _reset_between(
        r, w, _reset_one("none"), cls=_TwoHeadsBreak
    ),
    # Between the forward and the backward of the next micro-batch, with or without sync.
    "reset_after_the_next_forward_drops_kept_gradients": lambda r, w: _reset_between(
        r, w, _zero_grad(True), after_forward=True
    ),
    "reset_after_the_next_forward_without_sync": lambda r, w: _reset_between(
        r, w, _reset_one("none"), syncs=(False, False, True), after_forward=True
    ),
    "reset_after_the_next_forward_sequenced": lambda r, w: _reset_between(
        r, w, _zero_grad(False), cls=_TwoHeadsBreak, after_forward=True
    ),
    "a_change_to_grad_other_than_a_reset_raises": lambda r, w: _changed_between(r, w),
    "ranks_must_mark_the_same_no_shard_parameters": lambda r, w: _marks_differ(r, w),
    "gloo_gathers_one_unit_at_a_time_never_coalesced": lambda r, w: _gloo_gathers(r, w),
}


def _two_rank_checks(rank: int, world_size: int) -> dict:
    import traceback

    results = {}
    for name, check in TWO_RANK_CHECKS.items():
        try:
            check(rank, world_size)
            results[name] = None
        except Exception:
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def two_ranks():
    results = run_ranks(2, _two_rank_checks, timeout=600)
    check_results(results)
    return results


@pytest.mark.parametrize("check", list(TWO_RANK_CHECKS))
def test_two_ranks(two_ranks, check):
    failures = [f"rank {r}:\n{res[check]}" for r, res in enumerate(two_ranks) if res[check] is not None]
    assert not failures, "\n".join(failures)


def _hsdp_read_outside_forward(rank: int, world_size: int) -> dict:
    """HSDP 2 x 2: a loss term on weights read outside forward (a sharded one
    and a replicated one), which differs on every rank, gets the gradient
    averaged over the whole mesh, as the forward's: the reduce of such a read
    averages across replicas too (see [Note: HSDP]). On the small MLP."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model, ref = _mlp(), _mlp()
    ref.load_state_dict(model.state_dict())
    fxshard.no_shard(model[0])
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    fxshard.compile(model, mesh, backend="aot_eager")
    placements = {i: model[i]._parameters["weight"].placements for i in (0, 2)}
    assert placements == {0: (Replicate(), Replicate()), 2: (Replicate(), Shard(0))}, placements
    batches = [torch.randn(4, 6, generator=torch.Generator().manual_seed(r)) for r in range(world_size)]

    def loss(m: nn.Module, r: int) -> torch.Tensor:
        extra = (m[2].weight * (r + 1)).pow(2).sum() + (m[0].weight * (r + 1)).pow(2).sum()
        return m(batches[r]).pow(2).mean() + extra

    loss(model, rank).backward()
    (sum(loss(ref, r) for r in range(world_size)) / world_size).backward()
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), refs[name].grad, atol=2e-5, rtol=1e-4, msg=name)
    return {}


def test_hsdp_reads_outside_forward_average_over_the_mesh():
    check_results(run_ranks(4, _hsdp_read_outside_forward, timeout=300))
