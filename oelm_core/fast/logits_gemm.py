"""The output layer's logits GEMM with the cross-entropy's exponentials in its epilogue (Triton, TMA).

The fused loss (``oelm_core.fast.ce_kernels.forward``) needs, per slice of n tokens, the
unnormalised gradient E = exp(logit - c) over the padded vocabulary, c being each row's offset, and
each row's sum S of it. Otherwise cuBLAS writes the (n, V) logits and ``ce_kernels._ce_rows_kernel``
reads them back to write E: one more read and write of a 0.8 GB slice. Here one GEMM writes E from
its float32 accumulator, so the logits never reach memory (and are never rounded to bf16 first):

1. ``_target_logit_kernel``: c = x . w[target] per row, the target's logit, known before the GEMM
   (+inf for an ignored row: E = 0). So S >= 1, as in ``_ce_rows_kernel``.
2. ``_logits_exp_kernel``: E = exp(x w^T - c) in bf16 (0 past the vocabulary), tile by tile, each
   tile's row sums in float32 beside it (``part``, n x column tiles: deterministic, no atomics).
3. ``_finish_kernel``: S = the sum of the row's parts; then what ``_ce_rows_kernel`` does at the end of
   its row: loss = log S, E[target] = 1 - S, the row scale valid / n_valid / S and x times it.
   A row with S above e^30 has a logit more than ~30 nats above the target's (its loss is above 30
   nats: rare), and E there would leave the range that the gradient GEMMs sum safely. It is redone
   with the offset at its max: rescaled from what the GEMM stored while S < 3e38 (so that every
   stored bf16 entry is finite: logits up to ~88 nats above the target's), else recomputed from x
   and w (two passes over w, milliseconds a row: only for rows whose loss exceeds ~88 nats).

Hopper and datacenter Blackwell (TMA descriptors, ~210 KB of shared memory a program), bf16,
Triton >= 3.4 (measured with 3.6): ``available``. Switch: ``train.fused_logits`` (with
``train.fused_loss``). Timings against cuBLAS's GEMM and the loss kernel, alone
(``benchmarks/bench_ce.py``) and in the training step: benchmarks/README.md.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU-only installs: imported by tests, which then skip (available() is False)
    triton = None
# Host tensor descriptors and flattened persistent loops (tl.range(..., flatten=True)) need 3.4.
_TRITON_OK = triton is not None and tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 4)

# Tiles of the GEMM (rows x columns x depth), its pipeline depth and warps: the fastest of a sweep of
# 16 on an H200 at 8,192 x 50,304 x 512.
BLOCK_M, BLOCK_N, BLOCK_K, STAGES, WARPS = 128, 256, 64, 3, 8
# A row whose sum of exp(logit - target's logit) exceeds e^HEADROOM is redone with the offset at its
# max; from its stored entries while the sum is below RESCALE_MAX (under bf16's largest finite value,
# 3.39e38, so that no entry rounded to inf), else from x and w.
HEADROOM = 30.0
RESCALE_MAX = 3.0e38
# What the tiles above need of a program's shared memory (the pipeline's 3 stages of x and w, 144 KB,
# and the bf16 tile of E, 64 KB): Hopper's and datacenter Blackwell's 227 KB, not the 99 KB of
# consumer Blackwell (sm_120).
_SMEM_NEEDED = 216 * 1024

_SMS: dict = {}


def available(device: torch.device, dtype: torch.dtype, d_model: int, padded_vocab: int) -> bool:
    """Whether the fused GEMM runs here: CUDA with TMA (compute capability 9+) and the shared memory
    of its tiles, Triton >= 3.4, bf16, rows of 16-byte multiples. Where it does not (or
    ``train.fused_logits`` is off) the loss runs the logits GEMM and ``ce_kernels._ce_rows_kernel``."""
    if not (
        _TRITON_OK and device.type == "cuda" and dtype == torch.bfloat16 and d_model % 8 == 0 and padded_vocab % 8 == 0
    ):
        return False
    props = torch.cuda.get_device_properties(device)
    return props.major >= 9 and getattr(props, "shared_memory_per_block_optin", 0) >= _SMEM_NEEDED


if triton is not None:
    _LOG2E = tl.constexpr(1.4426950408889634)
    _S_MAX = tl.constexpr(math.exp(HEADROOM))
    _RESCALE_MAX = tl.constexpr(RESCALE_MAX)

    @triton.jit
    def _target_logit_kernel(x_ptr, w_ptr, targets_ptr, c_ptr, n, d, vocab, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
        """c[row] = x[row] . w[target[row]] in float32, +inf where the target is negative (ignored) or
        past the vocabulary (never read: no loss, no gradient)."""
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        t = tl.load(targets_ptr + rows, mask=rows < n, other=-1)
        valid = (t >= 0) & (t < vocab)
        dims = tl.arange(0, BLOCK_D)
        xr = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * d + dims[None, :],
            mask=(rows < n)[:, None] & (dims < d)[None, :],
            other=0.0,
        )
        wr = tl.load(
            w_ptr + tl.where(valid, t, 0)[:, None].to(tl.int64) * d + dims[None, :],
            mask=valid[:, None] & (dims < d)[None, :],
            other=0.0,
        )
        c = tl.sum(xr.to(tl.float32) * wr.to(tl.float32), 1)
        tl.store(c_ptr + rows, tl.where(valid, c, float("inf")), mask=rows < n)

    @triton.jit
    def _logits_exp_kernel(
        x_desc,
        w_desc,
        e_desc,
        c_ptr,
        part_ptr,
        n,
        d,
        vocab,
        col_tiles,
        programs,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        """E = exp(x w^T - c[:, None]) (n, padded) and part[row, tile] = the tile's row sums.

        Persistent: ``programs`` programs (one per SM) walk the tiles; the row tiles of one column
        tile come one after another, so each (BN, d) block of w is read from HBM once and x (8 MB)
        stays in L2.
        Past the vocabulary E = 0; beyond ~e^88.7 it is inf in bf16 (``_finish_kernel`` then
        recomputes the row: its S is at least 3e38)."""
        row_tiles = tl.cdiv(n, BM)
        for tile in tl.range(tl.program_id(0), row_tiles * col_tiles, programs, flatten=True):
            off_m = (tile % row_tiles) * BM
            col_tile = tile // row_tiles
            off_n = col_tile * BN
            acc = tl.zeros((BM, BN), tl.float32)
            for k in range(0, d, BK):
                acc = tl.dot(x_desc.load([off_m, k]), w_desc.load([off_n, k]).T, acc)
            rows = off_m + tl.arange(0, BM)
            c = tl.load(c_ptr + rows, mask=rows < n, other=float("inf"))
            e = tl.exp2(acc * _LOG2E - (c * _LOG2E)[:, None])
            if off_n + BN > vocab:  # only the last column tile holds padding: the test costs once
                e = tl.where((off_n + tl.arange(0, BN))[None, :] < vocab, e, 0.0)
            e_desc.store([off_m, off_n], e.to(e_desc.dtype))
            tl.store(part_ptr + rows * col_tiles + col_tile, tl.sum(e, 1), mask=rows < n)

    @triton.jit
    def _logits_of_row(w_ptr, xr, cols, dims, d, vocab):
        """x_row . w[cols] in float32 for a block of columns, -inf past the vocabulary."""
        wb = tl.load(
            w_ptr + cols[:, None].to(tl.int64) * d + dims[None, :],
            mask=(cols < vocab)[:, None] & (dims < d)[None, :],
            other=0.0,
        )
        return tl.where(cols < vocab, tl.sum(wb.to(tl.float32) * xr[None, :], 1), float("-inf"))

    @triton.jit
    def _finish_kernel(
        e_ptr,
        part_ptr,
        col_tiles,
        targets_ptr,
        c_ptr,
        x_ptr,
        w_ptr,
        d,
        vocab,
        padded,
        loss_ptr,
        scale_ptr,
        inv_n_ptr,
        xs_ptr,
        BLOCK_T: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """One program per row: S from the parts, the loss, E[target] = exp(-shift) - S (shift: the
        offset's move, 0 unless redone), the row scale and x times it (what ``ce_kernels._ce_rows_kernel``
        does at the end of a row); a counted row with S > e^HEADROOM (or a NaN) is first redone with
        the offset at its max. E is (n, padded) contiguous."""
        row = tl.program_id(0).to(tl.int64)
        base = e_ptr + row * padded
        target = tl.load(targets_ptr + row)
        valid = (target >= 0) & (target < vocab)  # (an id past the vocabulary must not write past E's row)
        j = tl.arange(0, BLOCK_T)
        s = tl.sum(tl.load(part_ptr + row * col_tiles + j, mask=j < col_tiles, other=0.0), 0)
        dims = tl.arange(0, BLOCK_D)
        xr = tl.load(x_ptr + row * d + dims, mask=dims < d, other=0.0).to(tl.float32)
        shift = 0.0  # (the row's offset) - (the target's logit): the loss is shift + log S
        if valid & ((s > _S_MAX) | (s != s)):
            cols0 = tl.arange(0, BLOCK)
            if s < _RESCALE_MAX:  # every stored entry (<= S) finite in bf16: rescale them by 1 / their max
                top = tl.full([], 0.0, tl.float32)
                for off in tl.range(0, padded, BLOCK):
                    v = tl.load(base + off + cols0, mask=off + cols0 < padded, other=0.0).to(tl.float32)
                    top = tl.maximum(top, tl.max(v, 0))
                shift = tl.log(top)
                s = tl.full([], 0.0, tl.float32)
                for off in tl.range(0, padded, BLOCK):
                    cols = off + cols0
                    v = tl.load(base + cols, mask=cols < padded, other=0.0).to(tl.float32)
                    e = v / top  # the max's entry: 1 to an ulp of float32, exactly 1 once stored in bf16
                    s += tl.sum(e, 0)
                    tl.store(base + cols, e.to(e_ptr.dtype.element_ty), mask=cols < padded)
            else:  # logits ~88 nats beyond the target's (or not finite): recompute them from x and w
                vcols0 = tl.arange(0, BLOCK_V)
                m = tl.full([], float("-inf"), tl.float32)
                for off in tl.range(0, vocab, BLOCK_V):
                    m = tl.maximum(m, tl.max(_logits_of_row(w_ptr, xr, off + vcols0, dims, d, vocab), 0))
                s = tl.full([], 0.0, tl.float32)
                for off in tl.range(0, padded, BLOCK_V):
                    cols = off + vcols0
                    e = tl.exp(_logits_of_row(w_ptr, xr, cols, dims, d, vocab) - m)  # 0 past vocab
                    s += tl.sum(e, 0)
                    tl.store(base + cols, e.to(e_ptr.dtype.element_ty), mask=cols < padded)
                shift = m - tl.load(c_ptr + row)
            tl.debug_barrier()  # the row's stores above before the target's store below
        tl.store(loss_ptr + row, tl.where(valid, shift + tl.log(s), 0.0))
        if valid:
            tl.store(base + target, (tl.exp(-shift) - s).to(e_ptr.dtype.element_ty))
        scale = tl.where(valid, tl.load(inv_n_ptr) / s, 0.0)
        tl.store(scale_ptr + row, scale)
        tl.store(xs_ptr + row * d + dims, (xr * scale).to(xs_ptr.dtype.element_ty), mask=dims < d)


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # Triton's CPU interpreter (tests): two programs walk the tiles
        return 2
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def loss_and_grad(
    x: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    vocab: int,
    inv_n: torch.Tensor,
    row_loss: torch.Tensor,
    row_scale: torch.Tensor,
    x_scaled: torch.Tensor,
) -> torch.Tensor:
    """One slice of the loss: x (n, d) and w (padded, d) contiguous, of one dtype, 16-byte aligned, d
    and padded multiples of 8; targets (n,) token ids in [0, vocab) (the real vocabulary: columns past
    it get E = 0) or negative (ignored; so is an id >= vocab, which the trainer never feeds); inv_n (1,)
    float32 = 1 / valid tokens of the whole batch.

    Returns E (n, padded) in x's dtype, and fills row_loss (n,) float32 (0 where ignored), row_scale
    (n,) float32 and x_scaled (n, d) = x * row_scale: E * row_scale[:, None] is the gradient of the
    mean loss with respect to the logits, (softmax - one_hot) * valid * inv_n, as with
    ``ce_kernels._ce_rows_kernel``."""
    n, d = x.shape
    padded = w.size(0)
    device = x.device
    if not (
        x.is_contiguous()
        and w.is_contiguous()
        and x.dtype == w.dtype
        and d % 8 == 0
        and padded % 8 == 0
        and x.data_ptr() % 16 == 0
        and w.data_ptr() % 16 == 0
    ):
        raise ValueError(
            f"logits_gemm.loss_and_grad: x {tuple(x.shape)} and w {tuple(w.shape)} must be contiguous, "
            f"of one dtype, 16-byte aligned, with d and the padded vocabulary multiples of 8 "
            f"(TMA's rules); check logits_gemm.available first"
        )
    e = torch.empty((n, padded), dtype=x.dtype, device=device)
    c = torch.empty(n, dtype=torch.float32, device=device)
    col_tiles = triton.cdiv(padded, BLOCK_N)
    part = torch.empty((n, col_tiles), dtype=torch.float32, device=device)
    block_d = triton.next_power_of_2(d)
    rows = max(1, 4096 // block_d)  # two (rows, d) float32 tiles in 4 warps' registers
    _target_logit_kernel[(triton.cdiv(n, rows),)](
        x, w, targets, c, n, d, vocab, ROWS=rows, BLOCK_D=block_d, num_warps=4
    )
    grid = min(_num_sms(device), triton.cdiv(n, BLOCK_M) * col_tiles)
    _logits_exp_kernel[(grid,)](
        TensorDescriptor.from_tensor(x, [BLOCK_M, BLOCK_K]),
        TensorDescriptor.from_tensor(w, [BLOCK_N, BLOCK_K]),
        TensorDescriptor.from_tensor(e, [BLOCK_M, BLOCK_N]),
        c,
        part,
        n,
        d,
        vocab,
        col_tiles,
        grid,
        BM=BLOCK_M,
        BN=BLOCK_N,
        BK=BLOCK_K,
        num_warps=WARPS,
        num_stages=STAGES,
    )
    _finish_kernel[(n,)](
        e,
        part,
        col_tiles,
        targets,
        c,
        x,
        w,
        d,
        vocab,
        padded,
        row_loss,
        row_scale,
        inv_n,
        x_scaled,
        BLOCK_T=triton.next_power_of_2(col_tiles),
        BLOCK=2048,
        BLOCK_D=block_d,
        BLOCK_V=max(1, 8192 // block_d),
        num_warps=4,
    )
    return e
