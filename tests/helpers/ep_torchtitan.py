"""torchtitan's own MoE models (Qwen3-MoE, DeepSeek-V3; tests/torchtitan/) under expert parallelism.

fxshard's code, not a torchtitan copy. ``parallelize`` is the EP setup that
torchtitan's trainer does at pytorch/torchtitan@b5bcd76 (the revision copied
under tests/torchtitan/), with the smallest shim that stands in for what
is not copied:

- torchtitan's trainer calls ``model.parallelize(parallel_dims)``. Each
  ``Module`` distributes its states by its ``sharding_config``, which
  ``set_moe_sharding_config`` (``models/common/moe_sharding.py``, not copied)
  fills in. For the routed experts' weights under EP it is
  ``expert_param_placement_sparse()``: ``{dp_replicate: R, efsdp: R, ep: S(0)}``,
  which ``ParallelDims.resolve_mesh`` reduces to the ``ep`` axis alone under
  the ``partial_dtensor`` backend (it keeps only ``tp`` and ``ep`` in band),
  so ``Module._distribute_states`` makes each of ``w1_EFD``, ``w2_EDF``,
  ``w3_EFD`` a ``distribute_tensor(param, sparse["ep"], [Shard(0)])``. The
  shim does exactly that for each ``GroupedExperts``; with no tensor
  parallelism every other sharding config resolves to no mesh (nothing
  distributed, no forward wrapped), so nothing else is done.
- Then torchtitan's own ``RoutedExperts.parallelize`` runs, unchanged, on a
  stand-in for ``ParallelDims`` (``_EPDims``: the ``partial_dtensor`` backend
  and ``get_optional_mesh("ep")``, the only parts it reads). It wires the ep
  mesh into torchtitan's ``AllToAllTokenDispatcher`` (``wire_meshes``).

Why a shim: torchtitan's ``ParallelDims``, ``ShardingConfig`` and
``moe_sharding.py`` need the external ``spmd_types`` package (not
installed), and the copied model files stub those imports
(tests/torchtitan/_stubs.py). The model files stay unchanged. The
dispatcher then runs torchtitan's ``partial_dtensor`` path (its
``get_spmd_backend() != "spmd_types"`` branches): ``all_to_all_single`` of the
per-expert counts, ``tolist()`` of the split sizes, ``all_to_all_single`` of
the tokens (differentiable in torch 2.13) and its ``_permute``/``_unpermute``.

The reference packs each EP group's batches into one batch (torchtitan's
models take packed sequences; ``PackedSDPA`` keeps them apart): torchtitan's
``GroupedExperts`` computes in bf16 (``.bfloat16()`` before
``torch._grouped_mm``), so an expert's weight gradient is rounded to bf16
once per grouped matmul. On an EP rank that matmul sums the tokens of the
group's ``ep`` ranks; packed the same way, the reference's matmul sees the
same rows in the same order (rank-major, then token order) and rounds the
same. Per-batch forwards of the reference would round each batch's share
alone: the first step's expert gradients then differ by 1e-4 of the largest
gradient, which is bf16's, not fxshard's, error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor

from tests.torchtitan import configs
from tests.torchtitan.models.common.moe import GroupedExperts, RoutedExperts, TokenChoiceTopKRouter


class _EPDims:
    """What ``RoutedExperts.parallelize`` reads of torchtitan's ``ParallelDims``."""

    spmd_backend = "partial_dtensor"

    def __init__(self, ep_mesh) -> None:
        self.ep_mesh = ep_mesh

    def get_optional_mesh(self, dims: str):
        return self.ep_mesh if dims == "ep" else None


def parallelize(model: nn.Module, ep_mesh) -> nn.Module:
    """torchtitan's EP setup of ``model``'s MoE layers on ``ep_mesh`` (see the module docstring)."""
    dims = _EPDims(ep_mesh)
    for module in model.modules():
        if isinstance(module, RoutedExperts):
            inner = module.inner_experts
            assert isinstance(inner, GroupedExperts), type(inner)
            assert inner.num_experts % ep_mesh.size() == 0, "torchtitan's dispatcher needs experts divisible by ep"
            for name, param in list(inner.named_parameters(recurse=False)):
                sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)])
                inner.register_parameter(name, nn.Parameter(sharded, requires_grad=param.requires_grad))
            module.parallelize(dims)  # torchtitan's: wires the ep mesh into its AllToAllTokenDispatcher
    return model


def _moe_blocks(model: nn.Module) -> list[nn.Module]:
    return [block for block in model.layers.values() if block.moe_enabled]


@dataclass(frozen=True)
class TorchtitanMoE:
    """tests/helpers/ep_parity.py's ``EPModel`` for torchtitan's ``name``
    (tests/torchtitan/configs.py) at test size, built and initialized as its
    trainer does; ``seq_len`` tokens per sequence, ``sequences`` of them per
    data-parallel rank."""

    name: str = "qwen3_moe"
    seq_len: int = 8
    sequences: int = 1
    num_experts: int | None = None  # None: the config's own

    def make(self) -> nn.Module:
        kwargs = {} if self.num_experts is None else {"num_experts": self.num_experts}
        return configs.init(configs.build(self.name, device="cpu", seq_len=self.seq_len, **kwargs))

    def parallelize(self, model: nn.Module, ep_mesh) -> nn.Module:
        return parallelize(model, ep_mesh)

    def batch(self, step: int, index: int, device: torch.device, micro: int = 0) -> Any:
        assert micro == 0, "one batch per step: no micro-batches (tests/helpers/ep_parity.py's EPScenario)"
        vocab = configs.VOCAB[self.name]
        return configs.make_batch(vocab, self.sequences, self.seq_len, device=device, seed=1000 * step + index)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        tokens, positions, labels = batch
        return F.cross_entropy(model(tokens, positions).float(), labels)

    def reference_losses(self, ref: nn.Module, batches: list, ep: int) -> list[torch.Tensor]:
        """Each EP group's batches packed into one (see the module docstring);
        each rank's loss is the mean over its own tokens."""
        losses: list[torch.Tensor] = []
        for first in range(0, len(batches), ep):
            tokens, positions, labels = (torch.cat(parts) for parts in zip(*batches[first : first + ep]))
            per_token = F.cross_entropy(ref(tokens, positions).float(), labels, reduction="none")
            losses.extend(per_token.view(ep, -1).mean(1))
        return losses

    def blocks(self, model: nn.Module) -> list[tuple[nn.Module, nn.Module | None]]:
        return [
            (block, block.moe.routed_experts.inner_experts if block.moe_enabled else None)
            for block in model.layers.values()
        ]

    def routed(self, ref: nn.Module, batch: Any) -> torch.Tensor:
        """Tokens per expert of each MoE layer, counted from its router's top-k choices."""
        counts: list[torch.Tensor] = []

        def count(router: TokenChoiceTopKRouter, inputs: Any, out: tuple) -> None:
            counts.append(torch.bincount(out[1].flatten(), minlength=router.num_experts))

        hooks = [block.moe.router.register_forward_hook(count) for block in _moe_blocks(ref)]
        try:
            with torch.no_grad():
                ref(*batch[:2])
        finally:
            for h in hooks:
                h.remove()
        return torch.stack(counts)
