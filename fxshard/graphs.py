"""``fxshard.cuda_graph``: a whole training step captured as one CUDA graph.

[Note: captured steps]
At small batch a step is bound by kernel launches and host work, not by the
GPU. ``cuda_graph(step)`` runs ``step`` eagerly for ``warmup`` calls (they
compile the model, form its units, create gradients and optimizer state),
captures the next call with ``torch.cuda.graph``, and replays the capture on
every call after. One graph holds the forward with its all-gathers, the loss,
the backward with its re-gathers and reduce-scatters, the optimizer step and
the zeroing of gradients: nothing of the step runs on the host in a replay.

How it is made safe:
- Warm-up and capture run on one side stream, the capture stream: on torch
  2.11/2.12 autograd records a node's stream in the warm-up and must find the
  capture stream there (2.13+ can override it; ``compat``).
- Before capturing, the models and optimizers the last warm-up call ran are
  checked: one graph per model (the sequenced path has Python between its
  graphs), CUDA and NCCL, capturable optimizers. The last warm-up call runs
  with ``set_sync_debug_mode("error")``, so a host sync in the step
  (``loss.item()``, ``print(loss)``) raises there, before the capture has
  issued a collective. Collectives of an aborted capture would leave the
  ranks' communicators out of step.
- Arguments are copied into the captured inputs; a changed shape, dtype or
  non-tensor argument raises instead of replaying stale values.
- A replay reads the tensors that existed at capture: every parameter shard,
  gradient and optimizer state. Each call checks they are still the same
  tensors (a checkpoint load into new tensors, ``zero_grad()`` outside the
  step), that every parameter trains or is frozen as at the capture, and
  that the optimizers' plain-number settings (a float learning rate a
  scheduler changes) did not move; each raises, naming ``reset()``, which
  captures again on the next call.

Buffers: every tensor the step allocates, the collectives' gathered units and
reduce buffers among them, comes from the capture's private pool, at the
address the capture gave it; replays reuse those addresses. The passes'
static buffer plan (``passes/buffers.py``) lays the collective buffers out
from liveness and predicts the step's peak (``CapturedStep.memory``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import logging
import operator
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

from fxshard.module.root import CALLED_ROOTS
from fxshard.passes.memory import step_transient
from fxshard.runtime import compat, process

log = logging.getLogger("fxshard")

_NUMBER = (bool, int, float, complex, str, type(None))


@dataclasses.dataclass(frozen=True)
class StepMemory:
    """Memory of a captured step, in bytes.

    ``persistent``: allocated when the capture began (shards, gradients,
    optimizer state, the captured inputs, whatever else the process holds).
    ``predicted_peak``: ``persistent`` plus the step's transient peak as the
    passes predict it from the compiled graphs' liveness (None where no
    estimate exists: the graphs came from torch's compile cache and their
    estimates file is gone). ``measured_peak``: the most allocated while
    capturing, which is what every replay uses. ``pool_reserved``: what the
    capture's private pool holds on the GPU (its blocks, rounded up by the
    caching allocator). ``outside_free``: what the allocator holds free
    outside the pool, in segments that live tensors keep (see [Note: memory
    outside the pool]); the pool cannot use it."""

    persistent: int
    predicted_peak: int | None
    measured_peak: int
    pool_reserved: int
    outside_free: int = 0

    def format(self) -> str:
        gib = lambda b: f"{b / 2**30:.3f} GiB"  # noqa: E731
        predicted = (
            gib(self.predicted_peak)
            if self.predicted_peak is not None
            else "none (the graphs came from torch's compile cache, without fxshard's estimates)"
        )
        return (f"captured step memory: predicted peak {predicted}, measured {gib(self.measured_peak)} "
                f"(persistent {gib(self.persistent)}; pool reserved {gib(self.pool_reserved)}; free outside the "
                f"pool {gib(self.outside_free)})")  # fmt: skip


# [Note: memory outside the pool]
# A replay allocates only from the capture's private pool. Whatever the
# caching allocator holds free in its other segments stays reserved beside
# it: segments that also hold live tensors cannot be given back. The
# warm-ups fill such segments: optimizer state made in the blocks that the
# first step's activations left, next to parameter shards made while the
# full model was freed. An uncaptured step computes in those free blocks;
# a captured one cannot, and reserved 1.14x (375M) to 1.20x (OLMoE) the
# uncaptured step's memory on one H200 at a fake world of 4. With
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True segments grow and shrink
# by pages, and the same steps reserved 1.02x to 1.04x. That setting is the
# process's, not fxshard's to make, so the capture says what is held and
# names it.
_OUTSIDE_FREE_HINT = 0.05  # of all reserved memory, past which the capture names the setting


@dataclasses.dataclass
class _Signature:
    """What a call passed, as the capture fixed it."""

    spec: Any  # the pytree spec of (args, kwargs)
    tensors: list[tuple[int, torch.Size, torch.dtype, torch.device]]  # leaf index, shape, dtype, device
    constants: dict[int, Any]  # leaf index -> non-tensor value


class CapturedStep:
    """A step function run as one CUDA graph; see [Note: captured steps].

    Call it as the function. It returns the graph's static outputs: tensors
    that the next call overwrites, as with ``torch.cuda.make_graphed_callables``
    (``.clone()`` one to keep it; ``loss.item()`` after the call is fine).
    """

    def __init__(self, fn: Callable[..., Any], warmup: int = 2) -> None:
        if not callable(fn):
            raise ValueError(f"fxshard.cuda_graph takes the step function, got {type(fn).__name__}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 1:
            raise ValueError(
                f"fxshard.cuda_graph: warmup must be an int >= 1 (eager calls before the capture; the first one "
                f"compiles), got {warmup!r}"
            )
        functools.update_wrapper(self, fn)
        self.fn, self.warmup = fn, warmup
        self.calls = 0  # since the last reset
        self.memory: StepMemory | None = None
        self._stream: torch.cuda.Stream | None = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._pool: Any = None
        self._signature: _Signature | None = None
        self._static: list[torch.Tensor] = []  # the captured inputs, in leaf order
        self._out: Any = None
        self._models: list[weakref.ref] = []  # the fxshard models the capture ran
        self._optimizers: list[weakref.ref] = []
        self._held: _Held | None = None  # what replays read
        self._settings: list[list[dict]] = []  # per optimizer, per group, its plain-number settings
        # What the last warm-up call ran: models and optimizers.
        self._ran: tuple[list[nn.Module], list[torch.optim.Optimizer]] = ([], [])
        _LIVE.add(self)

    @property
    def captured(self) -> bool:
        return self._graph is not None

    @property
    def models(self) -> list[nn.Module]:
        """The fxshard models the step called in its capture."""
        return [m for m in (r() for r in self._models) if m is not None]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if self._graph is not None:
            return self._replay(leaves, spec)
        if self.calls == 0:
            _check_can_capture(leaves)
        if self.calls < self.warmup:
            return self._warm(args, kwargs)
        return self._capture(leaves, spec)

    def reset(self) -> None:
        """Free the graph and its pool; the next call warms up and captures
        again. Call it after replacing what a replay reads (loading a
        checkpoint into new tensors), and before ``destroy_process_group``
        (fxshard also does this at exit)."""
        if self._graph is not None and torch.cuda.is_initialized():
            torch.cuda.synchronize()  # no replay may be running when the graph goes
        self._graph = self._pool = self._out = self._signature = self.memory = None
        self._static, self._models, self._optimizers, self._held, self._settings = [], [], [], None, []
        self._ran = ([], [])
        self.calls = 0

    # Warm-up and capture.

    def _warm(self, args: tuple, kwargs: dict) -> Any:
        last = self.calls == self.warmup - 1
        # Blocks cached on other streams (the model's build on the default
        # stream, say) are never reused on the capture stream: without this,
        # a warm-up on it reserved more memory than a plain step does.
        torch.cuda.empty_cache()
        stream = self._capture_stream()
        stream.wait_stream(torch.cuda.current_stream())
        # The last warm-up runs with host syncs as errors, unless it is also the
        # first call, which compiles (compiles may sync).
        checked = last and self.calls > 0
        with _recording() as (models, optimizers), torch.cuda.stream(stream):
            try:
                with compat.sync_debug_mode("error") if checked else contextlib.nullcontext():
                    out = self.fn(*args, **kwargs)
            except RuntimeError as error:
                if not compat.is_sync_debug_error(error):
                    raise
                self._check_ran(models, optimizers)  # a more specific cause first
                raise ValueError(
                    "fxshard.cuda_graph: the step synchronizes the host with the GPU (`.item()`, `print(tensor)`, "
                    "`.cpu()`, `.tolist()`, a data-dependent shape such as `nonzero`); a captured step cannot. "
                    "Return the tensor from the step and read it after the call: loss = step(x); loss.item(). "
                    f"Torch said: {str(error).splitlines()[0]}"
                ) from error
        torch.cuda.current_stream().wait_stream(stream)
        self.calls += 1
        if last:
            self._check_ran(models, optimizers)
        return out

    def _capture(self, leaves: list[Any], spec: Any) -> Any:
        models, optimizers = self._ran
        self._signature = _signature_of(leaves, spec)
        self._static = [leaves[i].detach().clone() for i, *_ in self._signature.tensors]
        static_args, static_kwargs = self._with_static(leaves, spec)
        stream = self._capture_stream()
        graph, pool = torch.cuda.CUDAGraph(), torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        persistent = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        graphs_before = [len(m.fxshard_plan.graphs) for m in models]
        for model in models:  # replays run no Python: ZeRO-1's gather must be in the graph (see [Note: ZeRO-1])
            kept = model.fxshard_plan.root.shards.kept
            if kept is not None:
                kept.stale = True
        try:
            with compat.stale_capture_stream_override(), _recording():
                with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                    out = self.fn(*static_args, **static_kwargs)
        except RuntimeError as error:
            compiled = [m for m, n in zip(models, graphs_before) if len(m.fxshard_plan.graphs) != n]
            if compiled:
                error.add_note("fxshard.cuda_graph: the model compiled a new graph while the step was captured; make "
                               "the warm-up calls run exactly what later calls run (same shapes and modes), or "
                               "raise warmup=")  # fmt: skip
            elif compat.is_capture_error(error):
                error.add_note("fxshard.cuda_graph: CUDA refused an operation of the step while capturing it; a "
                               "host sync (`.item()`, printing a tensor) or a CPU tensor in the step are the usual "
                               "causes")  # fmt: skip
            raise
        self._graph, self._pool, self._out = graph, pool, out
        self._freeze(models, optimizers)
        process.before_destroy(reset_all)
        measured = torch.cuda.max_memory_allocated()
        pool_reserved, outside_free = compat.pool_memory(pool)
        self.memory = StepMemory(persistent, _predicted_peak(models, persistent), measured, pool_reserved,
                                 outside_free)  # fmt: skip
        log.info("fxshard: %s", self.memory.format())
        hint = _outside_free_hint(outside_free, torch.cuda.memory_reserved(), compat.expandable_segments())
        if hint:
            log.warning(hint)
        graph.replay()  # the capture ran nothing: this call's step
        self.calls += 1
        return out

    def _freeze(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        """Remember what replays read, to check it on every call."""
        self._models = [weakref.ref(m) for m in models]
        self._optimizers = [weakref.ref(o) for o in optimizers]
        self._held = _Held(models, optimizers)
        self._syncs = [m.fxshard_plan.root.sync for m in models]
        self._settings = [_plain_settings(o) for o in optimizers]

    def _capture_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _check_ran(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        """Whether what the warm-up ran can be captured; raises if not."""
        for model in models:
            plan = model.fxshard_plan
            if plan.topology.experts is not None:
                raise ValueError(
                    f"fxshard.cuda_graph: {type(model).__name__} has expert-parallel parameters (see [Note: "
                    "expert-parallel parameters]); its token dispatch reads the all-to-all split sizes on the host "
                    "(`tolist()`), which a captured step cannot. Call the step without fxshard.cuda_graph"
                )
            if plan.topology.tensor_parallel:
                raise ValueError(
                    f"fxshard.cuda_graph: {type(model).__name__} has tensor-parallel parameters (see [Note: "
                    "tensor-parallel parameters]); capturing a step with them is not supported yet. Call the step "
                    "without fxshard.cuda_graph"
                )
            if plan.sequenced:
                raise ValueError(
                    f"fxshard.cuda_graph: {type(model).__name__} runs as several graphs with Python between them "
                    "(fxshard's sequenced reads), which one CUDA graph cannot hold. Remove the graph break; "
                    f"model.fxshard_plan.graph_break_reason says: {plan.graph_break_reason}"
                )
            if plan.root.pending():
                raise ValueError(
                    f"fxshard.cuda_graph: the step leaves {type(model).__name__}'s gradients kept without sync "
                    "(set_requires_gradient_sync(False)), and a replay cannot carry them to the next call. Capture "
                    "every micro-batch of one optimizer step, the last with set_requires_gradient_sync(True)"
                )
            topology = plan.topology
            if topology.device.type != "cuda":
                raise ValueError(f"fxshard.cuda_graph: {type(model).__name__} is sharded over a "
                                 f"{topology.device.type} mesh; CUDA graphs need a CUDA mesh with NCCL")  # fmt: skip
            backend = topology.shard.backend
            # At one rank too: on a one-rank gloo group, replays gave other
            # losses than plain steps (seen on an H200); NCCL's did not.
            if backend != "nccl":
                raise ValueError(f"fxshard.cuda_graph: {type(model).__name__}'s process group is {backend}; a "
                                 "captured step's collectives need NCCL: init_process_group('nccl')")  # fmt: skip
        for opt in optimizers:
            for group in opt.param_groups:
                if group.get("capturable") is False:
                    raise ValueError(
                        f"fxshard.cuda_graph: this {type(opt).__name__} is not capturable (its step reads its "
                        f"step count on the host); build it with capturable=True, e.g. "
                        f"torch.optim.{type(opt).__name__}(model.parameters(), fused=True, capturable=True)"
                    )
        self._ran = (list(dict.fromkeys(models)), list(dict.fromkeys(optimizers)))

    # Replay.

    def _replay(self, leaves: list[Any], spec: Any) -> Any:
        sig = self._signature
        if spec != sig.spec:
            raise ValueError(f"fxshard.cuda_graph: the step was captured with arguments {sig.spec}; this call "
                             f"passes {spec}. Call reset() to capture again, or keep one graph per signature")  # fmt: skip
        srcs = []
        for i, shape, dtype, device in sig.tensors:
            t = leaves[i]
            if not isinstance(t, torch.Tensor) or t.shape != shape or t.dtype != dtype or t.device != device:
                got = f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(
                    f"fxshard.cuda_graph: argument {i} was captured as {tuple(shape)} {dtype} on {device} and is "
                    f"now {got}; a graph replays fixed shapes and dtypes. Pad batches to one shape, or "
                    "use one fxshard.cuda_graph step per shape"
                )
            srcs.append(t)
        for i, value in sig.constants.items():
            if not _same_constant(leaves[i], value):
                raise ValueError(
                    f"fxshard.cuda_graph: non-tensor argument {i} was {value!r} at capture and is now "
                    f"{leaves[i]!r}; the graph replays what the capture saw. Pass it as a tensor, or call "
                    "reset() to capture again"
                )
        self._check_held()
        copies = [(s, t) for s, t in zip(self._static, srcs) if s is not t]
        if copies:
            torch._foreach_copy_([s for s, _ in copies], [t for _, t in copies])
        self._graph.replay()
        self.calls += 1
        return self._out

    def _check_held(self) -> None:
        models = [m() for m in self._models]
        optimizers = [o() for o in self._optimizers]
        if any(x is None for x in (*models, *optimizers)):
            raise ValueError("fxshard.cuda_graph: a model or optimizer the step was captured with is gone; "
                             "call reset() to capture again")  # fmt: skip
        syncs = [m.fxshard_plan.root.sync for m in models]
        if syncs != self._syncs:
            raise ValueError(
                "fxshard.cuda_graph: set_requires_gradient_sync changed since the capture, and a replay runs the "
                "captured phase. Toggle it inside the captured step (all micro-batches of one optimizer step), "
                "or call step.reset() to capture again"
            )
        if not self._held.frozen_alike():
            raise ValueError(
                "fxshard.cuda_graph: a parameter was frozen or unfrozen (requires_grad) since the capture, and a "
                "replay would still train what the capture trained. Call step.reset() after changing what "
                "trains, to capture again"
            )
        if not self._held.same():
            raise ValueError(
                "fxshard.cuda_graph: a parameter shard, gradient or optimizer state the step was captured with was "
                "replaced by another tensor (loading a checkpoint into new tensors, zero_grad(set_to_none=True) or "
                "setting .grad outside the step, a new optimizer state), so a replay would read the old one. Call "
                "step.reset() after such a change to capture again, and zero gradients inside the step "
                "(opt.zero_grad() there is fine)"
            )
        for opt, before in zip(optimizers, self._settings):
            now = _plain_settings(opt)
            if now != before:
                changed = next(f"{k}: {before[g][k]!r} -> {now[g][k]!r}" for g in range(len(now))
                               for k in now[g] if now[g][k] != before[g].get(k))  # fmt: skip
                raise ValueError(
                    f"fxshard.cuda_graph: an optimizer setting changed after capture ({changed}); the graph "
                    "replays the captured value. Make it a tensor and change it in place, e.g. "
                    "AdamW(params, lr=torch.tensor(3e-4, device='cuda'), fused=True, capturable=True), or call "
                    "step.reset() to capture again"
                )

    def _with_static(self, leaves: list[Any], spec: Any) -> tuple[tuple, dict]:
        leaves = list(leaves)
        for (i, *_), static in zip(self._signature.tensors, self._static):
            leaves[i] = static
        return pytree.tree_unflatten(leaves, spec)


def cuda_graph(fn: Callable[..., Any] | None = None, *, warmup: int = 2) -> Any:
    """Capture a whole training step as one CUDA graph: ``@fxshard.cuda_graph``
    or ``fxshard.cuda_graph(step, warmup=2)``. See [Note: captured steps].

    The first ``warmup`` calls run ``fn`` as it is; the next captures it and
    replays it; every later call copies its tensor arguments into the
    captured inputs and replays. Returned tensors are the graph's static
    outputs, valid until the next call (as with
    ``torch.cuda.make_graphed_callables``). Needs CUDA, NCCL, models that
    fxshard compiled to one graph, and capturable optimizers
    (``AdamW(..., fused=True, capturable=True)``); zero gradients inside the
    step (``opt.zero_grad()``: the captured gradients then live in the
    graph's pool, with no second persistent set). ``reset()`` frees the graph.
    """
    if fn is None:
        return functools.partial(cuda_graph, warmup=warmup)
    return CapturedStep(fn, warmup)


# Every step with a graph; reset at exit and before destroy_process_group():
# NCCL (2.28 on H200s, torch 2.11) blocks for good destroying a communicator
# that a live graph's collectives use.
_LIVE: weakref.WeakSet[CapturedStep] = weakref.WeakSet()


def reset_all() -> None:
    """Reset every captured step of this process."""
    for step in list(_LIVE):
        step.reset()


process.at_exit(reset_all)


@contextlib.contextmanager
def _recording() -> Iterator[tuple[list[nn.Module], list[torch.optim.Optimizer]]]:
    """The fxshard models and the optimizers that step inside the scope."""
    models: list[nn.Module] = []
    optimizers: list[torch.optim.Optimizer] = []
    token = CALLED_ROOTS.set(models)
    try:
        with process.before_each_step(lambda opt, args, kwargs: optimizers.append(opt)):
            yield models, optimizers
    finally:
        CALLED_ROOTS.reset(token)


def _outside_free_hint(outside_free: int, reserved: int, expandable: bool) -> str | None:
    """What to say of memory held free outside the pool (see [Note: memory
    outside the pool]), or None where it is small or nothing would help."""
    if expandable or outside_free <= _OUTSIDE_FREE_HINT * reserved:
        return None
    return (
        f"fxshard.cuda_graph: {outside_free / 2**30:.2f} GiB of the {reserved / 2**30:.2f} GiB reserved is free "
        "outside the captured step's pool, in segments that live tensors (optimizer state, parameter shards) keep, "
        "and a replay cannot use it. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, set before the process "
        "first allocates on the GPU, lets the allocator give such memory back"
    )


def _check_can_capture(leaves: list[Any]) -> None:
    """What can be told before the first call runs anything."""
    if not torch.cuda.is_available():
        raise ValueError("fxshard.cuda_graph: CUDA graphs need a CUDA device; on CPU, call the step function itself")
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "cuda":
            raise ValueError(f"fxshard.cuda_graph: argument {i} is on {leaf.device}; a captured step reads its inputs "
                             "on the GPU: move it there first (x.cuda(non_blocking=True))")  # fmt: skip
    if dist.is_initialized() and dist.get_world_size() > 1 and "nccl" not in str(dist.get_backend()):
        raise ValueError(f"fxshard.cuda_graph: the default process group is {dist.get_backend()}; a captured step's "
                         "collectives need NCCL: init_process_group('nccl')")  # fmt: skip


def _signature_of(leaves: list[Any], spec: Any) -> _Signature:
    tensors, constants = [], {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            tensors.append((i, leaf.shape, leaf.dtype, leaf.device))
        else:
            constants[i] = leaf
    return _Signature(spec, tensors, constants)


def _same_constant(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if type(a) is not type(b) or not isinstance(a, _NUMBER):
        return False  # other objects: only the captured one itself
    return a == b


class _Held:
    """What a replay reads, by identity: each module's parameter objects,
    their local shards and gradients, and every optimizer's state tensors.

    ``same()`` runs before every replay, while the GPU waits when the caller
    reads the loss each step, so it compares whole lists with C-level
    ``map`` rather than a Python loop per parameter (whose host time grows
    with the parameters and optimizer states, and delays every replay)."""

    def __init__(self, models: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> None:
        entries = [(module._parameters, name, p) for model in models for module in model.modules()
                   for name, p in module._parameters.items() if p is not None]  # fmt: skip
        self.dicts = [d for d, _, _ in entries]
        self.names = [n for _, n, _ in entries]
        self.params = [p for _, _, p in entries]
        self.dtensors = [p for p in self.params if isinstance(p, DTensor)]
        self.locals = list(map(compat.local_tensor_getter, self.dtensors))
        stepped = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        self.with_grads = list({id(p): p for p in (*self.params, *stepped)}.values())
        self.grads = list(map(_GRAD, self.with_grads))
        self.trained = list(map(_REQUIRES_GRAD, self.params))
        self.state_maps = [opt.state for opt in optimizers]
        self.optimizers = list(optimizers)
        self.states = self._states()
        self.state_sizes = list(map(len, self.states))
        self.state_values = self._values(self.states)

    def _states(self) -> list[dict]:
        return list(itertools.chain.from_iterable(opt.state.values() for opt in self.optimizers))

    @staticmethod
    def _values(states: list[dict]) -> list[Any]:
        return list(itertools.chain.from_iterable(map(dict.values, states)))

    def frozen_alike(self) -> bool:
        """Whether every parameter trains or is frozen as at the capture."""
        return list(map(_REQUIRES_GRAD, self.params)) == self.trained

    def same(self) -> bool:
        if not _identical(map(dict.get, self.dicts, self.names), self.params):
            return False
        if not _identical(map(compat.local_tensor_getter, self.dtensors), self.locals):
            return False
        if not _identical(map(_GRAD, self.with_grads), self.grads):
            return False
        # load_state_dict replaces the whole state map; a changed entry or key shows in the lists.
        if not _identical((opt.state for opt in self.optimizers), self.state_maps):
            return False
        states = self._states()
        return (
            _identical(states, self.states)
            and list(map(len, states)) == self.state_sizes
            and _identical(self._values(states), self.state_values)
        )


_GRAD = operator.attrgetter("grad")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")


def _identical(now: Iterable[Any], before: list[Any]) -> bool:
    """Whether ``now`` yields exactly the objects of ``before``, in order."""
    now = list(now)
    return len(now) == len(before) and all(map(operator.is_, now, before))


def _plain_settings(opt: torch.optim.Optimizer) -> list[dict]:
    """Each group's settings that a graph freezes: plain numbers (a tensor
    setting is read from its memory on every replay)."""
    return [{k: v for k, v in group.items() if k != "params" and isinstance(v, (*_NUMBER, tuple))}
            for group in opt.param_groups]  # fmt: skip


def _predicted_peak(models: list[nn.Module], persistent: int) -> int | None:
    """``persistent`` plus the largest transient peak the passes predict for
    one training step of one of ``models`` (see [Note: peak estimate]).
    Eager code of the step (a loss computed outside the model) is in no
    graph, so it is not predicted."""
    peaks = [p for m in models for record in m.fxshard_plan.graphs if (p := step_transient(record)) is not None]
    return persistent + max(peaks) if peaks else None
