"""The benchmark matrix: the paths users run, against FSDP2 + compile and a baseline commit.

    python bench/matrix.py --baseline c3006dc --out bench/results/matrix.json
    python bench/matrix.py --rows '375m*,moe*' --baseline c3006dc --out matrix.json   # a subset (fnmatch)
    python bench/matrix.py --rows 'moe*' --repeat 3 --baseline c3006dc               # medians of 3 interleaved runs
    python bench/matrix.py --rows '8b b1,8b b1 tp2' --nproc-per-node 4 --out tp.json  # (dp 4) and (dp 2, tp 2)
    python bench/matrix.py --list                                                   # the rows
    python bench/matrix.py --table bench/results/matrix-4xh200.json --readme README.md --table-name 4xh200
    python bench/matrix.py --merge a.json b.json --out bench/results/matrix.json     # runs of several calls (a row's
                                                                                    # latest run wins)

Each row is one model, batch, optimizer and strategy (``ROWS``). For each row,
each system runs in its own ``torchrun`` process (bench/bench.py
``--only-system``), one after the other:
- ``fsdp2_compile``: FSDP2 with each block compiled, the same strategy and optimizer;
- ``fxshard``: this tree (a CUDA-graph row: ``fxshard``, the step uncaptured, and
  ``fxshard_graph_none``, the same step captured, ``zero_grad()`` inside it as
  docs/cuda-graphs.md recommends; rows of older runs hold ``fxshard_capturable``
  and ``fxshard_graph``, whose steps zero gradients with ``set_to_none=False``);
- ``fxshard@REF``: fxshard at ``--baseline`` (a git ref, or a folder holding its
  ``fxshard/``), on this tree's models, data and step code, so that a
  regression shows up as a number.
A row with ``tp`` (bench.py ``--tp``) runs every system on a (dp, tp) mesh
with the model's TP plan (torchtitan's Llama plan, sequence parallelism on):
FSDP2 + compile with the same plan is the baseline. A row with ``ep``
(bench.py ``--ep``) runs torchtitan's MoE model with its expert-parallel
setup for every system; the baseline is torchtitan's FSDP2 + EP. Rows that need more GPUs
than there are (HSDP 2 x 2 needs 4) are listed as skipped. The JSON keeps
every result; the markdown table gives step time, peak allocated and
reserved memory, TFLOP/s per GPU with the MFU against 790 (a measured bf16
GEMM on an H100/H200) and 989 (the datasheet), and each ratio against its
target (``TARGETS``).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ROOT / ".bench-trees"  # baseline commits' fxshard/, extracted by git archive (ignored by git)
GEMM_PEAK, DATASHEET_PEAK = 790.0, 989.0  # bf16 TFLOP/s of one H100/H200: measured GEMM, datasheet


@dataclasses.dataclass(frozen=True)
class Row:
    name: str
    model: str
    batch: int
    optimizer: str = "adamw"  # torch's default AdamW: what users build
    strategy: str = "zero3"
    mesh: str | None = None  # "R,S": HSDP
    tp: int = 1  # >1: a (dp, tp) mesh, the model's TP plan for every system (bench.py --tp)
    loss_parallel: bool = False  # with tp: vocab-sharded logits into the loss (bench.py --loss-parallel)
    ep: int = 1  # >1: experts sharded over an ep mesh dimension, torchtitan's EP setup for every system (bench.py --ep)
    frozen_layers: int = 0
    micro_batches: int = 0
    graph: bool = False  # the whole step in fxshard.cuda_graph
    gpus: int = 2  # the fewest GPUs the row means anything on

    def flags(self) -> list[str]:
        flags = [f"--model={self.model}", f"--batch={self.batch}", f"--optimizer={self.optimizer}",
                 f"--strategy={self.strategy}"]  # fmt: skip
        for key in ("mesh", "frozen_layers", "micro_batches"):
            if getattr(self, key):
                flags.append(f"--{key.replace('_', '-')}={getattr(self, key)}")
        if self.tp > 1:
            flags.append(f"--tp={self.tp}")
        if self.loss_parallel:
            flags.append("--loss-parallel")
        if self.ep > 1:
            flags.append(f"--ep={self.ep}")
        if self.graph:  # a captured step's AdamW is capturable: give every system the same one
            flags.append("--capturable")
        return flags

    def systems(self) -> list[str]:
        """This tree's systems, FSDP2's first (the baseline commit's are added by ``run_row``)."""
        return ["fsdp2_compile", "fxshard", "fxshard_graph_none"] if self.graph else ["fsdp2_compile", "fxshard"]


def graph_keys(results: dict) -> tuple[str, str]:
    """A CUDA-graph row's (captured, uncaptured) systems: this tree's, or an older run's."""
    if "fxshard_graph" in results or "fxshard_capturable" in results:
        return "fxshard_graph", "fxshard_capturable"
    return "fxshard_graph_none", "fxshard"


ROWS = [
    # Models, torch's default AdamW, ZeRO-3.
    *(Row(f"{m} b{b}", m, b) for m in ("375m", "1b", "8b") for b in (1, 4)),
    Row("moe b2", "moe", 2),
    Row("hybrid b2", "hybrid", 2),
    # torchtitan's own model code at its own flavours; FSDP2 + compile is torchtitan's setup.
    Row("tt_llama3_1b b2", "tt_llama3_1b", 2),
    Row("tt_qwen3_moe b4", "tt_qwen3_moe", 4),
    Row("tt_dsv3 b4", "tt_dsv3", 4),
    # Optimizers.
    Row("1b b4 adamw_fused", "1b", 4, optimizer="adamw_fused"),
    Row("1b b4 sgd", "1b", 4, optimizer="sgd"),
    Row("moe b2 adamw_fused", "moe", 2, optimizer="adamw_fused"),
    # Strategies.
    Row("1b b4 zero2", "1b", 4, strategy="zero2"),
    Row("1b b4 zero1", "1b", 4, strategy="zero1"),
    Row("1b b4 hsdp 2x2", "1b", 4, mesh="2,2", gpus=4),
    Row("1b b4 frozen tower replicated", "1b", 4, frozen_layers=8),
    Row("1b b4 frozen tower sharded", "1b", 4, frozen_layers=8, strategy="shard_frozen"),
    Row("1b b4 accum4 sync each", "1b", 4, micro_batches=4),
    Row("1b b4 accum4 no sync", "1b", 4, micro_batches=4, strategy="no_sync"),
    # Tensor parallelism (issue 29), torchtitan's Llama plan with sequence parallelism; the batch is per
    # data-parallel rank. 2 GPUs: (dp 1, tp 2); 4: (dp 2, tp 2), beside "8b b1" at dp 4.
    Row("1b b4 tp2", "1b", 4, tp=2),
    Row("1b b4 tp2 loss parallel", "1b", 4, tp=2, loss_parallel=True),  # torchtitan's default
    Row("8b b1 tp2", "8b", 1, tp=2, gpus=4),
    # Expert parallelism (issue 29): torchtitan's Qwen3-MoE code at 1.4B, its EP setup; FSDP2 + compile is
    # torchtitan's (EP, each block compiled, experts' FSDP over efsdp). 4 GPUs: (efsdp 2, ep 2); 2: (1, 2).
    Row("tt_qwen3_moe_1b b2", "tt_qwen3_moe_1b", 2),
    Row("tt_qwen3_moe_1b b2 ep2", "tt_qwen3_moe_1b", 2, ep=2),
    # CUDA graphs: the captured step against the same step uncaptured.
    Row("375m b1 graph", "375m", 1, graph=True),
    Row("1b b4 graph", "1b", 4, graph=True),
    Row("moe b2 graph", "moe", 2, graph=True),
    Row("8b b1 graph", "8b", 1, graph=True),
]
# fxshard's step time over FSDP2 + compile's, at most (MoE: 0.6); peak allocated memory at most 1.0x.
TARGETS = {"time": 0.9, "moe_time": 0.6, "memory": 1.0, "graph_time": 1.0, "graph_reserved": 1.05}


def baseline_tree(ref: str) -> tuple[Path, str]:
    """The folder holding ``fxshard/`` at ``ref`` (extracted once), and its commit."""
    if (Path(ref) / "fxshard").is_dir():
        path = Path(ref)
    else:
        path = TREES / ref
        if not (path / "fxshard").is_dir():
            commit = git("rev-parse", f"{ref}^{{commit}}")
            path.mkdir(parents=True, exist_ok=True)
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "fxshard"], check=True,
                                     capture_output=True).stdout  # fmt: skip
            subprocess.run(["tar", "-x", "-C", str(path)], input=archive, check=True)
            (path / "COMMIT").write_text(commit + "\n")
    commit_file = path / "COMMIT"
    return path, commit_file.read_text().strip() if commit_file.exists() else str(path)


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True).stdout.strip()


