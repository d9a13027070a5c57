"""Training throughput of the three groups against the plain reference, side by side on one card.

    PYTHONPATH=. python benchmarks/bench_train.py --batch 8 64 --groups reference gpt_base oelm_nofreeze oelm_freeze

A group may carry options after a colon: ``gpt_base:loss=full,step=graph,compile=max-autotune``
(loss: chunked|full; step: trainer = oelm_core.train's step, graph = common.PlainStep (forward,
backward, clip_grad_norm_, the trainer's AdamW) captured whole in one CUDA graph, plain = PlainStep
uncaptured; compile: a torch.compile mode or "none", for the graph/plain steps; cuda_graph: 0/1
sets TrainConfig.cuda_graph for the trainer's step - the reference defaults to 0, as the issue
defines it: compiled, no CUDA graph; pad: 0/1, the reference's vocabulary padded to 50,304 as
nanoGPT does, default 1; chunk: tokens per loss slice; gemm: cublaslt|torch, the model's
training GEMMs through oelm_core/cublaslt.py (the default where it runs) or torch's own ops;
tuning: 0/1 sets TrainConfig.compile_tuning for the trainer's step (the default step), default 1
as the trainer's, and 0 for the reference, compiled as the issue defines it, plainly;
fused_logits: 0/1, the loss's logits GEMM with its exp in the epilogue (oelm_core/logits_gemm.py;
the default where it runs) or cuBLAS's GEMM and the loss kernel).
The JSON's options.cuda_graph says whether the timed step replayed a CUDA graph (never on CPU,
nor where the capture failed), options.gemm whether the model's GEMMs went through cuBLASLt,
options.fused_logits whether the loss's logits came from the fused GEMM.
Each figure is the median of --blocks blocks of --steps steps after warm-up, timed with CUDA
events; peak memory is torch.cuda.max_memory_allocated over building, compiling, capturing and
the timed steps, less what was allocated before the variant began. Prints a table last; --json
writes all.
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

from common import PlainStep, at_least, card_name, commit, free_between_runs, median, now, time_blocks  # noqa: E402
from reference import ReferenceGPT, copy_from, reference_grads_as_model  # noqa: E402

from oelm_core import cublaslt, logits_gemm  # noqa: E402
from oelm_core.accounting import flops_per_token, peak_flops  # noqa: E402
from oelm_core.config import TrainConfig, model_config  # noqa: E402
from oelm_core.model import GPT  # noqa: E402


# A group's options after the colon (the module docstring says what they do) and, where the set
# is closed, the values each takes; compile takes any mode torch.compile knows, or "none".
OPTIONS = {"loss": ("chunked", "full"), "step": ("trainer", "graph", "plain"), "compile": None,
           "cuda_graph": ("0", "1"), "pad": ("0", "1"), "chunk": None, "gemm": ("cublaslt", "torch"),
           "tuning": ("0", "1"), "fused_logits": ("0", "1")}
# Options that are environment switches the library reads when a step runs: (variable, its value).
ENV_OPTIONS = {"gemm": ("OELM_CUBLASLT", lambda val: "0" if val == "torch" else "1"),
               "fused_logits": ("OELM_FUSED_LOGITS", str)}


def parse_variant(spec: str, args) -> dict:
    """``group:key=value,...`` -> the variant's settings; ValueError names what is wrong."""
    group, _, opts = spec.partition(":")
    v = {"group": group, "loss": args.loss, "step": args.step, "compile": args.compile_mode}
    for item in filter(None, opts.split(",")):
        k, _, val = item.partition("=")
        if k not in OPTIONS:
            raise ValueError(f"{spec}: unknown option {k!r}; a group's options are "
                             f"{', '.join(OPTIONS)} (e.g. gpt_base:loss=full,cuda_graph=0)")
        if OPTIONS[k] and val not in OPTIONS[k]:
            raise ValueError(f"{spec}: {k}={val} is not one of {'|'.join(OPTIONS[k])}")
        if k == "chunk" and not (val.isdigit() and int(val) > 0):
            raise ValueError(f"{spec}: chunk={val} must be a positive integer (tokens per loss slice)")
        if not val:
            raise ValueError(f"{spec}: {k} needs a value ({k}=...)")
        v[k] = int(val) if val.isdigit() else val
    v["label"] = spec
    return v


