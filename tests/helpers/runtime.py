"""The one place tests read a compiled model's runtime (its ``RootState``:
plan table, shards, gradient store, sequencer), so that a change to where
the runtime lives changes this file, not every test."""

from __future__ import annotations

from typing import Any


def state(of: Any) -> Any:
    """The runtime of a model compiled by ``fxshard.compile``, or of its ``fxshard_plan``."""
    return getattr(of, "fxshard_plan", of).root
