"""Every private torch API fxshard touches, behind feature detection.

fxshard supports torch >= 2.11. Nothing outside this module imports from a
private torch namespace (``torch._*``); when an upstream name moves, this is
the one file to change.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if TORCH_VERSION < (2, 11):
    raise ImportError(f"fxshard needs torch >= 2.11, found {torch.__version__}")

from torch._dynamo.backends.common import aot_autograd  # noqa: E402
from torch._functorch.aot_autograd import make_boxed_func  # noqa: E402
from torch._functorch.partitioners import min_cut_rematerialization_partition  # noqa: E402
from torch._guards import detect_fake_mode  # noqa: E402
from torch._inductor import graph as _inductor_graph  # noqa: E402
from torch._inductor.compile_fx import compile_fx, compile_fx_inner as _compile_fx_inner  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

try:  # torch >= 2.6 names the base class of cache-aware custom passes
    from torch._inductor.custom_graph_pass import CustomGraphPass
except ImportError:  # pragma: no cover - older layouts
    CustomGraphPass = object  # type: ignore[misc,assignment]

if "inner_compile" not in inspect.signature(compile_fx).parameters:
    raise ImportError("this torch's compile_fx has no inner_compile hook; fxshard needs torch >= 2.11")

__all__ = [
    "CustomGraphPass",
    "size_hint",
    "compile_phase_times",
    "all_gather_async",
    "all_gather_coalesced_async",
    "reduce_scatter_async",
    "all_reduce_async",
    "assert_async",
    "inductor_row_alignment_bytes",
    "group_backend",
    "group_is_live",
    "invoke_subgraph_op",
    "is_higher_order_op",
    "disable_torch_function_subclass",
    "local_tensor",
    "dtensor_spec",
    "mark_parameter",
    "register_foreach_type",
    "replace_local_tensor",
    "resolve_group",
    "aot_autograd",
    "compile_fx",
    "compile_fx_inner",
    "detect_fake_mode",
    "inductor_config_patches",
    "env_inductor_config",
    "inductor_decompositions",
    "is_graph_break",
    "is_user_error",
    "graph_break_reason",
    "debug_calls_in_traces",
    "default_store",
    "is_checkpoint_region",
    "make_boxed_func",
    "make_fx",
    "in_backward",
    "AtBackwardEnd",
    "skip_as_top_frame",
    "min_cut_rematerialization_partition",
]


# What dynamo raises for a graph break under fullgraph=True: an unsupported
# construct, or Python control flow on tensor data (``.tolist()``, ``if x:``).
# Under fullgraph=False dynamo turns each of these into a graph break.
from torch._dynamo.exc import (  # noqa: E402
    BackendCompilerFailed as _BackendCompilerFailed,
    ObservedException as _ObservedException,
    TorchRuntimeError as _TorchRuntimeError,
    Unsupported as _Unsupported,
    UserError as _UserError,
)
from torch._subclasses.fake_tensor import (  # noqa: E402
    DataDependentOutputException as _DataDependentOutput,
    DynamicOutputShapeException as _DynamicOutputShape,
)
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode as _DataDependent  # noqa: E402

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


@functools.cache
@functools.cache
def _dynamo_debug_keys() -> tuple[str | None, str | None]:
    """The dynamo config keys that make logging calls no-ops and prints
    reorderable, where this torch has them (``ignore_logger_methods`` was
    renamed ``ignore_logging_functions``)."""
    from torch._dynamo import config

    options = config.get_config_copy()
    ignore = next((k for k in ("ignore_logging_functions", "ignore_logger_methods") if k in options), None)
    reorder = "reorderable_logging_functions" if "reorderable_logging_functions" in options else None
    return ignore, reorder


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

    ignore, reorder = _dynamo_debug_keys()
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


def default_store() -> Any:
    """The key-value store of the default process group (every rank reaches it)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def graph_break_reason(error: BaseException) -> str:
    """The first line of what dynamo or AOTAutograd said."""
    if isinstance(error, _BackendCompilerFailed):
        error = getattr(error, "inner_exception", None) or error.__cause__ or error
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _backward_task() -> int:
    """The id of the backward pass this thread runs in; -1 outside any."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    """Whether this thread runs inside a backward pass (a hook, a recompute)."""
    return _backward_task() != -1


class AtBackwardEnd:
    """Runs ``fn`` once at the end of each backward that calls ``queue()``.

    The autograd engine drops the callbacks of a backward that raises, so
    "queued" is kept per backward (its graph task id), never as a flag that a
    failed backward would leave set, silencing every later one."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self._task: int | None = None  # the backward it is queued in, until it runs

    def queue(self) -> None:
        task = _backward_task()
        if task != self._task:
            torch.autograd.Variable._execution_engine.queue_callback(self._run)
            self._task = task

    def _run(self) -> None:
        self._task = None
        self.fn()

    def abandoned(self) -> bool:
        """Whether it was queued in a backward that ended without running it
        (that backward raised). Ask outside any backward; this forgets it."""
        if self._task is None or in_backward():
            return False
        self._task = None
        return True


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
# body got gradients off by 7e-2 (tests/test_compat.py). A body cannot know
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


