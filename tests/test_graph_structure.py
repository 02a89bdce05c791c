"""The rewritten graphs: where collectives sit and what forward saves."""

from __future__ import annotations

import gc
import math
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.testing import FileCheck

import fxshard
from examples.llama import lm_loss
from fxshard.passes.lower import LOWERED
from fxshard.passes.markers import param_of
from fxshard.passes.units import form_units
from fxshard.runtime import compat, plans as plans_module
from fxshard.runtime.units import UNIT_GATHER as AG, UNIT_GATHER_WAIT, UNIT_REDUCE as RS, UNIT_REDUCE_WAIT, Units
from tests.helpers import models

PER_PARAM = 1e-6  # unit_mb so small that every parameter is a unit of its own


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


# Per-parameter units and size-formed units are those of flat graphs: an
# outlined layer (compile_blocks_once, the default) is never split between
# units. The tests of outlined blocks are at the end of this file.
FLAT = dict(compile_blocks_once=False)


def _train_once(model: nn.Module, **kwargs):
    fxshard.compile(model, backend="aot_eager", **kwargs)
    model(torch.randint(0, 37, (2, 9))).sum().backward()
    (record,) = model.fxshard_plan.graphs
    return record


def _small() -> nn.Module:
    """Tokens in, as TinyLlama, for checks of what holds hooks and code
    objects, and of which groups the collectives use, which do not depend on
    the layers: it compiles in a tenth of TinyLlama's time."""
    return nn.Sequential(nn.Embedding(37, 8), nn.Linear(8, 5))


def test_reshard_after_forward_saves_no_full_weight(fake_pg):
    """Every unit but the one gathered last in forward is resharded and
    gathered again in backward; that last one (here the final norm's weight)
    is saved, since the backward reads it first."""
    model = models.TinyLlama()
    record = _train_once(model, unit_mb=PER_PARAM, **FLAT)
    n_params = len(model.fxshard_plan.params)
    forward_gathers = _nodes(record.forward, AG)
    assert len(forward_gathers) == n_params  # tied weight: one gather
    (last,) = forward_gathers[-1].users
    units = model.fxshard_plan.units
    assert units.units[last.args[2]].names == ("norm.weight",)
    assert record.saved_full_weights == ("norm.weight",)
    backward_gathers = {units.units[n.args[2]].names for n in _nodes(record.backward, AG)}
    assert len(backward_gathers) == n_params - 1 and ("norm.weight",) not in backward_gathers
    assert len(_nodes(record.backward, RS)) == n_params
    for gather in _nodes(record.forward, AG):
        (wait,) = gather.users
        assert wait.target == UNIT_GATHER_WAIT


def _view_base(node: fx.Node) -> fx.Node:
    while getattr(node.target, "is_view", False):
        node = node.args[0]
    return node


def test_kept_unit_saves_its_small_members_as_copies(fake_pg):
    """The unit the forward keeps for backward (the final norm and the output
    projection) is saved as views of the output projection and a copy of the
    norm's weight: a saved view of the small weight kept the whole gathered
    unit alive until the norm's gradient, after the unit's reduce input was
    built (1 GiB at the 8B benchmark's peak)."""
    model = models.TinyLlama(tie=False)
    kept = sum(p.numel() * p.element_size() for p in (model.norm.weight, model.output.weight))
    record = _train_once(model, unit_mb=kept / 2**20)  # the two fit one unit
    last = model.fxshard_plan.units.units[-1]
    assert last.names == ("norm.weight", "output.weight")
    fw = record.forward
    (wait,) = [n for n in _nodes(fw, UNIT_GATHER_WAIT) if n.args[2] == last.index]
    (output,) = [n for n in fw.graph.nodes if n.op == "output"]
    saved = [a for a in output.args[0] if isinstance(a, fx.Node)]
    views = [a.meta["val"].numel() for a in saved if _view_base(a) is wait]
    copies = [a.meta["val"].shape for a in saved if a.target == torch.ops.aten.clone.default
              and _view_base(a.args[0]) is wait]  # fmt: skip
    norm, out = last.members
    assert views and all(n == out.numel for n in views)
    assert copies == [torch.Size(norm.param.shape)]


def test_one_collective_per_unit(fake_pg):
    """With the default units (64 MiB for a model this small) and flat
    graphs the tiny model is one unit: one all-gather in forward, kept for
    backward (it is the last unit), one reduce-scatter covering every
    parameter."""
    model = models.TinyLlama()
    record = _train_once(model, **FLAT)
    units = model.fxshard_plan.units
    assert len(units.units) == 1 and len(units.unit_of) == len(model.fxshard_plan.params)
    assert len(_nodes(record.forward, AG)) == 1 and len(_nodes(record.backward, AG)) == 0
    (reduce,) = _nodes(record.backward, RS)
    assert reduce.args[3] == list(range(len(model.fxshard_plan.params)))  # every gradient, in one reduce-scatter
    layout = reduce.args[0]  # built in the graph: one cat of every gradient, cast to the reduce dtype
    grads = [a for a in layout.args[0] if a.target != torch.ops.aten.full.default]  # not the alignment zeros
    assert layout.target == torch.ops.aten.cat.default and len(grads) == len(model.fxshard_plan.params)
    assert (
        "units: 1, one all-gather each, and one reduce-scatter per block or group of blocks (or one)"
        in record.summary()
    )


def test_local_shards_start_their_slots(fake_pg):
    """No copy-in: after the first call every local shard lives at the front
    of its padded slot, a storage of its own (so its DTensor's storage offset
    is 0 and torch.save works), and the gather sends the slots themselves."""
    model = models.TinyLlama()
    _train_once(model, unit_mb=0.003)
    units = model.fxshard_plan.units
    assert len(units.units) > 2
    for unit in units.units:
        for m, slot in zip(unit.members, unit.slots):
            local = m.param.shard.local()
            assert local.untyped_storage().data_ptr() == slot.untyped_storage().data_ptr()
            assert local.storage_offset() == slot.storage_offset() == 0 and slot.numel() == m.slot
        assert unit.shard_slots() is unit.slots
    named = dict(model.named_parameters())
    member = units.units[0].members[0]
    assert named[member.param.fqn].to_local().data_ptr() == member.param.shard.local().data_ptr()


