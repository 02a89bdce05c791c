"""The autograd engine: whether this thread runs inside a backward, whether
it accumulates into a leaf, and callbacks queued to run when a backward ends."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch._dynamo.compiled_autograd as compiled_autograd

__all__ = ["AtBackwardEnd", "accumulates_into", "in_backward"]


def _backward_task() -> int:
    """The id of the backward pass this thread runs in; -1 outside any."""
    return torch._C._current_graph_task_id()


def in_backward() -> bool:
    """Whether this thread runs inside a backward pass (a hook, a recompute)."""
    return _backward_task() != -1


def accumulates_into(node: torch.autograd.graph.Node) -> bool | None:
    """Whether the running backward will run ``node``, a leaf's
    ``AccumulateGrad``, so that the leaf's ``.grad`` takes what reaches it:
    in ``.backward()``, for every leaf or the ``inputs=`` it names. None
    where no leaf's ``.grad`` does: in ``autograd.grad()``, which returns
    the gradients instead (the engine refuses the question for a leaf
    there), and under compiled autograd, which traces the backward instead
    of running it."""
    if compiled_autograd.in_compiled_autograd_region:
        return None
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # "... we are currently running autograd.grad()"
        return None


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
