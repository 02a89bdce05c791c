"""Parity checks for Hugging Face transformers models (see tests/hf_models.py)."""

from __future__ import annotations

import collections
import copy
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import fxshard
from examples.llama import Llama, LlamaConfig, lm_loss
from tests import hf_models
from fxshard.runtime.compat import CHECKPOINT_REGIONS_SUPPORTED
from tests.parity import ATOL, RTOL, Scenario, _device, train_and_compare


def _hf_loss(out: Any, batch: Any) -> torch.Tensor:
    return out.loss  # the model computes it from labels=, as users call it


def _hf(name: str, **kwargs: Any) -> Scenario:
    make_batch = hf_models.short_batch if name.startswith("mixtral") else hf_models.batch
    kwargs.setdefault("compile_kwargs", dict(backend="aot_eager"))
    return Scenario(make_model=hf_models.MODELS[name], make_batch=make_batch, loss=_hf_loss, steps=1, **kwargs)


class CheckpointedLlama(Llama):
    """The example's Llama with ``torch.utils.checkpoint`` around each block."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = checkpoint(layer, h, self.rope_cos, self.rope_sin, use_reentrant=False)
        return self.output(self.norm(h)).float()


HF_SCENARIOS: dict[str, Scenario] = {
    **{f"hf_{name}": _hf(name) for name in hf_models.MODELS},
    # Not here yet: transformers' gradient_checkpointing_enable(). AOTAutograd
    # then saves the DTensor's DeviceMesh (an opaque graph input) for backward
    # and fails ("expected all tensors_saved_with_vc_check to be Tensors").
    "llama_block_checkpoint": Scenario(
        make_model=lambda: CheckpointedLlama(LlamaConfig()), make_batch=lambda g: torch.randint(0, 37, (2, 9), generator=g),
        loss=lm_loss, compile_kwargs=dict(backend="aot_eager"), steps=2,
    ),
}


def block_checkpoint_gathers_once(rank: int, world_size: int) -> None:
    """Checkpointed blocks: backward gathers each parameter once, for the
    recompute and the gradients together, never twice. Where torch cannot
    (see compat.CHECKPOINT_REGIONS_SUPPORTED), the error says so."""
    scenario = HF_SCENARIOS["llama_block_checkpoint"]
    if not CHECKPOINT_REGIONS_SUPPORTED:
        try:
            train_and_compare(rank, world_size, scenario)
        except Exception as error:  # dynamo wraps the backend's error
            assert "activation checkpointing inside an fxshard-compiled graph" in str(error), error
            return
        raise AssertionError("expected a clear NotImplementedError for checkpointing on this torch")
    graphs = train_and_compare(rank, world_size, scenario)["graphs"]
    for record in graphs:
        gathered = collections.Counter(s.param for s in record.reports["backward"].sites if s.kind == "unshard")
        assert gathered and max(gathered.values()) == 1, gathered
        assert record.saved_full_weights == ()


def eval_changing_lengths(rank: int, world_size: int) -> None:
    """no_grad forwards at six sequence lengths: outputs match, and dynamic
    shapes keep the compiled graphs to at most two (one static, one dynamic)."""
    device = _device(rank)
    torch.manual_seed(0)
    model = hf_models.llama().to(device)
    ref = copy.deepcopy(model)
    fxshard.compile(model, backend="aot_eager")
    for length in (5, 6, 7, 9, 11, 13):
        ids = torch.randint(0, hf_models.VOCAB, (2, length), generator=torch.Generator().manual_seed(rank + length))
        ids = ids.to(device)
        with torch.no_grad():
            out = model(input_ids=ids)
        assert type(out).__name__ == "CausalLMOutputWithPast"
        torch.testing.assert_close(out.logits, ref(input_ids=ids).logits, atol=ATOL, rtol=RTOL)
    graphs = model.fxshard_plan.graphs
    assert 1 <= len(graphs) <= 2, f"{len(graphs)} graphs for 6 lengths: recompiling per length"
    assert all(g.reports["inference"].count("reduce") == 0 for g in graphs)


HF_CHECKS: dict[str, Callable[[int, int], None]] = {
    "llama_block_checkpoint_gathers_once": block_checkpoint_gathers_once,
    "hf_eval_changing_lengths": eval_changing_lengths,
}
