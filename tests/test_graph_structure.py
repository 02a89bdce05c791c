"""The rewritten graphs: where collectives sit and what forward saves."""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn as nn
from torch.testing import FileCheck

import fxshard
from tests import models

AG = torch.ops._c10d_functional.all_gather_into_tensor.default
RS = torch.ops._c10d_functional.reduce_scatter_tensor.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


def _nodes(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target == target]


def _ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return seen


def _train_once(model: nn.Module, **kwargs):
    fxshard.compile(model, backend="aot_eager", **kwargs)
    model(torch.randint(0, 37, (2, 9))).sum().backward()
    (record,) = model.fxshard_plan.graphs
    return record


def test_reshard_after_forward_saves_no_full_weight(fake_pg):
    model = models.TinyLlama()
    record = _train_once(model)
    n_params = len(model.fxshard_plan.params)
    assert len(_nodes(record.forward, AG)) == n_params  # tied weight: one gather
    assert record.saved_full_weights == ()
    assert len(_nodes(record.backward, AG)) > 0  # gathered again instead
    assert len(_nodes(record.backward, RS)) == n_params
    for gather in _nodes(record.forward, AG):
        (wait,) = gather.users
        assert wait.target == WAIT


def test_keep_full_weights_gathers_once(fake_pg):
    record = _train_once(models.TinyLlama(), reshard_after_forward=False)
    assert record.saved_full_weights, "reshard_after_forward=False must keep full weights"
    assert _nodes(record.backward, AG) == []




def test_collective_order_filecheck(fake_pg):
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
    fxshard.compile(model, backend="aot_eager")
    model(torch.randn(5, 8)).sum().backward()
    (record,) = model.fxshard_plan.graphs
    fw = record.forward.code
    # Each weight and bias is gathered and waited on before the matmul reads it.
    FileCheck().check_count("all_gather_into_tensor", 2).check("wait_tensor").check("addmm").check(
        "all_gather_into_tensor"
    ).check("wait_tensor").check("addmm").run(fw)
    bw = record.backward.code
    # The last layer's weight gradient (mm) is complete before its reduce-scatter,
    # and the reduce is waited on before it is returned.
    FileCheck().check("mm").check("reduce_scatter_tensor").check("wait_tensor").check("return").run(bw)


def test_reduce_scatter_after_gradient_complete(fake_pg):
    model = models.TinyLlama()
    record = _train_once(model)
    bw = record.backward
    order = {n: i for i, n in enumerate(bw.graph.nodes)}
    embed_bwd = [n for n in bw.graph.nodes if n.target == torch.ops.aten.embedding_dense_backward.default]
    assert len(embed_bwd) == 1
    # The tied weight has one reduce-scatter, fed by both of its uses' gradients.
    tied = [rs for rs in _nodes(bw, RS) if embed_bwd[0] in _ancestors(rs)]
    assert len(tied) == 1
    mms = {n for n in _ancestors(tied[0]) if n.target == torch.ops.aten.mm.default}
    assert mms, "the output projection's gradient must be summed in before the reduce"
    for rs in _nodes(bw, RS):
        grad_producers = [a for a in _ancestors(rs) if a.op == "call_function"]
        assert all(order[a] < order[rs] for a in grad_producers)
        (wait,) = rs.users
        assert wait.target == WAIT


def test_frozen_parameters_are_gathered_not_reduced(fake_pg):
    model = models.TinyLlama(tie=False)
    model.embed.weight.requires_grad_(False)
    record = _train_once(model)
    forward, backward = record.reports["forward"], record.reports["backward"]
    assert "embed.weight" in {s.param for s in forward.sites if s.kind == "unshard"}
    assert "embed.weight" not in {s.param for s in backward.sites if s.kind == "reduce"}
    assert backward.count("reduce") == len(model.fxshard_plan.params) - 1


def test_no_grad_forward_gathers_and_never_reduces(fake_pg):
    model = models.TinyLlama()
    fxshard.compile(model, backend="aot_eager")
    with torch.no_grad():
        model(torch.randint(0, 37, (2, 9)))
    (record,) = model.fxshard_plan.graphs
    assert _nodes(record.inference, AG) and not _nodes(record.inference, RS)
    assert record.backward is None


def test_buffers_stay_replicated(fake_pg):
    model = models.TinyLlama()
    fxshard.compile(model, backend="aot_eager")
    assert type(model.rope_cos) is torch.Tensor and model.rope_cos.shape == (64, 6)
    assert all(type(p.data).__name__ == "DTensor" for p in model.parameters())


