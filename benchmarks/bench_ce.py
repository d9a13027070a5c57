"""The fused loss's cross-entropy kernel (oelm_core.fast.ce_kernels._ce_rows_kernel) on one slice of logits.

    PYTHONPATH=. python benchmarks/bench_ce.py --rows 8192 --configs 2048x4 8192x32 --json ce.json

One slice of bf16 logits as the loss sees it (--rows x 50,304 padded columns, 50,257 real). Timed:
the memory roofline on that slice (a copy: one read, one write; a float32 sum: one read); the kernel
with WRITE_GRAD for each BLOCKxnum_warps config, at GB/s counting its two passes over the slice
(one read, one write), each run on a fresh copy of the logits (the kernel works in place, and what
it leaves is no longer logits) and checked against float32 torch; and the output layer's
weight-gradient accumulation for the slice, bf16 matmul + float add vs ce_kernels._addmm_fp32_;
and the slice's whole forward, torch's GEMM + the kernel against the fused logits GEMM
(oelm_core.fast.logits_gemm; switch train.fused_logits), from x and w.
Each figure is the median of --reps CUDA-event timings after 3 warm-up runs. CUDA and Triton only.
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

from oelm_core.config import ModelConfig, TrainConfig  # noqa: E402

# The default model's output layer (medium512: 50,257 tokens padded to 50,304 rows of 512).
_DEFAULT = ModelConfig()
VOCAB, PADDED, D_MODEL = _DEFAULT.vocab_size, _DEFAULT.padded_vocab_size, _DEFAULT.d_model


def make_slice(rows: int, device):
    g = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(rows, PADDED, device=device, generator=g) * 3).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (rows,), device=device, generator=g)
    targets[::7] = -1
    inv_n = (1.0 / (targets >= 0).sum().float()).reshape(1)
    return logits, targets, inv_n


def run_kernel(logits, targets, inv_n, loss, scale, x, x_scaled, block: int, warps: int):
    """The kernel on one slice; x (rows, d_model) is the output layer's input it scales into x_scaled."""
    from oelm_core.fast import ce_kernels

    ce_kernels._ce_rows_kernel[(logits.size(0),)](
        logits,
        logits.stride(0),
        targets,
        loss,
        scale,
        inv_n,
        x,
        x_scaled,
        D_MODEL,
        VOCAB,
        PADDED,
        WRITE_GRAD=True,
        BLOCK=block,
        BLOCK_D=ce_kernels.triton.next_power_of_2(D_MODEL),
        num_warps=warps,
    )


def reference(logits, targets, inv_n):
    """Float32 torch: loss per row (0 where ignored) and (softmax - one_hot) * valid * inv_n."""
    x = logits[:, :VOCAB].float()
    valid, safe = targets >= 0, targets.clamp(min=0)
    lse = torch.logsumexp(x, 1)
    loss = torch.where(valid, lse - x.gather(1, safe[:, None])[:, 0], 0.0)
    grad = torch.softmax(x, 1)
    grad[torch.arange(len(targets), device=x.device), safe] -= 1.0
    return loss, grad.mul_(valid[:, None] * inv_n)


def check(logits, targets, inv_n, ref, block: int, warps: int) -> dict:
    """The kernel's loss, and its gradient E * row scale (``_ce_rows_kernel``), against float32."""
    ref_loss, ref_grad = ref
    out = logits.clone()
    loss, scale = (torch.empty(len(targets), device=logits.device) for _ in range(2))
    x = torch.randn(len(targets), D_MODEL, device=logits.device, dtype=logits.dtype)
    x_scaled = torch.empty_like(x)
    run_kernel(out, targets, inv_n, loss, scale, x, x_scaled, block, warps)
    grad = out[:, :VOCAB].float().mul_(scale[:, None])
    return {
        "loss_err": float((loss - ref_loss).abs().max()),
        "grad_err": float((grad - ref_grad).abs().max() / ref_grad.abs().max()),
        "pad_zero": bool((out[:, VOCAB:] == 0).all()),
        "x_scaled_err": float((x_scaled.float() - x.float() * scale[:, None]).abs().max()),
    }


