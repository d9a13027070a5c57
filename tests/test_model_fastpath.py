"""The fast paths of the model compute what the plain paths compute (CPU, float32).

The fused linear + cross-entropy (``loss_impl="chunked"``) against full logits + F.cross_entropy
(``loss_impl="full"``) and against benchmarks/reference.py's plain nanoGPT-style model with the
same weights: loss and every gradient within 1e-5. Timings live in benchmarks/, never here.
"""

import sys
from pathlib import Path

import pytest
import torch

from oelm_core import build_model
from oelm_core.model import linear_cross_entropy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from reference import ReferenceGPT, copy_from, reference_grads_as_model  # noqa: E402

TOL = 1e-5


def _batch(cfg, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=g)
    y[0, :5] = -1  # ignored positions
    return x, y


def _loss_and_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = model(x, y)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_close(a, b, tol=TOL):
    assert float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("variant", ["gpt_base", "oelm_nofreeze", "oelm_freeze"])
@pytest.mark.parametrize("chunk", [7, 8192])
def test_chunked_loss_matches_full_logits(variant, chunk):
    # vocab 100 padded to 128: the padding rows must get neither logits nor gradient.
    fast = build_model("tiny", variant, vocab_size=100, loss_chunk_tokens=chunk)
    full = build_model("tiny", variant, vocab_size=100, loss_impl="full")
    full.load_state_dict(fast.state_dict())
    x, y = _batch(fast.cfg)
    l1, g1 = _loss_and_grads(fast, x, y)
    l2, g2 = _loss_and_grads(full, x, y)
    assert abs(float(l1.detach() - l2.detach())) <= TOL
    assert g1.keys() == g2.keys()
    for name in g1:
        _assert_close(g1[name], g2[name])
    assert float(g1["wte.weight"][100:].abs().max()) == 0.0


@pytest.mark.parametrize("variant", ["gpt_base", "oelm_freeze"])
@pytest.mark.parametrize("pad_vocab", [True, False])
def test_fast_path_matches_the_plain_reference_model(variant, pad_vocab):
    model = build_model("tiny", variant, vocab_size=100, loss_chunk_tokens=11)
    ref = copy_from(ReferenceGPT(model.cfg, pad_vocab=pad_vocab), model)
    assert ref.wte.num_embeddings == (128 if pad_vocab else 100)
    x, y = _batch(model.cfg, seed=1)
    l1, g1 = _loss_and_grads(model, x, y)
    ref.zero_grad(set_to_none=True)
    l2 = ref(x, y)
    l2.backward()
    g2 = reference_grads_as_model(ref, model)
    assert abs(float(l1.detach() - l2.detach())) <= TOL
    for name, grad in g1.items():  # frozen Q/K have no gradient in the model: nothing to compare
        _assert_close(grad[: g2[name].size(0)], g2[name])
    with torch.no_grad():
        _assert_close(model(x), ref(x))


def test_linear_cross_entropy_without_grad_and_scaled_backward():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 8, generator=g, requires_grad=True)
    w = torch.randn(16, 8, generator=g, requires_grad=True)
    t = torch.randint(0, 13, (20,), generator=g)
    with torch.no_grad():
        plain = torch.nn.functional.cross_entropy(x @ w[:13].T, t)
        assert abs(float(linear_cross_entropy(x, w, t, 13, chunk=6) - plain)) <= TOL
    (3.0 * linear_cross_entropy(x, w, t, 13, chunk=6)).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (3.0 * torch.nn.functional.cross_entropy(x @ w[:13].T, t)).backward()
    _assert_close(gx, x.grad)
    _assert_close(gw[:13], w.grad[:13])
    assert float(gw[13:].abs().max()) == 0.0


