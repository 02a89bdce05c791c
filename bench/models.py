"""The benchmark's models: what each builds, its blocks, its loss and its FLOPs.

- ``375m``, ``1b``, ``8b``: the example's plain-PyTorch Llama (RMSNorm, RoPE,
  causal SDPA, SwiGLU, untied output), full multi-head attention.
- ``moe``: Hugging Face's OLMoE (transformers' own model code, its default
  ``grouped_mm`` experts): 32 experts, top-4, 16 layers, 940M parameters.
- ``hybrid``: tests/helpers/models.py's Hybrid at benchmark size: attention blocks,
  Mamba-style blocks that read their conv's weight directly and pass a weight
  to a custom op, and grouped-expert MoE layers, in one graph.
- ``tt_llama3_1b``, ``tt_qwen3_moe``, ``tt_dsv3``: torchtitan's own model code
  (tests/torchtitan/) at its own flavours: Llama 3 ``1B`` (tied embedding),
  Qwen3 ``debugmodel_moe`` (64 experts, top-8) and DeepSeek-V3 ``debugmodel``
  (MLA, 8 experts, top-3, 2 shared), built and initialized as torchtitan's
  trainer does (``init_weights``), with SDPA in place of flex attention (as
  torchtitan's graph trainer tests do). They take packed tokens. FSDP2's
  systems here are torchtitan's own setup: each block compiled, then
  ``fully_shard`` per block and on the root.
- ``tt_qwen3_moe_1b``: torchtitan's Qwen3-MoE code at 1.4B (16 layers, dim
  1024, 32 experts of hidden 768, top-8), built with its own layer builders:
  the expert-parallel rows' model (bench.py ``--ep``).
- ``tiny``, ``moe_tiny``, ``hybrid_tiny``, ``tt_tiny``, ``tt_qwen3_moe_tiny``: the same code
  at test size, for a smoke test on CPU (``--device cpu``).

The Llamas have a tensor-parallel plan (bench.py ``--tp``): torchtitan's
(tests/helpers/tp_models.py ``llama_tp_plan``, the plan the TP parity tests
use), with sequence parallelism, as torchtitan's default: attention and MLP
column- then row-wise, the embedding row-wise, the output column-wise, the
norms sequence-parallel; the logits replicated, or sharded on the vocabulary
with loss parallelism. torchtitan's MoE models have an expert-parallel setup
(bench.py ``--ep``): torchtitan's own (tests/helpers/ep_torchtitan.py),
experts ``Shard(0)`` on the ep mesh with its all-to-all token dispatcher.

FLOPs per token are 6 x the parameters a token passes through (OLMoE: the
router's top-k experts, not all of them) + 6 x attention layers x seq x dim,
the usual training estimate (forward and backward, no recompute). The
parameters are counted at their full size (a sharded one is a DTensor, whose
``numel`` is the whole tensor's), so the count is the model's under any
sharding; bench.py divides a token's FLOPs among the GPUs that share it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn as nn

from examples.llama import Llama, LlamaConfig, lm_loss


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    make: Callable[[], nn.Module]  # on the current default device, seeded by the caller
    vocab: int
    seq: int
    batch: int  # per GPU, unless --batch says otherwise
    warmup: int  # steps before the timed ones
    steps: int  # timed steps
    blocks: Callable[[nn.Module], nn.ModuleList]  # what FSDP2 wraps and compiles one by one
    loss: Callable[[nn.Module, torch.Tensor], torch.Tensor]  # (model, tokens) -> next-token loss
    flops_per_token: Callable[[nn.Module], float]  # training FLOPs per token (see the module docstring)
    # (model, loss_parallel) -> the TP plan for parallelize_module (--tp); None: the model has none
    tp_plan: Callable[[nn.Module, bool], dict] | None = None
    # (model, ep mesh) -> the model's own expert-parallel setup (--ep); None: the model has none
    ep_plan: Callable[[nn.Module, object], nn.Module] | None = None
    # block -> the module holding its experts' weights (None: it has none), which FSDP2 shards over efsdp (--ep)
    expert_module: Callable[[nn.Module], nn.Module | None] | None = None


def _llama(cfg: LlamaConfig, batch: int, warmup: int, steps: int) -> ModelSpec:
    def flops(model: nn.Module) -> float:
        params = sum(p.numel() for p in model.parameters())
        return 6 * params + 6 * cfg.layers * cfg.max_len * cfg.dim

    return ModelSpec(
        make=lambda: Llama(cfg), vocab=cfg.vocab, seq=cfg.max_len, batch=batch, warmup=warmup, steps=steps,
        blocks=lambda m: m.layers, loss=lambda m, t: lm_loss(m(t), t), flops_per_token=flops, tp_plan=_llama_tp_plan,
    )  # fmt: skip


def _llama_tp_plan(model: nn.Module, loss_parallel: bool) -> dict:
    from tests.helpers.tp_models import llama_tp_plan

    return llama_tp_plan(model, sequence_parallel=True, loss_parallel=loss_parallel)


def _olmoe(batch: int, warmup: int, steps: int, **sizes: int) -> ModelSpec:
    from transformers import OlmoeConfig

    cfg = OlmoeConfig(**sizes, bos_token_id=0, eos_token_id=1, pad_token_id=2)

    def make() -> nn.Module:
        from transformers import OlmoeForCausalLM

        return OlmoeForCausalLM(cfg)

    def flops(model: nn.Module) -> float:
        params = sum(p.numel() for p in model.parameters())
        experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
        active = params - experts * (1 - cfg.num_experts_per_tok / cfg.num_experts)
        return 6 * active + 6 * cfg.num_hidden_layers * cfg.max_position_embeddings * cfg.hidden_size

    def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        # use_cache=False, as in training: a key-value cache is inference state, and its
        # per-layer guards made FSDP2's per-block compile recompile past dynamo's limit.
        return lm_loss(model(input_ids=tokens, use_cache=False).logits.float(), tokens)

    return ModelSpec(
        make=make, vocab=cfg.vocab_size, seq=cfg.max_position_embeddings, batch=batch, warmup=warmup, steps=steps,
        blocks=lambda m: m.model.layers, loss=loss, flops_per_token=flops,
    )  # fmt: skip


def _hybrid(batch: int, warmup: int, steps: int, seq: int, **sizes) -> ModelSpec:
    from tests.helpers.models import Hybrid

    attention = sizes["pattern"].count("a")

    def flops(model: nn.Module) -> float:
        # Hybrid's experts run every token (gated to zero), so every parameter counts.
        return 6 * sum(p.numel() for p in model.parameters()) + 6 * attention * seq * sizes["dim"]

    return ModelSpec(
        make=lambda: Hybrid(**sizes, max_len=seq), vocab=sizes["vocab"], seq=seq, batch=batch, warmup=warmup,
        steps=steps, blocks=lambda m: m.layers, loss=lambda m, t: m(t, t), flops_per_token=flops,
    )  # fmt: skip


def _torchtitan(model: str, flavour: str | dict, batch: int, warmup: int, steps: int, seq: int) -> ModelSpec:
    """torchtitan's ``model`` at its ``flavour``, or, given a dict, tests/torchtitan/configs.py's
    config of ``model`` at those sizes (built with torchtitan's own layer builders)."""
    from tests.torchtitan.configs import CONFIGS, flavour_config, init

    if isinstance(flavour, dict):
        config = CONFIGS[model](seq_len=seq, **flavour)
    else:
        config = flavour_config(model, flavour, seq_len=seq)
    layers = len(config.layers)

    def make() -> nn.Module:
        module = config.build()
        module.verify_module_protocol()
        return init(module)  # the model's own init_weights, as torchtitan's trainer runs it

    def flops(module: nn.Module) -> float:
        params = sum(p.numel() for p in module.parameters())
        experts = [(n, p) for n, p in module.named_parameters() if ".routed_experts." in n]
        # each routed expert tensor is [experts, ...]: a token passes through top_k of them
        active = params - sum(p.numel() * (1 - _top_k(module, n) / p.shape[0]) for n, p in experts)
        return 6 * active + 6 * layers * seq * config.dim

    def loss(module: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        batch, length = tokens.shape
        positions = torch.arange(length, device=tokens.device).repeat(batch)
        logits = module(tokens.reshape(-1), positions).view(batch, length, -1)
        return lm_loss(logits.float(), tokens)

    return ModelSpec(
        make=make, vocab=config.vocab_size, seq=seq, batch=batch, warmup=warmup, steps=steps,
        blocks=lambda m: m.layers, loss=loss, flops_per_token=flops,
        ep_plan=_torchtitan_ep if any(getattr(layer, "moe", None) for layer in config.layers) else None,
        expert_module=_torchtitan_experts,
    )  # fmt: skip


def _torchtitan_ep(model: nn.Module, ep_mesh) -> nn.Module:
    """torchtitan's EP setup: experts Shard(0) on ep, its all-to-all dispatcher wired to the ep mesh
    (tests/helpers/ep_torchtitan.py)."""
    from tests.helpers.ep_torchtitan import parallelize

    return parallelize(model, ep_mesh)


def _torchtitan_experts(block: nn.Module) -> nn.Module | None:
    return block.moe.routed_experts.inner_experts if getattr(block, "moe_enabled", False) else None


def _top_k(module: nn.Module, name: str) -> int:
    layer = module.get_submodule(name.split(".moe.")[0])
    return layer.moe.router.top_k


SEQ = 2048
MODELS: dict[str, Callable[[], ModelSpec]] = {
    "375m": lambda: _llama(LlamaConfig(vocab=32768, dim=1024, layers=24, heads=16, hidden=2816, max_len=SEQ,
                                       tie_embeddings=False), 4, 4, 12),
    "1b": lambda: _llama(LlamaConfig(vocab=32768, dim=2048, layers=16, heads=16, hidden=5632, max_len=SEQ,
                                     tie_embeddings=False), 2, 4, 12),
    "8b": lambda: _llama(LlamaConfig(vocab=128256, dim=4096, layers=32, heads=32, hidden=14336, max_len=SEQ,
                                     tie_embeddings=False), 1, 3, 8),
    "moe": lambda: _olmoe(2, 4, 12, vocab_size=32768, hidden_size=1024, intermediate_size=512, num_hidden_layers=16,
                          num_attention_heads=16, num_key_value_heads=16, num_experts=32, num_experts_per_tok=4,
                          max_position_embeddings=1024),
    "hybrid": lambda: _hybrid(2, 4, 12, SEQ, vocab=32768, dim=1024, heads=16, pattern="amx" * 8, mlp_hidden=2816,
                              mamba_inner=2048, experts=8, expert_hidden=1024, top_k=2),
    "tt_llama3_1b": lambda: _torchtitan("llama3", "1B", 2, 4, 12, SEQ),
    "tt_qwen3_moe": lambda: _torchtitan("qwen3", "debugmodel_moe", 4, 4, 12, SEQ),
    "tt_dsv3": lambda: _torchtitan("deepseek_v3", "debugmodel", 4, 4, 12, SEQ),
    # Qwen3-MoE at 1.4B (32 experts, top-8, Qwen3's 128-wide heads): the expert-parallel row's model.
    "tt_qwen3_moe_1b": lambda: _torchtitan("qwen3_moe", dict(
        dim=1024, n_layers=16, n_heads=16, n_kv_heads=8, head_dim=128, moe_hidden_dim=768, num_experts=32, top_k=8,
        vocab=32768, max_context=SEQ), 2, 4, 12, SEQ),
    "tiny": lambda: _llama(LlamaConfig(vocab=64, dim=32, layers=2, heads=2, hidden=48, max_len=64,
                                       tie_embeddings=False), 1, 1, 2),
    "moe_tiny": lambda: _olmoe(1, 1, 2, vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=64),
    "hybrid_tiny": lambda: _hybrid(1, 1, 2, 64, vocab=41, dim=20, heads=2, pattern="amx"),
    "tt_tiny": lambda: _torchtitan("deepseek_v3", "tiny", 1, 1, 2, 32),
    "tt_qwen3_moe_tiny": lambda: _torchtitan("qwen3_moe", dict(num_experts=4), 1, 1, 2, 32),
}  # fmt: skip
