"""The sequencer issues collectives in plan order, whatever the reads were.

Single process: the collectives are recorded, not run, so two "ranks" that
read different parameters in different orders can be compared directly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint

import fxshard
from fxshard.runtime import sequencer as seq_mod
from fxshard.runtime.plans import ModelRuntime, PlanTable
from fxshard.runtime.sequencer import Sequencer, seq_gather
from tests.helpers import records

SHAPES = [(3, 2), (4,), (2, 2), (5, 1)]


@pytest.fixture
def recorded(monkeypatch):
    log: list[tuple[str, str]] = []

    def gather(local, dim0, world_size, group_name, dtype):
        log.append(("gather", group_name))
        return local.clone()

    def reduce(grad, local_rows, world_size, group_name, reduce_dtype, out_dtype):
        log.append(("reduce", group_name))
        return grad.clone()

    monkeypatch.setattr(seq_mod, "gather_full", gather)
    monkeypatch.setattr(seq_mod, "reduce_to_shard", reduce)
    monkeypatch.setattr(seq_mod, "any_rank", lambda flags, ws, group: [bool(f) for f in flags.tolist()])
    return log


def _sequencer(trainable=(True, True, True, True)) -> tuple[Sequencer, list[torch.Tensor], dict[int, torch.Tensor]]:
    values = [torch.full(shape, float(i + 1)) for i, shape in enumerate(SHAPES)]
    grads: dict[int, torch.Tensor] = {}
    params = [
        records.param(i, f"p{i}", shape, shape[0], world_size=1, shard=records.StubShard(
            value, trainable[i], add_grad=lambda g, i=i: grads.__setitem__(i, grads.get(i, 0) + g)))
        for i, (shape, value) in enumerate(zip(SHAPES, values))
    ]  # fmt: skip
    model = ModelRuntime(PlanTable(tuple(p.plan for p in params), tuple(p.local_rows for p in params)))
    seq = model.sequencer = Sequencer(model.table.id, params, 1, "g")
    seq.model = model  # what the reads' ops find by id, alive with the sequencer
    return seq, values, grads


def _step(seq: Sequencer, reads: list[int], backward: bool = True) -> list[torch.Tensor]:
    with seq.call() as (anchor, frozen):
        outs = [seq_gather(anchor, seq.plan, k) for k in reads]
        loss = sum((o * (k + 1)).sum() for o, k in zip(outs, reads))
    if backward:
        loss.backward()
    return outs


def test_same_collectives_whatever_the_reads(recorded, monkeypatch):
    """Two ranks read different parameters in different orders, one twice:
    both gather every parameter once, in plan order, then reduce in plan order
    every parameter that got a gradient on some rank (here: all of them)."""
    monkeypatch.setattr(seq_mod, "any_rank", lambda flags, ws, group: [True] * len(flags))
    logs = []
    for reads in ([3, 1], [0, 2, 1, 3, 2]):
        recorded.clear()
        seq, values, grads = _sequencer()
        outs = _step(seq, reads)
        for out, k in zip(outs, reads):
            torch.testing.assert_close(out, values[k])
        logs.append((list(recorded), seq.gathers, seq.reduces))
        for k in range(len(SHAPES)):  # each read's gradient, summed over repeated reads; zero if unread
            torch.testing.assert_close(grads[k], torch.full(SHAPES[k], float((k + 1) * reads.count(k))))
    assert logs[0] == logs[1]
    assert logs[0][0] == [("gather", "g")] * 4 + [("reduce", "g")] * 4


def test_no_gradient_anywhere_keeps_grad_none(recorded):
    """A parameter no rank produced a gradient for is not reduced (AdamW then
    skips it, as in unsharded training); frozen ones never are."""
    seq, _, grads = _sequencer(trainable=(True, False, True, True))
    _step(seq, [0, 1])
    assert sorted(grads) == [0]
    assert recorded.count(("reduce", "g")) == 1


def test_no_grad_calls_reduce_nothing(recorded):
    seq, values, grads = _sequencer()
    with torch.no_grad():
        outs = _step(seq, [2, 2], backward=False)
    assert outs[0].data_ptr() != outs[1].data_ptr()  # copies: see read()
    assert recorded == [("gather", "g")] * 4 and not seq._pending


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_recomputes_read_the_kept_weights(recorded, monkeypatch, reentrant):
    """A checkpointed function that reads through the sequencer, run eagerly
    in the call and recomputed in backward after it (see [Note: recomputes
    read through the sequencer]): the recompute gathers nothing, and the
    gradients are reduced once, at the end of the outer backward, reentrant
    checkpointing's nested backward included."""
    monkeypatch.setattr(seq_mod, "any_rank", lambda flags, ws, group: [True] * len(flags))
    seq, values, grads = _sequencer()
    anchors: list[torch.Tensor] = []

    def block(x: torch.Tensor) -> torch.Tensor:  # as a module's read finds its anchor
        anchor = anchors[0] if seq._current is not None else seq.recompute_anchor(True)
        return x * seq_gather(anchor, seq.plan, 0).sum() + seq_gather(anchor, seq.plan, 2).sum()

    x = torch.ones(2, requires_grad=True)
    with seq.call() as (anchor, frozen):
        anchors.append(anchor)
        h = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=reentrant)
        out = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=reentrant)  # a second nested backward
    assert recorded == [("gather", "g")] * 4
    out.sum().backward()
    assert recorded == [("gather", "g")] * 4 + [("reduce", "g")] * 4
    # out = (x * a + b) * a + b, with a = sum(p0) = 6 and b = sum(p2) = 12, over x's 2 elements
    a, b = float(values[0].sum()), float(values[2].sum())
    torch.testing.assert_close(grads[0], torch.full(SHAPES[0], 2 * (2 * a + b)))
    torch.testing.assert_close(grads[2], torch.full(SHAPES[2], 2 * (a + 1)))
    torch.testing.assert_close(x.grad, torch.full((2,), a * a))
    assert seq.recompute_anchor(True) is None  # outside a backward: reads gather as any read outside a call


