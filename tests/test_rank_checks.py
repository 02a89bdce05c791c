"""Ranks that disagree fail loudly, and errors reach the user as raised.

- compile compares the ranks' parameter lists and initial values;
- before a graph first runs, the ranks compare its collectives (a branch on
  input shapes that ranks take differently raises on every rank);
- FXSHARD_CHECK_COLLECTIVES=1 compares each collective (a parameter read on
  one rank only);
- an exception of the user's forward reaches the user as raised;
- logging, warnings and prints in forward keep the model one graph (GPT-2).

The gloo checks run together, one process per rank, at world size 2.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fxshard
from fxshard.runtime.rank_checks import RankMismatchError
from tests.helpers import models, rank_check_models
from tests.helpers.distributed import check_results, run_ranks, selected
from tests.helpers.parity import run_each


def _raises_on_every_rank(fn, error_type, *matches: str) -> None:
    try:
        fn()
    except error_type as error:
        for m in matches:
            assert m in str(error), f"expected {m!r} in: {error}"
        return
    raise AssertionError(f"expected {error_type.__name__}")


def different_init(rank: int, world_size: int) -> None:
    torch.manual_seed(rank)  # the mistake: a different start on each rank
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    _raises_on_every_rank(lambda: fxshard.compile(model, backend="aot_eager"), ValueError,
                          "'0.weight'", "manual_seed")  # fmt: skip
    assert type(model[0].weight) is nn.Parameter, "a rejected model must stay unsharded"
    fxshard.compile(model, backend="aot_eager", check_same_init=False)  # the user's call


def same_init_one_changed_value(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    if rank == 1:
        with torch.no_grad():
            model[1].bias[1] += 1e-7  # one ulp-scale difference in the last parameter
    _raises_on_every_rank(lambda: fxshard.compile(model, backend="aot_eager"), ValueError, "'1.bias'")


def different_architecture(rank: int, world_size: int) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4 + rank), nn.Linear(4 + rank, 2))
    _raises_on_every_rank(lambda: fxshard.compile(model, backend="aot_eager", check_same_init=False), ValueError,
                          "different models", "0.weight (4, 4)", "0.weight (5, 4)")  # fmt: skip


def shape_branch_differs(rank: int, world_size: int) -> None:
    """Rank 0's sequences take the branch that reads ``a``, rank 1's do not:
    both raise before the first gather, naming ``a.weight``."""
    torch.manual_seed(0)
    model = fxshard.compile(rank_check_models.Branchy(), backend="aot_eager")
    x = torch.randn(2, 12 if rank == 0 else 4, 6)
    _raises_on_every_rank(lambda: model(x), RankMismatchError, "'a.weight'", "graph 0")
    assert model.fxshard_plan.units.units[0].slots is None, "no graph may have run"


def shape_branch_differs_zero1(rank: int, world_size: int) -> None:
    """ZeRO-1's graphs gather nothing but reduce in the backward: the ranks
    compare them before the first run, as at the other stages, and raise
    before pairing rank 0's ``a`` gradients with rank 1's ``b``."""
    torch.manual_seed(0)
    model = fxshard.compile(rank_check_models.Branchy(), backend="aot_eager", zero_stage=1)
    x = torch.randn(2, 12 if rank == 0 else 4, 6)
    _raises_on_every_rank(lambda: model(x).sum().backward(), RankMismatchError, "ZeRO-1's kept copy of 'a.weight'",
                          "graph 0")  # fmt: skip


def shape_branch_differs_across_replicas(rank: int, world_size: int, zero_stage: int) -> None:
    """HSDP 2 x 2: the ranks of each shard group agree, the two replicas take
    different branches; their gradients are averaged together, so the ranks
    of the whole mesh must agree."""
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = fxshard.compile(rank_check_models.Branchy(), mesh, backend="aot_eager", zero_stage=zero_stage)
    x = torch.randn(2, 12 if rank < 2 else 4, 6)
    _raises_on_every_rank(lambda: model(x).sum().backward(), RankMismatchError, "'a.weight'")


def shape_branch_same(rank: int, world_size: int) -> None:
    """Different shapes that take the same branch agree: training runs, and a
    later recompile on one rank only (same collectives) does not wait."""
    torch.manual_seed(0)
    model = fxshard.compile(rank_check_models.Branchy(), backend="aot_eager")
    for length in (12 + rank, 12 + rank, 10 if rank == 0 else 13):
        model(torch.randn(2, length, 6)).sum().backward()
    lines = {g.collectives for g in model.fxshard_plan.graphs}
    assert len(lines) == 1 and any("'a.weight'" in line for line in next(iter(lines))), lines


def gpt2_one_graph(rank: int, world_size: int) -> None:
    """transformers logs a warning inside GPT-2's loss: one graph anyway, and
    the same training as unsharded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests.helpers.parity import Scenario, train_and_compare

    def make() -> nn.Module:
        return GPT2LMHeadModel(
            GPT2Config(
                n_layer=2,
                n_embd=32,
                n_head=2,
                vocab_size=64,
                n_positions=32,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
            )
        )  # parity: no dropout

    def batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 64, (2, 8), generator=gen)
        return {"input_ids": ids, "labels": ids}

    scenario = Scenario(make_model=make, make_batch=batch, loss=lambda out, b: out.loss,
                        compile_kwargs=dict(backend="aot_eager"), steps=2, sequenced=False)  # fmt: skip
    model = train_and_compare(rank, world_size, scenario)["model"]
    assert model.fxshard_plan.graph_break_reason is None


