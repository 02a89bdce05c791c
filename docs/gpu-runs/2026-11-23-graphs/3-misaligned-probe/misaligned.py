import os, sys, traceback
import torch, torch.distributed as dist
from tests import cuda_graph_checks as checks
name, det = sys.argv[1], sys.argv[2] == "det"
backend = sys.argv[3] if len(sys.argv) > 3 else None
if det:
    checks.deterministic()
rank = int(os.environ["LOCAL_RANK"]); torch.cuda.set_device(rank)
dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
device = torch.device("cuda", rank)
case = checks.CASES[name]
try:
    model, opt = checks._build(case, device, backend)
    step = checks.train_step(model, opt, case)
    for i in range(3):
        loss = step(*checks._batch(case, i, rank, device)); torch.cuda.synchronize()
    print(f"RESULT {name} det={det} backend={backend} rank {rank}: OK loss {loss.item():.4f}", flush=True)
except Exception:
    print(f"RESULT {name} det={det} backend={backend} rank {rank}: FAILED\n{traceback.format_exc()[-3000:]}", flush=True)
    os._exit(1)
dist.destroy_process_group()