def fake_store() -> Any:
    """The store of torch's ``fake`` process group (importing it registers the
    backend): tracing and tests at any world size without other processes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def resolve_group(group_name: str) -> Any:
    """The ProcessGroup registered under ``group_name`` (what functional collectives take)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def invoke_subgraph_op() -> Any:
    """torch's ``invoke_subgraph`` higher-order op (a call of a subgraph that
    AOTAutograd and Inductor compile once per body), or None without it."""
    return getattr(torch.ops.higher_order, "invoke_subgraph", None)


# Schemas of invoke_subgraph calls, per body graph (see below).
_SUBGRAPH_SCHEMAS: weakref.WeakKeyDictionary[torch.fx.GraphModule, dict] = weakref.WeakKeyDictionary()


@contextlib.contextmanager
def subgraph_schemas_cached(op: Any = None) -> Iterator[None]:
    """Before torch 2.12 (no ``get_functionalize_schema_entry`` on the
    invoke_subgraph cache), every call of ``invoke_subgraph`` traces its body
    again to build the op's schema, once under functionalization and once
    under autograd: AOTAutograd's joint trace of 32 outlined 8B layers took
    17.8 s on torch 2.11 against 7.4 s for the same layers inline, and 19.3
    against 7.9 s (torch 2.13) for a toy model on CPU. The schema depends on
    the body graph and the operands' types only, so inside this scope (fxshard's
    compiles) it is computed once per body graph and operand layout; outside
    it torch's own ``gen_schema`` runs. Later torch caches it itself; this
    does nothing there. ``op``: the higher-order op (tests pass their own)."""
    op = invoke_subgraph_op() if op is None else op
    hop = type(op)
    if op is None or _torch_caches_subgraph_schemas() or getattr(hop.gen_schema, "_fxshard_cached", False):
        yield  # nothing to cache, or an enclosing scope caches already
        return
    own = "gen_schema" in hop.__dict__
    uncached = hop.gen_schema

    def gen_schema(self: Any, subgraph: Any, identifier: Any, *operands: Any) -> Any:
        keys = [_operand_key(o) for o in operands]
        if not isinstance(subgraph, torch.fx.GraphModule) or None in keys:
            return uncached(self, subgraph, identifier, *operands)
        key = (identifier, tuple(keys))
        schemas = _SUBGRAPH_SCHEMAS.setdefault(subgraph, {})
        if key not in schemas:
            schemas[key] = uncached(self, subgraph, identifier, *operands)
        return schemas[key]

    gen_schema._fxshard_cached = True
    hop.gen_schema = gen_schema
    try:
        yield
    finally:
        if own:
            hop.gen_schema = uncached
        else:
            del hop.gen_schema


