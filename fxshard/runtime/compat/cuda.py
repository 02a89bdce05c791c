"""CUDA, for captured steps (fxshard/graphs.py): stream capture, sync debug
mode, the errors a capture or a forbidden sync raises, and the memory a
graph pool holds."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "host_syncs_allowed",
    "is_capture_error",
    "is_sync_debug_error",
    "expandable_segments",
    "pool_memory",
    "stale_capture_stream_override",
    "sync_debug_mode",
]


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


def pool_memory(pool: Any) -> tuple[int, int]:
    """Bytes the caching allocator holds in the private pool ``pool`` (a
    ``graph_pool_handle()``), and bytes it holds free outside it (in
    segments that live tensors keep reserved), from the memory snapshot."""
    inside = outside_free = 0
    for segment in torch.cuda.memory_snapshot():
        if tuple(segment.get("segment_pool_id", ())) == tuple(pool):
            inside += segment["total_size"]
        else:
            outside_free += segment["total_size"] - segment["allocated_size"]
    return inside, outside_free


def expandable_segments() -> bool:
    """Whether the caching allocator was configured with expandable segments
    (``PYTORCH_CUDA_ALLOC_CONF``, or ``PYTORCH_ALLOC_CONF`` since torch 2.9)."""
    settings = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    return "expandable_segments:true" in settings.replace(" ", "").lower()
