"""Scratch, timing only (its logits are int8-approximate, not exact): one-row CPU logits of the output
layer from an int8 per-row-scaled copy through fbgemm (KIND=int8), fp16 (KIND=fp16) or as the
model has them (KIND=none), then benchmarks/bench_generate.py with the given arguments.
KIND=int8 PYTHONPATH=. python int8_head.py --device cpu --threads 1 --uncached-repeats 1 --presets medium512"""
import os, sys, runpy, torch
sys.path.insert(0, os.getcwd())
from oelm_core import model as M
KIND = os.environ.get("KIND", "int8")
cache = {}
orig = M.GPT.logits
def logits(self, h):
    if M._one_cpu_row(h):
        W = self.output_weight
        key = (W.data_ptr(), W._version)
        if cache.get("key") != key:
            Wd = W.detach()
            if KIND == "int8":
                s = (Wd.abs().amax(1) / 127).clamp_min(1e-12)
                qw = torch.quantize_per_channel(Wd, s.double(), torch.zeros(Wd.size(0), dtype=torch.long), 0, torch.qint8)
                cache["p"] = torch.ops.quantized.linear_prepack(qw, None)
            else:
                cache["p"] = torch.ops.quantized.linear_prepack_fp16(Wd, None)
            cache["key"] = key
        f = torch.ops.quantized.linear_dynamic if KIND == "int8" else torch.ops.quantized.linear_dynamic_fp16
        return f(h.reshape(-1, h.size(-1)), cache["p"]).view(*h.shape[:-1], -1)[..., : self.cfg.vocab_size]
    return orig(self, h)
if KIND != "none":
    M.GPT.logits = logits
sys.argv = ["bench_generate.py"] + sys.argv[1:]
runpy.run_path(os.path.join(os.getcwd(), "benchmarks/bench_generate.py"), run_name="__main__")