def _torch_caches_subgraph_schemas() -> bool:
    from torch._guards import InvokeSubgraphCache

    return hasattr(InvokeSubgraphCache, "get_functionalize_schema_entry")


def _operand_key(value: Any) -> Any:
    """What a schema may depend on, of one operand; None where that is not
    plain data (symbolic sizes: no cache)."""
    if isinstance(value, torch.Tensor):
        sizes = (*value.shape, *value.stride())
        if not all(type(n) is int for n in sizes):
            return None
        return ("tensor", sizes, value.dtype, str(value.device), value.requires_grad)
    if isinstance(value, (int, float, bool)) and not isinstance(value, torch.SymInt):
        return (type(value).__name__, value)
    return None


def is_higher_order_op(target: Any) -> bool:
    return isinstance(target, torch._ops.HigherOrderOperator)


def group_is_live(group: Any) -> bool:
    """Whether ``group`` is still registered under its name (not destroyed
    with its world, its name not taken by a group of a new world)."""
    try:
        return resolve_group(group.group_name) is group
    except (ValueError, RuntimeError, KeyError):
        return False


def flat_mesh(mesh: Any) -> Any:
    """A 1-D mesh over every rank of ``mesh`` (private ``DeviceMesh._flatten``;
    torch caches it on the root mesh, so every compile shares its group)."""
    if mesh.ndim == 1:
        return mesh
    flatten = getattr(mesh, "_flatten", None)
    if flatten is None:
        raise NotImplementedError(f"this torch ({torch.__version__}) cannot flatten a DeviceMesh; HSDP needs it")
    return flatten()


def group_backend(group_name: str) -> str:
    """The backend of a group by name: "nccl", "gloo", "fake", ..."""
    import torch.distributed as dist

    return str(dist.get_backend(resolve_group(group_name)))


def disable_torch_function_subclass() -> Any:
    """Run torch functions on a tensor subclass as on a plain tensor (what
    ``Tensor.__torch_function__`` does around each call)."""
    return torch._C.DisableTorchFunctionSubclass()


def dtensor_spec(dtensor: Any) -> Any:
    """A DTensor's spec (mesh, placements, global shape), to build another DTensor of it."""
    return dtensor._spec


def mark_parameter(tensor: torch.Tensor) -> None:
    """Make a tensor subclass instance a parameter to torch, as
    ``nn.Parameter`` does for a subclass whose ``detach`` keeps its type:
    ``isinstance(tensor, nn.Parameter)`` then holds."""
    tensor._is_param = True


# [Note: shards take torch's foreach paths]
# torch picks an optimizer's implementation, and ``clip_grad_norm_`` its
# kernels, by exact type: foreach (one kernel per op over all parameters)
# only where ``type(p)`` is in ``torch.optim.optimizer._foreach_supported_types``
# (and ``torch.utils._foreach_utils``' list for gradients), a registry that
# DTensor joins at import. A DTensor subclass that is not registered falls to
# the per-parameter loop: the default ``AdamW`` issued ~1,000 more kernels per
# step on a 375M model. torch offers no other way to opt in, so a shard type
# registers itself the way DTensor does; only instances of that type are
# affected. tests/test_optimizer_paths.py counts the ops of one step against
# plain DTensors.
_FOREACH_TYPE_REGISTRIES = (("torch.optim.optimizer", "_foreach_supported_types"),
                            ("torch.utils._foreach_utils", "_foreach_supported_types"))  # fmt: skip


def register_foreach_type(cls: type) -> None:
    """Make torch's optimizers and gradient utilities take their foreach
    paths for tensors of type ``cls`` (see [Note: shards take torch's foreach paths])."""
    import importlib

    for module_name, attr in _FOREACH_TYPE_REGISTRIES:
        registry = getattr(importlib.import_module(module_name), attr, None)
        if not isinstance(registry, list):
            raise ImportError(f"{module_name}.{attr} is gone or no longer a list; fxshard's shards would lose "
                              "torch's foreach optimizer paths: update fxshard.runtime.compat.register_foreach_type")  # fmt: skip
        if cls not in registry:
            registry.append(cls)


