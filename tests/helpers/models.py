"""Small models for the tests, sized so shards come out uneven or empty."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from examples.llama import Block, Llama, LlamaConfig, RMSNorm, lm_loss, rope_tables


def TinyLlama(tie: bool = True, layers: int = 2) -> Llama:
    """The example's Llama at test size: vocab 37 and hidden 38 shard unevenly.
    ``layers=1`` for checks of flat graphs that hold within a layer: it
    compiles in about half the time (one layer is never outlined)."""
    return Llama(LlamaConfig(tie_embeddings=tie, layers=layers))


class TinyLlamaGraphBreak(Llama):
    """TinyLlama with a graph break between its layers: fxshard reads through
    the sequencer (see [Note: sequenced reads]), in two graphs, the tied
    embedding read in both."""

    def __init__(self) -> None:
        super().__init__(LlamaConfig())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](self.embed(tokens), self.rope_cos, self.rope_sin)
        torch._dynamo.graph_break()
        h = self.layers[1](h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h)).float()


class CheckpointedLlama(Llama):
    """TinyLlama with each block under ``torch.utils.checkpoint``; with
    ``graph_break``, a graph break inside the checkpointed function, so that
    fxshard reads through the sequencer and the checkpoint runs eagerly,
    recomputing after the call returned (see [Note: recomputes read through
    the sequencer])."""

    def __init__(self, graph_break: bool = True, reentrant: bool = False) -> None:
        super().__init__(LlamaConfig())
        self.graph_break, self.reentrant = graph_break, reentrant

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = torch.utils.checkpoint.checkpoint(self._block, layer, h, use_reentrant=self.reentrant)
        return self.output(self.norm(h)).float()

    def _block(self, layer: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if self.graph_break:
            torch._dynamo.graph_break()
        return layer(h, self.rope_cos, self.rope_sin)


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


class SmallVocab(nn.Module):
    """An embedding of 3 rows: at world size 4, rank 3 holds none of them.
    A second table reads padding_idx, so it keeps its gather."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(3, 8)
        self.pos = nn.Embedding(5, 8, padding_idx=0)
        self.head = nn.Linear(8, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device) % 5))


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


class Scaled(nn.Module):
    """A 0-dimensional parameter (a learned temperature): kept whole on every rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 6)
        self.temperature = nn.Parameter(torch.tensor(0.7))
        self.b = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * self.temperature)


class Tempered(nn.Module):
    """Whole parameters read through ops whose backward may recompute from
    them: CLIP's ``logit_scale.exp()`` (0-dimensional) and a sigmoid gate
    (kept whole by ``fxshard.no_shard``). In fp32 under Inductor the read was
    the parameter's own storage, which the backward overwrote."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(5, 6)
        self.logit_scale = nn.Parameter(torch.tensor(2.6592))
        self.gate = nn.Parameter(torch.linspace(-1.0, 1.0, 6))
        self.b = nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * torch.sigmoid(self.gate)
        return self.b(h) * self.logit_scale.exp()


class Transposed(nn.Module):
    """A parameter that is a transposed view (strides (1, 7)), 7 rows: uneven at 2 to 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(5, 7).t())
        self.b = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(x @ self.w))


class GraphBreaks(nn.Module):
    """A data-dependent branch splits the forward into graphs (the print in
    front of it does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(6, 9)
        self.second = nn.Linear(9, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.first(x))
        print("", end="")  # reordered after the graph by fxshard's compiles, not a break
        if h.sum() > 4:  # data-dependent: may differ between ranks; reads no parameter
            h = h * 2
        else:
            h = h - 1
        return self.second(h)


class RoutedExperts(nn.Module):
    """The older MoE pattern (transformers 4.x Mixtral, many research repos):
    one module per expert, called only for the experts that received tokens.
    Which experts run, and so which parameters are read, differs by rank."""

    def __init__(self, dim: int = 6, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 10), nn.SiLU(), nn.Linear(10, dim)) for _ in range(experts)
        )
        self.head = nn.Linear(dim, 3)
        self.experts_used: list[tuple[int, ...]] = []  # per call, for the test

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        choice = self.router(flat).argmax(-1)
        out = torch.zeros_like(flat)
        chosen = choice.unique().tolist()  # data-dependent: the experts this rank's tokens chose
        self.experts_used.append(tuple(chosen))
        for e in chosen:
            idx = (choice == e).nonzero().squeeze(1)
            out = out.index_add(0, idx, self.experts[e](flat[idx]))
        return self.head(out + flat)


class GroupedExperts(nn.Module):
    """An MoE layer whose experts are stored grouped, as in Mixtral's and
    DeepSeek's fused implementations: one parameter of shape [experts, dim,
    hidden] and one of [experts, hidden, dim]. Every token goes through every
    expert and the router's top-k gates weight the sum (zero for the experts
    not chosen): static shapes, no data-dependent control flow, so the forward
    stays one graph and its step can be captured in a CUDA graph."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.norm = RMSNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, dim, hidden) * dim**-0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, dim) * hidden**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        flat = self.norm(x).reshape(1, b * t, d)
        scores = self.router(flat[0]).softmax(-1)
        top, chosen = scores.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(scores).scatter(-1, chosen, top / top.sum(-1, keepdim=True))
        experts = self.w_in.shape[0]
        h = F.silu(torch.bmm(flat.expand(experts, -1, -1), self.w_in))  # [experts, tokens, hidden]
        out = torch.bmm(h, self.w_out)  # [experts, tokens, dim]
        return x + (out * gates.T.unsqueeze(-1)).sum(0).view(b, t, d)


class Hybrid(nn.Module):
    """A Jamba-like stack that compiles to one graph: causal attention blocks
    (the example Llama's), Mamba-style blocks that read their conv's weight
    directly, and MoE layers with grouped experts, then an untied output head.
    ``forward(tokens, labels)`` returns the next-token loss, computed in the
    compiled graph; without labels, the fp32 logits.

    Odd sizes shard unevenly: vocab 41, 5 experts, MoE hidden 27, Mamba inner
    13, MLP hidden 33."""

    def __init__(self, vocab: int = 41, dim: int = 20, heads: int = 2, pattern: str = "amxamx", max_len: int = 64,
                 mlp_hidden: int = 33, mamba_inner: int = 13, experts: int = 5, expert_hidden: int = 27,
                 top_k: int = 2) -> None:  # fmt: skip
        super().__init__()
        cfg = LlamaConfig(vocab=vocab, dim=dim, heads=heads, hidden=mlp_hidden, max_len=max_len)
        make = {"a": lambda: Block(cfg), "m": lambda: MambaStyleBlock(dim, inner=mamba_inner),
                "x": lambda: GroupedExperts(dim, hidden=expert_hidden, experts=experts, top_k=top_k)}  # fmt: skip
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(make[kind]() for kind in pattern)
        self.kinds = pattern
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab)
        cos, sin = rope_tables(dim // heads, max_len)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(tokens)
        for kind, layer in zip(self.kinds, self.layers):
            h = layer(h, self.rope_cos, self.rope_sin) if kind == "a" else layer(h)
        logits = self.head(self.norm(h)).float()
        return logits if labels is None else lm_loss(logits, labels)
