"""Hugging Face glue: ``save_pretrained`` of a sharded model.

The root's class gets the ``save_pretrained`` made here only where its base
class has one that takes a ``state_dict`` (``_root_methods`` in
fxshard/module/swap.py). Nothing here imports transformers or peft: their
methods are recognized by signature, and peft's, which reads ``state_dict``
from ``**kwargs``, by its source text.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


def takes_state_dict(method: Any) -> bool:
    """Whether ``method`` takes a ``state_dict`` argument: transformers'
    ``save_pretrained`` names it, peft's reads it from ``**kwargs``."""
    if method is None:
        return False
    try:
        params = inspect.signature(method).parameters
        if "state_dict" in params:
            return True
        keywords = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        return keywords and 'kwargs.get("state_dict"' in inspect.getsource(method)
    except (TypeError, ValueError, OSError):
        return False


def save_pretrained_method(base: type) -> Callable[..., Any]:
    """Hugging Face's ``save_pretrained`` writes ``self.state_dict()``: this
    rank's shards, which safetensors refuses ("invalid python storage"), or
    worse. Gathering here would hang when only rank 0 saves, as is usual, so
    the full state dict is the caller's to pass."""

    signature = inspect.signature(base.save_pretrained)

    def save_pretrained(self, *args: Any, **kwargs: Any) -> Any:
        given = signature.bind_partial(self, *args, **kwargs).arguments
        state_dict = given.get("state_dict", given.get("kwargs", {}).get("state_dict"))
        if state_dict is None:
            raise ValueError(
                "save_pretrained of a model that fxshard.compile sharded needs its full weights: on every rank, "
                "sd = torch.distributed.checkpoint.state_dict.get_model_state_dict(model, "
                "options=StateDictOptions(full_state_dict=True, cpu_offload=True)); then on rank 0, "
                "model.save_pretrained(path, state_dict=sd)"
            )
        return base.save_pretrained(self, *args, **kwargs)

    return save_pretrained
