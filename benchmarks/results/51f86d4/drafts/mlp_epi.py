"""Scratch: cuBLASLt GELU epilogues (oelm_core/cublaslt.py) against the plain MLP, correctness and time."""
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from oelm_core import cublaslt  # noqa: E402
from oelm_core.model import _FusedGeluMLP  # noqa: E402

dev = torch.device("cuda")
torch.manual_seed(0)
out = {}
print("available", cublaslt.available(dev, torch.bfloat16), cublaslt.available(dev, torch.float16))


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


# correctness at the real shape and a small odd one, bias and not
for (M, D, F_), bias in (((32768, 512, 2048), True), ((4096, 512, 2048), False), ((24, 40, 56), True)):
    p = [torch.randn(M, D, device=dev), torch.randn(F_, D, device=dev) * D ** -0.5,
         torch.randn(F_, device=dev) * 0.1 if bias else None, torch.randn(D, F_, device=dev) * F_ ** -0.5,
         torch.randn(D, device=dev) * 0.1 if bias else None]
    p32 = [t.clone().requires_grad_(True) if t is not None else None for t in p]
    y32 = F.linear(F.gelu(F.linear(p32[0], p32[1], p32[2]), approximate="tanh"), p32[3], p32[4])
    gy = torch.randn_like(y32)
    g32 = torch.autograd.grad(y32, [t for t in p32 if t is not None], gy)
    for name, fused in (("plain_bf16", False), ("fused_bf16", True)):
        pb = [t.to(torch.bfloat16).requires_grad_(True) if t is not None else None for t in p]
        if fused:
            y = _FusedGeluMLP.apply(*pb)
        else:
            y = F.linear(F.gelu(F.linear(pb[0], pb[1], pb[2]), approximate="tanh"), pb[3], pb[4])
        g = torch.autograd.grad(y, [t for t in pb if t is not None], gy.to(torch.bfloat16))
        errs = [rel(y, y32)] + [rel(a, b) for a, b in zip(g, g32)]
        key = f"{M}x{D}x{F_}_bias{int(bias)}_{name}"
        out[key] = errs
        print(key, " ".join(f"{e:.2e}" for e in errs))


def timeit(fn, n=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    res = []
    for _ in range(5):
        s.record()
        for _ in range(n):
            fn()
        e.record()
        torch.cuda.synchronize()
        res.append(s.elapsed_time(e) / n)
    return sorted(res)[2]


for M in (32768, 4096):
    D, F_ = 512, 2048
    x = torch.randn(M, D, device=dev, dtype=torch.bfloat16)
    w1 = torch.randn(F_, D, device=dev, dtype=torch.bfloat16) * 0.04
    b1 = torch.randn(F_, device=dev, dtype=torch.bfloat16) * 0.1
    w2 = torch.randn(D, F_, device=dev, dtype=torch.bfloat16) * 0.02
    b2 = torch.randn(D, device=dev, dtype=torch.bfloat16) * 0.1
    gy = torch.randn(M, D, device=dev, dtype=torch.bfloat16)
    pre = torch.randn(M, F_, device=dev, dtype=torch.bfloat16)
    h = torch.empty_like(pre)
    t = {}
    t["addmm fc"] = timeit(lambda: torch.addmm(b1, x, w1.t()))
    t["addmm fc + gelu"] = timeit(lambda: F.gelu(torch.addmm(b1, x, w1.t()), approximate="tanh"))
    t["lt linear_gelu"] = timeit(lambda: cublaslt.linear_gelu(x, w1, b1))
    t["mm g@w2"] = timeit(lambda: gy @ w2)
    t["mm g@w2 + dgelu + bsum (eager)"] = timeit(
        lambda: torch.ops.aten.gelu_backward(gy @ w2, pre, approximate="tanh").sum(0))
    comp = torch.compile(lambda g, w, p: (lambda d: (d, d.sum(0)))(torch.ops.aten.gelu_backward(g @ w, p, approximate="tanh")))
    t["mm g@w2 + dgelu + bsum (compiled)"] = timeit(lambda: comp(gy, w2, pre))
    t["lt matmul_dgelu"] = timeit(lambda: cublaslt.matmul_dgelu(gy, w2, pre, True))

    ps = [t_.detach().clone().float().requires_grad_(True) for t_ in (x, w1, b1, w2, b2)]

    def plain(x, w1, b1, w2, b2):
        return F.linear(F.gelu(F.linear(x, w1, b1), approximate="tanh"), w2, b2)

    def fused(x, w1, b1, w2, b2):
        return _FusedGeluMLP.apply(x.to(torch.bfloat16), w1.to(torch.bfloat16), b1.to(torch.bfloat16),
                                   w2.to(torch.bfloat16), b2.to(torch.bfloat16))
    gyf = gy.float()
    for name, f in (("plain", plain), ("fused", fused)):
        cf = torch.compile(f)

        def step():
            with torch.autocast("cuda", torch.bfloat16):
                y = cf(*ps)
            y.backward(gyf)
        t[f"mlp fwd+bwd compiled autocast: {name}"] = timeit(step, n=20)
    out[f"times_M{M}"] = t
    for k, v in t.items():
        print(f"M={M} {k}: {v*1000:.1f} us")

json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "mlp_epi.json"), "w"), indent=1)
