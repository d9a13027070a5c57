"""Generation speed: the reference loop, the fast decoder, and the fast decoder with each of its
parts switched off in turn (oelm_core.generate, oelm_core.fast.decode).

    PYTHONPATH=. python benchmarks/bench_generate.py --json generate.json
    PYTHONPATH=. python benchmarks/bench_generate.py --device cpu --threads 1 --presets medium512

For each preset (default smoke and medium512) and sampling setting (default greedy, and
temperature 0.8 with top-k 50): --new-tokens tokens (default 256, no stop at <|endoftext|>)
after a --prompt-tokens prompt (default 16), by each path (--paths; those that do not apply on
the device are left out):

  uncached          the reference loop without the KV cache (--uncached-repeats runs)
  reference         the reference KV-cached loop (SamplingConfig(fast=False))
  fast              the fast decoder, every part on (what fast.stream_tokens uses by default)
  -graph            the fast decoder without CUDA graphs (CUDA)
  -decode_kernels   ... without the fused Triton decode step (CUDA)
  -sample_kernels   ... without the Triton sampler (CUDA)
  -cpu_copies       ... without the transposed weight copies (CPU)

Time to first token (prompt prefill + first draw), decode ms/token after it, tokens/s over the
whole generation: medians of --repeats runs, the paths taken in turn within each repeat (a busy
machine slows them alike), after one warm-up run of each (which also captures the CUDA graphs).
Every path must give the reference's tokens; a path that does not is reported, and in float32
the run fails. The table comes last: "fast saves" is the share of this row's generation time that the
fast decoder saves, so for a "-part" row what that part saves (the 10% rule of
benchmarks/README.md); --json writes every row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import at_least, card_name, commit, median, now  # noqa: E402

from oelm_core.fast import decode  # noqa: E402
from oelm_core.generate import SamplingConfig, stream_tokens  # noqa: E402
from oelm_core.model import build_model  # noqa: E402

SAMPLINGS = {"greedy": dict(temperature=0.0), "T0.8-k50": dict(temperature=0.8, top_k=50)}
# path -> (where it applies: "any", "cuda", "cpu"; the fast decoder's switch it turns off)
PATHS = {
    "uncached": ("any", None),
    "reference": ("any", None),
    "fast": ("any", None),
    "-graph": ("cuda", "graph"),
    "-decode_kernels": ("cuda", "decode_kernels"),
    "-sample_kernels": ("cuda", "sample_kernels"),
    "-cpu_copies": ("cpu", "cpu_copies"),
}


def tokens_of(model, path, prompt, cfg):
    """The token stream of ``path``."""
    if path == "uncached":
        return stream_tokens(model, prompt, SamplingConfig(**{**vars(cfg), "use_cache": False}))
    if path == "reference":
        return stream_tokens(model, prompt, SamplingConfig(**{**vars(cfg), "fast": False}))
    off = PATHS[path][1]
    return decode.stream_tokens(model, prompt, cfg, **({off: False} if off else {}))


def run_once(model, path, prompt, cfg, cuda):
    """(seconds to the first token, seconds in all, the tokens, this process's CPU seconds)."""
    if cuda:
        torch.cuda.synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    ttft, tokens = None, []
    for token in tokens_of(model, path, prompt, cfg):
        tokens.append(token)
        if ttft is None:
            ttft = time.perf_counter() - t0
    return ttft, time.perf_counter() - t0, tokens, time.process_time() - c0


def describe(model, path, cfg):
    """What runs on ``path``: (decoder mode, decode step, sampler)."""
    if path in ("uncached", "reference"):
        return "-", "torch", "argmax" if cfg.greedy else "torch"
    off = PATHS[path][1]
    decoder = decode.acquire_decoder(model, **({off: False} if off else {}))
    decode.release_decoder(decoder)
    step = decoder.kernels + ("+copies" if decoder.copies is not None else "")
    return decoder.mode or "-", step, decoder.sampler(cfg)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["smoke", "medium512"])
    ap.add_argument("--samplings", nargs="+", default=list(SAMPLINGS), choices=list(SAMPLINGS))
    ap.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--new-tokens", type=at_least(1), default=256)
    ap.add_argument("--prompt-tokens", type=at_least(1), default=16)
    ap.add_argument("--repeats", type=at_least(1), default=3)
    ap.add_argument("--uncached-repeats", type=at_least(1), default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    cuda = device.type == "cuda"
    paths = [p for p in args.paths if PATHS[p][0] in ("any", device.type)]
    # After --threads: on CPU the card names the thread count the figures were taken with.
    meta = {
        "card": card_name(device),
        "device": str(device),
        "date": now(),
        "commit": commit(),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "load_average": os.getloadavg(),
    }
    print(json.dumps(meta), flush=True)
    rows, mismatches = [], []
    for preset in args.presets:
        model = build_model(preset, "gpt_base").to(device, getattr(torch, args.dtype)).eval()
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, min(50000, model.cfg.vocab_size), (args.prompt_tokens,), generator=gen).tolist()
        for sampling in args.samplings:
            cfg = SamplingConfig(max_new_tokens=args.new_tokens, stop_at_eot=False, seed=0, **SAMPLINGS[sampling])
            runs = {path: [] for path in paths}
            for path in paths:  # warm-up: the whole length (captures every graph the runs use)
                if path != "uncached":
                    run_once(model, path, prompt, cfg, cuda)
            for rep in range(args.repeats):
                for path in paths:
                    if path != "uncached" or rep < args.uncached_repeats:
                        runs[path].append(run_once(model, path, prompt, cfg, cuda))
            expect = runs["reference"][0][2] if "reference" in runs else None
            for path in paths:
                r = runs[path]
                same = expect is None or all(tokens == expect for _, _, tokens, _ in r)
                if not same:
                    mismatches.append((preset, sampling, path))
                n = len(r[0][2])
                mode, step, sampler = describe(model, path, cfg)
                total = median([t for _, t, _, _ in r])
                row = {
                    "preset": preset,
                    "sampling": sampling,
                    **SAMPLINGS[sampling],
                    "path": path,
                    "decoder": mode,
                    "step": step,
                    "sampler": sampler,
                    "new_tokens": n,
                    "same_tokens": same,
                    "ttft_ms": 1000 * median([f for f, _, _, _ in r]),
                    "decode_ms_per_token": 1000 * median([(t - f) / max(n - 1, 1) for f, t, _, _ in r]),
                    "total_s": total,
                    "tokens_per_s": n / total,
                    "runs_s": [t for _, t, _, _ in r],
                    # On a busy CPU the process's own CPU time shows the work better than the clock.
                    "cpu_tokens_per_s": n / median([c for _, _, _, c in r]),
                    "dtype": args.dtype,
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
        del model
        if cuda:
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)
    print(
        f"\n{meta['card']} ({device})  torch {meta['torch']}  {meta['date']}  commit {meta['commit']}  "
        f"{args.dtype}, {args.new_tokens} new tokens after {args.prompt_tokens}"
    )
    print(
        f"{'preset':10s} {'sampling':9s} {'path':16s} {'decoder':7s} {'step':13s} {'sampler':7s} "
        f"{'TTFT ms':>8s} {'ms/tok':>8s} {'tok/s':>9s} {'fast saves':>10s}"
        + (f" {'CPU-time tok/s':>14s}" if not cuda else "")
    )
    for r in rows:
        fast = next(
            (q for q in rows if q["preset"] == r["preset"] and q["sampling"] == r["sampling"] and q["path"] == "fast"),
            None,
        )
        saves = "" if fast is None or r is fast else f"{1 - r['tokens_per_s'] / fast['tokens_per_s']:10.1%}"
        print(
            f"{r['preset']:10s} {r['sampling']:9s} {r['path']:16s} {r['decoder']:7s} {r['step']:13s} "
            f"{r['sampler']:7s} {r['ttft_ms']:8.1f} {r['decode_ms_per_token']:8.3f} {r['tokens_per_s']:9.1f} "
            f"{saves:>10s}"
            + (f" {r['cpu_tokens_per_s']:14.1f}" if not cuda else "")
            + ("" if r["same_tokens"] else "  OTHER TOKENS THAN THE REFERENCE")
        )
    if mismatches:
        # bfloat16: the fused step keeps float32 inside, so its tokens may differ from the reference.
        message = f"paths that gave other tokens than the reference loop: {mismatches}"
        sys.exit(message) if args.dtype == "float32" else print(message)


if __name__ == "__main__":
    main()
