"""The user's module after ``fxshard.compile``: its shards, the reads and writes of its parameters, its calls.

[Note: the module package]
``fxshard.compile`` changes the user's module in place (see [Note: gather on
access] in swap.py). What that takes is here, one concern per file, listed
so that each file imports only files above it:

- ``shards.py``: ``ShardParameter``, the ``nn.Parameter`` registered for each
  parameter, and the rows of the full parameter a rank holds.
- ``optimizers.py``: what optimizer steps see: the shards' step count, and
  the checks before each step.
- ``writes.py``: a full value read outside a root call, whose writes reach
  the shard.
- ``zero1.py``: ZeRO-1's full copies.
- ``reads.py``: the property that gathers a parameter, and the local shards
  each root call hands to the graphs.
- ``root.py``: ``RootState``, the root's call.
- ``hf.py``: Hugging Face's ``save_pretrained``.
- ``checkpoint.py``: the state-dict hooks.
- ``structure.py``: the check that no parameter joins the model after
  compile, through a new submodule or a registration.
- ``swap.py``: ``shard_parameters``, which swaps parameters for shards and
  classes for gathering ones, and builds everything above.

Why this way:
- By concern, not by class: a change to one behaviour (the write-through
  emulation, a Hugging Face quirk, a strategy's read) is a change to one
  file, and a reader of one finds no other. The user-facing classes stay
  whole in the file of their concern; the files are small enough to read
  at once.
- Imports point one way, from ``swap.py`` down to ``shards.py``, with no
  cycle. ``fxshard/plan.py`` imports ``writes.py`` (for
  ``GatheredParameter``), so ``writes.py`` and the files it imports may not
  import ``fxshard.plan`` when they load (``shards.py`` imports ``ParamPlan``
  for annotations only), and this ``__init__`` re-exports nothing: loading
  ``writes.py`` must not load ``swap.py``, which imports ``fxshard.plan``.
- A package, not more files beside ``api.py``: these files are the API
  layer's side of the user's module (the graph passes and the runtime never
  import them), and the rest of fxshard reaches in at few places:
  ``api.py`` calls ``swap.shard_parameters`` and ``checkpoint.install`` and
  keeps the ``root.RootState``; ``graphs.py`` reads ``root.CALLED_ROOTS``;
  ``plan.py`` recognizes a ``writes.GatheredParameter``.
"""