def this_commit() -> str:
    """HEAD, or FXSHARD_COMMIT where set (a copy of the tree whose .git is not its own)."""
    if os.environ.get("FXSHARD_COMMIT"):
        return os.environ["FXSHARD_COMMIT"]
    try:
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", "fxshard", "bench", "examples")
        return git("rev-parse", "HEAD") + ("+changes" if dirty else "")
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"


def run_system(row: Row, system: str, tree: Path | None, nproc: int, timeout: float, out: Path) -> dict:
    """One system of one row in its own torchrun; its result, or the failure."""
    sys.path.insert(0, str(ROOT / "bench"))
    import bench

    flags = [*row.flags(), f"--only-system={system}", f"--out={out}", f"--device={DEVICE}"]
    if PROFILE:
        flags.append(f"--profile={PROFILE}")
        if PROFILE_HOST:
            flags.append("--profile-host")
    if MEMORY_STEP is not None:
        flags.append(f"--memory-step={MEMORY_STEP}")
    if tree is not None:
        flags.append(f"--fxshard-tree={tree}")
    command = [*bench.torchrun(nproc), str(ROOT / "bench" / "bench.py"), *flags]
    print(f"== {row.name}: {system}{' @ ' + str(tree) if tree else ''}", flush=True)
    start = time.monotonic()
    status = bench.run_child(command, timeout)
    wall_s = round(time.monotonic() - start, 1)  # the process's whole life, compile included: for planning calls
    print(f"== {row.name}: {system} took {wall_s} s", flush=True)
    if status == 0 and out.exists():
        child = json.loads(out.read_text())
        return {"meta": child["meta"], **child["results"][0], "wall_s": wall_s}
    return {"failed": "timed out" if status == 124 else f"exit status {status}", "wall_s": wall_s}


