"""The trainer's step, with each training fast path on and off, and the nanoGPT reference, on one card.

    PYTHONPATH=. python benchmarks/bench_train.py --batch 16 64 --compile 0 1 \\
        --groups reference gpt_base oelm_freeze --off fused_loss fused_logits cuda_graph
    # with torch.compile's own GEMM autotuning:
    PYTHONPATH=. python benchmarks/bench_train.py --batch 16 64 --groups gpt_base:compile=1 \\
        gpt_base:compile=max-autotune-no-cudagraphs

The step is built as the trainer builds it: ``build_model`` -> ``oelm_core.fast.apply(model, tc,
device)`` -> ``fast.make_step(model, configure_optimizer(model, tc, device), tc, device)`` (forward,
backward, clip, fused AdamW; bf16 autocast on CUDA, float32 on the CPU), ``tc`` a TrainConfig with
the variant's switches. ``reference`` is benchmarks/reference.py's nanoGPT-style GPT in that same
step (no fast path applies to it), compiled plainly and without a CUDA graph unless asked (as the
issue that asked for it defines it).

A variant is a group (a model variant, or ``reference``) with options after a colon, e.g.
``gpt_base:fused_logits=0,compile=1``:
  fused_loss, fused_logits, cuda_graph   0/1: that TrainConfig switch (default: on)
  compile     0/1: train.compile; or a torch.compile mode (max-autotune-no-cudagraphs, max-autotune,
              ...): train.compile with inductor set as that mode sets it, for the whole variant.
              max-autotune adds inductor's own GEMM autotuning; its CUDA graphs do not mix
              with the step's own (use cuda_graph=0 with it), the no-cudagraphs mode does
  chunk       train.loss_chunk_tokens
  pad         0/1, the reference only: its vocabulary padded to 50,304 rows as nanoGPT pads it
              (default 1)
``--compile 0 1`` times every variant that sets no compile of its own at each value; ``--off``
times every group but the reference once more with each named fast path off, one at a time. A
row's label is the variant as given, with what these add (``gpt_base:compile=1,fused_logits=0``; the
compile value only where --compile names several).

Each figure is the median of --blocks blocks of --steps steps after warm-up, timed with CUDA events
(on the CPU with the wall clock); peak memory is torch.cuda.max_memory_allocated over building,
compiling, capturing and the timed steps, less what was allocated before the variant began. The
JSON's ``applied`` says which fast paths actually ran (the fused logits GEMM only
where they run; cuda_graph whether the timed step replayed a graph), ``card_clocks`` the card's SM
clock and power over the timed blocks (``common.CardClocks``; None on a CPU). Prints a table last:
"x ref" is tokens/s against the reference at the same batch and compile setting, "vs on" the step
time against the same group with every fast path on (a fast path's gain is its "off" row's excess).
--json writes everything.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from common import (  # noqa: E402
    CardClocks,
    at_least,
    card_name,
    clocks_text,
    commit,
    free_between_runs,
    median,
    now,
    time_blocks,
)
from reference import ReferenceGPT, copy_from, reference_grads_as_model  # noqa: E402

from oelm_core import build_model, fast  # noqa: E402
from oelm_core.accounting import flops_per_token, peak_flops  # noqa: E402
from oelm_core.config import TrainConfig, model_config  # noqa: E402
from oelm_core.fast.loss import ChunkedOutputLoss  # noqa: E402
from oelm_core.step import configure_optimizer  # noqa: E402

FAST_PATHS = ("fused_loss", "fused_logits", "cuda_graph")
# A variant's options and, where the set is closed, their values (compile: 0, 1 or a torch.compile mode).
OPTIONS = {**{path: ("0", "1") for path in FAST_PATHS}, "compile": None, "chunk": None, "pad": ("0", "1")}
REFERENCE_OPTIONS = ("compile", "cuda_graph", "pad")


def compile_modes() -> list[str]:
    return [mode for mode in torch._inductor.list_mode_options() if mode != "default"]


def check_option(spec: str, group: str, k: str, val: str) -> None:
    """ValueError, naming ``spec``, unless ``k=val`` is an option ``group`` takes."""
    if k not in OPTIONS:
        raise ValueError(
            f"{spec}: unknown option {k!r}; a variant's options are "
            f"{', '.join(OPTIONS)} (e.g. gpt_base:fused_logits=0,compile=1)"
        )
    if not val:
        raise ValueError(f"{spec}: {k} needs a value ({k}=...)")
    if group == "reference" and k not in REFERENCE_OPTIONS:
        raise ValueError(
            f"{spec}: the reference takes only {', '.join(REFERENCE_OPTIONS)} (no fast path applies to it)"
        )
    if k == "pad" and group != "reference":
        raise ValueError(f"{spec}: pad is the reference's option")
    if OPTIONS[k] and val not in OPTIONS[k]:
        raise ValueError(f"{spec}: {k}={val} is not one of {'|'.join(OPTIONS[k])}")
    if k == "compile" and val not in ("0", "1", *compile_modes()):
        raise ValueError(f"{spec}: compile={val} is not 0, 1 or a torch.compile mode ({', '.join(compile_modes())})")
    if k == "chunk" and not (val.isdigit() and int(val) > 0):
        raise ValueError(f"{spec}: chunk={val} must be a positive integer (tokens per loss slice)")


def parse_variant(spec: str) -> dict:
    """``group:key=value,...`` -> {"group": ..., option: value}; ValueError names what is wrong."""
    group, _, opts = spec.partition(":")
    v = {"group": group}
    for item in filter(None, opts.split(",")):
        k, _, val = item.partition("=")
        check_option(spec, group, k, val)
        v[k] = val
    return v


def with_options(spec: str, **added: str) -> str:
    """``spec`` with ``added`` options appended: the label of an expanded variant."""
    extra = ",".join(f"{k}={val}" for k, val in added.items())
    if not extra:
        return spec
    return f"{spec}{',' if ':' in spec else ':'}{extra}"


def expand(specs: list[str], compiles: list[str], off: list[str]) -> list[dict]:
    """The variants to time, each with its label: each spec at each ``compiles`` value unless it
    sets compile (the label names the value where there are several), and each non-reference one
    again with each fast path of ``off`` switched off unless it sets that path."""
    for c in compiles:
        check_option("--compile", "", "compile", c)
    out = []
    for spec in specs:
        v = parse_variant(spec)
        for c in [v["compile"]] if "compile" in v else compiles:
            named = {} if "compile" in v or len(compiles) == 1 else {"compile": c}
            out.append({**v, "compile": c, "label": with_options(spec, **named)})
            if v["group"] != "reference":
                out += [
                    {**v, "compile": c, path: "0", "label": with_options(spec, **named, **{path: "0"})}
                    for path in off
                    if path not in v
                ]
    return out


def train_config(v: dict) -> TrainConfig:
    """The TrainConfig of variant ``v``: TrainConfig's defaults with the variant's options."""
    tc = TrainConfig()
    for path in FAST_PATHS:
        setattr(tc, path, bool(int(v.get(path, getattr(tc, path)))))
    tc.compile = v["compile"] != "0"
    if v["group"] == "reference":  # compiled plainly, no CUDA graph, unless asked
        tc.cuda_graph = bool(int(v.get("cuda_graph", 0)))
    if "chunk" in v:
        tc.loss_chunk_tokens = int(v["chunk"])
    return tc


def build(v: dict, tc: TrainConfig, preset: str, device):
    """(model config, model on ``device`` as the trainer builds it)."""
    if v["group"] == "reference":
        cfg = model_config(preset, "gpt_base")
        return cfg, ReferenceGPT(cfg, pad_vocab=bool(int(v.get("pad", 1)))).to(device)
    model = build_model(preset, v["group"]).to(device)
    return model.cfg, fast.apply(model, tc)


def applied(v: dict, tc: TrainConfig, model, step, device) -> dict:
    """Which fast paths ran in the timed steps (not only which were asked for)."""
    if v["group"] == "reference":
        return {"fused_loss": False, "fused_logits": False, "cuda_graph": replays_a_graph(step)}
    fused_loss = isinstance(model.output_loss, ChunkedOutputLoss)
    fused_logits = False
    if device.type == "cuda":
        from oelm_core.fast import logits_gemm

        fused_logits = (
            fused_loss
            and tc.fused_logits
            and logits_gemm.available(device, torch.bfloat16, model.cfg.d_model, model.cfg.padded_vocab_size)
        )
    return {
        "fused_loss": fused_loss,
        "fused_logits": bool(fused_logits),
        "cuda_graph": replays_a_graph(step),
    }


def replays_a_graph(step) -> bool:
    """Whether ``step`` replays a captured CUDA graph (``GraphStep.graph``; a plain step has none)."""
    return getattr(step, "graph", None) is not None


def inductor_mode(v: dict):
    """A context that sets inductor's options as the variant's torch.compile mode does."""
    if v["compile"] in ("0", "1"):
        return contextlib.nullcontext()
    import torch._inductor.config

    return torch._inductor.config.patch(torch._inductor.list_mode_options()[v["compile"]])


def bench_one(v: dict, batch: int, args, device) -> dict:
    torch.manual_seed(0)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()  # peak over build, compile, capture and the timed steps
        base_mem = torch.cuda.memory_allocated()  # held before this variant began: not its own
    graphs_before = dynamo_graphs()
    tc = train_config(v)
    t0 = time.perf_counter()
    cfg, model = build(v, tc, args.preset, device)
    step = fast.make_step(model, configure_optimizer(model, tc, device), tc, device, ddp=False)
    n_batches = 4
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, cfg.vocab_size, (batch, cfg.block_size + 1), generator=gen) for _ in range(n_batches)]
    xs = [d[:, :-1].contiguous() for d in data]
    ys = [d[:, 1:].contiguous() for d in data]
    if cuda:  # what a loader that never waits hands over: pinned host memory, copied asynchronously
        xs = [x.pin_memory() for x in xs]
        ys = [y.pin_memory() for y in ys]
    i, last = [0], [None]

    def one():
        k = i[0] % n_batches
        i[0] += 1
        x = xs[k].to(device, non_blocking=True)
        y = ys[k].to(device, non_blocking=True)
        last[0] = step([(x, y)], tc.lr, i[0])[0]

    for _ in range(3):  # compile, and (CUDA graph) warm up and capture
        one()
    if cuda:
        torch.cuda.synchronize()
    compile_s = time.perf_counter() - t0
    time_blocks(one, 1, args.warmup, cuda)
    with CardClocks(device) as clocks:
        secs = time_blocks(one, args.blocks, args.steps, cuda)
    loss = float(last[0].detach())
    graphs_after = dynamo_graphs()
    breakdown = profile(one, v, batch, args) if args.profile and cuda and v["label"] in args.profile else None
    s = median(secs)
    tokens = batch * cfg.block_size
    fpt = flops_per_token(cfg)["total"]
    peak = peak_flops(device) if cuda else None
    r = {
        "label": v["label"],
        "group": v["group"],
        "batch": batch,
        "tokens_per_step": tokens,
        "ms_per_step": 1000 * s,
        "tokens_per_s": tokens / s,
        "ms_min": 1000 * min(secs),
        "ms_max": 1000 * max(secs),
        "mfu": (tokens / s * fpt / peak) if peak else None,
        "flops_per_token": fpt,
        "peak_mem_gb": (torch.cuda.max_memory_allocated() - base_mem) / 2**30 if cuda else None,
        "compile_s": compile_s,
        "card_clocks": clocks.summary(),
        "loss": loss,
        "kernel_ms_per_step": breakdown,
        "dynamo_graphs": graphs_after - graphs_before if graphs_after is not None else None,
        "options": {k: v[k] for k in v if k != "label"},
        "train": {k: getattr(tc, k) for k in (*FAST_PATHS, "compile", "loss_chunk_tokens")},
        "applied": applied(v, tc, model, step, device),
    }
    step = model = last[0] = None  # the closure holds the step and the last loss: drop them first
    free_between_runs(cuda)
    return r


def dynamo_graphs():
    """Graphs torch.compile has captured in this process so far (None where torch does not count them)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return counters["stats"]["unique_graphs"]


