"""Stage-2 and stage-3 passes, each run alone on a small hand-built graph.

Graphs are traced with ``make_fx`` from functions that call fxshard's marker
ops (their fake implementations give every node a value), or built node by
node where a pass expects what an earlier pass inserted. No process group:
lowering traces the functional collectives on meta tensors, and units are
built from parameter records alone (tests/helpers/records.py).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import CheckpointPolicy

from fxshard.passes.bucket import bucket_collectives_pass
from fxshard.passes.lower import LOWERED, PARAM, lower_collectives_pass
from fxshard.passes.markers import is_reduce, is_unshard, param_of
from fxshard.passes.schedule import schedule_collectives_pass
from fxshard.passes.tagging import tag_unshard_pass
from fxshard.passes.units import form_units
from fxshard.runtime.plans import ModelRuntime
from fxshard.runtime.units import UNIT_GATHER, UNIT_GATHER_WAIT, UNIT_REDUCE, UNIT_REDUCE_WAIT, Units
from tests.helpers import marker_plans, records

_aten, _funcol, _fxshard = torch.ops.aten, torch.ops._c10d_functional, torch.ops.fxshard
WS = 4
MUST_RECOMPUTE, MUST_SAVE = CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.MUST_SAVE


def _unshard(shard: torch.Tensor, dim0: int, param: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    return _fxshard.unshard(
        shard, *marker_plans.sharded(param, (dim0, *shard.shape[1:]), shard.shape[0], WS, dtype=dtype)
    )


def _reduce(grad: torch.Tensor, local_rows: int, param: str) -> torch.Tensor:
    return _fxshard.reduce_grad(grad, *marker_plans.sharded(param, tuple(grad.shape), local_rows, WS))


def _trace(fn, *inputs: torch.Tensor) -> tuple[fx.GraphModule, list]:
    """``fn``'s graph, and its placeholders' fake values as the example inputs
    (the passes find the fake mode there)."""
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    return gm, [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]


def _calls(gm: fx.GraphModule, target) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.target == target]


def _positions(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


# -- bucket_collectives ------------------------------------------------------

SHAPES = {"a": (8, 3), "b": (5,), "c": (6, 2), "d": (4, 4)}  # full shapes; rank 0 holds 2 rows of each


def _units() -> Units:
    """Units as the user lists them (each reduced as one): a and b, then c;
    d is in none (a parameter the first graph never read)."""
    params = [records.param(i, name, shape, 2, world_size=WS) for i, (name, shape) in enumerate(SHAPES.items())]
    units = Units(ModelRuntime(), params, WS, "0", "1")
    units.form(form_units(units.params, ["a", "b", "c"], unit_bytes=100, explicit=[["a", "b"], ["c"]]))
    assert [u.names for u in units.units] == [("a", "b"), ("c",)]
    return units


def _shards() -> list[torch.Tensor]:
    return [torch.randn(2, *shape[1:]) for shape in SHAPES.values()]


def test_bucket_gathers_each_unit_once_and_reads_member_views():
    """A unit's reads become one gather and its wait, before the unit's first
    read; each member reads a view of its block of the gathered unit (block
    ``j`` starts at ``world_size * offset_j``), one view however many reads."""
    units = _units()

    def forward(a, b, c, d, x):
        h = x @ _unshard(a, 8, "a").t()  # (2, 8)
        h = h * _unshard(c, 6, "c").sum()
        h = h + _unshard(b, 5, "b").sum() + _unshard(a, 8, "a").sum()  # a read again
        return h * _unshard(d, 4, "d").sum()

    gm, inputs = _trace(forward, *_shards(), torch.randn(2, 3))
    a, b, c, _, _ = [n for n in gm.graph.nodes if n.op == "placeholder"]
    first_read_of_c = next(n for n in gm.graph.nodes if is_unshard(n) and n.args[0] is c)
    gm = bucket_collectives_pass(gm, inputs, units=units)

    g0, g1 = _calls(gm, UNIT_GATHER)
    assert g0.args == ([a, b], units.id, 0) and g1.args == ([c], units.id, 1)  # shards in order of first read
    (w0,), (w1,) = g0.users, g1.users
    assert w0.target == UNIT_GATHER_WAIT and w0.args == (g0, units.id, 0) and w1.args == (g1, units.id, 1)
    assert w0.meta["val"].shape == (WS * units.units[0].numel,) == (4 * 18,)  # a's slot 6, b's at 16
    # a: 8 x 3 at 0; b: 5 at 4 ranks x 16 (a's slot of 2 x 3, rounded up to 16 elements); c: 6 x 2 at 0.
    views = {}
    for wait in (w0, w1):
        for s in wait.users:
            assert s.target == _aten.slice.Tensor
            (view,) = s.users
            assert view.target == _aten.view.default
            views[(wait is w1, *s.args[1:], tuple(view.args[1]))] = view
    assert set(views) == {(False, 0, 0, 24, (8, 3)), (False, 0, 64, 69, (5,)), (True, 0, 0, 12, (6, 2))}
    view_a = views[(False, 0, 0, 24, (8, 3))]
    assert len(view_a.users) == 2  # the matmul's transpose and the second read's sum
    # Only d, in no unit, keeps its marker (for lower_collectives).
    assert [param_of(n).fqn for n in gm.graph.nodes if is_unshard(n)] == ["d"]
    pos = _positions(gm)
    assert pos[g1] < pos[w1] < min(pos[u] for v in w1.users for u in v.users)
    mul_c = next(n for n in gm.graph.nodes if n.target == _aten.mul.Tensor)
    assert pos[g1] < pos[mul_c] and first_read_of_c not in pos


def test_bucket_reduces_each_unit_once_into_local_views():
    """A unit's reduce markers become one reduce of the rank-major gradients,
    placed where the last of them is complete; each marker's users read the
    rank's rows of its member from the wait's output."""
    units = _units()

    def backward(ga, gb, gc, scale):
        ra = _reduce(ga * scale, 2, "a")
        rc = _reduce(gc * scale, 2, "c")
        rb = _reduce(gb * scale, 2, "b")  # the unit's last gradient
        return ra + 1, rb + 1, rc + 1

    gm, inputs = _trace(backward, torch.randn(8, 3), torch.randn(5), torch.randn(6, 2), torch.randn(()))
    gm = bucket_collectives_pass(gm, inputs, units=units)

    assert not [n for n in gm.graph.nodes if is_reduce(n)]
    r0, r1 = sorted(_calls(gm, UNIT_REDUCE), key=lambda n: n.args[2])
    assert r0.args[1:] == (units.id, 0, [0, 1]) and r1.args[1:] == (units.id, 1, [0])
    numel, _ = units.reduce_layout(0, [0, 1])
    inp = r0.args[0]
    assert inp.meta["val"].shape == (WS, numel) and numel >= 6 + 2
    # Rank-major: a as (4, 6); b padded from 5 to 8 rows, as (4, 2); zeros to the aligned row.
    assert inp.target == _aten.cat.default
    widths = [p.meta["val"].shape[1] for p in inp.args[0]]
    assert widths == [6, 2, numel - 8] and inp.args[0][-1].target == _aten.full.default
    assert any(n.target == _aten.constant_pad_nd.default and n.args[1] == [0, 0, 0, 3] for n in gm.graph.nodes)
    (wait,) = r0.users
    assert wait.target == UNIT_REDUCE_WAIT and wait.args == (r0, inp, units.id, 0, [0, 1])
    slices = sorted((s.args[2], s.args[3], tuple(next(iter(s.users)).args[1])) for s in wait.users)
    assert slices == [(0, 6, (2, 3)), (6, 8, (2,))]  # a's local 2 x 3, then b's 2 rows at a's slot
    pos = _positions(gm)
    grad_b = next(n for n in gm.graph.nodes if n.target == _aten.mul.Tensor and n.args[0].name.startswith("gb"))
    grad_c = next(n for n in gm.graph.nodes if n.target == _aten.mul.Tensor and n.args[0].name.startswith("gc"))
    assert pos[grad_b] < pos[r0] and pos[grad_c] < pos[r1] < pos[grad_b]


def test_bucket_without_units_does_nothing():
    gm, inputs = _trace(lambda a: _unshard(a, 8, "a") * 2, torch.randn(2, 3))
    before = [n.target for n in gm.graph.nodes]
    assert bucket_collectives_pass(gm, inputs, units=None) is gm
    assert [n.target for n in gm.graph.nodes] == before


# -- lower_collectives -------------------------------------------------------


def test_lower_turns_markers_into_functional_collectives():
    """A marker left over (its parameter in no unit) becomes the traced
    ``gather_full`` / ``reduce_to_shard``: the cast before the all-gather,
    the slice to ``dim0`` rows after its wait; the pad to ``world_size *
    chunk`` rows before the reduce-scatter, the average after it."""

    def graph(shard, grad):
        return _unshard(shard, 7, "w", torch.bfloat16) * 2, _reduce(grad, 2, "v")

    gm, inputs = _trace(graph, torch.randn(2, 3), torch.randn(5, 3))
    mul = next(n for n in gm.graph.nodes if n.target == _aten.mul.Tensor)
    gm = lower_collectives_pass(gm, inputs)

    shard, grad = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert not [n for n in gm.graph.nodes if is_unshard(n) or is_reduce(n)]
    (gather,) = _calls(gm, _funcol.all_gather_into_tensor.default)
    cast = gather.args[0]
    assert cast.args[0] is shard and cast.meta["val"].dtype == torch.bfloat16 and gather.args[1:] == (4, "0")
    (wait,) = gather.users
    assert wait.target == _funcol.wait_tensor.default and wait.meta["val"].shape == (8, 3)
    (rows,) = wait.users
    assert rows.target == _aten.slice.Tensor and rows.args[1:] == (0, 0, 7) and mul.args[0] is rows

    (scatter,) = _calls(gm, _funcol.reduce_scatter_tensor.default)
    pad = scatter.args[0]
    assert pad.target == _aten.constant_pad_nd.default and pad.args == (grad, [0, 0, 0, 3], 0.0)
    assert scatter.args[1:] == ("sum", 4, "1")
    (wait,) = scatter.users
    (average,) = wait.users
    assert average.target == _aten.div.Tensor and average.args[1] == 4 and average.meta["val"].shape == (2, 3)
    inserted = [n for n in gm.graph.nodes if n.meta.get(LOWERED)]
    assert {n.meta[PARAM] for n in inserted} == {"w", "v"} and len(inserted) == 8


def test_lower_without_markers_does_nothing():
    gm, inputs = _trace(lambda x: x * 2, torch.randn(3))
    before = [n.target for n in gm.graph.nodes]
    assert lower_collectives_pass(gm, inputs) is gm and [n.target for n in gm.graph.nodes] == before


# -- schedule_collectives ----------------------------------------------------


def _lowered(graph: fx.Graph, target, *args) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta[LOWERED] = True
    return node


def _gather_chain(n_units: int) -> tuple[fx.GraphModule, list[tuple[fx.Node, fx.Node, fx.Node]]]:
    """What bucketing leaves: each unit's gather, wait and first use, in a row."""
    graph = fx.Graph()
    h = graph.placeholder("x")
    shards = [graph.placeholder(f"shard{u}") for u in range(n_units)]
    units = []
    for u, shard in enumerate(shards):
        gather = _lowered(graph, UNIT_GATHER, [shard], 0, u)
        wait = _lowered(graph, UNIT_GATHER_WAIT, gather, 0, u)
        h = graph.call_function(_aten.mul.Tensor, (h, wait))
        units.append((gather, wait, h))
    graph.output(h)
    return fx.GraphModule(torch.nn.Module(), graph), units


