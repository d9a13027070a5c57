"""Scratch: every cuBLASLt heuristic algorithm for the MLP's epilogue GEMMs, GPU time in CUDA graphs."""
import json, os, sys
import torch
import torch.nn.functional as F
sys.path.insert(0, ".")
from oelm_core import cublaslt as C

dev = torch.device("cuda")
lt = C._lt(0)
lt.n_algos = 16
out = {}


def gtime(fn, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay(); torch.cuda.synchronize()
    st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    r = []
    for _ in range(7):
        st.record(); g.replay(); en.record(); torch.cuda.synchronize()
        r.append(st.elapsed_time(en) / reps * 1000)
    return sorted(r)[3]


for M in (32768, 4096):
    D, Fd = 512, 2048
    bf = torch.bfloat16
    x = torch.randn(M, D, device=dev, dtype=bf)
    w1 = torch.randn(Fd, D, device=dev, dtype=bf) * 0.04
    b1 = torch.randn(Fd, device=dev, dtype=bf) * 0.1
    w2 = torch.randn(D, Fd, device=dev, dtype=bf) * 0.02
    gy = torch.randn(M, D, device=dev, dtype=bf)
    pre = torch.randn(M, Fd, device=dev, dtype=bf)
    h = torch.empty_like(pre); d = torch.empty_like(pre); db = torch.empty(Fd, device=dev, dtype=bf)
    res = {}
    res["torch addmm fc"] = gtime(lambda: torch.addmm(b1, x, w1.t()))
    cg = torch.compile(lambda b, x, w: F.gelu(torch.addmm(b, x, w.t()), approximate="tanh"))
    res["torch addmm fc + gelu (compiled)"] = gtime(lambda: cg(b1, x, w1))
    res["torch g@w2"] = gtime(lambda: gy @ w2)
    cb = torch.compile(lambda g, w, p: (lambda t: (t, t.sum(0)))(torch.ops.aten.gelu_backward(g @ w, p, approximate="tanh")))
    res["torch g@w2 + dgelu + bias sum (compiled)"] = gtime(lambda: cb(gy, w2, pre))
    cs = torch.compile(lambda t: t.sum(0))
    res["bias sum alone (compiled)"] = gtime(lambda: cs(d))
    cases = {
        "DEFAULT fc": (x, w1.t(), h, C.EPILOGUE_DEFAULT, None, None),
        "GELU_AUX_BIAS fc": (x, w1.t(), h, C.EPILOGUE_GELU_AUX_BIAS, b1, pre),
        "DEFAULT g@w2": (gy, w2, d, C.EPILOGUE_DEFAULT, None, None),
        "DGELU g@w2": (gy, w2, d, C.EPILOGUE_DGELU, None, pre),
        "DGELU_BGRAD g@w2": (gy, w2, d, C.EPILOGUE_DGELU_BGRAD, db, pre),
    }
    for name, (a, b, o, epi, bias, aux) in cases.items():
        lt.pick = {}
        lt._plans.clear(); lt.candidates.clear()
        lt.matmul(a, b, o, epi, bias=bias, aux=aux)
        (key,) = lt.candidates.keys()
        times = []
        for i in range(len(lt.candidates[key])):
            lt.pick = {key: i}; lt._plans.clear()
            try:
                times.append(round(gtime(lambda: lt.matmul(a, b, o, epi, bias=bias, aux=aux)), 1))
            except Exception as e:
                times.append(str(e)[:40])
        res[name] = times
    out[M] = res
    for k, v in res.items():
        print(M, k, v, flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "lt_algos.json"), "w"), indent=1)
