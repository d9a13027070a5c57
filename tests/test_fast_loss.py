"""The fused loss (oelm_core.fast.loss, switch train.fused_loss) computes what the reference loss
(oelm_core.model.OutputLoss: full logits + F.cross_entropy) computes.

On the CPU (float32): loss and every gradient of the model with the fused loss against the same
model with the reference loss and against benchmarks/reference.py's nanoGPT-style model, within
1e-5; its edge cases (ignored targets, bad ids, slice sizes) and its tied-gradient hook. Its CUDA
kernels (oelm_core.fast.ce_kernels, oelm_core.fast.logits_gemm) against float64 on a GPU, or
without one in Triton's CPU interpreter (skipped without Triton). Timings live in benchmarks/.
"""

import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from oelm_core import build_model, fast
from oelm_core.config import TrainConfig
from oelm_core.fast.loss import ChunkedOutputLoss, linear_cross_entropy, split_tied_gradient
from oelm_core.model import OutputLoss

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from reference import ReferenceGPT, copy_from, reference_grads_as_model  # noqa: E402

TOL = 1e-5
CPU = torch.device("cpu")


def fused(model, **train):
    """``model`` with the fused loss installed as the trainer installs it (``fast.apply``)."""
    return fast.apply(model, TrainConfig(**train))


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


@pytest.mark.parametrize("vocab", [100, 128], ids=["padded", "unpadded"])
@pytest.mark.parametrize("variant", ["gpt_base", "oelm_nofreeze", "oelm_freeze"])
@pytest.mark.parametrize("chunk", [7, 8192])
def test_fused_loss_matches_the_reference_loss(variant, chunk, vocab):
    # vocab 100 is padded to 128 rows: the padding rows must get neither logits nor gradient.
    model = fused(build_model("tiny", variant, vocab_size=vocab), loss_chunk_tokens=chunk)
    plain = build_model("tiny", variant, vocab_size=vocab)
    assert isinstance(model.output_loss, ChunkedOutputLoss) and model.output_loss.chunk == chunk
    assert type(plain.output_loss) is OutputLoss
    plain.load_state_dict(model.state_dict())  # (the same seed gives the same weights anyway)
    x, y = _batch(model.cfg)
    l1, g1 = _loss_and_grads(model, x, y)
    l2, g2 = _loss_and_grads(plain, x, y)
    assert abs(float(l1 - l2)) <= TOL
    assert g1.keys() == g2.keys()
    for name in g1:
        _assert_close(g1[name], g2[name])
        assert torch.allclose(g1[name], g2[name], atol=1e-6), name
    assert g1["wte.weight"].size(0) == 128 and torch.count_nonzero(g1["wte.weight"][vocab:]) == 0


@pytest.mark.parametrize("variant", ["gpt_base", "oelm_freeze"])
@pytest.mark.parametrize("pad_vocab", [True, False])
def test_fused_loss_matches_the_nanogpt_reference(variant, pad_vocab):
    model = fused(build_model("tiny", variant, vocab_size=100), loss_chunk_tokens=11)
    ref = copy_from(ReferenceGPT(model.cfg, pad_vocab=pad_vocab), model)
    assert ref.wte.num_embeddings == (128 if pad_vocab else 100)
    x, y = _batch(model.cfg, seed=1)
    l1, g1 = _loss_and_grads(model, x, y)
    ref.zero_grad(set_to_none=True)
    l2 = ref(x, y)
    l2.backward()
    g2 = reference_grads_as_model(ref, model)
    assert abs(float(l1 - l2.detach())) <= TOL
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
        plain = F.cross_entropy(x @ w[:13].T, t)
        assert abs(float(linear_cross_entropy(x, w, t, 13, chunk=6) - plain)) <= TOL
    (3.0 * linear_cross_entropy(x, w, t, 13, chunk=6)).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    (3.0 * F.cross_entropy(x @ w[:13].T, t)).backward()
    _assert_close(gx, x.grad)
    _assert_close(gw[:13], w.grad[:13])
    assert float(gw[13:].abs().max()) == 0.0


def test_linear_cross_entropy_refuses_a_chunk_below_one():
    x, w, t = torch.randn(6, 4), torch.randn(8, 4), torch.zeros(6, dtype=torch.long)
    for chunk in (0, -1):
        with pytest.raises(ValueError, match=f"chunk must be a positive .* got chunk={chunk}"):
            linear_cross_entropy(x, w, t, 8, chunk=chunk)
        with pytest.raises(ValueError, match=rf"positive number of tokens .*train\.loss_chunk_tokens.*got {chunk}"):
            ChunkedOutputLoss(8, chunk)


