"""``fxshard.compile``: validate the user's input, shard, and compile.

Every check on user input lives here and in ``fxshard/options.py`` (the
options and the ``FXSHARD_*`` variables, read once into one frozen value),
and raises before anything is sharded or any collective runs. Below this
module nothing sees an option name.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor

from fxshard.checks import check_same_model
from fxshard.module import checkpoint
from fxshard.module.root import RootState
from fxshard.module.swap import PLAN, FXShardModule, shard_parameters
from fxshard.options import options
from fxshard.passes.pipeline import BackendSpec, FXShardBackend, GraphRecord
from fxshard.plan import Lifetime, build_plan, device_memory, format_plan, marked
from fxshard.policy import MixedPrecision
from fxshard.runtime import compat, rank_checks
from fxshard.runtime.plans import ParamPlan, PlanTable
from fxshard.runtime.topology import Topology
from fxshard.runtime.units import Units

log = logging.getLogger("fxshard")


@dataclass(frozen=True)
class ShardPlan:
    """What ``fxshard.compile`` decided for one model: ``model.fxshard_plan``.

    ``graphs`` grows as torch compiles graphs: one record per captured graph,
    with the rewritten forward and backward graphs and their collective reports.
    """

    topology: Topology  # the mesh, read once (see [Note: topology])
    params: tuple[ParamPlan, ...]  # per distinct parameter: placement, gradient reduce, lifetime, dtypes
    zero_stage: int
    mp_policy: MixedPrecision
    backend: str
    debug_dir: str | None
    graphs: list[GraphRecord]
    root: RootState
    units: Units | None  # None at world size 1 and for backend="eager"

    @property
    def mesh(self) -> DeviceMesh:
        """As the user passed it (or all ranks): the parameters' DTensors live on it."""
        return self.topology.mesh

    @property
    def shard_mesh(self) -> DeviceMesh:
        """Its dimension that parameters are sharded over (the mesh itself if 1-D)."""
        return self.topology.shard_mesh

    @property
    def reshard_after_forward(self) -> bool:
        """FSDP2's name for ``zero_stage == 3``."""
        return self.zero_stage == 3

    @property
    def sequenced(self) -> bool:
        """Whether reads go through the sequencer (see [Note: two ways to read]);
        decided by the first call."""
        return self.root.sequenced

    @property
    def graph_break_reason(self) -> str | None:
        """Why reads are sequenced: what dynamo said of the first graph break.
        None while the model runs as one graph."""
        return self.root.graph_break_reason


def _check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"fxshard.compile takes an nn.Module, got {type(model).__name__}")
    for name, module in model.named_modules():
        if isinstance(module, FXShardModule):
            where = f"submodule {name!r}" if name else "this module"
            raise ValueError(
                f"fxshard.compile was already called on {where}; call it once, on the root module, "
                "and use the module it returned"
            )
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            raise ValueError(
                f"{name or 'the model'} is already sharded by FSDP2's fully_shard; fxshard shards the model "
                "itself. Pass it before fully_shard (after parallelize_module, for tensor parallelism)"
            )
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            continue
        unsupported = [p for p in param.placements
                       if not (p.is_replicate() or (p.is_shard() and not compat.is_strided_shard(p)))]  # fmt: skip
        if unsupported:
            raise ValueError(
                f"parameter {name!r} is a DTensor placed {tuple(param.placements)}; fxshard shards tensor-parallel "
                "parameters placed Shard(k) or Replicate() on their mesh, as parallelize_module's styles leave "
                f"them, not {unsupported[0]}. Pass the model before fully_shard, distribute_tensor with other "
                "placements or another data-parallel sharding"
            )
    for name, module in model.named_modules():
        # The forward renormalizes the weight in place, a write that the
        # gathered copy would drop, silently.
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            raise ValueError(
                f"{name or 'the model'} is an {type(module).__name__} with sparse=True; fxshard reduces dense "
                "gradients (sparse ones would be gathered whole). Set sparse=False"
            )
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
            raise ValueError(
                f"{name or 'the model'} is an {type(module).__name__} with max_norm={module.max_norm}, which "
                "renormalizes its weight inside the forward; fxshard cannot keep writes made there. Set "
                "max_norm=None, and renormalize after each optimizer step if needed: with torch.no_grad(): "
                "module.weight.copy_(torch.renorm(module.weight, 2, 0, max_norm))"
            )


