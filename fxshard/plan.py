"""The plan: how each parameter is placed, gathered, reduced and kept.

``fxshard.compile`` builds one ``ParamPlan`` per distinct parameter from the
user's options, once, before anything is sharded (``build_plan``). Sharding,
the read path and the summaries take their facts from it.

[Note: replicated parameters]
A parameter is replicated (every rank holds all of it, a ``Replicate()``
DTensor) when the user asked for it (``fxshard.no_shard``), when it is
0-dimensional, or when it is frozen at compile time and the frozen
parameters fit (``shard_frozen``).
Reading one gathers nothing. Its gradient, if it gets one, is all-reduced
(averaged) over the mesh: ``fxshard::replicate`` marks the read in compiled
graphs, and its autograd formula is that all-reduce. A frozen parameter
reads as a plain tensor and never meets a collective; if it is unfrozen
later, dynamo's guard on ``requires_grad`` recompiles, and the read then
carries the all-reduce. So a gradient is never left unreduced.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fxshard.module.shards import ShardParameter
from fxshard.module.writes import GatheredParameter
from fxshard.policy import MixedPrecision
from fxshard.runtime import compat
from fxshard.runtime.plans import Lifetime, ParamPlan, Placement, Reduce, placement_text, reduce_text
from fxshard.runtime.topology import Topology

# Frozen parameters are replicated by default only while, replicated, they
# take at most this share of the device's memory.
FROZEN_REPLICATE_SHARE = 0.25


# Modules and parameters that fxshard.no_shard marked, until compile reads them.
# By id (a tensor compares elementwise, so it cannot be a set member), weakly.
_NO_SHARD: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()


def no_shard(target: nn.Module | nn.Parameter) -> nn.Module | nn.Parameter:
    """Keep ``target``'s parameters (a module's, recursively, or one
    parameter) replicated on every rank when ``fxshard.compile`` shards the
    model: no all-gather, and a gradient all-reduced (averaged) over the
    mesh instead of reduce-scattered. Call it before ``fxshard.compile``;
    returns ``target``. For parameters small enough that a gather costs more
    than it saves, or that a kernel reads whole outside the forward."""
    # A shard, not any DTensor: tensor parallelism's parameters are DTensors before compile.
    compiled = isinstance(target, (ShardParameter, GatheredParameter)) or (
        isinstance(target, nn.Module) and any(isinstance(p, ShardParameter) for p in target.parameters())
    )
    if compiled:
        raise ValueError(
            "fxshard.no_shard was called after fxshard.compile; mark parameters before compiling: "
            "fxshard.no_shard(model.vision); model = fxshard.compile(model, mesh)"
        )
    if not isinstance(target, (nn.Module, nn.Parameter)):
        raise ValueError(
            f"fxshard.no_shard takes a module or an nn.Parameter, got {type(target).__name__}; "
            "e.g. fxshard.no_shard(model.vision_tower) or fxshard.no_shard(model.head.weight)"
        )
    _NO_SHARD[id(target)] = target
    return target


def marked(model: nn.Module) -> set[int]:
    """Ids of the parameters of ``model`` that ``no_shard`` marked, directly or through a module."""
    marked = {id(p) for p in model.parameters() if _NO_SHARD.get(id(p)) is p}
    for module in model.modules():
        if _NO_SHARD.get(id(module)) is module:
            marked.update(id(p) for p in module.parameters())
    return marked


def device_memory(device: torch.device) -> int | None:
    """This rank's device memory in bytes (RAM for the CPU); None if unknown."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            return None
    return None


