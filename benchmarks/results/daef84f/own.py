"""Scratch (variants bX: DDP with X MB buckets, default 25): the trainer's DDP step against gradients all-reduced without DDP (after the backward,
in place), at BATCH x 512 per GPU. torchrun --nproc_per_node 2 own.py base own_coal own_flat"""
import gc, json, os, sys, time
import torch, torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager
sys.path.insert(0, os.getcwd())
from oelm_core.config import TrainConfig, model_config
from oelm_core.model import GPT
from oelm_core import train as T

VAR = {}
orig_wrap, orig_fb = T.TrainStep.wrap, T.TrainStep._forward_backward

DDP0 = T.DDP

class DDPcap(DDP0):  # DDP with bucket_cap_mb from the variant name "bX"
    def __init__(self, *args, **kwargs):
        super().__init__(*args, bucket_cap_mb=float(VAR["v"][1:]), **kwargs)

def wrap(self):
    if not VAR["v"].startswith("own"):
        T.DDP = DDPcap if VAR["v"][0] == "b" and VAR["v"][1:].replace(".", "").isdigit() else DDP0
        return orig_wrap(self)
    module = torch.compile(self.model) if self.compile else self.model
    if getattr(self, "tied", None) is not None:
        self.tied.remove()
    self.tied = T.TiedGradReducer.for_model(self.model)
    tied_w = self.tied.weight if self.tied is not None else None
    with torch.no_grad():
        for t in list(self.model.parameters()) + list(self.model.buffers()):
            dist.broadcast(t, 0)
    self.module = module
    self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
    self.body = [p for p in self.params if p is not tied_w]
    self.hooks = []
    self._compile_verified = not self.compile
    self._graph = None
    self._graph_warm = 0

def reduce_body(self):
    grads = [p.grad for p in self.body if p.grad is not None]
    if VAR["v"] == "own_flat":
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        torch._foreach_copy_(grads, [c.view_as(g) for c, g in zip(flat.split([g.numel() for g in grads]), grads)])
    else:
        with _coalescing_manager(device=grads[0].device, async_ops=True) as cm:
            for g in grads:
                dist.all_reduce(g, op=dist.ReduceOp.AVG)
        cm.wait()

def fb(self, batches):
    if not VAR["v"].startswith("own"):
        return orig_fb(self, batches)
    total = torch.zeros((), device=batches[0][0].device)
    if self.tied is not None:
        self.tied.begin([x for x, _ in batches])
    for i, (x, y) in enumerate(batches):
        last = i == len(batches) - 1
        if self.tied is not None:
            self.tied.sync = last
        with self.autocast:
            loss = self.module(x, y)
        (loss / len(batches)).backward()
        total += loss.detach().float()
    reduce_body(self)
    if self.tied is not None:
        self.tied.finish()
    return total / len(batches)

T.TrainStep.wrap, T.TrainStep._forward_backward = wrap, fb

def main():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    for batch in [int(b) for b in os.environ.get("BATCH", "8").split(",")]:
      for v in sys.argv[1:]:
        VAR["v"] = v
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
            loss, norm = one(i)
        torch.cuda.synchronize()
        setup = time.perf_counter() - t0
        p0 = next(model.parameters()).detach().double().sum().item()
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
        if rank == 0:
            print(json.dumps({"variant": v, "world": world, "batch": batch, "ms": round(secs[3], 3),
                              "min": round(secs[0], 3), "max": round(secs[-1], 3),
                              "graph": step._graph is not None, "loss25": round(float(loss), 6),
                              "norm25": round(float(norm), 5), "wsum25": p0,
                              "setup_s": round(setup, 1)}), flush=True)
        del step, one
        gc.collect()
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    dist.destroy_process_group()

main()
