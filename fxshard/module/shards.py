"""The shards a parameter becomes, and a rank's rows moved between full values and shards.

``ShardParameter`` is the ``nn.Parameter`` that ``fxshard.compile`` registers
in place of each parameter: this rank's rows of it as a DTensor, ``Shard(0)``
(or ``Replicate()`` for one kept whole). Below it, the helpers that make a
shard of a full value and that move rows between full values and shards, for
writes, checkpoints and gradients.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from fxshard.runtime import compat, process
from fxshard.runtime.topology import Topology
from fxshard.runtime.units import in_slot

if TYPE_CHECKING:
    # Not at import: fxshard/plan.py imports writes.py, which imports this module.
    from fxshard.plan import ParamPlan


def written(tensor: torch.Tensor) -> tuple[int, int, int, int, int]:
    """A key of the state of ``tensor``'s values: a write to them, by any
    path fxshard knows, gives a different key.

    [Note: has it changed]
    Every "has this tensor changed since then" question on the module side
    compares two ``written`` keys, one taken then and one now:
    - ZeRO-1's copies: gather again (``KeptParams.refresh``);
    - a held ``module.weight`` or ``module.weight.grad``: stale
      (``writes.Source``, ``writes.GradSource``);
    - the gradients kept without sync: reset by ``zero_grad``
      (``RootState.check_kept``);
    - a shard still empty after ``to_empty`` (``ShardParameter.uninitialized``);
    - a gathered value, around each function run on it: written, so its rows
      go to the shard (``GatheredParameter.__torch_function__``).
    Each part of the key is there for writes that move none of the others:
    - the tensor's id: a holder that looks the tensor up again (``p.grad``,
      the model's parameters) may find another (``.grad`` set anew, a shard
      replaced by ``to_empty``);
    - the address of the local tensor's storage (a plain tensor's own):
      ``.data =`` on a gathered value or on a gradient's local tensor
      (``p.grad.to_local()``) gives the values other memory and moves no
      version; so does moving a shard into its unit's slot
      (``HeldShard.rehome``). The storage's, not ``data_ptr()``: an in-place
      view op (``as_strided_``) moves a tensor within its storage, which is a
      write to the tensor (its version moves), not new values;
    - the DTensor's version: its in-place ops (``p.mul_``) move it, not the
      local tensor's;
    - the local tensor's version: writes through ``to_local()``, ``.data``
      or to this rank's rows (``copy_rows``) move it, not the DTensor's;
    - a shard's count of optimizer steps: torch's foreach and fused steps
      (the default on GPUs) move no version of a DTensor. A hook counts them
      while something that compares keys of shards lives
      (``count_optimizer_steps``: ZeRO-1's copies, each held value, a shard
      materialized by ``to_empty``).
    The key is ints, so keys compare with ``==``; a tensor in it would compare
    elementwise. An id or an address can come back once its tensor is freed;
    where a tensor may be freed and another made between the two keys (a
    gathered gradient held across ``zero_grad`` and a backward), the holder
    also keeps a weak reference and compares it with ``is``.

    One change of key is not a write: a shard moved into its unit's slot at
    the first call (``Units.rehome``) holds the same values in other memory.
    The shard records the keys around its move (``ShardParameter.moved``), so
    a held value read before it stays current (``unwritten_since``) unless
    something else changed too, an optimizer step, say. ZeRO-1's copies are
    gathered again after a move, as after any change of key: a shard moves
    at most once, after the first call."""
    if isinstance(tensor, ShardParameter):  # first: ZeRO-1 asks this of every shard at every call
        local, steps = compat.local_tensor_getter(tensor), tensor.optimizer_steps
    else:
        local, steps = compat.local_tensor_getter(tensor) if isinstance(tensor, DTensor) else tensor, 0
    return id(tensor), local.untyped_storage().data_ptr(), tensor._version, local._version, steps


STORAGE = 1  # the place of the storage address in a ``written`` key


class ShardParameter(DTensor):
    """A parameter's DTensor, ``Shard(0)`` or ``Replicate()``, as ``fxshard.compile`` registers it.

    A DTensor that is given new values by ``p.data = value`` keeps its old
    local tensor (the new one never reaches it), and ``p.copy_(full)``
    refuses a plain tensor; here both write this rank's rows into the local
    shard, in place, so units and optimizers keep their tensors. Every other
    operation is the DTensor's, and returns plain DTensors.
    """

    # The rows of the full parameter that this rank holds (``Topology.rows``),
    # given where the shard is made (``shard_parameter``).
    rows: slice
    # A tensor-parallel parameter's: where its TP-local tensor, whose rows
    # ``rows`` are, lies in the full one (see [Note: tensor-parallel parameters]).
    piece: tuple[slice, ...] = ()
    # Its ``written`` key when ``to_empty`` materialized it from the meta
    # device; None otherwise.
    _empty_at: tuple | None = None
    # Its ``written`` keys before and after its last move to other memory with
    # the same values (``HeldShard.rehome``); None if it never moved.
    moved: tuple[tuple, tuple] | None = None
    optimizer_steps: int = 0  # steps of optimizers holding it, once counted (count_optimizer_steps)

    @property
    def uninitialized(self) -> bool:
        """Materialized from the meta device and not written since (see
        [Note: has it changed]): reading it gathers nothing."""
        return self._empty_at is not None and self.unwritten_since(self._empty_at)

    def mark_empty(self) -> None:
        self._empty_at = written(self)

    def unwritten_since(self, key: tuple) -> bool:
        """Whether no write reached the shard since ``written(self)`` was
        ``key``: the key is the same, or only a move changed it (see [Note:
        has it changed])."""
        now = written(self)
        return now == key or self.moved == (key, now)

    @property
    def data(self) -> torch.Tensor:
        # A detached alias sharing the version counter (torch's ``.data`` has
        # its own), so that a write through ``p.data`` is a change that
        # ZeRO-1's copies and held gathered values see; of this class, so that
        # ``p.data.normal_()`` draws as ``p.normal_()`` does (see [Note:
        # random init through the shards]: as a plain DTensor, every CPU rank
        # drew the same rows) and ``p.data.copy_(full)`` takes a full tensor.
        alias = self.detach()
        alias.__class__ = ShardParameter
        alias.rows, alias.piece = self.rows, self.piece
        return alias

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        # A write to the values, as ``.data =`` is, not an op autograd records
        # (``copy_`` on a leaf that requires grad refuses one otherwise).
        with torch.no_grad():
            self.copy_(value)

    def copy_(self, src: torch.Tensor, non_blocking: bool = False) -> ShardParameter:
        if isinstance(src, DTensor):
            return super().copy_(src, non_blocking)
        self.write_full(src)
        return self

    # [Note: random init through the shards]
    # torchtitan's init_weights, and any loop over model.parameters(), runs
    # nn.init on the shards themselves. DTensor draws each rank's rows on
    # its own: on a CPU mesh every rank draws the same values (repeated rows
    # that no training separates), and on GPUs the values differ from the
    # unsharded model's. The in-place random fills below draw the whole
    # parameter instead, from the same generator and in the same order as
    # the unsharded parameter would, and keep this rank's rows: with the same
    # seed the weights equal the unsharded model's at any world size, and no
    # two ranks hold the same rows. nn.init's functions all start with one of
    # these (trunc_normal_ with uniform_, then deterministic in-place ops).
    # Random ops that make new tensors (torch.randn_like(p)) are DTensor's.
    def uniform_(self, *args: Any, **kwargs: Any) -> ShardParameter:
        return self._fill_full("uniform_", args, kwargs)

    def normal_(self, *args: Any, **kwargs: Any) -> ShardParameter:
        return self._fill_full("normal_", args, kwargs)

    def bernoulli_(self, *args: Any, **kwargs: Any) -> ShardParameter:
        return self._fill_full("bernoulli_", args, kwargs)

    def random_(self, *args: Any, **kwargs: Any) -> ShardParameter:
        return self._fill_full("random_", args, kwargs)

    def exponential_(self, *args: Any, **kwargs: Any) -> ShardParameter:
        return self._fill_full("exponential_", args, kwargs)

    def cauchy_(self, *args: Any, **kwargs: Any) -> ShardParameter:
        return self._fill_full("cauchy_", args, kwargs)

    def log_normal_(self, *args: Any, **kwargs: Any) -> ShardParameter:
        return self._fill_full("log_normal_", args, kwargs)

    def geometric_(self, *args: Any, **kwargs: Any) -> ShardParameter:
        return self._fill_full("geometric_", args, kwargs)

    def _fill_full(self, method: str, args: tuple, kwargs: dict) -> ShardParameter:
        if self.requires_grad and torch.is_grad_enabled():  # as torch refuses it on any leaf
            raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
        local = compat.local_tensor(self)
        full = torch.empty(self.shape, dtype=self.dtype, device=local.device)
        getattr(full, method)(*args, **kwargs)
        copy_rows(full, self, local)
        return self

    @staticmethod
    def __tensor_unflatten__(inner_tensors: dict, flatten_spec: Any, outer_size: Any, outer_stride: Any) -> Any:
        # DTensor's rebuilds a DTensor; compiled code that takes shards as
        # inputs (a ``torch.compile``d optimizer step) must see their own type,
        # or AOTAutograd's runtime check refuses them.
        plain = DTensor.__tensor_unflatten__(inner_tensors, flatten_spec, outer_size, outer_stride)
        return ShardParameter(compat.local_tensor(plain), compat.dtensor_spec(plain), requires_grad=plain.requires_grad)

    def write_full(self, full: torch.Tensor) -> None:
        """Copy this rank's rows of ``full``, the whole parameter, into the shard."""
        if not isinstance(full, torch.Tensor) or tuple(full.shape) != tuple(self.shape):
            got = tuple(full.shape) if isinstance(full, torch.Tensor) else type(full).__name__
            raise ValueError(
                f"a sharded parameter of shape {tuple(self.shape)} was given a value of shape {got}; give "
                "it a tensor of the parameter's full shape (each rank keeps its own rows), or a DTensor "
                "sharded like it. fxshard.compile fixed the shape: resize or prune parameters "
                "(resize_token_embeddings) before it"
            )
        copy_rows(full, self, compat.local_tensor(self))