def test_a_gather_costs_no_host_work_per_member(fake_pg, monkeypatch):
    """A gather's host work does not grow with its unit's members (counts,
    not times: a host-bound step pays it twice per unit). Its aten ops are
    the same for every unit, whatever its size: one split each for the
    blocks and for this rank's slots, not a slice per member. Whether the
    shards still start their slots is checked once per call of the root,
    a member at a time, not at every gather (``Units.check_slots``); a
    shard given another local tensor since is sent from that tensor, in
    forward and backward, from the next call on."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import fxshard.runtime.units as units_module

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "aten":  # not the collectives: one per member on gloo, coalesced on NCCL
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    model = models.TinyLlama()
    _train_once(model, unit_mb=0.02, mp_policy=fxshard.MixedPrecision(torch.bfloat16, torch.float32))
    units = model.fxshard_plan.units
    assert len({len(u.members) for u in units.units}) > 1 and max(len(u.members) for u in units.units) > 8
    ops = set()
    for unit in units.units:
        with Ops() as mode:
            mode.seen = []
            units.gather_start(unit.index)
        units.gather_wait(unit.index)
        ops.add(tuple(mode.seen))
    assert len(ops) == 1 and len(next(iter(ops))) == 4, ops  # empty, a split each, the cast

    checks = []
    monkeypatch.setattr(units_module, "_starts_slot", lambda *a, check=units_module._starts_slot: (
        checks.append(a), check(*a))[1])  # fmt: skip
    model(torch.randint(0, 37, (2, 9))).sum().backward()
    assert len(checks) == len(units.unit_of), "each member once, at the call"

    unit = units.units[1]
    member = unit.members[0]
    shard = model.get_parameter(member.param.fqn)
    new = shard.to_local() + 1
    compat.replace_local_tensor(shard, new)
    sent = []  # what each gather of the unit sends
    monkeypatch.setattr(unit, "shard_slots", lambda slots=unit.shard_slots: sent.append(slots()) or sent[-1])
    model(torch.randint(0, 37, (2, 9))).sum().backward()
    assert len(sent) == 2, "the unit is gathered in forward and again in backward"
    for sources in sent:
        assert sources[0].untyped_storage().data_ptr() != unit.slots[0].untyped_storage().data_ptr()
        assert torch.equal(sources[0][: member.local_numel], new.reshape(-1))


def test_collectives_write_what_the_graph_reads(fake_pg, monkeypatch):
    """No copy-out: the gather writes each member's full parameter into the
    tensor its wait returns, member-major; the reduce-scatter writes the
    gradient slots its wait returns (fp32 shards, so no cast either)."""
    model = models.TinyLlama()
    _train_once(model, unit_mb=0.003)
    units = model.fxshard_plan.units
    sent = {}
    gather, reduce = compat.all_gather_coalesced_async, compat.reduce_scatter_async
    monkeypatch.setattr(compat, "all_gather_coalesced_async",
                        lambda o, i, g, **kw: sent.update(gather=(o, i)) or gather(o, i, g, **kw))  # fmt: skip
    monkeypatch.setattr(compat, "reduce_scatter_async",
                        lambda o, i, g, **kw: sent.update(reduce=(o, i)) or reduce(o, i, g, **kw))  # fmt: skip
    unit = units.units[1]
    units.gather_start(unit.index)
    full = units.gather_wait(unit.index)
    outs, inps = sent["gather"]
    ws = units.world_size
    for m, slot, out, inp in zip(unit.members, unit.slots, outs, inps):
        assert out.data_ptr() == full.data_ptr() + ws * m.offset * full.itemsize and out.numel() == ws * m.slot
        assert inp.data_ptr() == slot.data_ptr() and inp.numel() == m.slot
    members = list(range(len(unit.members)))
    numel, dtype = units.reduce_layout(unit.index, members)
    inp = torch.ones(ws, numel, dtype=dtype)
    units.reduce_start(unit.index, members, inp)
    assert units.reduce_wait(unit.index, members, inp) is sent["reduce"][0]
    assert sent["reduce"][1].data_ptr() == inp.data_ptr()  # the graph's input, not a copy


@pytest.mark.parametrize("blocks", [False, True], ids=["flat", "blocks"])
def test_explicit_units_override(fake_pg, blocks):
    """units=[modules]: each listed module is one unit, minus deeper listed
    modules; the rest forms units by size, within runs of first use that a
    listed unit does not interrupt (the embedding, read before layer 0, is a
    unit of its own), and with outlined blocks, layer 1 is a unit of its own
    (a block joins blocks, not the other parameters)."""
    model = models.TinyLlama()
    _train_once(model, units=[model.layers[0], model.layers[0].attn], unit_mb=256, compile_blocks_once=blocks)
    units = {u.names for u in model.fxshard_plan.units.units}
    attn = tuple(n for n, _ in model.named_parameters() if n.startswith("layers.0.attn."))
    rest_of_block = {n for n, _ in model.named_parameters() if n.startswith("layers.0.") and n not in attn}
    assert any(set(u) == set(attn) for u in units)
    assert any(set(u) == rest_of_block for u in units)
    layer1 = {n for n, _ in model.named_parameters() if n.startswith("layers.1.")}
    assert any(set(u) >= layer1 for u in units)
    assert ("embed.weight",) in units
    # the two listed, the embedding, and the rest by size: one unit, or layer 1 and the norm with the output
    assert len(units) == (5 if blocks else 4), units


class _Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        return torch.utils.checkpoint.checkpoint(self.inner, *args, use_reentrant=False)


@pytest.mark.parametrize("listed", [False, True], ids=["by_size", "listed"])
def test_checkpointed_layers_gather_by_unit(fake_pg, listed):
    """Weights read only inside a checkpointed region (dynamo captures it as a
    higher-order op with a subgraph of its own) join units like any others.
    They were left out of every unit and gathered one by one, every gather at
    the top of the forward graph: all layers' full weights alive at once."""
    model = models.TinyLlama()
    for i, layer in enumerate(model.layers):
        model.layers[i] = _Checkpointed(layer)
    kwargs = dict(units=list(model.layers)) if listed else dict(unit_mb=PER_PARAM)
    record = _train_once(model, **kwargs, **FLAT)
    plan = model.fxshard_plan
    assert len(plan.units.unit_of) == len(plan.params)
    for graph in (record.forward, record.backward):
        assert _nodes(graph, torch.ops._c10d_functional.all_gather_into_tensor.default) == []
        assert _nodes(graph, torch.ops._c10d_functional.reduce_scatter_tensor.default) == []
    assert len(_nodes(record.forward, AG)) == len(plan.units.units)
    assert len(_nodes(record.backward, RS)) == len(plan.units.units)
    # Backward gathers each checkpointed layer's unit again: for its gradients and its recompute.
    layer_units = {u.index for u in plan.units.units if all(".inner." in n for n in u.names)}
    gathered_again = {n.args[2] for n in _nodes(record.backward, AG)}
    assert layer_units and layer_units <= gathered_again


def test_keep_full_weights_gathers_once(fake_pg):
    record = _train_once(models.TinyLlama(), reshard_after_forward=False)
    assert record.saved_full_weights, "reshard_after_forward=False must keep full weights"
    assert _nodes(record.backward, AG) == []


def test_zero1_reduces_in_the_backward_and_gathers_nothing(fake_pg):
    """ZeRO-1's graphs read the kept copies in place and reduce the gradients
    by units inside the backward, as ZeRO-2 does, never after it: the same
    reduces as ZeRO-2's, no gather in any graph, and no full weight saved."""
    zero2 = _train_once(models.TinyLlama(layers=1), **FLAT, reshard_after_forward=False)
    zero1 = _train_once(models.TinyLlama(layers=1), **FLAT, zero_stage=1)
    assert not _nodes(zero1.forward, AG) and not _nodes(zero1.backward, AG)
    assert [n.args[3] for n in _nodes(zero1.backward, RS)] == [n.args[3] for n in _nodes(zero2.backward, RS)]
    # The backward reads each kept copy as the forward's input, never a saved view of it.
    assert _nodes(zero1.backward, RS) and not zero1.saved_full_weights


def test_collective_order_filecheck(fake_pg):
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
    fxshard.compile(model, backend="aot_eager", unit_mb=PER_PARAM, prefetch=0)
    model(torch.randn(5, 8)).sum().backward()
    (record,) = model.fxshard_plan.graphs
    fw = record.forward.code
    # Each weight and bias is gathered and waited on before the matmul reads it.
    FileCheck().check("unit_gather.default(").check("unit_gather_wait").check("unit_gather.default(").check(
        "unit_gather_wait"
    ).check("addmm").check("unit_gather.default(").check("unit_gather_wait").check("addmm").run(fw)
    bw = record.backward.code
    # The last layer's weight gradient (mm) is complete before its reduce-scatter,
    # and the reduce is waited on before it is returned.
    FileCheck().check("mm").check("unit_reduce.default(").check("unit_reduce_wait").check("return").run(bw)


def test_reduce_scatter_after_gradient_complete(fake_pg):
    model = models.TinyLlama()
    record = _train_once(model, unit_mb=PER_PARAM)
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
        assert wait.target == UNIT_REDUCE_WAIT


def test_frozen_parameters_are_gathered_not_reduced(fake_pg):
    """shard_frozen=True: a frozen parameter is sharded, gathered, never reduced."""
    model = models.TinyLlama(tie=False)
    model.embed.weight.requires_grad_(False)
    record = _train_once(model, sharded_embeddings=False, shard_frozen=True)
    forward, backward = record.reports["forward"], record.reports["backward"]
    assert "embed.weight" in {s.param for s in forward.sites if s.kind == "unshard"}
    assert "embed.weight" not in {s.param for s in backward.sites if s.kind == "reduce"}
    assert backward.count("reduce") == len(model.fxshard_plan.params) - 1


def test_frozen_sharded_lookup_has_no_backward(fake_pg):
    from fxshard.runtime.embedding import EMBEDDING, EMBEDDING_BACKWARD

    model = models.TinyLlama(tie=False)
    model.embed.weight.requires_grad_(False)
    record = _train_once(model, shard_frozen=True)
    assert len(_nodes(record.forward, EMBEDDING)) == 1 and not _nodes(record.backward, EMBEDDING_BACKWARD)
    assert record.reports["backward"].count("reduce") == len(model.fxshard_plan.params) - 1


def _collectives(gm: fx.GraphModule) -> list[fx.Node]:
    funcol = torch.ops._c10d_functional
    kinds = (funcol.all_gather_into_tensor.default, funcol.reduce_scatter_tensor.default, funcol.all_reduce.default)
    return [n for n in gm.graph.nodes if n.target in (*kinds, AG, RS)]


