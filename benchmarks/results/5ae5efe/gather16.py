"""Scratch: DDP's gradients sent as bfloat16 where they are exactly bfloat16 values.

Under bf16 autocast a linear layer's weight gradient is the output of a bf16 GEMM, upcast: each
float32 value is a bfloat16 value. All-gathering those as bf16 (half the bytes of a float32
all-reduce on 2 GPUs) and adding the ranks' copies in float32 gives the same sum, bit for bit.
torchrun --nproc_per_node 2 gather16.py [variants]   (BATCH=8 by default; NOHOOK=1: DDP's own)

variants (one DDP, one dispatching comm hook, re-captured per variant):
  avg32   all_reduce(AVG) of the float32 bucket (the hook's own cost against DDP's default)
  g16     bucket -> bf16, all_gather, mean in float32 (exactness counted on warm-up steps)
  *+out   also the tied weight's output share rounded to bf16 and all-gathered (timing only)
"""
import json, os, sys
import torch, torch.distributed as dist
sys.path.insert(0, os.getcwd())
from oelm_core.config import TrainConfig, model_config
from oelm_core.model import GPT
from oelm_core import train as T

VAR = {"v": "avg32", "out": False}
INEXACT = {}  # param name -> inexact elements seen during warm-up (g16)
NAMES = {}
orig_on_out, orig_finish = T.TiedGradReducer._on_output_grad, T.TiedGradReducer.finish


def on_out(self, grad):
    if not VAR["out"]:
        return orig_on_out(self, grad)
    self._out = grad if self._out is None else self._out.add_(grad)
    if self.sync and self._ids is not None:
        h = self._out.to(torch.bfloat16)
        self._g16 = h.new_empty(self.world * h.numel())
        self._work = dist.all_gather_into_tensor(self._g16, h, async_op=True)


def finish(self):
    if VAR["out"] and self._ids is not None:
        self._work.wait()
        torch.mean(self._g16.view(self.world, -1), 0, dtype=torch.float32, out=self._out.view(-1))
    return orig_finish(self)


T.TiedGradReducer._on_output_grad, T.TiedGradReducer.finish = on_out, finish


def hook(state, bucket):
    buf, world = bucket.buffer(), dist.get_world_size()
    if VAR["v"] == "avg32":
        work = dist.all_reduce(buf, op=dist.ReduceOp.AVG, async_op=True)
        return work.get_future().then(lambda f: f.value()[0])
    if not torch.cuda.is_current_stream_capturing():
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            bad = int((g != g.to(torch.bfloat16).float()).sum())
            name = NAMES.get(id(p), "?")
            INEXACT[name] = max(INEXACT.get(name, 0), bad)
    half = buf.to(torch.bfloat16)
    out = half.new_empty(world * half.numel())
    work = dist.all_gather_into_tensor(out, half, async_op=True)

    def done(f):
        torch.mean(out.view(world, -1), 0, dtype=torch.float32, out=buf)
        return buf
    return work.get_future().then(done)


def main():
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    batch = int(os.environ.get("BATCH", "8"))
    torch.manual_seed(0)
    cfg = model_config("medium512", os.environ.get("GROUP", "gpt_base"))
    model = GPT(cfg).to(device)
    NAMES.update({id(p): n for n, p in model.named_parameters()})
    tc = TrainConfig(compile=True)
    step = T.make_step(model, T.configure_optimizer(model, tc, device), tc, device, ddp=True)
    nohook = os.environ.get("NOHOOK") == "1"
    if not nohook:
        step.module.register_comm_hook(None, hook)
    gen = torch.Generator().manual_seed(rank + 1)
    data = [torch.randint(0, cfg.vocab_size, (batch, 513), generator=gen) for _ in range(4)]
    xs = [d[:, :-1].contiguous().to(device) for d in data]
    ys = [d[:, 1:].contiguous().to(device) for d in data]
    n = [0]

    def one(i):
        n[0] += 1
        return step([(xs[i % 4], ys[i % 4])], 1e-4, n[0])
    order = ["default"] if nohook else (sys.argv[1:] or ["avg32", "g16", "g16+out", "avg32+out"])
    for rnd in range(2):
        for v in order:
            VAR["v"], VAR["out"] = v.split("+")[0], v.endswith("+out")
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
            # the ranks' weights must stay bitwise equal
            w = torch.cat([p.detach().flatten()[:4096] for p in model.parameters()])
            ws = [torch.empty_like(w) for _ in range(2)]
            dist.all_gather(ws, w)
            if rank == 0:
                print(json.dumps({"round": rnd, "variant": v, "batch": batch, "ms": round(secs[3], 3),
                                  "min": round(secs[0], 3), "max": round(secs[-1], 3),
                                  "graph": step._graph is not None, "loss": round(float(loss), 5),
                                  "norm": round(float(norm), 5),
                                  "ranks_equal": bool(torch.equal(ws[0], ws[1]))}), flush=True)
    if rank == 0 and INEXACT:
        print(json.dumps({"inexact_elements_by_param": INEXACT}), flush=True)
    os._exit(0)  # destroy_process_group() hangs after captured DDP steps


main()
