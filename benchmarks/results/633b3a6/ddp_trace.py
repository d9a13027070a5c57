"""Scratch: chrome traces of the captured DDP step (HEAD), 8x512/GPU. torchrun --nproc_per_node N ddp_trace.py OUTDIR [plain]"""
import json, os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
from oelm_core.config import TrainConfig, model_config
from oelm_core.model import GPT
from oelm_core import train as T

def main():
    out, plain = sys.argv[1], "plain" in sys.argv[2:]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    torch.manual_seed(0)
    cfg = model_config("medium512", "gpt_base")
    model = GPT(cfg).to(device)
    tc = TrainConfig(compile=True)
    step = T.make_step(model, T.configure_optimizer(model, tc, device), tc, device, ddp=not plain)
    gen = torch.Generator().manual_seed(rank + 1)
    data = [torch.randint(0, cfg.vocab_size, (8, 513), generator=gen) for _ in range(4)]
    xs = [d[:, :-1].contiguous().to(device) for d in data]
    ys = [d[:, 1:].contiguous().to(device) for d in data]
    n = [0]
    def one(i):
        n[0] += 1
        return step([(xs[i % 4], ys[i % 4])], 1e-4, n[0])
    for i in range(30):
        one(i)
    torch.cuda.synchronize(); dist.barrier()
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(4):
            one(i)
        torch.cuda.synchronize()
    name = f"{out}/trace_{'plain' if plain else 'ddp'}_w{world}_r{rank}.json"
    prof.export_chrome_trace(name)
    if rank == 0:
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70))
    dist.barrier()
    dist.destroy_process_group()

main()
