"""Tables for benchmarks/RESULTS.md from the JSON files run_all.sh writes.

    python benchmarks/make_results.py OUT_DIR [DDP_DIR]   # prints Markdown
"""
import json
import sys
from pathlib import Path


def load(path):
    p = Path(path)
    return json.loads(p.read_text()) if p.exists() else None


def context(rows):
    """Tokens per sequence of a bench_train.py run (one preset a file); 512 (medium512) where unknown."""
    return next((r["tokens_per_step"] // r["batch"] for r in rows if r.get("tokens_per_step")), 512)


def train_table(d):
    rows = [r for r in d["results"] if "error" not in r]
    ref = {r["batch"]: r["tokens_per_s"] for r in rows if r["label"] == "reference"}
    base = {r["batch"]: r["tokens_per_s"] for r in rows if r["label"] == "gpt_base"}
    out = [f"Card: **{d['meta']['card']}**, torch {d['meta']['torch']}, {d['meta']['date']}, commit `{d['meta']['commit']}`", "",
           f"| variant | batch x {context(rows)} | tokens/s | ms/step | MFU | peak mem (GiB) | x reference | x GPT-Base |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "-"
        mem = f"{r['peak_mem_gb']:.2f}" if r.get("peak_mem_gb") is not None else "-"
        x = f"{r['tokens_per_s'] / ref[r['batch']]:.2f}" if r["batch"] in ref else "-"
        xb = f"{r['tokens_per_s'] / base[r['batch']]:.3f}" if r["batch"] in base else "-"
        out.append(f"| {r['label']} | {r['batch']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.2f} | {mfu} | {mem} | {x} | {xb} |")
    for kind, checks in d.get("checks", {}).items():
        # Files written before agreement() recorded its shape all checked 4 x 512 (medium512).
        first = next(iter(checks.values()))
        shape = f"{first.get('batch', 4)} x {first.get('block_size', 512)}"
        out += ["", f"Agreement with copied weights ({kind}, one batch of {shape}):", "",
                "| comparison | abs. loss difference | max relative gradient difference |", "|---|---:|---:|"]
        for name, c in checks.items():
            out.append(f"| {name} | {c['loss_abs_diff']:.2e} | {c['max_grad_rel_diff']:.2e} |")
    return "\n".join(out)


def breakdown_table(d):
    rows = [r for r in d["results"] if r.get("kernel_ms_per_step")]
    if not rows:
        return ""
    out = [f"GPU time per step by kernel family, ms (CUDA profiler, 3 steps; **{d['meta']['card']}**, "
           f"commit `{d['meta']['commit']}`):", "",
           "| kernel family | " + " | ".join(f"{r['label']} ({r['batch']} x {context(rows)})" for r in rows) + " |",
           "|---|" + "---:|" * len(rows)]
    for fam in rows[0]["kernel_ms_per_step"]:
        out.append(f"| {fam} | " + " | ".join(f"{r['kernel_ms_per_step'][fam]:.2f}" for r in rows) + " |")
    return "\n".join(out)


def gen_table(d):
    """bench_generate.py's rows: per preset and sampling setting, every path, with what the fast
    decoder saves of each one's generation time."""
    rows = d["results"]
    out = [f"Device: **{d['meta']['card']}** ({d['meta']['device']}), {d['meta']['date']}, commit "
           f"`{d['meta']['commit']}`, {rows[0].get('dtype', 'float32')}", "",
           "| preset | sampling | path | decoder | step | sampler | new tokens | time to first token (ms) "
           "| ms/token | tokens/s | fast decoder saves |",
           "|---|---|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        fast = next((q for q in rows if q["preset"] == r["preset"] and q["sampling"] == r["sampling"]
                     and q["path"] == "fast"), None)
        saves = "" if fast is None or r is fast else f"{1 - r['tokens_per_s'] / fast['tokens_per_s']:.1%}"
        out.append(f"| {r['preset']} | {r['sampling']} | {r['path']} | {r['decoder']} | {r['step']} | "
                   f"{r['sampler']} | {r['new_tokens']} | {r['ttft_ms']:.1f} | {r['decode_ms_per_token']:.3f} | "
                   f"{r['tokens_per_s']:,.0f} | {saves} |")
    return "\n".join(out)


def sample_table(d):
    out = [f"Card: **{d['meta']['card']}**, {d['meta']['date']}, commit `{d['meta']['commit']}` (one draw "
           f"over 50,257 logits, 16 draws per CUDA graph)", "",
           "| temperature | top-k | top-p | torch ops (us) | Triton kernels (us) | speed-up | same token |",
           "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in d["results"]:
        out.append(f"| {r['temperature']} | {r['top_k'] or 'off'} | {r['top_p'] if r['top_p'] < 1 else 'off'} | "
                   f"{r['torch_us']:.1f} | {r['triton_us']:.1f} | {r['torch_us'] / r['triton_us']:.1f}x | "
                   f"{r['agree_of_256']}/256 |")
    return "\n".join(out)


def ddp_table(paths):
    rows = []
    meta = None
    for p in paths:
        d = load(p)
        if d:
            rows += d["results"]
            meta = meta or d["meta"]
    if not rows:
        return "(not run)"
    # The one-GPU step without accumulation: what one process runs at that micro-batch.
    one = {(r.get("impl"), r["group"], r["batch_per_gpu"]): r["tokens_per_s"]
           for r in rows if r["world"] == 1 and r.get("grad_accum", 1) == 1}
    out = [f"Card: **{meta['card']}**, {meta['date']}", "",
           "| step | gradients by | group | batch/GPU | micro-steps | GPUs | tokens/s (all GPUs) | ms/step | efficiency |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        b = one.get((r.get("impl"), r["group"], r["batch_per_gpu"]))
        eff = f"{100 * r['tokens_per_s'] / (r['world'] * b):.1f}%" if b else "-"
        out.append(f"| {r.get('impl', '-')} | {r.get('reducer', '-')} | {r['group']} | {r['batch_per_gpu']} | "
                   f"{r.get('grad_accum', 1)} | {r['world']} | {r['tokens_per_s']:,.0f} | {r['ms_per_step']:.2f} | {eff} |")
    out += ["", "Efficiency: tokens/s over GPUs x tokens/s of the same step on one GPU (for `trainer`, "
            "the plain step one process runs, one micro-step)."]
    return "\n".join(out)


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for name in ("train.json", "train_extra.json", "train_profile.json"):
        if load(out / name):
            print(train_table(load(out / name)), "\n")
            print(breakdown_table(load(out / name)), "\n")
    for name in ("generate.json", "generate_cpu.json"):
        if load(out / name):
            print(gen_table(load(out / name)), "\n")
    if load(out / "sample.json"):
        print(sample_table(load(out / "sample.json")), "\n")
    if len(sys.argv) > 2:
        ddp = Path(sys.argv[2])
        print(ddp_table(sorted(ddp.glob("ddp*.json"))))
