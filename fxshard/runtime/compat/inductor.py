"""Inductor: its ``compile_fx`` entry points, the config of one fxshard
compile, its decompositions, the row padding of the buffers it lays out, and
the folder of its caches."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch._inductor import graph as _inductor_graph
from torch._inductor.compile_fx import compile_fx, compile_fx_inner as _compile_fx_inner

try:  # torch >= 2.6 names the base class of cache-aware custom passes
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover - older layouts
    CustomGraphPass = object  # type: ignore[misc,assignment]

if "inner_compile" not in inspect.signature(compile_fx).parameters:
    raise ImportError("this torch's compile_fx has no inner_compile hook; fxshard needs torch >= 2.11")

__all__ = [
    "CustomGraphPass",
    "compile_fx",
    "compile_fx_inner",
    "env_inductor_config",
    "inductor_config_patches",
    "inductor_decompositions",
    "inductor_row_alignment_bytes",
    "torch_cache_dir",
]


def compile_fx_inner(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
    """Inductor's ``compile_fx_inner``; a graph that calls outlined bodies is
    compiled with its bodies donating no inputs (see [Note: subgraph donation])."""
    op = getattr(torch.ops.higher_order, "invoke_subgraph", None)
    calls_bodies = op is not None and any(n.target is op for n in gm.graph.nodes)
    with _subgraphs_donate_no_inputs() if calls_bodies else contextlib.nullcontext():
        return _compile_fx_inner(gm, example_inputs, **kwargs)


# [Note: subgraph donation]
# AOTAutograd marks some backward inputs "donated" (saved activations no one
# else reads), and Inductor may then write into them in place. Each graph
# lowering reads the indices of those inputs from the tracing context, and
# on torch 2.11 to 2.13 the lowering of an ``invoke_subgraph`` body inherits
# the *outer* backward's indices and applies them to the body's own inputs.
# A body's backward then writes its output into an input the outer graph
# still owns, and the outer graph, which cannot know, reuses that buffer
# while the output is alive: an ``nn.Sequential`` whose two ReLUs became one
# body got wrong gradients (tests/test_compat.py). A body cannot know
# which of its inputs the caller may give up, so its inputs donate nothing;
# the outer graph's donations stay as they are. Later torch clears the
# indices itself (pytorch#193960), where this does nothing.
@contextlib.contextmanager
def _subgraphs_donate_no_inputs() -> Any:
    cls = getattr(_inductor_graph, "SubgraphLowering", None)
    if cls is None:
        yield
        return
    original = cls.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.bw_donated_idxs = None

    cls.__init__ = init
    try:
        yield
    finally:
        cls.__init__ = original


def inductor_decompositions() -> dict:
    """The decomposition table Inductor applies before its post-grad passes."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_config_patches(
    joint_pre_pass: Callable[[torch.fx.Graph], None], extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Inductor config for one fxshard compile, applied by compile_fx around
    that compile only (never set globally); ``extra``: the user's
    (``env_inductor_config``, read at ``fxshard.compile``)."""
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "joint_custom_pre_pass"):
        raise ImportError("this torch's inductor has no joint_custom_pre_pass hook")
    patches: dict[str, Any] = {"joint_custom_pre_pass": joint_pre_pass}
    # fxshard's schedule places each collective's start and wait; Inductor's
    # peak-memory reordering would move them (a wait early, a prefetch late).
    if hasattr(inductor_config, "reorder_for_peak_memory"):
        patches["reorder_for_peak_memory"] = False
    patches.update(extra or {})
    return patches


def env_inductor_config() -> dict[str, Any]:
    """``FXSHARD_INDUCTOR_CONFIG="pattern_matcher=0,triton.autotune_pointwise=0"``:
    more Inductor options for fxshard's compiles, parsed as the option's type.
    ``fxshard.compile`` calls it first, so a bad value fails there."""
    import os

    import torch._inductor.config as inductor_config

    patches: dict[str, Any] = {}
    config = inductor_config.get_config_copy()
    for item in filter(None, (s.strip() for s in os.environ.get("FXSHARD_INDUCTOR_CONFIG", "").split(","))):
        key, sep, raw = (part.strip() for part in item.partition("="))
        if not sep:
            raise ValueError(f"FXSHARD_INDUCTOR_CONFIG: expected key=value, got {item!r}")
        if key not in config:
            raise ValueError(f"FXSHARD_INDUCTOR_CONFIG: torch._inductor.config has no option {key!r}")
        value: Any = raw
        if isinstance(config[key], bool):
            value = raw.lower() in ("1", "true", "yes")
        elif isinstance(config[key], (int, float)):
            try:
                value = type(config[key])(raw)
            except ValueError:
                kind = type(config[key]).__name__
                raise ValueError(f"FXSHARD_INDUCTOR_CONFIG: {key} takes {kind}, got {raw!r}") from None
        patches[key] = value
    return patches


def inductor_row_alignment_bytes() -> int:
    """The byte alignment to which Inductor pads the rows (strides) of the
    buffers it lays out, where it pads."""
    from torch._inductor import config

    return int(getattr(config, "padding_alignment_bytes", 128))


def torch_cache_dir() -> str:
    """The folder of torch's compile caches (``TORCHINDUCTOR_CACHE_DIR``)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # pragma: no cover - older layouts
        import getpass
        import os
        import tempfile

        return os.environ.get("TORCHINDUCTOR_CACHE_DIR") or os.path.join(
            tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"
        )
    return cache_dir()
