"""oelm_core/cublaslt.py: the training step's GEMMs through cuBLASLt against torch's own products,
and the model's training step with and without them. GPU only, except the fallback check."""

import pytest
import torch
import torch.nn.functional as F

from oelm_core import cublaslt, logits_gemm
from oelm_core.model import _lt_dtype, build_model

CUDA = torch.cuda.is_available()


def gpu(test):
    """GPU only: marked `gpu` (make test-gpu runs them), skipped without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="cuBLASLt needs a GPU")(test))


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_off_the_gpu_the_model_keeps_torchs_ops():
    assert not cublaslt.available(torch.device("cpu"), torch.bfloat16)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        assert _lt_dtype(x) is None


@gpu
def test_only_low_precision_and_only_unless_switched_off(monkeypatch):
    cuda = torch.device("cuda")
    assert cublaslt.available(cuda, torch.bfloat16) and not cublaslt.available(cuda, torch.float32)
    monkeypatch.setenv("OELM_CUBLASLT", "0")
    assert not cublaslt.available(cuda, torch.bfloat16)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_equals_torch(dtype, trans_a, trans_b, with_bias):
    m, k, n = 40, 24, 56
    a = torch.randn((k, m) if trans_a else (m, k), device="cuda").to(dtype)
    b = torch.randn((n, k) if trans_b else (k, n), device="cuda").to(dtype)
    bias = torch.randn(n, device="cuda").to(dtype) if with_bias else None
    got = cublaslt.gemm(a, b, bias, trans_a, trans_b)
    want = (a.float().t() if trans_a else a.float()) @ (b.float().t() if trans_b else b.float())
    if with_bias:
        want = want + bias.float()
    assert got.shape == (m, n) and got.dtype == dtype
    assert _rel(got, want) < 4e-3  # one rounding of the float32 result to 8 (bf16) or 11 bits


@gpu
def test_strided_operands_and_row_slices_of_the_output():
    a = torch.randn(40, 48, device="cuda").bfloat16()
    b = torch.randn(56, 24, device="cuda").bfloat16()
    got = cublaslt.gemm(a[:, ::2], b.t(), None, False, False)  # a column stride of 2; a transposed view
    assert _rel(got, a[:, ::2].float() @ b.float().t()) < 4e-3
    wide = torch.zeros(40, 100, device="cuda", dtype=torch.bfloat16)
    cublaslt.matmul_into(wide[:, 10:66], a[:, :24].contiguous(), b.t().contiguous())
    assert _rel(wide[:, 10:66], a[:, :24].float() @ b.float().t()) < 4e-3
    assert wide[:, :10].abs().max() == 0 and wide[:, 66:].abs().max() == 0


@gpu
@pytest.mark.parametrize("sliced", [False, True])
def test_a_float32_sum_of_products_is_added_once_per_call(sliced):
    """The output layer's weight gradient over slices: out (float32) += a^T b for bf16 a, b. The
    first call times the candidates on a buffer of out's layout: out still gets the product once,
    also where out is a column slice of a wider tensor (its rows further apart than its width)."""
    a = torch.randn(256, 96, device="cuda").bfloat16()
    b = torch.randn(256, 40, device="cuda").bfloat16()
    product = a.float().t() @ b.float()
    wide = torch.randn(96, 64 if sliced else 40, device="cuda")
    out = wide[:, 8:48] if sliced else wide
    start, whole = out.clone(), wide.clone()
    for calls in (1, 2):
        cublaslt.matmul_into(out, a, b, trans_a=True, accumulate=True)
        assert _rel(out - start, calls * product) < 1e-5
    cublaslt.matmul_into(out, a, b, trans_a=True)  # without accumulate: the product alone
    assert _rel(out, product) < 1e-5
    if sliced:  # nothing written beside the slice
        assert torch.equal(wide[:, :8], whole[:, :8]) and torch.equal(wide[:, 48:], whole[:, 48:])


@gpu
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_gelu_writes_the_tanh_gelu_and_its_input(with_bias):
    x = torch.randn(256, 64, device="cuda").bfloat16()
    w = torch.randn(128, 64, device="cuda").bfloat16() / 8
    b = torch.randn(128, device="cuda").bfloat16() if with_bias else None
    h, pre = cublaslt.gemm_gelu(x, w, b)
    want_pre = x.float() @ w.float().t() + (b.float() if with_bias else 0)
    assert _rel(pre, want_pre) < 4e-3
    tanh, erf = (F.gelu(want_pre, approximate=a).bfloat16() for a in ("tanh", "none"))
    assert _rel(h, tanh) < 4e-3
    # The two forms differ by less than that bound, but in bf16 ~13% of the values round apart:
    # the epilogue's values must be the tanh form's far more often than the erf form's.
    assert (h == tanh).float().mean() > (h == erf).float().mean() + 0.05


@gpu
def test_a_problem_cublaslt_refuses_falls_back_to_torch():
    lt = cublaslt._lt(torch.cuda.current_device())
    x = torch.randn(32, 16, device="cuda").bfloat16()
    w = torch.randn(20, 16, device="cuda").bfloat16()
    out, pre = torch.empty(32, 20, device="cuda", dtype=torch.bfloat16), torch.empty(32, 20, device="cuda", dtype=torch.bfloat16)
    # GELU's pre-activation needs rows of a multiple of 8 elements: 20 is not
    assert not lt.matmul(x, w, out, False, True, cublaslt.EPILOGUE_GELU_AUX, aux=pre)
    h, pre = cublaslt.gemm_gelu(x, w, None)
    assert _rel(h, F.gelu(x.float() @ w.float().t(), approximate="tanh")) < 4e-3
    assert cublaslt.gemm(x[:0], w, None, False, True).shape == (0, 20)  # no rows: torch's answer


@gpu
def test_each_problem_is_timed_once_and_a_capture_uses_the_first_guess(monkeypatch):
    lt = cublaslt._lt(torch.cuda.current_device())
    a = torch.randn(96, 64, device="cuda").bfloat16()
    b = torch.randn(64, 80, device="cuda").bfloat16()
    out = torch.empty(96, 80, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):  # first seen inside a capture
        assert lt.matmul(a, b, out, False, False)
    (plan,) = [p for key, p in lt._plans.items() if key[1] == (80, 64, 80) and key[3] == (64, 96, 64)]
    assert plan.chosen is None  # not timed inside the capture
    g.replay()
    torch.cuda.synchronize()
    assert _rel(out, a.float() @ b.float()) < 4e-3
    timed = []
    real = cublaslt._Lt._fastest
    monkeypatch.setattr(cublaslt._Lt, "_fastest", lambda self, *a: timed.append(1) or real(self, *a))
    for _ in range(3):
        assert lt.matmul(a, b, out, False, False)  # outside: timed the first time only
    assert timed == [1] and 0 <= plan.chosen < len(plan.candidates)


@gpu
def test_deterministic_algorithms_keep_the_heuristics_first_guess():
    lt = cublaslt._lt(torch.cuda.current_device())
    a = torch.randn(72, 40, device="cuda").bfloat16()
    b = torch.randn(40, 88, device="cuda").bfloat16()
    out = torch.empty(72, 88, device="cuda", dtype=torch.bfloat16)
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        assert lt.matmul(a, b, out, False, False)
    finally:
        torch.use_deterministic_algorithms(False)
    (plan,) = [p for key, p in lt._plans.items() if key[1] == (88, 40, 88) and key[3] == (40, 72, 40)]
    assert plan.chosen == 0


def _gemm_calls_and_step(model, idx, monkeypatch):
    """(cuBLASLt GEMMs launched, loss, gradients) of one bf16 training step of ``model``."""
    calls = []
    real = cublaslt._Lt._launch
    monkeypatch.setattr(cublaslt._Lt, "_launch", lambda self, *a: calls.append(1) or real(self, *a))
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", torch.bfloat16):
        loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    monkeypatch.setattr(cublaslt._Lt, "_launch", real)
    return len(calls), float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}


@gpu
@pytest.mark.parametrize("variant", ["gpt_base", "oelm_nofreeze", "oelm_freeze"])
@pytest.mark.parametrize("chunk", [8192, 48])
def test_a_training_step_matches_torchs_ops(variant, chunk, monkeypatch):
    """Loss and every gradient of a bf16 training step, through cuBLASLt and through torch's ops
    (copied weights, one batch, the loss in one slice or in three): equal within bf16 rounding.
    The GEMMs counted: frozen Q/K cost one forward and one input-gradient GEMM more per layer
    than Q/K/V in one product (kept apart so that their weight gets no gradient), not two."""
    torch.manual_seed(0)
    model = build_model("tiny", variant, loss_chunk_tokens=chunk).cuda()
    idx = torch.randint(0, model.cfg.vocab_size, (4, model.cfg.block_size), device="cuda")
    for _ in range(2):  # the first step times each problem's candidates
        launches, loss_lt, grads_lt = _gemm_calls_and_step(model, idx, monkeypatch)
    n, slices = model.cfg.n_layer, -(-4 * (model.cfg.block_size - 1) // chunk)
    # per layer: q/k/v (3, or 5 apart), projection (3), MLP (6); the loss: 3 a slice (over several
    # slices its weight gradient is summed in float32), 2 where the logits come from the fused
    # Triton GEMM (oelm_core/logits_gemm.py)
    fused = logits_gemm.available(idx.device, torch.bfloat16, model.cfg.d_model, model.cfg.padded_vocab_size)
    assert launches == n * (5 if variant == "oelm_freeze" else 3) + n * 3 + n * 6 + (2 if fused else 3) * slices
    monkeypatch.setenv("OELM_CUBLASLT", "0")
    monkeypatch.setenv("OELM_FUSED_LOGITS", "0")  # all of it through torch's ops and the loss kernel
    launches, loss_torch, grads_torch = _gemm_calls_and_step(model, idx, monkeypatch)
    assert launches == 0
    assert abs(loss_lt - loss_torch) < 2e-3 * abs(loss_torch)
    assert grads_lt.keys() == grads_torch.keys()
    for name in grads_torch:
        assert _rel(grads_lt[name], grads_torch[name]) < 3e-2, name
