"""Scratch (2026-11-26, eleventh stop): would gradients sent by the copy engines (NVLink peer
copies, no SMs) hide behind the backward pass where NCCL's kernels do not? One process, two GPUs:
the trainer's plain captured step (medium512, gpt_base, 8 x 512) on GPU 0, timed alone and with
peer copies of N MB each way running beside it on side streams (what a two-GPU exchange of the
gradients would move), and the copies alone. Prints ms per step."""
import statistics, sys, os
import torch
sys.path.insert(0, os.getcwd())
from oelm_core.config import TrainConfig, model_config
from oelm_core.model import GPT
from oelm_core.train import configure_optimizer, make_step

assert torch.cuda.device_count() >= 2
print("peer access 0->1", torch.cuda.can_device_access_peer(0, 1), "1->0", torch.cuda.can_device_access_peer(1, 0))
d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
torch.cuda.set_device(d0)
torch.manual_seed(0)
cfg = model_config("medium512", "gpt_base")
model = GPT(cfg).to(d0)
tc = TrainConfig(compile=True)
step = make_step(model, configure_optimizer(model, tc, d0), tc, d0)
x = torch.randint(0, cfg.vocab_size, (8, 512), device=d0)
y = torch.randint(0, cfg.vocab_size, (8, 512), device=d0)
n = [0]
def one():
    n[0] += 1
    step([(x, y)], 1e-4, n[0])
for _ in range(20):
    one()
torch.cuda.synchronize(d0)

MB = [77, 180]
bufs = {m: (torch.empty(m * 2**18, device=d0), torch.empty(m * 2**18, device=d1),
            torch.empty(m * 2**18, device=d0), torch.empty(m * 2**18, device=d1)) for m in MB}
s0 = torch.cuda.Stream(d0)
s1 = torch.cuda.Stream(d1)
s0b, s1b = torch.cuda.Stream(d0), torch.cuda.Stream(d1)

def copies(m):
    # A copy between devices waits for, and holds up, the current stream of *both* devices: both
    # are side streams here, or the copy would be ordered with the step on GPU 0's stream.
    a0, a1, r0, r1 = bufs[m]
    with torch.cuda.stream(s0), torch.cuda.stream(s1):
        r1.copy_(a0, non_blocking=True)   # GPU 0's gradient into GPU 1's receive buffer
    with torch.cuda.stream(s0b), torch.cuda.stream(s1b):
        r0.copy_(a1, non_blocking=True)   # and back

def timed(fn, reps=10, blocks=7):
    out = []
    for _ in range(blocks):
        torch.cuda.synchronize(d0); torch.cuda.synchronize(d1)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize(d0); torch.cuda.synchronize(d1)
        e1.record(); e1.synchronize()
        out.append(e0.elapsed_time(e1) / reps)
    return statistics.median(out)

def step_with(m):
    def fn():
        main0 = torch.cuda.current_stream(d0)
        for s in (s0, s0b):
            s.wait_stream(main0)
        copies(m)
        one()
        for s in (s0, s0b):
            main0.wait_stream(s)
        with torch.cuda.device(d1):
            for s in (s1, s1b):
                torch.cuda.current_stream(d1).wait_stream(s)
    return fn

for rnd in range(2):
    print(f"round {rnd}: step alone {timed(one):.3f} ms", flush=True)
    if rnd == 0:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                step_with(180)()
            torch.cuda.synchronize(d0); torch.cuda.synchronize(d1)
        prof.export_chrome_trace(os.path.join(os.environ.get("OUT", "."), "ce_overlap_trace.json"))
    for m in MB:
        print(f"  {m} MB each way, copies alone {timed(lambda: copies(m)):.3f} ms;"
              f" step with them beside it {timed(step_with(m)):.3f} ms", flush=True)
os._exit(0)
