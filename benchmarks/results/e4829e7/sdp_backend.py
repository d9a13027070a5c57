"""Scratch: benchmarks/bench_train.py with one SDPA backend allowed for every variant.
SDP=cudnn|flash|efficient|default python sdp_backend.py [bench_train arguments]"""
import os, runpy, sys
import torch
sys.path.insert(0, os.getcwd())
which = os.environ.get("SDP", "default")
if which != "default":
    torch.backends.cuda.enable_cudnn_sdp(which == "cudnn")
    torch.backends.cuda.enable_flash_sdp(which == "flash")
    torch.backends.cuda.enable_mem_efficient_sdp(which == "efficient")
    torch.backends.cuda.enable_math_sdp(False)
print(f"SDP backends allowed: {which}", flush=True)
sys.argv = ["bench_train.py"] + sys.argv[1:]
runpy.run_path(os.path.join(os.getcwd(), "benchmarks/bench_train.py"), run_name="__main__")
