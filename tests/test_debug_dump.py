"""debug_dir: every compiled graph dumped before and after each pass, readable."""

from __future__ import annotations

import torch

import fxshard
from tests.helpers import models


def test_dumps_every_phase_with_module_paths(fake_pg, tmp_path):
    model = models.TinyLlama()
    fxshard.compile(model, backend="aot_eager", debug_dir=tmp_path, unit_mb=0.003)
    model(torch.randint(0, 37, (2, 9))).sum().backward()
    graph_dir = tmp_path / "rank0" / "graph0"
    # compile_blocks_once (the default) adds outline_blocks, and on the joint
    # reroute_saved_inputs and tag_body_inputs before tag_unshard.
    for phase, name in [("captured", "00_dedupe_unshard"), ("captured", "02_outline_blocks"),
                        ("joint", "00_reroute_saved_inputs"), ("joint", "02_tag_unshard"),
                        ("forward", "00_bucket_collectives"), ("backward", "00_bucket_collectives")]:  # fmt: skip
        for when in ("before", "after"):
            assert (graph_dir / phase / f"{name}.{when}.txt").is_file(), (phase, name, when)
    for phase in ("forward", "backward"):
        passes = sorted(p.name for p in (graph_dir / phase).glob("*.after.txt"))
        assert passes == ["00_bucket_collectives.after.txt", "01_lower_collectives.after.txt",
                          "02_schedule_collectives.after.txt", "03_resolve_call_inputs.after.txt"], passes  # fmt: skip
    forward = (graph_dir / "forward" / "00_bucket_collectives.after.txt").read_text()
    assert "fxshard.unit_gather(" in forward and "fxshard.unit_gather_wait(" in forward
    assert "# layers.0.attn.wq" in forward or "# layers.0.attn" in forward
    assert "invoke_subgraph" in (graph_dir / "captured" / "02_outline_blocks.after.txt").read_text()
    joint = (graph_dir / "joint" / "02_tag_unshard.after.txt").read_text()
    assert "recompute=MUST_RECOMPUTE" in joint
    assert "recompute=MUST_SAVE" in joint  # the unit gathered last stays for backward
    summary = (graph_dir / "summary.txt").read_text()
    assert "layers.1.mlp.w2.weight" in summary
    saved = next(line for line in summary.splitlines() if line.startswith("full weights saved from forward"))
    assert saved != "full weights saved from forward for backward: none", saved
    assert "reduce-scattered" in summary
    assert "units: " in summary and "unit 0: " in summary
    assert "outlined blocks" in summary
    assert "[backward memory] predicted peak: " in summary


def test_debug_dir_from_environment(fake_pg, tmp_path, monkeypatch):
    monkeypatch.setenv("FXSHARD_DEBUG_DIR", str(tmp_path))
    model = fxshard.compile(models.Uneven(), backend="aot_eager")
    model(torch.randn(3, 5)).sum().backward()
    assert (tmp_path / "rank0" / "graph0" / "summary.txt").is_file()


def test_marks_the_models_collectives_not_fxshards():
    """A functional collective in a dump is the model's (TP's, EP's) unless
    fxshard's lowering made it (tests/helpers/tp_parity.py dump_marks checks
    a TP model's dump)."""
    from fxshard.passes.dump import format_graph
    from fxshard.passes.lower import LOWERED

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    funcol = torch.ops._c10d_functional
    ours = graph.call_function(funcol.all_reduce.default, (x, "sum", "7"))
    ours.meta[LOWERED] = True
    theirs = graph.call_function(funcol.all_reduce.default, (x, "sum", "9"))
    wait = graph.call_function(funcol.wait_tensor.default, (theirs,))
    graph.output((ours, wait))
    lines = format_graph(torch.fx.GraphModule(torch.nn.Module(), graph)).splitlines()
    assert "not fxshard's" not in lines[1], lines[1]
    assert lines[2].endswith("# the model's collective (TP/EP), not fxshard's: group 9"), lines[2]
    assert lines[3].endswith("# the wait of the model's collective, not fxshard's"), lines[3]
