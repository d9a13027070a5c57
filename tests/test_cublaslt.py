"""oelm_core/cublaslt.py: the training step's GEMMs through cuBLASLt against torch's own products,
and the model's training step with and without them. GPU only, except the fallback checks."""

import pytest
import torch
import torch.nn.functional as F

from oelm_core import cublaslt
from oelm_core.model import _lt_dtype, build_model

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="cuBLASLt needs a GPU")


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_off_the_gpu_and_in_float32_the_model_keeps_torchs_ops():
    assert not cublaslt.available(torch.device("cpu"), torch.bfloat16)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        assert _lt_dtype(x) is None
    if CUDA:
        assert not cublaslt.available(torch.device("cuda"), torch.float32)


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("OELM_CUBLASLT", "0")
    assert not cublaslt.available(torch.device("cuda", 0), torch.bfloat16)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (False, True), (True, False), (True, True)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_equals_torch(dtype, trans_a, trans_b, with_bias):
    assert cublaslt.available(torch.device("cuda"), dtype)
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
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_gelu_writes_gelu_and_its_input(with_bias):
    x = torch.randn(64, 32, device="cuda").bfloat16()
    w = torch.randn(48, 32, device="cuda").bfloat16() / 32 ** 0.5
    b = torch.randn(48, device="cuda").bfloat16() if with_bias else None
    h, pre = cublaslt.gemm_gelu(x, w, b)
    want_pre = x.float() @ w.float().t() + (b.float() if with_bias else 0)
    assert _rel(pre, want_pre) < 4e-3
    assert _rel(h, F.gelu(want_pre, approximate="tanh")) < 4e-3  # the tanh form, as the model's
    assert (h.float() - F.gelu(want_pre, approximate="none")).abs().max() > 0  # not the erf form's bits


@gpu
def test_each_problem_is_timed_once_and_a_capture_uses_the_first_guess():
    lt = cublaslt._lt(torch.cuda.current_device())
    a = torch.randn(96, 64, device="cuda").bfloat16()
    b = torch.randn(64, 80, device="cuda").bfloat16()
    out = torch.empty(96, 80, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), torch.cuda.graph(g, stream=s):  # first seen inside a capture
        lt.matmul(a, b, out, False, False)
    (plan,) = [p for key, p in lt._plans.items() if key[1] == (80, 64, 80) and key[3] == (64, 96, 64)]
    assert plan[3] is None  # not timed inside the capture
    g.replay()
    torch.cuda.synchronize()
    assert _rel(out, a.float() @ b.float()) < 4e-3
    lt.matmul(a, b, out, False, False)  # outside: timed now, the fastest kept
    assert plan[3] is not None and 0 <= plan[3] < len(plan[2])


@gpu
@pytest.mark.parametrize("variant", ["gpt_base", "oelm_freeze"])
def test_a_training_step_matches_torchs_ops(variant, monkeypatch):
    """Loss and every gradient of a bf16 training step, through cuBLASLt and through torch's ops
    (copied weights, one batch): equal within bf16 rounding; frozen Q/K get no gradient."""
    torch.manual_seed(0)
    model = build_model("tiny", variant).cuda()
    idx = torch.randint(0, model.cfg.vocab_size, (4, model.cfg.block_size), device="cuda")

    def step():
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", torch.bfloat16):
            loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        return float(loss), {n: p.grad.clone() for n, p in model.named_parameters()}

    calls = []
    real = cublaslt._Lt.matmul
    monkeypatch.setattr(cublaslt._Lt, "matmul", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    loss_lt, grads_lt = step()
    assert len(calls) >= 3 * model.cfg.n_layer * 3  # q/k/v, projections, MLP: forward and backward
    monkeypatch.setenv("OELM_CUBLASLT", "0")
    calls.clear()
    loss_torch, grads_torch = step()
    assert not calls
    assert abs(loss_lt - loss_torch) < 2e-3 * abs(loss_torch)
    assert grads_lt.keys() == grads_torch.keys()
    for name in grads_torch:
        assert _rel(grads_lt[name], grads_torch[name]) < 3e-2, name
    frozen = [n for n, b in model.named_buffers() if n.endswith("qk.weight")]
    assert bool(frozen) == (variant == "oelm_freeze")
