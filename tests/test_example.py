"""The example trains under torchrun, as the README runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


# CPU time: the example's default compiler, Inductor, compiles its C++ kernels for about a minute on
# 2 cores; it runs under [Note: full_cpu]. tests/test_parity.py's mixed_precision_bf16_inductor trains
# the example's Llama under Inductor (outlined layers, small units) against the unsharded reference.
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.full_cpu)])
def test_train_llama_under_torchrun_loss_goes_down(backend):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "train_llama.py"), "--steps", "25", "--backend", backend,
           "--unit-mb", "0.05", "--prefetch", "2"]  # fmt: skip  # small units, two gathers in flight on gloo
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    steps = re.findall(r"step +(\d+) +loss ([\d.]+) +(\d+) tokens/s +peak +([\d.]+) MiB", proc.stdout)
    assert len(steps) == 25, proc.stdout
    losses = [float(s[1]) for s in steps]
    assert sum(losses[-3:]) < 0.7 * sum(losses[:3]), losses
    assert all(float(s[3]) > 0 and int(s[2]) > 0 for s in steps)
    assert "(down)" in proc.stdout