def build(v: dict, preset: str, device):
    if v["group"] == "reference":
        cfg = model_config(preset, "gpt_base")
        model = ReferenceGPT(cfg, pad_vocab=bool(int(v.get("pad", 1))))
    else:
        over = {"loss_impl": v["loss"]}
        if "chunk" in v:
            over["loss_chunk_tokens"] = int(v["chunk"])
        cfg = model_config(preset, v["group"], **over)
        model = GPT(cfg)
    return cfg, model.to(device)


def bench_one(v: dict, batch: int, args, device) -> dict:
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # peak over build, compile, capture and the timed steps
        base_mem = torch.cuda.memory_allocated()  # held before this variant began: not its own
    graphs_before = dynamo_graphs()
    cfg, model = build(v, args.preset, device)
    fwd = model
    mode = v["compile"]
    t0 = time.perf_counter()
    if mode != "none":
        fwd = torch.compile(model, **({} if mode == "default" else {"mode": mode}))
    tc = TrainConfig(compile=mode != "none")
    # The reference is timed as the issue defines it (compiled plainly, no CUDA graph) unless asked.
    tc.compile_tuning = bool(int(v.get("tuning", 0 if v["group"] == "reference" else int(tc.compile_tuning))))
    tc.cuda_graph = bool(int(v.get("cuda_graph", 0 if v["group"] == "reference" else int(tc.cuda_graph))))
    n_batches = 4
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=gen) for _ in range(n_batches)]
    xs = [d[:, :-1].contiguous() for d in data]
    ys = [d[:, 1:].contiguous() for d in data]
    if cuda:  # what a loader that never waits hands over: pinned host memory, copied asynchronously
        xs = [x.pin_memory() for x in xs]
        ys = [y.pin_memory() for y in ys]
    i = [0]
    if v["step"] == "trainer":
        # The trainer's own step (oelm_core.train): compile as TrainConfig.compile does, fused AdamW,
        # clip, bf16 autocast. ``--compile-mode`` other than default does not apply to it.
        from oelm_core.train import configure_optimizer, make_step
        step = make_step(model, configure_optimizer(model, tc, device), tc, device)
        last = [None]

        def one():
            k = i[0] % n_batches
            i[0] += 1
            x = xs[k].to(device, non_blocking=True)
            y = ys[k].to(device, non_blocking=True)
            last[0] = step([(x, y)], tc.lr, i[0])[0]
        for _ in range(3):
            one()
    else:
        step = PlainStep(model, fwd, tc, (batch, cfg.block_size), device, graph=v["step"] == "graph" and cuda)
        step.warmup(xs[0], ys[0], n=3)
        last = [None]

        def one():
            k = i[0] % n_batches
            i[0] += 1
            last[0] = step(xs[k], ys[k])
    if cuda:
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    # Whether the timed step replays a CUDA graph: what was asked for, unless there is no CUDA or
    # the capture failed (either step then runs eagerly).
    v["cuda_graph"] = (getattr(step, "cuda_graph", None) if v["step"] == "trainer"
                       else step.g is not None)
    # Whether the model's training GEMMs went through cuBLASLt (never the reference's)
    v["gemm"] = ("cublaslt" if v["group"] != "reference" and cublaslt.available(device, torch.bfloat16)
                 else "torch")
    v["fused_logits"] = int(v["group"] != "reference" and v["loss"] == "chunked" and logits_gemm.available(
        device, torch.bfloat16, cfg.d_model, cfg.padded_vocab_size))

    time_blocks(one, 1, args.warmup, cuda)  # more warm-up
    secs = time_blocks(one, args.blocks, args.steps, cuda)
    loss = float(last[0].detach())
    graphs_after = dynamo_graphs()
    graphs = graphs_after - graphs_before if graphs_after is not None else None
    breakdown = None
    if args.profile and cuda and v["label"] in args.profile:
        from torch.profiler import ProfilerActivity, profile
        steps = 3
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                one()
            torch.cuda.synchronize()
        events = prof.key_averages()
        breakdown = kernel_breakdown(events, steps)
        table = events.table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=80)
        name = f"profile_{v['label'].replace(':', '_').replace(',', '_').replace('=', '-')}_b{batch}.txt"
        with open(os.path.join(args.out_dir, name), "w") as f:
            f.write(table)
    s = median(secs)
    tokens = batch * cfg.block_size
    fpt = flops_per_token(cfg)["total"]
    peak = peak_flops(device) if cuda else None
    r = {"label": v["label"], "group": v["group"], "batch": batch, "tokens_per_step": tokens,
         "ms_per_step": 1000 * s, "tokens_per_s": tokens / s,
         "ms_min": 1000 * min(secs), "ms_max": 1000 * max(secs),
         "mfu": (tokens / s * fpt / peak) if peak else None, "flops_per_token": fpt,
         "peak_mem_gb": (torch.cuda.max_memory_allocated() - base_mem) / 2**30 if cuda else None,
         "compile_s": compile_s, "loss": loss, "kernel_ms_per_step": breakdown, "dynamo_graphs": graphs, "options": {k: v[k] for k in v if k not in ("label",)}}
    step = model = fwd = last[0] = None  # the closures hold step and the last loss: drop them first
    free_between_runs(cuda)
    return r