GLOO_CHECKS = {f.__name__: f for f in (different_init, same_init_one_changed_value, different_architecture,
                                       shape_branch_differs, shape_branch_differs_zero1, shape_branch_same,
                                       gpt2_one_graph)}  # fmt: skip


def run_checks(rank: int, world_size: int, names: list[str]) -> dict[str, str | None]:
    return run_each(rank, world_size, names, lambda r, ws, name: GLOO_CHECKS[name](r, ws))


@pytest.fixture(scope="module")
def gloo_run(request):
    names = [n for n in selected(request, "check") if n != "gpt2_one_graph" or _has_transformers()]
    results = run_ranks(2, run_checks, names, timeout=600)
    check_results(results)
    return results


def _has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


# CPU time: GPT-2 (transformers' warning_once in its loss, and its training) runs under [Note: full_cpu];
# test_logging_warnings_and_prints_keep_one_graph and test_transformers_warning_once_keeps_one_graph
# check that logging, warning_once included, keeps one graph.
@pytest.mark.parametrize(
    "check", [pytest.param(n, marks=pytest.mark.full_cpu) if n == "gpt2_one_graph" else n for n in GLOO_CHECKS]
)
def test_ranks_that_disagree(gloo_run, check):
    if check not in gloo_run[0]:
        pytest.skip("needs transformers")
    failures = [f"rank {r}:\n{res[check]}" for r, res in enumerate(gloo_run) if res[check] is not None]
    assert not failures, "\n".join(failures)


def replicas_disagree(rank: int, world_size: int) -> None:
    for zero_stage in (3, 1):
        shape_branch_differs_across_replicas(rank, world_size, zero_stage)
        torch._dynamo.reset()


def test_hsdp_replicas_that_disagree():
    check_results(run_ranks(4, replicas_disagree, timeout=300))


def read_on_one_rank(rank: int, world_size: int) -> None:
    """Rank 0 reads a weight outside forward, rank 1 does not: with the
    debug check on, both raise before the mismatched collectives."""
    os.environ["FXSHARD_CHECK_COLLECTIVES"] = "1"
    torch.manual_seed(0)
    model = fxshard.compile(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)), backend="aot_eager")
    model(torch.randn(3, 4)).sum().backward()

    def next_step() -> None:
        if rank == 0:
            model[1].weight  # noqa: B018 - the read is a collective
        model(torch.randn(3, 4)).sum().backward()

    _raises_on_every_rank(next_step, RankMismatchError, "'1.weight'", "rank 0: all-gather of '1.weight'",
                          "rank 1: all-gather of unit 0")  # fmt: skip


def test_debug_check_names_a_read_on_one_rank():
    check_results(run_ranks(2, read_on_one_rank, timeout=300))


def step_skipped_on_one_rank(rank: int, world_size: int) -> dict:
    """Rank 1 stops a step early (and leaves): with the debug check on, rank 0
    raises naming its collective and the likely cause, instead of gloo's
    "Connection closed by peer" from inside a gather."""
    os.environ["FXSHARD_CHECK_COLLECTIVES"] = "1"
    torch.manual_seed(0)
    model = fxshard.compile(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)), backend="aot_eager")
    model(torch.randn(3, 4)).sum().backward()
    if rank == 1:
        dist.destroy_process_group()
        return {}
    _raises_on_every_rank(lambda: model(torch.randn(3, 4)).sum().backward(), RankMismatchError,
                          "rank 0 was about to issue all-gather of unit 0", "a step skipped on some ranks")  # fmt: skip
    return {}


def test_debug_check_names_a_step_skipped_on_one_rank():
    check_results(run_ranks(2, step_skipped_on_one_rank, timeout=300))


def tp_read_on_one_dp_index(rank: int, world_size: int) -> None:
    """FSDP + TP at (dp 2, tp 2) with the debug check on: steps train, each
    of fxshard's collectives checked on its data-parallel group, while the
    ranks of a TP group hold different pieces (the check compares what each
    rank is about to issue, not what it holds). Then the ranks at dp index 0
    read ``d.weight``, which TP leaves plain, outside forward (a gather over
    dp; a TP weight read there is its shard, no collective, as under FSDP2),
    those at dp index 1 do not: every rank raises before its data-parallel
    group pairs the reads."""
    from tests.helpers.tp_models import OddMLP, parallelize

    os.environ["FXSHARD_CHECK_COLLECTIVES"] = "1"
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = fxshard.compile(parallelize(OddMLP(), mesh["tp"]), mesh["dp"], backend="aot_eager", unit_mb=1e-4)
    for _ in range(2):
        model(torch.randn(3, 6)).sum().backward()

    def next_step() -> None:
        if mesh.get_local_rank("dp") == 0:
            model.d.weight  # noqa: B018 - the read is a collective over dp
        model(torch.randn(3, 6)).sum().backward()

    _raises_on_every_rank(next_step, RankMismatchError, "all-gather of 'd.weight'", "all-gather of unit 0")


