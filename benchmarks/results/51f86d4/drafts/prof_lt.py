import sys
import torch
from torch.profiler import profile, ProfilerActivity
from oelm_core.model import build_model
from oelm_core.config import TrainConfig
from oelm_core.train import make_step, configure_optimizer
dev = torch.device("cuda")
batch = int(sys.argv[1]) if len(sys.argv) > 1 else 64
model = build_model("medium512", "gpt_base").to(dev)
tc = TrainConfig(compile=True, cuda_graph=False, dtype="bf16", grad_clip=1.0)
step = make_step(model, configure_optimizer(model, tc, dev), tc, dev)
x = torch.randint(0, 50257, (batch, 513), device=dev)
b = [(x[:, :-1], x[:, 1:])]
for i in range(5):
    step(b, 1e-4, i + 1)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for i in range(2):
        step(b, 1e-4, 10 + i)
    torch.cuda.synchronize()
ka = prof.key_averages()
tot = sum(e.self_device_time_total for e in ka) / 2 / 1000
print(f"kernel ms per step: {tot:.2f}")
print(ka.table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=90))
