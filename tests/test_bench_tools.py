"""The benchmark's tools: the memory trace's replay, the kernel profile's
sums, and the driver that runs each system in a process of its own."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

import memtrace  # noqa: E402

import bench  # noqa: E402  (bench/bench.py)


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


def _kernel(name: str, start: float, end: float, stream: int = 7) -> SimpleNamespace:
    return SimpleNamespace(name=name, device_type=bench.torch.autograd.DeviceType.CUDA, device_resource_id=stream,
                           time_range=SimpleNamespace(start=start, end=end))  # fmt: skip


def test_gpu_busy_is_the_union_of_all_kernels():
    events = [_kernel("gemm", 0, 10), _kernel("ncclAllGather", 5, 20, stream=9), _kernel("copy", 30, 40)]  # us
    profile = bench.kernel_profile(SimpleNamespace(events=lambda: events), steps=2)
    assert profile["gpu_busy_ms"] == pytest.approx(30 / 1e3 / 2)  # 0-20 and 30-40
    assert profile["compute_busy_ms"] == pytest.approx(20 / 1e3 / 2)
    assert profile["exposed_nccl_ms"] == pytest.approx(10 / 1e3 / 2)  # 10-20: no compute kernel
    assert profile["kernels_per_step"] == 1.5 and "note" not in profile
    # The one idle stretch, 20-30, follows the NCCL kernel (the last to end) on another stream.
    assert profile["idle_by_transition"] == {"other stream, nccl -> other": [0.5, pytest.approx(10 / 1e3 / 2)]}
    assert profile["streams"] == 2
    assert "note" in bench.kernel_profile(SimpleNamespace(events=list), steps=1)


def test_host_ops_are_those_with_the_most_host_time_per_step():
    cpu = bench.torch.profiler.ProfilerActivity.CPU
    with bench.torch.profiler.profile(activities=[cpu]) as profiler:
        for _ in range(2):  # two steps of one matmul each
            x = bench.torch.ones(64, 64)
            (x @ x).sum()
    ops = bench.host_ops(profiler, steps=2, top=50)
    assert [o["self_ms"] for o in ops] == sorted((o["self_ms"] for o in ops), reverse=True)
    mm = next(o for o in ops if o["name"] == "aten::mm")
    assert mm["calls"] == 1 and 0 < mm["self_ms"] <= mm["total_ms"]
    assert len(bench.host_ops(profiler, steps=2, top=2)) == 2
    lines = bench.details({"system": "fxshard", "model": "tiny", "host_ops": ops[:2]})
    assert lines[0].startswith("fxshard tiny host self ms per step by op: ") and "calls)" in lines[0]


def _args(**kw) -> SimpleNamespace:
    base = dict(model="tiny", device="cpu", batch=None, prefetch=None, unit_mb=None, profile=0, profile_host=False,
                memory_step=None, fake_world=None, nproc_per_node=None, repeat=1, timeout=None, out=None, frozen_layers=0,
                micro_batches=None, strategy="zero3", optimizer="adamw", mesh=None, tp=None, loss_parallel=False,
                fxshard_tree=None, capturable=False)  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def test_each_system_gets_a_process_of_its_own(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    command = bench.child_command(_args(batch=3), "fsdp2", Path("o.json"))
    assert command[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    assert command[5].endswith("bench/bench.py")
    assert set(command[6:]) == {"--only-system=fsdp2", "--out=o.json", "--model=tiny", "--device=cpu", "--batch=3",
                                "--strategy=zero3", "--optimizer=adamw"}  # fmt: skip
    forwarded = bench.child_command(
        _args(frozen_layers=2, micro_batches=4, strategy="no_sync", mesh="2,2", fxshard_tree="/t"), "fxshard", Path("o")
    )
    for flag in ("--frozen-layers=2", "--micro-batches=4", "--strategy=no_sync", "--mesh=2,2", "--fxshard-tree=/t"):
        assert flag in forwarded
    tp = bench.child_command(_args(tp=2, loss_parallel=True), "fsdp2_compile", Path("o"))
    assert "--tp=2" in tp and "--loss-parallel" in tp
    profiled = bench.child_command(_args(profile=2, profile_host=True), "fxshard", Path("o"))
    assert "--profile=2" in profiled and "--profile-host" in profiled
    fake = bench.child_command(_args(fake_world=8), "fxshard", Path("o.json"))
    assert "torch.distributed.run" not in fake and "--fake-world=8" in fake


def test_the_driver_interleaves_repeats_and_keeps_failed_runs(monkeypatch, tmp_path, capsys):
    started = []

    def run_child(command, timeout):  # a child that writes its JSON, except fsdp2's second run
        system = next(a for a in command if a.startswith("--only-system=")).split("=")[1]
        out = Path(next(a for a in command if a.startswith("--out=")).split("=", 1)[1])
        started.append(system)
        if system == "fsdp2" and started.count("fsdp2") == 2:
            return 1
        result = dict(
            model="tiny",
            system=system,
            params=1,
            batch=1,
            step_ms=float(len(started)),
            tokens_per_s_per_gpu=1.0,
            tflops_per_gpu=0.0,
            peak_gib=0.0,
            first_step_s=0.0,
            loss_step10=4.0,
        )
        out.write_text(json.dumps(dict(meta=dict(device="cpu"), results=[result])))
        return 0

    monkeypatch.setattr(bench, "run_child", run_child)
    out = tmp_path / "merged.json"
    failed = bench.drive(_args(repeat=2, out=str(out)), ["fxshard", "fsdp2"])
    assert started == ["fxshard", "fsdp2", "fxshard", "fsdp2"]
    merged = json.loads(out.read_text())
    assert [(r["system"], r["run"]) for r in merged["results"]] == [("fxshard", 0), ("fsdp2", 0), ("fxshard", 1)]
    assert failed == 1 and merged["failures"] == [dict(system="fsdp2", run=1, returncode=1)]
    assert merged["meta"]["device"] == "cpu" and merged["meta"]["repeat"] == 2
    assert "fxshard: step ms per run 1.0 3.0" in capsys.readouterr().out


def test_a_cuda_graph_on_cpu_is_refused_with_the_fix(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench.py", "--model", "tiny", "--device", "cpu", "--systems", "fxshard_graph"])
    with pytest.raises(SystemExit):
        bench.main()
    assert "needs --device cuda" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags, error",
    [(["--model", "hybrid_tiny", "--tp", "2"], "hybrid_tiny has no TP plan"),
     (["--model", "tiny", "--loss-parallel"], "give --tp too")],
)  # fmt: skip
def test_tp_without_a_plan_or_loss_parallel_without_tp_is_refused(monkeypatch, capsys, flags, error):
    for name in ("DEVICE", "TP", "LOSS_PARALLEL", "MESH"):  # main() sets them; restored after the test
        monkeypatch.setattr(bench, name, getattr(bench, name))
    monkeypatch.setattr(sys, "argv", ["bench.py", "--device", "cpu", *flags])
    with pytest.raises(SystemExit):
        bench.main()
    assert error in capsys.readouterr().err


@pytest.mark.full_cpu  # two systems compiled on 4 gloo ranks: over 2 minutes on 2 cores
def test_tp_rows_run_both_systems_on_the_same_plan(tmp_path):
    """bench.py --tp 2 at 4 ranks, (dp 2, tp 2): fxshard and FSDP2 + per-block
    compile on torchtitan's plan train the same losses; the parameters are
    counted at full size and the tokens per GPU are the dp rank's / tp."""
    out = tmp_path / "tp.json"
    cmd = [sys.executable, str(Path(bench.__file__)), "--model=tiny", "--device=cpu", "--tp=2", "--nproc-per-node=4",
           "--systems=fxshard,fsdp2_compile", f"--out={out}"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-8000:]
    data = json.loads(out.read_text())
    assert not data["failures"] and [r["system"] for r in data["results"]] == ["fxshard", "fsdp2_compile"]
    spec = bench.MODELS["tiny"]()
    model = spec.make()
    params, flops = sum(p.numel() for p in model.parameters()), spec.flops_per_token(model)
    tokens = spec.batch * spec.seq / 2  # a TP group of 2 shares its dp rank's batch
    for r in data["results"]:
        assert (r["tp"], r["mesh"], r["sequence_parallel"], r["world_size"]) == (2, [2], True, 4)
        assert r["params"] == params  # DTensors count at full size: no TP shard counted alone
        assert r["tokens_per_s_per_gpu"] * r["step_ms"] / 1e3 == pytest.approx(tokens)
        assert r["tflops_per_gpu"] * 1e12 * r["step_ms"] / 1e3 == pytest.approx(flops * tokens)
        assert all(math.isfinite(loss) for loss in r["losses"])
    ours, fsdp2 = (r["losses"] for r in data["results"])
    assert ours == pytest.approx(fsdp2, abs=2e-3)  # bf16 compute, the same model, plan and tokens


