"""The output layer and its loss alone (oelm_core.model.linear_cross_entropy), forward and backward,
as the training step runs it at medium512: bf16 autocast, float32 hidden states and weight.

    PYTHONPATH=. python benchmarks/bench_loss.py --tokens 32768 --json loss.json

Timed: ms per forward + backward (median of --blocks blocks of 10 after 3 warm-up calls, CUDA
events) and the peak memory above the inputs. CUDA and Triton only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_ce import D_MODEL, PADDED, VOCAB  # noqa: E402
from common import at_least, card_name, commit, median, now, time_blocks  # noqa: E402

from oelm_core.config import ModelConfig  # noqa: E402
from oelm_core.model import linear_cross_entropy  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[32768, 4096], help="tokens per step (batch x 512)")
    ap.add_argument("--chunk", type=int, default=ModelConfig.loss_chunk_tokens,
                    help="tokens per slice (default: model.loss_chunk_tokens)")
    ap.add_argument("--blocks", type=at_least(1), default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_loss: needs CUDA; the loss path it times runs on CUDA only. Nothing to do.")
        return
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.nn.Parameter(torch.randn(PADDED, D_MODEL, device=device, generator=g) * 0.02)
    rows = []
    for n in args.tokens:
        x = torch.randn(n, D_MODEL, device=device, generator=g).requires_grad_()
        t = torch.randint(0, VOCAB, (n,), device=device, generator=g)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = linear_cross_entropy(x, w, t, VOCAB, chunk=args.chunk)
            loss.backward()
            x.grad = w.grad = None

        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        time_blocks(step, 1, 3, cuda=True)
        ms = 1000 * median(time_blocks(step, args.blocks, 10, cuda=True))
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        rows.append({"tokens": n, "chunk": args.chunk, "ms": ms, "peak_gib_above_inputs": peak})
        print(f"{n} tokens, slices of {args.chunk}: {ms:.3f} ms forward + backward, peak +{peak:.2f} GiB")
    out = {"card": card_name(), "date": now(), "commit": commit(), "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
