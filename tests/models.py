"""Small models for the tests, sized so shards come out uneven or empty."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(max_len).float(), inv)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[: x.shape[-2]].to(x.dtype), sin[: x.shape[-2]].to(x.dtype)
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), Attention(dim, heads)
        self.mlp_norm, self.mlp = RMSNorm(dim), SwiGLU(dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    """A Llama-style decoder: RMSNorm, RoPE, causal SDPA, SwiGLU; tied embeddings."""

    def __init__(self, vocab: int = 37, dim: int = 24, layers: int = 2, heads: int = 2, hidden: int = 38,
                 max_len: int = 64, tie: bool = True) -> None:  # fmt: skip
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.output.weight = self.embed.weight
        cos, sin = rope_tables(dim // heads, max_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h)).float()


@torch.library.custom_op("fxshard_test::gated_proj", mutates_args=())
def gated_proj(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A stand-in for a fused kernel that takes a weight as an argument."""
    return F.linear(x, weight) * torch.sigmoid(x.sum(-1, keepdim=True))


@gated_proj.register_fake
def _(x, weight):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _gated_proj_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _gated_proj_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    gate = torch.sigmoid(x.sum(-1, keepdim=True))
    lin = F.linear(x, weight)
    grad_lin = grad * gate
    grad_gate = (grad * lin).sum(-1, keepdim=True) * gate * (1 - gate)
    grad_x = grad_lin @ weight + grad_gate.expand_as(x)
    grad_w = grad_lin.reshape(-1, grad_lin.shape[-1]).T @ x.reshape(-1, x.shape[-1])
    return grad_x, grad_w


gated_proj.register_autograd(_gated_proj_backward, setup_context=_gated_proj_setup)


class MambaStyleBlock(nn.Module):
    """The fused-Mamba access pattern: the block reads ``self.conv1d.weight``
    directly, never calling ``self.conv1d``; ``x_proj``'s weight goes into a
    custom op. ``inner=6`` leaves rank 3 of 4 an empty conv shard."""

    def __init__(self, dim: int = 10, inner: int = 6, kernel: int = 4) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, 2 * inner)
        self.conv1d = nn.Conv1d(inner, inner, kernel, groups=inner, padding=kernel - 1)
        self.x_proj = nn.Linear(inner, inner, bias=False)
        self.out_proj = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        xz = self.in_proj(x)
        h, z = xz.chunk(2, dim=-1)
        h = F.conv1d(h.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, groups=h.shape[-1],
                     padding=self.conv1d.padding[0])[..., :t].transpose(1, 2)  # fmt: skip
        h = gated_proj(F.silu(h), self.x_proj.weight)
        return x + self.out_proj(h * F.silu(z))


class MambaStyle(nn.Module):
    def __init__(self, dim: int = 10, layers: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MambaStyleBlock(dim) for _ in range(layers))
        self.head = nn.Linear(dim, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Uneven(nn.Module):
    """Parameters whose dim 0 is not divisible by 2, 3 or 4, or smaller than the
    world size: some ranks hold a ragged shard, some hold nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 3)  # dim 0 = 3: empty on rank 3 of 4
        self.b = nn.Linear(3, 7)
        self.row = nn.Parameter(torch.randn(1, 7))  # dim 0 = 1: only rank 0 holds it
        self.c = nn.Linear(7, 1)  # weight (1, 7), bias (1,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))) * self.row)


class GraphBreaks(nn.Module):
    """A print and a data-dependent branch split the forward into graphs."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 9)
        self.second = nn.Linear(9, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        print("", end="")  # a graph break
        if h.sum() > 4:  # data-dependent: may differ between ranks; reads no parameter
            h = h * 2
        else:
            h = h - 1
        return self.second(h)