import matrix  # noqa: E402  (bench/matrix.py)


def _result(ms: float, peak: float, reserved: float | None = None) -> dict:
    return dict(step_ms=ms, peak_gib=peak, peak_reserved_gib=reserved or peak, tflops_per_gpu=395.0)


def test_matrix_rows_cover_what_users_run():
    rows = {r.name: r for r in matrix.ROWS}
    assert {r.optimizer for r in rows.values()} == set(bench.OPTIMIZERS)
    assert {r.strategy for r in rows.values()} == set(bench.STRATEGIES)
    assert {"375m", "1b", "8b", "moe", "hybrid"} <= {r.model for r in rows.values()}
    assert any(r.graph for r in rows.values()) and any(r.mesh for r in rows.values())
    assert not any("," in name for name in rows), "--rows splits its patterns at commas"
    assert rows["1b b4 accum4 no sync"].flags()[-1] == "--micro-batches=4"
    # Issue 29's runs: the 8B at (dp 2, tp 2) beside "8b b1" at dp 4, FSDP2 + compile on the same plan.
    assert rows["8b b1 tp2"].tp == 2 and rows["8b b1 tp2"].gpus == 4 and "--tp=2" in rows["8b b1 tp2"].flags()
    assert rows["8b b1"].tp == 1 and not any(f.startswith("--tp") for f in rows["8b b1"].flags())
    assert "--loss-parallel" in rows["1b b4 tp2 loss parallel"].flags()
    assert all(bench.MODELS[r.model]().tp_plan is not None for r in rows.values() if r.tp > 1)


