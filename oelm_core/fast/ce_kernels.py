"""The fused loss's CUDA kernels (Triton), behind ``oelm_core.fast.loss`` on GPUs.

Per slice of tokens: the logits GEMM over the padded vocabulary, one Triton pass
(``_ce_rows_kernel``) that turns the logits into the loss and, in place, the unnormalised
gradient, then the two gradient GEMMs; on Hopper in bf16, where switched on, the logits GEMM of
``oelm_core.fast.logits_gemm`` writes exp() from its accumulator instead of the first two.
``forward`` runs a batch of slices, ``scale_rows`` is the backward's pass. Imported only on CUDA
(it imports Triton); ``benchmarks/bench_ce.py`` and ``benchmarks/bench_loss.py`` time each piece.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from oelm_core.fast import logits_gemm

# How far above the offset (the target's logit) a logit may go in the kernel's one pass: E stays
# below e^30 (1e13) and S below 50,304 e^30 (5e17), far from overflow in the gradient GEMMs'
# float32 sums, and the row scale above 1/(n 5e17), far from underflow when it scales x in bf16.
_CE_HEADROOM = tl.constexpr(30.0)


@triton.jit
def _ce_rows_kernel(
    logits_ptr,
    stride,
    targets_ptr,
    loss_ptr,
    scale_ptr,
    inv_n_ptr,
    x_ptr,
    xs_ptr,
    d,
    vocab,
    padded,
    WRITE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One program per row of logits; loss = lse - logit[target] (0 where ignored).

    WRITE_GRAD: one pass over the row that also writes, in place, E = exp(logit - c) over all
    padded columns (0 past vocab) and E[target] = exp(logit[target] - c) - S, where
    S = sum(exp(logit - c)); then the row's ``scale`` = valid / n_valid / S and the row of
    x (d,) times it into ``xs``. E * scale is the gradient (softmax - one_hot) * valid / n_valid,
    so the weight gradient is E^T xs and the x gradient (E W) * scale (``forward``).
    The usual second read of the row, to normalise by a sum known only at its end, is gone.
    The offset c is the target's logit, so S >= 1. A logit more than _CE_HEADROOM above it
    (the row's loss is then above 30 nats: rare) is written as c - logit < 0 instead, and after
    the pass such a row is read and written once more with the offset at its max, whose own
    entry becomes exactly 1. An ignored row's offset is +inf: E = 0, no second pass.
    Every store covers whole blocks: one that skipped the target's column ran 3x slower.
    Not for float16, whose range E and S would leave (``oelm_core.fast.loss`` keeps it apart)."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    target = tl.load(targets_ptr + row)
    valid = target >= 0
    safe_t = tl.where(valid, target, 0)
    t_logit = tl.load(base + safe_t).to(tl.float32)
    cols0 = tl.arange(0, BLOCK)
    if WRITE_GRAD:
        c = tl.where(valid, t_logit, float("inf"))
        m = t_logit
        s = tl.full([], 0.0, tl.float32)
        for off in tl.range(0, padded, BLOCK):
            cols = off + cols0
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            m = tl.maximum(m, tl.max(x, 0))
            dist = x - c
            far = dist > _CE_HEADROOM
            e = tl.exp(tl.where(far, 0.0, dist))  # 0 past vocab, where dist = -inf
            s += tl.sum(tl.where(far, 0.0, e), 0)
            tl.store(base + cols, tl.where(far, -dist, e).to(logits_ptr.dtype.element_ty), mask=cols < padded)
        tl.debug_barrier()  # the stores above before the reads and the target's store below
        # A far logit (``far``'s own test, so the two agree): exp(logit - m) from what was written.
        if m - c > _CE_HEADROOM:
            shift = c - m
            # The max's entry as the pass stored it, so that it decodes to exactly 1.
            top = shift.to(logits_ptr.dtype.element_ty).to(tl.float32)
            s = tl.full([], 0.0, tl.float32)
            for off in tl.range(0, padded, BLOCK):
                cols = off + cols0
                v = tl.load(base + cols, mask=cols < padded, other=0.0).to(tl.float32)
                e = tl.where(v < 0, tl.exp(top - v), v * tl.exp(shift))
                s += tl.sum(e, 0)
                tl.store(base + cols, e.to(logits_ptr.dtype.element_ty), mask=cols < padded)
            tl.debug_barrier()
            c = m
        lse = c + tl.log(s)
        tl.store(base + safe_t, (tl.exp(t_logit - c) - s).to(logits_ptr.dtype.element_ty))
        scale = tl.where(valid, tl.load(inv_n_ptr) / s, 0.0)
        tl.store(scale_ptr + row, scale)
        dims = tl.arange(0, BLOCK_D)
        xr = tl.load(x_ptr + row * d + dims, mask=dims < d, other=0.0).to(tl.float32)
        tl.store(xs_ptr + row * d + dims, (xr * scale).to(xs_ptr.dtype.element_ty), mask=dims < d)
    else:  # the loss alone: the online log-sum-exp, one exp per logit
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.full([], 0.0, tl.float32)
        for off in tl.range(0, vocab, BLOCK):
            cols = off + cols0
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))  # finite from the first block on (vocab > 0)
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
            m = m_new
        lse = m + tl.log(s)
    tl.store(loss_ptr + row, tl.where(valid, lse - t_logit, 0.0))


@triton.jit
def _scale_rows_kernel(
    src_ptr, out_ptr, row_scale_ptr, factor_ptr, n_cols, ROW_SCALE: tl.constexpr, BLOCK: tl.constexpr
):
    """out[row] = src[row] * factor (* row_scale[row]), one program per row of contiguous
    tensors, computed in float32. (PyTorch's broadcasting multiply by a device
    scalar, or by a column of row scales with a dtype change, is not vectorised: 2-3x slower.)"""
    row = tl.program_id(0).to(tl.int64)
    factor = tl.load(factor_ptr).to(tl.float32)
    if ROW_SCALE:
        factor = factor * tl.load(row_scale_ptr + row)
    for off in tl.range(0, n_cols, BLOCK):
        cols = off + tl.arange(0, BLOCK)
        v = tl.load(src_ptr + row * n_cols + cols, mask=cols < n_cols).to(tl.float32)
        tl.store(out_ptr + row * n_cols + cols, (v * factor).to(out_ptr.dtype.element_ty), mask=cols < n_cols)


def scale_rows(
    src: torch.Tensor, factor: torch.Tensor, row_scale: Optional[torch.Tensor], dtype: torch.dtype
) -> torch.Tensor:
    """src (rows, cols) * factor (a one-element tensor) [* row_scale (rows,)], a new tensor of
    ``dtype``, by ``_scale_rows_kernel``; src is left as it is."""
    src = src.contiguous()
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    _scale_rows_kernel[(src.size(0),)](
        src,
        out,
        src if row_scale is None else row_scale,
        factor.reshape(1).float(),
        src.size(1),
        ROW_SCALE=row_scale is not None,
        BLOCK=512,
        num_warps=4,
    )
    return out


# False once torch has refused the mixed-dtype addmm (torch < 2.8): then never asked again.
_HAS_ADDMM_OUT_DTYPE = True


def _addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (float32) += a @ b for bf16/fp16 a, b: one GEMM accumulating in place where torch has
    the mixed-dtype addmm (CUDA, torch >= 2.8), else a low-precision product added in float32
    (slower: one more pass over the product; ``benchmarks/bench_ce.py`` times both). The weight
    gradient's float32 sum over the slices."""
    global _HAS_ADDMM_OUT_DTYPE
    if _HAS_ADDMM_OUT_DTYPE:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (TypeError, RuntimeError, NotImplementedError):
            _HAS_ADDMM_OUT_DTYPE = False
    acc += (a @ b).float()


