"""Plain torch, no fxshard: gloo's coalesced all-gather corrupts the heap.

    MALLOC_PERTURB_=165 torchrun --nproc_per_node 2 docs/notes/gloo-heap/repro_coalesced.py 5000

Each iteration issues 1 to 4 asynchronous all-gathers of two tensors each
(halves of one tensor) on a second gloo group, allocates and frees on the
main thread while they run, then waits for them and checks every result.

Environment:
- MODE=co (default): ``ProcessGroup.allgather_into_tensor_coalesced``, one
  coalesced collective per pair. MODE=ag: one async
  ``all_gather_into_tensor`` per tensor instead.
- THREADS=n: build the group as a ``ProcessGroupGloo`` with ``n`` worker
  threads (``new_group`` gives 2) and call its ``allgather_coalesced``, the
  body of ``allgather_into_tensor_coalesced``.

A crash is a rank dying with "malloc(): unaligned tcache chunk detected",
"free(): invalid pointer", "double free or corruption" or SIGSEGV; see
README.md for the counts. It can crash: no test suite runs it.
"""

import faulthandler
import os
import random
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

faulthandler.enable(all_threads=True)


def gather_group(rank: int, ws: int):
    if not os.environ.get("THREADS"):
        return dist.new_group(backend="gloo")
    from torch.distributed import PrefixStore, ProcessGroupGloo
    from torch.distributed.distributed_c10d import _get_default_store

    opts = ProcessGroupGloo._Options()
    opts._devices = [ProcessGroupGloo.create_default_device()]
    opts._threads = int(os.environ["THREADS"])
    opts._timeout = timedelta(seconds=120)
    return ProcessGroupGloo(PrefixStore("ga", _get_default_store()), rank, ws, opts)


def start(group, outs, ins, ws: int):
    if os.environ.get("MODE", "co") == "ag":
        works = [dist.all_gather_into_tensor(o, t, group=group, async_op=True) for o, t in zip(outs, ins)]
        return lambda: [w.wait() for w in works]
    if os.environ.get("THREADS"):  # a bare backend has no allgather_into_tensor_coalesced: its body
        work = group.allgather_coalesced([[o.chunk(ws)[r] for o in outs] for r in range(ws)], ins)
    else:
        work = group.allgather_into_tensor_coalesced(outs, ins)
    return work.wait


def main(iters: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, ws = dist.get_rank(), dist.get_world_size()
    group = gather_group(rank, ws)
    rng = random.Random(0)
    for it in range(iters):
        pending = []
        for _ in range(rng.randint(1, 4)):
            n = rng.randint(1, 5000)
            inp = torch.full((n,), float(rank + it))
            ins = [inp[: n // 2], inp[n // 2 :]]
            outs = [torch.empty(ws * t.numel()) for t in ins]
            pending.append((start(group, outs, ins, ws), outs, ins))
            junk = [torch.randn(rng.randint(1, 20000)) for _ in range(5)]
            del junk
        for wait, outs, ins in pending:
            wait()
            for o, t in zip(outs, ins):
                expected = torch.cat([torch.full((t.numel(),), float(r + it)) for r in range(ws)])
                assert torch.equal(o, expected), (it, t.numel())
    dist.destroy_process_group()
    print("ok", rank)


if __name__ == "__main__":
    main(int(sys.argv[1]))