def test_mixed_precision_casts_before_the_collectives(fake_pg):
    model = models.TinyLlama()
    mp = fxshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    record = _train_once(model, mp_policy=mp)
    gathered = {n.args[0].meta["val"].dtype for n in _nodes(record.forward, AG)}
    reduced = {n.args[0].meta["val"].dtype for n in _nodes(record.backward, RS)}
    assert gathered == {torch.bfloat16}, "the cast must come before the all-gather (half the bytes)"
    assert reduced == {torch.float32}
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())


def test_tied_weight_dedupe_keys_on_the_parameter(fake_pg):
    record = _train_once(models.TinyLlama())
    params = [s.param for s in record.reports["backward"].sites if s.kind == "reduce"]
    assert params.count("embed.weight") == 1 and len(params) == len(set(params))


def test_dedupe_keeps_side_effecting_nodes_without_users():
    """Dynamo graphs hold impure calls with no users (vmap nesting, say);
    de-duplication must erase only the reads it merged."""
    from fxshard.passes.dedupe import dedupe_unshard_pass
    from fxshard.runtime.ops import UNSHARD

    graph = fx.Graph()
    param = graph.placeholder("param")
    reads = []
    for _ in range(2):
        local = graph.call_method("to_local", (param,))
        reads.append(graph.call_function(UNSHARD, (local, 8, 2, "0", "1", "w", None, None)))
    graph.call_function(torch._C._functorch._vmap_decrement_nesting, ())  # impure, no users
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, tuple(reads)))
    gm = dedupe_unshard_pass(fx.GraphModule(nn.Module(), graph), ())
    targets = [n.target for n in gm.graph.nodes]
    assert targets.count(UNSHARD) == 1 and targets.count("to_local") == 1
    assert torch._C._functorch._vmap_decrement_nesting in targets


def _positions(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _gathers_by_wait(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    pos = _positions(gm)
    pairs = [(g, next(iter(g.users))) for g in _nodes(gm, AG)]
    return sorted(pairs, key=lambda p: pos[p[1]])


def test_prefetch_issues_next_unit_before_waiting(fake_pg):
    """With one parameter per unit (a tiny unit_mb), each all-gather is issued
    before the previous one is waited on, in forward and backward; with
    prefetch=0 each waits before the next is issued."""
    for prefetch in (0, 1, 2):
        torch._dynamo.reset()
        record = _train_once(models.TinyLlama(), prefetch=prefetch, unit_mb=1e-6)
        for gm in (record.forward, record.backward):
            pos, pairs = _positions(gm), _gathers_by_wait(gm)
            assert len(pairs) > 3
            for k in range(max(prefetch, 1), len(pairs)):
                gather, _ = pairs[k]
                _, wait_before = pairs[k - prefetch] if prefetch else pairs[k - 1]
                if prefetch:  # issued before unit k - prefetch is waited on
                    assert pos[gather] < pos[wait_before], (prefetch, k)
                else:  # issued only after unit k - 1 was waited on
                    assert pos[gather] > pos[wait_before], (prefetch, k)
        assert record.schedules["forward"].prefetch == prefetch


def test_units_follow_first_use_and_size_target(fake_pg):
    record = _train_once(models.TinyLlama(), unit_mb=1e-6)
    one_per_param = record.schedules["forward"]
    assert all(len(u) == 1 for u in one_per_param.units)
    torch._dynamo.reset()
    record = _train_once(models.TinyLlama())  # 256 MiB: the whole model is one unit
    assert len(record.schedules["forward"].units) == 1
    assert sum(map(len, record.schedules["forward"].units)) == len(one_per_param.units)


def test_reduce_waits_deferred(fake_pg):
    """At most two reduce-scatters are in flight: the wait of reduce i comes
    after reduce i+1 is issued, and before reduce i+2."""
    record = _train_once(models.TinyLlama())
    bw = record.backward
    pos = _positions(bw)
    reduces = _nodes(bw, RS)
    assert len(reduces) > 4
    for i, rs in enumerate(reduces):
        (wait,) = rs.users
        if i + 1 < len(reduces):
            assert pos[reduces[i + 1]] < pos[wait] < (pos[reduces[i + 2]] if i + 2 < len(reduces) else len(pos))


def test_reduces_on_their_own_group(fake_pg):
    """Reduce-scatters use a second communicator over the same ranks, so they
    can overlap the backward's all-gathers."""
    record = _train_once(models.TinyLlama())
    gather_groups = {n.args[-1] for n in _nodes(record.backward, AG)}
    reduce_groups = {n.args[-1] for n in _nodes(record.backward, RS)}
    assert len(gather_groups) == len(reduce_groups) == 1 and gather_groups != reduce_groups
