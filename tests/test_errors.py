"""Bad input: a clear error naming the fix, raised before anything is sharded."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Shard, distribute_tensor

import fxshard


def test_world_size_above_one_without_process_group(no_dist, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="init_process_group"):
        fxshard.compile(nn.Linear(4, 4))


def test_single_rank_without_process_group_just_works(no_dist, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = fxshard.compile(nn.Linear(4, 3), backend="aot_eager")
    model(torch.randn(2, 4)).sum().backward()
    assert model.weight.shape == (3, 4) and model._parameters["weight"].grad.shape == (3, 4)


@pytest.mark.parametrize("cast", [True, False])
@pytest.mark.parametrize("spelling", ["fxshard", "fsdp2"])
def test_floating_inputs_are_cast_to_the_compute_dtype(no_dist, monkeypatch, cast, spelling):
    """MixedPrecision(cast_forward_inputs=True), FSDP2's default: fp32 inputs
    meet bf16 weights; integer ids and non-tensors are left alone. FSDP2's
    own MixedPrecisionPolicy means the same (code from fully_shard moves
    over unchanged)."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.lin = nn.Embedding(10, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor, extra: dict, ids: torch.Tensor) -> torch.Tensor:
            return self.lin(x) + self.lin(extra["y"]) + self.emb(ids)

    policy = fxshard.MixedPrecision if spelling == "fxshard" else MixedPrecisionPolicy
    mp = policy(torch.bfloat16, torch.float32, cast_forward_inputs=cast)
    model = fxshard.compile(Net(), mp_policy=mp, backend="aot_eager")
    call = lambda: model(torch.randn(2, 4), {"y": torch.randn(2, 4)}, torch.tensor([1, 2]))  # noqa: E731
    if not cast:
        with pytest.raises(RuntimeError, match="dtype|same"):
            call()
        return
    out = call()
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert model._parameters.get("lin") is None and model.lin._parameters["weight"].grad.dtype == torch.float32


def test_mesh_must_be_one_or_two_dimensional(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2, 1))
    with pytest.raises(ValueError, match=r"1-D \(shard over it\) or 2-D \(replicate, shard\)"):
        fxshard.compile(nn.Linear(4, 4), mesh)


def test_mesh_must_cover_every_rank(fake_pg):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["dp"]
    with pytest.raises(ValueError, match="mesh covers 2 of the 4 ranks"):
        fxshard.compile(nn.Linear(4, 4), mesh)


def test_mesh_must_be_a_device_mesh(fake_pg):
    with pytest.raises(ValueError, match="DeviceMesh"):
        fxshard.compile(nn.Linear(4, 4), "cpu")


def test_parameters_on_another_device(fake_pg):
    mesh = init_device_mesh("cuda", (4,))  # the fake group builds it without a GPU
    with pytest.raises(ValueError, match=r"model\.to\("):
        fxshard.compile(nn.Linear(4, 4), mesh)


def test_compile_twice(fake_pg):
    model = fxshard.compile(nn.Sequential(nn.Linear(4, 4)), backend="aot_eager")
    with pytest.raises(ValueError, match="already called"):
        fxshard.compile(model)
    with pytest.raises(ValueError, match="already called"):
        fxshard.compile(nn.Sequential(model[0]))  # a compiled module inside a new root


def test_parameters_already_dtensors(fake_pg):
    model = nn.Linear(4, 4)
    mesh = init_device_mesh("cpu", (4,))
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    with pytest.raises(ValueError, match="already sharded over the mesh passed to fxshard.compile"):
        fxshard.compile(model, mesh)


@pytest.mark.parametrize(
    "table, match",
    [(nn.Embedding(10, 4, max_norm=1.0), "max_norm.*renormalizes its weight inside the forward"),
     (nn.EmbeddingBag(10, 4, max_norm=2.0), "max_norm"), (nn.Embedding(10, 4, sparse=True), "sparse=True")],
)  # fmt: skip
def test_embeddings_fxshard_cannot_train(fake_pg, table, match):
    """max_norm writes the weight inside the forward (dropped silently
    before); sparse gradients failed inside Inductor."""
    with pytest.raises(ValueError, match=match):
        fxshard.compile(nn.Sequential(table), backend="aot_eager")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(backend="tvm"), "backend must be one of"),
        (dict(mp_policy=torch.bfloat16), "mp_policy must be fxshard.MixedPrecision, FSDP2's MixedPrecisionPolicy"),
        (dict(mp_policy=MixedPrecisionPolicy(output_dtype=torch.float32)), "output_dtype=None and cast the output"),
        (dict(reshard_after_forward="yes"), "reshard_after_forward must be True or False"),
        (dict(zero_stage=0), "zero_stage must be 1, 2 or 3"),
        (dict(zero_stage=True), "zero_stage must be 1, 2 or 3"),
        (dict(zero_stage=1, reshard_after_forward=True), "disagree: reshard_after_forward=True is zero_stage=3"),
        (dict(zero_stage=3, reshard_after_forward=False), "disagree"),
        (dict(sharded_embeddings=1), "sharded_embeddings must be True or False"),
        (dict(compile_blocks_once="yes"), "compile_blocks_once must be True or False"),
        (dict(reduces_in_flight=0), "reduces_in_flight must be an int >= 1"),
        (dict(reduces_in_flight=True), "reduces_in_flight must be an int >= 1"),
        (dict(check_same_init="no"), "check_same_init must be True or False"),
    ],
)
def test_bad_options(fake_pg, kwargs, match):
    model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=match):
        fxshard.compile(model, **kwargs)
    assert type(model.weight) is nn.Parameter, "a rejected call must leave the model untouched"


