"""Scratch: oelm_core.model._gelu_backward_kernel launch shapes against torch.compile's GELU' + bias
sum (two kernels), at the MLP's 32,768 x 2,048 bf16 on this GPU."""
import sys
import torch
import triton
sys.path.insert(0, "benchmarks")
from common import median, time_blocks  # noqa: E402
from oelm_core import model as M  # noqa: E402

m, n = 32768, 2048
g = torch.randn(m, n, device="cuda").bfloat16()
pre = (torch.randn(m, n, device="cuda") * 2).bfloat16()


def t(fn):
    time_blocks(fn, 1, 3, cuda=True)
    return 1000 * median(time_blocks(fn, 15, 1, cuda=True))


@torch.compile
def compiled(g, pre):
    d = torch.ops.aten.gelu_backward(g, pre, approximate="tanh")
    return d, d.sum(0)


print("compiled gelu_backward + sum: %.1f us" % (1000 * t(lambda: compiled(g, pre))))
want = compiled(g, pre)
copy = torch.empty_like(g)
print("copy of one (32768 x 2048 bf16): %.1f us" % (1000 * t(lambda: copy.copy_(g))))
for rows, bm, bn, warps in [(256, 32, 128, 4), (64, 16, 256, 4), (128, 16, 256, 8), (256, 8, 512, 4),
                            (512, 32, 128, 8), (128, 32, 256, 8), (64, 64, 128, 4), (128, 64, 128, 8),
                            (64, 32, 256, 4), (256, 16, 256, 4), (32, 32, 256, 4), (64, 64, 64, 4)]:
    out = torch.empty_like(g)
    part = torch.empty((triton.cdiv(m, rows), n), dtype=torch.float32, device="cuda")

    def run():
        M._gelu_backward_kernel[(part.size(0), triton.cdiv(n, bn))](g, pre, out, part, m, n, ROWS=rows,
                                                                     BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
        return part.sum(0)
    k = t(lambda: M._gelu_backward_kernel[(part.size(0), triton.cdiv(n, bn))](
        g, pre, out, part, m, n, ROWS=rows, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps))
    total = t(run)
    b = run()
    ok = bool((out.float() - want[0].float()).abs().max() <= 2 ** -7 * want[0].float().abs().max()) and \
        bool(torch.allclose(b, want[1].float(), rtol=1e-3, atol=1e-1))
    print(f"rows {rows} block {bm}x{bn} warps {warps}: kernel {1000 * k:.1f} us, with the sum {1000 * total:.1f} us, ok {ok}", flush=True)