def local_tensor(dtensor: Any) -> torch.Tensor:
    """The plain tensor a DTensor holds (not a view of it)."""
    return dtensor._local_tensor


# ``local_tensor`` as a C-level getter, for ``map`` over many DTensors.
local_tensor_getter = operator.attrgetter("_local_tensor")


def replace_local_tensor(dtensor: Any, local: torch.Tensor) -> None:
    """Make ``dtensor`` (a parameter, say) hold ``local`` instead, keeping the
    DTensor object, so optimizers and references to it are unaffected.
    Unlike ``set_``, this leaves the old tensor and its views untouched:
    views already taken for a running call, and saved for its backward, keep
    their storage and version counter.

    The DTensor's own storage offset is fixed at construction and must equal
    its local tensor's, as for any DTensor: ``torch.save`` tells a
    storage-less wrapper by ``data_ptr() == 0``, which a nonzero offset breaks."""
    old = dtensor._local_tensor
    if local.shape != old.shape or local.dtype != old.dtype or local.stride() != old.stride():
        raise ValueError(f"replacement local tensor {local.shape}/{local.dtype} does not match {old.shape}/{old.dtype}")
    if local.storage_offset() != dtensor.storage_offset():
        raise ValueError(
            f"replacement local tensor starts at storage offset {local.storage_offset()}, the DTensor "
            f"at {dtensor.storage_offset()}; give the local tensor a storage of its own"
        )
    dtensor._local_tensor = local


