"""The plan's types, and the table by which compiled graphs name it.

``fxshard.compile`` builds one ``ParamPlan`` per distinct parameter
(``fxshard/plan.py``); sharding registers them here as one ``PlanTable``.

[Note: vocabulary]
fxshard's code and docs use these words in these meanings only:
- **topology**: the user's mesh, read once: the shard group, HSDP's
  replicas, every rank, this rank's place in each (see [Note: topology]).
- **plan**: what ``fxshard.compile`` decided for one parameter
  (``ParamPlan``: placement, gradient reduce, lifetime, dtypes, group),
  and for one model (the ``PlanTable`` of its parameters' plans, and
  ``model.fxshard_plan``). Decided once, before anything is sharded; read,
  never changed.
- **shard**: the rows of a parameter that this rank holds, a ``Shard(0)``
  DTensor registered as the parameter (``ShardParameter``); a replicated
  parameter's shard is the whole tensor. Optimizers and checkpoints see
  shards.
- **TP-local tensor**: a tensor-parallel parameter's piece on this rank's
  TP coordinate (its DTensor's local tensor before compile). Its rows are
  what is sharded, gathered and reduced; a plan's ``shape`` is its shape
  (see [Note: tensor-parallel parameters]).
- **gathered value**: a parameter's full value, all-gathered from its
  shards (in the compute dtype) for a read: the output of an
  ``fxshard::unshard`` marker in a graph, a ``GatheredParameter`` when
  eager code reads ``module.weight``. Writes to it land in the shard (see
  [Note: writes to gathered parameters]).
- **lifetime**: how long a gathered value lives (``Lifetime``): until its
  last use, gathered again for backward (ZeRO-3); until backward (ZeRO-2);
  always (replicated parameters and ZeRO-1's full copies).
- **unit**: sharded parameters gathered by one all-gather and reduced by one
  reduce-scatter per block they hold (one where they hold none; see [Note:
  a reduce per block]), over one flat buffer of per-rank slots, formed in order of
  first use up to ``unit_mb`` (see ``passes/units.py:unit_limit``) or as listed by ``units=`` (see [Note: units
  and flat shards]). Not a module boundary: a layer is never split between
  units, but a unit may hold several layers. ZeRO-1's units only reduce:
  their parameters' copies stay gathered (see [Note: ZeRO-1]).
- **block**: a layer (``layers.<i>``) compiled once as a body that every
  alike layer calls (see [Note: outlined blocks]).
- **reduce**: what a gradient goes through to reach its shard's ``.grad``,
  averaged over the mesh: a reduce-scatter (sharded), an all-reduce
  (replicated), then, under HSDP, an average across replicas.
- **phase**: one root call's treatment of gradients, chosen per call: SYNC
  (reduce), ACCUMULATE (keep unreduced), FLUSH (reduce with what was kept)
  (see [Note: accumulation without sync]).
- **bucket**: parameters that one collective moves outside a unit: ZeRO-1's
  gathers of its copies, in runs of one dtype up to ``unit_mb`` (256 MiB
  by default).
  (``passes/bucket.py`` is named for what it does to a unit's markers: it
  buckets them into the unit's one gather and its reduces.)

[Note: markers name the plan]
A marker op in a graph (``fxshard::unshard`` and its kin) carries two
integers: the table's id and the parameter's index in it. Passes and the
ops' eager and fake implementations look every fact up there (``param``),
so a fact has one home and a new plan field reaches every consumer without
a schema change. An id is a hash of the table's content, not a process
counter: torch caches compiled graphs on disk with the ids baked in, and a
hash makes "same id" mean "same facts" in any process (a live table of the
same content takes the next free id).
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from fxshard.runtime.tensor_parallel import TPLayout


class Placement(enum.Enum):
    SHARD = "Shard(0)"
    REPLICATE = "Replicate()"


class Reduce(enum.Enum):
    """What happens to the parameter's gradient."""

    REDUCE_SCATTER = "reduce-scatter"
    ALL_REDUCE = "all-reduce"
    NONE = "none"  # frozen at compile: no gradient (see [Note: replicated parameters])


class Lifetime(enum.Enum):
    """How long a gathered value lives."""

    LAST_USE = "until last use"  # ZeRO-3: freed after forward, gathered again for backward
    STEP = "until backward"  # ZeRO-2 (reshard_after_forward=False): kept from forward to backward
    ALWAYS = "always"  # replicated (the local tensor is the full one), or ZeRO-1 (see [Note: ZeRO-1])


