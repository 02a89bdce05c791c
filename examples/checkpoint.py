"""Save, resume and export a sharded model with torch.distributed.checkpoint.

    torchrun --nproc-per-node 2 examples/checkpoint.py --dir /tmp/ckpt

Trains a few steps, saves model and AdamW state with DCP (each rank writes
its own shards; the checkpoint loads at any world size), builds a fresh
model and optimizer, loads the checkpoint into them and trains on, then
exports a full, unsharded state dict that a plain ``nn.Module`` loads.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import fxshard  # noqa: E402
from examples.llama import Llama, LlamaConfig, lm_loss  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", required=True, help="checkpoint folder (DCP) and full export (full.pt)")
    p.add_argument("--steps", type=int, default=3, help="steps before the checkpoint, and again after")
    p.add_argument("--backend", default="aot_eager", choices=["inductor", "aot_eager", "eager"])
    return p.parse_args()


def build(backend: str, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = fxshard.compile(Llama(LlamaConfig()).to(device), backend=backend)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model, opt, steps: range, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in steps:
        tokens = torch.randint(0, 37, (4, 16), generator=torch.Generator().manual_seed(100 * step + rank)).to(device)
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(mean := loss.detach().clone())
        if rank == 0:
            print(f"step {step}  loss {mean.item() / world:.4f}", flush=True)


def main() -> None:
    args = parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank = dist.get_rank()

    model, opt = build(args.backend, device)
    train(model, opt, range(args.steps), device)
    model_sd, optim_sd = get_state_dict(model, opt)  # sharded: DTensors, named as in the plain model
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=args.dir)
    if rank == 0:
        print(f"saved to {args.dir}", flush=True)

    # Resume: a fresh model and optimizer, then the checkpoint loaded into them.
    model, opt = build(args.backend, device)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=args.dir)
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    if rank == 0:
        print("resumed", flush=True)
    train(model, opt, range(args.steps, 2 * args.steps), device)

    # Export: every rank takes part; rank 0 gets plain tensors on the CPU.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        Llama(LlamaConfig()).load_state_dict(full)  # loads into the plain, unsharded model
        torch.save(full, os.path.join(args.dir, "full.pt"))
        print(f"exported {len(full)} tensors to {os.path.join(args.dir, 'full.pt')}", flush=True)
    # The others wait for rank 0's export: a gloo group destroyed on one rank
    # while another still works aborted the process at exit, now and then.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
