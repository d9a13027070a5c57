"""Scratch (this 2-core AMD EPYC, torch 2.13.0+cpu, one thread): one-row products at the decoding
step's shapes, the layout the model uses against oneDNN's and MKL's packed weights, and a plain
sum of the same bytes. Output: cpu_gemv.txt."""
import torch, time
torch.set_num_threads(1)
print(torch._C._has_mkldnn, torch.backends.mkl.is_available())
def t(f, n=200):
    for _ in range(20): f()
    ts=[]
    for _ in range(n):
        a=time.perf_counter(); f(); ts.append(time.perf_counter()-a)
    ts.sort(); return ts[len(ts)//2]*1e6
for (o, i) in [(512, 512), (512, 2048), (1536, 512), (2048, 512), (50304, 512)]:
    nc = 24 if o < 50000 else 2
    Ws = [torch.randn(o, i) for _ in range(nc)]
    Wts = [w.t().contiguous() for w in Ws]
    h = torch.randn(1, i)
    mb = o*i*4/1e6
    k=[0]
    def nxt(L):
        k[0]=(k[0]+1)%nc; return L[k[0]]
    res = {}
    res["best mm"] = t(lambda: h @ nxt(Wts)) if o >= 1024 else t(lambda: torch.mv(nxt(Ws), h[0]))
    try:
        P = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in Ws]
        res["onednn packed"] = t(lambda: torch.ops.mkldnn._linear_pointwise(h, nxt(P), None, "none", [], ""))
    except Exception as e:
        print("onednn", type(e).__name__, str(e)[:200])
    try:
        P2 = [torch.ops.mkl._mkl_reorder_linear_weight(w, 1) for w in Ws]
        res["mkl packed"] = t(lambda: torch.ops.mkl._mkl_linear(h, nxt(P2), Ws[k[0]], None, 1))
    except Exception as e:
        print("mkl", type(e).__name__, str(e)[:200])
    res["sum"] = t(lambda: nxt(Ws).sum())
    print(f"out {o} in {i} ({mb:.1f} MB): " + "  ".join(f"{k}: {v:.0f}us ({mb/v*1e3:.1f}GB/s)" for k, v in res.items()), flush=True)
