import os, torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
def main(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29539")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dense = init_device_mesh("cpu", (2, 2), mesh_dim_names=("fsdp", "tp"))
    sparse = init_device_mesh("cpu", (2, 2), mesh_dim_names=("efsdp", "ep"))
    a = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), dense, [Shard(0), Shard(1)]))
    b = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), sparse, [Shard(0), Shard(0)]))
    for p in (a, b): p.grad = torch.ones_like(p)
    res = []
    for foreach in (True, False):
        opt = torch.optim.AdamW([a, b], lr=0.1, foreach=foreach)
        try:
            opt.step(); res.append(f"foreach={foreach} ok")
        except Exception as e:
            res.append(f"foreach={foreach} FAIL {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    try:
        n = torch.nn.utils.clip_grad_norm_([a, b], 1.0); res.append(f"clip ok {n}")
    except Exception as e:
        res.append(f"clip FAIL {type(e).__name__}: {str(e).splitlines()[0][:150]}")
    if rank == 0: print(res)
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(main, args=(4,), nprocs=4)
