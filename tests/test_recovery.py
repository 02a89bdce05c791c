"""A call that raises leaves the model usable: after a forward that raised
(a bad token id) and a backward that raised, the next steps train as the
unsharded model does (see [Note: a call that raises] in fxshard/runtime/units.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import fxshard
from tests.helpers.distributed import check_results, run_ranks


class FailingBackward(torch.autograd.Function):
    """The identity, whose backward raises while ``flag`` is not 0. The check
    reads the gradient, so it runs in the middle of the backward graph, after
    the reduces of the layers behind it were issued."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, flag: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(flag)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (flag,) = ctx.saved_tensors
        torch._assert_async((grad.abs().sum() >= 0) & (flag == 0), "backward failed on purpose")
        return grad * 1.0, None


class Net(nn.Module):
    def __init__(self, graph_break: bool = False) -> None:
        super().__init__()
        self.graph_break = graph_break  # reads go through the sequencer (see [Note: two ways to read])
        self.emb = nn.Embedding(64, 16)
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)
        self.mid = nn.Embedding(64, 16)  # the bad ids index it, halfway through the forward
        self.c, self.d = nn.Linear(16, 16), nn.Linear(16, 4)
        self.register_buffer("fail_backward", torch.zeros((), dtype=torch.long))

    def forward(self, ids: torch.Tensor, mid_ids: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(self.emb(ids))))
        if self.graph_break:
            torch._dynamo.graph_break()
        h = FailingBackward.apply(h + self.mid(mid_ids), self.fail_backward)
        return self.d(torch.tanh(self.c(h))).pow(2).mean()


# step -> what goes wrong in it
FAILURES = {1: "bad id", 3: "backward"}
STEPS = 6


def train_through_failures(rank: int, world_size: int, backend: str, zero_stage: int, graph_break: bool,
                           micro_batches: int) -> dict:  # fmt: skip
    """Steps of ``micro_batches`` micro-batches, all but the last without
    sync; the failures come in the first micro-batch of their step."""
    torch.manual_seed(0)
    ref = Net(graph_break)
    model = fxshard.compile(copy.deepcopy(ref), backend=backend, zero_stage=zero_stage, unit_mb=0.001)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    gen = torch.Generator().manual_seed(1)
    outcomes, worst = [], 0.0
    for step in range(STEPS):
        ids = torch.randint(0, 64, (micro_batches, world_size, 4, 8), generator=gen)
        mid_ids = ids.flip(-1).clone()
        if FAILURES.get(step) == "bad id":
            mid_ids[0, :, 0, 0] = 64
        try:
            for i in range(micro_batches):
                model.set_requires_gradient_sync(i == micro_batches - 1)
                model.fail_backward.fill_(int(FAILURES.get(step) == "backward" and i == 0))
                (model(ids[i, rank], mid_ids[i, rank]) / micro_batches).backward()
        except (IndexError, RuntimeError) as error:
            outcomes.append(f"{type(error).__name__}: {error}".splitlines()[0])
            opt.zero_grad()
            continue
        outcomes.append("trained")
        ref_loss = sum(ref(ids[i, r], mid_ids[i, r]) for i in range(micro_batches) for r in range(world_size))
        (ref_loss / (world_size * micro_batches)).backward()
        for name, p in model.named_parameters():  # gradients after the reduce, then parameters after the step
            worst = max(worst, (p.grad.full_tensor() - ref.get_parameter(name).grad).abs().max().item())
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        for name, p in model.named_parameters():
            worst = max(worst, (p.full_tensor() - ref.get_parameter(name)).abs().max().item())
    return dict(outcomes=outcomes, worst=worst)


@pytest.mark.parametrize(
    "backend,zero_stage,graph_break,micro_batches",
    [
        ("aot_eager", 3, False, 1),
        pytest.param("aot_eager", 1, False, 1, marks=pytest.mark.full_cpu),  # ZeRO-1: no collective in backward
        ("aot_eager", 3, True, 1),  # sequenced reads
        ("aot_eager", 3, False, 2),  # the first micro-batch of each step without sync
    ],
)
def test_training_goes_on_after_a_call_raises(backend, zero_stage, graph_break, micro_batches):
    results = run_ranks(2, train_through_failures, backend, zero_stage, graph_break, micro_batches, timeout=300)
    check_results(results)
    for rank, r in enumerate(results):
        outcomes = r["outcomes"]
        assert [o == "trained" for o in outcomes] == [s not in FAILURES for s in range(STEPS)], (rank, outcomes)
        assert outcomes[1].startswith("IndexError") and "out of range" in outcomes[1], outcomes[1]
        assert "backward failed on purpose" in outcomes[3], outcomes[3]
        assert r["worst"] < 1e-5, (rank, r["worst"])
