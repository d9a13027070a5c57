"""One sampled token: the reference's torch draw (generate.sample_from_noise + gumbel_noise)
against the two Triton kernels of oelm_core.fast.sample_kernels, on one row of 50,257 logits.

    PYTHONPATH=. python benchmarks/bench_sample.py --json sample.json

For each sampling setting both draws are captured, 16 in a row, in a CUDA graph (as the decoder
runs them) and timed per draw; each figure is the median of --reps replays after warm-up. Every
setting also checks that the two draw the same tokens over 256 (seed, step) pairs. CUDA only.
What the kernels save of a whole generation: bench_generate.py (its -sample_kernels rows).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import at_least, card_name, commit, median, now, time_blocks  # noqa: E402

from oelm_core.config import ModelConfig  # noqa: E402
from oelm_core.fast import sample_kernels  # noqa: E402
from oelm_core.fast.decode import sample  # noqa: E402
from oelm_core.generate import SamplingConfig, gumbel_noise, sample_from_noise, seed_tensor  # noqa: E402

VOCAB, DRAWS = ModelConfig.vocab_size, 16
SETTINGS = [(0.8, 0, 1.0), (0.8, 50, 1.0), (0.8, 50, 0.9), (1.0, 1000, 1.0)]  # temperature, top-k, top-p


def graph_of(fn):
    """fn() captured DRAWS times in a row as one CUDA graph (after a warm-up on a side stream)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(DRAWS):
            fn()
    return graph


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=at_least(1), default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available() or sample_kernels.triton is None:
        print("bench_sample: needs CUDA and Triton. Nothing to do.")
        return
    meta = {
        "card": card_name(),
        "date": now(),
        "commit": commit(),
        "torch": torch.__version__,
        "triton": sample_kernels.triton.__version__,
        "command": " ".join(sys.argv),
    }
    print(json.dumps(meta), flush=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(1, VOCAB, device="cuda", generator=g) * 3
    seed, step = seed_tensor(1, "cuda"), torch.zeros(1, dtype=torch.long, device="cuda")
    rows = []
    for temperature, top_k, top_p in SETTINGS:
        cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        agree = 0
        for i in range(256):
            s, t = seed_tensor(i, "cuda"), torch.tensor([i * 7], device="cuda")
            agree += int(
                torch.equal(sample(logits, cfg, s, t), sample_from_noise(logits, cfg, gumbel_noise(s, t, 1, VOCAB)[0]))
            )
        row = {
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "agree_of_256": agree,
            "fused": sample_kernels.supports(logits, top_k, top_p),
        }
        draws = {
            "torch": lambda: sample_from_noise(logits, cfg, gumbel_noise(seed, step, 1, VOCAB)[0]),
            "triton": lambda: sample(logits, cfg, seed, step),
        }
        for name, fn in draws.items():
            graph = graph_of(fn)
            time_blocks(graph.replay, 1, 5, cuda=True)
            row[f"{name}_us"] = 1e6 * median(time_blocks(graph.replay, args.reps, 1, cuda=True)) / DRAWS
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    print(f"\n{meta['card']}  torch {meta['torch']}  triton {meta['triton']}  {meta['date']}  commit {meta['commit']}")
    print(f"{'T':>4s} {'top-k':>5s} {'top-p':>5s} {'torch us':>9s} {'triton us':>9s} {'speed-up':>8s} {'agree':>7s}")
    for r in rows:
        print(
            f"{r['temperature']:4.1f} {r['top_k']:5d} {r['top_p']:5.2f} {r['torch_us']:9.1f} {r['triton_us']:9.1f} "
            f"{r['torch_us'] / r['triton_us']:7.1f}x {r['agree_of_256']:3d}/256"
        )


if __name__ == "__main__":
    main()