def test_schedule_prefetches_the_next_unit():
    """prefetch=1: unit u's gather is issued before unit u - 1's wait, so it
    runs while unit u - 1 computes; prefetch=0 leaves each gather at its wait."""
    gm, units = _gather_chain(3)
    schedule = schedule_collectives_pass(gm, [], unit_bytes=1, prefetch=1).record
    pos = _positions(gm)
    (g0, w0, use0), (g1, w1, use1), (g2, w2, _) = units
    assert pos[g0] < pos[g1] < pos[w0] < pos[use0] < pos[g2] < pos[w1] < pos[use1] < pos[w2]
    assert schedule.units == ((g0.name,), (g1.name,), (g2.name,)) and schedule.prefetch == 1

    gm, units = _gather_chain(3)
    before = list(gm.graph.nodes)
    schedule_collectives_pass(gm, [], unit_bytes=1, prefetch=0)
    assert list(gm.graph.nodes) == before


def _reduce_chain(n_units: int) -> tuple[fx.GraphModule, list[dict[str, fx.Node]]]:
    """What bucketing leaves in a backward: each unit's gradient (compute),
    the input lowering builds from it, the reduce, its wait and the view of
    the result the graph returns, in a row."""
    graph = fx.Graph()
    h = graph.placeholder("x")
    units, outputs = [], []
    for u in range(n_units):
        grad = graph.call_function(_aten.mul.Tensor, (h, h))
        inp = _lowered(graph, _aten.clone.default, grad)
        rs = _lowered(graph, UNIT_REDUCE, inp, 0, u, [0])
        wait = _lowered(graph, UNIT_REDUCE_WAIT, rs, inp, 0, u, [0])
        out = _lowered(graph, _aten.view.default, wait, [-1])
        units.append({"grad": grad, "inp": inp, "rs": rs, "wait": wait})
        outputs.append(out)
        h = grad
    graph.output((h, *outputs))
    return fx.GraphModule(torch.nn.Module(), graph), units


