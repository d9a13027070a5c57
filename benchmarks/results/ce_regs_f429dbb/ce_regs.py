"""Scratch (not adopted; NOTES.md): a loss kernel holding each row in registers (one read, one
write) against the kernel in use, on one 8,192 x 50,304 slice. Run from the repository root."""
import itertools
import sys
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import torch, triton, triton.language as tl
from bench_ce import make_slice, reference, time_ms, run_kernel, VOCAB, PADDED


@triton.jit
def _load(base, off, P: tl.constexpr, vocab):
    cols = off + tl.arange(0, P)
    return tl.load(base + cols, mask=cols < vocab, other=float("-inf"))


@triton.jit
def _sumexp(x, m):
    return tl.sum(tl.exp(x.to(tl.float32) - m), 0)


@triton.jit
def _store_grad(base, off, P: tl.constexpr, x, lse, safe_t, scale, vocab, padded, dt):
    cols = off + tl.arange(0, P)
    g = tl.exp(x.to(tl.float32) - lse)
    g = tl.where(cols == safe_t, g - 1.0, g)
    g = tl.where(cols < vocab, g * scale, 0.0)
    tl.store(base + cols, g.to(dt), mask=cols < padded)


@triton.jit
def ce_regs(logits_ptr, stride, targets_ptr, loss_ptr, inv_n_ptr, vocab, padded, n_rows,
            P0: tl.constexpr, P1: tl.constexpr, P2: tl.constexpr, P3: tl.constexpr, PERSIST: tl.constexpr):
    dt = logits_ptr.dtype.element_ty
    start = tl.program_id(0)
    if PERSIST:
        step = tl.num_programs(0)
    else:
        step = n_rows
    for r in range(start, n_rows, step):
        row = tl.cast(r, tl.int64)
        base = logits_ptr + row * stride
        x0 = _load(base, 0, P0, vocab)
        x1 = _load(base, P0, P1, vocab)
        x2 = _load(base, P0 + P1, P2, vocab)
        x3 = _load(base, P0 + P1 + P2, P3, vocab)
        m = tl.maximum(tl.maximum(tl.max(x0, 0), tl.max(x1, 0)), tl.maximum(tl.max(x2, 0), tl.max(x3, 0))).to(tl.float32)
        s = _sumexp(x0, m) + _sumexp(x1, m) + _sumexp(x2, m) + _sumexp(x3, m)
        lse = m + tl.log(s)
        target = tl.load(targets_ptr + row)
        valid = target >= 0
        safe_t = tl.where(valid, target, 0)
        t_logit = tl.load(base + safe_t).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(valid, lse - t_logit, 0.0))
        scale = tl.where(valid, tl.load(inv_n_ptr), 0.0)
        _store_grad(base, 0, P0, x0, lse, safe_t, scale, vocab, padded, dt)
        _store_grad(base, P0, P1, x1, lse, safe_t, scale, vocab, padded, dt)
        _store_grad(base, P0 + P1, P2, x2, lse, safe_t, scale, vocab, padded, dt)
        _store_grad(base, P0 + P1 + P2, P3, x3, lse, safe_t, scale, vocab, padded, dt)


def pieces(n):
    out, rem = [], n
    for _ in range(3):
        p = 1 << (rem.bit_length() - 1) if rem >= 16 else 16
        out.append(p); rem = max(rem - p, 0)
    out.append(max(16, 1 << max(rem - 1, 0).bit_length()))
    return out


def main():
    dev = "cuda"
    rows = 8192
    logits, targets, inv_n = make_slice(rows, dev)
    ref = reference(logits, targets, inv_n)
    P = pieces(PADDED)
    print("pieces", P, sum(P), torch.cuda.get_device_name(), flush=True)
    loss = torch.empty(rows, device=dev)
    x = logits.clone()
    res = {}
    copy = time_ms(lambda: x.copy_(logits), 20)
    print(f"copy {copy:.3f} ms", flush=True)
    cur = time_ms(lambda: run_kernel(x, targets, inv_n, loss, 2048, 4), 20)
    print(f"current 2048x4 {cur:.3f} ms", flush=True)
    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    for warps, maxnreg, persist in itertools.product([8, 16, 32], [None, 64, 96, 128, 168], [0, 1, 2]):
        if maxnreg and warps * 32 * maxnreg > 65536:
            continue
        kw = {"num_warps": warps}
        if maxnreg:
            kw["maxnreg"] = maxnreg
        grid = (rows,) if not persist else (nsm * persist,)
        def fn():
            ce_regs[grid](x, x.stride(0), targets, loss, inv_n, VOCAB, PADDED, rows, *P, PERSIST=bool(persist), **kw)
        try:
            x.copy_(logits); fn(); torch.cuda.synchronize()
            ref_loss, ref_grad = ref
            le = float((loss - ref_loss).abs().max())
            ge = float((x[:, :VOCAB].float() - ref_grad).abs().max() / ref_grad.abs().max())
            pz = bool((x[:, VOCAB:] == 0).all())
            t = time_ms(fn, 20)
            print(f"warps {warps} maxnreg {maxnreg} persist {persist}: {t:.3f} ms  loss_err {le:.2e} grad_err {ge:.2e} pad0 {pz}", flush=True)
            res[f"{warps}/{maxnreg}/{persist}"] = t
        except Exception as e:
            print(f"warps {warps} maxnreg {maxnreg} persist {persist}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
    best = min(res, key=res.get)
    print(f"BEST {best} {res[best]:.3f} ms vs current {cur:.3f} vs copy {copy:.3f}")


if __name__ == "__main__":
    main()
