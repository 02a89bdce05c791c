"""Tiny configs of torchtitan's own models, built with torchtitan's own config builders.

fxshard's code, not a torchtitan copy. Each ``*_config()`` returns the model's
torchtitan ``Config`` (``Llama3Model.Config``, ``Qwen3Model.Config``,
``DeepSeekV3Model.Config``), assembled with the same layer builders and
initializers that torchtitan's flavours (``llama3_configs["1B"]`` etc.) use,
only at test size. Sizes are odd on purpose (vocab 131/127/129, FFN hidden 221,
97, ...) so that dim-0 shards come out uneven.

Inputs: torchtitan's decoders take *packed* tokens, ``tokens[T]`` -> logits
``[T, vocab]`` (its dataloader flattens the batch; ``positions[T]`` restart at 0
for each sequence). ``make_batch`` turns a ``(batch, seq_len)`` batch into that
form. torchtitan's language models only accept flex/varlen attention (its
``get_attention_config("sdpa")`` raises); like torchtitan's own graph_trainer
tests (``experiments/graph_trainer/common_utils.py``) we swap each layer's
``inner_attention`` for an SDPA module instead. ``attn="flex"`` or ``"varlen"``
keeps torchtitan's backend (then pass ``attention_masks=model.get_attention_masks(positions)``).

Typical use, as torchtitan's trainer does it::

    model = build("llama3")                     # on the meta device
    model.to_empty(device="cuda")
    init(model, buffer_device=None)             # model.init_weights(buffer_device=...) under no_grad
    tokens, positions, labels = make_batch(VOCAB["llama3"], device="cuda")
    loss = F.cross_entropy(model(tokens, positions).float(), labels)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .models.common import ComplexRoPE, CosSinRoPE, Embedding, Linear, RMSNorm
from .models.common.attention import ScaledDotProductAttention
from .models.common.feed_forward import compute_ffn_hidden_dim
from .models.deepseek_v3 import (
    _EMBEDDING_INIT as _DSV3_EMBEDDING_INIT,
    _NORM_INIT as _DSV3_NORM_INIT,
    _build_dsv3_layers,
    _build_mtp_layers,
    _output_linear_init as _dsv3_output_linear_init,
)
from .models.deepseek_v3.model import DeepSeekV3Model
from .models.llama3 import (
    _EMBEDDING_INIT as _LLAMA3_EMBEDDING_INIT,
    _EMBEDDING_SKIP_INIT as _LLAMA3_EMBEDDING_SKIP_INIT,
    _NORM_INIT as _LLAMA3_NORM_INIT,
    _build_llama3_layers,
    _output_linear_init as _llama3_output_linear_init,
)
from .models.llama3.model import Llama3Model
from .models.qwen3 import (
    _EMBEDDING_INIT as _QWEN3_EMBEDDING_INIT,
    _EMBEDDING_SKIP_INIT as _QWEN3_EMBEDDING_SKIP_INIT,
    _LINEAR_INIT as _QWEN3_LINEAR_INIT,
    _build_qwen3_layers,
    _build_qwen3_moe_layers,
    _qwen3_norm,
)
from .models.qwen3.model import Qwen3Model

SEQ_LEN = 32
# RoPE cache length. With positions=None RoPE uses rows 0..T-1 of the cache, so
# this bounds the packed token count T of a call that passes no positions.
MAX_CONTEXT = 256


class PackedSDPA(ScaledDotProductAttention):
    """SDPA on torchtitan's packed ``[T, N, H]`` attention inputs.

    With ``seq_len=None`` this is torchtitan's ``GraphTrainerScaledDotProductAttention``
    (one causal sequence over all T tokens). With ``seq_len`` set, the T tokens are
    ``T // seq_len`` independent causal sequences, so a flattened ``(B, seq_len)``
    batch attends exactly as a batch would.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        seq_len: int | None = None

    def __init__(self, config: Config) -> None:
        super().__init__(config)
        self.seq_len = config.seq_len

    def forward(self, q_TNH, k_TNH, v_TNH, **kwargs):
        seq = q_TNH.shape[0] if self.seq_len is None else self.seq_len
        q, k, v = (t.unflatten(0, (-1, seq)) for t in (q_TNH, k_TNH, v_TNH))
        return super().forward(q, k, v, **kwargs).flatten(0, 1)


def _with_attention(config, attn: str, seq_len: int | None):
    """Swap every layer's inner attention to SDPA (torchtitan's graph_trainer way)."""
    if attn == "sdpa":
        for layer in [*config.layers, *getattr(config, "mtp_layers", [])]:
            layer.attention.inner_attention = PackedSDPA.Config(seq_len=seq_len)
    return config


def _backend(attn: str) -> str:
    return "flex" if attn == "sdpa" else attn


