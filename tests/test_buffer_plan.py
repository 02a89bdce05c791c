"""The static buffer plan: every collective buffer at an offset, none sharing
bytes with another alive at the same time; and the peak estimate it feeds."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

import fxshard
from fxshard.passes.buffers import ALIGN, BufferKind, BufferPlan, first_fit, plan_buffers
from fxshard.passes.memory import graph_peak, liveness, step_peak
from fxshard.passes.pipeline import BackendSpec, FXShardBackend
from fxshard.runtime import compat
from fxshard.runtime.units import UNIT_GATHER, UNIT_REDUCE
from tests.helpers import marker_plans, models

_aten, _funcol = torch.ops.aten, torch.ops._c10d_functional


def _conflicts(plan: BufferPlan) -> list[tuple[str, str]]:
    """Brute force: every pair alive at once that shares a byte."""
    return [(a.name, b.name) for i, a in enumerate(plan.buffers) for b in plan.buffers[i + 1 :]
            if a.alive_with(b) and a.shares_bytes(b)]  # fmt: skip


def _at_zero(plan: BufferPlan) -> BufferPlan:
    return BufferPlan(tuple(b.__class__(**{**b.__dict__, "offset": 0}) for b in plan.buffers), plan.total)


class _Builder:
    """A hand-built graph whose nodes carry fake values, as lowering leaves them."""

    def __init__(self) -> None:
        self.graph = fx.Graph()

    def input(self, name: str, *shape: int) -> fx.Node:
        node = self.graph.placeholder(name)
        node.meta["val"] = torch.empty(shape, device="meta")
        return node

    def __call__(self, target, *args) -> fx.Node:
        node = self.graph.call_function(target, args)
        vals = fx.node.map_aggregate(args, lambda a: a.meta["val"] if isinstance(a, fx.Node) else a)
        node.meta["val"] = target(*vals) if target not in (_funcol.all_gather_into_tensor.default,) else \
            vals[0].new_empty((4 * vals[0].shape[0], *vals[0].shape[1:]))  # fmt: skip
        return node

    def module(self, *outputs: fx.Node) -> fx.GraphModule:
        self.graph.output(outputs)
        return fx.GraphModule(torch.nn.Module(), self.graph)


def _prefetching_graph() -> fx.GraphModule:
    """Three gathers of 4 x 128 rows (1 MiB of fp32 each): the second is
    issued while the first is read (prefetch), the third after the first is
    dead. Then a reduce-scatter of a gradient the graph computes."""
    g = _Builder()
    x = g.input("x", 8, 512)
    shards = [g.input(f"primals_{i}", 128, 512) for i in range(3)]
    gather = lambda s: g(_funcol.all_gather_into_tensor.default, s, 4, "g")
    wait = lambda t: g(_funcol.wait_tensor.default, t)
    ag0, ag1 = gather(shards[0]), gather(shards[1])
    h = g(_aten.mm.default, x, g(_aten.t.default, wait(ag0)))
    ag2 = gather(g(_aten.mul.Tensor, shards[2], 2.0))  # built by the graph: a gather input
    h = g(_aten.mm.default, h, wait(ag1))
    h = g(_aten.mm.default, x, g(_aten.t.default, g(_aten.mm.default, h, g(_aten.t.default, wait(ag2)))))
    rs = g(_funcol.reduce_scatter_tensor.default, h, "sum", 4, "g")
    return g.module(wait(rs), h)


def test_hand_built_plan_separates_buffers_alive_together():
    plan = plan_buffers(_prefetching_graph())
    by_name = {b.name: b for b in plan.buffers}
    kinds = sorted(b.kind.value for b in plan.buffers)
    assert kinds == ["gather", "gather", "gather", "gather_input", "reduce_input", "reduce_output"], plan.format()
    ag0, ag1, ag2 = (by_name[f"all_gather_into_tensor_default{s}"] for s in ("", "_1", "_2"))
    assert ag0.alive_with(ag1) and ag0.offset != ag1.offset  # prefetched: both alive
    assert ag0.end_node == "mm_default" and ag0.end < ag2.start  # last read through its view, by the first mm
    assert ag2.offset == ag0.offset  # the first gather is dead: its bytes are reused
    assert _conflicts(plan) == []
    assert _conflicts(_at_zero(plan)), "a plan with every buffer at offset 0 would overlap: the test could not fail"
    assert all(b.offset % ALIGN == 0 for b in plan.buffers)
    assert plan.total < sum(b.nbytes for b in plan.buffers)  # dead buffers' bytes are reused
    assert "reduce_output" in plan.format() and "total:" in plan.format()


def test_first_fit_never_overlaps_live_buffers():
    rng = random.Random(0)
    for _ in range(200):
        items = []
        for i in range(rng.randint(1, 12)):
            start = rng.randint(0, 30)
            items.append((f"b{i}", rng.choice([0, 1, 100, 512, 513, 4096, 10_000]), start, start + rng.randint(0, 10)))
        offsets = first_fit(items)
        for name, size, start, end in items:
            assert offsets[name] % ALIGN == 0
            for other, size2, start2, end2 in items:
                if other != name and start <= end2 and start2 <= end:
                    o, o2 = offsets[name], offsets[other]
                    assert not (o < o2 + size2 and o2 < o + size), (items, offsets)
        # The arena is never larger than all of them side by side.
        top = max(offsets[n] + s for n, s, _, _ in items)
        assert top <= sum(-(-s // ALIGN) * ALIGN for _, s, _, _ in items)
        assert first_fit(list(reversed(items))) == offsets  # depends on the items, not their order


def _train(tmp_path=None, **kwargs):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = models.TinyLlama()
    fxshard.compile(model, backend="aot_eager", unit_mb=0.003, debug_dir=tmp_path, **kwargs)
    model(torch.randint(0, 37, (2, 9))).sum().backward()
    (record,) = model.fxshard_plan.graphs
    return record


@pytest.fixture(scope="module")
def twice(tmp_path_factory):
    """TinyLlama compiled twice on a 4-rank fake group, the second with a debug dump."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=compat.fake_store(), rank=0, world_size=4)
    dump = tmp_path_factory.mktemp("dump")
    try:
        yield _train(), _train(dump), dump
    finally:
        if dist.is_initialized():  # a later test's fake_pg may have replaced it
            dist.destroy_process_group()
        torch._dynamo.reset()


