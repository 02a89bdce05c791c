import os, torch, torch.nn as nn, torch.distributed as dist, torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, Replicate
from torch.distributed.tensor.placement_types import _StridedShard
from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel, RowwiseParallel
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

def main(rank, world):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29535")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank()
    for out in (8, 10, 11, 3):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, out, bias=False), nn.Linear(out, 6, bias=False))
        full0, full1 = m[0].weight.detach().clone(), m[1].weight.detach().clone()
        parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        fully_shard(m, mesh=mesh["dp"])
        p0, p1 = m[0].weight, m[1].weight
        nested0 = full0.chunk(2, 0)[tp] if tp < len(full0.chunk(2, 0)) else full0[:0]
        nested0 = nested0.chunk(2, 0)[dp] if dp < len(nested0.chunk(2, 0)) else nested0[:0]
        ok_full = torch.equal(p0.full_tensor(), full0) and torch.equal(p1.full_tensor(), full1)
        loc = p0.to_local()
        shape, off = compute_local_shape_and_global_offset(p0.shape, p0.device_mesh, p0.placements)
        dcp_piece = full0[off[0]:off[0]+shape[0]]
        print(f"rank{rank} out={out} placements={p0.placements} {p1.placements} local={tuple(loc.shape)} "
              f"full_ok={ok_full} nested_ok={torch.equal(loc, nested0)} dcp_box=({off[0]},{shape[0]}) dcp_ok={torch.equal(loc, dcp_piece)}")
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(main, args=(4,), nprocs=4)
