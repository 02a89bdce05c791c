"""torch.distributed: process groups by name, the default and fake stores, a
mesh flattened to 1-D, the asynchronous collectives of fxshard's runtime,
and a hook that runs before ``destroy_process_group`` shuts communicators down."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = [
    "all_gather_async",
    "all_gather_coalesced_async",
    "all_reduce_async",
    "call_before_destroy",
    "concatenate_meshes",
    "default_store",
    "fake_store",
    "flat_mesh",
    "group_backend",
    "group_is_live",
    "reduce_scatter_async",
    "resolve_group",
]


def default_store() -> Any:
    """The key-value store of the default process group (every rank reaches it)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def fake_store() -> Any:
    """The store of torch's ``fake`` process group (importing it registers the
    backend): tracing and tests at any world size without other processes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def resolve_group(group_name: str) -> Any:
    """The ProcessGroup registered under ``group_name`` (what functional collectives take)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


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


def concatenate_meshes(meshes: list[Any]) -> Any:
    """One mesh whose dimensions are those of ``meshes``, slices of one root
    mesh, in order: FSDP2's mesh of a TP parameter, (dp, tp) (private
    ``DeviceMesh._concatenate``). Raises ``RuntimeError`` where the slices
    come from different roots or overlap."""
    from torch.distributed.device_mesh import DeviceMesh

    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is None:
        raise NotImplementedError(
            f"this torch ({torch.__version__}) cannot concatenate DeviceMeshes; tensor-parallel parameters need it"
        )
    return concatenate(list(meshes))


def group_backend(group_name: str) -> str:
    """The backend of a group by name: "nccl", "gloo", "fake", ..."""
    import torch.distributed as dist

    return str(dist.get_backend(resolve_group(group_name)))


def all_gather_async(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    """Start ``all_gather_single`` (torch >= 2.13; ``all_gather_into_tensor``
    before, deprecated since); returns the Work."""
    import torch.distributed as dist

    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=True)


def all_gather_coalesced_async(outs: list[torch.Tensor], inps: list[torch.Tensor], group: Any, coalesce: bool) -> Any:
    """Start one all-gather of each ``inps[i]`` into ``outs[i]``
    (``world_size`` times as large); returns one Work for all. With
    ``coalesce`` (NCCL) it is one coalesced collective, one group launch
    (``ProcessGroup`` has had ``allgather_into_tensor_coalesced`` since torch
    2.1). Without, one all-gather each: gloo's coalesced all-gather corrupts
    the heap in plain torch (2.13) when two of the group's worker threads run
    one at once, and one all-gather each did not (docs/notes/gloo-heap/)."""
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