def _count_slices(monkeypatch) -> list:
    """The rows of each log-sum-exp the CPU loss takes from now on: one call per slice."""
    rows = []
    logsumexp = torch.logsumexp
    monkeypatch.setattr(torch, "logsumexp", lambda t, dim: rows.append(t.size(0)) or logsumexp(t, dim=dim))
    return rows


def test_linear_cross_entropy_slices_by_the_configs_chunk_by_default(monkeypatch):
    """Without ``chunk``, the slices are TrainConfig.loss_chunk_tokens tokens long (moved here to
    6: 20 tokens in 4 slices, one log-sum-exp each), not a second copy of that default."""
    monkeypatch.setattr(TrainConfig, "loss_chunk_tokens", 6)
    rows = _count_slices(monkeypatch)
    g = torch.Generator().manual_seed(3)
    x, w, t = torch.randn(20, 8, generator=g), torch.randn(16, 8, generator=g), torch.randint(0, 13, (20,), generator=g)
    loss = linear_cross_entropy(x, w, t, 13)
    assert rows == [6, 6, 6, 2]
    assert abs(float(loss - F.cross_entropy(x @ w[:13].T, t))) <= TOL


def test_apply_slices_the_models_loss_by_train_loss_chunk_tokens(monkeypatch):
    model = fused(build_model("tiny", "gpt_base"), loss_chunk_tokens=40)  # 3 x 32 tokens
    x, y = _batch(model.cfg)
    rows = _count_slices(monkeypatch)
    model(x, y)
    assert rows == [40, 40, 16]


@pytest.mark.parametrize("bad", [-100, -2, 100, 128])
def test_fused_loss_refuses_the_targets_cross_entropy_refuses(bad):
    """Only -1 is ignored, as by F.cross_entropy(ignore_index=-1): other negative ids and ids
    past the vocabulary (the padding rows' 100..127 included) are an IndexError in both paths."""
    for model in (
        fused(build_model("tiny", "gpt_base", vocab_size=100)),
        build_model("tiny", "gpt_base", vocab_size=100),
    ):
        x, y = _batch(model.cfg)
        y[1, 3] = bad
        with pytest.raises(IndexError, match=f"{bad} is out of bounds"):
            model(x, y)


def test_an_all_ignored_batch_gives_the_reference_nan_loss_and_zero_gradients():
    model = fused(build_model("tiny", "gpt_base"), loss_chunk_tokens=7)
    plain = build_model("tiny", "gpt_base")
    x, y = _batch(model.cfg)
    y[:] = -1
    (l1, g1), (l2, g2) = _loss_and_grads(model, x, y), _loss_and_grads(plain, x, y)
    assert l1.isnan() and l2.isnan()
    assert all(float(g.abs().max()) == 0 for g in (*g1.values(), *g2.values()))


def test_grad_hook_hands_over_the_output_share_of_the_tied_gradient():
    """ChunkedOutputLoss.grad_hook (set by split_tied_gradient) gets the output layer's share of
    the tied weight's gradient; wte.grad keeps the embedding's, zero outside the batch's tokens;
    together exactly the plain gradient. None joins them again; an untied output layer or the
    reference loss has nothing to split."""
    torch.manual_seed(0)
    model = fused(build_model("tiny", "gpt_base"), loss_chunk_tokens=40)  # 3 x 32 tokens: 3 slices
    idx, tgt = torch.randint(0, 100, (3, 32)), torch.randint(0, 128, (3, 32))
    model(idx, tgt).backward()
    plain = model.wte.weight.grad.clone()
    model.zero_grad(set_to_none=True)
    shares = []
    assert split_tied_gradient(model, shares.append) is model.wte.weight
    assert model.output_loss.grad_hook == shares.append
    (0.5 * model(idx, tgt)).backward()  # the hook's share is scaled like any gradient
    (out,), emb = shares, model.wte.weight.grad
    assert out.dtype == torch.float32 and out.shape == plain.shape
    assert (out + emb - 0.5 * plain).abs().max().item() < 1e-7
    unused = torch.ones(emb.size(0), dtype=torch.bool)
    unused[idx.flatten()] = False
    assert emb[unused].abs().max().item() == 0.0 and emb[~unused].abs().min().item() > 0
    assert out[unused].abs().max().item() > 0  # the output layer touches every row
    assert split_tied_gradient(model, None) is model.wte.weight
    assert model.output_loss.grad_hook is None
    model.zero_grad(set_to_none=True)
    model(idx, tgt).backward()
    assert torch.equal(model.wte.weight.grad, plain)
    assert len(shares) == 1
    for model in (
        fused(build_model("tiny", "gpt_base", tie_embeddings=False)),  # nothing to split
        build_model("tiny", "gpt_base"),
    ):
        assert split_tied_gradient(model, shares.append) is None
        assert getattr(model.output_loss, "grad_hook", None) is None