def test_matrix_table_gives_ratios_and_missed_targets(tmp_path):
    data = dict(
        meta=dict(commit="a" * 40, baseline="b" * 40, date="2026-11-26", gpus=2, device="H200", torch="2.11"),
        rows=[
            dict(row=vars(matrix.ROWS[0]) | {}, results={
                "fsdp2_compile": _result(100.0, 4.0), "fxshard": _result(80.0, 3.9),
                "fxshard@bbbbbbb": _result(120.0, 3.9), "fxshard@ccccccc": _result(90.0, 3.9)}),
            dict(row=vars(matrix.Row("moe b2", "moe", 2)), results={
                "fsdp2_compile": _result(50.0, 3.0), "fxshard": _result(40.0, 3.3)}),
            dict(row=vars(matrix.Row("g", "375m", 1, graph=True)), results={
                "fsdp2_compile": _result(100.0, 4.0), "fxshard_capturable": _result(60.0, 3.8, 5.0),
                "fxshard_graph": _result(20.0, 3.8, 6.0)}),
            # This tree's graph rows: the recommended step (zero_grad() inside), against it uncaptured.
            dict(row=vars(matrix.Row("g2", "375m", 1, graph=True)), results={
                "fsdp2_compile": _result(100.0, 4.0), "fxshard": _result(60.0, 3.8, 5.0),
                "fxshard_graph_none": _result(30.0, 3.7, 5.1)}),
            dict(row=vars(matrix.Row("hsdp", "1b", 4, mesh="2,2", gpus=4)), results={}, skipped="needs 4 GPUs"),
        ],
    )  # fmt: skip
    lines = matrix.markdown(data).splitlines()
    dense, moe, graph, graph_none, hsdp = lines[-5:]
    assert "time 0.80x, memory 0.97x" in dense and "| 0.67x |" in dense and dense.endswith("| none |")
    assert "| 120.0 ms, 3.90 / 3.90 GiB; ccccccc: 90.0 ms, 3.90 / 3.90 GiB |" in dense  # a second baseline, named
    assert "time 0.800x > 0.6x" in moe and "memory 1.100x > 1.0" in moe
    assert "reserved vs uncaptured 1.200x > 1.05x" in graph and "time vs uncaptured 0.33x" in graph
    assert (
        "(uncaptured 60.0 ms" in graph_none and "time vs uncaptured 0.50x, reserved vs uncaptured 1.02x" in graph_none
    )
    assert matrix.Row("g", "375m", 1, graph=True).systems() == ["fsdp2_compile", "fxshard", "fxshard_graph_none"]
    assert "skipped: needs 4 GPUs" in hsdp
    assert "ALLOC_CONF" not in lines[0]  # the allocator's default: nothing to say
    allocator = {**data, "meta": {**data["meta"], "alloc_conf": "expandable_segments:True"}}
    assert "NCCL ?, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; fxshard at" in matrix.markdown(allocator)
    (tmp_path / "m.json").write_text(json.dumps(data))
    readme = tmp_path / "README.md"
    readme.write_text(
        "head\n<!-- bench-table:start -->\nold\n<!-- bench-table:end -->\n"
        "mid\n<!-- bench-table:2gpu:start -->\nkept\n<!-- bench-table:2gpu:end -->\ntail\n"
    )
    matrix.write_readme(readme, matrix.markdown(data), "m.json")
    text = readme.read_text()
    assert "old" not in text and text.startswith("head\n") and text.endswith("tail\n") and dense in text
    assert "kept" in text  # the other table's markers are another table's
    matrix.write_readme(readme, "new", "m2.json", "2gpu")
    text = readme.read_text()
    assert "kept" not in text and "\nnew\n" in text and "--table-name 2gpu" in text and dense in text