def test_frozen_parameters_are_replicated_by_default(fake_pg):
    """A frozen module is kept whole: no gather, no reduce, no marker; its
    plan says so, and the dump's summary shows it."""
    model = models.TinyLlama(tie=False)
    for layer in model.layers:
        layer.attn.requires_grad_(False)
    record = _train_once(model)
    plan = {p.fqn: p for p in model.fxshard_plan.params}
    frozen = [n for n, p in model.named_parameters() if ".attn." in n]
    for name in frozen:
        assert plan[name].placement.value == "Replicate()" and plan[name].reduce.value == "none", plan[name]
        assert dict(model.named_parameters())[name].placements[0].is_replicate()
    units = model.fxshard_plan.units
    assert not set(frozen) & {n for u in units.units for n in u.names}, "replicated parameters are in no unit"
    for phase in ("forward", "backward"):
        sites = record.reports[phase].sites
        assert not {s.param for s in sites} & set(frozen), f"{phase}: a frozen parameter meets a collective"
    assert "Replicate(), gradient none, gathered value always" in record.summary()


def test_no_shard_reads_whole_and_all_reduces(fake_pg):
    """fxshard.no_shard: no gather in forward, one deferred all-reduce per
    replicated parameter in backward, on the reduce group."""
    model = models.TinyLlama(tie=False)
    fxshard.no_shard(model.layers[1].mlp)
    record = _train_once(model, **FLAT)
    replicated = [n for n, _ in model.named_parameters() if n.startswith("layers.1.mlp.")]
    backward = record.reports["backward"]
    assert sorted(s.param for s in backward.sites if s.kind == "allreduce") == sorted(replicated)
    assert not {s.param for s in record.reports["forward"].sites if s.kind == "unshard"} & set(replicated)
    all_reduces = _nodes(record.backward, torch.ops._c10d_functional.all_reduce.default)
    assert len(all_reduces) == len(replicated)
    reduce_group = model.fxshard_plan.params[0].reduce_group_name
    assert all(n.args[2] == reduce_group for n in all_reduces)
    assert all(n.target != torch.ops._c10d_functional.all_reduce.default for n in _collectives(record.forward))
    planned = {b.owner for b in record.buffer_plans["backward"].buffers if b.kind.value == "reduce_output"}
    assert set(replicated) <= planned, "the static buffer plan holds every all-reduce's buffer"
    # Deferred: each wait sits after compute that follows its all-reduce.
    order = {n: i for i, n in enumerate(record.backward.graph.nodes)}
    waits = [next(iter(n.users)) for n in all_reduces]
    assert any(order[w] > order[n] + 1 for n, w in zip(all_reduces, waits))


def test_no_shard_errors(fake_pg):
    with pytest.raises(ValueError, match="module or an nn.Parameter"):
        fxshard.no_shard("layers.0")
    model = models.TinyLlama()
    fxshard.compile(model, backend="aot_eager")
    with pytest.raises(ValueError, match="before compiling"):
        fxshard.no_shard(model.layers[0].mlp)
    with pytest.raises(ValueError, match="before compiling"):
        fxshard.no_shard(model.norm.weight)
    with pytest.raises(ValueError, match="shard_frozen must be True or False"):
        fxshard.compile(models.TinyLlama(), backend="aot_eager", shard_frozen="yes")


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
    assert all(isinstance(p.data, DTensor) for p in model.parameters())  # the shards, DTensors


def test_mixed_precision_casts_before_the_collectives(fake_pg, monkeypatch):
    model = models.TinyLlama()
    mp = fxshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    sent = {"gather": set(), "reduce": set()}
    gather, reduce = compat.all_gather_coalesced_async, compat.reduce_scatter_async
    monkeypatch.setattr(compat, "all_gather_coalesced_async",
                        lambda o, i, g, **kw: sent["gather"].update(t.dtype for t in i)
                        or gather(o, i, g, **kw))  # fmt: skip
    monkeypatch.setattr(compat, "reduce_scatter_async",
                        lambda o, i, g, **kw: sent["reduce"].add(i.dtype) or reduce(o, i, g, **kw))  # fmt: skip
    record = _train_once(model, mp_policy=mp, unit_mb=0.003)
    assert sent["gather"] == {torch.bfloat16}, "the cast must come before the all-gather (half the bytes)"
    assert sent["reduce"] == {torch.float32}
    assert {n.meta["val"].dtype for n in _nodes(record.forward, UNIT_GATHER_WAIT)} == {torch.bfloat16}
    assert {n.meta["val"].dtype for n in _nodes(record.backward, UNIT_REDUCE_WAIT)} == {torch.float32}
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())


def test_tied_weight_dedupe_keys_on_the_parameter(fake_pg):
    from examples.llama import Llama, LlamaConfig

    record = _train_once(Llama(LlamaConfig(layers=0)))  # the tied embedding and output projection alone
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
    # One unit per gather here: each all-gather is a schedule unit.
    pos = _positions(gm)
    pairs = [(g, next(iter(g.users))) for g in _nodes(gm, AG)]
    return sorted(pairs, key=lambda p: pos[p[1]])


def test_prefetch_issues_next_unit_before_waiting(fake_pg):
    """With one parameter per unit (a tiny unit_mb), each all-gather is issued
    before the previous one is waited on, in forward and backward; with
    prefetch=0 each waits before the next is issued."""
    for prefetch in (0, 1, 2):
        torch._dynamo.reset()
        record = _train_once(models.TinyLlama(layers=1), prefetch=prefetch, unit_mb=PER_PARAM, **FLAT)
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
    model = models.TinyLlama(layers=1)
    record = _train_once(model, unit_mb=PER_PARAM, **FLAT)
    names = [u.names for u in model.fxshard_plan.units.units]
    assert all(len(n) == 1 for n in names)
    first_use = [s.param for s in record.reports["forward"].sites if s.kind == "unshard"]
    assert [n[0] for n in names] == first_use
    torch._dynamo.reset()
    model = models.TinyLlama(layers=1)
    _train_once(model, unit_mb=0.003, **FLAT)
    units = model.fxshard_plan.units.units
    sizes = [[math.prod(m.param.shape) * m.param.gather_dtype.itemsize for m in u.members] for u in units]
    most = int(0.003 * 2**20)
    # At most unit_mb (a larger parameter alone), and full: the next unit's first member did not fit.
    assert len(units) > 2 and all(sum(s) <= most or len(s) == 1 for s in sizes)
    assert all(sum(a) + b[0] > most for a, b in zip(sizes, sizes[1:]))
    assert [n for u in units for n in u.names] == first_use


# 1 (the default) and 3 by default; 2 under [Note: full_cpu].
@pytest.mark.parametrize("in_flight", [1, pytest.param(2, marks=pytest.mark.full_cpu), 3])
def test_reduce_waits_deferred(fake_pg, in_flight):
    """At most ``reduces_in_flight`` reduce-scatters run at once, and at most
    that many reduce inputs are alive: the wait of reduce i comes after
    reduce i + in_flight - 1 is issued, and before the input of reduce
    i + in_flight is built (the default is 1)."""
    kwargs = {} if in_flight == 1 else {"reduces_in_flight": in_flight}
    mp = fxshard.MixedPrecision(torch.bfloat16, torch.float32)  # every reduce input is a buffer of its own
    record = _train_once(models.TinyLlama(layers=1), unit_mb=PER_PARAM, mp_policy=mp, **kwargs, **FLAT)
    bw = record.backward
    pos = _positions(bw)
    reduces = _nodes(bw, RS)
    assert len(reduces) > 4
    intervals = []
    for i, rs in enumerate(reduces):
        (wait,) = rs.users
        issued_before = reduces[i + in_flight - 1] if i + in_flight - 1 < len(reduces) else rs
        assert pos[issued_before] <= pos[wait], (i, in_flight)
        # What lowering inserted to build this reduce's input (cast, pad, layout).
        built, frontier = [], [rs.args[0]]
        while frontier:
            n = frontier.pop()
            if n.meta.get(LOWERED) and n not in built:
                built.append(n)
                frontier.extend(n.all_input_nodes)
        intervals.append((min(pos[n] for n in built), pos[wait]))
    alive = max(sum(a <= p <= b for a, b in intervals) for p in range(len(pos)))
    assert alive == in_flight