def time_ms(fn, reps: int, restore=None) -> float:
    """Median ms of ``fn()``; ``restore()``, if given, runs before each call, outside the timing."""
    times = []
    for i in range(3 + reps):  # 3 warm-up runs (and Triton's compile for a new config)
        if restore is not None:
            restore()
        secs = time_blocks(fn, 1, 1, cuda=True)
        if i >= 3:
            times += secs
    return 1000 * median(times)


def config(spec: str) -> tuple[int, int]:
    block, _, warps = spec.partition("x")
    return int(block), int(warps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--rows",
        type=int,
        default=TrainConfig.loss_chunk_tokens,
        help="tokens in the slice (default: train.loss_chunk_tokens, the loss's slice)",
    )
    ap.add_argument(
        "--configs",
        nargs="+",
        default=["2048x4", "8192x32", "1024x2", "4096x4", "2048x8"],
        help="BLOCKxnum_warps; 2048x4 is what ce_kernels.forward uses, 8192x32 the previous setting",
    )
    ap.add_argument("--reps", type=at_least(1), default=20, help="timed runs per figure (the median is reported)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_ce: no CUDA device; the kernel it times runs on CUDA only. Nothing to do.")
        return
    try:
        from oelm_core.fast import ce_kernels
    except ImportError:
        print("bench_ce: Triton is not installed, so the fused loss has no cross-entropy kernel. Nothing to do.")
        return
    meta = {
        "card": card_name(),
        "date": now(),
        "commit": commit(),
        "torch": torch.__version__,
        "triton": ce_kernels.triton.__version__,
        "command": " ".join(sys.argv),
        "rows": args.rows,
    }
    print(json.dumps(meta), flush=True)

    logits, targets, inv_n = make_slice(args.rows, "cuda")
    gb = logits.numel() * logits.element_size() / 1e9
    other = torch.empty_like(logits)
    copy_ms = time_ms(lambda: other.copy_(logits), args.reps)
    sum_ms = time_ms(lambda: torch.sum(logits, dtype=torch.float32), args.reps)
    roofline = {
        "slice_gb": gb,
        "copy_ms": copy_ms,
        "copy_gbs": 2 * gb / copy_ms * 1e3,
        "sum_ms": sum_ms,
        "sum_gbs": gb / sum_ms * 1e3,
    }

    ref = reference(logits, targets, inv_n)
    work = logits.clone()
    loss, scale = (torch.empty(args.rows, device="cuda") for _ in range(2))
    x = torch.randn(args.rows, D_MODEL, device="cuda", dtype=torch.bfloat16)
    x_scaled = torch.empty_like(x)
    kernel = []
    for block, warps in map(config, args.configs):
        ms = time_ms(
            lambda: run_kernel(work, targets, inv_n, loss, scale, x, x_scaled, block, warps),
            args.reps,
            restore=lambda: work.copy_(logits),
        )
        kernel.append(
            {
                "block": block,
                "num_warps": warps,
                "ms": ms,
                "gbs": 2 * gb / ms * 1e3,
                "x_copy": ms / copy_ms,
                **check(logits, targets, inv_n, ref, block, warps),
            }
        )
    del ref  # 3.3 GB of float32 reference at 8,192 rows

    x = torch.randn(args.rows, D_MODEL, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(PADDED, D_MODEL, device="cuda")
    plain_ms = time_ms(lambda: acc.add_((logits.T @ x).float()), args.reps)
    fused_ms = time_ms(lambda: ce_kernels._addmm_fp32_(acc, logits.T, x), args.reps)
    acc.zero_()
    ce_kernels._addmm_fp32_(acc, logits.T, x)
    exact = logits.T.float() @ x.float()
    dw = {
        "bf16_mm_float_add_ms": plain_ms,
        "addmm_fp32_ms": fused_ms,
        "addmm_fp32_rel_err": float((acc - exact).norm() / exact.norm()),
        # False: this torch lacks the mixed-dtype addmm and _addmm_fp32_ fell back to (a).
        "mixed_dtype_addmm": ce_kernels._HAS_ADDMM_OUT_DTYPE,
    }

    forward = forward_paths(args.rows, args.reps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "roofline": roofline, "kernel": kernel, "dw": dw, "forward": forward}, f, indent=1)
    print_tables(meta, roofline, kernel, dw, forward)