process.foreach_type(ShardParameter)


class HeldShard:
    """A parameter's shard as its first owner holds it now (``plans.Shard``):
    read from the module each time, since the user may replace the tensor."""

    __slots__ = ("module", "attr", "_zero", "_release", "_released")

    def __init__(self, module: torch.nn.Module, attr: str) -> None:
        self.module, self.attr = module, attr
        self._zero: DTensor | None = None  # the .grad that hold_zero_grad gave, until released
        self._release: RemovableHandle | None = None  # the hook that releases it
        # (key of a zero released while still .grad, what .grad became): a
        # release is fxshard's, not a reset (see grad_key)
        self._released: tuple[tuple[int, ...], DTensor | None] | None = None

    def local(self) -> torch.Tensor:
        return compat.local_tensor(self.module._parameters[self.attr])

    def grad(self) -> torch.Tensor | None:
        return self.module._parameters[self.attr].grad

    def forget_release(self) -> None:
        """Once nothing is kept for the parameter: a later ``.grad`` (None
        included) is the user's, not what a release left."""
        self._released = None

    def grad_key(self) -> tuple[int, ...] | None:
        """A key of ``.grad`` that a reset changes (see [Note: has it
        changed]). Where ``.grad`` is what releasing the zero without memory
        left (see the Note below), the zero's key: a reset by fxshard is no
        reset of the user's."""
        grad = self.grad()
        if self._released is not None and self._released[1] is grad:
            return self._released[0]
        return None if grad is None else written(grad)

    def rehome(self, tensor: torch.Tensor) -> None:
        """Hold ``tensor``, a copy of the local shard in other memory: a move,
        no write (see [Note: has it changed])."""
        param = self.module._parameters[self.attr]
        before = written(param)
        compat.replace_local_tensor(param, tensor)
        if isinstance(param, ShardParameter):
            param.moved = (before, written(param))

    # [Note: a zero gradient without memory]
    # A parameter whose gradient is kept without sync gets a zero ``.grad``
    # where it has none (see [Note: accumulation without sync] in
    # fxshard/runtime/ops.py): what ``zero_grad`` resets, so that the root can
    # tell that the kept gradients were reset too. It is one zero element
    # seen at the shard's shape through zero strides: a real zero gradient would hold the
    # sharded gradients (1/world of the model in the shard dtype) from the
    # first micro-batch, where FSDP2 makes them at the reduce. Reads and
    # ``zero_grad`` (both forms) work on it; other in-place writes raise (its
    # elements share one memory location). It lives only while the gradient
    # is kept, which no optimizer steps on (fused ones read a gradient as
    # contiguous memory: this one, as garbage). Before anything accumulates
    # into ``.grad`` it is released (``.grad`` back to None): by a hook on the
    # parameter, which runs before autograd accumulates, and by ``add_grad``.
    # Where nothing is kept any more but it is still ``.grad`` (``zero_()``
    # reset the kept gradients, or a sequenced flush skipped a parameter
    # frozen since), the root makes it a real zero gradient.
    def hold_zero_grad(self) -> bool:
        """Give the parameter a zero ``.grad`` without memory if it has none
        (see the Note); whether it did."""
        param = self.module._parameters[self.attr]
        if param.grad is not None or not param.requires_grad:
            return False
        self.release_zero_grad()  # a zero the user reset (zero_grad set None): its hook
        self._released = None
        local = compat.local_tensor(param)
        # A tensor of its own, not an expanded view of a 0-d one: torch 2.11's
        # dynamo failed to fake a parameter whose .grad was such a view ("2 !=
        # 0" in meta_utils) in a resume frame of the sequenced path.
        zero = local.new_empty_strided(local.shape, (0,) * local.dim()).zero_()
        param.grad = grad_dtensor(zero, compat.dtensor_spec(param))
        self._zero = param.grad
        self._release = param.register_hook(self._before_accumulate)
        return True

    def _before_accumulate(self, grad: torch.Tensor) -> None:
        self.release_zero_grad()  # returns None: the gradient goes on unchanged

    def release_zero_grad(self, materialize: bool = False) -> None:
        """If ``.grad`` is still the zero ``hold_zero_grad`` gave: None, or
        with ``materialize`` a real zero gradient."""
        if self._release is None:
            return
        param = self.module._parameters[self.attr]
        if param.grad is self._zero:
            local = compat.local_tensor(param)
            param.grad = grad_dtensor(torch.zeros_like(local), compat.dtensor_spec(param)) if materialize else None
            self._released = (written(self._zero), param.grad)
        self._release.remove()  # torch allows it inside the hook itself
        self._zero = self._release = None

    def add_grad(self, grad: torch.Tensor) -> None:
        self.release_zero_grad()
        param = self.module._parameters[self.attr]
        if param.grad is None:
            param.grad = grad_dtensor(grad, compat.dtensor_spec(param))
        else:
            param.grad.to_local().add_(grad)

    def trainable(self) -> bool:
        return self.module._parameters[self.attr].requires_grad


