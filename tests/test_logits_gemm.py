"""oelm_core/logits_gemm.py: the logits GEMM with the loss's exponentials in its epilogue.

Its loss, gradient E * row scale and scaled input rows against float64, for ordinary rows, an
ignored row and rows whose logits climb far above the target's (rescaled from what the GEMM
stored, or recomputed from x and w); on a GPU also the whole loss against the cuBLAS + loss-kernel
path. Without a GPU the kernels run in Triton's CPU interpreter (float32; skipped without Triton).
"""

import sys
from pathlib import Path

import pytest
import torch


def _far_rows(w, x, targets):
    """Row 3: one logit ~50 above and the target ~70 below it, S within float32 (redone from what the
    GEMM stored); row 4: one logit 200, the target far below (S overflows: recomputed)."""
    for row, top, k in ((3, 50.0, 5), (4, 200.0, 7)):
        x[row] = w[k] * (top / float(w[k].norm() ** 2))
        targets[row] = int((w[:len(w) - 19] @ x[row]).argmin())  # the lowest real logit


def check_loss_and_grad(device: str) -> None:
    from oelm_core import logits_gemm
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # (the interpreter's bf16 dot is wrong)
    g = torch.Generator().manual_seed(0)
    n, d, vocab, padded = 37, 64, 301, 320  # a partial row tile and a partial column tile
    w = torch.randn(padded, d, generator=g) * 0.3
    w[vocab:] = 0
    x = torch.randn(n, d, generator=g)
    t = torch.randint(0, vocab, (n,), generator=g)
    _far_rows(w, x, t)
    t[6] = -1
    xq, wq = x.to(dtype), w.to(dtype)
    logits = xq.double() @ wq.double()[:vocab].T
    valid = t >= 0
    dist = logits.max(1).values - logits.gather(1, t.clamp(min=0)[:, None])[:, 0]
    assert 30 < float(dist[3]) < 85 and float(dist[4]) > 100  # the two far rows are what they say
    ref_loss = torch.where(valid, torch.logsumexp(logits, 1) - logits.gather(1, t.clamp(min=0)[:, None])[:, 0], 0.0)
    n_valid = int(valid.sum())
    ref_grad = torch.softmax(logits, 1)
    ref_grad[torch.arange(n), t.clamp(min=0)] -= 1.0
    ref_grad *= (valid / n_valid)[:, None]

    xd, wd, td = xq.to(device), wq.to(device), t.to(device)
    inv_n = torch.tensor([1.0 / n_valid], device=device)
    loss, scale = torch.empty(n, device=device), torch.empty(n, device=device)
    x_scaled = torch.empty_like(xd)
    e = logits_gemm.loss_and_grad(xd, wd, td, vocab, inv_n, loss, scale, x_scaled)
    e, loss, scale = e.double().cpu(), loss.double().cpu(), scale.double().cpu()
    got = e * scale[:, None]

    loss_tol, grad_tol = (1e-5, 1e-7) if dtype == torch.float32 else (5e-3, 2 ** -8 / n_valid)
    assert float(((loss - ref_loss).abs() / ref_loss.abs().clamp(min=1)).max()) < loss_tol
    assert float((got[:, :vocab] - ref_grad).abs().max()) < grad_tol
    assert float(e[:, vocab:].abs().max()) == 0.0
    assert float(e[6].abs().max()) == 0.0 and float(loss[6]) == 0.0 and float(scale[6]) == 0.0  # ignored
    for row in (3, 4):  # redone with the offset at the row's max, whose own entry is exactly 1
        assert float(e[row].max()) == 1.0
    assert float(ref_loss[4]) > 250  # the recomputed row's loss, to float32 rounding of its logits
    assert torch.equal(x_scaled.cpu(), (xd.float() * scale.float().to(device)[:, None]).to(dtype).cpu())


def check_against_cublas_path(device: str) -> None:
    """The model's CUDA loss (``_ce_forward_cuda``, bf16, three slices) with the fused GEMM against
    cuBLAS + ``_ce_rows_kernel``: the loss within the bf16 rounding of the latter's logits, the
    gradients within bf16 noise."""
    import os
    from oelm_core.model import _ce_forward_cuda
    g = torch.Generator().manual_seed(1)
    n, d, vocab, padded = 2500, 512, 50257, 50304
    x = torch.randn(n, d, generator=g).to(device)
    w = (torch.randn(padded, d, generator=g) * 0.1).to(device)
    t = torch.randint(0, vocab, (n,), generator=g).to(device)
    t[::11] = -1
    out = {}
    for fused in ("1", "0"):
        os.environ["OELM_FUSED_LOGITS"] = fused
        try:
            loss, gx, gw, row_scale = _ce_forward_cuda(x, w, t, vocab, 1024, torch.bfloat16, True)
        finally:
            del os.environ["OELM_FUSED_LOGITS"]
        out[fused] = (float(loss), (gx.float() * row_scale[:, None]), gw.float())
    (l1, gx1, gw1), (l0, gx0, gw0) = out["1"], out["0"]
    assert abs(l1 - l0) < 1e-3 * l0, (l1, l0)
    for a, b in ((gx1, gx0), (gw1, gw0)):
        assert float((a - b).norm() / b.norm()) < 1e-2


@pytest.mark.parametrize("check", ["check_loss_and_grad", "check_against_cublas_path"])
def test_the_fused_logits_gemm(check):
    """On a Hopper GPU here; without a GPU, the first check through Triton's CPU interpreter."""
    pytest.importorskip("triton")
    from oelm_core import logits_gemm
    if torch.cuda.is_available():
        if not logits_gemm.available(torch.device("cuda"), torch.bfloat16, 512, 50304):
            pytest.skip("the fused logits GEMM needs TMA (compute capability 9+)")
        globals()[check]("cuda")
    elif check == "check_against_cublas_path":
        pytest.skip("compares two CUDA paths")
    else:
        from conftest import run_in_triton_interpreter
        run_in_triton_interpreter(Path(__file__), check)


if __name__ == "__main__":  # the interpreter subprocess: python test_logits_gemm.py CHECK
    globals()[sys.argv[1]]("cpu")
