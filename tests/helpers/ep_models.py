"""A small MoE decoder with grouped experts and expert parallelism, modelled on torchtitan.

Written for fxshard's tests, after torchtitan's (BSD-licensed) ``models/common/moe.py``
and ``token_dispatcher.py`` (pytorch/torchtitan@b5bcd76): the same shapes and
steps, fewer options.
- ``GroupedExperts``: ``w1``, ``w2``, ``w3`` of shape (experts, ..., ...),
  SwiGLU per expert over that expert's rows of the routed tokens (torchtitan's
  for-loop path: ``torch._grouped_mm``'s CPU backward fails in fp32 on torch 2.13).
  Under EP the weights are DTensors ``Shard(0)`` on the ep mesh and the forward
  computes on their local experts (``to_local()``), as torchtitan's does.
- ``TokenChoiceRouter``: a gate, softmax scores, top-k experts per token.
- ``TokenDispatcher``: without an ep mesh, tokens sorted by expert; with one,
  torchtitan's ``AllToAllTokenDispatcher``: the per-expert counts exchanged by
  an all-to-all, the split sizes read to the host (``tolist()``, which dynamo
  traces as unbacked sizes), the tokens moved by an all-to-all of those
  uneven splits, reordered rank-major to expert-major; the combine reverses it.
- ``ExpertParallel``: the ParallelStyle that puts the experts on the ep mesh
  (``Shard(0)``) and gives the dispatcher its mesh, applied with
  ``parallelize_module(model, mesh["ep"], ep_plan(model))``.
``MoEDecoder``'s blocks are a norm and an MoE (routed experts plus a shared
dense expert), no attention: the all-to-alls are what is tested; with
``checkpoint=True`` each block runs under activation checkpointing.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from examples.llama import RMSNorm


class GroupedExperts(nn.Module):
    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) / dim**0.5)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) / hidden**0.5)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) / dim**0.5)

    def forward(self, x_RD: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = self.w1, self.w2, self.w3
        if isinstance(w1, DTensor):  # EP: this rank's experts, as torchtitan computes on them
            w1, w2, w3 = w1.to_local(), w2.to_local(), w3.to_local()
        outs = []
        for e, x in enumerate(torch.split(x_RD, tokens_per_expert.tolist(), dim=0)):
            outs.append((F.silu(x @ w1[e].t()) * (x @ w3[e].t())) @ w2[e].t())
        return torch.cat(outs)


class TokenChoiceRouter(nn.Module):
    def __init__(self, dim: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.num_experts, self.top_k = experts, top_k

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        scores = F.softmax(self.gate(x_TD), dim=-1)
        top_scores, expert_ids = torch.topk(scores, k=self.top_k, dim=-1)
        ids = expert_ids.view(-1)  # per-expert token counts, of a static shape (bincount's is data-dependent)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=ids.device).scatter_add(
            0, ids, torch.ones_like(ids)
        )
        return top_scores, expert_ids, counts


class TokenDispatcher:
    """torchtitan's token dispatcher (local, or all-to-all over ``ep_mesh``)."""

    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self.ep_mesh = None

    def dispatch(self, x_TD: torch.Tensor, scores_TK: torch.Tensor, ids_TK: torch.Tensor,
                 counts_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple]:  # fmt: skip
        order = torch.argsort(ids_TK.view(-1), stable=True)
        scores_N = scores_TK.view(-1)[order]
        token_N = order // self.top_k
        routed = x_TD[token_N]
        if self.ep_mesh is None:
            return routed, counts_E, (token_N, scores_N)
        ep = self.ep_mesh.size()
        group = self.ep_mesh.get_group().group_name
        with torch.no_grad():
            received = all_to_all_single(counts_E, None, None, group)  # (ep, local experts): from each rank
            received = torch.ops._c10d_functional.wait_tensor(received)
            in_splits = counts_E.view(ep, -1).sum(1).tolist()
            out_splits = received.view(ep, -1).sum(1).tolist()
        routed = all_to_all_single_autograd(routed, out_splits, in_splits, group)
        # Rank-major (r0: e0 e1, r1: e0 e1) to expert-major (e0: r0 r1, e1: r0 r1).
        local = received.numel() // ep
        seg_lens = received.view(ep, local).t().reshape(-1)
        seg_starts = (received.cumsum(0) - received).view(ep, local).t().reshape(-1)
        seg_ids = torch.repeat_interleave(
            torch.arange(seg_lens.numel(), device=routed.device), seg_lens, output_size=routed.shape[0]
        )
        permuted = (
            seg_starts[seg_ids]
            + torch.arange(seg_ids.shape[0], device=routed.device)
            - (seg_lens.cumsum(0) - seg_lens)[seg_ids]
        )
        per_local_expert = received.view(ep, local).sum(0)
        return routed[permuted], per_local_expert, (token_N, scores_N, permuted, in_splits, out_splits)

    def combine(self, out_RD: torch.Tensor, meta: tuple, x_TD: torch.Tensor) -> torch.Tensor:
        token_N, scores_N = meta[:2]
        if self.ep_mesh is not None:
            permuted, in_splits, out_splits = meta[2:]
            unpermuted = torch.zeros_like(out_RD).index_copy(0, permuted, out_RD)
            out_RD = all_to_all_single_autograd(unpermuted, in_splits, out_splits, self.ep_mesh.get_group().group_name)
        out_RD = out_RD * scores_N.unsqueeze(-1)
        return torch.zeros_like(x_TD).index_add(0, token_N, out_RD)


