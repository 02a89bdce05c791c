"""Small tensor-parallel models and their TP plans (torchtitan's Llama plan,
without sequence parallelism), sized so TP and data-parallel pieces come
out uneven or empty at (dp 2, tp 2)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from examples.llama import RMSNorm, apply_rope, rope_tables


class Attention(nn.Module):
    """Heads counted from the local width (``view(..., -1, head_dim)``), so
    that a column-parallel ``wq`` gives each TP rank its own heads."""

    def __init__(self, dim: int, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, head_dim: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), Attention(dim, head_dim)
        self.mlp_norm, self.mlp = RMSNorm(dim), MLP(dim, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TPLlama(nn.Module):
    """An untied Llama: vocab 131 (TP pieces of 66 and 65 rows), hidden 22
    (11 per TP rank, 6 and 5 rows per data-parallel rank)."""

    def __init__(self, vocab: int = 131, dim: int = 16, head_dim: int = 4, hidden: int = 22, layers: int = 2,
                 checkpoint: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.checkpoint = checkpoint  # each layer under activation checkpointing
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, head_dim, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        cos, sin = rope_tables(head_dim, 32)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            if self.checkpoint:
                h = torch.utils.checkpoint.checkpoint(layer, h, self.rope_cos, self.rope_sin, use_reentrant=False)
            else:
                h = layer(h, self.rope_cos, self.rope_sin)
        return self.output(self.norm(h)).float()


def sequence_parallel_plan(model: nn.Module) -> dict[str, object]:
    """torchtitan's Llama TP plan with sequence parallelism: activations
    between blocks sharded on the sequence, the norms' weights replicated
    DTensors (their gradients partial sums over tp until reduced)."""
    plan: dict[str, object] = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in range(len(model.layers)):
        plan[f"layers.{i}.attn_norm"] = plan[f"layers.{i}.mlp_norm"] = SequenceParallel()
        plan[f"layers.{i}.attn"] = PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                                     desired_input_layouts=(Replicate(), None, None))  # fmt: skip
        plan[f"layers.{i}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.wo", "mlp.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def llama_plan(model: nn.Module) -> dict[str, object]:
    """torchtitan's Llama TP plan without sequence parallelism: the embedding
    row-wise (vocab-parallel), attention and MLP column- then row-wise, the
    output column-wise with replicated logits."""
    plan: dict[str, object] = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    }
    for i in range(len(model.layers)):
        for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.wo", "mlp.w2"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    return plan


class OddMLP(nn.Module):
    """Out features 10 (``hidden``), 11 and 3 with biases: at tp 2, TP pieces
    of 5, of 6 and 5, of 2 and 1 rows; at dp 2 the last has an empty
    data-parallel shard. A column-wise layer into a row-wise one (``hidden``
    divisible by tp: TP's row-wise input assumes even pieces), a replicated
    row-wise bias beside sharded ones, and a plain layer between
    tensor-parallel ones."""

    def __init__(self, hidden: int = 10) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, hidden), nn.Linear(hidden, 6)
        self.c, self.d = nn.Linear(6, 11), nn.Linear(11, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b(torch.tanh(self.a(x)))
        x = self.d(torch.tanh(self.c(x)))
        return self.head(x)


def odd_plan(model: OddMLP) -> dict[str, object]:
    """``d`` stays plain: sharded over dp only."""
    return {"a": ColwiseParallel(), "b": RowwiseParallel(), "c": ColwiseParallel(output_layouts=Replicate()),
            "head": ColwiseParallel(output_layouts=Replicate())}  # fmt: skip


def parallelize(model: nn.Module, tp_mesh: object, sequence_parallel: bool = False,
                loss_parallel: bool = False) -> nn.Module:  # fmt: skip
    """``model`` with its TP plan applied on ``tp_mesh``; ``loss_parallel``:
    the output's logits stay sharded on the vocabulary, a DTensor, for a
    loss under ``torch.distributed.tensor.parallel.loss_parallel()``."""
    plan = llama_tp_plan(model, sequence_parallel, loss_parallel) if isinstance(model, TPLlama) else odd_plan(model)
    return parallelize_module(model, tp_mesh, plan)


def llama_tp_plan(model: nn.Module, sequence_parallel: bool = False, loss_parallel: bool = False) -> dict[str, object]:
    """torchtitan's Llama TP plan, for TPLlama or examples/llama.py's Llama
    (the same module names; the benchmark's ``--tp`` applies it there)."""
    plan = sequence_parallel_plan(model) if sequence_parallel else llama_plan(model)
    if loss_parallel:  # torchtitan's plan with loss parallelism
        plan["output"] = ColwiseParallel(input_layouts=plan["output"].input_layouts[0],
                                         output_layouts=Shard(-1), use_local_output=False)  # fmt: skip
    return plan
