"""Parameters stay the user's after compile: writes, meta-device init,
conversions and optimizers (see [Note: writes to gathered parameters])."""

from __future__ import annotations

import pytest

from tests.helpers.distributed import check_results, run_ranks
from tests.helpers.param_checks import run_checks


# CPU time on 2 cores: world sizes 1 and 3 run on the GPUs (1) and under
# [Note: full_cpu]; 2 and 4 always (uneven rows at 2, an empty shard at 4).
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.full_cpu)])
def test_writes_optimizers_and_conversions(world_size):
    names = [
        "writes",
        "reinit",
        "reassign",
        "structure",
        "state_dict_aliases_meta",  # built on the CPU instead: test_state_dict_aliases_without_meta_init
        "init_through_shards",
        "identical_rows",
        "outer_compile",
        "optimizer_before_compile",
        "conversions",
        "writes_zero1",
        "held_values",
        "held_values_zero1",
        "storage_swaps",
        "swap_load",
        "empty_then_stepped",
        "freeze_through_attribute",
        "zero1_fused_step",
        "grads_through_attribute",
        "loss_outside_forward",
    ]
    check_results(run_ranks(world_size, run_checks, names))


@pytest.mark.full_cpu  # CPU time: a model built on the CPU keeps its shards' memory as one built on meta does
@pytest.mark.parametrize("world_size", [2, 3])
def test_state_dict_aliases_without_meta_init(world_size):
    check_results(run_ranks(world_size, run_checks, ["state_dict_aliases_not_meta"]))


@pytest.mark.full_cpu  # CPU time: ZeRO-1 reads module.weight outside a call as ZeRO-3 does
def test_gradients_through_attributes_at_zero1():
    check_results(run_ranks(2, run_checks, ["grads_through_attribute_zero1", "loss_outside_forward_zero1"]))


# CPU time: Inductor's compiles; the user's compile of a whole step traces
# the optimizer's step over DTensors (20 s on 2 cores). The GPU gate runs both.
@pytest.mark.full_cpu
def test_outer_compiles():
    check_results(run_ranks(2, run_checks, ["outer_compile_inductor", "compiled_step"]))


@pytest.mark.parametrize(
    "world_size", [pytest.param(1, marks=pytest.mark.full_cpu), 2, pytest.param(3, marks=pytest.mark.full_cpu), 4]
)
def test_meta_device_init(world_size):
    names = ["meta_init_trains"] if world_size == 2 else ["meta_init"]
    check_results(run_ranks(world_size, run_checks, names))


@pytest.mark.full_cpu  # CPU time: ZeRO-1's copies are gathered from the initialized shards as after any write
def test_meta_device_init_trains_at_zero1():
    check_results(run_ranks(2, run_checks, ["meta_init_trains_zero1"]))