class RoutedExperts(nn.Module):
    """The dispatcher and the grouped experts: what ``ExpertParallel`` parallelizes."""

    def __init__(self, experts: int, dim: int, hidden: int, top_k: int) -> None:
        super().__init__()
        self.inner = GroupedExperts(experts, dim, hidden)
        self.dispatcher = TokenDispatcher(top_k)

    def forward(
        self, x_TD: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor
    ) -> torch.Tensor:
        routed, per_expert, meta = self.dispatcher.dispatch(x_TD, scores, ids, counts)
        return self.dispatcher.combine(self.inner(routed, per_expert), meta, x_TD)


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.router = TokenChoiceRouter(dim, experts, top_k)
        self.experts = RoutedExperts(experts, dim, hidden, top_k)
        self.shared = nn.Linear(dim, dim, bias=False)  # a dense shared expert beside the routed ones

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_TD = x.reshape(-1, x.shape[-1])
        scores, ids, counts = self.router(x_TD)
        return (self.experts(x_TD, scores, ids, counts) + self.shared(x_TD)).view_as(x)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.norm, self.moe = RMSNorm(dim), MoE(dim, hidden, experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class MoEDecoder(nn.Module):
    """8 experts, top 2, of 6 tokens per rank: on every rank some expert
    receives no tokens from it (12 routed rows over 8 experts)."""

    def __init__(self, vocab: int = 37, dim: int = 8, hidden: int = 12, experts: int = 8, top_k: int = 2,
                 layers: int = 2, checkpoint: bool = False) -> None:  # fmt: skip
        super().__init__()
        self.checkpoint = checkpoint  # each block under activation checkpointing
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, hidden, experts, top_k) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            if self.checkpoint:  # eagerly, the backward runs the block again, all-to-alls too
                h = torch.utils.checkpoint.checkpoint(layer, h, use_reentrant=False)
            else:
                h = layer(h)
        return self.output(self.norm(h))


class ExpertParallel(ParallelStyle):
    """Experts ``Shard(0)`` on the ep mesh (each EP rank holds experts / ep of
    them), and the dispatcher's all-to-alls on it: torchtitan's EP setup
    (its ``RoutedExperts.parallelize`` with ``expert_param_placement_sparse``)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        assert isinstance(module, RoutedExperts), type(module)
        for name, param in list(module.inner.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param.detach(), device_mesh, [Shard(0)]), param.requires_grad)
            module.inner.register_parameter(name, sharded)
        module.dispatcher.ep_mesh = device_mesh
        return module


def is_expert(name: str) -> bool:
    """Whether the parameter named ``name`` is a grouped expert weight (EP puts it on the ep mesh)."""
    return ".moe.experts.inner." in name


def ep_plan(model: MoEDecoder) -> dict[str, ParallelStyle]:
    return {f"layers.{i}.moe.experts": ExpertParallel() for i in range(len(model.layers))}


def parallelize(model: MoEDecoder, ep_mesh) -> MoEDecoder:
    return parallelize_module(model, ep_mesh, ep_plan(model))
