"""Run many zoo architectures (tests/zoo.py) against the unsharded reference.

    PYTHONPATH=. python bench/scripts/zoo_survey.py --seeds 0-199 --backend aot_eager --world-size 2 \\
        --out docs/zoo/survey.txt [--chunk 50] [--no-blocks-once]

Seeds run in chunks, each chunk inside one set of gloo ranks. Each rank logs
a JSON line per seed as it finishes; a chunk that hangs or dies is killed,
the seed it was in is recorded as hung, and the survey goes on from the
next seed. Appends one line per seed to ``--out``:

    <backend> ws<N> seed <s> PASS|FAIL <seconds> s | <architecture>
        <first lines of the failure>

``--no-blocks-once`` compiles with ``compile_blocks_once=False``: not the
default, for telling failures of outlined blocks from the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from tests.distributed import run_ranks
from tests.zoo import parse_seeds, plan, run_seeds


def _logged(log_dir: str, world_size: int) -> dict[int, list[dict]]:
    """Per seed, the line of each rank that finished it."""
    seen: dict[int, list[dict]] = {}
    for rank in range(world_size):
        path = os.path.join(log_dir, f"rank{rank}.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    entry = json.loads(line)
                    seen.setdefault(entry["seed"], []).append(entry)
    return seen


def _run_chunk(seeds: list[int], args: argparse.Namespace, log_dir: str) -> str | None:
    """Run ``seeds`` in one set of ranks; None, or why the ranks died."""
    kwargs = dict(compile_blocks_once=False) if args.no_blocks_once else {}
    try:
        run_ranks(args.world_size, run_seeds, seeds, args.backend, log_dir, kwargs, timeout=args.timeout)
    except Exception as error:  # a hang (TimeoutError) or a rank that died
        return f"{type(error).__name__}: {error}"
    return None


def _summary_line(seed: int, entries: list[dict], args: argparse.Namespace, died: str | None) -> str:
    errors = [f"rank {e['rank']}: {e['error']}" for e in entries if e["error"]]
    if len(entries) < args.world_size:
        errors.append(f"hung or died before finishing this seed ({died})")
    seconds = max((e["seconds"] for e in entries), default=float("nan"))
    head = f"{args.backend} ws{args.world_size} seed {seed} {'FAIL' if errors else 'PASS'} {seconds:.1f} s | " \
           f"{plan(seed).describe()}"  # fmt: skip
    detail = "".join(f"\n    {line}" for e in errors for line in e.strip().splitlines()[-args.lines :])
    return head + detail


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", default="200", help='"200" (0..199), "5-9" or "1,4,7"')
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--chunk", type=int, default=50, help="seeds per set of ranks")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per chunk")
    parser.add_argument("--lines", type=int, default=12, help="lines of each failure to keep")
    parser.add_argument("--no-blocks-once", action="store_true")
    args = parser.parse_args()
    todo = parse_seeds(args.seeds)
    counts = {"PASS": 0, "FAIL": 0}
    start = time.perf_counter()
    while todo:
        chunk = todo[: args.chunk]
        with tempfile.TemporaryDirectory() as log_dir:
            died = _run_chunk(chunk, args, log_dir)
            seen = _logged(log_dir, args.world_size)
        # Seeds every rank finished, then the one a hang or crash stopped in.
        done = [s for s in chunk if s in seen and len(seen[s]) == args.world_size]
        if died:
            done += [s for s in chunk if s not in done][:1]
        with open(args.out, "a") as out:
            for seed in done:
                line = _summary_line(seed, seen.get(seed, []), args, died)
                counts[line.split(" | ")[0].split()[4]] += 1
                out.write(line + "\n")
                print(line, flush=True)
        todo = todo[len(done) :] if done else todo[1:]
    print(f"{args.backend} ws{args.world_size}: {counts['PASS'] + counts['FAIL']} seeds, {counts['FAIL']} failed, "
          f"{time.perf_counter() - start:.0f} s", file=sys.stderr)  # fmt: skip


if __name__ == "__main__":
    main()
