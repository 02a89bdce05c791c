"""A quick check of fxshard.cuda_graph on GPUs (torchrun, NCCL):

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 bench/scripts/graph_smoke.py [--model 375m] [--no-destroy-reset]

1. A small example Llama: the plain loop and the captured step from the same
   seed, 8 steps, losses and shards compared bitwise (deterministic mode).
2. A host sync in the step raises fxshard's error before the capture.
3. With ``--model``: step times of the plain and the captured step (this
   process, one after the other), and the captured step's memory.
4. The process ends with its graphs alive (``--no-destroy-reset``: without
   reset), so a hang in destroy_process_group shows as a timeout.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402

import fxshard  # noqa: E402
from examples.llama import Llama, LlamaConfig, lm_loss  # noqa: E402


def build(cfg: LlamaConfig, mesh, mp: bool):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Llama(cfg)
    policy = fxshard.MixedPrecision(torch.bfloat16, torch.float32) if mp else None
    model = fxshard.compile(model, mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True, capturable=True)
    return model, opt


def batches(n: int, batch: int, seq: int, vocab: int):
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    return [torch.randint(0, vocab, (batch, seq), generator=g).cuda() for _ in range(n)]


def step_fn(model, opt):
    def step(tokens):
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    return step


def equality(mesh) -> None:
    torch.use_deterministic_algorithms(True)
    cfg = LlamaConfig(vocab=101, dim=64, layers=3, heads=4, hidden=96, max_len=64, tie_embeddings=False)
    data = batches(8, 2, 64, cfg.vocab)
    for mp in (False, True):
        m1, o1 = build(cfg, mesh, mp)
        plain = step_fn(m1, o1)
        ref = [plain(t).detach().clone() for t in data]
        m2, o2 = build(cfg, mesh, mp)
        graphed = fxshard.cuda_graph(step_fn(m2, o2))
        got = [graphed(t).detach().clone() for t in data]
        same_loss = all(torch.equal(a, b) for a, b in zip(ref, got))
        same_params = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(m1.parameters(), m2.parameters()))
        print(
            f"rank {dist.get_rank()} mp={mp}: losses equal {same_loss}, shards equal {same_params}; "
            f"{graphed.memory.format()}",
            flush=True,
        )
        if not same_loss:
            print("  plain", [x.item() for x in ref], "\n  graph", [x.item() for x in got], flush=True)
        graphed.reset()
    torch.use_deterministic_algorithms(False)


def sync_error(mesh) -> None:
    cfg = LlamaConfig(vocab=101, dim=64, layers=2, heads=4, hidden=96, max_len=64, tie_embeddings=False)
    model, opt = build(cfg, mesh, False)
    inner = step_fn(model, opt)

    def step(tokens):
        loss = inner(tokens)
        print(f"loss {loss}")  # a host sync
        return loss

    graphed = fxshard.cuda_graph(step)
    data = batches(3, 2, 64, cfg.vocab)
    try:
        for t in data:
            graphed(t)
        print(f"rank {dist.get_rank()} sync error: NOT RAISED", flush=True)
    except ValueError as error:
        print(f"rank {dist.get_rank()} sync error raised: {str(error)[:200]}", flush=True)


def timing(mesh, name: str, batch: int) -> list:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from bench import MODELS, SEQ

    cfg = MODELS[name][0]
    data = batches(4, batch, SEQ, cfg.vocab)
    out = []
    for graphed in (False, True):
        model, opt = build(cfg, mesh, True)
        step = step_fn(model, opt)
        if graphed:
            step = fxshard.cuda_graph(step)
        times = []
        for i in range(25):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            loss = step(data[i % 4])
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        ms = statistics.median(times[5:]) * 1e3
        extra = step.memory.format() if graphed else ""
        print(
            f"rank {dist.get_rank()} {name} batch {batch} graphed={graphed}: {ms:.1f} ms, loss {loss.item():.4f}, "
            f"max reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB {extra}",
            flush=True,
        )
        out.append(step)
        del model, opt
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--no-destroy-reset", action="store_true")
    parser.add_argument("--skip-equality", action="store_true")
    args = parser.parse_args()
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    if not args.skip_equality:
        equality(mesh)
        sync_error(mesh)
    keep = timing(mesh, args.model, args.batch) if args.model else []
    if not args.no_destroy_reset:
        fxshard.graphs.reset_all()
    t0 = time.perf_counter()
    dist.destroy_process_group()
    print(
        f"rank {rank}: destroy_process_group took {time.perf_counter() - t0:.1f} s with {len(keep)} steps alive",
        flush=True,
    )


if __name__ == "__main__":
    main()
