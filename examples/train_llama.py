"""Train a small Llama-style model with fxshard (ZeRO-3) under torchrun.

    torchrun --nproc-per-node 2 examples/train_llama.py            # CPU: gloo
    torchrun --nproc-per-node 2 examples/train_llama.py --bf16     # GPUs: NCCL

Every rank sees different data: sequences that follow a fixed random
successor table with 10% noise, so there is something to learn and the loss
falls from ln(vocab). Prints per-step loss, tokens/s and peak memory.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fxshard  # noqa: E402
from examples.llama import Llama, LlamaConfig, lm_loss  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager", "eager"])
    p.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 reduce (MixedPrecision)")
    p.add_argument("--keep-full-weights", action="store_true", help="reshard_after_forward=False")
    p.add_argument("--unit-mb", type=float, default=None, help="the most MiB of gathered weights a unit holds")
    p.add_argument("--prefetch", type=int, default=1, help="units gathered ahead of the one computing")
    p.add_argument("--debug-dir", default=None, help="dump the rewritten graphs here")
    return p.parse_args()


def batches(vocab: int, batch: int, seq: int, rank: int, device: torch.device):
    table = torch.randperm(vocab, generator=torch.Generator().manual_seed(0))  # the same on every rank
    gen = torch.Generator().manual_seed(1000 + rank)  # different data on every rank
    while True:
        tokens = torch.empty(batch, seq, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=gen)
        for i in range(1, seq):
            noise = torch.randint(0, vocab, (batch,), generator=gen)
            keep = torch.rand(batch, generator=gen) > 0.1
            tokens[:, i] = torch.where(keep, table[tokens[:, i - 1]], noise)
        yield tokens.to(device)


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # peak RSS of this process


def main() -> None:
    args = parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # fxshard, like FSDP2, expects the same initial weights on every rank
    cfg = LlamaConfig(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads,
                      hidden=args.dim * 8 // 3, max_len=args.seq)  # fmt: skip
    model = Llama(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    mp = fxshard.MixedPrecision(torch.bfloat16, torch.float32) if args.bf16 else None
    fxshard.compile(model, reshard_after_forward=not args.keep_full_weights, mp_policy=mp,
                    unit_mb=args.unit_mb, prefetch=args.prefetch,
                    backend=args.backend, debug_dir=args.debug_dir)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    if rank == 0:
        print(f"fxshard {fxshard.__version__}: {n_params / 1e6:.2f}M parameters on {world} x {device.type}, "
              f"backend {args.backend}, {'bf16' if args.bf16 else 'fp32'}", flush=True)  # fmt: skip

    data = batches(args.vocab, args.batch, args.seq, rank, device)
    losses = []
    for step in range(args.steps):
        tokens = next(data)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)  # synchronizes, so the time below is the whole step
        elapsed = time.perf_counter() - start
        losses.append(mean_loss.item() / world)
        if rank == 0:
            tok_s = args.batch * args.seq * world / elapsed
            note = " (includes compile)" if step == 0 else ""
            print(f"step {step:3d}  loss {losses[-1]:.4f}  {tok_s:10.0f} tokens/s  "
                  f"peak {peak_memory_mib(device):8.1f} MiB  {elapsed * 1e3:8.1f} ms{note}", flush=True)  # fmt: skip
    if rank == 0:
        first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        print(f"loss {first:.4f} -> {last:.4f} ({'down' if last < first else 'NOT down'})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