# One token at a time after a 4-token prefill (attends without a mask), and chunks of several
# new tokens after cached ones (each attends to the cache and causally to the others of its
# chunk: the one case with an explicit mask in the SDPA path).
@pytest.mark.parametrize("chunks", [[4] + [1] * 8, [4, 5, 3]], ids=["one_token", "chunks"])
@pytest.mark.parametrize("variant", ["gpt_base", "oelm_freeze"])
def test_cached_decoding_matches_the_full_forward(variant, chunks):
    model = build_model("tiny", variant).eval()
    x, _ = _batch(model.cfg, b=2, seed=3)
    x = x[:, :sum(chunks)]
    ends = [sum(chunks[:i + 1]) for i in range(len(chunks))]
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache(batch=2)
        steps = [model(x[:, a:b], cache=cache) for a, b in zip([0] + ends[:-1], ends)]
    assert cache.length == x.size(1)
    _assert_close(torch.cat(steps, dim=1), full, tol=1e-4)


def test_linear_cross_entropy_refuses_a_chunk_below_one():
    x, w, t = torch.randn(6, 4), torch.randn(8, 4), torch.zeros(6, dtype=torch.long)
    for chunk in (0, -1):
        with pytest.raises(ValueError, match=f"chunk must be a positive .* got chunk={chunk}"):
            linear_cross_entropy(x, w, t, 8, chunk=chunk)


def test_linear_cross_entropy_slices_by_the_configs_chunk_by_default(monkeypatch):
    """Without ``chunk``, the slices are ModelConfig.loss_chunk_tokens tokens long (moved here to
    6: 20 tokens in 4 slices, one log-sum-exp each), not a second copy of that default."""
    from oelm_core.config import ModelConfig
    monkeypatch.setattr(ModelConfig, "loss_chunk_tokens", 6)
    lse_rows = []
    logsumexp = torch.logsumexp
    monkeypatch.setattr(torch, "logsumexp", lambda t, dim: lse_rows.append(t.size(0)) or logsumexp(t, dim=dim))
    g = torch.Generator().manual_seed(3)
    x, w, t = torch.randn(20, 8, generator=g), torch.randn(16, 8, generator=g), torch.randint(0, 13, (20,), generator=g)
    loss = linear_cross_entropy(x, w, t, 13)
    assert lse_rows == [6, 6, 6, 2]
    assert abs(float(loss - torch.nn.functional.cross_entropy(x @ w[:13].T, t))) <= TOL


@pytest.mark.parametrize("bad", [-100, -2, 100, 128])
def test_chunked_loss_refuses_the_targets_cross_entropy_refuses(bad):
    """Only -1 is ignored, as by F.cross_entropy(ignore_index=-1): other negative ids and ids
    past the vocabulary (the padding rows' 100..127 included) are an IndexError in both paths."""
    for impl in ("chunked", "full"):
        model = build_model("tiny", "gpt_base", vocab_size=100, loss_impl=impl)
        x, y = _batch(model.cfg)
        y[1, 3] = bad
        with pytest.raises(IndexError, match=f"{bad} is out of bounds"):
            model(x, y)