def test_real_model_plan_covers_every_collective(twice):
    record = twice[0]
    for phase in ("forward", "backward"):
        gm, plan = getattr(record, phase), record.buffer_plans[phase]
        assert _conflicts(plan) == [], plan.format()
        kinds = [b.kind for b in plan.buffers]
        gathers = [n for n in gm.graph.nodes if n.target == UNIT_GATHER]
        reduces = [n for n in gm.graph.nodes if n.target == UNIT_REDUCE]
        assert gathers and kinds.count(BufferKind.GATHER) == len(gathers)
        assert kinds.count(BufferKind.REDUCE_OUTPUT) == kinds.count(BufferKind.REDUCE_INPUT) == len(reduces)
        assert {b.owner for b in plan.buffers} == {f"unit {n.args[2]}" for n in gathers + reduces}
        pos = {n.name: i for i, n in enumerate(gm.graph.nodes)}
        for n in reduces:  # the input lives from its cat to the wait, which reads it
            (b,) = [b for b in plan.buffers if b.name == n.args[0].name]
            (wait,) = n.users
            assert b.start <= pos[n.name] and b.end >= pos[wait.name]
    assert len(record.buffer_plans["backward"].buffers) > 2


def test_plans_are_stable_across_recompiles(twice):
    first, second, _ = twice
    assert first.buffer_plans == second.buffer_plans
    assert first.buffer_plans["backward"].total > 0


def test_summary_shows_the_plan(twice):
    summary = (twice[2] / "rank0" / "graph0" / "summary.txt").read_text()
    for phase in ("forward", "backward"):
        assert f"[{phase} buffers] static buffer plan: " in summary
        assert twice[1].buffer_plans[phase].format() in summary
    assert "unit_gather_wait_default " in summary and "reduce_input" in summary


def test_per_parameter_collectives_are_planned(fake_pg):
    """Without units (FXShardBackend(units=None)) the markers lower to funcol
    collectives, per parameter; the plan takes their buffers."""
    group = dist.group.WORLD.group_name
    # Shards of 3 x 6 of two 10-row parameters, gathered in bf16, reduced in fp32.
    w1, w2 = (marker_plans.sharded(n, (10, 6), 3, 4, group, group, torch.bfloat16, torch.float32) for n in ("w1", "w2"))

    def f(x, s1, s2):
        unshard = torch.ops.fxshard.unshard.default
        return (x @ unshard(s1, *w1).float().t() @ unshard(s2, *w2).float()).sum()

    backend = FXShardBackend(BackendSpec("aot_eager", True, 0, 4, group, None), units=None)
    s1, s2 = torch.randn(3, 6, requires_grad=True), torch.randn(3, 6, requires_grad=True)
    torch.compile(f, backend=backend, fullgraph=True)(torch.randn(5, 6), s1, s2).backward()
    (record,) = backend.graphs
    forward, backward = record.buffer_plans["forward"], record.buffer_plans["backward"]
    assert {(b.kind, b.owner) for b in forward.buffers} >= {
        (BufferKind.GATHER, "w1"),
        (BufferKind.GATHER, "w2"),
        (BufferKind.GATHER_INPUT, "w1"),
    }  # the bf16 cast
    assert {b.kind for b in backward.buffers} >= {BufferKind.REDUCE_INPUT, BufferKind.REDUCE_OUTPUT}
    for plan in (forward, backward):
        assert _conflicts(plan) == [], plan.format()
        collectives = [
            n
            for n in getattr(record, plan is forward and "forward" or "backward").graph.nodes
            if n.target in (_funcol.all_gather_into_tensor.default, _funcol.reduce_scatter_tensor.default)
        ]
        assert sum(b.kind in (BufferKind.GATHER, BufferKind.REDUCE_OUTPUT) for b in plan.buffers) == len(collectives)


def test_peak_fuses_pointwise_chains_and_frees_backward_inputs():
    """A pointwise chain into a reduction allocates only the reduction's
    output; a backward frees a saved input after its last read, but holds
    the forward's (``primals_*``)."""

    def f(saved, primals_1):
        y = (saved * 2 + 1).sum(0)
        big = torch.mm(primals_1, primals_1)  # 256 KiB, after ``saved`` is dead
        return y, big

    gm = make_fx(f, tracing_mode="fake")(torch.randn(256, 64), torch.randn(256, 256))
    saved, primals = list(gm.graph.nodes)[:2]
    saved.name, primals.name = "saved", "primals_1"
    assert sorted(n.name for n in liveness(gm.graph).fused) == ["add", "mul"]  # the sum's kernel computes them
    held, freed = graph_peak(gm.graph), graph_peak(gm.graph, free_inputs=True)
    kib = 2**10
    assert held.total == 64 * kib + 256 * kib + 256 * kib + 256  # both inputs, mm's output, sum's
    assert freed.total == 256 * kib + 256 * kib + 256  # ``saved`` is gone before the mm
    assert freed.intermediates == 256 * kib + 256 and freed.at == "mm"
    assert step_peak(held, freed, held_outside=10) == held.total + 10
    assert step_peak(freed, None) == freed.total