def test_debug_check_with_tensor_parallelism():
    check_results(run_ranks(4, tp_read_on_one_dp_index, timeout=300))


# Single process (a fake 4-rank group): how the first call reads, and errors.


@pytest.mark.parametrize("first_call_ok", [True, False])
def test_user_errors_propagate_as_raised(fake_pg, first_call_ok):
    model = fxshard.compile(rank_check_models.Raises(), backend="aot_eager")
    if first_call_ok:
        model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(KeyError, match="boom"):
        model(torch.randn(3, 4))
    with pytest.raises(AssertionError, match="batch of 5"):
        model(torch.randn(5, 4))
    with pytest.raises(RuntimeError, match=r"mat1 and mat2 shapes cannot be multiplied") as info:
        model(torch.randn(2, 7))
    assert type(info.value) is RuntimeError  # torch's own error, not dynamo's wrapper
    model(torch.randn(2, 4)).sum().backward()  # errors do not change how the model reads
    assert model.fxshard_plan.sequenced is False
    assert model.fxshard_plan.graph_break_reason is None


def test_logging_warnings_and_prints_keep_one_graph(fake_pg):
    import torch._dynamo.config as dynamo_config

    before = set(dynamo_config.reorderable_logging_functions)
    model = fxshard.compile(rank_check_models.Chatty(), backend="aot_eager")
    model(torch.randn(2, 4)).sum().backward()
    assert model.fxshard_plan.sequenced is False and len(model.fxshard_plan.graphs) == 1
    assert set(dynamo_config.reorderable_logging_functions) == before, "dynamo's config is fxshard's only in its calls"


def test_transformers_warning_once_keeps_one_graph(fake_pg):
    pytest.importorskip("transformers")  # it adds Logger.warning_once
    model = fxshard.compile(rank_check_models.ChattyOnce(), backend="aot_eager")
    model(torch.randn(2, 4)).sum().backward()
    assert model.fxshard_plan.sequenced is False and len(model.fxshard_plan.graphs) == 1


def test_graph_break_reason_in_plan_and_summary(fake_pg, tmp_path):
    model = fxshard.compile(models.GraphBreaks(), backend="aot_eager", debug_dir=tmp_path)
    model(torch.randn(4, 6)).sum().backward()
    plan = model.fxshard_plan
    assert plan.sequenced and plan.graph_break_reason, plan.graph_break_reason
    assert "Data-dependent" in plan.graph_break_reason or "data" in plan.graph_break_reason.lower()
    summary = (tmp_path / "rank0" / "graph0" / "summary.txt").read_text()
    assert "sequenced reads" in summary and plan.graph_break_reason in summary


def hsdp_read_on_one_replica(rank: int, world_size: int) -> None:
    """HSDP 2 x 2 with the debug check on: a step trains, checking every
    average across replicas against the replicate group (see [Note: HSDP]).
    Then the ranks of replica 0 add a loss term on a weight read outside
    forward, replica 1's do not: inside each replica the ranks agree, but
    the replicas are about to average different gradients, and every rank
    raises before they pair."""
    os.environ["FXSHARD_CHECK_COLLECTIVES"] = "1"
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = fxshard.compile(nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2)), mesh, backend="aot_eager")
    model(torch.randn(3, 4)).sum().backward()

    def next_step() -> None:
        loss = model(torch.randn(3, 4)).sum()
        if mesh.get_local_rank("replicate") == 0:
            loss = loss + model[1].weight.sum()  # a gather, and its gradient's reduce
        loss.backward()

    _raises_on_every_rank(next_step, RankMismatchError, "all-reduce over 2 replicas of the gradient of '1.weight'",
                          "all-reduce over 2 replicas of unit 0's gradients")  # fmt: skip


def test_debug_check_sees_the_averages_across_replicas():
    check_results(run_ranks(4, hsdp_read_on_one_replica, timeout=300))


def test_a_failed_case_prints_its_traceback_at_once(capsys):
    """A gate cut off by its time limit reports no results: the cause of a
    failure on one rank (the others then wait in a collective) must already
    be on stderr."""

    def run(rank, world_size, name):
        if name == "bad":
            raise ValueError("the cause, on this rank only")

    results = run_each(3, 4, ["good", "bad"], run)
    err = capsys.readouterr().err
    assert results["good"] is None and "the cause" in results["bad"]
    assert "[rank 3/4] bad FAILED" in err
    assert "[rank 3/4]   ValueError: the cause, on this rank only" in err
    assert "good FAILED" not in err