def copy_rows(full: torch.Tensor, like: ShardParameter, into: torch.Tensor) -> None:
    """Copy this rank's rows of ``full`` (laid out as ``like``) into ``into``, in place."""
    full = full[like.piece] if like.piece else full
    rows = full[like.rows] if like.dim() else full
    with torch.no_grad(), compat.disable_torch_function_subclass():
        into.copy_(rows)


def rows_of(full: torch.Tensor, like: ShardParameter) -> DTensor:
    """This rank's rows of ``full`` (all of them, replicated), as a DTensor
    laid out like ``like``; a view of ``full`` where it can be."""
    with compat.disable_torch_function_subclass():
        full = full[like.piece] if like.piece else full
        local = full.detach()[like.rows] if full.dim() else full.detach()
    return DTensor.from_local(local.to(like.device), like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())  # fmt: skip


def dtensor_metas(params: tuple[DTensor, ...]) -> list:
    """What ``as_dtensor_grads`` needs of each parameter, kept by an autograd node: its spec."""
    return [compat.dtensor_spec(p) for p in params]


def as_dtensor_grads(grads: tuple[torch.Tensor | None, ...], specs: list) -> tuple[DTensor | None, ...]:
    """Local gradients as their parameters' DTensor gradients (``specs`` from ``dtensor_metas``)."""
    return tuple(None if g is None else grad_dtensor(g, spec) for g, spec in zip(grads, specs))