def test_schedule_defers_reduce_waits_by_reduces_in_flight():
    """Reduce i's wait moves past the next unit's gradient computation, to
    just before the input of reduce i + max_reduces_in_flight is built (or
    to the end): at most that many reduce inputs are alive."""
    for in_flight in (1, 2):
        gm, units = _reduce_chain(4)
        schedule = schedule_collectives_pass(gm, [], unit_bytes=1, prefetch=1, max_reduces_in_flight=in_flight).record
        pos = _positions(gm)
        output = next(n for n in gm.graph.nodes if n.op == "output")
        for i, unit in enumerate(units):
            wait = pos[unit["wait"]]
            assert pos[units[min(i + in_flight, len(units)) - 1]["rs"]] < wait, (in_flight, i)  # in flight together
            if i + in_flight < len(units):
                later = units[i + in_flight]
                assert pos[later["grad"]] < wait < pos[later["inp"]], (in_flight, i)
            else:  # nothing later to wait for: at the end
                assert wait > pos[units[-1]["rs"]] and wait < pos[output], (in_flight, i)
        assert schedule.deferred_reduces == 4


# -- tag_unshard -------------------------------------------------------------


def _joint() -> fx.GraphModule:
    """A joint graph: three weights read in forward (one through a cast and a
    transpose), gradients computed from the tangent."""

    def joint(s0, s1, s2, x, tangents):
        h = x.to(torch.bfloat16) @ _unshard(s0, 8, "w0").to(torch.bfloat16).t()
        h = h.float() @ _unshard(s1, 8, "w1").t()
        y = h * _unshard(s2, 8, "w2")
        g2 = _reduce((tangents * h).sum(0), 2, "w2")
        return y, g2

    gm, _ = _trace(joint, torch.randn(2, 3), torch.randn(2, 8), torch.randn(2), torch.randn(4, 3), torch.randn(4, 8))
    return gm


