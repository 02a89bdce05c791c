"""Who holds the memory at a step's peak: the CUDA caching allocator's trace
of one step, replayed to its highest point.

``start()`` turns on torch's allocator history (Python stacks, allocations
only); ``summary(base)`` replays the trace, finds the event at which the
allocated bytes were highest, and groups the blocks alive there by where they
were allocated: the innermost frame in generated Inductor code, fxshard,
FSDP2, the optimizer, or this benchmark. Blocks allocated before ``start()``
(shards, optimizer state) are one line, ``before the step``.
"""

from __future__ import annotations

import linecache
import os

import torch

# Frames worth naming a block after, innermost first.
_NAMED = ("torchinductor", "/fxshard/", "_fully_shard", "/bench/", "/examples/", "/torch/optim/")


def start() -> int:
    """Record the allocator's history from now; returns the bytes already allocated."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python", max_entries=2_000_000)
    return base


def _where(frames: list[dict]) -> tuple[str, str]:
    """(file, file:line source) of the first frame in _NAMED, else of the innermost."""
    chosen = next((f for f in frames if any(k in f["filename"] for k in _NAMED)), frames[0] if frames else None)
    if chosen is None:
        return "no Python frame", "no Python frame (autograd engine or C++)"
    name = os.path.basename(chosen["filename"])
    source = linecache.getline(chosen["filename"], chosen["line"]).strip()
    return name, f"{name}:{chosen['line']} {chosen['name']}: {source[:110]}"


def _group(blocks: list[dict], key: int, top: int) -> list[dict]:
    sums: dict[str, list] = {}
    for block in blocks:
        where = _where(block.get("frames", []))[key]
        entry = sums.setdefault(where, [0, 0])
        entry[0] += block["size"]
        entry[1] += 1
    ranked = sorted(sums.items(), key=lambda kv: -kv[1][0])[:top]
    return [dict(where=w, gib=round(n / 2**30, 4), blocks=c) for w, (n, c) in ranked]


def summary(base: int, top: int = 25) -> dict:
    """Stop recording; the blocks alive at the recorded peak, grouped by source line and by file."""
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return replay(snapshot["device_traces"][torch.cuda.current_device()], base, top)


def replay(events: list[dict], base: int, top: int = 25) -> dict:
    """The blocks alive at the highest point of a trace that starts with ``base`` bytes allocated."""
    now, peak, peak_at = base, base, -1
    for i, event in enumerate(events):
        if event["action"] == "alloc":
            now += event["size"]
        elif event["action"] == "free_completed":
            now -= event["size"]
        if now > peak:
            peak, peak_at = now, i
    live: dict[int, dict] = {}
    for event in events[: peak_at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    blocks = list(live.values())
    traced = sum(b["size"] for b in blocks)
    return dict(
        peak_gib=peak / 2**30,
        before_step_gib=(peak - traced) / 2**30,
        events=len(events),
        peak_event=_where(events[peak_at].get("frames", []))[1] if peak_at >= 0 else "before the step",
        by_line=_group(blocks, 1, top),
        by_file=_group(blocks, 0, top),
    )


def format_summary(system: str, s: dict, lines: int = 14) -> str:
    rows = [f"{system}: peak {s['peak_gib']:.2f} GiB in the recorded step; before the step {s['before_step_gib']:.2f} GiB; "
            f"peak reached at {s['peak_event']}"]  # fmt: skip
    rows += [f"  {b['gib']:8.3f} GiB {b['blocks']:5d} blocks  {b['where']}" for b in s["by_file"][:8]]
    rows.append("  by line:")
    rows += [f"  {b['gib']:8.3f} GiB {b['blocks']:5d} blocks  {b['where']}" for b in s["by_line"][:lines]]
    return "\n".join(rows)