def forward_paths(rows: int, reps: int) -> dict:
    """The slice's forward as the training step runs it, from x (rows, d) and w (padded, d) to E, the
    loss and the row scales: torch's GEMM + ``_ce_rows_kernel`` against the fused logits GEMM
    (``oelm_core.fast.logits_gemm``), with the GEMM alone for scale, and the two paths' agreement."""
    from oelm_core.fast import logits_gemm

    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(rows, D_MODEL, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(PADDED, D_MODEL, device="cuda", generator=g) * 0.1).to(torch.bfloat16)
    targets = torch.randint(0, VOCAB, (rows,), device="cuda", generator=g)
    targets[::7] = -1
    inv_n = (1.0 / (targets >= 0).sum().float()).reshape(1)
    loss, scale = (torch.empty(rows, device="cuda") for _ in range(2))
    x_scaled = torch.empty_like(x)

    def gemm():
        return x @ w.T

    def split():
        logits = gemm()
        run_kernel(logits, targets, inv_n, loss, scale, x, x_scaled, 2048, 4)
        return logits

    out = {"gemm_ms": time_ms(gemm, reps), "gemm_and_kernel_ms": time_ms(split, reps)}
    if not logits_gemm.available(x.device, x.dtype, D_MODEL, PADDED):
        return out

    def fused():
        return logits_gemm.loss_and_grad(x, w, targets, VOCAB, inv_n, loss, scale, x_scaled)

    out["fused_ms"] = time_ms(fused, reps)
    grad_a = split()[:, :VOCAB].float().mul_(scale[:, None])
    loss_a = loss.clone()
    grad_b = fused()[:, :VOCAB].float().mul_(scale[:, None])
    out |= {
        "loss_diff": float((loss - loss_a).abs().max()),
        "grad_rel_diff": float((grad_b - grad_a).norm() / grad_a.norm()),
    }
    return out


def print_tables(meta, roofline, kernel, dw, forward):
    r = roofline
    print(f"\n{meta['card']}  torch {meta['torch']}  triton {meta['triton']}  {meta['date']}  commit {meta['commit']}")
    print(
        f"slice {meta['rows']} x {PADDED} bf16 ({r['slice_gb']:.2f} GB): copy {r['copy_ms']:.3f} ms "
        f"({r['copy_gbs']:.0f} GB/s), float32 sum {r['sum_ms']:.3f} ms ({r['sum_gbs']:.0f} GB/s)"
    )
    print(
        f"\n{'BLOCK x warps':>13s} {'ms':>7s} {'GB/s':>6s} {'x copy':>6s} {'loss err':>9s} {'grad err':>9s}"
        f" {'pad 0':>5s}"
    )
    for k in kernel:
        print(
            f"{k['block']:>8d} x {k['num_warps']:<2d} {k['ms']:7.3f} {k['gbs']:6.0f} {k['x_copy']:6.2f} "
            f"{k['loss_err']:9.2e} {k['grad_err']:9.2e} {'yes' if k['pad_zero'] else 'NO':>5s}"
        )
    print(
        f"\ndW += logits.T @ x ({PADDED} x {D_MODEL} float32): "
        f"bf16 mm + float add {dw['bf16_mm_float_add_ms']:.3f} ms, "
        f"_addmm_fp32_ {dw['addmm_fp32_ms']:.3f} ms (rel err {dw['addmm_fp32_rel_err']:.1e}"
        f"{'' if dw['mixed_dtype_addmm'] else ', fell back to bf16 mm + add'})"
    )
    f = forward
    print(
        f"\nforward, x ({meta['rows']} x {D_MODEL}) to E, loss and row scales: GEMM alone {f['gemm_ms']:.3f} ms, "
        f"GEMM + loss kernel {f['gemm_and_kernel_ms']:.3f} ms"
        + (
            f", fused logits GEMM {f['fused_ms']:.3f} ms (loss diff {f['loss_diff']:.1e}, "
            f"gradient rel. diff {f['grad_rel_diff']:.1e})"
            if "fused_ms" in f
            else ", no fused logits GEMM here"
        )
    )


if __name__ == "__main__":
    main()
