"""Tiny stand-ins for the parts of torchtitan that its model code imports but a
single-process forward/backward never needs.

Written for fxshard's tests (not copied from torchtitan). The model files under
this folder are copies of pytorch/torchtitan; where they imported torchtitan
infrastructure (trainer config, logging, protocols, parallelism, EP kernels,
state-dict adapters) or the external ``spmd_types`` package, the import points
here instead. Everything here is either

* the "off" behaviour that torchtitan itself has when no parallelism or SPMD
  type checking is active (``get_spmd_backend() != "spmd_types"``, no current
  mesh, no batch-invariant mode, no regional inductor, ``spmd_types`` helpers
  that are documented no-ops outside type checking), or
* a placeholder that raises if a code path that needs real torchtitan is
  reached (parallelize functions, pipelining, EP dispatch kernels, FSDP, ...).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

# --------------------------------------------------------------------------
# spmd_types (external package: github.com/pytorch/spmd_types). Outside an
# active type-checking mode all of these are documented no-ops; type checking
# is never active here, so ``is_type_checking()`` is always False.
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _no_op():
    """Does nothing; usable as ``with`` and as a decorator. A generator context
    manager (like spmd_types' own ``local()``/``no_typecheck()``) so that dynamo
    traces through it instead of breaking the graph."""
    yield


def _identity_decorator(fn):
    return fn


class _SpmdType:
    def __init__(self, name: str):
        self.name = name

    def __call__(self, *args):  # S(dim)
        return _SpmdType(f"{self.name}{args}")

    def __repr__(self) -> str:
        return self.name


class _SpmdTypesRuntime:
    @staticmethod
    def get_partition_spec(t):
        return None

    @staticmethod
    def get_local_type(t):
        return None

    @staticmethod
    def has_local_type(t) -> bool:
        return False


class spmd_types:  # noqa: N801 - stands in for the module ``spmd_types``
    R = _SpmdType("R")
    I = _SpmdType("I")  # noqa: E741
    V = _SpmdType("V")
    P = _SpmdType("P")
    S = _SpmdType("S")
    runtime = _SpmdTypesRuntime

    class PartitionSpec(tuple):
        def __new__(cls, *args):
            return super().__new__(cls, args)

    @staticmethod
    def is_type_checking() -> bool:
        return False

    @staticmethod
    def local():
        return _no_op()

    @staticmethod
    def no_typecheck(fn=None, /, **kwargs):
        if fn is not None:
            return fn
        if kwargs:
            return _identity_decorator
        return _no_op()

    @staticmethod
    def local_map(*, in_types: Any = None, out_types: Any = None):
        return _identity_decorator

    @staticmethod
    def assert_type(*args, **kwargs) -> None:
        return None

    @staticmethod
    def mutate_type(*args, **kwargs) -> None:
        return None

    @staticmethod
    def get_local_type(t):
        return None

    @staticmethod
    def register_autograd_function(cls):
        return cls

    @staticmethod
    def all_to_all(*args, **kwargs):
        raise NotImplementedError("spmd_types.all_to_all: expert parallelism is not available in these test copies")


get_partition_spec = _SpmdTypesRuntime.get_partition_spec
get_local_type = _SpmdTypesRuntime.get_local_type
has_local_type = _SpmdTypesRuntime.has_local_type


# --------------------------------------------------------------------------
# torchtitan.distributed.utils / .compile / .spmd_types / .parallel_dims,
# torchtitan.protocols.sharding, torchtitan.tools.utils
# --------------------------------------------------------------------------


def get_spmd_backend() -> str:
    # torchtitan's default is "spmd_types", but every branch on it is also
    # gated on an active spmd mesh / type checking; "partial_dtensor" (its other
    # value) keeps all of those branches off without needing the package.
    return "partial_dtensor"


def is_in_batch_invariant_mode() -> bool:
    return False


def maybe_regional_inductor(inductor_configs: dict) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext()


def current_spmd_mesh():
    return None


def spmd_mesh_size(axis_name: str) -> int:
    return 1


@contextlib.contextmanager
def maybe_set_sparse_mesh():
    yield


def _needs_torchtitan(name: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"{name} needs torchtitan's parallelism code, which is not copied here")

    fn.__name__ = name
    return fn


set_current_spmd_mesh = _needs_torchtitan("set_current_spmd_mesh")
spmd_distribute_tensor = _needs_torchtitan("spmd_distribute_tensor")
spmd_redistribute_per_axis = _needs_torchtitan("spmd_redistribute_per_axis")
spmd_validate_redistributions = _needs_torchtitan("spmd_validate_redistributions")
check_dtensor_placements_match = _needs_torchtitan("check_dtensor_placements_match")
resolve_placements = _needs_torchtitan("resolve_placements")


class ParallelDims:
    """Placeholder type (only used in annotations and Module.parallelize)."""


class SpmdLayout:
    """Placeholder type (only used in annotations and Module.parallelize)."""


class ShardingConfig:
    """Placeholder type: the tiny test configs never set ``sharding_config``."""


def round_up(value: int, multiple: int) -> int:
    # Same as torchtitan.tools.utils.round_up.
    return ((value + multiple - 1) // multiple) * multiple


def has_cuda_capability(major: int, minor: int) -> bool:
    # Same as torchtitan.tools.utils.has_cuda_capability.
    return (
        torch.cuda.is_available() and torch.version.hip is None and torch.cuda.get_device_capability() >= (major, minor)
    )


def get_cuda_flash_attention_impl() -> str | None:
    # Same as torchtitan.tools.utils.get_cuda_flash_attention_impl.
    if has_cuda_capability(10, 0):
        return "FA4"
    if has_cuda_capability(9, 0):
        return "FA3"
    return None


device_type = "cuda" if torch.cuda.is_available() else "cpu"
device_module = getattr(torch, device_type)


# --------------------------------------------------------------------------
# torchtitan.observability.structured_logger, torchtitan.tools.logging
# --------------------------------------------------------------------------


class structured_logger:  # noqa: N801 - stands in for the module
    @staticmethod
    def log_trace_span(name: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


logger = logging.getLogger("torchtitan")


# --------------------------------------------------------------------------
# torchtitan.distributed.minimal_async_ep (EP kernels; EP is not used here)
# --------------------------------------------------------------------------

combine_op = _needs_torchtitan("minimal_async_ep.combine_op")
dispatch_op = _needs_torchtitan("minimal_async_ep.dispatch_op")
init_buffer = _needs_torchtitan("minimal_async_ep.init_buffer")


@dataclass(frozen=True, kw_only=True)
class MinimalAsyncEPDispatchMetadata:
    """Placeholder for the EP dispatch metadata type."""


# --------------------------------------------------------------------------
# torchtitan.models.common.dist_gemm (tp_gemm_backend="dist_gemm" only)
# --------------------------------------------------------------------------


class _DistGemmPlaceholder:
    class Config:
        def __init__(self, *args, **kwargs):
            raise NotImplementedError("tp_gemm_backend='dist_gemm' is not available in these test copies")


class AllGatherFusedFeedForward(_DistGemmPlaceholder):
    pass


class AllGatherFusedQKVLinear(_DistGemmPlaceholder):
    pass


class RowParallelLinear(_DistGemmPlaceholder):
    pass


# --------------------------------------------------------------------------
# Trainer-side pieces referenced by the model registries (model_registry())
# and by deepseek_v3/mtp.py's loss / FSDP helpers.
# --------------------------------------------------------------------------


@dataclass(kw_only=True)
class ModelSpec:
    """Plain record standing in for torchtitan.protocols.model_spec.ModelSpec."""

    name: str
    flavor: str
    model: Any
    parallelize_fn: Any = None
    pipelining_fn: Any = None
    post_optimizer_build_fn: Any = None
    state_dict_adapter: Any = None


@dataclass(kw_only=True)
class CompileConfig:
    enable: bool = False
    components: list = None
    backend: str = "inductor"


parallelize_llama = _needs_torchtitan("parallelize_llama")
parallelize_qwen3 = _needs_torchtitan("parallelize_qwen3")
parallelize_deepseekv3 = _needs_torchtitan("parallelize_deepseekv3")
pipeline_llm = _needs_torchtitan("pipeline_llm")
register_moe_load_balancing_hook = _needs_torchtitan("register_moe_load_balancing_hook")
apply_fsdp_to_decoder = _needs_torchtitan("apply_fsdp_to_decoder")


class StateDictAdapter:
    """Placeholder base for torchtitan.protocols.state_dict_adapter.StateDictAdapter."""


class Llama3StateDictAdapter(StateDictAdapter):
    pass


class Qwen3StateDictAdapter(StateDictAdapter):
    pass


class DeepSeekV3StateDictAdapter(StateDictAdapter):
    pass


# torchtitan.components.loss
IGNORE_INDEX = -100
LossFunction = Any


def cross_entropy_loss(
    pred: torch.Tensor, labels: torch.Tensor, *, global_vocab_size: int | None = None
) -> torch.Tensor:
    """torchtitan.components.loss.cross_entropy_loss without the TP loss-parallel branches."""
    return torch.nn.functional.cross_entropy(pred.float(), labels, reduction="sum", ignore_index=IGNORE_INDEX)


def __getattr__(name: str):
    # BaseLoss subclasses Configurable, whose module imports this one: build it
    # on first use to keep the import order free of cycles.
    if name == "BaseLoss":
        from .config.configurable import Configurable

        class BaseLoss(Configurable):
            """torchtitan.components.loss.BaseLoss without compile support."""

            @dataclass(kw_only=True, slots=True)
            class Config(Configurable.Config):
                pass

            def _maybe_compile(self, compile_config) -> None:
                return None

            def __call__(self, pred, labels, global_valid_tokens=None, **kwargs):
                loss = self.fn(pred, labels)
                if global_valid_tokens is not None:
                    loss = loss / global_valid_tokens
                return loss, {}

        globals()["BaseLoss"] = BaseLoss
        return BaseLoss
    raise AttributeError(name)


# torch.distributed.fsdp.DataParallelMeshDims (torch >= 2.12); the MTP code only annotates with it.
try:
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # torch 2.11
    DataParallelMeshDims = Any
