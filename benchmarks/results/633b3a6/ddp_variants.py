"""Scratch: DDP step variants at BATCH x 512/GPU on HEAD. torchrun --nproc_per_node N ddp_variants.py V1 V2 ...
V: base | plain | carveN (SM carveout N for cuBLAS during the backward) | carveallN (whole step)
   | dense (the tied weight's shares added and all-reduced after the backward, no overlap)
   | noddpopt (torch._dynamo.config.optimize_ddp = False)
TRACE=DIR: also write a chrome trace of 4 steps per rank (trace_<variant>_w<world>_r<rank>.json)
"""
import gc, json, os, sys, time
import torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
from oelm_core.config import TrainConfig, model_config
from oelm_core.model import GPT
from oelm_core import train as T

VAR = {}
orig_fb = T.TrainStep._forward_backward
orig_begin = T.TiedGradReducer.begin
orig_call = T.TrainStep.__call__

def fb(self, batches):
    v = VAR["v"]
    if v.startswith("carve") and not v.startswith("carveall"):
        n = int(v[5:])
        # the carveout is read when the cuBLAS call is made (host side): set for the backward only
        orig_backward = torch.Tensor.backward
        def backward(t, *a, **k):
            torch._C._set_sm_carveout_experimental(n)
            try:
                return orig_backward(t, *a, **k)
            finally:
                torch._C._set_sm_carveout_experimental(None)
        torch.Tensor.backward = backward
        try:
            return orig_fb(self, batches)
        finally:
            torch.Tensor.backward = orig_backward
    return orig_fb(self, batches)
T.TrainStep._forward_backward = fb

def begin(self, tokens):
    orig_begin(self, tokens)
    if VAR["v"] == "dense":
        self._ids = None
T.TiedGradReducer.begin = begin

def main():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    batch = int(os.environ.get("BATCH", 8))
    for v in sys.argv[1:]:
        VAR["v"] = v
        torch._C._set_sm_carveout_experimental(int(v[8:]) if v.startswith("carveall") else None)
        torch._dynamo.config.optimize_ddp = v != "noddpopt"  # DDPOptimizer: split at buckets
        torch.manual_seed(0)
        cfg = model_config("medium512", "gpt_base")
        model = GPT(cfg).to(device)
        tc = TrainConfig(compile=True)
        step = T.make_step(model, T.configure_optimizer(model, tc, device), tc, device,
                           ddp=not v.startswith("plain"))
        gen = torch.Generator().manual_seed(rank + 1)
        data = [torch.randint(0, cfg.vocab_size, (batch, 513), generator=gen) for _ in range(4)]
        xs = [d[:, :-1].contiguous().to(device) for d in data]
        ys = [d[:, 1:].contiguous().to(device) for d in data]
        n = [0]
        def one(i):
            n[0] += 1
            return step([(xs[i % 4], ys[i % 4])], 1e-4, n[0])
        t0 = time.perf_counter()
        for i in range(25):
            loss, _ = one(i)
        torch.cuda.synchronize()
        setup = time.perf_counter() - t0
        secs = []
        for _ in range(7):
            dist.barrier(); torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for i in range(10):
                one(i)
            b.record(); b.synchronize()
            t = torch.tensor(a.elapsed_time(b) / 10, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            secs.append(float(t))
        secs.sort()
        if os.environ.get("TRACE"):
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for i in range(4):
                    one(i)
                torch.cuda.synchronize()
            prof.export_chrome_trace(f"{os.environ['TRACE']}/trace_{v}_w{world}_r{rank}.json")
        if rank == 0:
            print(json.dumps({"variant": v, "world": world, "batch": batch, "ms": round(secs[3], 3),
                              "min": round(secs[0], 3), "max": round(secs[-1], 3),
                              "graph": step._graph is not None, "loss": float(loss),
                              "setup_s": round(setup, 1)}), flush=True)
        step = one = None
        gc.collect()
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    dist.destroy_process_group()

main()