def run_row(
    row: Row, baselines: list[tuple[Path, str]], nproc: int, timeout: float, tmp: Path, repeat: int = 1
) -> dict:
    """Each system of ``row`` in its own process, ``repeat`` times
    interleaved (all systems once, then again): a system's result is its run
    with the median step time, and ``step_ms_runs`` holds every run's."""
    systems = [(s, None, s) for s in row.systems()]
    ours = row.systems()[-1]
    systems += [(ours, path, f"{ours}@{commit[:7]}") for path, commit in baselines]
    runs: dict[str, list[dict]] = {label: [] for _, _, label in systems}
    for r in range(repeat):
        for i, (system, tree, label) in enumerate(systems):
            out = tmp / f"{row.name}-{i}-{r}.json".replace(" ", "_")
            runs[label].append(run_system(row, system, tree, nproc, timeout, out))
    return {"row": dataclasses.asdict(row), "results": {label: _median_run(rs) for label, rs in runs.items()}}


def _median_run(runs: list[dict]) -> dict:
    done = sorted((r for r in runs if "failed" not in r), key=lambda r: r["step_ms"])
    if not done:
        return runs[0]
    chosen = dict(done[(len(done) - 1) // 2])  # the lower median: a real run, not an average of two
    if len(runs) > 1:
        chosen["step_ms_runs"] = [r.get("step_ms") for r in runs]  # None where a run failed
    return chosen


def gib(r: dict, key: str) -> str:
    return f"{r[key]:.2f}" if key in r else "-"


def cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if "failed" in r:
        return f"failed ({r['failed']})"
    spread = ""
    if len(times := [t for t in r.get("step_ms_runs", ()) if t is not None]) > 1:
        spread = f" ({min(times):.1f}-{max(times):.1f} over {len(times)} runs)"
    return f"{r['step_ms']:.1f} ms{spread}, {gib(r, 'peak_gib')} / {gib(r, 'peak_reserved_gib')} GiB"


def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    if not a or not b or key not in a or key not in b or not b[key]:
        return None
    return a[key] / b[key]


def verdict(row: dict) -> tuple[list[str], list[str]]:
    """The ratios of fxshard's result against FSDP2 + compile (and, for a
    CUDA-graph row, against the same step uncaptured), and the targets missed."""
    r, spec = row["results"], row["row"]
    captured, uncaptured = graph_keys(r) if spec["graph"] else ("fxshard", None)
    ours = r.get(captured)
    fsdp2 = r.get("fsdp2_compile")
    shown, missed = [], []
    target = TARGETS["moe_time"] if spec["model"].startswith("moe") else TARGETS["time"]
    checks = [("time", ratio(ours, fsdp2, "step_ms"), target), ("memory", ratio(ours, fsdp2, "peak_gib"), 1.0)]
    if spec["graph"]:
        plain = r.get(uncaptured)
        checks += [("time vs uncaptured", ratio(ours, plain, "step_ms"), TARGETS["graph_time"]),
                   ("reserved vs uncaptured", ratio(ours, plain, "peak_reserved_gib"), TARGETS["graph_reserved"])]  # fmt: skip
    for name, value, limit in checks:
        if value is None:
            continue
        shown.append(f"{name} {value:.2f}x")
        if value > limit:
            missed.append(f"{name} {value:.3f}x > {limit}x")
    return shown, missed


def merge(paths: list[str]) -> dict:
    """Several matrix runs (device calls) as one: their rows in the order of
    ``ROWS`` (rows it does not name after them, as they came), each with its
    run's commit and date; the meta of the first, with every commit. A row
    that a later run measured again takes that run's figures: the table shows
    each row's latest measurement."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    # A row keeps what it already carries (a merged file's rows ran at several commits).
    latest = {
        row["row"]["name"]: {"commit": run["meta"]["commit"], "baseline": run["meta"].get("baseline"),
                             "date": run["meta"]["date"], **row}
        for run in runs
        for row in run["rows"]
    }  # fmt: skip
    order = {row.name: i for i, row in enumerate(ROWS)}
    rows = sorted(latest.values(), key=lambda row: order.get(row["row"]["name"], len(ROWS)))  # stable
    for run in runs[1:]:
        for key in ("device", "gpus", "torch", "nccl", "alloc_conf"):
            if run["meta"].get(key) != runs[0]["meta"].get(key):
                raise SystemExit(f"{key} differs between runs ({runs[0]['meta'].get(key)}, {run['meta'].get(key)})")
    commits = list(dict.fromkeys(row["commit"][:7] for row in rows))
    dates = sorted({row["date"] for row in rows})  # the first run's date alone hid when later rows ran
    date = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    # Each run once, named by commit and file (a file name can come back from another session's call).
    merged = list(dict.fromkeys(m for p, run in zip(paths, runs)
                                for m in run["meta"].get("merged") or [f"{run['meta']['commit'][:7]}:{p}"]))  # fmt: skip
    return {"meta": {**runs[0]["meta"], "commit": ", ".join(commits), "date": date, "merged": merged}, "rows": rows}


def markdown(data: dict) -> str:
    meta = data["meta"]
    lines = [
        f"{meta.get('gpus', '?')} x {meta.get('device', '?')}, torch {meta.get('torch', '?')}, "
        f"NCCL {meta.get('nccl', '?')}"
        + (f", PYTORCH_CUDA_ALLOC_CONF={meta['alloc_conf']}" if meta.get("alloc_conf") else "")
        + f"; fxshard at {meta['commit']}, baseline fxshard at "
        f"{'each row' if meta.get('merged') else (meta.get('baseline') or '-')[:12]}; {meta['date']}. bf16 compute, fp32 reduce and master weights; "
        "each system in its own process; step time is the median of the timed steps; memory is peak allocated / "
        "reserved. Targets: step time at most 0.9x FSDP2 + compile (MoE 0.6x), peak memory at most 1.0x; "
        "a captured step at most 1.0x the time and 1.05x the reserved memory of the same step uncaptured."
        + (f" Rows from {len(set(meta['merged']))} runs of this command; the systems of a row ran in one device call." if meta.get("merged") else ""),
        "",
        "| row | FSDP2 + compile | fxshard | ratios | fxshard at baseline | vs baseline | TFLOP/s/GPU (MFU 790 / 989) | targets missed |",
        "|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for row in data["rows"]:
        r, spec = row["results"], row["row"]
        if "skipped" in row:
            lines.append(f"| {spec['name']} | skipped: {row['skipped']} | | | | | | |")
            continue
        ours_key, uncaptured = graph_keys(r) if spec["graph"] else ("fxshard", None)
        ours = r.get(ours_key)
        first = ((row["baseline"] if "baseline" in row else meta.get("baseline")) or "")[:7]
        base = r.get(f"{ours_key}@{first}")
        # Merged runs: each row says which commits it compared.
        against = f" vs {first}" if base else ""
        name = f"{spec['name']} ({row['commit'][:7]}{against})" if meta.get("merged") else spec["name"]
        if uncaptured and r.get(uncaptured):
            ours_cell = f"{cell(ours)} (uncaptured {cell(r[uncaptured])})"
        else:
            ours_cell = cell(ours)
        vs_base = ratio(ours, base, "step_ms")
        # Further baselines (--baseline A,B): the table compares with the first; the others are named in its cell.
        others = [(k.split("@", 1)[1], v) for k, v in r.items() if k.startswith(f"{ours_key}@") and v is not base]
        base_cell = "; ".join([cell(base)] * bool(base) + [f"{c}: {cell(v)}" for c, v in others]) or "-"
        tflops = ours.get("tflops_per_gpu") if ours else None
        mfu = f"{tflops:.0f} ({tflops / GEMM_PEAK:.0%} / {tflops / DATASHEET_PEAK:.0%})" if tflops else "-"
        shown, missed = verdict(row)
        lines.append(
            f"| {name} | {cell(r.get('fsdp2_compile'))} | {ours_cell} | {', '.join(shown) or '-'} | "
            f"{base_cell} | {f'{vs_base:.2f}x' if vs_base else '-'} | {mfu} | {'; '.join(missed) or 'none'} |"
        )
    return "\n".join(lines)


def write_readme(readme: Path, table: str, source: str, name: str | None = None) -> None:
    """Replace the table between a markdown file's markers (``bench-table``, or
    ``bench-table:NAME``: a file can hold one table per device kind) with ``table``."""
    key = f"bench-table:{name}" if name else "bench-table"
    start, end = f"<!-- {key}:start -->", f"<!-- {key}:end -->"
    text = readme.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"{readme} has no {start} ... {end} markers")
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    flag = f" --table-name {name}" if name else ""
    note = f"<!-- generated by: python bench/matrix.py --table {source} --readme {readme}{flag} -->"
    readme.write_text(f"{head}{start}\n{note}\n\n{table}\n\n{end}{tail}")


DEVICE = "cuda"
PROFILE = 0  # --profile: profile the last N steps of every system
PROFILE_HOST = False  # --profile-host: their host ops too
MEMORY_STEP = None  # --memory-step: what is alive at this step's peak, for every system


def main() -> None:
    global DEVICE, PROFILE, PROFILE_HOST, MEMORY_STEP
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="*", help="comma-separated fnmatch patterns of row names (--list)")
    parser.add_argument("--baseline", default=None,
                        help="git refs, or folders holding a commit's fxshard/, comma-separated; the table "
                        "compares with the first")  # fmt: skip
    parser.add_argument("--out", default=None, help="JSON (the markdown table goes next to it, .md)")
    parser.add_argument("--nproc-per-node", type=int, default=None, help="GPUs (default: all)")
    parser.add_argument("--timeout", type=float, default=420, help="seconds one system's run may take")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run each row's systems this many times, interleaved; each keeps its median run "
                        "(host-bound steps vary by about 20%% between processes)")  # fmt: skip
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke test (gloo)")
    parser.add_argument("--profile", type=int, default=0, help="profile every system's last N steps (kernels)")
    parser.add_argument("--profile-host", action="store_true", help="with --profile: the host ops too")
    parser.add_argument("--memory-step", type=int, default=None, help="list what is alive at step N's peak")
    parser.add_argument("--list", action="store_true", help="print the rows and exit")
    parser.add_argument("--table", default=None, help="print the markdown table of this JSON and exit")
    parser.add_argument(
        "--readme",
        default=None,
        help="with --table: write the table into this markdown file (README.md, docs/performance.md)",
    )
    parser.add_argument("--table-name", default=None, help="with --readme: the markers bench-table:NAME")
    parser.add_argument("--merge", nargs="+", default=None, help="merge these runs' JSON into --out")
    args = parser.parse_args()
    DEVICE, PROFILE, PROFILE_HOST, MEMORY_STEP = args.device, args.profile, args.profile_host, args.memory_step
    if PROFILE_HOST and not PROFILE:
        parser.error("--profile-host profiles the steps that --profile N names: give --profile too")
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: give 1 or more")
    if args.list:
        print("\n".join(f"{r.name}: {' '.join(r.flags())}{' (graph)' if r.graph else ''}" for r in ROWS))
        return
    if args.merge:
        data = merge(args.merge)
        if args.out:
            Path(args.out).write_text(json.dumps(data, indent=1))
            Path(args.out).with_suffix(".md").write_text(markdown(data) + "\n")
        print(markdown(data))
        return
    if args.table:
        table = markdown(json.loads(Path(args.table).read_text()))
        if args.readme:
            write_readme(Path(args.readme), table, args.table, args.table_name)
        print(table)
        return
    patterns = args.rows.split(",")
    rows = [r for r in ROWS if any(fnmatch.fnmatch(r.name, p) for p in patterns)]
    if not rows:
        parser.error(f"no row matches {args.rows!r}; --list shows them")
    if DEVICE == "cpu":  # the tiny models stand in for each model; no CUDA graph on CPU
        rows = [dataclasses.replace(r, model=_tiny(r.model), batch=1) for r in rows if not r.graph]
    nproc = args.nproc_per_node or (_gpus() if DEVICE == "cuda" else 2)
    baselines = [baseline_tree(ref) for ref in args.baseline.split(",")] if args.baseline else []
    data: dict = {"meta": {"commit": this_commit(), "baseline": baselines[0][1] if baselines else None,
                           "baselines": [commit for _, commit in baselines],
                           "date": datetime.date.today().isoformat(), "gpus": nproc}, "rows": []}  # fmt: skip
    out = Path(args.out) if args.out else None
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="matrix-") as tmp:
        for row in rows:
            if row.gpus > nproc or nproc % row.tp or nproc % row.ep:
                need = (
                    f"{row.gpus} GPUs" if row.gpus > nproc else f"a GPU count divisible by tp {row.tp} and ep {row.ep}"
                )
                entry = {"row": dataclasses.asdict(row), "results": {}, "skipped": f"needs {need}"}
            else:
                entry = run_row(row, baselines, nproc, args.timeout, Path(tmp), args.repeat)
            data["rows"].append(entry)
            for result in entry["results"].values():
                if "meta" in result:
                    data["meta"].update({k: result["meta"].get(k) for k in ("device", "torch", "nccl", "alloc_conf")})
            if out:  # after every row, so that a later failure keeps the earlier rows
                out.write_text(json.dumps(data, indent=1))
                out.with_suffix(".md").write_text(markdown(data) + "\n")
    print(markdown(data))


def _tiny(model: str) -> str:
    return {"moe": "moe_tiny", "hybrid": "hybrid_tiny"}.get(model, "tiny")


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


if __name__ == "__main__":
    main()