def grad_dtensor(grad: torch.Tensor, spec: Any) -> DTensor:
    """``grad``, this rank's part of a parameter's gradient, as a DTensor laid
    out as the parameter (``spec``). The parameter's own spec where the dtypes
    agree (no spec built, no autograd node: see ``compat.dtensor_of_spec``);
    ``from_local`` where the gradient has a graph of its own (``create_graph``)."""
    if grad.dtype == spec.tensor_meta.dtype and not grad.requires_grad:
        return compat.dtensor_of_spec(grad, spec)
    return DTensor.from_local(grad, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                              stride=spec.stride)  # fmt: skip


def shard_parameter(shard: DTensor, requires_grad: bool, rows: slice, piece: tuple[slice, ...] = ()) -> ShardParameter:
    """``shard``, which holds ``rows`` of its parameter (of its TP-local
    tensor at ``piece``), as a ``ShardParameter``: an ``nn.Parameter`` to
    torch (``isinstance(p, nn.Parameter)``), registered as modules hold parameters."""
    param = ShardParameter(compat.local_tensor(shard), compat.dtensor_spec(shard), requires_grad=requires_grad)
    param.rows, param.piece = rows, piece
    compat.mark_parameter(param)
    return param


def slot_backed(shard: DTensor, topology: Topology) -> DTensor:
    """A sharded DTensor whose local tensor starts a slot buffer of its own
    (``in_slot``, see Units.rehome); a replicated one as it is."""
    if not any(p.is_shard() for p in shard.placements):
        return shard
    local = in_slot(compat.local_tensor(shard), shard.shape, topology.shard.size)
    return DTensor.from_local(local, shard.device_mesh, shard.placements, run_check=False, shape=shard.shape,
                              stride=shard.stride())  # fmt: skip