def _explicit_units(model: nn.Module, units: object) -> tuple[tuple[str, ...], ...]:
    """The parameter names of each listed module, each parameter in its
    deepest listed module (as nested ``fully_shard`` calls assign them)."""
    if units is None:
        return ()
    if not isinstance(units, (list, tuple)) or not all(isinstance(m, nn.Module) for m in units):
        raise ValueError("units must be a list of submodules of the model, e.g. units=list(model.layers)")
    names = {id(m): name for name, m in model.named_modules(remove_duplicate=False)}
    listed: dict[str, int] = {}
    for i, m in enumerate(units):
        if id(m) not in names:
            raise ValueError(f"units[{i}] ({type(m).__name__}) is not a submodule of the model; list its submodules")
        if names[id(m)] in listed:
            raise ValueError(f"units lists module {names[id(m)]!r} twice")
        listed[names[id(m)]] = i
    groups: list[list[str]] = [[] for _ in units]
    seen: set[int] = set()
    for fqn, param in model.named_parameters():
        if id(param) in seen:
            continue
        seen.add(id(param))
        owners = [name for name in listed if name == "" or fqn.startswith(name + ".")]
        if owners:
            groups[listed[max(owners, key=len)]].append(fqn)
    return tuple(tuple(g) for g in groups if g)


def _default_mesh(device_type: str) -> DeviceMesh:
    if not dist.is_initialized():
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        if world_size > 1:
            raise ValueError(
                f"WORLD_SIZE is {world_size} but no process group is initialized; call "
                "torch.distributed.init_process_group() before fxshard.compile, or pass mesh="
            )
        log.info("fxshard: no process group; starting a single-rank one")
        backend = "gloo" if device_type == "cpu" else dist.Backend.default_device_backend_map.get(device_type, "gloo")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _check_devices(model: nn.Module, expected: torch.device) -> None:
    """Parameters on this rank's mesh device, or all on the meta device
    (meta-device init: ``model.to_empty`` materializes the shards after compile)."""
    devices = {p.device.type for p in model.parameters()}
    if "meta" in devices and devices != {"meta"}:
        meta = next(n for n, p in model.named_parameters() if p.is_meta)
        raise ValueError(
            f"parameter {meta!r} is on the meta device and others are not; build the whole model on the "
            "meta device (with torch.device('meta'): model = Net()), or none of it"
        )
    for name, param in model.named_parameters():
        device = param.device
        if device.type == "meta":
            continue
        if device.type != expected.type or (expected.index is not None and device.index != expected.index):
            raise ValueError(
                f"parameter {name!r} is on {device} but this rank's mesh device is {expected}; "
                f"move the model first: model.to({str(expected)!r})"
            )


def _tp_params(model: nn.Module) -> tuple[tuple[str, DTensor], ...]:
    """The parameters that tensor parallelism made DTensors (see [Note:
    tensor-parallel parameters]), by name; none on the meta device."""
    params = tuple((name, p) for name, p in model.named_parameters() if isinstance(p, DTensor))
    for name, param in params:
        if compat.local_tensor(param).is_meta:
            raise ValueError(
                f"tensor-parallel parameter {name!r} is on the meta device; meta-device init with tensor "
                "parallelism is not supported yet. Materialize and initialize the model before fxshard.compile "
                "(model.to_empty(device=...), then its own init)"
            )
    return params


def _topology(model: nn.Module, mesh: DeviceMesh | None, expert_mesh: DeviceMesh | None = None) -> Topology:
    """The user's mesh (all ranks where None), and with expert parallelism
    ``expert_mesh``, read once (see [Note: topology])."""
    tp_params = _tp_params(model)
    if expert_mesh is not None and mesh is None:
        raise ValueError(
            "expert_mesh needs the data-parallel mesh beside it: fxshard.compile(model, dense['dp'], "
            "expert_mesh=sparse['efsdp']) (see [Note: expert-parallel parameters])"
        )
    if tp_params and mesh is None:
        raise ValueError(
            "the model has tensor-parallel parameters (DTensors); pass the data-parallel mesh beside their TP "
            "mesh: fxshard.compile(model, mesh['dp']) of init_device_mesh(device_type, (dp, tp), "
            "mesh_dim_names=('dp', 'tp'))"
        )
    if mesh is None:
        first = next(model.parameters(), None)
        device_type = first.device.type if first is not None else "cpu"
        if device_type == "meta":  # materialized later, on this machine's accelerator if it has one
            device_type = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"
        mesh = _default_mesh(device_type)
    topology = Topology.from_mesh(mesh, tp_params, expert_mesh)
    _check_devices(model, topology.device)
    return topology


