import os, sys, time, torch, torch.nn as nn, torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed._functional_collectives import all_to_all_single
from torch._dynamo.utils import counters
GROUP = {}
FLAGS = sys.argv[1]  # none | dyn

@torch.library.custom_op("ep::dispatch", mutates_args=())
def dispatch(x: torch.Tensor, counts: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = GROUP["ep"]
    recv = torch.empty_like(counts); dist.all_to_all_single(recv, counts, group=g)
    ins = counts.view(n, -1).sum(1).tolist(); outs = recv.view(n, -1).sum(1).tolist()
    out = x.new_empty((sum(outs), x.shape[1])); dist.all_to_all_single(out, x.contiguous(), outs, ins, group=g)
    return out, recv
@dispatch.register_fake
def _(x, counts, n):
    rows = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty((rows, x.shape[1])), torch.empty_like(counts)

@torch.library.custom_op("ep::combine", mutates_args=())
def combine(y: torch.Tensor, counts: torch.Tensor, recv: torch.Tensor, n: int, rows: int) -> torch.Tensor:
    g = GROUP["ep"]
    ins = counts.view(n, -1).sum(1).tolist(); outs = recv.view(n, -1).sum(1).tolist()
    out = y.new_empty((rows, y.shape[1])); dist.all_to_all_single(out, y.contiguous(), ins, outs, group=g)
    return out
@combine.register_fake
def _(y, counts, recv, n, rows):
    return y.new_empty((rows, y.shape[1]))

def d_bwd(ctx, gout, grecv):
    return combine(gout, ctx.counts, ctx.recv, ctx.n, ctx.rows), None, None
def d_setup(ctx, inputs, output):
    ctx.counts, ctx.n, ctx.rows = inputs[1], inputs[2], inputs[0].shape[0]; ctx.recv = output[1]
dispatch.register_autograd(d_bwd, setup_context=d_setup)
def c_bwd(ctx, g):
    out, _ = dispatch(g, ctx.counts, ctx.n)
    return out, None, None, None, None
def c_setup(ctx, inputs, output):
    ctx.counts, ctx.n = inputs[1], inputs[3]
combine.register_autograd(c_bwd, setup_context=c_setup)

class MoE(nn.Module):
    def __init__(s, n, D=8):
        super().__init__(); s.n = n; s.router = nn.Linear(D, n, bias=False); s.w = nn.Parameter(torch.randn(D, D) * 0.1)
    def forward(s, x):
        ids = s.router(x).argmax(-1); order = torch.argsort(ids, stable=True); xs = x[order]
        counts = torch.nn.functional.one_hot(ids, s.n).sum(0)
        xr, recv = dispatch(xs, counts, s.n)
        y = combine(xr @ s.w, counts, recv, s.n, xs.shape[0])
        out = torch.empty_like(y); out[order] = y
        return out

def main(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29538")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    GROUP["ep"] = dist.group.WORLD
    torch._dynamo.config.capture_dynamic_output_shape_ops = FLAGS == "dyn"
    torch.manual_seed(0); m = MoE(world)
    torch.manual_seed(rank + 10); xs = [torch.randn(16, 8) for _ in range(3)]
    eager = [m(x).sum() for x in xs]
    cm = torch.compile(m, backend="aot_eager", fullgraph=True)
    try:
        ok = True
        for x, e in zip(xs, eager):
            o = cm(x).sum(); o.backward(); ok &= torch.allclose(o, e, atol=1e-4)
        print(rank, FLAGS, "ok", ok, "graphs", counters["stats"]["unique_graphs"])
    except Exception as err:
        print(rank, FLAGS, "FAILED", type(err).__name__, str(err).splitlines()[0][:200])
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(main, args=(4,), nprocs=4)
