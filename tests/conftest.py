import pytest
import torch
import torch.distributed as dist


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
