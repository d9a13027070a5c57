"""Generation speed with and without the KV cache (oelm_core.generate.stream_tokens).

    PYTHONPATH=. python benchmarks/bench_generate.py --presets smoke medium512 --new-tokens 256
    PYTHONPATH=. python benchmarks/bench_generate.py --device cuda --modes graph eager legacy

Greedy decoding of --new-tokens tokens (no stop at <|endoftext|>) after a --prompt-tokens prompt;
time to first token (prompt prefill + first sample), decode ms/token after it, and tokens/s over
the whole generation, median of --repeats runs after one warm-up run (the warm-up also captures
the CUDA graph of the decode step, once per model). Prints a table last.

Cached decoding modes (--modes; the default is "graph" alone):
  graph   GraphDecoder as stream_tokens uses it: the fixed-shape one-token step and the sampler,
          16 steps (generate.CHUNK) per CUDA graph replay on CUDA (the table's decoder column
          says "eager" where it was not captured)
  eager   the same fixed-shape steps run op by op (no graph)
  legacy  the plain growing-cache path, model(x, cache=cache) per token (before the graph step)

Greedy by default; --temperature/--top-k time sampling (the same sampler runs on every path).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import at_least, card_name, commit, median, now  # noqa: E402

from oelm_core import sample_kernels  # noqa: E402
from oelm_core.generate import SamplingConfig, acquire_decoder, release_decoder, stream_tokens  # noqa: E402
from oelm_core.model import build_model  # noqa: E402


def set_mode(model, mode):
    """Make stream_tokens' (reused) decoder of ``model`` run in ``mode``; returns the decoder."""
    decoder = acquire_decoder(model)
    release_decoder(decoder)
    if mode == "graph":
        if decoder.mode != "graph":
            decoder.mode = None  # untried again: capture on the next run where possible
    else:
        decoder.mode = mode
        decoder.graphs.clear()
    return decoder


def run_once(model, prompt, n, use_cache, cuda, temperature=0.0, top_k=0):
    cfg = SamplingConfig(max_new_tokens=n, temperature=temperature, top_k=top_k, stop_at_eot=False,
                         use_cache=use_cache, seed=0)
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    ttft, count = None, 0
    for _ in stream_tokens(model, prompt, cfg):
        count += 1
        if ttft is None:
            ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return ttft, total, count


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", nargs="+", default=["smoke", "medium512"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=at_least(1), default=3)
    ap.add_argument("--uncached-repeats", type=at_least(1), default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--modes", nargs="+", default=["graph"], choices=["graph", "eager", "legacy"],
                    help="cached decoding modes to time (each against the same uncached baseline)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          ("cpu" if args.device == "auto" else args.device))
    cuda = device.type == "cuda"
    # After --threads: on CPU the card names the thread count the figures were taken with.
    meta = {"card": card_name(device), "device": str(device),
            "date": now(), "commit": commit(), "torch": torch.__version__, "command": " ".join(sys.argv)}
    print(json.dumps(meta), flush=True)
    rows = []
    for preset in args.presets:
        model = build_model(preset, "gpt_base").to(device, getattr(torch, args.dtype)).eval()
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, 50000, (args.prompt_tokens,), generator=gen).tolist()
        for mode in list(args.modes) + [None]:  # None: uncached
            use_cache = mode is not None
            decoder = set_mode(model, mode) if use_cache else None
            reps = args.repeats if use_cache or args.uncached_repeats is None else args.uncached_repeats
            sampling = dict(temperature=args.temperature, top_k=args.top_k)
            top_k = SamplingConfig(**sampling).top_k_for(model.cfg.vocab_size)
            fused = sample_kernels.supports(model.wte.weight, 0 if args.temperature == 0 else top_k, 1.0)
            if args.temperature == 0:  # generate.sample: the kernels for greedy inside CUDA graphs only
                fused = fused and mode == "graph"
            sampler = "triton" if fused else ("argmax" if args.temperature == 0 else "torch")
            # Warm-up: the whole length with the cache (captures every graph the runs use).
            run_once(model, prompt, args.new_tokens if use_cache else min(8, args.new_tokens), use_cache,
                     cuda, **sampling)
            runs = [run_once(model, prompt, args.new_tokens, use_cache, cuda, **sampling) for _ in range(reps)]
            ttft = median([r[0] for r in runs])
            total = median([r[1] for r in runs])
            n = runs[0][2]
            row = {"preset": preset, "cache": use_cache, "mode": mode or "uncached",
                   "decoder": decoder.mode if decoder is not None else "-",
                   "kernels": decoder.kernels if decoder is not None else "torch",
                   "new_tokens": n, "ttft_ms": 1000 * ttft,
                   "decode_ms_per_token": 1000 * median([(r[1] - r[0]) / max(r[2] - 1, 1) for r in runs]),
                   "total_s": total, "tokens_per_s": n / total, "dtype": args.dtype,
                   "temperature": args.temperature, "top_k": args.top_k, "sampler": sampler}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del model
        if cuda:
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    print(f"\n{meta['card']} ({device})  torch {meta['torch']}  {meta['date']}  commit {meta['commit']}")
    print(f"{'preset':10s} {'cache':>8s} {'decoder':>7s} {'new':>4s} {'TTFT ms':>8s} {'ms/tok':>7s} "
          f"{'tok/s':>9s} {'speed-up':>8s}")
    for r in rows:
        base = next(q for q in rows if q["preset"] == r["preset"] and not q["cache"])
        print(f"{r['preset']:10s} {r['mode']:>8s} {r['decoder']:>7s} {r['new_tokens']:4d} {r['ttft_ms']:8.1f} "
              f"{r['decode_ms_per_token']:7.3f} {r['tokens_per_s']:9.1f} "
              f"{r['tokens_per_s'] / base['tokens_per_s']:8.1f}x")


if __name__ == "__main__":
    main()
