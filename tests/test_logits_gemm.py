"""oelm_core/logits_gemm.py: the logits GEMM with the loss's exponentials in its epilogue.

Its loss, gradient E * row scale and scaled input rows against float64, for ordinary rows, an
ignored row and rows whose logits climb far above the target's (rescaled from what the GEMM
stored, or recomputed from x and w), with the library's tiles and (in the interpreter) with small
ones, so that each program walks many tiles; the finishing kernel alone on planted sums, where its
two ways of redoing a row give different answers; on a GPU also the whole loss against the cuBLAS +
loss-kernel path. Without a GPU the kernels run in Triton's CPU interpreter (float32; skipped
without Triton or with one whose interpreter cannot run them, conftest.triton_interpreter_unusable).
"""

import math
import os
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
    _loss_and_grad(device)
    if device == "cpu":  # 3 row tiles x 10 column tiles, 15 a program (the interpreter runs 2)
        logits_gemm.BLOCK_M, logits_gemm.BLOCK_N, logits_gemm.BLOCK_K = 16, 32, 16
        _loss_and_grad(device)


def _loss_and_grad(device: str) -> None:
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

    # nats, whatever the loss: the far rows' losses are 70-280 nats, and bf16 E in the rescaled row
    loss_tol, grad_tol = (2e-4, 1e-7) if dtype == torch.float32 else (5e-3, 2 ** -8 / n_valid)
    assert float((loss - ref_loss).abs().max()) < loss_tol
    assert float((got[:, :vocab] - ref_grad).abs().max()) < grad_tol
    assert float(e[:, vocab:].abs().max()) == 0.0
    assert float(e[6].abs().max()) == 0.0 and float(loss[6]) == 0.0 and float(scale[6]) == 0.0  # ignored
    for row in (3, 4):  # redone with the offset at the row's max, whose own entry is exactly 1
        assert float(e[row].max()) == 1.0
    assert float(ref_loss[4]) > 250  # the recomputed row's loss, to float32 rounding of its logits
    assert torch.equal(x_scaled.cpu(), (xd.float() * scale.float().to(device)[:, None]).to(dtype).cpu())


def check_finish_tiers(device: str) -> None:
    """``_finish_kernel`` alone, on E and row sums planted as the GEMM would leave them, where its two
    ways of redoing a row disagree (x and w say something else than the planted E): row 0 one entry
    e^35 (rescaled), row 1 an entry past bf16's range with a finite float32 sum, as a logit 88.72
    nats above the target's leaves it (recomputed from x and w: a logit 100 over 0s), row 2 many
    entries of e^25 (rescaled), row 3 ignored with a NaN sum (left alone)."""
    from oelm_core import logits_gemm
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n, d, vocab, padded, target = 4, 64, 301, 320, 5
    e = torch.zeros(n, padded, dtype=torch.float64)
    e[:, target] = 1.0
    e[0, 10], e[0, 11] = math.exp(35), math.exp(20)
    e[1, 10] = float("inf")
    e[2, :vocab] = math.exp(25)
    e[2, target] = 1.0
    e[3] = 0.0
    sums = e.sum(1)
    sums[1], sums[3] = 3.2e38, float("nan")
    x, w = torch.zeros(n, d), torch.zeros(padded, d)
    x[:, 0], w[10, 0] = 1.0, 100.0  # the logits x w^T: 100 at column 10, 0 elsewhere (for every row)
    targets = torch.tensor([target, target, target, -1])
    col_tiles = 3  # the sums in three parts, as three column tiles would leave them
    part = torch.stack([sums / 2, sums / 4, sums / 4], 1)
    e_q = e.to(dtype)
    dev = dict(device=device)
    e_d, loss, scale = e_q.clone().to(**dev), torch.empty(n, **dev), torch.empty(n, **dev)  # (worked in place)
    x_d, x_scaled = x.to(dtype).to(**dev), torch.empty(n, d, dtype=dtype, **dev)
    inv_n = torch.tensor([1 / 3], **dev)
    c = torch.zeros(n, **dev)  # the target's logit
    logits_gemm._finish_kernel[(n,)](e_d, part.float().to(**dev), col_tiles, targets.to(**dev), c, x_d,
                                     w.to(dtype).to(**dev), d, vocab, padded, loss, scale, inv_n, x_scaled,
                                     BLOCK_T=4, BLOCK=128, BLOCK_D=64, BLOCK_V=16, num_warps=4)
    got, loss, scale = e_d.double().cpu(), loss.double().cpu(), scale.double().cpu()
    stored = e_q.double()
    want = torch.zeros(n, padded, dtype=torch.float64)
    for row in (0, 2):  # rescaled by the largest stored entry
        want[row] = stored[row] / stored[row].max()
    want[1, :vocab] = torch.exp(torch.tensor(-100.0, dtype=torch.float64))
    want[1, 10] = 1.0
    s = want[:3].sum(1)
    want_loss = torch.tensor([math.log(stored[0].max()), 100.0, math.log(stored[2].max())]) + s.log()
    target_entry = want[:3, target] - s
    want[:3, target] = target_entry
    assert float((loss[:3] - want_loss).abs().max()) < 1e-4, (loss, want_loss)
    assert float((scale[:3] - 1 / 3 / s).abs().max() / (1 / 3 / s).max()) < 1e-5
    assert float((got[:3] - want[:3]).abs().max()) < 2 ** -8
    assert float(got[0].max()) == 1.0 and float(got[2].max()) == 1.0 and float(got[1, 10]) == 1.0
    assert float(got[3].abs().max()) == 0.0 and float(loss[3]) == 0.0 and float(scale[3]) == 0.0