def profile(one, v: dict, batch: int, args, steps: int = 3) -> dict:
    """GPU time per step by kernel family over ``steps`` steps; the profiler's table to --out-dir."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            one()
        torch.cuda.synchronize()
    events = prof.key_averages()
    table = events.table(sort_by="cuda_time_total", row_limit=45, max_name_column_width=80)
    name = f"profile_{v['label'].replace(':', '_').replace(',', '_').replace('=', '-')}_b{batch}.txt"
    with open(os.path.join(args.out_dir, name), "w") as f:
        f.write(table)
    return kernel_breakdown(events, steps)


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
        family = next(
            (name for name, pats in KERNEL_FAMILIES if any(p in key for p in pats)), "other elementwise and reductions"
        )
        out[family] += us / 1000 / steps
    out["total"] = sum(out.values())
    return out


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


def agreement(preset: str, device, batch: int = 4) -> dict:
    """Loss and gradients of one batch (``batch`` x block_size tokens, copied weights): the model
    with the fast paths ``fast.apply`` installs by default against the same model without them and
    against the reference, bf16 autocast on CUDA, float32 on the CPU."""
    out = {}
    torch.manual_seed(0)
    autocast = device.type == "cuda"
    for variant in ("gpt_base", "oelm_freeze"):
        fast_model = fast.apply(build_model(preset, variant).to(device), TrainConfig())
        plain = build_model(preset, variant).to(device)
        plain.load_state_dict(fast_model.state_dict())
        ref = copy_from(ReferenceGPT(fast_model.cfg).to(device), fast_model)
        t = fast_model.cfg.block_size
        x = torch.randint(0, fast_model.cfg.vocab_size, (batch, t), device=device)
        y = torch.randint(0, fast_model.cfg.vocab_size, (batch, t), device=device)
        losses, grads = {}, {}
        for name, m in (("fast", fast_model), ("plain", plain), ("reference", ref)):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = m(x, y)
            loss.backward()
            losses[name] = loss.item()
            grads[name] = (
                reference_grads_as_model(ref, fast_model)
                if name == "reference"
                else {n: p.grad for n, p in m.named_parameters()}
            )
        names = [n for n, _ in fast_model.named_parameters()]
        for other in ("plain", "reference"):
            out[f"{variant}: fast vs {other}"] = {
                "loss_abs_diff": abs(losses["fast"] - losses[other]),
                "max_grad_rel_diff": max(rel(grads["fast"][n], grads[other][n]) for n in names),
                "batch": batch,
                "block_size": t,
            }
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="medium512")
    ap.add_argument("--batch", type=at_least(1), nargs="+", default=[16, 64])
    ap.add_argument(
        "--groups",
        nargs="+",
        default=["reference", "gpt_base", "oelm_nofreeze", "oelm_freeze"],
        help="variants: a group (a model variant or 'reference') with options, e.g. gpt_base:fused_logits=0",
    )
    ap.add_argument(
        "--compile",
        nargs="+",
        default=["0"],
        help="train.compile for the variants that set none: 0, 1 or a torch.compile mode (several: each)",
    )
    ap.add_argument(
        "--off",
        nargs="*",
        default=[],
        choices=FAST_PATHS,
        help="also time every group but the reference with each of these fast paths off",
    )
    ap.add_argument("--steps", type=at_least(1), default=10, help="steps per timed block")
    ap.add_argument("--blocks", type=at_least(1), default=7, help="timed blocks (the median is reported)")
    ap.add_argument("--warmup", type=at_least(0), default=10, help="steps after compilation before timing")
    ap.add_argument("--check", action="store_true", help="print loss/grad agreement with the reference")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", nargs="*", default=[], help="variant labels to profile (CUDA kernel table)")
    ap.add_argument("--out-dir", default=".", help="where profile tables go")
    ap.add_argument("--cache-in", default=None, help="torch.compiler cache artifacts to load first")
    ap.add_argument("--cache-out", default=None, help="write torch.compiler cache artifacts here")
    args = ap.parse_args()
    try:  # every variant checked before anything runs
        variants = expand(args.groups, args.compile, args.off)
    except ValueError as e:
        ap.error(str(e))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    if args.cache_in and os.path.exists(args.cache_in):
        with open(args.cache_in, "rb") as f:
            torch.compiler.load_cache_artifacts(f.read())
    meta = {
        "card": card_name(device),
        "date": now(),
        "commit": commit(),
        "torch": torch.__version__,
        "command": " ".join(sys.argv),
        "preset": args.preset,
    }
    print(json.dumps(meta), flush=True)
    results, checks = [], {}
    if args.check:
        checks["bf16" if device.type == "cuda" else "float32"] = agreement(args.preset, device)
        print(json.dumps(checks, indent=1), flush=True)
    for batch in args.batch:
        for v in variants:
            try:
                with inductor_mode(v):
                    r = bench_one(dict(v), batch, args, device)
            except Exception as e:  # keep the other figures
                import traceback

                traceback.print_exc()
                r = {"label": v["label"], "group": v["group"], "batch": batch, "options": v, "error": repr(e)[:300]}
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


def _setting(r: dict) -> tuple:
    """What a row's fast paths are compared within: batch, compile and the options that are no fast path."""
    o = r["options"]
    return (r["batch"], o["compile"], o.get("chunk"))