@dataclass(frozen=True)
class ParamPlan:
    """One parameter's plan: everything a read, a gradient and a checkpoint need."""

    fqn: str
    placement: Placement
    reduce: Reduce
    lifetime: Lifetime
    dim0: int
    world_size: int  # of the dimension it is sharded over
    group_name: str
    reduce_group_name: str  # same ranks, another communicator (see fxshard::unshard)
    dtype: torch.dtype | None  # gather and compute dtype; None keeps the shard's
    reduce_dtype: torch.dtype | None
    requires_grad: bool  # at compile time
    shape: tuple[int, ...]  # the full parameter's
    shard_dtype: torch.dtype
    device: torch.device
    replicas: int = 1  # HSDP: copies across the mesh's replicate dimension (see [Note: HSDP])
    replica_group_name: str = ""  # HSDP: the group across them, over which gradients are averaged too
    # A tensor-parallel parameter's layout on its TP mesh; then ``shape`` and
    # ``dim0`` are its TP-local tensor's (see [Note: tensor-parallel parameters]).
    tp: TPLayout | None = None
    # How many data-parallel ranks' gradients each rank's local gradient
    # already sums: an expert's, its EP group's (see [Note: expert-parallel
    # parameters]). The reduce divides by ``world_size * presummed``.
    presummed: int = 1

    @property
    def replicated(self) -> bool:
        return self.placement is Placement.REPLICATE

    @property
    def kept(self) -> bool:
        """Sharded, and held gathered between steps (ZeRO-1; see [Note: ZeRO-1])."""
        return self.placement is Placement.SHARD and self.lifetime is Lifetime.ALWAYS

    @property
    def gather_dtype(self) -> torch.dtype:
        """The dtype it is gathered and computed in (``dtype``, resolved)."""
        return self.dtype or self.shard_dtype

    @property
    def summed_dtype(self) -> torch.dtype:
        """The dtype its gradient is reduced and accumulated in (``reduce_dtype``, resolved)."""
        return self.reduce_dtype or self.gather_dtype

    def describe(self) -> str:
        dtypes = f"{_dtype(self.gather_dtype)}/{_dtype(self.summed_dtype)}"
        local = "EP-local" if self.tp is not None and self.tp.expert else "TP-local"
        shape = f"{list(self.shape)}" if self.tp is None else f"{list(self.tp.shape)} ({local} {list(self.shape)})"
        return (f"{self.fqn} {shape} {_dtype(self.shard_dtype)}: {placement_text(self)}, "
                f"compute/reduce {dtypes}, gradient {reduce_text(self)}, gathered value {self.lifetime.value}")  # fmt: skip


class Shard(Protocol):
    """A parameter's shard as its module holds it now: the user may replace
    the tensor (``p.data = ...``, ``to_empty``), so it is read each time,
    never kept (implemented in fxshard/module/shards.py)."""

    def local(self) -> torch.Tensor:
        """This rank's rows, the DTensor's local tensor."""
        ...

    def rehome(self, tensor: torch.Tensor) -> None:
        """Make the DTensor hold ``tensor`` (same values) instead."""
        ...

    def add_grad(self, grad: torch.Tensor) -> None:
        """Accumulate a reduced gradient of this rank's rows into ``.grad``."""
        ...

    def grad(self) -> torch.Tensor | None:
        """The parameter's ``.grad`` now."""
        ...

    def forget_release(self) -> None:
        """Nothing is kept for the parameter any more (see ``grad_key``)."""
        ...

    def grad_key(self) -> tuple[int, ...] | None:
        """A key of ``.grad`` (None without one) that a reset changes (see
        [Note: has it changed] in fxshard/module/shards.py)."""
        ...

    def hold_zero_grad(self) -> bool:
        """A zero ``.grad`` without memory where there is none, while the
        gradient is kept without sync (see [Note: a zero gradient without
        memory]); whether it gave one."""
        ...

    def release_zero_grad(self, materialize: bool = False) -> None:
        """The zero ``hold_zero_grad`` gave, if still ``.grad``: None, or a real zero gradient."""
        ...

    def trainable(self) -> bool:
        """The parameter's ``requires_grad`` now (users may freeze later)."""
        ...


@dataclass(frozen=True, eq=False)
class Param:
    """One parameter at run time: its plan, its index in the model's table,
    this rank's rows of it and its shard. The one record that units, the
    sequencer and ZeRO-1's copies read; everything else is the plan's."""

    index: int
    plan: ParamPlan
    local_rows: int
    shard: Shard

    @property
    def fqn(self) -> str:
        return self.plan.fqn

    @property
    def shape(self) -> tuple[int, ...]:
        return self.plan.shape

    @property
    def shard_dtype(self) -> torch.dtype:
        return self.plan.shard_dtype

    @property
    def gather_dtype(self) -> torch.dtype:
        return self.plan.gather_dtype

    @property
    def reduce_dtype(self) -> torch.dtype:
        """The dtype a reduce sums in."""
        return self.plan.summed_dtype

    @property
    def device(self) -> torch.device:
        return self.plan.device


