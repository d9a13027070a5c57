"""Scratch record (not adopted): a loss kernel that reads each row of logits once, against
oelm_core.model._ce_rows_kernel, which reads it twice. Run from the repository root on a GPU:
    PYTHONPATH=. python benchmarks/results/1e6b63a/ce_parts.py ce_parts.json
PARTS programs share a row, each holding its columns in registers; they publish their part's max
and sum of exponentials, wait at a per-row counter for the others, then write the gradient from
registers. Programs take (row, part) from a ticket in start order, so waiting cannot deadlock.
Output and numbers: ce_parts.txt / ce_parts.json beside this file."""
import json, sys
import torch
import triton
import triton.language as tl
sys.path.insert(0, "benchmarks")
from common import card_name, median, time_blocks
from oelm_core import model as M
import bench_ce as B


@triton.jit
def _ce_parts_kernel(logits_ptr, stride, targets_ptr, loss_ptr, inv_n_ptr, stats_ptr, sync_ptr,
                     vocab, padded, width, PARTS: tl.constexpr, PARTS_P2: tl.constexpr,
                     WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    ticket = tl.atomic_add(sync_ptr, 1, sem="relaxed")
    row = (ticket // PARTS).to(tl.int64)
    part = ticket % PARTS
    lo = part * width
    cols = lo + tl.arange(0, BLOCK)
    mine = (cols < lo + width) & (cols < padded)
    base = logits_ptr + row * stride
    x = tl.load(base + cols, mask=mine & (cols < vocab), other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    s = tl.sum(tl.exp(x - tl.where(m == float("-inf"), 0.0, m)), 0)
    stats = stats_ptr + (row * PARTS + part) * 2
    tl.store(stats, m)
    tl.store(stats + 1, s)
    tl.debug_barrier()
    counter = sync_ptr + 1 + row
    arrived = tl.atomic_add(counter, 1, sem="acq_rel") + 1
    while arrived < PARTS:
        arrived = tl.atomic_add(counter, 0, sem="acquire")
    parts = tl.arange(0, PARTS_P2)
    ms = tl.load(stats_ptr + (row * PARTS + parts) * 2, mask=parts < PARTS, other=float("-inf"),
                 cache_modifier=".cg")
    ss = tl.load(stats_ptr + (row * PARTS + parts) * 2 + 1, mask=parts < PARTS, other=0.0,
                 cache_modifier=".cg")
    big = tl.max(ms, 0)
    lse = big + tl.log(tl.sum(ss * tl.exp(ms - big), 0))
    target = tl.load(targets_ptr + row)
    valid = target >= 0
    safe_t = tl.where(valid, target, 0)
    t_logit = tl.sum(tl.where(cols == safe_t, x, 0.0), 0)
    owner = (safe_t >= lo) & (safe_t < lo + width)
    tl.store(loss_ptr + row, tl.where(valid, lse - t_logit, 0.0), mask=owner)
    if WRITE_GRAD:
        scale = tl.where(valid, tl.load(inv_n_ptr), 0.0)
        g = tl.exp(x - lse)
        g = tl.where(cols == safe_t, g - 1.0, g) * scale
        tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=mine)


PARTS = [None]  # (parts, num_warps), or None for the library's kernel


def ce_rows(logits, targets, row_loss, inv_n, vocab, write_grad):
    rows, padded = logits.shape
    if PARTS[0] is None:
        LIBRARY_KERNEL[(rows,)](logits, logits.stride(0), targets, row_loss, inv_n, vocab, padded,
                                WRITE_GRAD=write_grad, BLOCK=2048, num_warps=4)
        return
    parts, warps = PARTS[0]
    width = -(-padded // parts)  # columns per part, rounded up to a multiple of 64
    width = -(-width // 64) * 64
    sync = torch.zeros(1 + rows, dtype=torch.int32, device=logits.device)
    stats = torch.empty(rows * parts * 2, dtype=torch.float32, device=logits.device)
    _ce_parts_kernel[(rows * parts,)](logits, logits.stride(0), targets, row_loss, inv_n, stats, sync,
                                      vocab, padded, width, PARTS=parts,
                                      PARTS_P2=triton.next_power_of_2(parts), WRITE_GRAD=write_grad,
                                      BLOCK=triton.next_power_of_2(width), num_warps=warps)


class _Launch:
    """Stands in for M._ce_rows_kernel inside linear_cross_entropy: kernel[grid](...) -> ce_rows."""
    def __getitem__(self, grid):
        return lambda logits, stride, targets, loss, inv_n, vocab, padded, WRITE_GRAD, BLOCK, num_warps: \
            ce_rows(logits, targets, loss, inv_n, vocab, WRITE_GRAD)


LIBRARY_KERNEL = M._ce_rows_kernel


def t(fn, reps=20):
    time_blocks(fn, 1, 3, cuda=True)
    return 1000 * median(time_blocks(fn, reps, 1, cuda=True))


def main():
    print(card_name(), torch.__version__, triton.__version__, flush=True)
    out = {}
    for rows in (8192, 4096):
        logits, targets, inv_n = B.make_slice(rows, "cuda")
        ref = B.reference(logits, targets, inv_n)
        other = torch.empty_like(logits)
        copy = t(lambda: other.copy_(logits))
        print(f"rows {rows}: copy {copy:.3f} ms", flush=True)
        work, loss = logits.clone(), torch.empty(rows, device="cuda")
        configs = [None] + [(p, w) for p in (4, 7, 8, 13, 16, 25, 32) for w in (2, 4, 8, 16)
                            if not (p <= 8 and w < 4) and not (p >= 16 and w > 8)]
        for cfg in configs:
            PARTS[0] = cfg
            x, l = logits.clone(), torch.empty(rows, device="cuda")
            ce_rows(x, targets, l, inv_n, B.VOCAB, True)
            torch.cuda.synchronize()
            le = float((l - ref[0]).abs().max())
            ge = float((x[:, :B.VOCAB].float() - ref[1]).abs().max() / ref[1].abs().max())
            pz = bool((x[:, B.VOCAB:] == 0).all())
            ms = t(lambda: ce_rows(work, targets, loss, inv_n, B.VOCAB, True))
            ms_nog = t(lambda: ce_rows(work, targets, loss, inv_n, B.VOCAB, False))
            print(f"  {str(cfg):10s} {ms:.3f} ms (x copy {ms / copy:.2f}); loss only {ms_nog:.3f}; "
                  f"loss err {le:.1e} grad err {ge:.1e} pad0 {pz}", flush=True)
            out[f"{rows}_{cfg}"] = dict(ms=ms, loss_only=ms_nog, copy=copy, le=le, ge=ge, pz=pz)
        del ref
    # the whole loss, forward + backward, at 64 x 512 and 8 x 512 tokens
    torch.manual_seed(0)
    w = (torch.randn(50304, 512, device="cuda") * 0.02).requires_grad_()
    M._ce_rows_kernel = _Launch()
    for n in (32768, 4096):
        x = torch.randn(n, 512, device="cuda", requires_grad=True)
        y = torch.randint(0, 50257, (n,), device="cuda")

        def step():
            with torch.autocast("cuda", torch.bfloat16):
                l = M.linear_cross_entropy(x, w, y, 50257)
            l.backward()
            return l.detach()
        res = {}
        for cfg in (None, (8, 4), (16, 4), (13, 4)):
            PARTS[0] = cfg
            x.grad = w.grad = None
            l = step()
            gx, gw = x.grad.clone(), w.grad.clone()
            res[str(cfg)] = (t(step, 10), float(l), gx, gw)
        base = res["None"]
        for k, (ms, l, gx, gw) in res.items():
            print(f"loss fwd+bwd n={n} {k:8s}: {ms:.3f} ms  loss {l:.6f} (d {l - base[1]:.1e}) "
                  f"gx rel {float((gx - base[2]).norm() / base[2].norm()):.1e} "
                  f"gw rel {float((gw - base[3]).norm() / base[3].norm()):.1e}", flush=True)
    json.dump(out, open(sys.argv[1] if len(sys.argv) > 1 else "/dev/null", "w"), indent=1)


main()
