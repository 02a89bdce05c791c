import os

import pytest
import torch
import torch.distributed as dist

# [Note: full_cpu]
# Tests marked ``full_cpu`` are slower CPU variants of checks that the default
# run already makes (another world size, Inductor on a flat graph, more models
# or seeds). The suite has a 10-minute budget on 2 CPU cores, so the default
# run deselects them (not skips: the summary counts them as deselected and says
# how to run them). FXSHARD_FULL_CPU=1 adds them; ``-m full_cpu`` runs only
# them. Fixtures that run many cases in one set of ranks run the selected
# cases only (tests.helpers.distributed.selected).
_FULL_CPU_DESELECTED = pytest.StashKey[int]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("FXSHARD_FULL_CPU") or "full_cpu" in config.getoption("markexpr"):
        return
    slower = [item for item in items if item.get_closest_marker("full_cpu")]
    if slower:
        items[:] = [item for item in items if not item.get_closest_marker("full_cpu")]
        config.hook.pytest_deselected(items=slower)
    config.stash[_FULL_CPU_DESELECTED] = len(slower)


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    n = config.stash.get(_FULL_CPU_DESELECTED, 0)
    # Under pytest-xdist the workers deselect; the controller, which prints, has no count.
    distributed = config.pluginmanager.hasplugin("dsession") and not os.environ.get("FXSHARD_FULL_CPU")
    if n:
        terminalreporter.write_line(
            f"{n} deselected: slower CPU variants (marker full_cpu); "
            "FXSHARD_FULL_CPU=1 adds them, -m full_cpu runs only them"
        )
    elif distributed and "full_cpu" not in config.getoption("markexpr"):
        terminalreporter.write_line(
            "Slower CPU variants (marker full_cpu) do not run by default; "
            "FXSHARD_FULL_CPU=1 adds them, -m full_cpu runs only them"
        )


def _reset() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    torch._dynamo.reset()


@pytest.fixture
def no_dist():
    """No process group before or after the test."""
    _reset()
    yield
    _reset()


@pytest.fixture
def fake_pg():
    """A 4-rank fake process group (this process is rank 0): collectives are
    traced and run with the right shapes but move no data."""
    from fxshard.runtime.compat import fake_store

    _reset()
    dist.init_process_group("fake", store=fake_store(), rank=0, world_size=4)
    yield 4
    _reset()
