"""Scratch: the tied weight's output share all-reduced on its own NCCL communicator, with few CTAs
(NCCL's max_ctas) so that the backward it overlaps keeps more SMs; DDP and the rows unchanged.
torchrun --nproc_per_node 2 ctas.py   (BATCH=8 by default; variants re-captured on one step)"""
import json, os, sys
import torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
from oelm_core.config import TrainConfig, model_config
from oelm_core.model import GPT
from oelm_core import train as T

VAR = {"v": "base"}
GROUPS = {}
orig_on_out = T.TiedGradReducer._on_output_grad

def on_out(self, grad):
    g = GROUPS.get(VAR["v"])
    if g is None:
        return orig_on_out(self, grad)
    self._out = grad if self._out is None else self._out.add_(grad)
    if self.sync and self._ids is not None:
        self._work = dist.all_reduce(self._out, op=dist.ReduceOp.AVG, group=g, async_op=True)

T.TiedGradReducer._on_output_grad = on_out

def group(max_ctas=None, high=False):
    opts = dist.ProcessGroupNCCL.Options(is_high_priority_stream=high)
    if max_ctas is not None:
        opts.config.min_ctas = 1
        opts.config.max_ctas = max_ctas
    return dist.new_group(list(range(dist.get_world_size())), backend="nccl", pg_options=opts)

def main():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    for n in (1, 2, 4, 8, 16):
        GROUPS[f"t{n}"] = group(n)
    GROUPS["tsep"] = group()
    GROUPS["thigh"] = group(high=True)
    batch = int(os.environ.get("BATCH", "8"))
    torch.manual_seed(0)
    cfg = model_config("medium512", "gpt_base")
    model = GPT(cfg).to(device)
    tc = TrainConfig(compile=True)
    step = T.make_step(model, T.configure_optimizer(model, tc, device), tc, device, ddp=True)
    gen = torch.Generator().manual_seed(rank + 1)
    data = [torch.randint(0, cfg.vocab_size, (batch, 513), generator=gen) for _ in range(4)]
    xs = [d[:, :-1].contiguous().to(device) for d in data]
    ys = [d[:, 1:].contiguous().to(device) for d in data]
    n = [0]
    def one(i):
        n[0] += 1
        return step([(xs[i % 4], ys[i % 4])], 1e-4, n[0])
    order = sys.argv[1:] or ["base", "t4", "t2", "t8", "t16", "t1", "tsep", "thigh"]
    for rnd in range(2):
        for v in order:
            VAR["v"] = v
            step._graph, step._graph_warm = None, 0
            torch.cuda.synchronize()
            for i in range(20):
                loss, norm = one(i)
            torch.cuda.synchronize()
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
                print(json.dumps({"round": rnd, "variant": v, "batch": batch, "ms": round(secs[3], 3),
                                  "min": round(secs[0], 3), "max": round(secs[-1], 3),
                                  "graph": step._graph is not None, "loss": round(float(loss), 5),
                                  "norm": round(float(norm), 5)}), flush=True)
    os._exit(0)  # destroy_process_group() hung here after the captured DDP steps (the run was killed by its timeout after printing everything)

main()
