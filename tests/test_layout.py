"""How the source is laid out: rules that a change could break silently.

Each check reads fxshard's source files (comments stripped), so it costs no
compile and fails on the line that breaks the rule.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import fxshard

ROOT = Path(fxshard.__file__).parent


def _code(path: Path) -> str:
    return "\n".join(line.split("#")[0] for line in path.read_text().splitlines())


def _files_matching(pattern: str) -> set[str]:
    """The files whose code matches, compat's modules as one (``runtime/compat``)."""
    regex = re.compile(pattern)
    files = {str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py") if regex.search(_code(p))}
    return {"runtime/compat" if f.startswith("runtime/compat/") else f for f in files}


def test_only_the_topology_reads_the_mesh():
    """See [Note: topology]; compat wraps the private flatten."""
    readers = _files_matching(
        r"\bnew_group\(|\.get_group\(|\.get_local_rank\(|\.mesh_dim_names|\._flatten\b|mesh\.size\("
    )
    allowed = {"runtime/topology.py", "runtime/compat"}
    assert readers <= allowed, f"read the mesh through fxshard.runtime.topology: {sorted(readers - allowed)}"
    assert "runtime/topology.py" in readers


def test_a_ranks_rows_come_from_the_topology():
    """See [Note: topology]: ``Topology.rows`` answers which rows a rank
    holds; only ops that get a group's size and rank as plain ints ask
    ``shard_range`` themselves."""
    askers = _files_matching(r"\bshard_range\(")
    assert askers == {"runtime/collectives.py", "runtime/topology.py", "runtime/embedding.py"}, sorted(askers)


def test_process_wide_effects_have_one_home():
    """See [Note: process-wide effects]: optimizer step hooks, the foreach
    type registry, exit and before-destroy hooks, torch's swap-on-conversion
    flag go through runtime/process.py."""
    pattern = (r"register_optimizer_step_\w+_hook|register_module_\w+_registration_hook|atexit\.register|"
               r"register_foreach_type\(|call_before_destroy\(|set_swap_module_params_on_conversion")  # fmt: skip
    doers = _files_matching(pattern)
    assert doers <= {"runtime/process.py", "runtime/compat"}, sorted(doers)
    assert "runtime/process.py" in doers


def test_layers_import_downward():
    """API -> passes -> runtime: the runtime imports neither the passes nor
    the API, and the passes do not import the API."""
    imports = re.compile(r"^\s*(?:from|import)\s+fxshard(?:\.(\w+))?", re.M)
    for path in ROOT.rglob("*.py"):
        layer = path.relative_to(ROOT).parts[0] if len(path.relative_to(ROOT).parts) > 1 else "api"
        targets = {m or "api" for m in imports.findall(path.read_text())}
        targets = {t if t in ("passes", "runtime") else "api" for t in targets}
        if layer == "runtime":
            assert targets <= {"runtime"}, f"{path.relative_to(ROOT)} imports {targets}"
        elif layer == "passes":
            assert targets <= {"runtime", "passes"}, f"{path.relative_to(ROOT)} imports {targets}"


def test_module_files_import_downward():
    """See [Note: the module package]: each file of fxshard/module/ imports
    only the files listed before it there, and its __init__ imports none
    (fxshard/plan.py imports writes.py, which must not load swap.py)."""
    order = ["shards", "optimizers", "writes", "zero1", "reads", "root", "hf", "checkpoint", "structure", "swap"]
    folder = ROOT / "module"
    assert sorted(order) == sorted(p.stem for p in folder.glob("*.py") if p.stem != "__init__")
    init = ast.parse((folder / "__init__.py").read_text())
    assert not [n for n in ast.walk(init) if isinstance(n, (ast.Import, ast.ImportFrom))]
    imports = re.compile(r"^from fxshard\.module(?:\.(\w+) import| import ([\w, ]+))", re.M)
    for i, name in enumerate(order):
        found = imports.findall((folder / f"{name}.py").read_text())
        targets = {m or n.strip() for m, names in found for n in (names.split(",") if names else [""])}
        assert targets <= set(order[:i]), f"module/{name}.py imports {sorted(targets - set(order[:i]))}"
