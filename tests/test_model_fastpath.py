"""The fast paths of the model compute what the plain paths compute (CPU, float32).

The fused linear + cross-entropy (``loss_impl="chunked"``) against full logits + F.cross_entropy
(``loss_impl="full"``) and against benchmarks/reference.py's plain nanoGPT-style model with the
same weights: loss and every gradient within 1e-5. Timings live in benchmarks/, never here.
"""

import sys
from pathlib import Path

import pytest
import torch

from oelm_core import build_model, count_parameters
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


@pytest.mark.parametrize("variant", ["gpt_base", "oelm_freeze"])
def test_cached_single_token_decoding_matches_the_full_forward(variant):
    # The one-token cached step attends without a mask; it must equal the uncached logits.
    model = build_model("tiny", variant).eval()
    x, _ = _batch(model.cfg, b=2, seed=3)
    x = x[:, :12]
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache(batch=2)
        steps = [model(x[:, :4], cache=cache)]
        for i in range(4, 12):
            steps.append(model(x[:, i:i + 1], cache=cache))
    _assert_close(torch.cat(steps, dim=1), full, tol=1e-4)


def test_parameter_counts_unchanged():
    counts = {v: count_parameters(build_model("medium512", v))
              for v in ("gpt_base", "oelm_nofreeze", "oelm_freeze")}
    assert counts["gpt_base"]["total"] == counts["oelm_freeze"]["total"] == 44_896_768
    assert counts["oelm_freeze"]["trainable"] == 41_751_040


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
    loss, gx, gw = _ce_forward_cuda(x, w, t, vocab, 16, torch.float32, True)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(xr @ wr[:vocab].T, t, ignore_index=-1)
    ref.backward()
    assert abs(float(loss) - float(ref)) < 1e-5, (float(loss), float(ref))
    assert float((gx - xr.grad).abs().max()) < 1e-5 and float((gw - wr.grad).abs().max()) < 1e-5


def test_the_triton_loss_kernel_equals_cross_entropy():
    """On a GPU here; without one, on the CPU through Triton's interpreter (skipped without Triton)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        tf32 = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 GEMMs, to compare within 1e-5
        try:
            check_loss_kernel("cuda")
        finally:
            torch.backends.cuda.matmul.allow_tf32 = tf32
    else:
        from conftest import run_in_triton_interpreter
        run_in_triton_interpreter(Path(__file__), "check_loss_kernel")


if __name__ == "__main__":  # the interpreter subprocess: python test_model_fastpath.py CHECK
    globals()[sys.argv[1]]("cpu")