def shard_of(full: torch.Tensor, topology: Topology, spec: ParamPlan) -> ShardParameter:
    """``full`` as this rank's DTensor on the mesh: replicated on every
    dimension but the shard dimension, where ``spec`` says. A
    tensor-parallel parameter (a DTensor) is sharded as its TP-local tensor,
    on the (dp, tp) mesh (see [Note: tensor-parallel parameters])."""
    tp = spec.tp
    if tp is not None:
        full = compat.local_tensor(full)
    # Shards are row-major whatever the parameter's strides (``nn.Parameter(w.t())``):
    # units, collectives and rows-of-a-full-value copies all assume it.
    full = full.detach().contiguous()
    shape, stride = (torch.Size(tp.shape), tp.stride) if tp is not None else (full.shape, full.stride())
    mesh, piece = topology.spmd_mesh(tp), topology.piece(tp) if tp is not None else ()
    rows = topology.rows(spec.dim0, sharded=not spec.replicated, tp=tp)
    if spec.replicated:  # the tensor itself, not a copy: a frozen tower is not held twice
        dt = DTensor.from_local(full, mesh, topology.placements(False, tp), run_check=False, shape=shape,
                                stride=stride)  # fmt: skip
        return shard_parameter(dt, spec.requires_grad, rows, piece)
    local = in_slot(full[rows], full.shape, spec.world_size)  # see Units.rehome
    dt = DTensor.from_local(local, mesh, topology.placements(True, tp), run_check=False, shape=shape,
                            stride=stride)  # fmt: skip
    return shard_parameter(dt, spec.requires_grad, rows, piece)
