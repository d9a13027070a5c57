import torch
from torch.profiler import profile, ProfilerActivity
from oelm_core.model import build_model
from oelm_core.config import TrainConfig
from oelm_core.train import make_step, configure_optimizer
dev = torch.device("cuda")
model = build_model("medium512", "gpt_base").to(dev)
tc = TrainConfig(compile=True, cuda_graph=False, dtype="bf16", grad_clip=1.0)
step = make_step(model, configure_optimizer(model, tc, dev), tc, dev)
x = torch.randint(0, 50257, (64, 513), device=dev)
b = [(x[:, :-1], x[:, 1:])]
for i in range(5):
    step(b, 1e-4, i + 1)
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
    for i in range(2):
        step(b, 1e-4, 10 + i)
    torch.cuda.synchronize()
ka = prof.key_averages(group_by_input_shape=True)
print(ka.table(sort_by="self_cuda_time_total", row_limit=70, max_name_column_width=70, max_shapes_column_width=110))
