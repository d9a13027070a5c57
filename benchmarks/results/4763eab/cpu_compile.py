# Scratch (2026-11-27): torch.compile of GPT.decode_step on the CPU (one thread, medium512, greedy,
# 16-token prompt, 256 new tokens through generate.stream_tokens); eager first, then compiled.
import sys, time, torch
sys.path.insert(0, ".")
torch.set_num_threads(1)
from oelm_core import build_model
import oelm_core.generate as G
m = build_model("medium512", "gpt_base", seed=0).eval()
cfg = G.SamplingConfig(max_new_tokens=256, temperature=0.0, stop_at_eot=False)
def run():
    with torch.no_grad():
        t = time.perf_counter(); n = 0; first = None
        for tok in G.stream_tokens(m, list(range(16)), cfg):
            n += 1
            if n == 1: first = time.perf_counter()
        return (time.perf_counter() - first) / (n - 1) * 1e3
print("eager  ms/token", round(run(), 2))
step = torch.compile(m.decode_step, dynamic=True)
G.GraphDecoder._decode = lambda self, model: step(self.token, self.state[:1], self.cache)
t0 = time.perf_counter()
print("compiled ms/token (1st run, compiles)", round(run(), 2), round(time.perf_counter() - t0, 1), "s")
print("compiled ms/token", round(run(), 2))
print("compiled ms/token", round(run(), 2))