@pytest.mark.gpu
def test_float16_autocast_keeps_the_loss_in_range():
    """Under float16 autocast the loss takes the plain slices (the kernel's unnormalised gradient
    would leave float16's range): loss and gradients as the reference loss's."""
    model = fused(build_model("tiny", "gpt_base", vocab_size=100), loss_chunk_tokens=7).cuda()
    plain = build_model("tiny", "gpt_base", vocab_size=100).cuda()
    plain.load_state_dict(model.state_dict())
    x, y = (t.cuda() for t in _batch(model.cfg))
    with torch.autocast("cuda", torch.float16):
        (l1, g1), (l2, g2) = _loss_and_grads(model, x, y), _loss_and_grads(plain, x, y)
    assert abs(float(l1) - float(l2)) < 1e-2 * float(l2)
    for name in g2:
        assert torch.isfinite(g1[name]).all()
        assert float((g1[name] - g2[name]).norm()) <= 3e-2 * float(g2[name].norm()) + 1e-6, name


# --------------------------------------------------------------------------------------------
# The CUDA kernels: each check runs on a GPU, or in Triton's CPU interpreter (a subprocess that
# runs this file: ``python tests/test_fast_loss.py CHECK``)
# --------------------------------------------------------------------------------------------


def check_loss_kernel(device: str) -> None:
    """The CUDA loss path (Triton kernel, slices, float32 weight-gradient accumulation) against
    F.cross_entropy: loss and both gradients."""
    from oelm_core.fast import ce_kernels

    g = torch.Generator().manual_seed(0)
    n, d, vocab, padded = 37, 16, 301, 320  # 3 slices of 16 rows; vocab not a multiple of BLOCK
    x = torch.randn(n, d, generator=g).to(device)
    w = torch.randn(padded, d, generator=g).to(device) * 0.5
    w[vocab:] = 0
    t = torch.randint(0, vocab, (n,), generator=g).to(device)
    t[::5] = -1
    switches = dict(fused_logits=True)  # it does not run in float32: the kernel's path
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 GEMMs on a GPU, to compare within 1e-5
    try:
        loss, gx, gw, row_scale = ce_kernels.forward(x, w, t, vocab, 16, torch.float32, True, **switches)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    gx = (gx * row_scale[:, None]).double().cpu()
    xr, wr = x.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()  # float64, here
    ref = F.cross_entropy(xr @ wr[:vocab].T, t.cpu(), ignore_index=-1)
    ref.backward()
    assert abs(float(loss) - float(ref)) < 1e-5, (float(loss), float(ref))
    assert float((gx - xr.grad).abs().max()) < 1e-5 and float((gw.double().cpu() - wr.grad).abs().max()) < 1e-5
    # Every target ignored: NaN (0/0) and zero gradients, as F.cross_entropy gives.
    loss, gx, gw, row_scale = ce_kernels.forward(
        x, w, torch.full_like(t, -1), vocab, 16, torch.float32, True, **switches
    )
    assert loss.isnan() and float((gx * row_scale[:, None]).abs().max()) == 0 and float(gw.abs().max()) == 0