def check_against_cublas_path(device: str) -> None:
    """The model's CUDA loss (``_ce_forward_cuda``, bf16, three slices) with the fused GEMM against
    cuBLAS + ``_ce_rows_kernel``: the loss within the bf16 rounding of the latter's logits, the
    gradients within bf16 noise."""
    from oelm_core.model import _ce_forward_cuda
    g = torch.Generator().manual_seed(1)
    n, d, vocab, padded = 2500, 512, 50257, 50304
    x = torch.randn(n, d, generator=g).to(device)
    w = (torch.randn(padded, d, generator=g) * 0.1).to(device)
    t = torch.randint(0, vocab, (n,), generator=g).to(device)
    t[::11] = -1
    out, saved = {}, os.environ.get("OELM_FUSED_LOGITS")
    for fused in ("1", "0"):
        os.environ["OELM_FUSED_LOGITS"] = fused
        try:
            loss, gx, gw, row_scale = _ce_forward_cuda(x, w, t, vocab, 1024, torch.bfloat16, True)
        finally:
            os.environ.pop("OELM_FUSED_LOGITS")
            if saved is not None:
                os.environ["OELM_FUSED_LOGITS"] = saved
        out[fused] = (float(loss), (gx.float() * row_scale[:, None]), gw.float())
    (l1, gx1, gw1), (l0, gx0, gw0) = out["1"], out["0"]
    assert abs(l1 - l0) < 1e-3 * l0, (l1, l0)
    for a, b in ((gx1, gx0), (gw1, gw0)):
        assert float((a - b).norm() / b.norm()) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("check", ["check_loss_and_grad", "check_finish_tiers", "check_against_cublas_path"])
def test_the_fused_logits_gemm(check):
    """On a Hopper GPU here; without a GPU, the first two checks through Triton's CPU interpreter."""
    pytest.importorskip("triton")
    from oelm_core import logits_gemm
    if torch.cuda.is_available():
        if not logits_gemm.available(torch.device("cuda"), torch.bfloat16, 512, 50304):
            pytest.skip("the fused logits GEMM does not run here (it needs Triton >= 3.4, compute "
                        "capability 9+ with ~216 KB of shared memory a program, OELM_FUSED_LOGITS not 0)")
        globals()[check]("cuda")
    elif check == "check_against_cublas_path":
        pytest.skip("compares two CUDA paths")
    else:
        from conftest import run_in_triton_interpreter
        run_in_triton_interpreter(Path(__file__), check)


# What the CPU runs under the interpreter, in one process (conftest.run_in_triton_interpreter).
INTERPRETER_CHECKS = [("check_loss_and_grad",), ("check_finish_tiers",)]

if __name__ == "__main__":  # the interpreter subprocess: python test_logits_gemm.py RESULTS.json
    from conftest import run_interpreter_checks
    run_interpreter_checks(globals(), sys.argv[1])
