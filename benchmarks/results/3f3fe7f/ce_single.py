"""Scratch (not part of the library): the loss kernel before this change (two reads of each row)
against oelm_core.model._ce_rows_kernel (one read), on fresh copies of one 8,192-row slice, side by
side; and a slice with far logits (rows that make the kernel move its offset). Run from the root:
    PYTHONPATH=. python .device/ce_single.py
"""
import sys
import torch
import triton
import triton.language as tl
sys.path.insert(0, "benchmarks")
import bench_ce as B  # noqa: E402


@triton.jit
def old_kernel(logits_ptr, stride, targets_ptr, loss_ptr, inv_n_ptr, vocab, padded,
                    WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row of logits: loss = lse - logit[target]; then, in place, the
    gradient (softmax - one_hot) * valid / n_valid over all padded columns (0 past vocab).
    The running max and sum are scalars, so the first pass costs one exp per logit."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    target = tl.load(targets_ptr + row)
    cols0 = tl.arange(0, BLOCK)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.full([], 0.0, tl.float32)
    for off in tl.range(0, vocab, BLOCK):
        cols = off + cols0
        x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, 0))  # finite from the first block on (vocab > 0)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    valid = target >= 0
    safe_t = tl.where(valid, target, 0)
    t_logit = tl.load(base + safe_t).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - t_logit, 0.0))
    if WRITE_GRAD:
        scale = tl.where(valid, tl.load(inv_n_ptr), 0.0)
        for off in tl.range(0, padded, BLOCK):
            cols = off + cols0
            x = tl.load(base + cols, mask=cols < padded, other=0.0).to(tl.float32)
            g = tl.exp(x - lse)
            g = tl.where(cols == safe_t, g - 1.0, g)
            g = tl.where(cols < vocab, g * scale, 0.0)
            tl.store(base + cols, g.to(logits_ptr.dtype.element_ty), mask=cols < padded)




def variant(name, *edits):
    """oelm_core.model's kernel with text edits, written to a module of its own (Triton reads source)."""
    import importlib.util, inspect, os, tempfile, textwrap
    from oelm_core import model as M
    text = textwrap.dedent(inspect.getsource(M._ce_rows_kernel.fn)).replace("_CE_HEADROOM", "30.0")
    for a, b in edits:
        assert a in text, a
        text = text.replace(a, b)
    path = os.path.join(tempfile.mkdtemp(), f"ce_{name}.py")
    with open(path, "w") as f:
        f.write("import triton\nimport triton.language as tl\n\n" + text)
    spec = importlib.util.spec_from_file_location(f"ce_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._ce_rows_kernel


def main():
    rows = 8192
    logits, targets, inv_n = B.make_slice(rows, "cuda")
    ref = B.reference(logits, targets, inv_n)
    work = logits.clone()
    loss, scale = (torch.empty(rows, device="cuda") for _ in range(2))
    h = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16)
    h_scaled = torch.empty_like(h)
    kernels = {
        "lib": None,
        "no_slow": variant("no_slow", ("if m > c + 30.0:", "if m > 1e38:")),
    }

    def run(k, block, warps):
        if k is None:
            return B.run_kernel(work, targets, inv_n, loss, scale, h, h_scaled, block, warps)
        k[(rows,)](work, work.stride(0), targets, loss, scale, inv_n, h, h_scaled, 512, B.VOCAB, B.PADDED,
                   WRITE_GRAD=True, BLOCK=block, BLOCK_D=512, num_warps=warps)

    for block, warps in [(2048, 4), (1024, 4), (1024, 2), (2048, 8), (4096, 8), (512, 1), (4096, 4)]:
        old = B.time_ms(lambda: old_kernel[(rows,)](work, work.stride(0), targets, loss, inv_n, B.VOCAB, B.PADDED,
                                                     WRITE_GRAD=True, BLOCK=block, num_warps=warps),
                        20, restore=lambda: work.copy_(logits))
        line = f"{block}x{warps}: old {old:.3f}"
        for name, k in kernels.items():
            ms = B.time_ms(lambda: run(k, block, warps), 20, restore=lambda: work.copy_(logits))
            line += f"  {name} {ms:.3f}"
        chk = B.check(logits, targets, inv_n, ref, block, warps)
        print(line, f" lib check {chk}", flush=True)
    del ref
    other = torch.empty_like(logits)
    print("copy", B.time_ms(lambda: other.copy_(logits), 20))
    # far logits: every row's max 60+ nats above its target's in a late block (the slow path)
    far = logits.clone()
    far[:, 40000] = 60.0
    print("far rows, lib 2048x4:", B.time_ms(lambda: run(None, 2048, 4), 20, restore=lambda: work.copy_(far)))


if __name__ == "__main__":
    main()