def check_loss_kernel_offsets(device: str) -> None:
    """The kernel's running offset: rows whose logits climb far above the target's, block after
    block, in the first block or a late one (such rows are redone after the pass), with the target
    early or late, losses up to ~400 nats, and an ignored row: loss, E * row_scale against float64
    softmax - one_hot, and the input rows times the row scale."""
    from oelm_core.fast.ce_kernels import _ce_rows_kernel

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
    _ce_rows_kernel[(6,)](
        x,
        x.stride(0),
        targets.to(device),
        loss,
        scale,
        inv_n,
        h,
        h_scaled,
        24,
        vocab,
        padded,
        WRITE_GRAD=True,
        BLOCK=block,
        BLOCK_D=32,
        num_warps=1,
    )
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
    _ce_rows_kernel[(3,)](
        x16,
        x16.stride(0),
        t16,
        loss16,
        scale16,
        inv16,
        h16,
        h16.clone(),
        24,
        vocab,
        padded,
        WRITE_GRAD=True,
        BLOCK=block,
        BLOCK_D=32,
        num_warps=1,
    )
    ref16 = half.double()
    ref16[:, vocab:] = float("-inf")
    want16 = torch.logsumexp(ref16, 1) - ref16.gather(1, targets[rows][:, None])[:, 0]
    assert float(want16[:2].min()) > 50  # the far rows are far
    assert float((loss16.double().cpu() - want16).abs().max()) < 1e-4 * float(want16.abs().max())
    got16 = x16.double().cpu() * scale16.double().cpu()[:, None]
    grad16 = torch.softmax(ref16, 1)
    grad16[torch.arange(3), targets[rows]] -= 1.0
    assert float((got16 - grad16 / 3).abs().max()) < 2**-8


def check_scale_rows(device: str) -> None:
    """The backward's scaling of the loss's gradients: rows longer than one block, a row scale and
    a dtype change (bf16 -> float32), or the factor alone; the source left as it was."""
    from oelm_core.fast.ce_kernels import scale_rows
    from oelm_core.fast.loss import _scale_rows

    g = torch.Generator().manual_seed(2)
    src = torch.randn(5, 700, generator=g).to(device)
    row_scale, factor = torch.rand(5, generator=g).to(device), torch.tensor(0.25).to(device)
    half = src.to(torch.bfloat16)
    for scale in (_scale_rows, scale_rows):  # on the CPU the first is the plain path
        out = scale(half, factor, row_scale, torch.float32)
        assert out.dtype == torch.float32
        assert torch.allclose(out, half.float() * row_scale[:, None] * 0.25, rtol=1e-6, atol=0)
        before = src.clone()
        out = scale(src, factor, None, torch.float32)
        assert torch.equal(src, before) and torch.allclose(out, src * 0.25, rtol=1e-6, atol=0)


def _far_rows(w, x, targets):
    """Row 3: one logit ~50 above and the target ~70 below it, S within float32 (redone from what the
    GEMM stored); row 4: one logit 200, the target far below (S overflows: recomputed)."""
    for row, top, k in ((3, 50.0, 5), (4, 200.0, 7)):
        x[row] = w[k] * (top / float(w[k].norm() ** 2))
        targets[row] = int((w[: len(w) - 19] @ x[row]).argmin())  # the lowest real logit


def check_logits_gemm(device: str) -> None:
    """The fused logits GEMM (``logits_gemm.loss_and_grad``): its loss, gradient E * row scale and
    scaled input rows against float64, for ordinary rows, an ignored row and rows whose logits climb
    far above the target's (rescaled from what the GEMM stored, or recomputed from x and w), with the
    library's tiles and (in the interpreter) with small ones, so that each program walks many tiles."""
    from oelm_core.fast import logits_gemm

    _logits_gemm_loss_and_grad(device)
    if device == "cpu":  # 3 row tiles x 10 column tiles, 15 a program (the interpreter runs 2)
        logits_gemm.BLOCK_M, logits_gemm.BLOCK_N, logits_gemm.BLOCK_K = 16, 32, 16
        _logits_gemm_loss_and_grad(device)


def _logits_gemm_loss_and_grad(device: str) -> None:
    from oelm_core.fast import logits_gemm

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
    loss_tol, grad_tol = (2e-4, 1e-7) if dtype == torch.float32 else (5e-3, 2**-8 / n_valid)
    assert float((loss - ref_loss).abs().max()) < loss_tol
    assert float((got[:, :vocab] - ref_grad).abs().max()) < grad_tol
    assert float(e[:, vocab:].abs().max()) == 0.0
    assert float(e[6].abs().max()) == 0.0 and float(loss[6]) == 0.0 and float(scale[6]) == 0.0  # ignored
    for row in (3, 4):  # redone with the offset at the row's max, whose own entry is exactly 1
        assert float(e[row].max()) == 1.0
    assert float(ref_loss[4]) > 250  # the recomputed row's loss, to float32 rounding of its logits
    assert torch.equal(x_scaled.cpu(), (xd.float() * scale.float().to(device)[:, None]).to(dtype).cpu())


