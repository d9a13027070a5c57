"""POET-style learnable orthogonal Q/K: W = R W0 P keeps W0's singular values while it trains."""

import io

import pytest
import torch

from oelm_core import ConfigError, build_model, count_parameters, model_config
from oelm_core.orthogonal import orthogonality_error
from oelm_core.poet import (
    POETProjection,
    apply_block_rotation,
    cayley_exact,
    cayley_neumann,
    poet_modules,
    skew_from_upper,
    spectrum_error,
)
from oelm_core.step import restart_optimizer_state

# tiny preset: 2 layers, d 32, vocab 128, T 32; block 16 gives 2 blocks per factor.
TINY = dict(poet_block_size=16)


pytestmark = pytest.mark.usefixtures("one_thread")


def poet(seed: int = 0, **overrides):
    return build_model("tiny", "oelm_poet", seed=seed, **{**TINY, **overrides})


def train(model, steps: int, lr: float = 1e-3, reset_state: bool = False):
    """AdamW on a real next-token loss (predict the previous token: learnable by attention)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    errors, losses = [], []
    for step in range(1, steps + 1):
        x = torch.randint(0, model.cfg.vocab_size, (4, model.cfg.block_size), generator=g)
        loss = model(x, torch.roll(x, 1, dims=1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        for m in model.modules():
            if hasattr(m, "after_optimizer_step"):
                restarted = m.after_optimizer_step(step)
                if reset_state:
                    restart_optimizer_state(opt, restarted)
        errors.append(max(spectrum_error(m, model.cfg.qk_gain) for m in poet_modules(model)))
        losses.append(loss.item())
    return errors, losses, opt


def rand_skew(n: int, b: int, scale: float, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return skew_from_upper(torch.randn(n, b * (b - 1) // 2, generator=g, dtype=torch.float64) * scale, b)


def test_building_blocks():
    q = rand_skew(3, 6, 0.1)
    assert torch.equal(q, -q.transpose(1, 2))
    eye = torch.eye(6, dtype=torch.float64)
    c = cayley_exact(q)
    assert (c @ c.transpose(1, 2) - eye).abs().max() < 1e-12
    # The truncated series converges to the exact transform...
    assert (cayley_neumann(q, 40) - c).abs().max() < 1e-12
    # ...and on an eigenvalue i*theta of Q its singular value is |1 - (i theta)^(n+1)|.
    theta = 0.3
    q2 = torch.tensor([[[0.0, theta], [-theta, 0.0]]], dtype=torch.float64)
    for n in (1, 2, 3, 4, 5):
        s = torch.linalg.svdvals(cayley_neumann(q2, n)[0])
        expected = abs(1 - (1j * theta) ** (n + 1))
        assert torch.allclose(s, torch.full((2,), expected, dtype=torch.float64), atol=1e-12)


def test_block_rotation_equals_the_dense_matrix():
    d, b = 12, 4
    blocks = cayley_exact(rand_skew(d // b, b, 0.5))
    perm = torch.randperm(d, generator=torch.Generator().manual_seed(0))
    dense_blocks = torch.block_diag(*blocks)
    pi = torch.eye(d, dtype=torch.float64)[perm]  # (Pi x) = x[perm]
    r = pi.T @ dense_blocks @ pi
    m = torch.randn(d, 5, dtype=torch.float64)
    assert torch.allclose(apply_block_rotation(blocks, perm, m), r @ m, atol=1e-12)
    assert torch.allclose(r @ r.T, torch.eye(d, dtype=torch.float64), atol=1e-12)


def test_starts_at_w0_and_has_the_qk_interface():
    model = poet()
    qk = model.blocks[0].attn.qk
    assert isinstance(qk, POETProjection)
    assert qk.weight.shape == (64, 32)
    assert torch.equal(qk.weight, torch.cat([qk.w0_q, qk.w0_k]))  # Q = 0: R = P = I exactly
    x = torch.randn(2, 5, 32)
    assert torch.allclose(qk(x), x @ qk.weight.T, atol=1e-6)
    assert orthogonality_error(qk.w0_q) < 1e-5 and orthogonality_error(qk.w0_k) < 1e-5
    names = [n for n, _ in model.named_parameters()]
    assert model.unfreeze_qk("all") == []  # nothing frozen to unfreeze: R and P always train
    assert [n for n, _ in model.named_parameters()] == names


def test_accounting_counts_the_skew_generators():
    model = poet()
    c = count_parameters(model)
    skew = 2 * 4 * 2 * (16 * 15 // 2)  # layers * factors * blocks * b(b-1)/2 = 1,920
    assert c["by_component"]["attn_qk"] == {"trainable": skew, "frozen": 2 * 2 * 32 * 32}
    frozen_ref = count_parameters(build_model("tiny", "oelm_freeze"))
    assert c["frozen"] == frozen_ref["frozen"] and c["trainable"] == frozen_ref["trainable"] + skew
    # Permutation indices and seeds are integer buffers: bookkeeping, not weights.
    assert all(not b.is_floating_point() for n, b in model.named_buffers() if "perm" in n or "poet_" in n)


@pytest.mark.parametrize("gain", [1.0, 2.0])
def test_training_keeps_the_spectrum_with_five_terms_and_drifts_with_one(gain):
    five = poet(poet_neumann_terms=5, poet_merge_every=0, qk_gain=gain)
    one = poet(poet_neumann_terms=1, poet_merge_every=0, qk_gain=gain)
    w_start = five.blocks[0].attn.qk.weight.detach().clone()
    err5, loss5, _ = train(five, 50)
    err1, _, _ = train(one, 50)
    assert max(err5) < 1e-3  # ~2e-5 measured
    assert max(err1) > 1e-2 and max(err1) > 100 * max(err5)  # ~4e-2 measured
    assert sum(loss5[-5:]) / 5 < sum(loss5[:5]) / 5 - 0.05  # a real loss that really went down
    w_end = five.blocks[0].attn.qk.weight.detach()
    assert (w_end - w_start).abs().max() > 1e-2  # ...while Q/K really moved


def test_gradients_reach_only_the_skew_generators():
    model = poet()
    x = torch.randint(0, 128, (2, 32))
    model(x, x).backward()
    qk = model.blocks[0].attn.qk
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in qk.skew_parameters())
    assert not qk.w0_q.requires_grad and qk.w0_q.grad is None
    assert {n.split(".")[-1] for n, _ in qk.named_parameters()} == {
        "skew_q_left",
        "skew_q_right",
        "skew_k_left",
        "skew_k_right",
    }


def test_merge_folds_r_and_p_into_w0_and_resets():
    model = poet(poet_merge_every=0)
    train(model, 20, lr=3e-3)
    qk = model.blocks[1].attn.qk
    w_before = qk.weight.detach().clone()
    perms = qk.perm_q_left.clone()
    qk.merge()
    assert all(torch.equal(p, torch.zeros_like(p)) for p in qk.skew_parameters())
    assert not torch.equal(qk.perm_q_left, perms) and int(qk.poet_merges) == 1
    assert torch.equal(qk.perm_q_left.sort().values, torch.arange(32))
    # W0 absorbed R and P (exact Cayley): same weight up to the Neumann truncation error.
    assert torch.allclose(qk.weight, w_before, atol=1e-4)
    assert torch.equal(qk.weight, torch.cat([qk.w0_q, qk.w0_k]))
    assert orthogonality_error(qk.w0_q) < 1e-5 and orthogonality_error(qk.w0_k) < 1e-5


def test_periodic_merges_keep_the_spectrum_exact_over_long_training():
    model = poet(poet_merge_every=10)
    errors, losses, opt = train(model, 40, lr=3e-3, reset_state=True)
    assert all(int(m.poet_merges) == 4 for m in poet_modules(model))
    assert max(errors) < 1e-4
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.2


def test_merge_restarts_exactly_the_merged_generators_moments():
    model = poet(poet_merge_every=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 128, (2, 32))
    for step in (1, 2, 3):
        opt.zero_grad()
        model(x, x).backward()
        opt.step()
        restarted = [p for m in poet_modules(model) for p in m.after_optimizer_step(step)]
        assert restart_optimizer_state(opt, restarted) == (8 if step == 3 else 0)  # 2 layers x 4
    skew = poet_modules(model)[0].skew_parameters()[0]
    assert torch.count_nonzero(opt.state[skew]["exp_avg"]) == 0
    assert torch.count_nonzero(opt.state[skew]["exp_avg_sq"]) == 0
    assert torch.count_nonzero(opt.state[model.wte.weight]["exp_avg"]) > 0


def test_state_dict_round_trip_restores_weights_and_permutations():
    model = poet(poet_merge_every=5)
    train(model, 12, lr=3e-3)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    fresh = poet(seed=123, poet_merge_every=5)
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    for a, b in zip(poet_modules(model), poet_modules(fresh)):
        assert torch.equal(a.weight, b.weight) and torch.equal(a.perm_k_right, b.perm_k_right)
        a.merge(), b.merge()  # the next merge draws the same permutations on both
        assert torch.equal(a.perm_k_right, b.perm_k_right)


def test_bf16_autocast_builds_the_weight_in_float32():
    model = poet()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w = model.blocks[0].attn.qk.weight
        out = model(torch.randint(0, 128, (1, 8)))
    assert w.dtype == torch.float32 and torch.isfinite(out).all()
    assert spectrum_error(model.blocks[0].attn.qk) < 1e-6


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(poet_block_size=12), "must divide"),
        (dict(freeze_qk="all"), "freeze_qk: none"),
        (dict(poet_neumann_terms=0), "at least 1"),
    ],
)
def test_bad_poet_configs(overrides, message):
    with pytest.raises(ConfigError, match=message):
        model_config("tiny", "oelm_poet", **overrides)


def test_block_sizes_that_divide_every_preset():
    from oelm_core import PRESETS

    for name, shape in PRESETS.items():
        cfg = model_config(name, "oelm_poet")
        assert shape["d_model"] % cfg.poet_block_size == 0, name
