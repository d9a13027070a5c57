"""Scratch (session of 2026-11-26, eleventh stop): the output layer's three GEMMs per 8,192-token
slice at medium512, cuBLAS as the step calls it against other ways of asking for the same product.
Prints ms (median of 20, CUDA events) and TFLOP/s per variant. Not part of the harness."""
import statistics
import torch
import torch._inductor.config as icfg

torch.manual_seed(0)
dev = "cuda"
N, V, D = 8192, 50304, 512
xs = torch.randn(N, D, device=dev, dtype=torch.bfloat16)
wc = (torch.randn(V, D, device=dev) * 0.02).to(torch.bfloat16)
logits = torch.randn(N, V, device=dev, dtype=torch.bfloat16) * 1e-3
gx = torch.empty(N, D, device=dev, dtype=torch.bfloat16)
gw = torch.zeros(V, D, device=dev, dtype=torch.float32)
flop = 2 * N * V * D


def timeit(fn, reps=20):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def report(name, fn, ref=None):
    ms = timeit(fn)
    err = ""
    if ref is not None:
        out = fn()
        err = f"  max|diff| {float((out.float() - ref.float()).abs().max()):.2e}"
    print(f"{name:58s} {ms:7.3f} ms  {flop / ms / 1e9:6.0f} TFLOP/s{err}", flush=True)
    return ms


def run_all(tag):
    print(f"--- {tag}")
    ref_f = xs @ wc.T
    report("fwd  logits = xs @ wc.T", lambda: xs @ wc.T)
    report("fwd  torch.mm(xs, wc.T, out=logits)", lambda: torch.mm(xs, wc.T, out=logits))
    ref_x = torch.mm(logits, wc)
    report("dX   torch.mm(logits, wc, out=gx)", lambda: torch.mm(logits, wc, out=gx))
    report("dX   via transposes: mm(wc.T, logits.T, out=gx.T)", lambda: (torch.mm(wc.T, logits.T, out=gx.T), gx)[1], ref_x)
    h = D // 2
    def halves_d():
        torch.mm(logits, wc[:, :h], out=gx[:, :h]); torch.mm(logits, wc[:, h:], out=gx[:, h:]); return gx
    report("dX   two halves of d_model (strided out)", halves_d, ref_x)
    k = 25152
    def halves_k():
        torch.mm(logits[:, :k], wc[:k], out=gx); gx.addmm_(logits[:, k:], wc[k:]); return gx
    report("dX   two halves of the vocabulary (addmm_ beta=1)", halves_k, ref_x)
    m = N // 2
    def halves_m():
        torch.mm(logits[:m], wc, out=gx[:m]); torch.mm(logits[m:], wc, out=gx[m:]); return gx
    report("dX   two halves of the rows", halves_m, ref_x)
    def dw_first():
        return logits.T @ xs
    report("dW   logits.T @ xs (bf16 out)", dw_first)
    def dw_acc():
        torch.addmm(gw, logits.T, xs, out_dtype=torch.float32, out=gw); return gw
    report("dW   addmm fp32 accumulate (as the step)", dw_acc)
    def dw_acc_t():
        torch.addmm(gw.T, xs.T, logits, out_dtype=torch.float32, out=gw.T); return gw
    report("dW   addmm fp32 accumulate, transposed problem", dw_acc_t)


run_all("default (cuBLAS)")
try:
    torch.backends.cuda.preferred_blas_library("cublaslt")
    run_all("preferred_blas_library('cublaslt')")
finally:
    torch.backends.cuda.preferred_blas_library("default")

icfg.max_autotune_gemm_backends = "TRITON,CUBLAS"
for tma in (False, True):
    try:
        icfg.triton.enable_persistent_tma_matmul = tma
    except AttributeError:
        pass
    torch._dynamo.reset()
    print(f"--- inductor max-autotune (Triton + cuBLAS choices, persistent TMA {tma})")
    f_fwd = torch.compile(lambda a, b: a @ b.T, mode="max-autotune-no-cudagraphs")
    f_dx = torch.compile(lambda a, b: a @ b, mode="max-autotune-no-cudagraphs")
    f_dw = torch.compile(lambda g, a, b: g + (a.T @ b).float(), mode="max-autotune-no-cudagraphs")
    report("fwd  compiled", lambda: f_fwd(xs, wc))
    report("dX   compiled", lambda: f_dx(logits, wc), torch.mm(logits, wc))
    report("dW   compiled (g + (a.T @ b).float())", lambda: f_dw(gw, logits, xs))