def _check_expert_parallel(topology: Topology, zero_stage: int, backend: str) -> None:
    """Refuse what fxshard does not support with expert parallelism yet
    (see [Note: expert-parallel parameters]), naming it and the fix."""
    if topology.experts is None:
        return
    if backend == "eager":
        raise NotImplementedError(
            "backend='eager' (sequenced reads) with expert parallelism is not supported yet; use 'aot_eager' or "
            "'inductor'"
        )
    if any(not t.expert for t in topology.tensor_parallel):
        raise NotImplementedError("tensor parallelism together with expert parallelism is not supported yet")


def _check_tensor_parallel(model: nn.Module, zero_stage: int, shard_frozen: bool, whole: set[int]) -> None:
    """Refuse what fxshard does not support for tensor-parallel parameters
    yet (see [Note: tensor-parallel parameters]), naming it and the fix."""
    tp = [(name, p) for name, p in model.named_parameters() if isinstance(p, DTensor)]
    if not tp:
        return
    for name, p in tp:  # frozen ones are sharded, whatever shard_frozen says (fxshard/plan.py)
        if id(p) in whole or p.dim() == 0:
            why = "fxshard.no_shard marks it" if id(p) in whole else "it is 0-dimensional"
            raise ValueError(
                f"tensor- or expert-parallel parameter {name!r} would be kept replicated over the data-parallel "
                f"mesh ({why}), which is not supported yet: leave it unmarked (fxshard.no_shard the plain modules "
                "beside it instead, e.g. an MoE's router)"
            )


def _check_collectives(topology: Topology) -> None:
    """FXSHARD_CHECK_COLLECTIVES=1 or TORCH_DISTRIBUTED_DEBUG=DETAIL: every
    collective fxshard issues from Python is compared across ranks first, on
    a gloo group (see [Note: checked collectives]): those of the shard
    dimension among its ranks, and the averages across HSDP replicas among
    theirs."""
    checked = topology.check_groups()
    if checked:
        log.warning(
            "fxshard: checking every collective across ranks first (FXSHARD_CHECK_COLLECTIVES); slow, for debugging"
        )
    for names, check_group in checked:
        rank_checks.register_checked(names, check_group)


def _write_plan(debug_dir: str, table: PlanTable) -> None:
    """``<debug_dir>/rank<r>/plan.txt``: one line per parameter, by its index
    in the plan (how graphs' markers name it)."""
    folder = os.path.join(debug_dir, f"rank{dist.get_rank()}")
    os.makedirs(folder, exist_ok=True)
    lines = [f"{i:>4} {p.describe()}" for i, p in enumerate(table.params)]
    with open(os.path.join(folder, "plan.txt"), "w") as f:
        f.write(format_plan(table.params) + f"\nplan {table.id}, by index:\n" + "\n".join(lines) + "\n")


