"""Parameters that tensor parallelism already sharded: their layout on the TP mesh.

[Note: tensor-parallel parameters]
A model given to ``fxshard.compile(model, mesh["dp"])`` after
``parallelize_module(model, mesh["tp"], plan)`` holds some parameters as
DTensors on the 1-D tp mesh, ``Shard(k)`` or ``Replicate()``. fxshard takes
them as FSDP2's ``fully_shard(model, mesh=mesh["dp"])`` does:
- The **TP-local tensor** (the DTensor's local tensor, this TP rank's piece
  of the parameter) is what fxshard shards over dp, by its rows, with the
  one row rule of every other parameter (``Topology.rows``). A plan's
  ``shape`` and ``dim0`` are the TP-local tensor's: what a read marker
  gathers and returns, what units lay out; ``tp.shape`` is the parameter's
  global shape.
- The **shard** is a DTensor on the concatenated (dp, tp) mesh with the
  global shape and FSDP2's placements: ``(Shard(0), *tp)``, or
  ``(_StridedShard(0, split_factor=tp), *tp)`` where TP already shards dim 0
  (rows are cut by TP first, then by dp: exactly that layout, uneven sizes
  included). Optimizers, ``clip_grad_norm_``, state dicts and DCP see it as
  they see FSDP2's.
- A **read** inside the root call gathers the TP-local tensor (the usual
  marker, on the dp group) and wraps it as the TP module expects it:
  ``DTensor.from_local(gathered, tp_mesh, tp_placements, shape=global,
  stride=global)``, as SimpleFSDP does. TP modules compute exactly as before
  compile, with TP's own collectives, which fxshard's passes leave alone.
  Returning the plain TP-local tensor would let a module compute on a piece
  silently (a row-wise output would lose its all-reduce).
- The **gradient** leaves ``from_local``'s backward TP-complete (a
  ``Partial`` one all-reduced over tp, as FSDP2's ``_get_grad_inner_tensor``
  does) and is reduce-scattered over dp as any other; the shard's ``.grad``
  is a DTensor laid out as the shard.
- A read **outside** a root call returns the shard itself, as FSDP2's
  ``module.weight`` outside forward does: fxshard's gathered values (and
  writes through them, see [Note: writes to gathered parameters]) are plain
  tensors, which cannot stand in for a TP DTensor. Writes to the shard
  (``copy_`` of a full tensor, ``nn.init``) land in this rank's piece.
- **Units** are formed from rank-independent sizes (a TP piece counts as
  its share of the global size): TP ranks then form the same units, so
  fxshard's gathers and TP's collectives, on different groups, are issued
  in one order on every rank, which NCCL needs to avoid a cycle of waits.
  The graph agreement compares the ranks of one data-parallel group only.
- **HSDP + TP** takes the ``(dp_replicate, dp_shard)`` submesh of a
  ``(dp_replicate, dp_shard, tp)`` mesh, as FSDP2 does: the shard lives on
  the 3-D mesh with ``Replicate()`` first, and the reduce-scattered
  gradient is averaged across replicas as on any HSDP mesh.
- **Frozen** TP parameters are sharded whatever ``shard_frozen`` says, as
  FSDP2 shards them: keeping one replicated over dp is not supported.
What is not supported raises at compile (``fxshard/api.py``,
docs/limits.md): TP meshes of more than one dimension,
``Partial`` or ``_StridedShard`` inputs, replicated (``no_shard``,
0-dimensional) TP parameters, models already under
FSDP.

[Note: expert-parallel parameters]
Expert parallelism (EP) as torchtitan sets it up: the world is a data-parallel
group ``dp``, and a second view of the same ranks, ``sparse = (efsdp, ep)``
with ``efsdp * ep = dp``. The model's EP plan put each MoE layer's grouped
expert weights (experts, ...) on ``sparse["ep"]`` as ``Shard(0)`` DTensors:
each EP rank holds ``experts / ep`` of them. Tokens reach their experts by
the model's own all-to-alls over ``ep``, with split sizes that depend on the
routing. The user compiles once:
``fxshard.compile(model, dense["dp"], expert_mesh=sparse["efsdp"])``, as
torchtitan's ``apply_fsdp_to_decoder(model, dp_mesh, edp_mesh=...)`` hands
FSDP2 both meshes (``shard_placement_fn`` returning the efsdp mesh for
expert weights).
- **Which are experts**: DTensor parameters whose mesh's ranks lie inside
  this rank's data-parallel group (a TP mesh crosses data-parallel groups).
  They are taken as TP parameters are (their EP-local tensor is what is
  sharded, ``TPLayout`` with ``expert=True``), but sharded over
  ``expert_mesh`` (``Topology.experts``), not over the data-parallel group:
  every EP rank holds other experts, so only the ranks of one EP coordinate
  share rows to shard. The shard is a DTensor on (efsdp, ep) with FSDP2's
  placements, ``(_StridedShard(0, sf=ep), Shard(0))``.
- **Non-expert parameters** are sharded over the whole data-parallel group,
  as without EP, in units; the experts' gathers and reduces are their own
  per-parameter collectives on efsdp (lowered markers, outside units, so not
  coalesced or prefetched yet).
- **Gradients**: the combine's all-to-all backward brings every token's
  gradient back to the rank holding its expert, so each rank's local expert
  gradient already sums the losses of its EP group's ``ep`` ranks. The
  reduce-scatter over efsdp sums the rest; dividing by ``efsdp * ep`` (the
  plan's ``presummed = ep`` beside ``world_size = efsdp``) averages over the
  whole data-parallel group, as the non-expert gradients are averaged, and as
  torchtitan sets FSDP2's gradient divide factor.
- **The all-to-alls stay in the one graph.** The split sizes are read with
  ``tolist()``, which dynamo (torch 2.13) traces as unbacked SymInts feeding
  ``_c10d_functional.all_to_all_single``; the data-dependent shapes live inside
  the graph, so no graph break and no sequenced reads. The host sync of
  ``tolist()`` stays (torchtitan's too). fxshard's passes leave the model's
  collectives as they are; the dump marks them as the model's.
- **ZeRO-1**: an expert's full copy is its EP-local tensor, gathered over
  efsdp in a bucket of its own group (``KeptParams``), once per step.
- **Rank checks**: the same-init checksums of an expert parameter are
  compared among ranks of one EP coordinate.
Not supported yet (refused at compile, or where the path is first taken):
HSDP with EP, sequenced reads (``backend="eager"``, a graph break),
TP and EP together, an EP mesh of more than one dimension, ``no_shard`` on
expert parameters, and ``fxshard.cuda_graph`` (the dispatch's ``tolist()``
is a host sync, which a captured step cannot hold).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TPLayout:
    """A tensor-parallel parameter's layout on its TP mesh: plain values
    (a plan's content is hashed by its repr, see [Note: markers name the
    plan]); the mesh itself is the topology's."""

    mesh_dims: tuple[str, ...]  # the TP mesh's dimension names
    size: int  # ranks of the TP mesh
    coordinate: int  # this rank's index on it
    placements: tuple[Any, ...]  # DTensor placements on it: Shard(k) or Replicate()
    shape: tuple[int, ...]  # the parameter's global shape
    stride: tuple[int, ...]  # and stride
    expert: bool = False  # an EP mesh: sharded over the experts' group (see [Note: expert-parallel parameters])

    @property
    def strided(self) -> bool:
        """Whether TP already cuts dim 0 into pieces, which the data-parallel
        shards then cut again: FSDP2's ``_StridedShard(0, sf=size)``."""
        return self.size > 1 and any(p.is_shard() and p.dim % len(self.shape) == 0 for p in self.placements)

    def text(self) -> str:
        return f"{', '.join(map(repr, self.placements))} on {'x'.join(self.mesh_dims)} ({self.size})"
