"""Drawing the next token on the GPU in two small Triton kernels (temperature, top-k, top-p).

Why: ``oelm_core.generate.sample`` written with torch ops is ~10 launches per token (the noise
hash, the scaling, a top-k over the whole vocabulary, masking, the argmax), more GPU time than
the whole fused decode step of the smoke model. The draw is the same here:

    _scores_kernel   (column chunks, batch) programs: x = logits * (1 / T) and x + g, g the Gumbel
                     noise of ``generate.gumbel_noise`` from the same integer hash of (seed,
                     step, token id); as candidates, the chunk's largest x + g, or for top-k its
                     KM largest x (KM >= k: together they hold the row's k largest).
    _pick_kernel     one program per row: the cut (the k-th largest candidate, raised by the
                     top-p rule), then the first id of the largest x + g at or above the cut.

No sort anywhere: the k-th largest value and the top-p cut are found by bisection on the
float's bits (32 rounds, each one masked sum over a block held on chip).

Seed and step are read on the device and nothing is allocated by the host between the kernels,
so the draw can be captured in a CUDA graph. Supported (``supports``): temperature > 0 with no
cut, or a top-k cut of at most ``MAX_TOP_K`` (with or without top-p); a top-p cut alone would
bisect over the whole vocabulary and stays with torch. ``oelm_core.fast.decode.sample`` picks
these kernels where they apply. Against ``generate.sample``: the same noise
bits (float32 arithmetic without fused multiply-adds, libdevice's log) and so the same token,
ties included (every x equal to the k-th largest, or to the top-p cut, is kept; equal scores
go to the lowest id),
except where a top-p sum lands on p to float rounding (torch sums in another order).
tests/test_sample_kernels.py checks it.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

try:  # optional: CPU-only installs have no Triton, and ``supports`` says no
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the install
    triton = None

MAX_TOP_K = 1024
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_CHUNK = 2048  # columns per _scores_kernel program without top-k (and at least with it)
_MAX_CANDIDATES = 8192  # one _pick_kernel block: chunks are widened to keep a row's under it


if triton is not None:
    # libdevice's log and exp are CUDA's logf and expf, which torch uses: the same noise bits.
    # Triton's CPU interpreter (tests) has no libdevice; numpy's functions stand in there. Two
    # jit functions, not `_log = tl.log if ... else libdevice.log`: a builtin called through a
    # module-level alias fails inside a kernel ("Did you forget to add @triton.jit?").
    @triton.jit
    def _log(x, INTERPRET: tl.constexpr):
        if INTERPRET:
            return tl.log(x)
        else:
            return libdevice.log(x)

    @triton.jit
    def _exp(x, INTERPRET: tl.constexpr):
        if INTERPRET:
            return tl.exp(x)
        else:
            return libdevice.exp(x)

    @triton.jit
    def _hash32(h):
        """Mueller's hash32 on uint32 (products wrap mod 2^32, as ``generate._hash32`` masks)."""
        h = ((h >> 16) ^ h) * 0x45D9F3B
        h = ((h >> 16) ^ h) * 0x45D9F3B
        return (h >> 16) ^ h

    @triton.jit
    def _key(x):
        """float32 -> int32 in the same order (-inf lowest, as float ordering; no NaNs)."""
        b = x.to(tl.int32, bitcast=True)
        return b ^ ((b >> 31) & 0x7FFFFFFF)

    @triton.jit
    def _raise(lo, shift, key, w, need):
        """One bisection round for the largest v with sum(w over key >= v) >= need, v known to
        be in [lo, lo + 2^(shift + 1)): the upper half if it still has enough."""
        mid = lo + (tl.full([], 1, tl.int64) << shift)
        return tl.where(tl.sum(tl.where(key >= mid, w, 0.0), 0) >= need, mid, lo)

    @triton.jit
    def _scores_kernel(
        logits_ptr,
        stride,
        seed_ptr,
        step_ptr,
        inv_t,
        x_ptr,
        s_ptr,
        cx_ptr,
        cs_ptr,
        ci_ptr,
        over_ptr,
        vocab,
        NOISE: tl.constexpr,
        TOP_K: tl.constexpr,
        KM: tl.constexpr,
        CH: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        """Columns [chunk * CH, (chunk + 1) * CH) of row ``row``: x and x + g (x without NOISE)
        into x, s (batch, vocab); the chunk's candidates, KM slots of (x, x + g, id) at cx, cs, ci[row, chunk]:
        with TOP_K its KM largest x (and, at over[row, chunk], the KM-th largest key if ties
        left more than KM at or above it, else INT32_MIN), without it its largest x + g."""
        chunk, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
        cols = chunk * CH + tl.arange(0, CH)
        ok = cols < vocab
        x = tl.load(logits_ptr + row * stride + cols, mask=ok, other=float("-inf")).to(tl.float32) * inv_t
        s = x
        if NOISE:
            seed = tl.load(seed_ptr).to(tl.uint32)
            step = tl.load(step_ptr).to(tl.uint32)
            key = _hash32(_hash32(seed) + step * 0x9E3779B9)
            h = _hash32(key + cols.to(tl.uint32) * 0x85EBCA77)
            u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
            s = tl.where(ok, x + -_log(-_log(u, INTERPRET), INTERPRET), float("-inf"))
        tl.store(x_ptr + row * vocab + cols, x, mask=ok)
        tl.store(s_ptr + row * vocab + cols, s, mask=ok)
        slot = (row * tl.num_programs(0) + chunk) * KM
        if TOP_K:
            xkey = tl.where(ok, _key(x), -2147483648)
            ones = tl.where(ok, 1.0, 0.0)
            cut = tl.full([], -2147483648, tl.int64)
            for r in tl.static_range(32):  # the KM-th largest key
                cut = _raise(cut, 31 - r, xkey, ones, KM)
            sel = xkey >= cut
            pos = tl.cumsum(sel.to(tl.int32), 0) - 1
            put = sel & (pos < KM)
            tl.store(cx_ptr + slot + pos, x, mask=put)
            tl.store(cs_ptr + slot + pos, s, mask=put)
            tl.store(ci_ptr + slot + pos, cols, mask=put)
            n_sel = tl.sum(sel.to(tl.int32), 0)
            tl.store(over_ptr + row * tl.num_programs(0) + chunk, tl.where(n_sel > KM, cut, -2147483648).to(tl.int32))
        else:
            best = tl.max(s, 0)
            i = tl.min(tl.where(s == best, cols, vocab), 0)
            tl.store(cx_ptr + slot, tl.max(tl.where(cols == i, x, float("-inf")), 0))
            tl.store(cs_ptr + slot, best)
            tl.store(ci_ptr + slot, i)

    @triton.jit
    def _set_block(row, off, full, x_ptr, s_ptr, vocab, cx_ptr, cs_ptr, ci_ptr, n_cand, BLOCK: tl.constexpr):
        """Block ``off`` of what the draw is over: the candidates, or (``full``) the whole row.
        -> (key of x, x, x + g, id, valid); invalid entries have key INT32_MIN, x = s = -inf."""
        offs = off + tl.arange(0, BLOCK)
        in_row = full & (offs < vocab)
        in_cand = (full == 0) & (offs < n_cand)
        x = tl.where(
            full,
            tl.load(x_ptr + row * vocab + offs, mask=in_row, other=float("-inf")),
            tl.load(cx_ptr + row * n_cand + offs, mask=in_cand, other=float("-inf")),
        )
        s = tl.where(
            full,
            tl.load(s_ptr + row * vocab + offs, mask=in_row, other=float("-inf")),
            tl.load(cs_ptr + row * n_cand + offs, mask=in_cand, other=float("-inf")),
        )
        ids = tl.where(full, offs, tl.load(ci_ptr + row * n_cand + offs, mask=in_cand, other=0))
        valid = in_row | in_cand
        return tl.where(valid, _key(x), -2147483648), x, s, ids, valid

    @triton.jit
    def _weight(key, x, valid, cut, top, z, MASS: tl.constexpr, INTERPRET: tl.constexpr):
        """1 per entry (a count), or (MASS) the softmax probability of entries at or above cut."""
        if MASS:
            return tl.where(key >= cut, _exp(x - top, INTERPRET) / z, 0.0)
        else:
            return tl.where(valid, 1.0, 0.0)

    @triton.jit
    def _largest_key(
        row,
        full,
        x_ptr,
        s_ptr,
        vocab,
        cx_ptr,
        cs_ptr,
        ci_ptr,
        n_cand,
        need,
        cut,
        top,
        z,
        MASS: tl.constexpr,
        BLOCK: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        """The largest v with the count (or MASS) of the set's entries with key >= v >= need."""
        lo = tl.full([], -2147483648, tl.int64)
        if full:
            for r in tl.static_range(32):
                mid = lo + (tl.full([], 1, tl.int64) << (31 - r))
                mass = tl.full([], 0.0, tl.float32)
                for off in tl.range(0, vocab, BLOCK):
                    key, x, s, ids, valid = _set_block(
                        row, off, full, x_ptr, s_ptr, vocab, cx_ptr, cs_ptr, ci_ptr, n_cand, BLOCK
                    )
                    w = _weight(key, x, valid, cut, top, z, MASS, INTERPRET)
                    mass += tl.sum(tl.where(key >= mid, w, 0.0), 0)
                lo = tl.where(mass >= need, mid, lo)
        else:  # one block, loaded once
            key, x, s, ids, valid = _set_block(row, 0, full, x_ptr, s_ptr, vocab, cx_ptr, cs_ptr, ci_ptr, n_cand, BLOCK)
            w = _weight(key, x, valid, cut, top, z, MASS, INTERPRET)
            for r in tl.static_range(32):
                lo = _raise(lo, 31 - r, key, w, need)
        return lo

    @triton.jit
    def _pick_kernel(
        x_ptr,
        s_ptr,
        vocab,
        cx_ptr,
        cs_ptr,
        ci_ptr,
        n_cand,
        over_ptr,
        n_chunks,
        out_ptr,
        k,
        top_p,
        TOP_K: tl.constexpr,
        TOP_P: tl.constexpr,
        BLOCK: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        """out[row] = the first id of the largest x + g among x >= the cut. The cut: the k-th
        largest x (TOP_K), raised by top-p (TOP_P, only with TOP_K) to the lowest x whose
        mass above is below p. Over the candidates, unless ties overflowed a chunk's slots at
        or above the cut: then over the whole row (same answer, slower)."""
        row = tl.program_id(0).to(tl.int64)
        cut = tl.full([], -2147483648, tl.int64)
        full = n_cand < 0
        if TOP_K:  # the candidates hold every chunk's KM >= k largest values, so the row's k largest
            cut = _largest_key(
                row,
                full,
                x_ptr,
                s_ptr,
                vocab,
                cx_ptr,
                cs_ptr,
                ci_ptr,
                n_cand,
                k,
                cut,
                0.0,
                1.0,
                False,
                BLOCK,
                INTERPRET,
            )
            c = tl.arange(0, BLOCK)
            over = tl.load(over_ptr + row * n_chunks + c, mask=c < n_chunks, other=-2147483648)
            full = tl.max(over, 0).to(tl.int64) >= cut
        n = tl.where(full, vocab, n_cand)
        if TOP_P:
            # generate.sample keeps a token while the mass before it is < p: the cut becomes the
            # largest v with mass(key >= v) >= p, the probabilities softmax over x >= cut.
            top = tl.full([], float("-inf"), tl.float32)
            for off in tl.range(0, n, BLOCK):
                key, x, s, ids, valid = _set_block(
                    row, off, full, x_ptr, s_ptr, vocab, cx_ptr, cs_ptr, ci_ptr, n_cand, BLOCK
                )
                top = tl.maximum(top, tl.max(tl.where(key >= cut, x, float("-inf")), 0))
            z = tl.full([], 0.0, tl.float32)
            for off in tl.range(0, n, BLOCK):
                key, x, s, ids, valid = _set_block(
                    row, off, full, x_ptr, s_ptr, vocab, cx_ptr, cs_ptr, ci_ptr, n_cand, BLOCK
                )
                z += tl.sum(tl.where(key >= cut, _exp(x - top, INTERPRET), 0.0), 0)
            cut = _largest_key(
                row,
                full,
                x_ptr,
                s_ptr,
                vocab,
                cx_ptr,
                cs_ptr,
                ci_ptr,
                n_cand,
                top_p,
                cut,
                top,
                z,
                True,
                BLOCK,
                INTERPRET,
            )
        best = tl.full([], float("-inf"), tl.float32)
        best_i = tl.full([], 2147483647, tl.int32)
        for off in tl.range(0, n, BLOCK):
            key, x, s, ids, valid = _set_block(
                row, off, full, x_ptr, s_ptr, vocab, cx_ptr, cs_ptr, ci_ptr, n_cand, BLOCK
            )
            s = tl.where(key >= cut, s, float("-inf"))
            m = tl.max(s, 0)
            i = tl.min(tl.where(s == m, ids, 2147483647), 0)  # the first of equal maxima, as argmax
            take = (m > best) | ((m == best) & (i < best_i))
            best_i = tl.where(take, i, best_i)
            best = tl.where(take, m, best)
        tl.store(out_ptr + row, tl.where(best_i == 2147483647, 0, best_i).to(tl.int64))


def supports(logits: torch.Tensor, top_k: int, top_p: float) -> bool:
    """Whether ``sample`` can draw for these logits with this cut (top_k 0: none)."""
    if triton is None or not (logits.is_cuda or _INTERPRET):
        return False
    return top_k <= MAX_TOP_K and (top_k > 0 or top_p >= 1.0)


def _launch_shape(vocab: int, top_k: int) -> tuple[int, int]:
    """(KM, CH): candidates kept per chunk and chunk width, so that all candidates of a row
    (chunks x KM) fit one block of at most _MAX_CANDIDATES."""
    if not top_k:
        return 1, _CHUNK
    km = max(16, triton.next_power_of_2(top_k))
    ch = max(_CHUNK, km)
    while triton.cdiv(vocab, ch) * km > _MAX_CANDIDATES and ch < triton.next_power_of_2(vocab):
        ch *= 2
    return km, ch


def sample(
    logits: torch.Tensor,
    inv_t: float,
    top_k: int,
    top_p: float,
    seed: Optional[torch.Tensor],
    step: Optional[torch.Tensor],
) -> torch.Tensor:
    """logits (..., vocab) float32/bfloat16; inv_t the float32 1 / temperature; top_k 0 (none)
    or below vocab; seed and step one-element int64 tensors on the logits' device -> token ids
    (...,) int64: ``generate.sample``'s draw (see the module docstring). seed None: no noise, the
    first index of the largest logit (greedy, as ``argmax``; one launch fewer than torch's).
    Requires ``supports(logits, top_k, top_p)``."""
    vocab = logits.size(-1)
    rows = logits.reshape(-1, vocab)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    batch, device = rows.size(0), rows.device
    km, ch = _launch_shape(vocab, top_k)
    n_chunks = triton.cdiv(vocab, ch)
    x = torch.empty((batch, vocab), dtype=torch.float32, device=device)
    s = torch.empty_like(x)
    cx = torch.empty((batch, n_chunks * km), dtype=torch.float32, device=device)
    cs = torch.empty_like(cx)
    ci = torch.empty((batch, n_chunks * km), dtype=torch.int32, device=device)
    over = torch.empty((batch, n_chunks), dtype=torch.int32, device=device)
    out = torch.empty(batch, dtype=torch.int64, device=device)
    # No fused multiply-add: x + g is rounded after x, as torch computes it. Warps: each of the
    # 32 bisection rounds is one block-wide sum; timed on an H200, 4 warps were as fast as 8 for
    # top-k 50 (2,048 columns a chunk, 1,600 candidates) and 2 twice as slow, while top-k 1,000
    # (8,192 columns, 7,168 candidates) took twice as long with 4 as with 8.
    noise = seed is not None
    warps = 8 if cx.size(1) > 2048 else 4
    _scores_kernel[(n_chunks, batch)](
        rows,
        rows.stride(0),
        seed if noise else out,
        step if noise else out,
        inv_t,
        x,
        s,
        cx,
        cs,
        ci,
        over,
        vocab,
        NOISE=noise,
        TOP_K=bool(top_k),
        KM=km,
        CH=ch,
        INTERPRET=_INTERPRET,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    _pick_kernel[(batch,)](
        x,
        s,
        vocab,
        cx,
        cs,
        ci,
        cx.size(1),
        over,
        n_chunks,
        out,
        top_k,
        top_p,
        TOP_K=bool(top_k),
        TOP_P=bool(top_k) and top_p < 1.0,
        BLOCK=triton.next_power_of_2(max(cx.size(1), n_chunks)),
        INTERPRET=_INTERPRET,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    return out.view(logits.shape[:-1])
