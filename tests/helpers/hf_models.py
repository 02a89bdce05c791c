"""Hugging Face transformers models from small configs (no download).

Sizes are chosen so shards come out uneven at world sizes 2 and 3.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

VOCAB = 67


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=44, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    ))  # fmt: skip


def qwen3() -> nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=44, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False,
    ))  # fmt: skip


def mixtral(experts_implementation: str | None = None) -> nn.Module:
    """``experts_implementation="eager"``: transformers' loop over only the
    experts that received tokens, so parameter reads differ between ranks."""
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=16, num_experts_per_tok=2, max_position_embeddings=64,
        experts_implementation=experts_implementation,
    ))  # fmt: skip


def mixtral_expert_loop() -> nn.Module:
    return mixtral("eager")


def mamba() -> nn.Module:
    from transformers import MambaConfig, MambaForCausalLM

    return MambaForCausalLM(MambaConfig(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
        time_step_rank=4, use_mambapy=False,
    ))  # fmt: skip


def mamba2() -> nn.Module:
    from transformers import Mamba2Config, Mamba2ForCausalLM

    return Mamba2ForCausalLM(Mamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=1, expand=2,
        num_hidden_layers=2, conv_kernel=4, chunk_size=8,
    ))  # fmt: skip


def jamba() -> nn.Module:
    from transformers import JambaConfig, JambaForCausalLM

    return JambaForCausalLM(JambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
        attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_dt_rank=4, use_mamba_kernels=False, max_position_embeddings=64,
    ))  # fmt: skip


MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": llama,
    "qwen3": qwen3,
    "mixtral": mixtral,
    "mixtral_expert_loop": mixtral_expert_loop,
    "mamba": mamba,
    "mamba2": mamba2,
    "jamba": jamba,
}


def batch(gen: torch.Generator, length: int = 12) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, length), generator=gen)
    return {"input_ids": ids, "labels": ids}


def short_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    """8 tokens for 16 experts: each rank's batch reaches a different number of
    experts, so an expert loop runs a different number of times per rank."""
    return batch(gen, length=4)