def test_matrix_repeats_interleave_and_keep_the_median_run(monkeypatch, tmp_path):
    calls, times = [], iter([130.0, 90.0, 120.0, 70.0, 110.0, None])  # fsdp2, fxshard, fsdp2, ... (None: failed)

    def fake(row, system, tree, nproc, timeout, out):
        calls.append(system)
        t = next(times)
        return {"failed": "exit status 1"} if t is None else _result(t, 1.0)

    monkeypatch.setattr(matrix, "run_system", fake)
    entry = matrix.run_row(matrix.ROWS[0], [], 2, 60, tmp_path, repeat=3)
    assert calls == ["fsdp2_compile", "fxshard"] * 3  # interleaved: each system once, then again
    fsdp2, ours = entry["results"]["fsdp2_compile"], entry["results"]["fxshard"]
    assert fsdp2["step_ms"] == 120.0 and fsdp2["step_ms_runs"] == [130.0, 120.0, 110.0]
    assert ours["step_ms"] == 70.0 and ours["step_ms_runs"] == [90.0, 70.0, None]  # the lower of two medians
    assert matrix.cell(ours).startswith("70.0 ms (70.0-90.0 over 2 runs)")


@pytest.mark.parametrize(
    "doc, source, name",
    [
        ("README.md", "matrix-4xh200.json", "4xh200"),
        ("docs/performance.md", "matrix.json", None),
        ("docs/performance.md", "matrix-2gpu.json", "2gpu"),
    ],
)
def test_tables_are_the_ones_generated_from_the_results(doc, source, name):
    root = Path(__file__).resolve().parent.parent
    data = json.loads((root / "bench" / "results" / source).read_text())
    text = (root / doc).read_text()
    key = f"bench-table:{name}" if name else "bench-table"
    table = text.split(f"<!-- {key}:start -->", 1)[1].split(f"<!-- {key}:end -->", 1)[0]
    flag = f" --table-name {name}" if name else ""
    assert matrix.markdown(data) in table, (
        f"{doc}'s benchmark table is not bench/results/{source}'s; regenerate it: "
        f"python bench/matrix.py --table bench/results/{source} --readme {doc}{flag}"
    )


def test_merged_runs_keep_each_rows_commit_and_baseline(tmp_path):
    """Rows from device calls at different commits, each against its own
    baseline (or none), merged twice: each row still names what it compared."""

    def run(commit: str, baseline: str | None, name: str, path: str, date: str = "2026-11-26") -> str:
        results = {"fsdp2_compile": _result(100.0, 4.0), "fxshard": _result(80.0, 3.9)}
        if baseline:
            results[f"fxshard@{baseline[:7]}"] = _result(90.0, 3.9)
        meta = dict(commit=commit, baseline=baseline, date=date, gpus=4, device="H100", torch="2.11")
        (tmp_path / path).write_text(json.dumps(dict(meta=meta, rows=[dict(row=vars(matrix.Row(name, "1b", 4)),
                                                                           results=results)])))  # fmt: skip
        return str(tmp_path / path)

    first = matrix.merge([run("a" * 40, "b" * 40, "one", "1.json"), run("c" * 40, None, "two", "2.json")])
    (tmp_path / "m.json").write_text(json.dumps(first))
    assert first["meta"]["date"] == "2026-11-26"
    data = matrix.merge([str(tmp_path / "m.json"), run("d" * 40, "e" * 40, "three", "3.json", "2026-11-28")])
    one, two, three = matrix.markdown(data).splitlines()[-3:]
    assert one.startswith("| one (aaaaaaa vs bbbbbbb) |") and "| 0.89x |" in one
    assert two.startswith("| two (ccccccc) |") and "| - | - |" in two
    assert three.startswith("| three (ddddddd vs eeeeeee) |")
    assert data["meta"]["commit"] == "aaaaaaa, ccccccc, ddddddd" and len(data["meta"]["merged"]) == 3
    assert data["meta"]["date"] == "2026-11-26 to 2026-11-28" and "; 2026-11-26 to 2026-11-28." in matrix.markdown(data)

    # Row "two" measured again, at another commit: its new figures, in its place.
    again = matrix.merge([str(tmp_path / "m.json"), run("f" * 40, None, "two", "4.json")])
    assert [r["row"]["name"] for r in again["rows"]] == ["one", "two"]
    assert matrix.markdown(again).splitlines()[-1].startswith("| two (fffffff) |")

    # Rows the matrix names come in its order, whatever order the runs measured them in.
    late = matrix.merge([run("a" * 40, None, "1b b4 graph", "5.json"), run("a" * 40, None, "8b b1", "6.json")])
    assert [r["row"]["name"] for r in late["rows"]] == ["8b b1", "1b b4 graph"]
