"""Smoke test: each tiny torchtitan model builds on CPU, initializes, and trains one step.

Run from the repository root: ``python -m tests.torchtitan.smoke``
"""

from __future__ import annotations

import time
import warnings

import torch
import torch.nn.functional as F

from .configs import NAMES, VOCAB, build, init, make_batch


def main() -> None:
    torch.manual_seed(0)
    # torchtitan's MoE router computes its gate under autocast(float32), which CPU autocast refuses (and skips).
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    start = time.perf_counter()
    for name in NAMES:
        t0 = time.perf_counter()
        model = build(name, device="cpu")
        init(model, buffer_device=None)
        tokens, positions, labels = make_batch(VOCAB[name], batch=2, seq_len=32)
        logits = model(tokens, positions)
        assert logits.shape == (tokens.numel(), VOCAB[name]), logits.shape
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        params = list(model.parameters())
        n_params = sum(p.numel() for p in params)
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, f"{name}: no grad for {missing}"
        assert torch.isfinite(loss), loss
        tied = model.tok_embeddings.weight is model.lm_head.weight
        print(
            f"{name:12s} loss {loss.item():.4f}  params {n_params:,} ({len(params)} tensors)"
            f"  tied={tied}  {time.perf_counter() - t0:.2f}s"
        )
    print(f"all {len(NAMES)} models passed in {time.perf_counter() - start:.1f}s")


if __name__ == "__main__":
    main()
