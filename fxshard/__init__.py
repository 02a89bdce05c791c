"""fxshard: FSDP / ZeRO-3 sharding by rewriting the compiled graph."""

from fxshard.api import ShardPlan, compile
from fxshard.policy import MixedPrecision

__version__ = "0.1.0"
__all__ = ["MixedPrecision", "ShardPlan", "compile", "__version__"]
