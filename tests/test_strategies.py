"""Replicated parameters (fxshard.no_shard, frozen ones): the plan, its
dump, the memory fallback, and unfreezing after compile (gloo, CPU)."""

from __future__ import annotations

import logging

import torch

import fxshard
from examples.llama import lm_loss
from fxshard import plan as plan_module
from tests import models
from tests.distributed import check_results, run_ranks


def test_plan_is_dumped(fake_pg, tmp_path):
    model = models.TinyLlama(tie=False)
    model.layers[0].requires_grad_(False)
    fxshard.no_shard(model.norm)
    fxshard.compile(model, backend="aot_eager", debug_dir=tmp_path, reshard_after_forward=False)
    text = (tmp_path / "rank0" / "plan.txt").read_text()
    lines = {
        line.split(" ")[0]: line
        for line in text.splitlines()
        if line.startswith(("layers.", "norm", "embed", "output"))
    }
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
    gradient all-reduced, as the unsharded reference's."""
    torch.manual_seed(0)
    model = models.TinyLlama(tie=False)
    ref = models.TinyLlama(tie=False)
    ref.load_state_dict(model.state_dict())
    model.layers[1].requires_grad_(False)
    fxshard.compile(model, backend="aot_eager")
    plan = {p.fqn: p for p in model.fxshard_plan.params}
    assert plan["layers.1.mlp.w1.weight"].placement.value == "Replicate()"
    batches = [torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(r)) for r in range(world_size)]
    lm_loss(model(batches[rank]), batches[rank]).backward()
    assert all(p.grad is None for n, p in model.named_parameters() if n.startswith("layers.1."))
    model.zero_grad()
    model.layers[1].requires_grad_(True)
    lm_loss(model(batches[rank]), batches[rank]).backward()
    (sum(lm_loss(ref(b), b) for b in batches) / world_size).backward()
    refs = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), refs[name].grad, atol=2e-5, rtol=1e-4, msg=name)
    return {}


def test_unfrozen_after_compile_is_all_reduced():
    check_results(run_ranks(2, _unfreeze_later))