def test_reduce_waits_have_compute_to_hide_behind(fake_pg):
    """Units whose gradients one op completes (a layer's outlined call, split
    into two units by ``units=``) count as one reduce in flight: each wait
    still has compute between it and its reduce, unless nothing is left to
    compute."""
    model = models.TinyLlama()
    mp = fxshard.MixedPrecision(torch.bfloat16, torch.float32)
    record = _train_once(model, units=[model.layers[0].attn, model.layers[1].attn], unit_mb=0.003, mp_policy=mp)
    bw = record.backward
    nodes = list(bw.graph.nodes)
    pos = _positions(bw)
    compute = [pos[n] for n in nodes if n.op == "call_function" and not n.meta.get(LOWERED)
               and n.target not in (RS, UNIT_REDUCE_WAIT, AG, UNIT_GATHER_WAIT)]  # fmt: skip
    reduces = _nodes(bw, RS)
    assert len(reduces) >= 5  # two units per layer, and the rest
    for rs in reduces:
        (wait,) = rs.users
        if any(p > pos[rs] for p in compute):
            assert any(pos[rs] < p < pos[wait] for p in compute), rs.name


def test_reduces_on_their_own_group(fake_pg, monkeypatch):
    """Reduce-scatters use a second communicator over the same ranks, so they
    can overlap the backward's all-gathers."""
    groups = {"gather": set(), "reduce": set()}
    gather, reduce = compat.all_gather_coalesced_async, compat.reduce_scatter_async
    monkeypatch.setattr(compat, "all_gather_coalesced_async",
                        lambda o, i, g, **kw: groups["gather"].add(g) or gather(o, i, g, **kw))  # fmt: skip
    monkeypatch.setattr(compat, "reduce_scatter_async",
                        lambda o, i, g, **kw: groups["reduce"].add(g) or reduce(o, i, g, **kw))  # fmt: skip
    _train_once(_small())
    (g,), (r,) = groups["gather"], groups["reduce"]
    assert g is not r and dist.get_process_group_ranks(g) == dist.get_process_group_ranks(r)


def test_compiles_on_one_mesh_share_the_reduce_group(fake_pg):
    """One reduce communicator per mesh, not one per compile (each NCCL
    communicator holds GPU memory), and a new one once the world is new."""

    def reduce_group(model):
        fxshard.compile(model, backend="aot_eager")
        return {p.reduce_group_name for p in model.fxshard_plan.params}

    first, second = reduce_group(models.TinyLlama()), reduce_group(models.TinyLlama())
    assert first == second and len(first) == 1 and first != {dist.group.WORLD.group_name}
    dist.destroy_process_group()
    dist.init_process_group("fake", store=compat.fake_store(), rank=0, world_size=4)
    (name,) = reduce_group(models.TinyLlama())
    assert compat.group_is_live(compat.resolve_group(name))


def test_a_dropped_model_frees_its_shards(fake_pg):
    """torch keeps a compiled function, and the backend its lazy backward
    compile calls, after the model is gone; the backend must not keep the
    units, and through them every shard slot, alive (8 GiB per 8B model on
    4 ranks, found by the benchmark: each system after an fxshard one
    started with it allocated)."""
    model = models.TinyLlama()
    _train_once(model)
    units, params = weakref.ref(model.fxshard_plan.units), weakref.ref(next(model.parameters()))
    slot = weakref.ref(model.fxshard_plan.units.units[0].slots[0])
    cls = type(model)  # caches keep classes (Python's inspect memoizes by class): it must hold nothing
    del model
    gc.collect()
    assert units() is None and params() is None and slot() is None
    assert cls.__name__.startswith("FXShard")


@pytest.mark.parametrize("zero_stage", [pytest.param(3, marks=pytest.mark.full_cpu), 1])  # 1: both hooks
def test_optimizer_hooks_go_with_the_last_model(fake_pg, zero_stage):
    """fxshard's checks on optimizer steps (optimizers built before compile,
    steps on unreduced gradients, counting steps for ZeRO-1 and held
    values) use torch's process-wide step hooks, the only ones an optimizer
    built later runs: they are held by the compiled models that need them,
    and removed with the last one (they once stayed for the process). So are
    the registration hooks that keep parameters from joining a compiled
    model (see [Note: parameters join before compile])."""
    from torch.optim import optimizer as torch_optimizer

    from fxshard.module import optimizers, structure

    def ours() -> list[str]:
        hooks = [*torch_optimizer._global_optimizer_pre_hooks.values(),
                 *torch_optimizer._global_optimizer_post_hooks.values()]  # fmt: skip
        return sorted(h.__name__ for h in hooks if getattr(h, "__module__", "").startswith("fxshard"))

    def holders() -> tuple[int, int]:
        return optimizers._STEP_CHECK.count, optimizers._STEP_COUNT.count

    def registration_hooks() -> list[str]:
        hooks = [*torch.nn.modules.module._global_module_registration_hooks.values(),
                 *torch.nn.modules.module._global_parameter_registration_hooks.values()]  # fmt: skip
        return sorted(h.__name__ for h in hooks if getattr(h, "__module__", "").startswith("fxshard"))

    gc.collect()
    start = holders()  # other tests' models may still be alive in this process
    watching = structure._MODULE_HOOK.count
    models_ = [_small(), _small()]
    for i in range(2):
        _train_once(models_[i], zero_stage=zero_stage)
    _ = models_[0][1].weight  # a read outside forward counts optimizer steps
    opt = torch.optim.AdamW(models_[0].parameters())
    opt.step()
    assert ours() == ["_check_optimizer", "_count_steps"]
    assert registration_hooks() == ["_on_module", "_on_parameter"]
    del opt, models_[0], _
    gc.collect()
    # The second model still checks steps; it counts them only for ZeRO-1's copies (nothing read it outside).
    assert "_check_optimizer" in ours()
    if start[1] == 0:
        assert ("_count_steps" in ours()) == (zero_stage == 1)
    models_.clear()
    gc.collect()
    assert holders() == start and structure._MODULE_HOOK.count == watching
    if start == (0, 0):
        assert ours() == []
    if watching == 0:
        assert registration_hooks() == []


def test_models_compile_past_dynamos_recompile_limit(fake_pg):
    """Each root gets a forward with its own code object: dynamo caches per
    code object and stops at its recompile limit, so a forward that every
    root shared failed on the ninth model a process compiled."""
    with torch._dynamo.config.patch(recompile_limit=1):
        for _ in range(2):
            model = _small()
            _train_once(model)
            assert type(model).forward.__code__ is not nn.Sequential.forward.__code__