def check_logits_gemm_finish_tiers(device: str) -> None:
    """``logits_gemm._finish_kernel`` alone, on E and row sums planted as the GEMM would leave them,
    where its two ways of redoing a row disagree (x and w say something else than the planted E):
    row 0 one entry e^35 (rescaled), row 1 an entry past bf16's range with a finite float32 sum, as a
    logit 88.72 nats above the target's leaves it (recomputed from x and w: a logit 100 over 0s),
    row 2 many entries of e^25 (rescaled), row 3 ignored with a NaN sum (left alone)."""
    from oelm_core.fast import logits_gemm

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
    logits_gemm._finish_kernel[(n,)](
        e_d,
        part.float().to(**dev),
        col_tiles,
        targets.to(**dev),
        c,
        x_d,
        w.to(dtype).to(**dev),
        d,
        vocab,
        padded,
        loss,
        scale,
        inv_n,
        x_scaled,
        BLOCK_T=4,
        BLOCK=128,
        BLOCK_D=64,
        BLOCK_V=16,
        num_warps=4,
    )
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
    assert float((got[:3] - want[:3]).abs().max()) < 2**-8
    assert float(got[0].max()) == 1.0 and float(got[2].max()) == 1.0 and float(got[1, 10]) == 1.0
    assert float(got[3].abs().max()) == 0.0 and float(loss[3]) == 0.0 and float(scale[3]) == 0.0


@pytest.mark.gpu
@pytest.mark.interpreter
@pytest.mark.parametrize(
    "check",
    [
        "check_loss_kernel",
        "check_loss_kernel_offsets",
        "check_scale_rows",
        "check_logits_gemm",
        "check_logits_gemm_finish_tiers",
    ],
)
def test_the_triton_kernels_of_the_loss(check):
    """Each check on a GPU here (the fused logits GEMM's where it runs: Hopper); without one, on the
    CPU through Triton's interpreter (skipped without Triton, or with one whose interpreter cannot
    run them: conftest.triton_interpreter_unusable)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        if "logits_gemm" in check:
            _skip_without_the_logits_gemm()
        globals()[check]("cuda")
    else:
        from conftest import run_in_triton_interpreter

        run_in_triton_interpreter(Path(__file__), check)


def _skip_without_the_logits_gemm():
    from oelm_core.fast import logits_gemm

    if not logits_gemm.available(torch.device("cuda"), torch.bfloat16, 512, 50304):
        pytest.skip(
            "the fused logits GEMM does not run here (it needs Triton >= 3.4 and compute "
            "capability 9+ with ~216 KB of shared memory a program)"
        )


@pytest.mark.gpu
def test_the_fused_logits_gemm_agrees_with_the_loss_kernel():
    """The CUDA loss (``ce_kernels.forward``, bf16, three slices of medium512's output layer) with
    the fused logits GEMM (train.fused_logits on) against the logits GEMM + ``_ce_rows_kernel``
    (off): the loss within the bf16 rounding of the latter's logits, the gradients within bf16
    noise."""
    pytest.importorskip("triton")
    _skip_without_the_logits_gemm()
    from oelm_core.fast import ce_kernels

    g = torch.Generator().manual_seed(1)
    n, d, vocab, padded = 2500, 512, 50257, 50304
    x = torch.randn(n, d, generator=g).cuda()
    w = (torch.randn(padded, d, generator=g) * 0.1).cuda()
    t = torch.randint(0, vocab, (n,), generator=g).cuda()
    t[::11] = -1
    out = {}
    for fused_logits in (True, False):
        loss, gx, gw, row_scale = ce_kernels.forward(
            x, w, t, vocab, 1024, torch.bfloat16, True, fused_logits=fused_logits
        )
        out[fused_logits] = (float(loss), (gx.float() * row_scale[:, None]), gw.float())
    (l1, gx1, gw1), (l0, gx0, gw0) = out[True], out[False]
    assert abs(l1 - l0) < 1e-3 * l0, (l1, l0)
    for a, b in ((gx1, gx0), (gw1, gw0)):
        assert float((a - b).norm() / b.norm()) < 1e-2


# What the CPU runs under the interpreter, in one process (conftest.run_in_triton_interpreter).
INTERPRETER_CHECKS = [
    ("check_loss_kernel",),
    ("check_loss_kernel_offsets",),
    ("check_scale_rows",),
    ("check_logits_gemm",),
    ("check_logits_gemm_finish_tiers",),
]

if __name__ == "__main__":  # the interpreter subprocess: python test_fast_loss.py RESULTS.json
    from conftest import run_interpreter_checks

    run_interpreter_checks(globals(), sys.argv[1])
