"""Stress gloo's asynchronous collectives the way fxshard issues them on CPU.

    python bench/scripts/gloo_stress.py MODE ITERATIONS

MODE names what runs each iteration, any combination of: ``ag`` async
all-gathers on one group, ``rs`` async reduce-scatters on a second group,
``cnt`` a blocking list all-gather of one integer (the lookup count check),
``fun`` a functional all-gather, ``ng`` a new group every 25 iterations, and
``co`` gloo's coalesced all-gather. Several are in flight at once while the
main thread allocates and frees; every result is checked.

On torch 2.13 (2 ranks, this project's CPU machine) ``agrscntfun`` and
``agrscntfunng`` passed 3000 and 1500 iterations; ``co`` aborted with
"free(): invalid pointer" within 3000, which is why fxshard never uses the
coalesced all-gather on gloo (``compat.all_gather_coalesced_async``).
"""

import os
import random
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run(rank, ws, port, mode, iters):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=ws)
    ga = dist.new_group(backend="gloo")
    gr = dist.new_group(backend="gloo")
    rng = random.Random(0)
    for it in range(iters):
        if "ng" in mode and it % 25 == 0:
            gr = dist.new_group(backend="gloo")
        pend = []
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(1, 5000)
            inp = torch.full((n,), float(rank + it), dtype=torch.float32)
            out = torch.empty(ws * n)
            if "ag" in mode:
                pend.append(("ag", n, it, dist.all_gather_into_tensor(out, inp, group=ga, async_op=True), out, inp))
            if "co" in mode:
                ins = [inp[: n // 2], inp[n // 2 :]]
                outs = [torch.empty(ws * t.numel()) for t in ins]
                pend.append(("co", n, it, ga.allgather_into_tensor_coalesced(outs, ins), outs, ins))
            if "rs" in mode:
                rin = torch.full((ws * n,), float(rank + 1))
                rout = torch.empty(n)
                pend.append(("rs", n, it, dist.reduce_scatter_tensor(rout, rin, group=gr, async_op=True), rout, rin))
            if "cnt" in mode:
                counts = [torch.zeros(1, dtype=torch.int64) for _ in range(ws)]
                dist.all_gather(counts, torch.tensor([n], dtype=torch.int64), group=ga)
            if "fun" in mode:
                t = torch.ops._c10d_functional.all_gather_into_tensor(inp.contiguous(), ws, gr.group_name)
                t = torch.ops._c10d_functional.wait_tensor(t)
                assert torch.equal(t, torch.cat([torch.full((n,), float(r + it)) for r in range(ws)]))
            # churn the heap on the main thread
            junk = [torch.randn(rng.randint(1, 20000)) for _ in range(5)]
            del junk
        for kind, n, i, w, out, inp in pend:
            w.wait()
            if kind == "co":
                for o, t in zip(out, inp):
                    assert torch.equal(o, torch.cat([torch.full((t.numel(),), float(r + i)) for r in range(ws)]))
                continue
            if kind == "ag":
                exp = torch.cat([torch.full((n,), float(r + i)) for r in range(ws)])
            else:
                exp = torch.full((n,), float(sum(r + 1 for r in range(ws))))
            assert torch.equal(out, exp), (kind, n, i)
    dist.destroy_process_group()
    if rank == 0:
        print("ok", mode)


if __name__ == "__main__":
    mode = sys.argv[1]
    iters = int(sys.argv[2])
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    mp.spawn(run, args=(2, port, mode, iters), nprocs=2)
