"""fxshard: FSDP / ZeRO-3 sharding by rewriting the compiled graph."""

from fxshard.api import ShardPlan, compile
from fxshard.graphs import CapturedStep, StepMemory, cuda_graph
from fxshard.plan import no_shard
from fxshard.policy import MixedPrecision

__version__ = "0.1.0"
__all__ = [
    "CapturedStep",
    "MixedPrecision",
    "ShardPlan",
    "StepMemory",
    "compile",
    "cuda_graph",
    "no_shard",
    "__version__",
]