def test_an_all_ignored_batch_gives_the_full_paths_nan_loss_and_zero_gradients():
    fast = build_model("tiny", "gpt_base", loss_chunk_tokens=7)
    full = build_model("tiny", "gpt_base", loss_impl="full")
    x, y = _batch(fast.cfg)
    y[:] = -1
    (l1, g1), (l2, g2) = _loss_and_grads(fast, x, y), _loss_and_grads(full, x, y)
    assert l1.isnan() and l2.isnan()
    assert all(float(g.abs().max()) == 0 for g in (*g1.values(), *g2.values()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused loss kernel runs on CUDA")
def test_float16_autocast_keeps_the_loss_in_range():
    """Under float16 autocast the loss takes the plain slices (the kernel's unnormalised gradient
    would leave float16's range): loss and gradients as the full-logits path's."""
    fast = build_model("tiny", "gpt_base", vocab_size=100, loss_chunk_tokens=7).cuda()
    full = build_model("tiny", "gpt_base", vocab_size=100, loss_impl="full").cuda()
    full.load_state_dict(fast.state_dict())
    x, y = (t.cuda() for t in _batch(fast.cfg))
    with torch.autocast("cuda", torch.float16):
        (l1, g1), (l2, g2) = _loss_and_grads(fast, x, y), _loss_and_grads(full, x, y)
    assert abs(float(l1) - float(l2)) < 1e-2 * float(l2)
    for name in g2:
        assert torch.isfinite(g1[name]).all()
        assert float((g1[name] - g2[name]).norm()) <= 3e-2 * float(g2[name].norm()) + 1e-6, name


def check_loss_kernel(device: str) -> None:
    """The CUDA loss path (Triton kernel, slices, float32 weight-gradient accumulation) against
    F.cross_entropy: loss and both gradients."""
    from oelm_core.model import _ce_forward_cuda
    g = torch.Generator().manual_seed(0)
    n, d, vocab, padded = 37, 16, 301, 320  # 3 slices of 16 rows; vocab not a multiple of BLOCK
    x = torch.randn(n, d, generator=g).to(device)
    w = torch.randn(padded, d, generator=g).to(device) * 0.5
    w[vocab:] = 0
    t = torch.randint(0, vocab, (n,), generator=g).to(device)
    t[::5] = -1
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 GEMMs on a GPU, to compare within 1e-5
    try:
        loss, gx, gw, row_scale = _ce_forward_cuda(x, w, t, vocab, 16, torch.float32, True)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    gx = (gx * row_scale[:, None]).double().cpu()
    xr, wr = x.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()  # float64, here
    ref = torch.nn.functional.cross_entropy(xr @ wr[:vocab].T, t.cpu(), ignore_index=-1)
    ref.backward()
    assert abs(float(loss) - float(ref)) < 1e-5, (float(loss), float(ref))
    assert float((gx - xr.grad).abs().max()) < 1e-5 and float((gw.double().cpu() - wr.grad).abs().max()) < 1e-5
    # Every target ignored: NaN (0/0) and zero gradients, as F.cross_entropy gives.
    loss, gx, gw, row_scale = _ce_forward_cuda(x, w, torch.full_like(t, -1), vocab, 16, torch.float32, True)
    assert loss.isnan() and float((gx * row_scale[:, None]).abs().max()) == 0 and float(gw.abs().max()) == 0


def check_loss_kernel_offsets(device: str) -> None:
    """The kernel's running offset: rows whose logits climb far above the target's, block after
    block, in the first block or a late one (such rows are redone after the pass), with the target
    early or late, losses up to ~400 nats, and an ignored row: loss, E * row_scale against float64
    softmax - one_hot, and the input rows times the row scale."""
    from oelm_core.model import _ce_rows_kernel
    g = torch.Generator().manual_seed(1)
    vocab, padded, block = 150, 160, 16  # 10 blocks, the last one partly padding
    logits = torch.randn(6, padded, generator=g, dtype=torch.float64)
    logits[0] += torch.arange(padded) * 2.5  # far logits in most blocks, the max in the last
    logits[1, 100] = 60.0  # one far logit in a late block
    logits[2, 3] = 200.0  # in the first block
    logits[3] += torch.arange(padded).flip(0) * 2.5  # the max in the first block
    logits[4] += torch.arange(padded) * 2.5  # ignored
    targets = torch.tensor([2, 140, 77, 159 - 10, -1, 5])
    n_valid = int((targets >= 0).sum())
    x = logits.float().to(device)
    loss, scale = torch.empty(6, device=device), torch.empty(6, device=device)
    inv_n = torch.tensor([1.0 / n_valid], device=device)
    h = torch.randn(6, 24, generator=g).to(device)  # the rows of the output layer's input, d = 24
    h_scaled = torch.empty_like(h)
    _ce_rows_kernel[(6,)](x, x.stride(0), targets.to(device), loss, scale, inv_n, h, h_scaled, 24, vocab,
                          padded, WRITE_GRAD=True, BLOCK=block, BLOCK_D=32, num_warps=1)
    ref = logits.clone()
    ref[:, vocab:] = float("-inf")
    lse = torch.logsumexp(ref, 1)
    valid = targets >= 0
    safe = targets.clamp(min=0)
    ref_loss = torch.where(valid, lse - logits.gather(1, safe[:, None])[:, 0], 0.0)
    ref_grad = torch.softmax(ref, 1)
    ref_grad[torch.arange(6), safe] -= 1.0
    ref_grad *= (valid / n_valid)[:, None]
    got = x.double().cpu() * scale.double().cpu()[:, None]
    assert float(ref_loss[0]) > 150 and float(ref_loss[2]) > 150  # the far rows are far
    assert float((loss.double().cpu() - ref_loss).abs().max()) < 1e-4 * float(ref_loss.abs().max())
    assert float((got - ref_grad).abs().max()) < 1e-6, float((got - ref_grad).abs().max())
    assert float(x[:, vocab:].abs().max()) == 0.0
    assert float(x[4].abs().max()) == 0.0  # the ignored row: E = 0, never redone
    assert torch.equal(h_scaled, h * scale[:, None])
    # bf16, as in training: a row with one far logit is redone with that logit's entry exactly 1,
    # so its loss is the bf16 logits' own to float32 rounding (not to the bf16 rounding of a
    # distance of 57 or 200 nats).
    rows = [1, 2, 5]
    half = logits[rows].to(torch.bfloat16)
    x16 = half.clone().to(device)  # (on the CPU .to would not copy, and the kernel works in place)
    t16 = targets[rows].to(device)
    loss16, scale16 = torch.empty(3, device=device), torch.empty(3, device=device)
    inv16 = torch.tensor([1.0 / 3], device=device)
    h16 = torch.zeros(3, 24, device=device)
    _ce_rows_kernel[(3,)](x16, x16.stride(0), t16, loss16, scale16, inv16, h16, h16.clone(), 24, vocab,
                          padded, WRITE_GRAD=True, BLOCK=block, BLOCK_D=32, num_warps=1)
    ref16 = half.double()
    ref16[:, vocab:] = float("-inf")
    want16 = torch.logsumexp(ref16, 1) - ref16.gather(1, targets[rows][:, None])[:, 0]
    assert float(want16[:2].min()) > 50  # the far rows are far
    assert float((loss16.double().cpu() - want16).abs().max()) < 1e-4 * float(want16.abs().max())
    got16 = x16.double().cpu() * scale16.double().cpu()[:, None]
    grad16 = torch.softmax(ref16, 1)
    grad16[torch.arange(3), targets[rows]] -= 1.0
    assert float((got16 - grad16 / 3).abs().max()) < 2 ** -8


def check_scale_rows(device: str) -> None:
    """The backward's scaling of the loss's gradients: rows longer than one block, a row scale and
    a dtype change (bf16 -> float32), or the factor alone; the source left as it was."""
    from oelm_core.model import _scale_rows, _scale_rows_triton
    g = torch.Generator().manual_seed(2)
    src = torch.randn(5, 700, generator=g).to(device)
    row_scale, factor = torch.rand(5, generator=g).to(device), torch.tensor(0.25).to(device)
    half = src.to(torch.bfloat16)
    for scale in (_scale_rows, _scale_rows_triton):  # on the CPU the first is the plain path
        out = scale(half, factor, row_scale, torch.float32)
        assert out.dtype == torch.float32
        assert torch.allclose(out, half.float() * row_scale[:, None] * 0.25, rtol=1e-6, atol=0)
        before = src.clone()
        out = scale(src, factor, None, torch.float32)
        assert torch.equal(src, before) and torch.allclose(out, src * 0.25, rtol=1e-6, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("check", ["check_loss_kernel", "check_loss_kernel_offsets", "check_scale_rows"])
def test_the_triton_kernels_of_the_loss(check):
    """Each check on a GPU here; without one, on the CPU through Triton's interpreter (skipped
    without Triton, or with one whose interpreter cannot run them)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        globals()[check]("cuda")
    else:
        from conftest import run_in_triton_interpreter
        run_in_triton_interpreter(Path(__file__), check)


# What the CPU runs under the interpreter, in one process (conftest.run_in_triton_interpreter).
INTERPRETER_CHECKS = [("check_loss_kernel",), ("check_loss_kernel_offsets",), ("check_scale_rows",)]

if __name__ == "__main__":  # the interpreter subprocess: python test_model_fastpath.py RESULTS.json
    from conftest import run_interpreter_checks
    run_interpreter_checks(globals(), sys.argv[1])
