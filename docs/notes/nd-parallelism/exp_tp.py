"""TP (parallelize_module) under an FSDP-style unshard/reduce marker, compiled.

    python exp_tp.py                             # plain
    python exp_tp.py --checkpoint                # the MLP under activation checkpointing
    python exp_tp.py --checkpoint --input-grad   # and an input that requires grad
"""
import os, sys, torch, torch.nn as nn, torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, Replicate
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
from torch._functorch.aot_autograd import aot_module_simplified
from functorch.compile import make_boxed_func
import torch.distributed._functional_collectives as fc

GROUPS = {}

@torch.library.custom_op("exp::unshard", mutates_args=())
def unshard(shard: torch.Tensor, key: int, rows: int) -> torch.Tensor:
    g, n = GROUPS[key]
    out = torch.ops._c10d_functional.all_gather_into_tensor(shard.contiguous(), n, g)
    return torch.ops._c10d_functional.wait_tensor(out)[:rows].clone()
@unshard.register_fake
def _(shard, key, rows):
    return shard.new_empty((rows, *shard.shape[1:]))
@torch.library.custom_op("exp::reduce", mutates_args=())
def reduce(grad: torch.Tensor, key: int, rows: int) -> torch.Tensor:
    g, n = GROUPS[key]
    out = torch.ops._c10d_functional.reduce_scatter_tensor(grad.contiguous(), "sum", n, g)
    return (torch.ops._c10d_functional.wait_tensor(out) / n)
@reduce.register_fake
def _(grad, key, rows):
    return grad.new_empty((grad.shape[0] // GROUPS[key][1], *grad.shape[1:]))
def _bwd(ctx, g):
    return reduce(g, ctx.key, 0), None, None
def _setup(ctx, inputs, output):
    ctx.key = inputs[1]
unshard.register_autograd(_bwd, setup_context=_setup)

class MLP(nn.Module):
    def __init__(s):
        super().__init__(); s.a = nn.Linear(8, 16, bias=False); s.b = nn.Linear(16, 8, bias=False)
    def forward(s, x):
        if "--checkpoint" in sys.argv:  # the whole region under activation checkpointing
            return torch.utils.checkpoint.checkpoint(lambda y: s.b(torch.relu(s.a(y))), x, use_reentrant=False)
        return s.b(torch.relu(s.a(x)))

def swap(mod, name, param, dp_mesh, key):
    # param: DTensor on tp mesh. fxshard-style: keep dp rows of its TP-local tensor.
    local = param.to_local()
    n, r = dp_mesh.size(), dp_mesh.get_local_rank()
    rows = local.shape[0]
    shard = local.chunk(n, 0)[r].detach().clone().requires_grad_(True)
    GROUPS[key] = (dp_mesh.get_group().group_name, n)
    spec = (param.device_mesh, param.placements, param.shape, param.stride())
    del mod._parameters[name]
    mod.__dict__["_shard_" + name] = shard
    def get(self, name=name, key=key, rows=rows, spec=spec):
        full_local = unshard(self.__dict__["_shard_" + name], key, rows)
        m, pl, sh, st = spec
        return DTensor.from_local(full_local, m, pl, run_check=False, shape=sh, stride=st)
    mod.__class__ = type("X" + type(mod).__name__, (type(mod),), {name: property(get)})
    return shard

def backend(gm, ex):
    if dist.get_rank() == 0:
        print("=== dynamo graph"); print(gm.code)
    def fw(g, e):
        if dist.get_rank() == 0: print("=== aot fw"); print(g.code)
        return make_boxed_func(g)
    def bw(g, e):
        if dist.get_rank() == 0: print("=== aot bw"); print(g.code)
        return make_boxed_func(g)
    return aot_module_simplified(gm, ex, fw_compiler=fw, bw_compiler=bw)

def main(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = MLP(); model = MLP(); model.load_state_dict(ref.state_dict())
    parallelize_module(model, mesh["tp"], {"a": ColwiseParallel(), "b": RowwiseParallel()})
    shards = [swap(model.a, "weight", model.a.weight, mesh["dp"], 0), swap(model.b, "weight", model.b.weight, mesh["dp"], 1)]
    torch.manual_seed(1)
    x = torch.randn(4, 3, 8)
    xl = x.chunk(2, 0)[mesh["dp"].get_local_rank()]  # dp splits batch; tp ranks same batch
    if "--input-grad" in sys.argv:  # an input that requires grad, as inside a checkpointed region
        xl = xl.clone().requires_grad_()
    cm = torch.compile(model, backend=backend, fullgraph=True)
    out = cm(xl); loss = out.sum(); loss.backward()
    ref(x).sum().backward()
    # check grads: shard grad is sum over this dp rank's batch /dp; ref grad sums all -> compare *2/2
    for s, p, (place) in zip(shards, [ref.a.weight, ref.b.weight], [Shard(0), Shard(1)]):
        full = p.grad
        tpl = full.chunk(2, place.dim)[mesh["tp"].get_local_rank()]
        mine = tpl.chunk(2, 0)[mesh["dp"].get_local_rank()] / 2
        print(rank, "grad ok", torch.allclose(s.grad, mine, atol=1e-5), type(out).__name__)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(main, args=(4,), nprocs=4)
