"""``fxshard.cuda_graph`` errors that need no GPU: CUDA graphs need CUDA
tensors and an NCCL group. The rest of the feature is gated on GPUs in
tests/test_cuda_graph_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fxshard
from tests.helpers import cuda_graph_checks as checks
from tests.helpers.distributed import check_results, run_ranks


@pytest.mark.full_cpu  # 13 s on 2 cores; the one-rank test below checks the same error
def test_cpu_model_on_two_gloo_ranks():
    """The Hybrid on CPU, 2 gloo ranks: an error at the capture at the
    latest, before its collectives; the model then trains without the graph."""
    check_results(run_ranks(2, checks.error_cpu_tensors, timeout=300))


def test_cpu_model_without_process_group(no_dist, monkeypatch):
    """``fxshard.compile(model)`` with no process group (a one-rank gloo group)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    checks.error_cpu_tensors(0, 1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gloo_group_with_cuda_tensors(no_dist):
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.cuda.set_device(0)
    checks.error_gloo_group_on_cuda(0, 1)


def _held_after_a_step():
    """A trained fxshard model on a one-rank gloo group, its AdamW, and what
    a replay would read of them (``graphs._Held``)."""
    from fxshard import graphs
    from tests.helpers import models

    torch.manual_seed(0)
    model = fxshard.compile(models.Uneven(), backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 5)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return model, opt, graphs._Held([model], [opt])


def _replace_param(model, opt):
    # Past nn.Module.__setattr__, which raises for another parameter after compile.
    model.b._parameters["weight"] = torch.nn.Parameter(torch.zeros(7, 3))


def _set_grad(model, opt):
    shard = model.get_parameter("b.weight")
    shard.grad = torch.zeros_like(shard.grad)


def _grads_to_none(model, opt):
    opt.zero_grad(set_to_none=True)


def _load_optimizer_state(model, opt):
    opt.load_state_dict(opt.state_dict())


def _replace_state_tensor(model, opt):
    state = opt.state[model.get_parameter("c.bias")]
    state["exp_avg"] = state["exp_avg"].clone()


def _new_state_entry(model, opt):
    opt.state[model.get_parameter("c.bias")]["extra"] = torch.zeros(())


def _replace_local_shard(model, opt):
    from fxshard.runtime import compat

    p = model.get_parameter("a.weight")
    compat.replace_local_tensor(p, compat.local_tensor(p).clone())


@pytest.mark.parametrize(
    "change",
    [
        _replace_param,
        _set_grad,
        _grads_to_none,
        _load_optimizer_state,
        _replace_state_tensor,
        _new_state_entry,
        _replace_local_shard,
    ],  # fmt: skip
)
def test_a_replay_notices_replaced_tensors(no_dist, monkeypatch, change):
    """Each of these leaves a replay reading tensors the model and optimizer
    no longer hold; ``CapturedStep`` raises on ``same() == False``."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model, opt, held = _held_after_a_step()
    assert held.same()
    change(model, opt)
    assert not held.same()


def test_a_replay_notices_freezing(no_dist, monkeypatch):
    """A replay trains what the capture trained: freezing a parameter after
    it must capture again."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model, opt, held = _held_after_a_step()
    assert held.frozen_alike()
    model.b.requires_grad_(False)
    assert not held.frozen_alike()
    model.b.requires_grad_(True)
    assert held.frozen_alike()


def test_a_replay_accepts_writes_in_place(no_dist, monkeypatch):
    """Writes that keep every tensor (another step, in-place zeroing, ``.data
    =``, ``load_state_dict`` of the model) leave what a replay reads in place."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model, opt, held = _held_after_a_step()
    model(torch.randn(3, 5)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    with torch.no_grad():
        model.b.weight.data = torch.ones(7, 3)
        model.row.mul_(2.0)
    model.load_state_dict(model.state_dict())
    assert held.same()


@pytest.mark.parametrize(
    "env, expandable",
    [({}, False), ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
     ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128, expandable_segments:True"}, True),
     ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, False)],
)  # fmt: skip
def test_memory_held_free_outside_the_pool_names_expandable_segments(monkeypatch, env, expandable):
    """See [Note: memory outside the pool]: a captured step whose allocator
    holds much free memory outside the pool says so, and names the setting
    that gives it back, unless it is set."""
    from fxshard.graphs import _outside_free_hint
    from fxshard.runtime import compat

    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert compat.expandable_segments() is expandable
    hint = _outside_free_hint(int(0.54 * 2**30), int(4.5 * 2**30), compat.expandable_segments())
    assert (hint is None) is expandable
    if hint:
        assert "0.54 GiB of the 4.50 GiB" in hint and "expandable_segments:True" in hint
    assert _outside_free_hint(int(0.1 * 2**30), int(4.5 * 2**30), False) is None  # within 5%: nothing to say
