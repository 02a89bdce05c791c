"""Every private torch API fxshard touches, behind feature detection.

fxshard supports torch >= 2.11. Nothing outside this module imports from a
private torch namespace (``torch._*``); when an upstream name moves, this is
the one file to change.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if TORCH_VERSION < (2, 11):
    raise ImportError(f"fxshard needs torch >= 2.11, found {torch.__version__}")

from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._functorch.aot_autograd import make_boxed_func  # noqa: E402
from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: E402
from torch._guards import detect_fake_mode  # noqa: E402
from torch._inductor.compile_fx import compile_fx, compile_fx_inner  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

try:  # torch >= 2.6 names the base class of cache-aware custom passes
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover - older layouts
    CustomGraphPass = object  # type: ignore[misc,assignment]

if "inner_compile" not in inspect.signature(compile_fx).parameters:
    raise ImportError("this torch's compile_fx has no inner_compile hook; fxshard needs torch >= 2.11")

__all__ = [
    "CustomGraphPass",
    "aot_autograd",
    "compile_fx",
    "compile_fx_inner",
    "detect_fake_mode",
    "inductor_config_patches",
    "inductor_decompositions",
    "is_graph_break",
    "graph_break_reason",
    "is_checkpoint_region",
    "make_boxed_func",
    "make_fx",
    "queue_backward_callback",
    "skip_as_top_frame",
    "min_cut_rematerialization_partition",
]


# What dynamo raises for a graph break under fullgraph=True: an unsupported
# construct, or Python control flow on tensor data (``.tolist()``, ``if x:``).
# Under fullgraph=False dynamo turns each of these into a graph break.
from torch._dynamo.exc import BackendCompilerFailed as _BackendCompilerFailed  # noqa: E402
from torch._dynamo.exc import Unsupported as _Unsupported, UserError as _UserError  # noqa: E402
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode as _DataDependent  # noqa: E402
from torch._subclasses.fake_tensor import (  # noqa: E402
    DataDependentOutputException as _DataDependentOutput,
    DynamicOutputShapeException as _DynamicOutputShape,
)

_GRAPH_BREAKS = (_Unsupported, _UserError, _DataDependent)
# What the backend (AOTAutograd tracing with fake tensors) raises on an op
# whose output depends on data; dynamo's fullgraph=False turns these into breaks.
_BACKEND_BREAKS = (_UserError, _DataDependent, _DataDependentOutput, _DynamicOutputShape)


def is_graph_break(error: BaseException) -> bool:
    """Whether ``error``, raised by a fullgraph=True compile, is a graph break:
    dynamo's own, or a data-dependent op that AOTAutograd met while tracing
    (a custom op whose backward calls ``.tolist()``, say)."""
    if isinstance(error, _BackendCompilerFailed):
        error = getattr(error, "inner_exception", None) or error.__cause__
        return isinstance(error, _BACKEND_BREAKS)
    return isinstance(error, _GRAPH_BREAKS)


def graph_break_reason(error: BaseException) -> str:
    """The first line of what dynamo or AOTAutograd said."""
    if isinstance(error, _BackendCompilerFailed):
        error = getattr(error, "inner_exception", None) or error.__cause__ or error
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the running backward pass ends (call from inside it)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


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
    from torch._C._dynamo.eval_frame import set_code_exec_strategy, _FrameAction, _FrameExecStrategy

    set_code_exec_strategy(code, _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))


def inductor_decompositions() -> dict:
    """The decomposition table Inductor applies before its post-grad passes."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def inductor_config_patches(joint_pre_pass: Callable[[torch.fx.Graph], None]) -> dict[str, Any]:
    """Inductor config for one fxshard compile, applied by compile_fx around
    that compile only (never set globally)."""
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config, "joint_custom_pre_pass"):
        raise ImportError("this torch's inductor has no joint_custom_pre_pass hook")
    return {"joint_custom_pre_pass": joint_pre_pass}


def fake_store() -> Any:
    """The store of torch's ``fake`` process group (importing it registers the
    backend): tracing and tests at any world size without other processes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()
