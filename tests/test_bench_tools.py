"""The benchmark's memory trace: the replay that finds what is alive at a step's peak."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import memtrace  # noqa: E402


def _frame(line: int, file: str = "/tmp/torchinductor_root/ab/cabc.py") -> list[dict]:
    return [{"filename": file, "line": line, "name": "call"}]


def test_replay_finds_the_blocks_alive_at_the_peak():
    events = [
        dict(action="alloc", addr=1, size=100, frames=_frame(10)),
        dict(action="alloc", addr=2, size=50, frames=_frame(11)),
        dict(action="free_requested", addr=1, size=100),  # not freed until completed
        dict(action="alloc", addr=3, size=30, frames=_frame(12, "/x/fxshard/runtime/units.py")),
        dict(action="free_completed", addr=1, size=100),
        dict(action="free_completed", addr=9, size=500),  # allocated before the trace began
        dict(action="alloc", addr=4, size=60, frames=[]),
    ]
    summary = memtrace.replay(events, base=1000)
    assert summary["peak_gib"] * 2**30 == 1180  # 1000 + 100 + 50 + 30
    assert summary["before_step_gib"] * 2**30 == 1000
    by_file = {b["where"]: b["blocks"] for b in summary["by_file"]}
    assert by_file == {"cabc.py": 2, "units.py": 1}
    assert summary["peak_event"].startswith("units.py:12 call")