def _tags(gm: fx.GraphModule) -> dict[str, list[tuple[str, CheckpointPolicy]]]:
    """Per parameter, its unshard's chain of tagged nodes, as (op, tag)."""
    tags = {}
    for node in gm.graph.nodes:
        if is_unshard(node):
            chain, frontier = [], [node]
            while frontier:
                n = frontier.pop(0)
                if "recompute" in n.meta:
                    chain.append((n.target._opname, n.meta["recompute"]))
                    frontier.extend(n.users)
            tags[param_of(node).fqn] = chain
    return tags


def test_tag_marks_the_chain_from_shard_to_full_weight():
    """MUST_RECOMPUTE on every unshard and each view or cast of its output,
    and on nothing the weights feed (the matmuls are the partitioner's to decide)."""
    gm = tag_unshard_pass(_joint(), [], policy=MUST_RECOMPUTE)
    assert _tags(gm) == {
        "w0": [("unshard", MUST_RECOMPUTE), ("_to_copy", MUST_RECOMPUTE), ("t", MUST_RECOMPUTE)],
        "w1": [("unshard", MUST_RECOMPUTE), ("t", MUST_RECOMPUTE)],
        "w2": [("unshard", MUST_RECOMPUTE)],
    }
    tagged = {n for n in gm.graph.nodes if "recompute" in n.meta}
    assert len(tagged) == 6 and not any(n.target in (_aten.mm.default, _aten.mul.Tensor) for n in tagged)


def test_tag_keeps_the_unit_gathered_last():
    """With units, the unit of the forward's last unshard is MUST_SAVE (the
    backward reads it first), the others are recomputed; MUST_SAVE as the
    policy saves every chain."""
    unit_of = {"w0": ("w0",), "w1": ("w1", "w2"), "w2": ("w1", "w2")}.__getitem__
    gm = tag_unshard_pass(_joint(), [], policy=MUST_RECOMPUTE, unit_of=unit_of)
    assert {p: {tag for _, tag in chain} for p, chain in _tags(gm).items()} == {
        "w0": {MUST_RECOMPUTE}, "w1": {MUST_SAVE}, "w2": {MUST_SAVE}
    }  # fmt: skip
    gm = tag_unshard_pass(_joint(), [], policy=MUST_SAVE, unit_of=unit_of)
    tags = _tags(gm)
    assert {tag for chain in tags.values() for _, tag in chain} == {MUST_SAVE} and len(tags["w0"]) == 3


# -- form_units: the benchmark models' reduces -----------------------------------