def llama3_config(*, tied: bool = False, attn: str = "sdpa", seq_len: int | None = SEQ_LEN) -> Llama3Model.Config:
    """Llama 3 as torchtitan's ``_8b`` (untied) or ``_1b``/``_3b`` (tied), at test size."""
    dim, n_heads, n_kv_heads, vocab = 64, 4, 2, 131
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=vocab,
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab,
            embedding_dim=dim,
            param_init=_LLAMA3_EMBEDDING_SKIP_INIT if tied else _LLAMA3_EMBEDDING_INIT,
        ),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_LLAMA3_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_llama3_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True,
            n_layers=2 if tied else 3,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=1, ffn_dim_multiplier=1.3),  # 221
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_context_length=MAX_CONTEXT, theta=500000, scaling="llama"),
            attn_backend=_backend(attn),
        ),
    )
    return _with_attention(config, attn, seq_len)


def qwen3_config(*, tied: bool = False, attn: str = "sdpa", seq_len: int | None = SEQ_LEN) -> Qwen3Model.Config:
    """Qwen3 dense as torchtitan's ``_8b`` (untied) or ``_0_6b`` (tied), at test size.

    head_dim 24 != dim / n_heads, as in real Qwen3, so GQAttention uses its explicit scale.
    """
    dim, head_dim, vocab = 64, 24, 127
    config = Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=_qwen3_norm(dim),
        enable_weight_tying=tied,
        tok_embeddings=Embedding.Config(
            num_embeddings=vocab,
            embedding_dim=dim,
            param_init=_QWEN3_EMBEDDING_SKIP_INIT if tied else _QWEN3_EMBEDDING_INIT,
        ),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_QWEN3_LINEAR_INIT),
        layers=_build_qwen3_layers(
            fuse_qkv=True,
            n_layers=2,
            dim=dim,
            n_heads=4,
            n_kv_heads=2,
            head_dim=head_dim,
            hidden_dim=97,
            attn_backend=_backend(attn),
            rope=CosSinRoPE.Config(dim=head_dim, max_context_length=MAX_CONTEXT, theta=1000000.0),
        ),
    )
    return _with_attention(config, attn, seq_len)


def qwen3_moe_config(
    *,
    attn: str = "sdpa",
    seq_len: int | None = SEQ_LEN,
    num_experts: int = 5,
    top_k: int = 2,
    dim: int = 64,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 16,
    moe_hidden_dim: int = 40,
    vocab: int = 127,
    max_context: int = MAX_CONTEXT,
) -> Qwen3Model.Config:
    """Qwen3-MoE as torchtitan's ``_debugmodel_moe``/``_30b_a3b``: 5 experts, top-2, softmax + route_norm.

    Expert hidden dims stay multiples of 8: ``torch._grouped_mm`` needs 16-byte
    strides in bf16 (on CPU as on GPU). The odd expert count shards unevenly;
    expert parallelism needs ``num_experts`` divisible by ep (torchtitan's
    dispatcher views the per-expert counts as ``(ep, experts // ep)``).
    The sizes are keywords so that the benchmark can build it larger
    (bench/models.py ``tt_qwen3_moe_1b``); the defaults are the test size.
    """
    config = Qwen3Model.Config(
        vocab_size=vocab,
        dim=dim,
        norm=_qwen3_norm(dim),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_QWEN3_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_QWEN3_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=True,
            n_layers=n_layers,
            dim=dim,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            moe_hidden_dim=moe_hidden_dim,
            num_experts=num_experts,
            top_k=top_k,
            attn_backend=_backend(attn),
            rope=CosSinRoPE.Config(dim=head_dim, max_context_length=max_context, theta=1000000.0),
            moe_comm_backend="standard",
        ),
    )
    return _with_attention(config, attn, seq_len)


