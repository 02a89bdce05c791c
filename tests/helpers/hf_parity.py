"""Parity checks for Hugging Face transformers models (see tests/helpers/hf_models.py)."""

from __future__ import annotations

import collections
import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import fxshard
from examples.llama import Llama, LlamaConfig, lm_loss
from fxshard.runtime.compat import is_checkpoint_region
from tests.helpers import hf_models
from tests.helpers.parity import ATOL, RTOL, Scenario, _device, train_and_compare


def _hf_loss(out: Any, batch: Any) -> torch.Tensor:
    return out.loss  # the model computes it from labels=, as users call it


SEQUENCED = {
    "mixtral_expert_loop": True,
    "jamba": True,
    "llama": False,
    "qwen3": False,
    "mamba": False,
    "mamba2": False,
}


def _hf(name: str, **kwargs: Any) -> Scenario:
    make_batch = hf_models.short_batch if name.startswith("mixtral") else hf_models.batch
    kwargs.setdefault("compile_kwargs", dict(backend="aot_eager"))
    kwargs.setdefault("sequenced", SEQUENCED.get(name))
    return Scenario(make_model=hf_models.MODELS[name], make_batch=make_batch, loss=_hf_loss, steps=1, **kwargs)


def _checkpointing(**kwargs: Any) -> Callable[[nn.Module], None]:
    def prepare(model: nn.Module) -> None:
        model.config.use_cache = False  # else transformers logs a warning: a graph break
        model.gradient_checkpointing_enable(kwargs or None)

    return prepare


class CheckpointedLlama(Llama):
    """The example's Llama with ``torch.utils.checkpoint`` around each block."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = checkpoint(layer, h, self.rope_cos, self.rope_sin, use_reentrant=False)
        return self.output(self.norm(h)).float()


HF_SCENARIOS: dict[str, Scenario] = {
    **{f"hf_{name}": _hf(name) for name in hf_models.MODELS if name != "mamba"},
    # Mamba's fused scan under Inductor on GPUs sums in another order: one
    # embedding element of 2144 came out 2.9e-5 off after the first AdamW
    # step (Adam's first update divides by |grad|, so a tiny gradient's
    # rounding shows at the scale of the learning rate).
    "hf_mamba": _hf("mamba", atol=5e-5),
    "hf_llama_gradient_checkpointing": _hf("llama", prepare=_checkpointing()),
    "hf_qwen3_gradient_checkpointing_reentrant": _hf("qwen3", prepare=_checkpointing(use_reentrant=True)),
    # The expert loop's graph breaks put the checkpoint in eager code, which
    # recomputes in backward through the sequencer: non-reentrant
    # (transformers' default) raised CheckpointError on one rank and aborted
    # the other; reentrant hung, each rank gathering the experts its tokens
    # reached.
    "hf_mixtral_expert_loop_gradient_checkpointing": _hf("mixtral_expert_loop", prepare=_checkpointing()),
    "hf_mixtral_expert_loop_gradient_checkpointing_reentrant": _hf(
        "mixtral_expert_loop", prepare=_checkpointing(use_reentrant=True)
    ),
    "llama_block_checkpoint": Scenario(
        make_model=lambda: CheckpointedLlama(LlamaConfig()),
        make_batch=lambda g: torch.randint(0, 37, (2, 9), generator=g),
        loss=lm_loss,
        compile_kwargs=dict(backend="aot_eager"),
        steps=2,
    ),
}


CHECKPOINTED = (
    "llama_block_checkpoint",
    "hf_llama_gradient_checkpointing",
    "hf_qwen3_gradient_checkpointing_reentrant",
)


def checkpoint_gathers_once(scenario_name: str) -> Callable[[int, int], None]:
    """Checkpointed blocks keep parity, their weights move in units (they
    were once gathered one by one, all at the top of the forward), and
    backward gathers each parameter once, for the recompute and the
    gradients together, never twice; the forward saves no full weight."""

    def check(rank: int, world_size: int) -> None:
        # A unit per parameter: one unit would be the whole model, kept from forward to backward
        # (the last unit gathered is), and backward would gather nothing to check.
        scenario = HF_SCENARIOS[scenario_name]
        scenario = dataclasses.replace(scenario, compile_kwargs={**scenario.compile_kwargs, "unit_mb": 1e-6})
        model = train_and_compare(rank, world_size, scenario)["model"]
        plan = model.fxshard_plan
        assert not plan.sequenced, "expected one graph: the test checks the graph's collectives"
        regions = sum(is_checkpoint_region(n) for g in plan.graphs for n in g.captured.graph.nodes)
        assert regions >= 2, f"expected a checkpoint region per block, found {regions}"
        trained = [g for g in plan.graphs if "backward" in g.reports]
        assert trained
        for record in trained:
            read = {s.param for s in record.reports["forward"].sites if s.kind == "unshard"}
            if plan.units is not None:
                assert read <= set(plan.units.unit_of), f"in no unit: {sorted(read - set(plan.units.unit_of))}"
            gathered = collections.Counter(s.param for s in record.reports["backward"].sites if s.kind == "unshard")
            assert gathered and max(gathered.values()) == 1, gathered
            # Only the unit gathered last in forward is kept for backward.
            saved = record.saved_full_weights
            assert len({plan.units.unit_of[p][0] for p in saved}) <= 1 if plan.units else saved == (), saved

    return check


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


def save_pretrained(rank: int, world_size: int) -> None:
    """``save_pretrained`` without the full weights raises, naming the fix;
    with the exported full state dict, rank 0's save loads back in
    transformers as the sharded model's weights."""
    import tempfile

    import pytest
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    device = _device(rank)
    torch.manual_seed(0)
    model = fxshard.compile(hf_models.llama().to(device), backend="aot_eager")
    ids = torch.randint(0, hf_models.VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank)).to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    with pytest.raises(ValueError, match="needs its full weights"):
        model.save_pretrained(path[0])
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        model.save_pretrained(path[0], state_dict=full)
    dist.barrier()
    loaded = type(hf_models.llama()).from_pretrained(path[0])
    for name, p in model.named_parameters():
        torch.testing.assert_close(loaded.get_parameter(name), p.full_tensor().cpu(), atol=0, rtol=0, msg=name)


HF_CHECKS: dict[str, Callable[[int, int], None]] = {
    **{f"{name}_gathers_once": checkpoint_gathers_once(name) for name in CHECKPOINTED},
    "hf_eval_changing_lengths": eval_changing_lengths,
    "hf_save_pretrained": save_pretrained,
}
