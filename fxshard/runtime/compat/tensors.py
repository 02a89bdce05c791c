"""Tensors and DTensors: a DTensor's local tensor and spec, making a tensor
subclass a parameter that takes torch's foreach optimizer paths, and tensor
ops torch keeps private (multi-tensor copy, device-side assert)."""

from __future__ import annotations

import operator
from typing import Any

import torch

__all__ = [
    "assert_async",
    "disable_torch_function_subclass",
    "dtensor_of_spec",
    "dtensor_spec",
    "foreach_copy_",
    "is_strided_shard",
    "local_tensor",
    "local_tensor_getter",
    "mark_parameter",
    "register_foreach_type",
    "replace_local_tensor",
    "strided_shard",
]


def disable_torch_function_subclass() -> Any:
    """Run torch functions on a tensor subclass as on a plain tensor (what
    ``Tensor.__torch_function__`` does around each call)."""
    return torch._C.DisableTorchFunctionSubclass()


def dtensor_spec(dtensor: Any) -> Any:
    """A DTensor's spec (mesh, placements, global shape), to build another DTensor of it."""
    return dtensor._spec


def dtensor_of_spec(local: torch.Tensor, spec: Any) -> Any:
    """A DTensor of ``spec`` holding ``local`` itself, as FSDP2's
    ``_from_local_no_grad`` makes its gradients: ``DTensor.from_local``
    builds a spec and runs an autograd function per call, which costs host
    time per parameter on every step. ``spec`` must describe ``local``
    (its dtype; its shape as this rank's part of the spec's)."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=False)


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
# the per-parameter loop: the default ``AdamW`` then launches each of its
# kernels once per parameter instead of once over all of them. torch offers
# no other way to opt in, so a shard type registers itself the way DTensor
# does; only instances of that type are affected.
# tests/test_optimizer_paths.py counts the ops of one step against plain
# DTensors.
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


def foreach_copy_(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair (casting), as one multi-tensor kernel
    (``torch._foreach_copy_``, in every torch fxshard supports)."""
    torch._foreach_copy_(dsts, srcs)


def assert_async(ok: torch.Tensor, message: str) -> None:
    """Fail the device stream if ``ok`` (a one-element bool tensor) is false,
    without a host sync: a device-side assert, as an out-of-range index in
    ``F.embedding`` raises on GPU."""
    torch._assert_async(ok, message)


def strided_shard(dim: int, split_factor: int) -> Any:
    """DTensor's ``_StridedShard(dim, split_factor=...)`` (private): the
    data-parallel placement of a dimension that TP already shards into
    ``split_factor`` pieces, each piece cut again (FSDP2's layout of such a
    parameter; see [Note: tensor-parallel parameters])."""
    from torch.distributed.tensor import placement_types

    cls = getattr(placement_types, "_StridedShard", None)
    if cls is None:
        raise NotImplementedError(
            f"this torch ({torch.__version__}) has no _StridedShard placement; a tensor-parallel parameter "
            "sharded on dim 0 needs it"
        )
    return cls(dim, split_factor=split_factor)


def is_strided_shard(placement: Any) -> bool:
    """Whether ``placement`` is a ``_StridedShard`` (a subclass of ``Shard`` to torch)."""
    from torch.distributed.tensor import placement_types

    cls = getattr(placement_types, "_StridedShard", None)
    return cls is not None and isinstance(placement, cls)