def all_gather_async(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    """Start ``all_gather_single`` (torch >= 2.13; ``all_gather_into_tensor``
    before, deprecated since); returns the Work."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


def foreach_copy_(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair (casting), as one multi-tensor kernel
    (``torch._foreach_copy_``, in every torch fxshard supports)."""
    torch._foreach_copy_(dsts, srcs)


def all_gather_coalesced_async(outs: list[torch.Tensor], inps: list[torch.Tensor], group: Any, coalesce: bool) -> Any:
    """Start one all-gather of each ``inps[i]`` into ``outs[i]``
    (``world_size`` times as large); returns one Work for all. With
    ``coalesce`` (NCCL) it is one coalesced collective, one group launch
    (``ProcessGroup`` has had ``allgather_into_tensor_coalesced`` since torch
    2.1). Without, one all-gather each: gloo's coalesced all-gather corrupted
    the heap here (torch 2.13, two ranks, several in flight: 3 crashes in 10
    runs of the example, none in 12 with one all-gather each)."""
    if coalesce:
        return group.allgather_into_tensor_coalesced(outs, inps)
    return _AllWork([all_gather_async(o, i, group) for o, i in zip(outs, inps)])


class _AllWork:
    """Several Works waited as one."""

    def __init__(self, works: list[Any]) -> None:
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True


def reduce_scatter_async(out: torch.Tensor, inp: torch.Tensor, group: Any, average: bool = False) -> Any:
    """Start a ``reduce_scatter_single`` (``reduce_scatter_tensor`` before
    torch 2.13) that sums, or averages (NCCL only); returns the Work."""
    import torch.distributed as dist

    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    return fn(out, inp, op=op, group=group, async_op=True)


def all_reduce_async(tensor: torch.Tensor, group: Any, average: bool = False) -> Any:
    """Start an in-place ``all_reduce`` of ``tensor`` that sums, or averages
    (NCCL only; gloo's AVG is garbage, see ``Units._on_nccl``); returns the Work."""
    import torch.distributed as dist

    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    return dist.all_reduce(tensor, op=op, group=group, async_op=True)


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


def size_hint(value: Any) -> int:
    """An int for a size that may be symbolic (dynamic shapes): its example
    value, read without adding a guard (``int()`` on a SymInt would guard
    and so cause recompiles)."""
    if isinstance(value, int):
        return value
    from torch.fx.experimental import symbolic_shapes

    hint = getattr(symbolic_shapes, "optimization_hint", None) or getattr(symbolic_shapes, "hint_int", None)
    if hint is None:  # pragma: no cover - neither name in this torch
        return value.node.hint
    return int(hint(value))


def assert_async(ok: torch.Tensor, message: str) -> None:
    """Fail the device stream if ``ok`` (a one-element bool tensor) is false,
    without a host sync: a device-side assert, as an out-of-range index in
    ``F.embedding`` raises on GPU."""
    torch._assert_async(ok, message)


def inductor_row_alignment_bytes() -> int:
    """The byte alignment to which Inductor pads the rows (strides) of the
    buffers it lays out, where it pads."""
    from torch._inductor import config

    return int(getattr(config, "padding_alignment_bytes", 128))


# CUDA-graph capture (fxshard/graphs.py).


@contextlib.contextmanager
def stale_capture_stream_override() -> Iterator[None]:
    """During a capture, let autograd run a node whose recorded stream is not
    the capture stream on the capture stream instead (torch >= 2.13,
    ``set_override_stale_capture_stream``). The setting is process-wide, so
    it is restored on exit. On torch 2.11 and 2.12 this does nothing: there
    the warm-up calls run on the capture stream, so that every autograd node
    records that stream (which 2.13+ needs no less, but tolerates)."""
    setter = getattr(torch._C, "_set_override_stale_capture_stream", None)
    if setter is None:
        yield
        return
    getter = getattr(torch._C, "_override_stale_capture_stream", None)
    before = bool(getter()) if getter is not None else False
    setter(True)
    try:
        yield
    finally:
        setter(before)


@contextlib.contextmanager
def sync_debug_mode(mode: str) -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode`` in scope (it is process-wide)."""
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


@contextlib.contextmanager
def host_syncs_allowed() -> Iterator[None]:
    """Sync debug mode off in scope: compiling a graph may synchronize, and a
    captured step's last warm-up call checks only the step's own code."""
    if not torch.cuda.is_available() or torch.cuda.get_sync_debug_mode() == 0:
        yield
        return
    with sync_debug_mode("default"):
        yield


def is_sync_debug_error(error: BaseException) -> bool:
    """What ``set_sync_debug_mode("error")`` raises at a synchronizing call."""
    return isinstance(error, RuntimeError) and "called a synchronizing CUDA operation" in str(error)


def is_capture_error(error: BaseException) -> bool:
    """What CUDA raises for an operation a stream capture does not allow (a
    host sync, an allocation outside the pool's reach)."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and ("capturing" in text or "stream capture" in text)


def pool_reserved_bytes(pool: Any) -> int:
    """Bytes the caching allocator holds in the private pool ``pool`` (a
    ``graph_pool_handle()``), from its segments in the memory snapshot."""
    total = 0
    for segment in torch.cuda.memory_snapshot():
        if tuple(segment.get("segment_pool_id", ())) == tuple(pool):
            total += segment["total_size"]
    return total


class _BeforeDestroy:
    """Runs ``fn`` when ``destroy_process_group()`` destroys the default
    group, before any communicator is shut down: that function finalizes each
    object in the world's ``comms`` list first (torch >= 2.11)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def finalize(self) -> None:
        self.fn()


def call_before_destroy(fn: Callable[[], None]) -> bool:
    """Have ``destroy_process_group()`` call ``fn`` before it shuts down the
    default group's communicators (once; call again after each init).
    False where this torch has no such point: then only exit resets."""
    from torch.distributed import distributed_c10d as c10d

    comms = getattr(getattr(c10d, "_world", None), "comms", None)
    if not isinstance(comms, list):
        return False
    if not any(isinstance(c, _BeforeDestroy) and c.fn is fn for c in comms):
        comms.append(_BeforeDestroy(fn))
    return True


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
