"""fxshard against FSDP2, side by side, in one run, on the same model and data.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 4 bench/bench.py --model 1b --out bench-1b.json

Systems, each on the example's plain-PyTorch Llama (RMSNorm, RoPE, causal
SDPA, SwiGLU, untied output), built from the same seed:
- ``fxshard``: ``fxshard.compile(model, mesh, mp_policy=...)`` (Inductor);
- ``fsdp2``: ``fully_shard`` on each block, then on the root;
- ``fsdp2_compile``: each block ``torch.compile``d, then ``fully_shard`` on
  each block and the root (torchtitan's order).
All use bf16 compute, fp32 gradient reduction, fp32 master weights and
``AdamW(fused=True)``; sequence length 2048; random tokens, the same per step
and rank for every system. Timing follows ../shared/BENCHMARKS.md: the
median step over ``--steps`` steps after ``--warmup``, GPU synchronized; the
first step (compile included) separately; peak memory from
``max_memory_allocated`` reset after the model is built and sharded.
Rank 0 prints a table and writes JSON; ``bench/plot.py`` draws it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fxshard  # noqa: E402
from fxshard.runtime import compat  # noqa: E402
import memtrace  # noqa: E402  (bench/memtrace.py: this script's folder is on sys.path)
from examples.llama import Llama, LlamaConfig, lm_loss  # noqa: E402

SEQ = 2048
# name: (config, batch per GPU, warm-up steps, timed steps); as in BENCHMARKS.md
MODELS = {
    "375m": (LlamaConfig(vocab=32768, dim=1024, layers=24, heads=16, hidden=2816, max_len=SEQ,
                         tie_embeddings=False), 4, 4, 12),  # fmt: skip
    "1b": (LlamaConfig(vocab=32768, dim=2048, layers=16, heads=16, hidden=5632, max_len=SEQ,
                       tie_embeddings=False), 2, 4, 12),  # fmt: skip
    "8b": (LlamaConfig(vocab=128256, dim=4096, layers=32, heads=32, hidden=14336, max_len=SEQ,
                       tie_embeddings=False), 1, 3, 8),  # fmt: skip
}
# A smoke test of this script on CPU: --model tiny --device cpu (gloo).
MODELS["tiny"] = (LlamaConfig(vocab=64, dim=32, layers=2, heads=2, hidden=48, max_len=SEQ, tie_embeddings=False), 1, 1, 2)
SYSTEMS = ("fxshard", "fsdp2", "fsdp2_compile")
# fxshard variants, not in the default set: the keyword arguments each adds.
FXSHARD_VARIANTS = {
    "fxshard": {},
    "fxshard_flat": {"compile_blocks_once": False},  # every layer compiled inline
    "fxshard_r2": {"reduces_in_flight": 2},  # two reduce-scatters in flight, two reduce inputs alive
}
ALL_SYSTEMS = (*SYSTEMS, *FXSHARD_VARIANTS)
DEVICE = "cuda"
PROFILE = 0  # profile the last N steps (--profile)
MEMORY_STEP = None  # the step whose allocations are traced to its peak (--memory-step)


FXSHARD_KWARGS: dict = {}
# torch.compile's own phase timers, as printed (see compat.compile_phase_times)
COMPILE_PHASES = ("bytecode_tracing", "aot_collect_metadata", "aot_trace_joint_graph", "create_aot_dispatcher_function",
                  "compile_fx_inner", "backward._backward_impl", "_compile.compile_inner")  # fmt: skip


def build(system: str, cfg: LlamaConfig, mesh) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Llama(cfg)
    if system in FXSHARD_VARIANTS:
        mp = fxshard.MixedPrecision(torch.bfloat16, torch.float32)
        return fxshard.compile(model, mesh, mp_policy=mp, **{**FXSHARD_KWARGS, **FXSHARD_VARIANTS[system]})
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.layers):
        if system == "fsdp2_compile":
            block = torch.compile(block)
            model.layers.register_module(str(i), block)
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def tokens_for(step: int, rank: int, batch: int, vocab: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randint(0, vocab, (batch, SEQ), generator=gen).to(DEVICE)


def run_system(system: str, name: str, mesh) -> dict:
    cfg, batch, warmup, steps = MODELS[name]
    rank = dist.get_rank()
    # What an earlier system left allocated: its peak is not this one's.
    leftover = torch.cuda.memory_allocated() if DEVICE == "cuda" else 0
    model = build(system, cfg, mesh)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    batches = [tokens_for(s, rank, batch, cfg.vocab) for s in range(warmup + steps)]
    sync()
    if DEVICE == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses, step_peaks = [], [], []
    profiler, traced = None, None
    compat.compile_phase_times(reset=True)
    for i, tokens in enumerate(batches):
        if PROFILE and i == len(batches) - PROFILE:
            activity = torch.profiler.ProfilerActivity.CUDA if DEVICE == "cuda" else torch.profiler.ProfilerActivity.CPU
            profiler = torch.profiler.profile(activities=[activity])
            profiler.__enter__()
        if MEMORY_STEP == i and DEVICE == "cuda":
            base = memtrace.start()
        start = time.perf_counter()
        loss = lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
        if MEMORY_STEP == i and DEVICE == "cuda":
            traced = memtrace.summary(base)
        if DEVICE == "cuda":
            step_peaks.append(torch.cuda.max_memory_allocated() - leftover)
            torch.cuda.reset_peak_memory_stats()
        if i == 0:
            first_step_phases = compat.compile_phase_times()
    if profiler is not None:
        profiler.__exit__(None, None, None)
    peak = max(step_peaks, default=0)
    step = statistics.median(times[warmup:])
    tokens_per_gpu = batch * SEQ
    flops = (6 * params + 6 * cfg.layers * SEQ * cfg.dim) * tokens_per_gpu
    result = dict(
        model=name, system=system, params=params, batch=batch, seq=SEQ, world_size=dist.get_world_size(),
        step_ms=step * 1e3, tokens_per_s_per_gpu=tokens_per_gpu / step, tflops_per_gpu=flops / step / 1e12,
        peak_gib=peak / 2**30, leftover_gib=leftover / 2**30, first_step_s=times[0], loss_step10=losses[min(9, len(losses) - 1)],
        first_step_compile_s=first_step_phases,
        losses=losses, step_times_ms=[t * 1e3 for t in times], step_peaks_gib=[p / 2**30 for p in step_peaks],
    )  # fmt: skip
    if traced is not None:
        result["memory_at_peak"] = traced
    if system in FXSHARD_VARIANTS:
        result.update(fxshard_plan_facts(model))
    if profiler is not None:
        result["profile"] = kernel_profile(profiler, PROFILE)
    del model, opt, batches, loss
    gc.collect()
    torch._dynamo.reset()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(intervals):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _covered(intervals: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    total, j = 0.0, 0
    for a, b in intervals:
        while j < len(cover) and cover[j][1] <= a:
            j += 1
        k = j
        while k < len(cover) and cover[k][0] < b:
            total += min(b, cover[k][1]) - max(a, cover[k][0])
            k += 1
    return total


def kernel_profile(profiler, steps: int) -> dict:
    """Per step, from the GPU kernels of the profiled steps (ms): time with
    any compute kernel running, NCCL kernel time, NCCL time with no compute
    kernel running (exposed communication), and the largest kernels."""
    kernels = [e for e in profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    nccl = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" in e.name.lower()]
    compute = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()]
    nccl_u, compute_u = _union(nccl), _union(compute)
    nccl_ms = sum(b - a for a, b in nccl_u) / 1e3
    by_name: dict[str, float] = {}
    for e in kernels:
        by_name[e.name[:90]] = by_name.get(e.name[:90], 0.0) + (e.time_range.end - e.time_range.start) / 1e3
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:15]
    return dict(
        compute_busy_ms=sum(b - a for a, b in compute_u) / 1e3 / steps,
        nccl_ms=nccl_ms / steps,
        exposed_nccl_ms=(nccl_ms - _covered(nccl_u, compute_u) / 1e3) / steps,
        top_kernels_ms={k: v / steps for k, v in top},
    )


def fxshard_plan_facts(model: torch.nn.Module) -> dict:
    """Units and the predicted peak from fxshard's plan (see the README's
    debug dumps): the largest graph's liveness estimate (inputs and
    intermediates) plus AdamW's two fp32 states per shard element."""
    plan = model.fxshard_plan
    graph_peaks = {f"graph{g.index}.{phase}": p.total for g in plan.graphs for phase, p in g.peaks.items()}
    shard_bytes = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    units = plan.units.units if plan.units is not None else []
    return dict(
        units=len(units), unit_mib=[u.gather_nbytes() / 2**20 for u in units],
        graph_peaks_gib={k: v / 2**30 for k, v in graph_peaks.items()},
        predicted_peak_gib=(max(graph_peaks.values()) + 2 * shard_bytes) / 2**30 if graph_peaks else None,
        outlined=[g.outline.format().strip() for g in plan.graphs],
    )


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def table(results: list[dict]) -> str:
    head = "| model | system | step ms | tokens/s/GPU | TFLOP/s/GPU | peak GiB | first step s | loss@10 |"
    rows = [head, "|" + "---|" * 8]
    for r in results:
        rows.append(
            f"| {r['model']} ({r['params'] / 1e9:.2f}B, batch {r['batch']}) | {r['system']} | {r['step_ms']:.1f} | "
            f"{r['tokens_per_s_per_gpu']:.0f} | {r['tflops_per_gpu']:.0f} | {r['peak_gib']:.2f} | "
            f"{r['first_step_s']:.1f} | {r['loss_step10']:.4f} |"
        )
    for r in results:
        if "profile" in r:
            p = r["profile"]
            rows.append(f"\n{r['system']} {r['model']} profile per step: compute busy {p['compute_busy_ms']:.1f} ms, "
                        f"NCCL {p['nccl_ms']:.1f} ms, exposed NCCL {p['exposed_nccl_ms']:.1f} ms")  # fmt: skip
        phases = r.get("first_step_compile_s") or {}
        if phases:
            shown = ", ".join(f"{k} {phases[k]:.1f}" for k in COMPILE_PHASES if k in phases)
            rows.append(f"\n{r['system']} {r['model']} first step, compile phases (s): {shown}")
        if "step_peaks_gib" in r and r["step_peaks_gib"]:
            rows.append(f"\n{r['system']} {r['model']} peak GiB per step: "
                        + " ".join(f"{p:.2f}" for p in r["step_peaks_gib"]))
        if "memory_at_peak" in r:
            rows.append("\n" + memtrace.format_summary(r["system"], r["memory_at_peak"]))
        if r.get("predicted_peak_gib") is not None:
            rows.append(f"\n{r['system']} {r['model']}: {r['units']} units, predicted peak "
                        f"{r['predicted_peak_gib']:.2f} GiB (measured {r['peak_gib']:.2f})")  # fmt: skip
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--out", default=None, help="JSON file (rank 0 writes it)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke test with gloo")
    parser.add_argument("--prefetch", type=int, default=None, help="fxshard.compile(prefetch=...)")
    parser.add_argument("--profile", type=int, default=0, help="profile the GPU kernels of the last N steps")
    parser.add_argument("--unit-mb", type=float, default=None, help="fxshard.compile(unit_mb=...)")
    parser.add_argument("--fake-world", type=int, default=None,
                        help="one process, a fake process group of this many ranks: memory only (no communication "
                             "runs, so step times and losses mean nothing)")
    parser.add_argument("--memory-step", type=int, default=None,
                        help="trace this step's allocations and report who holds its peak (bench/memtrace.py); "
                             "pick a warm-up step, since recording slows it")
    args = parser.parse_args()
    global DEVICE, PROFILE, MEMORY_STEP
    DEVICE = args.device
    PROFILE = args.profile
    MEMORY_STEP = args.memory_step
    for key, value in (("prefetch", args.prefetch), ("unit_mb", args.unit_mb)):
        if value is not None:
            FXSHARD_KWARGS[key] = value
    systems = args.systems.split(",")
    if unknown := set(systems) - set(ALL_SYSTEMS):
        parser.error(f"unknown systems {sorted(unknown)}; choose from {ALL_SYSTEMS}")

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.fake_world:
        if DEVICE == "cuda":
            torch.cuda.set_device(0)
        dist.init_process_group("fake", store=compat.fake_store(), rank=0, world_size=args.fake_world)
    elif DEVICE == "cuda":
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    mesh = init_device_mesh(DEVICE, (dist.get_world_size(),))
    cuda = DEVICE == "cuda"
    meta = dict(device=torch.cuda.get_device_name() if cuda else "cpu", gpus=dist.get_world_size(),
                torch=torch.__version__, nccl=".".join(map(str, torch.cuda.nccl.version())) if cuda else "-",
                precision="bf16 compute, fp32 reduce",
                nccl_nvls_enable=os.environ.get("NCCL_NVLS_ENABLE"), fxshard_kwargs=FXSHARD_KWARGS,
                fake_world=args.fake_world)  # fmt: skip
    results = []
    for system in systems:
        results.append(run_system(system, args.model, mesh))
        if dist.get_rank() == 0:
            print(table(results[-1:]), flush=True)
            if args.out:  # after every system, so that a later failure keeps the earlier results
                Path(args.out).write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    if dist.get_rank() == 0:
        print(table(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