def forward(
    x: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    vocab: int,
    chunk: int,
    dtype: torch.dtype,
    need_grad: bool,
    *,
    fused_logits: bool,
):
    """The fused loss's forward on CUDA: x (n, d), w (padded, d), targets (n,) as
    ``oelm_core.fast.loss.linear_cross_entropy`` takes them, computed in ``dtype`` (bf16, or
    float32 for tests) in slices of ``chunk`` rows.

    Per slice one matmul over the *padded* vocabulary (aligned for the tensor cores), one Triton
    pass that turns the logits into the loss and, in place, the unnormalised gradient E (each row
    read once, written once; see ``_ce_rows_kernel``), then the two gradient matmuls. Compared with
    full logits + F.cross_entropy under torch.compile this saves three passes over the (tokens x
    vocab) logits. The kernel's small programs (2,048 columns, 4 warps), many per SM, keep enough
    loads in flight to run at about the speed of a copy of the slice (``benchmarks/bench_ce.py``).
    Ignored rows (target -1) cost as much as the others: E is written and scaled by 0.
    ``fused_logits``: with gradients, bf16, on Hopper (``logits_gemm.available``) the matmul and
    that pass are one Triton GEMM that writes E from its accumulator.

    Returns (loss, grad_x, grad_w, row_scale): the mean loss (0-dim float32); grad_w = E^T
    (row_scale * x) (padded, d) is final, float32 (or ``dtype`` for a single slice); grad_x = E W
    (n, d) of ``dtype`` is still to be multiplied by row_scale (n,) float32, which the backward
    does in the pass that applies the incoming gradient. Without need_grad all but the loss are
    None."""
    n, padded = x.size(0), w.size(0)
    xc, wc = x.to(dtype).contiguous(), w.to(dtype)
    targets = targets.contiguous()
    n_valid = (targets >= 0).sum()
    inv_n = (1.0 / n_valid.clamp(min=1).float()).reshape(1)
    row_loss = torch.empty(n, dtype=torch.float32, device=x.device)
    grad_x = grad_w = row_scale = x_scaled = None
    if need_grad:
        grad_x = torch.empty((n, x.size(1)), dtype=dtype, device=x.device)
        row_scale = torch.empty(n, dtype=torch.float32, device=x.device)
        x_scaled = torch.empty_like(xc[:chunk])  # one slice's x times its row scales, reused
        if n > chunk:  # several slices: the weight gradient summed in float32
            grad_w = torch.zeros(w.shape, dtype=torch.float32, device=x.device)
    fused = need_grad and fused_logits and logits_gemm.available(x.device, dtype, x.size(1), padded)
    if fused:
        wc = wc.contiguous()
    for s in range(0, n, chunk):
        xs = xc[s : s + chunk]
        if fused:  # the logits never reach memory: E comes from the GEMM's epilogue
            logits = logits_gemm.loss_and_grad(
                xs,
                wc,
                targets[s : s + chunk],
                vocab,
                inv_n,
                row_loss[s : s + chunk],
                row_scale[s : s + chunk],
                x_scaled[: xs.size(0)],
            )
        else:
            logits = xs @ wc.T
            # Without need_grad, the pointers the kernel does not use are row_loss and xs.
            _ce_rows_kernel[(xs.size(0),)](
                logits,
                logits.stride(0),
                targets[s : s + chunk],
                row_loss[s:],
                row_loss if row_scale is None else row_scale[s:],
                inv_n,
                xs,
                xs if x_scaled is None else x_scaled,
                xs.size(1),
                vocab,
                padded,
                WRITE_GRAD=need_grad,
                BLOCK=2048,
                BLOCK_D=triton.next_power_of_2(xs.size(1)),
                num_warps=4,
            )
        if need_grad:
            torch.mm(logits, wc, out=grad_x[s : s + chunk])
            xs = x_scaled[: xs.size(0)]
            if n <= chunk:
                grad_w = logits.T @ xs
            else:
                _addmm_fp32_(grad_w, logits.T, xs)
    loss = row_loss.sum() / n_valid  # every target ignored: 0/0, NaN, as F.cross_entropy gives
    return loss, grad_x, grad_w, row_scale
