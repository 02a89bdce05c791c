"""``fxshard.cuda_graph`` on CPU: its argument checks, the checks it runs
before capturing, and the checks of each replayed call. Capture and replay
themselves need CUDA (tests/test_cuda_graph_gpu.py); here a stand-in graph
whose ``replay`` only counts lets the per-call checks run."""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fxshard
from fxshard.graphs import CapturedStep
from tests.helpers.models import GraphBreaks


class _CountingGraph:
    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def _as_captured(step: CapturedStep, models: list, optimizers: list, *args, **kwargs) -> _CountingGraph:
    """Put ``step`` in the state a capture with these arguments leaves it in."""
    from torch.utils import _pytree as pytree

    from fxshard.graphs import _signature_of

    leaves, spec = pytree.tree_flatten((args, kwargs))
    step._signature = _signature_of(leaves, spec)
    step._static = [leaves[i].detach().clone() for i, *_ in step._signature.tensors]
    step._freeze(models, optimizers)
    step._graph = graph = _CountingGraph()
    step._out = step._static[0] if step._static else None
    return graph


def _trained(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


@pytest.mark.parametrize("warmup", [0, -1, True, 1.5, "2"])
def test_warmup_must_be_a_positive_int(warmup):
    with pytest.raises(ValueError, match="warmup must be an int >= 1"):
        fxshard.cuda_graph(lambda: None, warmup=warmup)


def test_decorator_forms():
    def step(x):
        return x

    assert isinstance(fxshard.cuda_graph(step), CapturedStep)
    assert fxshard.cuda_graph(warmup=3)(step).warmup == 3
    with pytest.raises(ValueError, match="takes the step function"):
        fxshard.cuda_graph(3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_no_cuda_raises_before_running_the_step():
    ran = []
    step = fxshard.cuda_graph(lambda x: ran.append(x))
    with pytest.raises(ValueError, match="need a CUDA device"):
        step(torch.ones(2))
    assert not ran


def test_checks_before_capture(no_dist):
    """The models and optimizers a warm-up ran: a sequenced model, a CPU mesh,
    an optimizer that is not capturable. Each raises, naming the fix."""
    step = fxshard.cuda_graph(lambda: None)
    broken = fxshard.compile(GraphBreaks(), backend="aot_eager")
    broken(torch.randn(3, 6))  # the graph break makes its reads sequenced
    assert broken.fxshard_plan.sequenced
    with pytest.raises(ValueError, match="several graphs.*Remove the graph break.*Dynamo said|graph_break_reason"):
        step._check_ran([broken], [])

    model = fxshard.compile(nn.Linear(4, 3), backend="aot_eager")
    model(torch.randn(2, 4))
    with pytest.raises(ValueError, match="cpu mesh; CUDA graphs need a CUDA mesh"):
        step._check_ran([model], [])
    with pytest.raises(ValueError, match=r"not capturable.*capturable=True"):
        step._check_ran([], [torch.optim.AdamW(model.parameters(), capturable=False)])
    step._check_ran([], [torch.optim.AdamW(model.parameters(), capturable=True), torch.optim.SGD(model.parameters())])


def test_replay_checks_arguments(no_dist):
    model = fxshard.compile(nn.Linear(4, 3), backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(2, 4)
    _trained(model, opt, x)
    step = fxshard.cuda_graph(lambda x, scale, mode="a": None)
    graph = _as_captured(step, [model], [opt], x, 2.0, mode="a")

    y = torch.randn(2, 4)
    assert step(y, 2.0, mode="a") is step._static[0]
    assert graph.replays == 1 and torch.equal(step._static[0], y)  # the argument was copied in

    with pytest.raises(ValueError, match=r"argument 0 was captured as \(2, 4\).*now \(3, 4\)"):
        step(torch.randn(3, 4), 2.0, mode="a")
    with pytest.raises(ValueError, match="torch.float32.*now.*torch.float64"):
        step(y.double(), 2.0, mode="a")
    with pytest.raises(ValueError, match="non-tensor argument 1 was 2.0 at capture and is now 3.0"):
        step(y, 3.0, mode="a")
    with pytest.raises(ValueError, match="non-tensor argument 2 was 'a'"):
        step(y, 2.0, mode="b")
    with pytest.raises(ValueError, match="captured with arguments"):
        step(y, 2.0)
    assert graph.replays == 1  # nothing replayed after a refused call


def test_replay_checks_what_the_graph_reads(no_dist):
    model = fxshard.compile(nn.Linear(4, 3), backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(2, 4)
    _trained(model, opt, x)
    step = fxshard.cuda_graph(lambda x: None)
    graph = _as_captured(step, [model], [opt], x)
    step(x)
    assert graph.replays == 1

    opt.param_groups[0]["lr"] = 5e-4  # a scheduler with a float learning rate
    with pytest.raises(ValueError, match=r"optimizer setting changed after capture \(lr: 0.001 -> 0.0005\).*tensor"):
        step(x)
    opt.param_groups[0]["lr"] = 1e-3
    step(x)

    opt.zero_grad(set_to_none=True)  # outside the step: the graph still writes the old gradients
    with pytest.raises(ValueError, match=r"replaced by another tensor.*reset\(\)"):
        step(x)
    _trained(model, opt, x)  # new gradient tensors
    with pytest.raises(ValueError, match="replaced by another tensor"):
        step(x)
    step.reset()
    assert not step.captured and step.calls == 0

    graph = _as_captured(step, [model], [opt], x)
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from a checkpoint: new state tensors
    with pytest.raises(ValueError, match="replaced by another tensor"):
        step(x)
    graph = _as_captured(step, [model], [opt], x)
    with torch.no_grad():
        model.weight.copy_(torch.ones(3, 4))  # a write into the shard: the same tensor
        opt.state[next(iter(opt.state))]["exp_avg"].zero_()
    step(x)
    assert graph.replays == 1


def test_estimates_survive_a_compile_cache_hit(no_dist, tmp_path, monkeypatch):
    """A second process (here: a second compile after dynamo's reset) loads
    the compiled graphs from torch's cache, so fxshard's passes do not run;
    the memory estimates a captured step predicts from come back from disk."""
    from fxshard.passes.memory import load_estimates, step_transient

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # cold: the first compile runs the passes
    x = torch.randn(3, 8)
    # One mesh for both, as a second process would name its group as the
    # first did: with CUDA present, each default mesh made a new group of
    # another name, which the graphs carry (seen on an H200).
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))

    def trained() -> nn.Module:
        torch.manual_seed(0)
        model = fxshard.compile(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), mesh)
        model(x).sum().backward()
        return model

    (first,) = trained().fxshard_plan.graphs
    assert first.forward is not None and set(first.peaks) == {"forward", "backward"}
    torch._dynamo.reset()
    # As in a second process, the first model is gone: a live model of the
    # same plan would give the second one another plan id, hence other graphs.
    gc.collect()
    (again,) = trained().fxshard_plan.graphs
    assert again.forward is None, "torch's compile cache should have skipped the passes"
    assert again.peaks == first.peaks and again.backward_held == first.backward_held
    assert step_transient(again) == step_transient(first) > 0

    Path(again.estimates_file).write_text("{not json")
    assert load_estimates(again.estimates_file) is None  # a damaged file is no estimate, not an error


def test_sync_state_is_part_of_the_capture(no_dist):
    """A step that leaves gradients kept without sync cannot be captured, and
    toggling set_requires_gradient_sync after the capture raises on replay."""
    model = fxshard.compile(nn.Linear(4, 3), backend="aot_eager")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(2, 4)
    model.set_requires_gradient_sync(False)
    model(x).sum().backward()
    step = fxshard.cuda_graph(lambda x: None)
    with pytest.raises(ValueError, match=r"kept without sync.*set_requires_gradient_sync\(True\)"):
        step._check_ran([model], [])
    model.set_requires_gradient_sync(True)
    _trained(model, opt, x)
    graph = _as_captured(step, [model], [opt], x)
    step(x)
    model.set_requires_gradient_sync(False)
    with pytest.raises(ValueError, match="set_requires_gradient_sync changed since the capture"):
        step(x)
    model.set_requires_gradient_sync(True)
    step(x)
    assert graph.replays == 2
