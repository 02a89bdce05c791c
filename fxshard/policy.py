"""User-facing policies: frozen, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for compute and gradient reduction.

    - ``param_dtype``: the dtype parameters are gathered and computed in. The
      cast happens before the all-gather. Shards keep their own dtype and
      serve as the master weights. None: the shard's dtype.
    - ``reduce_dtype``: the dtype gradients are reduced in; the result lands
      in the shard's dtype. None: the gradient's dtype (``param_dtype``).
    - ``cast_forward_inputs``: cast the floating-point tensors among the
      model's call arguments to ``param_dtype`` (FSDP2's default too), so that
      fp32 images meet bf16 weights; integer ids are left alone.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for field in ("param_dtype", "reduce_dtype"):
            value = getattr(self, field)
            if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
                raise ValueError(
                    f"MixedPrecision.{field} must be a floating torch.dtype or None, got {value!r}; "
                    f"for example MixedPrecision({field}=torch.bfloat16)"
                )
        if not isinstance(self.cast_forward_inputs, bool):
            raise ValueError(
                f"MixedPrecision.cast_forward_inputs must be True or False, got {self.cast_forward_inputs!r}"
            )