def test_mixed_precision_rejects_non_float_dtypes():
    with pytest.raises(ValueError, match="floating torch.dtype"):
        fxshard.MixedPrecision(param_dtype=torch.int8)


def test_zero_dim_parameter_is_kept_whole(fake_pg):
    """A 0-dimensional parameter has no dim 0 to shard: it is replicated
    (trained to parity in the scalar_parameter scenario)."""
    model = nn.Linear(4, 4)
    model.scale = nn.Parameter(torch.tensor(1.0))
    fxshard.compile(model)
    assert model.fxshard_plan.params[-1].placement.value == "Replicate()"
    assert model.scale.shape == ()


def test_a_model_partly_on_the_meta_device(fake_pg):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
    with pytest.raises(ValueError, match=r"'1.weight' is on the meta device and others are not"):
        fxshard.compile(model)


@pytest.mark.parametrize("value, match", [("no_such_option=1", "no option 'no_such_option'"),
                                          ("pattern_matcher", "expected key=value"),
                                          ("compile_threads=many", "compile_threads takes int")])  # fmt: skip
def test_bad_inductor_config_from_environment(fake_pg, monkeypatch, value, match):
    monkeypatch.setenv("FXSHARD_INDUCTOR_CONFIG", value)
    with pytest.raises(ValueError, match=match):
        fxshard.compile(nn.Linear(4, 4))


def test_inductor_config_from_environment_is_parsed_as_the_option_type(monkeypatch):
    from fxshard.runtime import compat

    monkeypatch.setenv("FXSHARD_INDUCTOR_CONFIG", "pattern_matcher = 0, compile_threads=4")
    assert compat.env_inductor_config() == {"pattern_matcher": False, "compile_threads": 4}


@pytest.mark.parametrize("set_before_compile", [True, False], ids=["before", "after"])
def test_environment_is_read_once_at_compile(fake_pg, monkeypatch, set_before_compile):
    """FXSHARD_* variables are options: read by fxshard.compile, with the
    arguments, and fixed for that model (they were read again at each
    graph's compile, so a variable set later changed a model already made)."""
    from tests.helpers import models

    model = models.TinyLlama()
    if set_before_compile:
        monkeypatch.setenv("FXSHARD_DISABLE_PASSES", "outline_blocks")
    fxshard.compile(model, backend="aot_eager")
    if not set_before_compile:
        monkeypatch.setenv("FXSHARD_DISABLE_PASSES", "outline_blocks")
    model(torch.arange(18).reshape(2, 9) % 37).sum().backward()
    (record,) = model.fxshard_plan.graphs
    assert bool(record.outline.bodies) is not set_before_compile


def test_a_data_dependent_error_in_fxshards_own_passes_is_not_a_graph_break(no_dist, monkeypatch):
    """The backend counts a data-dependent error of tracing as the model's
    graph break. Raised by fxshard's own passes (the peak estimate read an
    expert all-to-all's token count on torch 2.11), it was reported as a graph
    break with advice to the user; it is fxshard's bug and says so."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    from fxshard.passes import pipeline

    def data_dependent(*args, **kwargs):
        raise GuardOnDataDependentSymNode("Could not extract specialized integer from data-dependent expression u0")

    monkeypatch.setattr(pipeline, "graph_peak", data_dependent)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = fxshard.compile(nn.Linear(4, 3), backend="aot_eager")
    with pytest.raises(RuntimeError, match="bug in fxshard, not in the model") as caught:
        model(torch.randn(2, 4))
    assert "graph break in" not in str(caught.value) and model.fxshard_plan.graph_break_reason is None


def test_outer_fullgraph_compile_names_the_fix(no_dist, monkeypatch):
    """torch.compile(model, fullgraph=True) over a compiled model cannot trace
    fxshard's call (a plain outer torch.compile skips it, see
    tests/helpers/param_checks.py's outer_compile): dynamo's error says why
    and what to drop, where torch.compiler.disable takes a reason."""
    import inspect

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = fxshard.compile(nn.Linear(4, 3), backend="aot_eager")
    wrapped = torch.compile(model, backend="aot_eager", fullgraph=True)
    fix = "Drop fullgraph=True" if "reason" in inspect.signature(torch.compiler.disable).parameters else ""
    with pytest.raises(Exception, match=fix):
        wrapped(torch.randn(2, 4))
    torch._dynamo.reset()


def test_module_compile_after_fxshard_compile_keeps_fxshards_graph(no_dist, monkeypatch):
    """model.compile(), as FSDP2 users call it after fully_shard, would swap
    fxshard's compiled call for a plain compile of the model: it warns and
    does nothing, and fxshard's own graph runs."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = fxshard.compile(nn.Linear(4, 3), backend="aot_eager")
    with pytest.warns(UserWarning, match="does nothing"):
        model.compile(backend="aot_eager")
    model(torch.randn(2, 4)).sum().backward()
    assert len(model.fxshard_plan.graphs) == 1 and not model.fxshard_plan.sequenced
    torch._dynamo.reset()
