"""The one-token KV-cached decode step as a handful of fused Triton kernels.

Why: decoding one token of one sequence is bound by the number of kernels, not by memory
bandwidth. ``oelm_core.fast.decode.decode_step`` launches ~115 small kernels per token (cuBLAS
GEMVs, layer norms, the softmax, index_copy, cat, ...) at the ``medium512`` preset (6 layers,
d_model 512, 8 heads, d_ff 2048, vocab 50,257), several times what streaming the ~180 MB of
weights it reads takes. Here each layer is five launches and the whole step 5 * n_layer + 2 (32
at medium512):

    embedding      x = wte[idx] + wpe[pos]                                    _embed_kernel
    per layer      qkv = [W_qk; W_v] LN_1(x) + [0; b_v]                        _gemv_kernel
                   k, v stored at pos; per head and key block: partial          _attend_kernel
                   softmax(q K^T / sqrt(d_head)) V with its max and sum
                   x += W_proj combine(partials) + b_proj                       _gemv_kernel
                   hidden = GELU_tanh(W_fc LN_2(x) + b_fc)                      _gemv_kernel
                   x += W_mlp_proj hidden + b_mlp_proj                          _gemv_kernel
    output layer   logits = W_out[:vocab] LN_f(x)                               _gemv_kernel

Every shape is fixed and the token id and position are read only inside the kernels (no host
synchronisation, no allocation once a ``DecodeScratch`` exists), so ``fast.decode.GraphDecoder``
can capture steps in a CUDA graph. On Hopper GPUs the kernels are launched with programmatic
dependent launch: each starts, and fetches its weights, while the previous one finishes. The
measured gain (``bench_generate.py``, the decoder with ``decode_kernels=False``) is in
benchmarks/README.md.

Supported (``supports``): dot attention through a plain ``QKProjection`` in every layer
(standard, orthogonal and frozen Q/K; not the Synthesizer or POET), eval mode, float32 or
bfloat16 weights and cache, d_model and d_ff up to 8,192, batch 1, on CUDA (or on the CPU
under Triton's interpreter, ``TRITON_INTERPRET=1``, for tests). ``fast.decode.decode_step`` is
the reference: the same contract and, in float32, the same numbers (tests/test_decode_kernels.py).
The residual stream and every intermediate stay in float32 here, so a bfloat16 model comes out
slightly more accurate than the reference, which rounds each of them to bfloat16.
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from typing import Optional

import torch

from oelm_core.model import GPT, KVCache, QKProjection

try:  # optional: CPU-only installs have no Triton, and ``supports`` says no
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
try:  # programmatic dependent launch: newer Tritons, on GPUs of compute capability >= 9.0
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - depends on the install
    gdc_launch_dependents = gdc_wait = None


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        x_ptr,
        ln_w_ptr,
        ln_b_ptr,
        eps,
        part_m_ptr,
        part_l_ptr,
        n_parts,
        n_head,
        d_head,
        wa_ptr,
        wb_ptr,
        w_stride,
        n_a,
        b_ptr,
        res_ptr,
        out_ptr,
        N,
        K,
        LN: tl.constexpr,
        LN_BIAS: tl.constexpr,
        COMBINE: tl.constexpr,
        BIAS: tl.constexpr,
        GELU: tl.constexpr,
        RESIDUAL: tl.constexpr,
        PDL: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_P: tl.constexpr,
    ):
        """out[n] = act(sum_k W[n, k] * h[k] + b[n]) (+ res[n]) for n < N, one program per
        BLOCK_N rows, each holding whole rows (BLOCK_K >= K).

        h is x (K,) float32, or LN(x) with weight ln_w and bias ln_b (K,), or (COMBINE) the
        attention output assembled from ``_attend_kernel``'s partials: x (n_parts, K) the
        unnormalised sums, part_m / part_l (n_parts, n_head) their score maxima and softmax
        denominators, column k belonging to head k // d_head.
        W: rows [0, n_a) of ``wa``, then rows [0, N - n_a) of ``wb``, both row-major with row
        stride ``w_stride``, float32 or bfloat16 (accumulated in float32); b: (N - n_a,), the
        bias of ``wb``'s rows (``wa`` is the stacked W_q/W_k, which never have a bias).
        res, out: (N,) float32; ``out`` may be ``res`` (an in-place residual add): each program
        reads and writes only its own rows.
        """
        rows = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        row_ok = rows < N
        cols = tl.arange(0, BLOCK_K)
        col_ok = cols < K
        # The weight tile goes first and whole: the one large load, independent of the input
        # (LayerNorm, attention combine) computed below, so its latency overlaps theirs and the
        # program waits for memory about once. Both weights' addresses are formed and one chosen
        # per row, so a layer's q/k and v rows come out of one launch whatever BLOCK_N is.
        w_rows = tl.where(
            rows[:, None] < n_a, wa_ptr + rows[:, None] * w_stride, wb_ptr + (rows[:, None] - n_a) * w_stride
        )
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        if PDL:
            # Launched early (programmatic dependent launch): the weights, which no kernel
            # writes, are on their way while the previous kernel finishes; everything else
            # (inputs, outputs) waits for it to complete.
            gdc_wait()
            gdc_launch_dependents()
        if COMBINE:
            # Each program merges the per-key-block partials of the heads itself (a few KB read
            # from cache), which saves a separate combine launch per layer.
            parts = tl.arange(0, BLOCK_P)
            ok = (parts[:, None] < n_parts) & col_ok[None, :]
            ml_offs = parts[:, None] * n_head + cols[None, :] // d_head
            m = tl.load(part_m_ptr + ml_offs, mask=ok, other=float("-inf"))
            m_max = tl.max(m, 0)  # finite: the key block holding the new token has a score
            scale = tl.exp(m - m_max[None, :])
            denom = tl.sum(scale * tl.load(part_l_ptr + ml_offs, mask=ok, other=0.0), 0)
            acc = tl.load(x_ptr + parts[:, None] * K + cols[None, :], mask=ok, other=0.0)
            h = tl.where(col_ok, tl.sum(scale * acc, 0) / denom, 0.0)
        else:
            h = tl.load(x_ptr + cols, mask=col_ok, other=0.0)
        if LN:
            # Every program recomputes the statistics of x: cheaper than a LayerNorm launch.
            mean = tl.sum(h, 0) / K
            centred = tl.where(col_ok, h - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, 0) / K + eps)
            h = centred * rstd * tl.load(ln_w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            if LN_BIAS:
                h += tl.load(ln_b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        y = tl.sum(w.to(tl.float32) * h[None, :], 1)
        if BIAS:
            b_ok = row_ok & (rows >= n_a)
            y += tl.load(b_ptr + (rows - n_a), mask=b_ok, other=0.0).to(tl.float32)
        if GELU:
            # GELU's tanh approximation: 0.5 y (1 + tanh(u)) = y * sigmoid(2 u).
            u = 0.7978845608028654 * (y + 0.044715 * y * y * y)
            y = y * tl.sigmoid(2.0 * u)
        if RESIDUAL:
            y += tl.load(res_ptr + rows, mask=row_ok, other=0.0)
        tl.store(out_ptr + rows, y, mask=row_ok)

    @triton.jit
    def _attend_kernel(
        qkv_ptr,
        pos_ptr,
        k_cache_ptr,
        v_cache_ptr,
        stride_h,
        stride_t,
        part_acc_ptr,
        part_m_ptr,
        part_l_ptr,
        D,
        DH,
        n_head,
        scale,
        PDL: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """Program (head, j): the new token's attention over keys j*BLOCK_T .. (j+1)*BLOCK_T - 1
        of that head, as a partial softmax: part_m[j, head] = the block's largest score s_t
        (-inf if the block lies past pos), part_l[j, head] = sum_t exp(s_t - m),
        part_acc[j, head*DH:(head+1)*DH] = sum_t exp(s_t - m) v_t, over t <= pos only.

        qkv: (3 D,) float32, [q | k | v] with the heads concatenated in each; caches: one
        layer's (1, H, block_size, DH) buffers (float32 or bfloat16), strides stride_h,
        stride_t and 1. The block holding ``pos`` stores the new k, v there and takes them from
        registers: keys t < pos come from the cache, so nothing stored here is loaded back.
        One program per key block instead of a loop over them: one memory round trip per step
        instead of one per block (a loop over the keys in fewer programs was several times slower).
        """
        if PDL:  # nothing to load ahead, but an early launch still hides the launch latency
            gdc_wait()
            gdc_launch_dependents()
        head = tl.program_id(0)
        j = tl.program_id(1)
        pos = tl.load(pos_ptr)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < DH
        t = j * BLOCK_T + tl.arange(0, BLOCK_T)
        cached = (t < pos)[:, None] & d_ok[None, :]
        k_base = k_cache_ptr + head * stride_h
        v_base = v_cache_ptr + head * stride_h
        offs = t[:, None] * stride_t + d[None, :]
        k = tl.load(k_base + offs, mask=cached, other=0.0).to(tl.float32)
        v = tl.load(v_base + offs, mask=cached, other=0.0).to(tl.float32)
        q = tl.load(qkv_ptr + head * DH + d, mask=d_ok, other=0.0)
        k_new = tl.load(qkv_ptr + D + head * DH + d, mask=d_ok, other=0.0).to(k_cache_ptr.dtype.element_ty)
        v_new = tl.load(qkv_ptr + 2 * D + head * DH + d, mask=d_ok, other=0.0).to(v_cache_ptr.dtype.element_ty)
        mine = d_ok & (pos // BLOCK_T == j)
        tl.store(k_base + pos * stride_t + d, k_new, mask=mine)
        tl.store(v_base + pos * stride_t + d, v_new, mask=mine)
        # The new key and value as stored (rounded to the cache's dtype), as later steps see them.
        is_new = (t == pos)[:, None]
        k = tl.where(is_new, k_new.to(tl.float32)[None, :], k)
        v = tl.where(is_new, v_new.to(tl.float32)[None, :], v)
        s = tl.where(t <= pos, tl.sum(k * q[None, :], 1) * scale, float("-inf"))
        m = tl.max(s, 0)
        p = tl.exp(s - tl.where(m == float("-inf"), 0.0, m))  # all 0 in a block past pos
        part = j * n_head + head
        tl.store(part_m_ptr + part, m)
        tl.store(part_l_ptr + part, tl.sum(p, 0))
        tl.store(part_acc_ptr + j * D + head * DH + d, tl.sum(p[:, None] * v, 0), mask=d_ok)

    @triton.jit
    def _embed_kernel(
        idx_ptr, pos_ptr, wte_ptr, wte_stride, wpe_ptr, wpe_stride, x_ptr, D, PDL: tl.constexpr, BLOCK_D: tl.constexpr
    ):
        """x (D,) float32 = wte[idx] + wpe[pos]; idx, pos: one int64 each, read here."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
        tok = tl.load(idx_ptr)
        pos = tl.load(pos_ptr)
        cols = tl.arange(0, BLOCK_D)
        ok = cols < D
        e = tl.load(wte_ptr + tok * wte_stride + cols, mask=ok, other=0.0).to(tl.float32)
        e += tl.load(wpe_ptr + pos * wpe_stride + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(x_ptr + cols, e, mask=ok)


_DTYPES = (torch.float32, torch.bfloat16)
# Launch shapes, chosen by timing the CUDA-graph-captured step at medium512 on an H200.
# GEMV: a program holds BLOCK_N whole rows of W, up to _TILE elements (32 float32 registers per
# thread at 8 warps), so at most 8,192 columns. BLOCK_N is the largest power of two that still
# gives _MIN_PROGRAMS programs (about one per SM of an H100/H200, 132, so every SM streams
# weights), within the tile, and at least _MIN_BLOCK_N rows (narrow layers are launch-bound
# anyway). 8 warps rather than 4: more loads in flight per SM, a faster step.
_TILE = 8192
_MIN_PROGRAMS = 128
_MIN_BLOCK_N = 4
_GEMV_WARPS = 8
# Attention: (BLOCK_T, d_head) keys and as many values per program, 32 KB each (at d_head 64:
# 128 float32 or 256 bfloat16 keys, 4 or 2 key blocks x 8 heads at medium512). Fewer, larger
# blocks leave the projection less to combine; much larger ones load too much per program.
# Of 64, 128 and 256 float32 keys a program, 128 gave the fastest step at position 511.
_ATTN_TILE_BYTES = 32768
_ATTN_WARPS = 4


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _gemv_blocks(n: int, k: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K) for an (n, k) weight."""
    block_k = triton.next_power_of_2(k)
    return min(_TILE // block_k, max(_MIN_BLOCK_N, _pow2_floor(n // _MIN_PROGRAMS))), block_k


def supports(model: GPT) -> bool:
    """Whether ``decode_step`` can run ``model`` (see the module docstring)."""
    if triton is None or model.training:
        return False
    weight = model.wte.weight
    if not (weight.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    if not all(isinstance(block.attn.qk, QKProjection) for block in model.blocks):
        return False
    if triton.next_power_of_2(max(model.cfg.d_model, model.cfg.d_ff)) > _TILE:
        return False
    tensors = list(model.parameters()) + list(model.buffers())
    return all(t.dtype in _DTYPES for t in tensors if t.is_floating_point())


class DecodeScratch:
    """The fixed buffers of one model's fused decode step, all float32: ``x`` (d_model,) the
    residual stream, ``qkv`` (3 d_model,), the attention partials ``part_acc`` (n_parts,
    d_model), ``part_m`` and ``part_l`` (n_parts, n_head), ``hidden`` (d_ff,) and ``logits``
    (1, vocab_size), which ``decode_step`` returns. Make it once per model and keep it alive
    while a CUDA graph that captured it is replayed.

    ``attn_block_t``: keys per attention program (a power of two; n_parts = block_size /
    attn_block_t); tests make it small to get several key blocks out of a small context.
    ``pdl``: launch with programmatic dependent launch (CUDA, compute capability >= 9.0), so
    each kernel starts loading its weights while the previous one finishes.
    """

    def __init__(self, model: GPT, attn_block_t: Optional[int] = None):
        cfg = model.cfg
        device = model.wte.weight.device
        f32 = dict(dtype=torch.float32, device=device)
        self.d_block = triton.next_power_of_2(cfg.d_head)
        key_bytes = self.d_block * model.wte.weight.element_size()  # the cache's dtype
        self.attn_block_t = attn_block_t or min(_ATTN_TILE_BYTES // key_bytes, triton.next_power_of_2(cfg.block_size))
        self.n_parts = triton.cdiv(cfg.block_size, self.attn_block_t)
        self.pdl = device.type == "cuda" and gdc_wait is not None and torch.cuda.get_device_capability(device)[0] >= 9
        self.x = torch.empty(cfg.d_model, **f32)
        self.qkv = torch.empty(3 * cfg.d_model, **f32)
        self.part_acc = torch.empty(self.n_parts, cfg.d_model, **f32)
        self.part_m = torch.empty(self.n_parts, cfg.n_head, **f32)
        self.part_l = torch.empty(self.n_parts, cfg.n_head, **f32)
        self.hidden = torch.empty(cfg.d_ff, **f32)
        self.logits = torch.empty(1, cfg.vocab_size, **f32)


def _gemv(
    s: DecodeScratch,
    out: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    *,
    ln=None,
    bias=None,
    gelu: bool = False,
    residual: Optional[torch.Tensor] = None,
    weight_b: Optional[torch.Tensor] = None,
    combine_heads: int = 0,
) -> None:
    """out = act(W @ h + bias) (+ residual) with ``_gemv_kernel``, N = out's size.

    W is ``weight``'s first N rows, or ``weight`` stacked on ``weight_b`` (``bias`` then
    belongs to ``weight_b``'s rows). h is x, LN(x) for a LayerNorm module ``ln``, or, with
    ``combine_heads`` > 0, the attention output of that many heads from the partials in ``s``
    (x is then ``s.part_acc``).
    """
    n, k = out.numel(), x.size(-1)
    wb = weight if weight_b is None else weight_b
    if weight.stride(1) != 1 or wb.stride(1) != 1 or weight.stride(0) != wb.stride(0):
        raise ValueError("the fused decode step needs row-major weights with one row stride")
    block_n, block_k = _gemv_blocks(n, k)
    heads = max(combine_heads, 1)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        ln.weight if ln is not None else None,
        ln.bias if ln is not None else None,
        ln.eps if ln is not None else 0.0,
        s.part_m,
        s.part_l,
        s.n_parts,
        heads,
        k // heads,
        weight,
        wb,
        weight.stride(0),
        0 if weight_b is None else weight.size(0),
        bias,
        residual,
        out,
        n,
        k,
        LN=ln is not None,
        LN_BIAS=ln is not None and ln.bias is not None,
        COMBINE=combine_heads > 0,
        BIAS=bias is not None,
        GELU=gelu,
        RESIDUAL=residual is not None,
        PDL=s.pdl,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        BLOCK_P=triton.next_power_of_2(s.n_parts),
        num_warps=_GEMV_WARPS,
        launch_pdl=s.pdl,
    )


def decode_step(
    model: GPT, idx: torch.Tensor, pos: torch.Tensor, cache: KVCache, scratch: Optional[DecodeScratch] = None
) -> torch.Tensor:
    """``fast.decode.decode_step(model, idx, pos, cache)`` for one sequence, in 5 * n_layer + 2
    kernels.

    idx: (1, 1) int64 token id; pos: (1,) int64 position (< block_size), both on the model's
    device and read only on the device; cache: the model's ``KVCache`` for batch 1, positions
    < pos filled. Writes this token's keys and values at ``pos`` and attends over 0..pos;
    leaves ``cache.length`` alone. Returns logits (1, vocab_size) float32: ``scratch.logits``,
    overwritten by the next call. Without ``scratch`` a new one is made (allocations: not for
    a CUDA graph).
    """
    if idx.shape != (1, 1) or pos.numel() != 1 or cache.k[0].size(0) != 1:
        raise ValueError(
            f"the fused decode step takes one sequence: idx (1, 1) and pos (1,), "
            f"got idx {tuple(idx.shape)}, pos {tuple(pos.shape)} and a cache of batch "
            f"{cache.k[0].size(0)}"
        )
    cfg = model.cfg
    s = scratch if scratch is not None else DecodeScratch(model)
    d, h = cfg.d_model, cfg.n_head
    wte, wpe = model.wte.weight, model.wpe.weight
    with torch.cuda.device(wte.device) if wte.is_cuda else nullcontext():
        _embed_kernel[(1,)](
            idx,
            pos,
            wte,
            wte.stride(0),
            wpe,
            wpe.stride(0),
            s.x,
            d,
            PDL=s.pdl,
            BLOCK_D=triton.next_power_of_2(d),
            num_warps=4,
            launch_pdl=s.pdl,
        )
        for layer, block in enumerate(model.blocks):
            attn, mlp = block.attn, block.mlp
            _gemv(s, s.qkv, s.x, attn.qk.weight, weight_b=attn.v.weight, bias=attn.v.bias, ln=block.ln_1)
            kc, vc = cache.k[layer], cache.v[layer]
            _attend_kernel[(h, s.n_parts)](
                s.qkv,
                pos,
                kc,
                vc,
                kc.stride(1),
                kc.stride(2),
                s.part_acc,
                s.part_m,
                s.part_l,
                d,
                cfg.d_head,
                h,
                1.0 / math.sqrt(cfg.d_head),
                PDL=s.pdl,
                BLOCK_T=s.attn_block_t,
                BLOCK_D=s.d_block,
                num_warps=_ATTN_WARPS,
                launch_pdl=s.pdl,
            )
            _gemv(s, s.x, s.part_acc, attn.proj.weight, bias=attn.proj.bias, residual=s.x, combine_heads=h)
            _gemv(s, s.hidden, s.x, mlp.fc.weight, bias=mlp.fc.bias, gelu=True, ln=block.ln_2)
            _gemv(s, s.x, s.hidden, mlp.proj.weight, bias=mlp.proj.bias, residual=s.x)
        _gemv(s, s.logits, s.x, model.output_weight, ln=model.ln_f)
    return s.logits
