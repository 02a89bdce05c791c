"""Run a function on N gloo ranks, one process each, with a hard timeout.

A hang is a failure: every rank gets ``timeout`` seconds, then all are killed
and the test fails, instead of wedging the suite.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _entry(rank: int, world_size: int, out_dir: str, backend: str, env: dict, fn: Callable,
           args: tuple) -> None:  # fmt: skip
    import faulthandler

    import torch

    # A forkserver child inherits the server's environment, not the caller's.
    os.environ.clear()
    os.environ.update(env)
    # A rank that dies on a signal (a heap corruption's SIGABRT, a SIGSEGV)
    # prints every thread's Python stack to stderr, which pytest shows.
    faulthandler.enable(all_threads=True)
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    # A file store in this set's own folder, not a TCP port: sets of ranks
    # that run at once (pytest-xdist workers) never meet.
    dist.init_process_group(backend, init_method=f"file://{out_dir}/store", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        result = {"__error__": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if dist.is_initialized():  # ``fn`` may have destroyed it (a teardown test)
        dist.destroy_process_group()


_PRELOADED = False


def _preload_once() -> None:
    """Ranks fork from a server that imported torch and fxshard once (a
    spawned rank spends about 3 s importing torch, and as long again
    importing fxshard, which imports dynamo and AOTAutograd; the suite starts
    about 100 ranks). Imports only: the server runs no op, so no thread pool
    is forked."""
    global _PRELOADED
    if not _PRELOADED:
        import multiprocessing

        multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "fxshard"])
        _PRELOADED = True


def run_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 300, backend: str = "gloo") -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on each rank; return the results.

    ``backend="nccl"`` puts rank ``r`` on GPU ``r``.

    ``fn`` must be importable (a module-level function). A rank that raises
    returns ``{"__error__": traceback}``, reported by :func:`check_results`.
    """
    import torch

    # GPU ranks start from a fresh interpreter: a forkserver that imported
    # torch and fxshard is no place to fork CUDA processes from.
    method = "spawn" if backend == "nccl" else "forkserver"
    if method == "forkserver":
        _preload_once()
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry, args=(world_size, out_dir, backend, dict(os.environ), fn, args), nprocs=world_size,
            join=False, start_method=method,
        )  # fmt: skip
        try:
            deadline_left = timeout
            while not ctx.join(timeout=min(5.0, deadline_left)):
                deadline_left -= 5.0
                if deadline_left <= 0:
                    raise TimeoutError(f"{fn.__name__} on {world_size} ranks did not finish in {timeout} s (hang?)")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]


def selected(request: Any, argname: str, **where: Any) -> list[Any]:
    """The values of parameter ``argname`` in the tests of the requesting
    module that this session runs and whose other parameters equal ``where``:
    the cases for a fixture to run in one set of ranks. A deselected case
    (``-k``, ``-m``, [Note: full_cpu] in tests/conftest.py) does not run."""
    values = []
    for item in request.session.items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        if item.module is request.module and argname in params and all(params.get(k) == v for k, v in where.items()):
            values.append(params[argname])
    return list(dict.fromkeys(values))


def check_results(results: list[Any]) -> None:
    errors = [
        f"rank {r}:\n{res['__error__']}"
        for r, res in enumerate(results)
        if isinstance(res, dict) and "__error__" in res
    ]
    if errors:
        raise AssertionError("\n".join(errors))