def compile(  # noqa: A001 - the public name, as in torch.compile
    model: nn.Module,
    mesh: DeviceMesh | None = None,
    *,
    reshard_after_forward: bool | None = None,
    zero_stage: int | None = None,
    mp_policy: MixedPrecision | MixedPrecisionPolicy | None = None,
    backend: str = "inductor",
    prefetch: int = 1,
    unit_mb: float | None = None,
    units: list[nn.Module] | None = None,
    sharded_embeddings: bool = True,
    compile_blocks_once: bool = True,
    reduces_in_flight: int = 1,
    debug_dir: str | os.PathLike | None = None,
    check_same_init: bool = True,
    shard_frozen: bool = False,
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard ``model``'s parameters over ``mesh`` and compile it; in place.

    Every parameter becomes a ``Shard(0)`` DTensor. Calling the module runs
    the captured graphs, rewritten to all-gather each parameter before its
    first use and reduce-scatter its gradient (averaged over the mesh) into
    the shard's ``.grad``. Parameters marked with ``fxshard.no_shard``, and
    frozen ones (``requires_grad=False``, see ``shard_frozen``), stay whole on
    every rank as ``Replicate()`` DTensors: never gathered, a gradient
    all-reduced (see [Note: replicated parameters] in fxshard/plan.py).

    - ``mesh``: a 1-D DeviceMesh; None uses all ranks of the default group
      (and starts a one-rank group if none exists and WORLD_SIZE is 1). A
      2-D mesh with named dimensions, replicate first, is HSDP: parameters
      are sharded over the inner dimension (gathers and reduce-scatters stay
      inside it) and gradients are then averaged across the outer one (see
      [Note: HSDP] in fxshard/runtime/collectives.py). Either may be a
      slice of a larger mesh (``mesh["dp"]``), as FSDP2 takes one: each
      slice is then a data-parallel group of its own, and every rank of the
      job must call ``compile``. Parameters that ``parallelize_module`` made
      DTensors on ``mesh["tp"]`` of the same (dp, tp) mesh are sharded over
      dp as their TP-local tensors, and become DTensors on the (dp, tp) mesh
      with FSDP2's placements; with HSDP, pass ``mesh["dp_replicate",
      "dp_shard"]`` of a (dp_replicate, dp_shard, tp) mesh (see [Note:
      tensor-parallel parameters] and docs/limits.md for what is not
      supported).
    - ``zero_stage``: what stays sharded between uses (3 by default). The
      optimizer state and the gradients are sharded at every stage:
      3 (FSDP2 ``reshard_after_forward=True``, Megatron-FSDP
      ``optim_grads_params``): gathered parameters are freed after their last
      use in forward and gathered again for backward; 2 (FSDP2
      ``reshard_after_forward=False``, Megatron-FSDP ``optim_grads``): they
      are kept from forward to backward; 1 (Megatron-FSDP ``optim``): every
      rank keeps a full copy of the parameters between steps, gathered once
      after each optimizer step (see [Note: ZeRO-1] in fxshard/module/zero1.py).
    - ``reshard_after_forward``: FSDP2's name: True is ``zero_stage=3``,
      False ``zero_stage=2``.
    - ``mp_policy``: ``fxshard.MixedPrecision``, or FSDP2's
      ``MixedPrecisionPolicy`` (the same fields; its ``output_dtype`` must be
      None: fxshard does not cast the model's output).
    - ``backend``: "inductor" or "aot_eager", the compiler run after fxshard's
      passes; "eager" compiles nothing and gathers on every access (debugging).
    - ``prefetch``: how many units of gathers run ahead of the unit computing
      (0: each gather waits where its weight is first used).
    - ``unit_mb``: the most MiB of gathered weights a unit holds (a layer
      larger than that is a unit alone). None (the default): 256 MiB, and at
      most an eighth of the model's weights where that is over 64 MiB, so
      that the two units gathered at a time (the one computing, the one
      prefetched) hold at most a quarter of a small model. Units are formed
      from the first compiled graph: parameters in order of first use. Each
      unit is one all-gather, and one reduce-scatter per layer compiled once
      that it holds, layers (or, in a unit without such layers, parameters)
      joined until a reduce covers a quarter of ``unit_mb`` (of 256 MiB by
      default).
    - ``units``: modules, each of which becomes one unit (its parameters not
      in a deeper listed module), instead of forming units by size. The
      parameters of no listed module form units by size.
    - ``sharded_embeddings``: an embedding table that compiled code reads only
      through ``F.embedding`` (``nn.Embedding``, not tied to an output
      projection) is never gathered: ranks exchange token ids and rows, and
      each rank reduces its own rows' gradient (see [Note: sharded lookups]).
      False gathers it like any weight.
    - ``compile_blocks_once``: blocks of a module list (``layers.<i>``) that
      trace alike node for node are compiled once and called per layer, with
      the layer's gathered weights as arguments: first-step compile time
      that no longer grows with depth (see [Note: outlined blocks]). On by
      default: it shortens a deep model's first step, and leaves step time
      and peak memory no worse; False compiles every layer inline.
    - ``reduces_in_flight``: how many gradient reduce-scatters may run at once
      in backward. A reduce's wait is placed just before the input of the
      reduce issued this many later is built: the reduce ran while the later
      units' gradients were computed, so backward does not stall on it, and
      only this many reduce inputs (a unit's gradients in ``reduce_dtype``,
      the size of its parameters in that dtype) are alive at once.
    - ``debug_dir`` (or ``FXSHARD_DEBUG_DIR``): where to dump graphs and summaries.
      The ``FXSHARD_*`` variables are read here, once: changing them later
      does not change a compiled model.
    - ``check_same_init``: compare a checksum of every parameter across ranks
      first (one all-gather) and raise if any differs: ranks must start from
      the same weights. The first call then checks that no two ranks hold
      the same rows of a weight (values drawn per shard with one seed, as
      ``torch.randn_like`` of a shard draws on a CPU mesh). False skips both
      (the parameter lists are compared either way; see ``fxshard/checks.py``).
    - ``shard_frozen``: False (the default) keeps parameters that are frozen
      at compile time replicated, since they need no gather and no reduce,
      unless together they would take more than a quarter of the device's
      memory (then they are sharded, with a warning). True shards them.
      Frozen tensor-parallel parameters are always sharded.
    - ``expert_mesh``: with expert parallelism, the data-parallel dimension
      beside the EP mesh that the experts are on: torchtitan's
      ``sparse["efsdp"]`` of an ``(efsdp, ep)`` mesh over the same ranks as
      ``mesh``. Parameters on an EP mesh (DTensors whose ranks lie inside
      ``mesh``) are sharded over it; the others over ``mesh``, as without EP.
      Expert gradients are averaged over all of ``mesh``'s ranks (see [Note:
      expert-parallel parameters] and docs/limits.md).
    """
    _check_model(model)
    opts = options(reshard_after_forward=reshard_after_forward, zero_stage=zero_stage, mp_policy=mp_policy,
                   backend=backend, prefetch=prefetch, unit_mb=unit_mb, sharded_embeddings=sharded_embeddings,
                   compile_blocks_once=compile_blocks_once, reduces_in_flight=reduces_in_flight,
                   debug_dir=debug_dir, check_same_init=check_same_init, shard_frozen=shard_frozen)  # fmt: skip
    explicit = _explicit_units(model, units)
    whole = marked(model)
    _check_tensor_parallel(model, opts.zero_stage, opts.shard_frozen, whole)
    topology = _topology(model, mesh, expert_mesh)
    _check_expert_parallel(topology, opts.zero_stage, opts.backend)
    shard, replicas, device = topology.shard, topology.replicas, topology.device
    memory = check_same_model(model, topology, values=opts.check_same_init, whole=whole,
                              memory=device_memory(device))  # fmt: skip
    # Below, everything runs on the shard dimension; HSDP adds to each reduce
    # an average across replicas (see [Note: HSDP] in fxshard/runtime/collectives.py).
    reduce_group_name = topology.reduce_group()
    if opts.check_collectives:
        _check_collectives(topology)
    lifetime = {1: Lifetime.ALWAYS, 2: Lifetime.STEP, 3: Lifetime.LAST_USE}[opts.zero_stage]
    plans = build_plan(model, topology, opts.mp_policy, reduce_group_name, lifetime, opts.shard_frozen, memory,
                       whole)  # fmt: skip
    params = tuple(plans.values())
    sharded_embeddings = opts.sharded_embeddings and opts.backend != "eager" and shard.size > 1
    count_group = topology.count_group() if sharded_embeddings else ""
    state = shard_parameters(model, plans, topology, sequenced=opts.backend == "eager",
                             bucket_bytes=opts.bucket_bytes, count_group_name=count_group)  # fmt: skip
    if opts.mp_policy.cast_forward_inputs:
        state.input_dtype = opts.mp_policy.param_dtype
    state.check_rows = opts.check_same_init and shard.size > 1
    if opts.debug_dir:
        _write_plan(opts.debug_dir, state.table)
    graphs: list[GraphRecord] = []
    unit_plan = None
    if opts.backend != "eager":
        spec = BackendSpec(opts.backend, opts.zero_stage != 2, dist.get_rank(), shard.size, shard.name,
                           opts.debug_dir, opts.unit_bytes, opts.prefetch, sharded_embeddings,
                           opts.compile_blocks_once, opts.reduces_in_flight, format_plan(params), explicit,
                           opts.disabled_passes, opts.inductor_config)  # fmt: skip
        if shard.size > 1:
            unit_plan = Units(state.runtime, state.gathered, shard.size, shard.name, reduce_group_name, replicas)
        compiled = FXShardBackend(spec, unit_plan, topology.agreement())
        graphs = compiled.graphs
        # One graph, or sequenced reads: see [Note: two ways to read].
        nn.Module.compile(model, backend=compiled, fullgraph=True)  # the class's compile is the user's no-op
        state.attach(compiled, unit_plan)
    plan = ShardPlan(
        topology, params, opts.zero_stage, opts.mp_policy, opts.backend, opts.debug_dir, graphs, state, unit_plan
    )
    # On the instance: the class may outlive the model (see module.swap._root_methods).
    model.__dict__[PLAN] = plan
    # Full state dicts load into the shards; another rank's shards do not.
    checkpoint.install(model, shard.rank, shard.size, topology.tp_coordinates())
    log.info("fxshard: sharded %d parameters over %d ranks, %d replicas (%s)", len(params), shard.size,
             1 if replicas is None else replicas.size, opts.backend)  # fmt: skip
    return model
