"""Checkpoints of a compiled model behave as in plain PyTorch (gloo, CPU).

One 2-rank run saves: ``torch.save`` of the sharded state dict before and
after steps (and resuming from it), loading a full unsharded state dict, a
full export with ``get_model_state_dict``, and a DCP checkpoint of the model
and its AdamW state. Runs at 3 ranks and at 1 then load that checkpoint,
check the weights and optimizer state, and continue training: it must match
the 2-rank run's own continuation. An HSDP checkpoint (4 ranks as 2 x 2)
loads at 1 x 4 and 4 x 1.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import models
from tests.helpers.checkpoint_checks import dcp_resume, hsdp_reshapes, two_rank_checks
from tests.helpers.distributed import check_results, run_ranks


def test_hsdp_checkpoint_loads_at_other_mesh_shapes(tmp_path):
    check_results(run_ranks(4, hsdp_reshapes, str(tmp_path), timeout=300))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dcp"))
    results = run_ranks(2, two_rank_checks, path, timeout=300)
    check_results(results)
    return path, results


@pytest.mark.parametrize("check", ["torch_save", "full_load", "full_export", "another_ranks_file"])
def test_two_ranks(two_ranks, check):
    _, results = two_ranks
    failures = [f"rank {r}:\n{res[check]}" for r, res in enumerate(results) if res[check] is not None]
    assert not failures, "\n".join(failures)


# World size 3 reshards 2 ranks' uneven and empty shards; world size 1 runs
# Inductor (this file's one C++ compile).
# Resuming at 1 under Inductor also runs on the GPU gate (test_nccl_checkpoint_round_trip).
@pytest.mark.parametrize("world_size,backend", [(3, "aot_eager"), pytest.param(1, "inductor", marks=pytest.mark.full_cpu)],
                         ids=["ws3", "ws1-inductor"])  # fmt: skip
def test_dcp_checkpoint_resumes_at_another_world_size(two_ranks, world_size, backend):
    path, results = two_ranks
    saved = results[0]["dcp_saved"]
    check_results(run_ranks(world_size, dcp_resume, path, saved, backend, timeout=300))


def test_example_saves_resumes_and_exports(tmp_path):
    """examples/checkpoint.py under torchrun, as its docstring runs it."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(root / "examples" / "checkpoint.py"), "--dir", str(tmp_path / "ckpt"), "--backend", "eager"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=root, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    assert [int(s) for s in re.findall(r"^step (\d+)  loss", proc.stdout, re.M)] == list(range(6)), proc.stdout
    assert "resumed" in proc.stdout and "exported" in proc.stdout
    full = torch.load(tmp_path / "ckpt" / "full.pt")
    models.TinyLlama().load_state_dict(full)