def test_an_input_gradient_penalty_recomputes_before_the_backward(recorded, monkeypatch):
    """``autograd.grad`` of the output with respect to the input (a gradient
    penalty) recomputes the checkpointed block but gives the parameters no
    gradient: the call waits for the backward of the loss, which reduces
    once."""
    monkeypatch.setattr(seq_mod, "any_rank", lambda flags, ws, group: [True] * len(flags))
    seq, values, grads = _sequencer()
    anchors: list[torch.Tensor] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        anchor = anchors[0] if seq._current is not None else seq.recompute_anchor(True)
        return torch.tanh(x * seq_gather(anchor, seq.plan, 0).sum())

    x = torch.full((2,), 0.1, requires_grad=True)
    with seq.call() as (anchor, frozen):
        anchors.append(anchor)
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    (penalty,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    assert recorded == [("gather", "g")] * 4 and seq._pending  # no reduce yet
    (out.sum() + penalty.pow(2).sum()).backward()
    assert recorded == [("gather", "g")] * 4 + [("reduce", "g")] * 4 and not seq._pending
    a = torch.tensor(float(values[0].sum()), requires_grad=True)  # the same loss, by hand
    y = torch.tanh(torch.full((2,), 0.1) * a)
    dx = a * (1 - y**2)
    (d,) = torch.autograd.grad(y.sum() + dx.pow(2).sum(), a)
    torch.testing.assert_close(grads[0], torch.full(SHAPES[0], float(d)))


def test_recompute_over_calls_with_and_without_sync_is_an_error(recorded):
    seq, _, _ = _sequencer()
    anchors: list[torch.Tensor] = []

    def block(x: torch.Tensor) -> torch.Tensor:
        anchor = anchors[-1] if seq._current is not None else seq.recompute_anchor(True)
        return x * seq_gather(anchor, seq.plan, 0).sum()

    x = torch.ones(2, requires_grad=True)
    outs = []
    for sync in (False, True):
        with seq.call(sync) as (anchor, frozen):
            anchors.append(anchor)
            outs.append(torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False))
    with pytest.raises(RuntimeError, match="Call backward after each forward"):
        sum(o.sum() for o in outs).backward()


def test_calls_with_grad_and_no_backward_warn(recorded, caplog):
    """Each keeps the gathered weights until a backward: an evaluation loop
    without no_grad grows by the model's weights per call; it is told."""
    seq, _, _ = _sequencer()
    for _ in range(seq_mod._PENDING_WARN + 2):
        _step(seq, [0], backward=False)
    warnings = [r for r in caplog.records if "torch.no_grad()" in r.getMessage()]
    assert len(warnings) == 1 and len(seq._pending) == seq_mod._PENDING_WARN + 2


class _Flag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.talk = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.talk:
            torch._dynamo.graph_break()  # only from the second call on (a print would not break: fxshard reorders it)
        return self.lin(x)


def test_graph_break_after_first_call_is_an_error(no_dist):
    model = fxshard.compile(_Flag(), backend="aot_eager")
    model(torch.randn(2, 3))
    assert not model.fxshard_plan.sequenced
    model.talk = True
    with pytest.raises(NotImplementedError, match="graph break appeared after the first call"):
        model(torch.randn(2, 3))


def test_graph_break_on_first_call_sequences(no_dist):
    model = _Flag()
    model.talk = True
    ref = nn.Linear(3, 3)
    ref.load_state_dict(model.lin.state_dict())
    fxshard.compile(model, backend="aot_eager")
    x = torch.randn(2, 3)
    model(x).sum().backward()
    assert model.fxshard_plan.sequenced
    ref(x).sum().backward()
    grad = dict(model.named_parameters())["lin.weight"].grad  # model.lin.weight is the gathered weight
    torch.testing.assert_close(grad.full_tensor(), ref.weight.grad)
