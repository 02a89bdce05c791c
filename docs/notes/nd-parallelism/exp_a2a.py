import os, sys, time, torch, torch.nn as nn, torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed._functional_collectives import all_to_all_single
from torch._functorch.aot_autograd import aot_module_simplified
from functorch.compile import make_boxed_func

MODE = sys.argv[1]  # capture | nocapture
BACKEND = sys.argv[2]  # aot_eager | inductor | print

class MoE(nn.Module):
    def __init__(s, ep_mesh, E=4, D=8):
        super().__init__()
        s.ep = ep_mesh; s.E = E; s.n = ep_mesh.size()
        s.router = nn.Linear(D, E, bias=False)
        s.w = nn.Parameter(torch.randn(E // s.n, D, D) * 0.1)  # local experts
    def forward(s, x):
        ids = s.router(x).argmax(-1)                       # (T,) top-1
        order = torch.argsort(ids, stable=True)
        xs = x[order]
        counts = torch.bincount(ids, minlength=s.E)        # (E,)
        recv_counts = all_to_all_single(counts, None, None, group=s.ep)
        in_splits = counts.view(s.n, -1).sum(1).tolist()
        out_splits = recv_counts.view(s.n, -1).sum(1).tolist()
        xr = all_to_all_single(xs, out_splits, in_splits, group=s.ep)
        # local experts: one per rank here (E == n) -> plain matmul; general: grouped mm
        yr = xr @ s.w[0]
        y = all_to_all_single(yr, in_splits, out_splits, group=s.ep)
        out = torch.empty_like(y)
        out[order] = y
        return out

def printing(gm, ex):
    if dist.get_rank() == 0: print("=== dynamo"); print(gm.code)
    def fw(g, e):
        if dist.get_rank() == 0: print("=== fw"); print(g.code)
        return make_boxed_func(g)
    def bw(g, e):
        if dist.get_rank() == 0: print("=== bw"); print(g.code)
        return make_boxed_func(g)
    return aot_module_simplified(gm, ex, fw_compiler=fw, bw_compiler=bw)

def main(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29534")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch._dynamo.config.capture_scalar_outputs = (MODE == "capture")
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    torch.manual_seed(0)
    m = MoE(mesh["ep"], E=world)
    torch.manual_seed(rank + 10)
    ref_x = [torch.randn(16, 8) for _ in range(3)]
    eager = [m(x).sum() for x in ref_x]
    be = printing if BACKEND == "print" else BACKEND
    cm = torch.compile(m, backend=be, fullgraph=(MODE == "capture"))
    t0 = time.time()
    ok = True
    for i, x in enumerate(ref_x):
        m.zero_grad()
        out = cm(x).sum(); out.backward()
        ok &= torch.allclose(out, eager[i], atol=1e-4)
    from torch._dynamo.utils import counters
    print(rank, MODE, BACKEND, "ok", ok, "graphs", counters["stats"]["unique_graphs"], "breaks", dict(counters["graph_break"]) if counters["graph_break"] else 0, f"{time.time()-t0:.1f}s")
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(main, args=(4,), nprocs=4)
