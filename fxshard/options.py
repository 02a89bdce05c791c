"""``fxshard.compile``'s options, validated once into one frozen value.

The ``FXSHARD_*`` environment variables are read here too, once, when the
model is compiled: what a compile decided does not change if the
environment does later.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from torch.distributed.fsdp import MixedPrecisionPolicy

from fxshard.passes.pipeline import COMPILERS
from fxshard.passes.units import DEFAULT_UNIT_BYTES
from fxshard.policy import MixedPrecision
from fxshard.runtime import compat

BACKENDS = (*COMPILERS, "eager")


@dataclass(frozen=True)
class Options:
    zero_stage: int  # 1, 2 or 3
    mp_policy: MixedPrecision
    backend: str  # one of BACKENDS
    prefetch: int
    unit_mb: float | None  # None: fxshard's default (see passes/units.py:unit_limit)
    sharded_embeddings: bool
    compile_blocks_once: bool
    reduces_in_flight: int
    debug_dir: str | None  # or FXSHARD_DEBUG_DIR
    check_same_init: bool
    shard_frozen: bool
    check_collectives: bool  # FXSHARD_CHECK_COLLECTIVES=1, or TORCH_DISTRIBUTED_DEBUG=DETAIL
    disabled_passes: frozenset[str]  # FXSHARD_DISABLE_PASSES=name,...: bisecting
    inductor_config: tuple[tuple[str, Any], ...]  # FXSHARD_INDUCTOR_CONFIG=key=value,...

    @property
    def reshard_after_forward(self) -> bool:
        return self.zero_stage == 3

    @property
    def unit_bytes(self) -> int | None:
        return None if self.unit_mb is None else int(self.unit_mb * 2**20)

    @property
    def bucket_bytes(self) -> int:
        """ZeRO-1's and the sequenced reads' buckets: ``unit_mb``, or 256 MiB."""
        return DEFAULT_UNIT_BYTES if self.unit_mb is None else self.unit_bytes


def _from_fsdp2(policy: MixedPrecisionPolicy) -> MixedPrecision:
    """FSDP2's policy as fxshard's, so that ``fully_shard(model, mp_policy=...)``
    code moves over unchanged. fxshard does not cast the model's output."""
    if policy.output_dtype is not None:
        raise ValueError(
            f"mp_policy: MixedPrecisionPolicy(output_dtype={policy.output_dtype}) is not supported: fxshard does "
            "not cast the model's output. Pass output_dtype=None and cast the output in the model or the loss."
        )
    return MixedPrecision(policy.param_dtype, policy.reduce_dtype, policy.cast_forward_inputs)


def options(
    *,
    reshard_after_forward: object,
    zero_stage: object,
    mp_policy: object,
    backend: object,
    prefetch: object,
    unit_mb: object,
    sharded_embeddings: object,
    compile_blocks_once: object,
    reduces_in_flight: object,
    debug_dir: object,
    check_same_init: object,
    shard_frozen: object,
) -> Options:
    """The options of one ``fxshard.compile`` call, checked, with the
    environment's; a ``ValueError`` naming the option otherwise."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if mp_policy is None:
        mp_policy = MixedPrecision()
    elif isinstance(mp_policy, MixedPrecisionPolicy):
        mp_policy = _from_fsdp2(mp_policy)
    elif not isinstance(mp_policy, MixedPrecision):
        raise ValueError(
            f"mp_policy must be fxshard.MixedPrecision, FSDP2's MixedPrecisionPolicy or None, "
            f"got {type(mp_policy).__name__}"
        )
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0 (units gathered ahead), got {prefetch!r}")
    if unit_mb is not None and (isinstance(unit_mb, bool) or not isinstance(unit_mb, (int, float)) or not unit_mb > 0):
        raise ValueError(
            f"unit_mb must be a number > 0 (the most MiB of gathered weights a unit holds) or None, got {unit_mb!r}"
        )
    if isinstance(reduces_in_flight, bool) or not isinstance(reduces_in_flight, int) or reduces_in_flight < 1:
        raise ValueError(
            f"reduces_in_flight must be an int >= 1 (reduce-scatters running at once), got {reduces_in_flight!r}"
        )
    for name, value in (("sharded_embeddings", sharded_embeddings), ("compile_blocks_once", compile_blocks_once),
                        ("shard_frozen", shard_frozen), ("check_same_init", check_same_init)):  # fmt: skip
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")
    if debug_dir is None:
        debug_dir = os.environ.get("FXSHARD_DEBUG_DIR") or None
    elif not isinstance(debug_dir, (str, os.PathLike)):
        raise ValueError(f"debug_dir must be a path or None, got {debug_dir!r}")
    # A bad FXSHARD_INDUCTOR_CONFIG fails here, not inside dynamo.
    inductor_config = tuple(compat.env_inductor_config().items()) if backend == "inductor" else ()
    return Options(
        zero_stage=_zero_stage(zero_stage, reshard_after_forward), mp_policy=mp_policy, backend=backend,
        prefetch=prefetch, unit_mb=unit_mb, sharded_embeddings=sharded_embeddings,
        compile_blocks_once=compile_blocks_once, reduces_in_flight=reduces_in_flight,
        debug_dir=os.fspath(debug_dir) if debug_dir is not None else None, check_same_init=check_same_init,
        shard_frozen=shard_frozen, check_collectives=_check_collectives(),
        disabled_passes=frozenset(p.strip() for p in os.environ.get("FXSHARD_DISABLE_PASSES", "").split(",")
                                  if p.strip()),
        inductor_config=inductor_config,
    )  # fmt: skip


def _zero_stage(zero_stage: object, reshard_after_forward: object) -> int:
    """The ZeRO stage, from either name for it."""
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise ValueError(f"reshard_after_forward must be True or False, got {reshard_after_forward!r}")
    if zero_stage is None:
        return 2 if reshard_after_forward is False else 3
    if isinstance(zero_stage, bool) or zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage!r}")
    if reshard_after_forward is not None and reshard_after_forward != (zero_stage == 3):
        raise ValueError(
            f"zero_stage={zero_stage} and reshard_after_forward={reshard_after_forward} disagree: "
            "reshard_after_forward=True is zero_stage=3 and False is zero_stage=2; pass one of them"
        )
    return zero_stage


def _check_collectives() -> bool:
    return os.environ.get("FXSHARD_CHECK_COLLECTIVES", "0").lower() in ("1", "true", "yes") or (
        os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL"
    )