def distinct_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Each parameter once (tied weights: by its first owner's path)."""
    seen: set[int] = set()
    for mod_name, mod in model.named_modules():
        for attr, param in mod._parameters.items():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            yield (f"{mod_name}.{attr}" if mod_name else attr), param


def build_plan(
    model: nn.Module,
    topology: Topology,
    mp: MixedPrecision,
    reduce_group_name: str,
    sharded_lifetime: Lifetime,
    shard_frozen: bool,
    memory: int | None,
    whole: set[int],
) -> dict[int, ParamPlan]:
    """Each distinct parameter's plan, by the parameter's id, in registration
    order. ``topology``: the mesh it is sharded over. ``sharded_lifetime``: how
    long a sharded parameter's gathered value lives (the ZeRO stage). ``memory``: the smallest
    device memory of all ranks (bytes), so that every rank decides alike
    whether frozen parameters fit. ``whole``: what ``marked`` returns."""
    params = list(distinct_parameters(model))
    # Frozen tensor-parallel parameters are sharded, as FSDP2 shards them:
    # fxshard does not keep a TP parameter replicated over dp yet.
    frozen = [p for _, p in params if not p.requires_grad and id(p) not in whole and not isinstance(p, DTensor)]
    replicate_frozen = not shard_frozen
    if replicate_frozen and frozen:
        frozen_bytes = sum(p.numel() * p.element_size() for p in frozen)
        if memory is not None and frozen_bytes > FROZEN_REPLICATE_SHARE * memory:
            import logging

            logging.getLogger("fxshard").warning(
                "fxshard: the %d frozen parameters (%.2f GiB) would take more than %d%% of this device's memory "
                "replicated; sharding them. Pass shard_frozen=True to say so, or fxshard.no_shard(...) to "
                "replicate some of them",
                len(frozen), frozen_bytes / 2**30, int(FROZEN_REPLICATE_SHARE * 100),
            )  # fmt: skip
            replicate_frozen = False
    replicas = topology.replicas
    expert_reduce = topology.expert_reduce_group() if topology.experts is not None else ""
    plans: dict[int, ParamPlan] = {}
    for fqn, param in params:
        # A tensor-parallel parameter is sharded as its TP-local tensor (see
        # [Note: tensor-parallel parameters]).
        tp = topology.tp_layout(param) if isinstance(param, DTensor) else None
        local = compat.local_tensor(param) if tp is not None else param
        # A 0-dimensional parameter (a learned scale) has no dim 0 to shard.
        replicated = (
            id(param) in whole or param.dim() == 0 or (replicate_frozen and not param.requires_grad and tp is None)
        )
        if replicated:
            reduce = Reduce.ALL_REDUCE if param.requires_grad else Reduce.NONE
            lifetime = Lifetime.ALWAYS
        else:
            reduce = Reduce.REDUCE_SCATTER if param.requires_grad else Reduce.NONE
            lifetime = sharded_lifetime
        dtype = mp.param_dtype if mp.param_dtype not in (None, param.dtype) else None
        # An expert's is sharded over the experts' group, its gradient summed
        # over its EP group already (see [Note: expert-parallel parameters]).
        expert = tp is not None and tp.expert
        group = topology.sharded_over(tp)
        plans[id(param)] = ParamPlan(
            fqn, Placement.REPLICATE if replicated else Placement.SHARD, reduce, lifetime,
            local.shape[0] if local.dim() else 1, group.size, group.name,
            expert_reduce if expert else reduce_group_name, dtype,
            mp.reduce_dtype, param.requires_grad, tuple(local.shape), param.dtype, topology.device,
            *((replicas.size, replicas.group_name) if replicas is not None else (1, "")), tp,
            tp.size if expert else 1,
        )  # fmt: skip
    return plans


def format_plan(plans: tuple[ParamPlan, ...]) -> str:
    """The plan in a few lines for the summary: counts per kind, and the
    parameters of every kind but the most common one."""
    kinds: dict[tuple, list[ParamPlan]] = {}
    for p in plans:
        kinds.setdefault((placement_text(p), reduce_text(p), p.lifetime), []).append(p)
    common = max(kinds, key=lambda k: len(kinds[k])) if kinds else None
    lines = [f"parameters: {len(plans)}"]
    for (placement, reduce, lifetime), members in kinds.items():
        head = f"  {len(members)} {placement}, gradient {reduce}, gathered value {lifetime.value}"
        if (placement, reduce, lifetime) == common:
            lines.append(head)
            continue
        names = ", ".join(p.fqn for p in members[:6]) + (f", ... ({len(members)})" if len(members) > 6 else "")
        lines.append(f"{head}: {names}")
    return "\n".join(lines) + "\n"