def deepseek_v3_config(
    *, attn: str = "sdpa", seq_len: int | None = SEQ_LEN, num_mtp_layers: int = 0
) -> DeepSeekV3Model.Config:
    """DeepSeek-V3 (MLA + MoE) at test size: 1 dense layer then 2 MoE layers.

    Routing as torchtitan's ``_671b``: sigmoid scores, node-limited groups (4 groups,
    2 kept), route_norm, route_scale 2.5, top-2 of 8 experts, 1 shared expert.
    MLA with q_lora_rank > 0 (wq_a/q_norm/wq_b, as 236B/671B) and v_head_dim != qk
    head dim; YaRN RoPE as all DeepSeek-V3 flavours. ``num_mtp_layers > 0`` adds
    multi-token-prediction layers; the forward then returns a list of logits.
    """
    dim, vocab, rope_dim = 64, 129, 8
    layers = _build_dsv3_layers(
        n_layers=3,
        n_dense_layers=1,
        dim=dim,
        n_heads=4,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=rope_dim,
        v_head_dim=12,
        mscale=0.70,
        dense_hidden_dim=97,
        moe_hidden_dim=24,
        num_experts=8,
        num_shared_experts=1,
        router_top_k=2,
        router_score_func="sigmoid",
        router_num_expert_groups=4,
        router_num_limited_groups=2,
        router_route_scale=2.5,
        router_route_norm=True,
        attn_backend=_backend(attn),
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(
            dim=rope_dim,
            max_context_length=MAX_CONTEXT,
            theta=10000.0,
            scaling="yarn",
            rope_factor=40.0,
            beta_fast=32.0,
            beta_slow=1.0,
            original_seq_len=4096,
        ),
    )
    config = DeepSeekV3Model.Config(
        vocab_size=vocab,
        dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=_DSV3_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_DSV3_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=_dsv3_output_linear_init(dim)),
        layers=layers,
        mtp_layers=_build_mtp_layers(layers[-1], dim=dim, num_mtp_layers=num_mtp_layers),
    )
    return _with_attention(config, attn, seq_len)


CONFIGS: dict[str, Callable[..., object]] = {
    "llama3": lambda **kw: llama3_config(tied=False, **kw),
    "llama3_tied": lambda **kw: llama3_config(tied=True, **kw),
    "qwen3": lambda **kw: qwen3_config(tied=False, **kw),
    "qwen3_tied": lambda **kw: qwen3_config(tied=True, **kw),
    "qwen3_moe": qwen3_moe_config,
    "deepseek_v3": deepseek_v3_config,
}
NAMES = tuple(CONFIGS)


def flavour_config(model: str, flavour: str, seq_len: int | None = SEQ_LEN) -> object:
    """torchtitan's own flavour of ``model`` (``"llama3"``, ``"qwen3"``,
    ``"deepseek_v3"``), e.g. ``llama3_configs["1B"]``, with SDPA attention over
    sequences of ``seq_len``; ``flavour="tiny"`` is this file's test size."""
    from .models.deepseek_v3 import deepseekv3_configs
    from .models.llama3 import llama3_configs
    from .models.qwen3 import qwen3_configs

    if flavour == "tiny":
        return CONFIGS[model](seq_len=seq_len)
    flavours = {"llama3": llama3_configs, "qwen3": qwen3_configs, "deepseek_v3": deepseekv3_configs}[model]
    moe = {"moe_comm_backend": "standard"} if model == "deepseek_v3" else {}
    return _with_attention(flavours[flavour](attn_backend="flex", **moe), "sdpa", seq_len)


VOCAB = {"llama3": 131, "llama3_tied": 131, "qwen3": 127, "qwen3_tied": 127, "qwen3_moe": 127, "deepseek_v3": 129}


def build(name: str, device: torch.device | str = "meta", **config_kwargs) -> torch.nn.Module:
    """Build torchtitan model ``name`` as the trainer does: ``config.build()`` under a device context.

    The default ``"meta"`` is the trainer's; parameters are then uninitialized until
    ``model.to_empty(device=...)`` and ``init(model)``. Pass ``device="cpu"`` (or a
    CUDA device) to allocate real, still uninitialized, storage directly.
    """
    config = CONFIGS[name](**config_kwargs)
    with torch.device(device):
        model = config.build()
    model.verify_module_protocol()  # as torchtitan's trainer does right after build
    return model


def init(model: torch.nn.Module, buffer_device: torch.device | str | None = None) -> torch.nn.Module:
    """Initialize parameters and buffers exactly as torchtitan's trainer does::

        model.to_empty(device=init_device)
        with torch.no_grad():
            model.init_weights(buffer_device=buffer_device)

    (``to_empty`` is the caller's: a model built on meta must be moved first.)
    ``init_weights`` -> ``init_states`` re-ties tied embeddings, runs every
    module's ``param_init`` and recomputes the RoPE cache and MoE buffers on
    ``buffer_device`` (default: where each buffer already is).
    """
    if isinstance(buffer_device, str):
        buffer_device = torch.device(buffer_device)
    with torch.no_grad():
        model.init_weights(buffer_device=buffer_device)
    return model


def make_batch(
    vocab: int, batch: int = 2, seq_len: int = SEQ_LEN, *, device: torch.device | str = "cpu", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``(batch, seq_len)`` tokens packed as torchtitan feeds them: ``tokens[T]``,
    ``positions[T]`` (restarting at 0 per sequence) and next-token ``labels[T]``."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, vocab, (batch, seq_len + 1), generator=g)
    tokens = seqs[:, :-1].reshape(-1).to(device)
    labels = seqs[:, 1:].reshape(-1).to(device)
    positions = torch.arange(seq_len).repeat(batch).to(device)
    return tokens, positions, labels