def print_table(meta, results):
    ok = [r for r in results if "error" not in r]
    ref = {
        (r["batch"], r["options"]["compile"]): r["tokens_per_s"]
        for r in ok
        if r["group"] == "reference" and set(r["options"]) <= {"group", "compile"}
    }
    all_on = {
        (r["group"], _setting(r)): r["ms_per_step"]
        for r in ok
        if r["group"] != "reference" and not any(r["options"].get(p) == "0" for p in FAST_PATHS)
    }
    print(f"\n{meta['card']}  torch {meta['torch']}  {meta['date']}  commit {meta['commit']}  preset {meta['preset']}")
    print(
        f"{'variant':52s} {'batch':>5s} {'tok/s':>10s} {'ms/step':>8s} {'MFU':>6s} {'mem GB':>7s} "
        f"{'x ref':>6s} {'vs on':>6s} {'comp s':>6s}  card (clock, power; *: power-capped)"
    )
    for r in results:
        if "error" in r:
            print(f"{r['label']:52s} {r['batch']:5d}  ERROR {r['error'][:60]}")
            continue
        mfu = f"{100 * r['mfu']:5.1f}%" if r["mfu"] else "     -"
        mem = f"{r['peak_mem_gb']:7.2f}" if r["peak_mem_gb"] is not None else "      -"
        x = ref.get((r["batch"], r["options"]["compile"]))
        x = f"{r['tokens_per_s'] / x:6.2f}" if x else "     -"
        on = all_on.get((r["group"], _setting(r)))
        on = f"{r['ms_per_step'] / on:6.3f}" if on else "     -"
        print(
            f"{r['label']:52s} {r['batch']:5d} {r['tokens_per_s']:10.0f} {r['ms_per_step']:8.2f} {mfu} {mem} "
            f"{x} {on} {r['compile_s']:6.0f}  {clocks_text(r.get('card_clocks'))}"
        )
    profiled = [r for r in ok if r.get("kernel_ms_per_step")]
    if profiled:
        print("\nWhere a step's time goes (ms per step and share of the timed step; kernels from the CUDA profiler):")
        print(f"{'family':34s}" + "".join(f" {r['label'][:22]:>22s}" for r in profiled))
        for fam in step_shares(profiled[0]):
            cells = []
            for r in profiled:
                ms = step_shares(r)[fam]
                cells.append(f" {ms:12.2f} ({100 * ms / r['ms_per_step']:5.1f}%)")
            print(f"{fam:34s}" + "".join(cells))
        if all(r["mfu"] for r in profiled):
            print(f"{'MFU (6N + attention FLOPs)':34s}" + "".join(f" {100 * r['mfu']:21.1f}%" for r in profiled))


def step_shares(r: dict) -> dict:
    """A profiled row's kernel families (ms per step) and the rest of its timed step: the GPU idle
    between kernels (launch gaps, host work, waits), the timed step less the kernels' sum. Kernels
    on several streams may overlap; then the idle share is the lower bound 0."""
    kernels = {k: v for k, v in r["kernel_ms_per_step"].items() if k != "total"}
    return kernels | {"idle (step less kernels)": max(0.0, r["ms_per_step"] - r["kernel_ms_per_step"]["total"])}


if __name__ == "__main__":
    main()