def test_units_id_names_the_layout():
    """Compiled graphs name their Units by id, and torch caches them on disk:
    the id depends on the layout only, never on what the process built before,
    and two live Units of one layout get two ids."""
    from fxshard.runtime.units import Units
    from tests.helpers import records

    def units(*shapes):
        params = [records.param(i, f"w{i}", shape, shape[0] // 2) for i, shape in enumerate(shapes)]
        u = Units(plans_module.ModelRuntime(), params, 2, "0", "1")
        u.form(form_units(u.params, [p.fqn for p in params], unit_bytes=2**20))
        return u

    a = units((4, 3), (6, 2))
    other = units((4, 3), (6, 3))
    b = units((4, 3), (6, 2))
    assert other.id != a.id and b.id == a.id + 1
    a_id = a.id
    del a, b
    gc.collect()
    assert units((4, 3), (6, 2)).id == a_id


def test_plan_id_names_the_plan():
    """Markers name a model's plan table by id, baked into graphs that torch
    caches on disk: the id depends on the plans only, and two live tables of
    the same plans (two copies of one model) get two ids, so that each
    model's reads find its own gradient store and sequencer."""
    from tests.helpers import marker_plans

    plan, _ = marker_plans.sharded("w", (8, 3), 4, 2)
    table = plans_module.table(plan)

    def named(*args):
        return plans_module.ModelRuntime(plans_module.PlanTable(*args))

    again = named(table.params, table.local_rows)
    rows = named(table.params, (3,))
    assert again.table.id == plan + 1 and rows.table.id not in (plan, plan + 1)
    again_id = again.table.id
    del again
    gc.collect()
    assert named(table.params, table.local_rows).table.id == again_id


def test_members_start_aligned_in_the_gathered_unit():
    """Each member's block of a gathered unit, which compiled graphs (and an
    outlined block's body, compiled for aligned inputs) read in place, starts
    16-byte aligned, whatever the sizes before it (odd conv biases, say)."""
    from fxshard.runtime.units import Units
    from tests.helpers import records

    shapes = [(13, 1, 4), (13,), (26, 20), (7,), (3, 5), (41, 20)]
    for dtype in (torch.float32, torch.bfloat16):
        params = [records.param(i, f"w{i}", shape, -(-shape[0] // 3), world_size=3, shard_dtype=dtype,
                                reduce_dtype=torch.float32) for i, shape in enumerate(shapes)]  # fmt: skip
        u = Units(plans_module.ModelRuntime(), params, 3, "0", "1")
        u.form(form_units(u.params, [p.fqn for p in params], unit_bytes=2**20))
        (unit,) = u.units
        ends = [3 * m.offset for m in unit.members]
        assert all(start * dtype.itemsize % 16 == 0 for start in ends), ends
        spans = sorted((3 * m.offset, 3 * (m.offset + m.slot)) for m in unit.members)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= 3 * unit.numel


# Flat graphs gather through the same units as outlined blocks: [Note: full_cpu].
@pytest.mark.parametrize("blocks", [pytest.param(False, marks=pytest.mark.full_cpu), True], ids=["flat", "blocks"])
def test_gathers_need_no_buffer_but_their_output(fake_pg, monkeypatch, blocks):
    """Communication holds no memory of its own. A gather that casts writes
    the cast into this rank's slot of each member's block of the gathered
    output, and the all-gather runs in place; one that does not cast sends
    the slots themselves. With two units in flight (prefetch=2)."""
    calls = []
    gather = compat.all_gather_coalesced_async

    def record(outs, inps, group, **kw):
        calls.append([(o, i, group.rank()) for o, i in zip(outs, inps)])
        return gather(outs, inps, group, **kw)

    monkeypatch.setattr(compat, "all_gather_coalesced_async", record)
    for mp in (fxshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), None):
        model = models.TinyLlama()
        record_ = _train_once(model, unit_mb=0.003, prefetch=2, mp_policy=mp, compile_blocks_once=blocks)
        calls.clear()  # the first step sends copies until the shards move into their slots (Units.rehome)
        model(torch.randint(0, 37, (2, 9))).sum().backward()
        units = model.fxshard_plan.units
        slots = {s.untyped_storage().data_ptr() for u in units.units for s in u.slots}
        assert len(calls) == 2 * len(units.units) - 1  # forward and backward; the last unit is kept
        for call in calls:
            for out, inp, rank in call:
                if mp is not None:  # in place, at this rank's slot of the member's block
                    assert inp.dtype == out.dtype == torch.bfloat16
                    assert inp.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
                    assert inp.storage_offset() == out.storage_offset() + rank * inp.numel()
                else:  # the slots themselves
                    assert inp.untyped_storage().data_ptr() in slots
        assert "[forward memory] predicted peak: " in record_.summary()


def test_untied_embedding_lookup_moves_tokens_not_the_table(fake_pg):
    """An embedding read only by F.embedding (default options) becomes
    fxshard::embedding on the local shard: no gather, no reduce, no unit. A
    table tied to the output projection, or one with a padding row, keeps
    its gather; so does every table with sharded_embeddings=False."""
    from examples.llama import Llama, LlamaConfig
    from fxshard.runtime.embedding import EMBEDDING, EMBEDDING_BACKWARD

    model = models.TinyLlama(tie=False)
    record = _train_once(model)
    assert record.sharded_lookups == ("embed.weight",)
    assert "embed.weight" not in model.fxshard_plan.units.unit_of
    (lookup,) = _nodes(record.captured, EMBEDDING)
    assert param_of(lookup).fqn == "embed.weight" and lookup.args[1].op == "placeholder"  # the local shard itself
    assert len(_nodes(record.forward, EMBEDDING)) == 1 and len(_nodes(record.backward, EMBEDDING_BACKWARD)) == 1
    assert "sharded embedding lookups (tokens move, not the table): embed.weight" in record.summary()

    # The embedding and the output projection alone: which tables keep their gather does not depend on the blocks.
    for tie in (True, False):
        model = Llama(LlamaConfig(layers=0, tie_embeddings=tie))
        record = _train_once(model, sharded_embeddings=tie)
        assert record.sharded_lookups == () and not _nodes(record.captured, EMBEDDING)
        assert "embed.weight" in model.fxshard_plan.units.unit_of

    model = models.SmallVocab()
    fxshard.compile(model, backend="aot_eager")
    model(torch.randint(0, 3, (2, 5))).sum().backward()
    (record,) = model.fxshard_plan.graphs
    assert record.sharded_lookups == ("embed.weight",)  # pos has padding_idx=0


def test_sharded_lookup_backward_sums_without_atomic_adds(fake_pg):
    """The sharded lookup's backward sums the rows this rank holds with the
    sorted embedding backward, the ids of other ranks' rows sent to a padding
    row it skips: an index_add_ with those ids clamped onto two rows of the
    shard made (world_size - 1) / world_size of its atomic adds contend for
    those rows on GPUs (see [Note: sharded lookups])."""
    from examples.llama import Llama, LlamaConfig
    from fxshard.runtime.embedding import EMBEDDING, embedding_backward

    model = Llama(LlamaConfig(layers=0, tie_embeddings=False))  # a lookup needs no blocks
    (lookup,) = _nodes(_train_once(model).captured, EMBEDDING)
    table, index = lookup.args[2], lookup.args[3]
    tokens = torch.randint(0, 37, (2, 9))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        grad = embedding_backward(torch.ones(2, 9, 24), tokens, table, index)
    ops = {e.key for e in prof.key_averages()}
    assert "aten::embedding_dense_backward" in ops and not {"aten::index_add_", "aten::index_add"} & ops
    assert tuple(grad.shape) == (-(-37 // 4), 24)


def test_reduce_input_rows_are_never_padded(fake_pg, monkeypatch):
    """Inductor pads the rows of buffers whose row is not 128-byte aligned
    (on GPUs; here forced on CPU), copying the buffer for each reader. The
    rank-major reduce input is read flat, and its wait must get the buffer
    its start sent (the runtime checks), so its rows are made aligned: the
    unit's 31 x 37 + 31 = 1178 elements per rank get 6 zeros."""
    from fxshard.runtime.units import Units

    monkeypatch.setenv("FXSHARD_INDUCTOR_CONFIG", "disable_padding_cpu=0")
    seen = []
    start = Units.reduce_start
    monkeypatch.setattr(Units, "reduce_start",
                        lambda self, u, m, inp: seen.append((inp.shape, inp.stride())) or start(self, u, m, inp))  # fmt: skip
    model = nn.Linear(37, 123)  # one unit of 31 x 37 + 31 = 1178 fp32 elements per rank: Inductor pads to 1184
    fxshard.compile(model, backend="inductor")
    model(torch.randn(2, 37)).sum().backward()
    assert seen == [((4, 1184), (1184, 1))], seen


def test_alike_blocks_compile_once(fake_pg):
    """compile_blocks_once: four alike layers call one body, each layer's
    weights are one unit whose gather is issued while the previous layer
    computes, and the bodies save no full weight: the backward gathers again."""
    from examples.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig(layers=4))
    record = _train_once(model, compile_blocks_once=True, unit_mb=PER_PARAM)
    assert record.outline.bodies == [[f"layers.{i}" for i in range(4)]] and not record.outline.inline
    units = model.fxshard_plan.units
    for i in range(4):  # one unit per block: never split, however small unit_mb
        (unit,) = {units.unit_of[n][0] for n, _ in model.layers[i].named_parameters(prefix=f"layers.{i}")}
        assert sorted(units.units[unit].names) == sorted(n for n, _ in model.layers[i].named_parameters(f"layers.{i}"))
    fw = record.forward
    calls = [n for n in fw.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
    assert len(calls) == 4 and len({n.args[0].target for n in calls}) == 1
    pos, pairs = _positions(fw), _gathers_by_wait(fw)
    prefetched = 0
    for gather, wait in pairs:
        later = [c for c in calls if pos[c] > pos[wait]]
        if later and later[0] is not calls[0]:  # layer k's unit: issued before layer k - 1's call
            assert pos[gather] < pos[calls[calls.index(later[0]) - 1]]
            prefetched += 1
    assert prefetched == 3
    kept = units.units[units.unit_of["norm.weight"][0]].names  # the last unit gathered (see tag_unshard)
    assert sorted(record.saved_full_weights) == sorted(kept) and not any(n.startswith("layers.") for n in kept)
    back = {s.param for s in record.reports["backward"].sites if s.kind == "unshard"}
    assert {n for n, _ in model.layers.named_parameters(prefix="layers")} <= back


def test_blocks_join_into_units_of_unit_mb(fake_pg):
    """Consecutive outlined blocks fill units of at most unit_mb, as other
    parameters do: with 2.5 blocks' worth, layers 0-1 and 2-3."""
    from examples.llama import Llama, LlamaConfig

    model = Llama(LlamaConfig(layers=4))
    block_mib = sum(p.numel() * p.element_size() for p in model.layers[0].parameters()) / 2**20
    _train_once(model, compile_blocks_once=True, unit_mb=2.5 * block_mib)
    units = model.fxshard_plan.units
    layer_units = [{units.unit_of[n][0] for n, _ in model.layers[i].named_parameters(prefix=f"layers.{i}")}
                   for i in range(4)]  # fmt: skip
    assert all(len(u) == 1 for u in layer_units)
    assert layer_units[0] == layer_units[1] != layer_units[2] == layer_units[3]


@pytest.mark.parametrize(
    "blocks, block_mib, unit_mb, per_unit, per_reduce",
    [
        (8, 75, None, [1] * 8, [1] * 8),  # torchtitan's Qwen3 debugmodel_moe: a unit per layer, as FSDP2
        (16, 104, None, [2] * 8, [1] * 16),  # OLMoE: an eighth is 208 MiB, two layers
        (64, 24, None, [8] * 8, [3, 3, 2] * 8),  # small layers: 192 MiB units, reduces of at least 64 MiB
        (32, 436, None, [1] * 32, [1] * 32),  # 8B: 256 MiB is less than a layer
        (6, 10, None, [6], [6]),  # DeepSeek-V3's debugmodel: an eighth is under 64 MiB, so units hold 64
        (8, 75, 256, [3, 3, 2], [1] * 8),  # the user's unit_mb: at most that, whatever the model
        (4, 75, 50, [1] * 4, [1] * 4),  # a layer larger than unit_mb is a unit alone
    ],
)
def test_default_units_hold_at_most_an_eighth_of_the_model(blocks, block_mib, unit_mb, per_unit, per_reduce):
    """Units hold at most ``unit_mb`` (256 MiB by default) and, by default,
    at most an eighth of the model's gathered weights where that is over 64
    MiB, so that the two units gathered at a time hold no more than a
    quarter of a small model. Units of about 256 MiB held two units of four
    layers of Qwen3's 8 at the backward's peak (1.11x FSDP2 + compile's on
    4 x H200). A unit is full: the next layer would not fit. Reduce groups
    stay at least a quarter of 256 MiB (or of ``unit_mb``): each reduce, as
    each gather, costs the host."""
    from tests.helpers import records

    cols = 4096  # fp32 rows of 16 KiB: a MiB is 64 rows
    params = {f"l{i}": records.param(i, f"l{i}", (64 * block_mib, cols), 32 * block_mib) for i in range(blocks)}
    names = list(params)
    unit_bytes = None if unit_mb is None else unit_mb * 2**20
    units = form_units(params, names, unit_bytes, blocks=[[n] for n in names])
    assert [sum(len(group) for group in unit) for unit in units] == per_unit
    assert [len(group) for unit in units for group in unit] == per_reduce
    assert [p.fqn for unit in units for group in unit for p in group] == names


def test_a_unit_of_blocks_reduces_each_block_after_its_backward(fake_pg, monkeypatch):
    """A unit of several outlined blocks is gathered once but reduced per
    block ([Note: a reduce per block]): each block's reduce-scatter is
    issued right after that block's backward call, before the next block's,
    so its gradients and reduce input are freed early. One reduce for the
    unit kept all of its gradients alive until the last block's, beside the
    unit's whole reduce input, and the estimated backward peak says so.
    Blocks smaller than a quarter of ``unit_mb`` are reduced a few at a
    time: each reduce costs host time."""
    from examples.llama import Llama, LlamaConfig

    def layer_mib() -> float:
        layer = Llama(LlamaConfig(layers=1, dim=64, hidden=256)).layers[0]
        return sum(p.numel() for p in layer.parameters()) * 2 / 2**20  # gathered in bf16

    def train(unit_mb: float, one_reduce_per_unit: bool = False):
        # Weights larger than the activations, as in the benchmark's MoE, where the reduce set the peak.
        model = Llama(LlamaConfig(layers=4, dim=64, hidden=256))
        if one_reduce_per_unit:  # every unit as one reduce group, as before
            form = Units.form
            monkeypatch.setattr(Units, "form", lambda self, units: form(self, [[sum(u, [])] for u in units]))
        mp = fxshard.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        fxshard.compile(model, backend="aot_eager", compile_blocks_once=True, mp_policy=mp, unit_mb=unit_mb)
        model(torch.randint(0, 37, (2, 4))).float().sum().backward()
        (record,) = model.fxshard_plan.graphs
        units = model.fxshard_plan.units
        (unit,) = {units.unit_of[n][0] for n, _ in model.layers.named_parameters(prefix="layers")}
        return units.units[unit], record

    def layers_per_reduce(unit, record) -> list[set[str]]:
        bw = record.backward
        pos = _positions(bw)
        calls = sorted((n for n in bw.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph), key=pos.get)
        reduces = sorted((n for n in _nodes(bw, RS) if n.args[2] == unit.index), key=pos.get)
        assert len(calls) == 4
        layers = []
        for reduce in reduces:
            layers.append({unit.members[j].param.fqn.split(".")[1] for j in reduce.args[3]})
            # Issued after its last layer's backward (layers run backward from 3), before the next one's.
            last = 3 - int(min(layers[-1]))
            assert pos[calls[last]] < pos[reduce]
            if last + 1 < len(calls):
                assert pos[reduce] < pos[calls[last + 1]]
        return layers

    # 4 layers: the unit holds them all, and each layer is a quarter of it.
    unit, record = train(4 * layer_mib())
    assert len(unit.reduce_groups) == 4 and "4 reduces" in record.summary()
    assert layers_per_reduce(unit, record) == [{"3"}, {"2"}, {"1"}, {"0"}]
    unit, halves = train(8 * layer_mib())  # a quarter is two layers: a reduce per two
    assert layers_per_reduce(unit, halves) == [{"2", "3"}, {"0", "1"}]
    unit, whole = train(4 * layer_mib(), one_reduce_per_unit=True)
    assert layers_per_reduce(unit, whole) == [{"0", "1", "2", "3"}]
    assert record.peaks["backward"].total < 0.7 * whole.peaks["backward"].total


def test_blocks_that_differ_are_not_shared(fake_pg):
    """A layer that traces differently (another width) gets no shared body:
    alike layers share one, the odd one stays inline."""
    from examples.llama import Block, Llama, LlamaConfig

    model = Llama(LlamaConfig(layers=3))
    model.layers[1] = Block(LlamaConfig(hidden=20))
    record = _train_once(model, compile_blocks_once=True)
    assert record.outline.bodies == [["layers.0", "layers.2"]] and record.outline.inline == ["layers.1"]


class _VmapLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.randn(6))
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.vmap(lambda row: row * self.scale)(x))


class _VmapStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_VmapLayer() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def test_blocks_with_effects_stay_inline_and_in_order(fake_pg):
    """Dynamo inlines torch.vmap as ops that open and close a vmap level, and
    records no module for the one that closes it: it sits between a layer's
    nodes. Outlining must neither move it (the level would close before it
    opens: an internal assert in functorch, as in transformers' Mamba) nor
    outline a layer that holds vmap levels. The layers stay inline."""
    model = _VmapStack()
    fxshard.compile(model, backend="aot_eager")
    model(torch.randn(4, 6)).sum().backward()
    (record,) = model.fxshard_plan.graphs
    assert record.outline.bodies == [] and record.outline.inline == ["layers.0", "layers.1", "layers.2"]
    # The dump says why, also where nothing was outlined (it said only "none").
    assert all("vmap" in record.outline.why[n] for n in record.outline.inline), record.outline.why
    assert "inline: layers.0 (_vmap" in record.outline.format(), record.outline.format()
    names = [n.name for n in record.captured.graph.nodes]
    opens = [i for i, n in enumerate(names) if n.startswith("_vmap_increment_nesting")]
    closes = [i for i, n in enumerate(names) if n.startswith("_vmap_decrement_nesting")]
    assert len(opens) == len(closes) == 3 and all(o < c for o, c in zip(opens, closes)), names


def test_replicated_reads_stay_outside_outlined_blocks(fake_pg):
    """A layer reading replicated weights is still compiled once: the reads
    stay in the outer graph, like unshards, and the body takes the weights."""
    model = models.TinyLlama(tie=False)
    for layer in model.layers:
        fxshard.no_shard(layer.mlp)
    record = _train_once(model)
    assert record.outline.bodies == [["layers.0", "layers.1"]], record.outline.format()
    replicate = torch.ops.fxshard.replicate.default
    assert len(_nodes(record.captured, replicate)) == 3 * len(model.layers)


def _hsdp(model: nn.Module, shape: tuple[int, int], monkeypatch, **kwargs):
    """Compile ``model`` on a (replicate, shard) mesh of ``shape`` and train
    one step; the record, the replicate group, and ``started``, the
    all-reduces the runtime started (numel, group)."""
    from torch.distributed.device_mesh import init_device_mesh

    started = []
    start = getattr(compat, "all_reduce_async", None)
    monkeypatch.setattr(compat, "all_reduce_async", lambda t, g, **kw: started.append((t.numel(), g)) or start(t, g, **kw),
                        raising=False)  # fmt: skip
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    fxshard.compile(model, mesh, backend="aot_eager", **kwargs)
    tokens = torch.randint(0, 37, (2, 9))
    lm_loss(model(tokens), tokens).backward()
    (record,) = model.fxshard_plan.graphs
    return record, mesh.get_group("replicate"), started


def _replica_all_reduces(gm: fx.GraphModule, group) -> list[fx.Node]:
    return [n for n in _nodes(gm, torch.ops._c10d_functional.all_reduce.default) if n.args[2] == group.group_name]


@pytest.mark.parametrize("zero_stage", [3, 2, 1])
def test_hsdp_averages_each_unit_across_replicas_inside_the_backward(fake_pg, monkeypatch, zero_stage):
    """HSDP on a 2 x 2 mesh (see [Note: HSDP]): the backward graph averages
    each unit's reduced gradient across the replicas itself. One
    ``fxshard::unit_reduce_replicas`` per unit reduce starts the all-reduce
    on the replicate group, from the reduce-scatter's token where that is
    waited for, and its wait comes later, with what is left of the backward
    between (at the end of the graph). A replicated
    parameter's average is an all-reduce on the replicate group, waited for
    late too. ZeRO-1's kept copies average the same way, inside the backward."""
    model = models.TinyLlama(tie=False)
    fxshard.no_shard(model.norm)
    record, replicate, started = _hsdp(model, (2, 2), monkeypatch, zero_stage=zero_stage, unit_mb=0.003)
    bw, units = record.backward, model.fxshard_plan.units
    pos = _positions(bw)
    comm = ("fxshard.unit_", "_c10d_functional.")  # the collectives and their waits; the rest computes
    compute = [pos[n] for n in bw.graph.nodes if n.op == "call_function" and not n.meta.get(LOWERED)
               and not str(n.target).startswith(comm)]  # fmt: skip
    reduces = _nodes(bw, RS)
    assert len(reduces) == len(units.units) > 2
    averages = [n for n in bw.graph.nodes if str(n.target) == "fxshard.unit_reduce_replicas.default"]
    assert [a.args[0] for a in averages] == reduces, "one average across replicas per unit reduce, from its token"
    assert not _nodes(bw, UNIT_REDUCE_WAIT), "a unit's gradients come from the average's wait"
    for a in averages:
        (wait,) = a.users
        assert str(wait.target) == "fxshard.unit_replicas_wait.default"
        assert pos[wait] > pos[a] + 1, f"{a.name} is waited for where it starts"
        if any(p > pos[a] for p in compute):  # what is left of the backward runs beside it
            assert any(pos[a] < p < pos[wait] for p in compute), f"no backward compute hides {a.name}"
    # The replicated norm's gradient: all-reduced in its group, then across the replicas, waited for late.
    (norm,) = _replica_all_reduces(bw, replicate)
    (norm_wait,) = norm.users
    assert pos[norm_wait] > pos[norm] + 1
    assert any(pos[norm] < p < pos[norm_wait] for p in compute)

    # What ran: one all-reduce on the replicate group per unit reduce, of that reduce's output.
    expected = [units.reduce_layout(r.args[2], r.args[3])[0] for r in reduces]
    assert [n for n, _ in started] == expected
    assert all(dist.get_process_group_ranks(g) == dist.get_process_group_ranks(replicate) for _, g in started)


def test_hsdp_without_sharding_averages_inside_the_backward(fake_pg, monkeypatch):
    """A (4, 1) mesh shards nothing (no units): each gradient's average across
    the replicas is an all-reduce on the replicate group inside the backward
    graph, waited for at its end."""
    model = models.TinyLlama(tie=False)
    record, replicate, started = _hsdp(model, (4, 1), monkeypatch)
    bw = record.backward
    assert model.fxshard_plan.units is None
    pos = _positions(bw)
    averages = _replica_all_reduces(bw, replicate)
    trained = [p for p in model.fxshard_plan.params if p.requires_grad]
    assert len(averages) == len(trained)
    output = next(n for n in bw.graph.nodes if n.op == "output")
    for a in averages:
        (wait,) = a.users
        assert pos[wait] > pos[a] + 1 and all(pos[n] >= pos[wait] for n in bw.graph.nodes if n.op == "output")
        assert not any(
            n.op == "call_function" and pos[wait] < pos[n] < pos[output] and not n.meta.get(LOWERED)
            for n in bw.graph.nodes
        ), "compute after the replica waits: they are not at the end"


class _ClampLayer(nn.Module):
    """Writes in place: its own tensor (as Hugging Face's MoE clamps its expert
    ids), or, with ``on_input``, the block's input activation."""

    def __init__(self, on_input: bool) -> None:
        super().__init__()
        self.lin, self.on_input = nn.Linear(8, 8), on_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_input:
            x = x.detach()
            x.clamp_(max=1.0)  # the caller's tensor
            return self.lin(x)
        y = self.lin(x)
        y.clamp_(max=1.0)
        return y


class _ClampStack(nn.Module):
    def __init__(self, on_input: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)  # every layer's input then requires grad: the layers trace alike
        self.layers = nn.ModuleList(_ClampLayer(on_input) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x) * 1.0
        return x


@pytest.mark.parametrize("on_input", [False, True], ids=["own_value", "input"])
def test_blocks_writing_in_place(fake_pg, on_input):
    """A block may write in place to a tensor it made itself: the body replays
    the write on its own tensor (HF OLMoE's layers were never compiled once
    for one clamp_ on their expert ids). A write to memory a block input
    shares keeps the block inline: the caller would not see it."""
    model = _ClampStack(on_input)
    fxshard.compile(model, backend="aot_eager")
    x = torch.randn(4, 8)
    model(x).sum().backward()
    (record,) = model.fxshard_plan.graphs
    names = ["layers.0", "layers.1", "layers.2"]
    if on_input:
        assert record.outline.bodies == [] and record.outline.inline == names
        assert all(record.outline.why[n] == "clamp_: writes an input in place, and reads it after" for n in names), (
            record.outline.why
        )
    else:
        assert record.outline.bodies == [names] and not record.outline.inline


class _ModeLayer(nn.Module):
    """Part of its code in other modes, as torchtitan's MoE layer: a gate
    under autocast, a count of its choices added to a buffer under no_grad
    (``read_count``: then read again in the layer), and attention under
    ``sdpa_kernel`` (torchtitan's puts cuDNN first)."""

    def __init__(self, read_count: bool) -> None:
        super().__init__()
        self.gate, self.lin, self.read_count = nn.Linear(8, 4), nn.Linear(8, 8), read_count
        self.register_buffer("counts", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            scores = self.gate(x)  # bf16: the body must replay the region
        chosen = nn.functional.one_hot(scores.argmax(-1), 4).sum(0)
        with torch.no_grad():
            self.counts.add_(chosen)
        y = self.lin(x) * torch.sigmoid(scores.float()).mean(-1, keepdim=True)
        with sdpa_kernel([SDPBackend.MATH]):  # not the CPU's flash kernel, which it picks by default
            y = y + nn.functional.scaled_dot_product_attention(*[y.view(2, 1, 8, 8)] * 3).view(16, 8)
        return y + self.counts.sum() * 1e-3 if self.read_count else y


class _ModeStack(nn.Module):
    def __init__(self, read_count: bool, under_autocast: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.layers = nn.ModuleList(_ModeLayer(read_count) for _ in range(3))
        self.under_autocast = under_autocast

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.under_autocast):
            for layer in self.layers:
                x = layer(x)
        return x.float()


def _trains_as_eager(model: nn.Module, ref: nn.Module) -> None:
    """Two steps of a compiled ``model`` (world size 1) and its eager ``ref``
    on (16, 8) inputs: the same outputs and accumulated gradients."""
    for _ in range(2):
        x = torch.randn(16, 8)
        out, ref_out = model(x), ref(x)
        torch.testing.assert_close(out, ref_out)
        out.square().sum().backward(), ref_out.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=name)


@pytest.mark.parametrize("case", ["count_after", "count_read", "under_autocast"])
def test_blocks_in_other_modes(no_dist, tmp_path, case):
    """A layer with an autocast region, a choice of attention kernel and a
    no_grad write to its buffer is compiled once: the body replays the
    region and the choice, and the write runs after the call. A layer that
    reads the buffer after writing it stays inline (the write cannot move),
    and so does one in an autocast region of the model's: torch traces a
    body's backward under the region that its call is in, and the
    attention's gradients then rounded otherwise than eager's. Each says
    why. Every case trains as in eager: outputs, gradients and the counts,
    and its attention runs the kernel it chose (torchtitan's layers once ran
    flash attention where they chose cuDNN's: the choice moved out of the
    body, ahead of the call)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    read_count = case == "count_read"
    ref = _ModeStack(read_count, case == "under_autocast")
    model = _ModeStack(read_count, case == "under_autocast")
    model.load_state_dict(ref.state_dict())
    fxshard.compile(model, backend="aot_eager", debug_dir=tmp_path)
    _trains_as_eager(model, ref)
    for layer, ref_layer in zip(model.layers, ref.layers):
        assert layer.counts.sum() == 32, layer.counts  # 16 tokens counted twice, not more
        torch.testing.assert_close(layer.counts, ref_layer.counts, rtol=0, atol=0)
    (record,) = model.fxshard_plan.graphs
    names = ["layers.0", "layers.1", "layers.2"]
    why = {"count_read": "add_: writes an input in place, and reads it after",
           "under_autocast": "runs under an autocast region opened outside it"}.get(case)  # fmt: skip
    if why:
        assert record.outline.bodies == [] and record.outline.inline == names
        assert all(record.outline.why[n] == why for n in names), record.outline.why
    else:
        assert record.outline.bodies == [names], record.outline.format()
    # Traced under the choice, whether outlined or inline: the math kernel's ops, not the flash kernel.
    joint = "".join(f.read_text() for f in (tmp_path / "rank0" / "graph0" / "joint").glob("*.before.txt"))
    assert "_softmax" in joint and "flash_attention" not in joint


class _AverageLayer(nn.Module):
    """A running average of its output in a buffer, written three ways."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.lin, self.how = nn.Linear(8, 8), how
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if self.how == "in_no_grad":  # the usual spelling
            with torch.no_grad():
                self.mean.mul_(0.9).add_(y.mean(0), alpha=0.1)
        elif self.how == "read_then_copy":
            new = self.mean * 0.9 + y.mean(0).detach() * 0.1
            with torch.no_grad():
                self.mean.copy_(new)
        else:  # "lerp": what the first case's reason suggests
            value = y.mean(0).detach()
            with torch.no_grad():
                self.mean.lerp_(value, 0.1)
        return torch.relu(y)


class _AverageStack(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.layers = nn.ModuleList(_AverageLayer(how) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("how", ["in_no_grad", "read_then_copy", "lerp"])
def test_blocks_keeping_a_running_average(no_dist, how):
    """A layer that writes a running average to its buffer under no_grad.
    Where the buffer is computed under no_grad, the layer stays inline and
    says how to write it to be compiled once; written with one lerp_, it is.
    A layer that reads the buffer and then writes it stays inline: moved
    after the call, the write changed an input that the call saves for its
    backward, and the backward failed ('modified by an inplace operation').
    Each trains as in eager."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    ref, model = _AverageStack(how), _AverageStack(how)
    model.load_state_dict(ref.state_dict())
    fxshard.compile(model, backend="aot_eager")
    _trains_as_eager(model, ref)
    for layer, ref_layer in zip(model.layers, ref.layers):
        torch.testing.assert_close(layer.mean, ref_layer.mean)  # fp32 tolerance: torch 2.11 differs by an ulp
    outline = model.fxshard_plan.graphs[0].outline
    names = ["layers.0", "layers.1", "layers.2"]
    if how == "lerp":
        assert outline.bodies == [names], outline.format()
    else:
        why = {"in_no_grad": "(mul_); to compile the layer once", "read_then_copy": "copy_: writes an input in "
               "place that the layer also reads"}[how]  # fmt: skip
        assert outline.bodies == [] and all(why in outline.why[n] for n in names), outline.why


class _AttentionStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with sdpa_kernel([SDPBackend.MATH]):  # the model's choice, around its layers
            for layer in self.layers:
                x = layer(x)
                x = x + nn.functional.scaled_dot_product_attention(*[x.view(2, 1, 8, 8)] * 3).view(16, 8)
        return x


def test_blocks_under_the_models_kernel_choice_stay_inline(no_dist, tmp_path):
    """A kernel choice that the model makes around its layers: outlined, the
    layers ran the default kernel (the body was traced without the choice),
    silently. They stay inline, say why, and run the chosen kernel."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = fxshard.compile(_AttentionStack(), backend="aot_eager", debug_dir=tmp_path)
    model(torch.randn(16, 8)).sum().backward()
    (record,) = model.fxshard_plan.graphs
    assert record.outline.bodies == [], record.outline.format()
    assert set(record.outline.why.values()) == {"runs under an sdpa_kernel choice made outside it"}, record.outline.why
    joint = "".join(f.read_text() for f in (tmp_path / "rank0" / "graph0" / "joint").glob("*.before.txt"))
    assert "_softmax" in joint and "flash_attention" not in joint


class _NormLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.lin(x)))


def test_blocks_with_batch_norm_stay_inline(no_dist):
    """Batch norm writes its running statistics with no in-place op in the
    graph, which torch's invoke_subgraph cannot train; its count's ``add_``
    alone could move after the call. Such layers stay inline, say why, and
    keep their statistics as in eager."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), *(_NormLayer() for _ in range(3)))
    model = nn.Sequential(nn.Linear(8, 8), *(_NormLayer() for _ in range(3)))
    model.load_state_dict(ref.state_dict())
    fxshard.compile(model, backend="aot_eager")
    for _ in range(2):
        x = torch.randn(16, 8)
        model(x).sum().backward(), ref(x).sum().backward()
    for name, value in ref.state_dict().items():
        got = model.state_dict()[name]
        torch.testing.assert_close(got.full_tensor() if isinstance(got, DTensor) else got, value, msg=name)
    (record,) = model.fxshard_plan.graphs
    assert record.outline.bodies == [] and record.outline.inline == ["0", "1", "2", "3"], record.outline.format()
    assert all(record.outline.why[n] == "batch_norm: an effect a body cannot replay" for n in "123"), record.outline.why


def test_lowering_traces_each_collective_layout_once(fake_pg, monkeypatch):
    """The lowering pass traces a collective once per distinct (collective,
    arguments, input layout) in a graph, not once per parameter: alike
    layers repeat their shapes. Replicated parameters (``no_shard``, a
    frozen tower's, world size 1) are lowered one by one, and tracing each
    read was most of this pass's time."""
    from examples.llama import Llama, LlamaConfig
    from fxshard.passes import lower

    traced, inlined = [], []
    make_fx, inline = compat.make_fx, lower._inline

    def _inline(graph, lowering, *args):
        val = lowering.node.args[0].meta["val"]
        inlined.append((param_of(lowering.node).fqn, lowering.fn.func.__name__, tuple(val.shape), val.stride()))
        return inline(graph, lowering, *args)

    monkeypatch.setattr(compat, "make_fx", lambda fn, **kw: traced.append(fn) or make_fx(fn, **kw))
    monkeypatch.setattr(lower, "_inline", _inline)
    model = Llama(LlamaConfig(layers=2))
    fxshard.no_shard(model.layers)
    _train_once(model)
    layers = {n for n, _ in model.named_parameters() if n.startswith("layers.")}
    assert {i[0] for i in inlined} == layers
    # Per distinct shape, a read in the forward (gather_full at world size 1)
    # and an all-reduce in the backward: 8 traces for 36 lowerings.
    shapes = {tuple(p.shape) for p in model.layers.parameters()}
    assert len(inlined) == 2 * len(layers) and len(traced) == 2 * len(shapes)