def dynamo_graphs():
    """Graphs torch.compile has captured in this process so far (None where torch does not count them)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return counters["stats"]["unique_graphs"]


# Kernel families of a training step, matched on the profiler's kernel names, in this order.
KERNEL_FAMILIES = [
    ("fused loss kernel", ("_ce_rows_kernel", "_target_logit_kernel", "_finish_kernel")),
    ("logits GEMM with the loss's exp", ("_logits_exp_kernel",)),
    ("compiled cross-entropy", ("log_softmax", "nll_loss")),
    ("attention", ("sdpa", "fmha", "flash", "cudnn")),
    ("GEMM", ("nvjet", "gemm", "gemv", "cutlass", "splitkreduce")),
    ("optimizer and clipping", ("multi_tensor_apply",)),
]


def kernel_breakdown(events, steps: int) -> dict:
    """GPU milliseconds per step by kernel family (the rest is "other elementwise and reductions")."""
    out = {name: 0.0 for name, _ in KERNEL_FAMILIES} | {"other elementwise and reductions": 0.0}
    for e in events:
        us = e.self_device_time_total
        if us <= 0:
            continue
        key = e.key.lower()
        family = next((name for name, pats in KERNEL_FAMILIES if any(p in key for p in pats)),
                      "other elementwise and reductions")
        out[family] += us / 1000 / steps
    out["total"] = sum(out.values())
    return out


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def agreement(preset: str, device, dtype_autocast: bool, batch: int = 4) -> dict:
    """Loss and gradients of the fast path vs the full-logits path vs the reference (copied weights),
    on one batch of ``batch`` x block_size tokens (each comparison records both)."""
    out = {}
    torch.manual_seed(0)
    for variant in ("gpt_base", "oelm_freeze"):
        fast = GPT(model_config(preset, variant)).to(device)
        full = GPT(model_config(preset, variant, loss_impl="full")).to(device)
        full.load_state_dict(fast.state_dict())
        ref = copy_from(ReferenceGPT(fast.cfg).to(device), fast)
        t = fast.cfg.block_size
        x = torch.randint(0, fast.cfg.vocab_size, (batch, t), device=device)
        y = torch.randint(0, fast.cfg.vocab_size, (batch, t), device=device)
        losses, grads = {}, {}
        for name, m in (("chunked", fast), ("full", full), ("reference", ref)):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=dtype_autocast):
                loss = m(x, y)
            loss.backward()
            losses[name] = float(loss)
            grads[name] = (reference_grads_as_model(ref, fast) if name == "reference"
                           else {n: p.grad for n, p in m.named_parameters()})
        names = [n for n, _ in fast.named_parameters()]
        for other in ("full", "reference"):
            out[f"{variant}: chunked vs {other}"] = {
                "loss_abs_diff": abs(losses["chunked"] - losses[other]),
                "max_grad_rel_diff": max(rel(grads["chunked"][n], grads[other][n]) for n in names),
                "batch": batch, "block_size": t}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="medium512")
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--groups", nargs="+", default=["reference", "gpt_base", "oelm_nofreeze", "oelm_freeze"])
    ap.add_argument("--steps", type=at_least(1), default=10, help="steps per timed block")
    ap.add_argument("--blocks", type=at_least(1), default=7, help="timed blocks (the median is reported)")
    ap.add_argument("--warmup", type=at_least(0), default=10, help="steps after compilation before timing")
    ap.add_argument("--compile-mode", default="default", help="torch.compile mode, or 'none'")
    ap.add_argument("--loss", default="chunked", choices=["chunked", "full"])
    ap.add_argument("--step", default="trainer", choices=["trainer", "graph", "plain"],
                    help="trainer: oelm_core.train's step; graph: benchmarks/common.py's PlainStep "
                         "(the trainer's AdamW, but clip_grad_norm_ before it) captured whole in a "
                         "CUDA graph; plain: PlainStep without the graph")
    ap.add_argument("--check", action="store_true", help="print loss/grad agreement with the reference")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", nargs="*", default=[], help="variant labels to profile (CUDA kernel table)")
    ap.add_argument("--out-dir", default=".", help="where profile tables go")
    ap.add_argument("--cache-in", default=None, help="torch.compiler cache artifacts to load first")
    ap.add_argument("--cache-out", default=None, help="write torch.compiler cache artifacts here")
    args = ap.parse_args()
    try:  # every variant checked before anything runs
        variants = [parse_variant(spec, args) for spec in args.groups]
    except ValueError as e:
        ap.error(f"--groups {e}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if args.cache_in and os.path.exists(args.cache_in):
        with open(args.cache_in, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
    meta = {"card": card_name(), "date": now(), "commit": commit(), "torch": torch.__version__,
            "command": " ".join(sys.argv), "preset": args.preset}
    print(json.dumps(meta), flush=True)
    results, checks = [], {}
    if args.check:
        checks["bf16" if device.type == "cuda" else "float32"] = agreement(args.preset, device, device.type == "cuda")
        print(json.dumps(checks, indent=1), flush=True)
    for batch in args.batch:
        for spec, parsed in zip(args.groups, variants):
            v = dict(parsed)  # bench_one records what applied in it
            # The library reads these switches when a step is built and compiled (cuBLASLt) or run
            # (the loss); a variant without the option keeps the caller's setting
            saved = {var: os.environ.get(var) for var, _ in ENV_OPTIONS.values()}
            for key, (var, value) in ENV_OPTIONS.items():
                if key in v:
                    os.environ[var] = value(v[key])
            try:
                r = bench_one(v, batch, args, device)
            except Exception as e:  # keep the other figures
                import traceback
                traceback.print_exc()
                r = {"label": spec, "group": v["group"], "batch": batch, "error": repr(e)[:300]}
            finally:
                for var, value in saved.items():
                    os.environ.pop(var, None)
                    if value is not None:
                        os.environ[var] = value
            results.append(r)
            print(json.dumps(r), flush=True)
    if args.cache_out:
        try:
            art = torch.compiler.save_cache_artifacts()
            if art is not None:
                with open(args.cache_out, "wb") as f:
                    f.write(art[0])
        except Exception as e:
            print("cache save failed", e)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "checks": checks, "results": results}, f, indent=1)
    print_table(meta, results)


def print_table(meta, results):
    ref = {r["batch"]: r["tokens_per_s"] for r in results if r["group"] == "reference" and "error" not in r
           and r["label"] == "reference"}
    print(f"\n{meta['card']}  torch {meta['torch']}  {meta['date']}  commit {meta['commit']}")
    print(f"{'variant':44s} {'batch':>5s} {'tok/s':>10s} {'ms/step':>8s} {'MFU':>6s} {'mem GB':>7s} {'x ref':>6s} {'comp s':>6s}")
    for r in results:
        if "error" in r:
            print(f"{r['label']:44s} {r['batch']:5d}  ERROR {r['error'][:60]}")
            continue
        mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] else "    -"
        mem = f"{r['peak_mem_gb']:7.2f}" if r["peak_mem_gb"] is not None else "      -"
        x = f"{r['tokens_per_s'] / ref[r['batch']]:6.2f}" if r["batch"] in ref else "     -"
        print(f"{r['label']:44s} {r['batch']:5d} {r['tokens_per_s']:10.0f} {r['ms_per_step']:8.2f} {mfu} {mem} {x} {r['compile_s']:6.0f}")
    profiled = [r for r in results if r.get("kernel_ms_per_step")]
    if profiled:
        families = list(profiled[0]["kernel_ms_per_step"])
        print("\nGPU time per step by kernel family (ms, from the CUDA profiler):")
        print(f"{'family':34s}" + "".join(f" {r['label'][:18]:>18s}" for r in profiled))
        for fam in families:
            print(f"{fam:34s}" + "".join(f" {r['kernel_ms_per_step'][fam]:18.2f}" for r in profiled))


if __name__ == "__main__":
    main()