def _llama_blocks(layers: int, dim: int, hidden: int, experts: int = 0) -> tuple[dict, list[list[str]], list[str]]:
    """The parameter records of the benchmark's Llama (bench/models.py) or,
    with ``experts``, an OLMoE-shaped layer (grouped expert weights), by
    block, gathered in bf16; no other parameter."""
    shapes: dict[str, tuple] = {}
    for i in range(layers):
        shapes.update({f"{i}.{n}": (dim, dim) for n in ("wq", "wk", "wv", "wo")})
        shapes.update({f"{i}.norm1": (dim,), f"{i}.norm2": (dim,)})
        if experts:
            shapes.update({f"{i}.experts": (experts * 3 * hidden, dim), f"{i}.router": (experts, dim)})
        else:
            shapes.update({f"{i}.w1": (hidden, dim), f"{i}.w2": (dim, hidden), f"{i}.w3": (hidden, dim)})
    names = list(shapes)
    params = {n: records.param(j, n, s, s[0] // WS, world_size=WS, dtype=torch.bfloat16)
              for j, (n, s) in enumerate(shapes.items())}  # fmt: skip
    blocks = [[n for n in names if n.startswith(f"{i}.")] for i in range(layers)]
    return params, blocks, names


def test_the_benchmark_models_reduce_counts():
    """A count that cannot be noisy, for [Note: a reduce per block]: a
    reduce per block on the 375M model (24 MiB blocks) made its host-bound
    step slower; blocks under a quarter of 256 MiB are reduced together,
    and the large blocks of the 1B model and OLMoE one by one. By default a
    unit holds an eighth of these models at most: three 375M blocks, two
    1B or OLMoE blocks."""
    for model, shape, units, reduces in (("375m", (24, 1024, 2816), 8, 8), ("1b", (16, 2048, 5632), 8, 16),
                                         ("olmoe", (16, 1024, 512, 32), 8, 16)):  # fmt: skip
        params, blocks, names = _llama_blocks(*shape)
        formed = form_units(params, names, None, blocks=blocks)  # the default unit_mb
        assert (len(formed), sum(map(len, formed))) == (units, reduces), model


def test_weights_outside_blocks_join_only_uninterrupted_runs():
    """An untied embedding (read first) and the final norm and output
    projection (read last) fit one unit by size, but joined they would stay
    gathered through every block between them: OLMoE's peak held its 0.2 GiB
    embedding through the forward. They form a unit per run of first uses
    that no block interrupts."""
    params, blocks, names = _llama_blocks(2, 256, 512)
    for j, (name, shape) in enumerate({"embed": (1000, 256), "norm": (256,), "out": (1000, 256)}.items()):
        params[name] = records.param(len(params) + j, name, shape, shape[0] // WS, world_size=WS, dtype=torch.bfloat16)
    first_use = ["embed", *names, "norm", "out"]
    formed = form_units(params, first_use, 256 * 2**20, blocks=blocks)
    units = [[p.fqn for group in unit for p in group] for unit in formed]
    assert units == [["embed"], names, ["norm", "out"]]
    # Without blocks, nothing interrupts: one unit, as before.
    assert [[p.fqn for group in unit for p in group] for unit in form_units(params, first_use, 256 * 2**20)] == [
        first_use
    ]


def test_units_without_blocks_reduce_in_groups():
    """Where no layers are compiled once (torchtitan's MoE models), a unit
    of the rest reduces its parameters in first-use order in groups of at
    least a quarter of ``unit_mb``, as a unit of blocks does: reduced as
    one, a Qwen3-MoE unit held its whole reduce input in fp32 (twice its
    gathered size) at the backward's peak. The user's units reduce as one."""
    unit_bytes = 256 * 2**20
    params, _, names = _llama_blocks(4, 2048, 5632)  # 98 MiB a layer in bf16
    formed = form_units(params, names, unit_bytes)  # no blocks: the rest
    assert [p.fqn for unit in formed for group in unit for p in group] == names
    assert [len(unit) for unit in formed] == [4, 2]  # units of 3 layers (294 MiB) and 1 (98 MiB)
    for unit in formed:  # every group but a unit's last holds a quarter of unit_mb, and none much more
        sizes = [sum(math.prod(p.shape) * 2 for p in group) for group in unit]
        assert all(unit_bytes // 4 <= size < unit_bytes // 4 + 23 * 2**20 for size in sizes[:-1]), sizes
    listed = form_units(params, names, unit_bytes, explicit=[names])
    assert len(listed) == 1 and len(listed[0]) == 1
