"""Dynamo, the frame tracer of ``torch.compile``: which errors of a
fullgraph=True compile are graph breaks and which are the user's own code
raising, logging calls kept out of traces, frames dynamo must not compile on
their own, and its compile-time counters."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# What dynamo raises for a graph break under fullgraph=True: an unsupported
# construct, or Python control flow on tensor data (``.tolist()``, ``if x:``).
# Under fullgraph=False dynamo turns each of these into a graph break.
from torch._dynamo.exc import (
    BackendCompilerFailed as _BackendCompilerFailed,
    ObservedException as _ObservedException,
    TorchRuntimeError as _TorchRuntimeError,
    Unsupported as _Unsupported,
    UserError as _UserError,
)
from torch._subclasses.fake_tensor import (
    DataDependentOutputException as _DataDependentOutput,
    DynamicOutputShapeException as _DynamicOutputShape,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode as _DataDependent

__all__ = [
    "compile_phase_times",
    "debug_calls_in_traces",
    "graph_break_reason",
    "is_checkpoint_region",
    "is_data_dependent",
    "is_graph_break",
    "is_user_error",
    "not_traced",
    "skip_as_top_frame",
]

_GRAPH_BREAKS = (_Unsupported, _UserError, _DataDependent)
# What the backend (AOTAutograd tracing with fake tensors) raises on an op
# whose output depends on data; dynamo's fullgraph=False turns these into breaks.
_BACKEND_BREAKS = (_UserError, _DataDependent, _DataDependentOutput, _DynamicOutputShape)
# Dynamo's names (``gb_type``, the first words of the message) for an
# ``assert`` it proved to fail while tracing: the code raises AssertionError.
_FAILED_ASSERTS = ("Data-dependent assertion failed", "Assertion failed on symbolic shapes")


def is_user_error(error: BaseException) -> bool:
    """Whether ``error``, raised by a fullgraph=True compile, says that the
    user's code itself raises for these inputs: an exception that escapes the
    traced frame (dynamo reports it as ``Unsupported``, "Observed exception"),
    an ``assert`` proved false, or an op that fails on fake tensors (a shape
    error). These are not graph breaks: run eagerly, the code raises too."""
    if isinstance(error, _TorchRuntimeError):
        return True
    if not isinstance(error, _Unsupported):
        return False
    if isinstance(error.__cause__, _ObservedException):
        return True
    kind = getattr(error, "gb_type", None) or str(error)
    return kind.startswith(_FAILED_ASSERTS)


def is_graph_break(error: BaseException) -> bool:
    """Whether ``error``, raised by a fullgraph=True compile, is a graph break:
    dynamo's own, or a data-dependent op that AOTAutograd met while tracing
    (a custom op whose backward calls ``.tolist()``, say). An exception of the
    user's code (``is_user_error``) is not one, though dynamo raises it as
    ``Unsupported`` too."""
    if is_user_error(error):
        return False
    if isinstance(error, _BackendCompilerFailed):
        error = getattr(error, "inner_exception", None) or error.__cause__
        return isinstance(error, _BACKEND_BREAKS)
    return isinstance(error, _GRAPH_BREAKS)


def is_data_dependent(error: BaseException) -> bool:
    """Whether ``error`` is a symbolic-shapes error about a size or value
    that depends on data (what the backend counts as a graph break when it
    comes from tracing the user's code)."""
    return isinstance(error, _BACKEND_BREAKS)


def graph_break_reason(error: BaseException) -> str:
    """The first line of what dynamo or AOTAutograd said."""
    if isinstance(error, _BackendCompilerFailed):
        error = getattr(error, "inner_exception", None) or error.__cause__ or error
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _dynamo_debug_keys() -> tuple[str | None, str | None]:
    """The dynamo config keys that make logging calls no-ops and prints
    reorderable, where this torch has them (``ignore_logger_methods`` was
    renamed ``ignore_logging_functions``)."""
    from torch._dynamo import config

    options = config.get_config_copy()
    ignore = next((k for k in ("ignore_logging_functions", "ignore_logger_methods") if k in options), None)
    reorder = "reorderable_logging_functions" if "reorderable_logging_functions" in options else None
    return ignore, reorder


# Once, at import: under a user's torch.compile of the model, dynamo traces
# debug_calls_in_traces, and a functools.cache there printed its warning.
_DEBUG_KEYS = _dynamo_debug_keys()


_LOGGER_METHODS = ("debug", "info", "warning", "warn", "warning_once", "info_once")  # *_once: transformers'


@contextlib.contextmanager
def debug_calls_in_traces() -> Iterator[None]:
    """While dynamo traces inside this scope, logging calls are dropped from
    the graph (``logging.Logger.warning``, transformers' ``warning_once``)
    and ``print`` / ``warnings.warn`` run after it, instead of each being a
    graph break. Set for fxshard's calls only and restored after, as the
    Inductor options are (see ``inductor_config_patches``). Transformers adds
    ``warning_once`` when imported, so the methods are looked up per call."""
    import logging
    import warnings

    from torch._dynamo import config

    ignore, reorder = _DEBUG_KEYS
    methods = {getattr(logging.Logger, name) for name in _LOGGER_METHODS if hasattr(logging.Logger, name)}
    extra = [(ignore, methods), (reorder, {print, warnings.warn})]
    saved = [(key, getattr(config, key)) for key, _ in extra if key is not None]
    for key, add in extra:
        if key is not None:
            setattr(config, key, set(getattr(config, key)) | add)
    # Dynamo skips guards on nn.Module hooks by default: a forward hook added
    # after the first call would be silently ignored by the compiled graph.
    # With the guards, adding or removing a hook recompiles (the same
    # collectives: hooks change compute, not which parameters are read).
    if hasattr(config, "skip_nnmodule_hook_guards"):
        saved.append(("skip_nnmodule_hook_guards", config.skip_nnmodule_hook_guards))
        config.skip_nnmodule_hook_guards = False
    metrics_log = logging.getLogger("torch._dynamo.metrics_context")
    metrics_log.addFilter(_drop_unsortable_config_errors)
    try:
        yield
    finally:
        for key, value in saved:
            setattr(config, key, value)
        metrics_log.removeFilter(_drop_unsortable_config_errors)


def _drop_unsortable_config_errors(record: Any) -> bool:
    """False (drop) for torch's error that it could not log the sets of
    functions above with a compile's metrics: torch 2.11 sorts every set of
    dynamo's config to log it, and functions do not sort, so it logs
    "Unexpected exception logging compilation metrics" at each compile
    (torch 2.13 leaves these keys out). The metrics are lost either way."""
    error = record.exc_info[1] if record.exc_info else None
    return not (
        isinstance(error, TypeError) and "not supported between instances of" in str(error) and "function" in str(error)
    )


def is_checkpoint_region(node: Any) -> bool:
    """A dynamo node for a ``torch.utils.checkpoint`` region."""
    return node.op == "call_function" and "checkpoint" in str(getattr(node.target, "__name__", node.target))


def skip_as_top_frame(code: Any) -> None:
    """Never compile ``code`` as a frame of its own, but still inline it into
    frames that dynamo traces (what dynamo does for ``torch.nn``'s code)."""
    from torch._dynamo import eval_frame

    if hasattr(eval_frame, "skip_code"):
        eval_frame.skip_code(code)
        return
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))


def not_traced(fn: Any, reason: str) -> Any:
    """``fn`` under ``torch.compiler.disable``: a user's ``torch.compile``
    does not trace it but calls it (a graph break; under fullgraph=True,
    dynamo's error, which quotes ``reason`` where torch takes one)."""
    import inspect

    import torch

    if "reason" in inspect.signature(torch.compiler.disable).parameters:
        return torch.compiler.disable(fn, reason=reason)
    return torch.compiler.disable(fn)


def compile_phase_times(reset: bool = False) -> dict[str, float]:
    """Seconds torch.compile spent per phase so far in this process (dynamo
    tracing, AOTAutograd, Inductor, ...), summed over graphs; ``reset``
    clears the counters. For benchmarks' first-step breakdowns."""
    from torch._dynamo import utils

    metrics = getattr(utils, "compilation_time_metrics", {})
    times = {name: float(sum(values)) for name, values in metrics.items()}
    if reset:
        metrics.clear()
    return times
