"""Microbenchmark: ways to lay bf16 gradients out rank-major in fp32 (the
reduce-scatter input), on one 8B Llama block's gradient shapes.

    python bench/scripts/layout_micro.py [world_size]

Prints GB/s (bytes read + written) per method. GPU only."""

import sys

import torch

ws = int(sys.argv[1]) if len(sys.argv) > 1 else 4
dev = "cuda"
shapes = [
    (4096, 4096),
    (1024, 4096),
    (1024, 4096),
    (4096, 4096),
    (14336, 4096),
    (14336, 4096),
    (4096, 14336),
    (4096,),
    (4096,),
]
grads = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s in shapes]
rows = [g.reshape(g.shape[0], -1) for g in grads]
chunk = [-(-r.shape[0] // ws) for r in rows]
slot = [c * r.shape[1] for c, r in zip(chunk, rows)]
numel = sum(slot)
out = torch.empty(ws, numel, device=dev, dtype=torch.float32)
nbytes = sum(g.numel() for g in grads) * 2 + out.numel() * 4


def chunk_cat():
    torch._chunk_cat(grads, 0, ws, out=out)


views = []
off = 0
for r, c, s in zip(rows, chunk, slot):
    views.append(out[:, off : off + s].view(ws, c, r.shape[1]))
    off += s


def per_member_copy():
    for r, v, c in zip(rows, views, chunk):
        v.copy_(r.view(ws, c, r.shape[1]))  # all shapes divide ws here


@torch.compile(fullgraph=True)
def inductor_cat(gs):
    return torch.cat([g.reshape(ws, -1).float() for g in gs], dim=1)


def inductor():
    inductor_cat(grads)


def cast_only():
    for g in grads:
        g.float()


def fp32_chunk_cat_src():
    torch._chunk_cat(g32, 0, ws, out=out)


g32 = [g.float() for g in grads]


def bench(fn, name, nb=nbytes):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    n = 20
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / n
    print(f"{name:24s} {ms:7.3f} ms  {nb / ms / 1e6:7.0f} GB/s", flush=True)
    return ms


ref = out.clone()
chunk_cat()
ref.copy_(out)
print(
    f"{torch.cuda.get_device_name()} torch {torch.__version__} ws={ws} params/block={sum(g.numel() for g in grads) / 1e6:.1f}M"
)
bench(chunk_cat, "_chunk_cat bf16->fp32")
out.zero_()
per_member_copy()
assert torch.equal(out, ref)
bench(per_member_copy, "per-member copy_")
assert torch.equal(inductor_cat(grads), ref)
bench(inductor, "inductor cat (fresh out)")
bench(cast_only, "plain .float() each")
bench(fp32_chunk_cat_src, "_chunk_cat fp32->fp32", sum(g.numel() for g in grads) * 8)
flat = torch.randn(numel, device=dev)
cast = torch.empty(numel, device=dev, dtype=torch.bfloat16)
bench(lambda: cast.copy_(flat), "flat fp32->bf16 copy_", numel * 6)