def placement_text(p: ParamPlan) -> str:
    if p.tp is not None:  # FSDP2's placements on (dp, tp), as the shard's DTensor has them
        strided = p.placement is Placement.SHARD and p.tp.strided
        dp = f"_StridedShard(0, sf={p.tp.size})" if strided else p.placement.value
        if p.tp.expert:  # over the experts' group (see [Note: expert-parallel parameters])
            dp += f" over {p.world_size} expert ranks"
        return f"({dp}, {p.tp.text()})"
    return p.placement.value if p.replicas == 1 else f"(Replicate(), {p.placement.value})"


def reduce_text(p: ParamPlan) -> str:
    if p.presummed > 1 and p.reduce is not Reduce.NONE:
        return f"{p.reduce.value}, averaged over {p.world_size * p.presummed} ranks"
    if p.replicas == 1 or p.reduce is Reduce.NONE:
        return p.reduce.value
    return f"{p.reduce.value}, then all-reduce over {p.replicas} replicas"


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class PlanTable:
    """One model's parameter plans as graphs name them (see the Note).
    ``local_rows``: how many rows of each parameter this rank holds
    (``Topology.rows``: all of a replicated one's); ``count_group_name``:
    the CPU group on which sharded lookups compare token counts ("" for
    none). Its ``id`` is given when a ``ModelRuntime`` names it."""

    def __init__(self, params: tuple[ParamPlan, ...], local_rows: tuple[int, ...], count_group_name: str = "") -> None:
        self.params, self.local_rows, self.count_group_name = params, local_rows, count_group_name
        self.id: int | None = None

    @property
    def content(self) -> bytes:
        return repr((self.params, self.local_rows, self.count_group_name)).encode()

    def as_stored(self) -> PlanTable:
        """The same plans gathering in the stored dtype: reads outside a root
        call, whose writes land in the shard."""
        return PlanTable(
            tuple(dataclasses.replace(p, dtype=None) for p in self.params), self.local_rows, self.count_group_name
        )


class ModelRuntime:
    """One model's run-time state, found by any id its graphs carry.

    [Note: one registry]
    Compiled graphs name what they need by integers (see [Note: markers name
    the plan]): read and reduce markers and sequenced reads name a plan
    table, unit collectives name the units' layout. Every such id of one
    model leads here, to its one ``ModelRuntime``: its two tables (``table``,
    read by its root call's graphs, and ``stored``, by reads outside them),
    its gradient store (runtime/ops.py), its sequencer (runtime/sequencer.py)
    and its units (runtime/units.py). The registry is weak: the model's root
    state holds its runtime, and a freed model's ids go with it. An id is a
    hash of what it names, never a process counter, so that graphs that torch
    caches on disk, with ids baked in, mean the same facts in any process; a
    live id is never given twice (two copies of one model take the next free
    ones)."""

    def __init__(self, table: PlanTable | None = None) -> None:
        self.tables: dict[int, PlanTable] = {}
        self.table = self.stored = None
        self.store: Any = None  # GradStore, set by the root state
        self.sequencer: Any = None  # Sequencer
        self.units: Any = None  # Units, once formed from the first graph
        if table is not None:
            self.table = self.name(table)
            stored = table.as_stored()  # the same table where every parameter computes in its stored dtype
            self.stored = table if stored.content == table.content else self.name(stored)

    def name(self, table: PlanTable) -> PlanTable:
        """Give ``table`` its id, by which graphs find this runtime."""
        table.id = _register(self, table.content)
        self.tables[table.id] = table
        return table

    def name_units(self, units: Any, layout: bytes) -> int:
        """Hold ``units`` and return the id of their ``layout``, by which unit collectives find them."""
        self.units = units
        return _register(self, layout)


_MODELS: weakref.WeakValueDictionary[int, ModelRuntime] = weakref.WeakValueDictionary()


def _register(model: ModelRuntime, content: bytes) -> int:
    uid = int.from_bytes(hashlib.sha256(content).digest()[:7], "little")
    while uid in _MODELS:
        uid += 1
    _MODELS[uid] = model
    return uid


def runtime(id: int) -> ModelRuntime:
    """The runtime of the model whose graphs name ``id``."""
    try:
        return _MODELS[id]
    except KeyError:
        raise RuntimeError(f"fxshard: no live model has id {id}; the model whose graph names it was freed") from None


def table(plan: int) -> PlanTable:
    return runtime(plan).tables[plan]


def param(plan: int, index: int) -> ParamPlan:
    """The plan of parameter ``index`` of table ``plan``."""
    return table(plan).params[index]


def local_rows(plan: int, index: int) -> int:
    return table(plan).local_rows[index]
