"""Numerical checks of oelm_core.orthogonal: exactness, Haar sign correction, JL and logit scale."""

import pytest
import torch

from oelm_core.orthogonal import (
    ORTHOGONAL_METHODS,
    QK_INITS,
    attention_logit_stats,
    condition_number,
    gaussian,
    init_qk,
    isometry_error,
    jl_distortion,
    orthogonal,
    orthogonality_error,
    random_projection,
)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_qk_inits_cover_every_construction():
    assert set(QK_INITS) == {"normal", "qr", "svd", "householder", "cayley", "gaussian", "illcond"}
    assert set(ORTHOGONAL_METHODS) == {"qr", "svd", "householder", "cayley"}


@pytest.mark.parametrize("method", ["qr", "svd", "householder", "cayley"])
@pytest.mark.parametrize("shape", [(512, 512), (64, 512), (512, 64)])
@pytest.mark.parametrize("gain", [1.0, 2.0])
def test_orthogonal_is_exact_in_float32(method, shape, gain):
    W = orthogonal(*shape, method=method, gain=gain, generator=gen())
    assert W.shape == shape and W.dtype == torch.float32
    err = orthogonality_error(W, gain=gain)
    assert isinstance(err, float) and err < 1e-5
    # The Gram matrix of the smaller side is gain^2 I: 4 I for gain 2.
    w = W.double()
    gram = w @ w.T if shape[0] <= shape[1] else w.T @ w
    assert torch.allclose(gram, gain**2 * torch.eye(min(shape), dtype=torch.float64), atol=1e-5)


def test_gaussian_is_far_from_orthogonal():
    G = gaussian(512, 512, generator=gen())
    Q = orthogonal(512, 512, generator=gen())
    assert orthogonality_error(G) > 0.5
    assert abs(condition_number(Q) - 1) < 1e-4
    assert condition_number(G) > 100 * condition_number(Q)
    # Same expected row norm (gain^2 = 1) despite that: the control changes only the geometry.
    assert abs(G.double().norm(dim=1).pow(2).mean().item() - 1) < 0.02


def test_isometry():
    x = torch.randn(100, 512, generator=gen(1))
    assert isometry_error(orthogonal(512, 512, generator=gen()), x) < 1e-5
    assert isometry_error(gaussian(512, 512, generator=gen()), x) > 0.01


def haar_statistics(method: str, n: int = 8, draws: int = 2000, seed: int = 2) -> dict[str, float]:
    g = gen(seed)
    W = torch.stack([orthogonal(n, n, method, generator=g, dtype=torch.float64) for _ in range(draws)])
    tr = W.diagonal(dim1=1, dim2=2).sum(-1)
    return {
        "p_det_positive": (torch.linalg.det(W) > 0).double().mean().item(),
        "mean_trace": tr.mean().item(),
        "mean_trace_sq": tr.pow(2).mean().item(),
        "max_abs_entry_mean": W.mean(0).abs().max().item(),
    }


@pytest.mark.parametrize("method", ["qr", "svd"])
def test_haar_constructions_are_haar(method):
    """Haar on O(n): det is +1 or -1 with probability 1/2 each, E[tr W] = 0, E[tr(W)^2] = 1 (for
    n >= 2) and every entry has mean 0. A missing or partial sign correction moves the
    determinant's sign and tr(W)^2 (e.g. correcting column 0 only: P(det > 0) = 0,
    E[tr^2] = 3), an unsymmetrised factor moves the entries' means. Standard errors at 2,000
    draws: 0.011, 0.022, 0.03 and 0.008; the bounds are 5 or more of them."""
    s = haar_statistics(method)
    assert abs(s["p_det_positive"] - 0.5) < 0.06, s
    assert abs(s["mean_trace"]) < 0.11, s
    assert abs(s["mean_trace_sq"] - 1) < 0.2, s
    assert s["max_abs_entry_mean"] < 0.045, s


@pytest.mark.parametrize("method", ["householder", "cayley"])
def test_the_haar_statistics_reject_the_non_haar_constructions(method):
    # The statistics above tell these from Haar: both always have det +1 at n = 8 (Householder: (-1)^n).
    assert haar_statistics(method, draws=200)["p_det_positive"] == 1.0


def test_jl_distortion_shrinks_with_k():
    d, n = 512, 50
    X = torch.randn(n, d, generator=gen(3))
    stats = {
        (m, k): jl_distortion(random_projection(k, d, m, generator=gen(k)), X)
        for m in ("qr", "gaussian")
        for k in (32, 256)
    }
    assert set(stats["qr", 256]) == {"max", "mean", "std"}
    assert stats["qr", 256]["mean"] < 0.1
    for m in ("qr", "gaussian"):
        assert stats[m, 256]["mean"] < stats[m, 32]["mean"]
        assert stats[m, 256]["max"] < stats[m, 32]["max"]


def test_jl_distortion_zero_for_full_rank_orthogonal():
    X = torch.randn(20, 64, generator=gen(4))
    assert jl_distortion(orthogonal(64, 64, generator=gen()), X)["max"] < 1e-5


@pytest.mark.parametrize("method", list(QK_INITS))
def test_same_seed_same_matrix(method):
    a = init_qk(64, 128, method, generator=gen(7))
    b = init_qk(64, 128, method, generator=gen(7))
    c = init_qk(64, 128, method, generator=gen(8))
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_unknown_method_lists_valid_names():
    with pytest.raises(ValueError) as exc:
        orthogonal(4, 4, method="givens")
    assert all(name in str(exc.value) for name in ORTHOGONAL_METHODS)
    with pytest.raises(ValueError) as exc:
        init_qk(4, 4, "givens")
    assert all(name in str(exc.value) for name in QK_INITS)


def test_attention_logit_scale_at_init():
    d, n_head = 256, 4
    x = torch.randn(64, d, generator=gen(5))
    g = gen(6)
    ortho = attention_logit_stats(orthogonal(d, d, generator=g), orthogonal(d, d, generator=g), x, n_head)
    normal = attention_logit_stats(
        init_qk(d, d, "normal", generator=g), init_qk(d, d, "normal", generator=g), x, n_head
    )
    assert 0.8 < ortho["std"] < 1.25
    assert normal["std"] < 0.5 * ortho["std"]
    # Smaller logits mean flatter attention, closer to the uniform entropy log(64).
    assert ortho["entropy"] < normal["entropy"] < torch.log(torch.tensor(64.0)).item()


def test_condition_number_is_inf_for_rank_deficient_matrices():
    u, v = torch.randn(6, 1, generator=gen(9)), torch.randn(1, 6, generator=gen(10))
    for W in (
        torch.zeros(4, 4),
        torch.ones(4, 4),
        u @ v,
        u.double() @ v.double(),
        torch.zeros(2, 5),
        torch.eye(5, 3) @ torch.eye(3, 5),
    ):
        assert condition_number(W) == float("inf"), W
    assert condition_number(torch.eye(3, 5)) == 1.0
    W = torch.diag(torch.tensor([1.0, 1e-3], dtype=torch.float64))
    assert condition_number(W) == pytest.approx(1e3)  # ill-conditioned, yet of full rank


def test_random_projection_refuses_k_above_d():
    for method in ("qr", "gaussian"):
        with pytest.raises(ValueError, match=r"k=64 > d=16"):
            random_projection(64, 16, method)
    assert random_projection(16, 16).shape == (16, 16)


def test_gaussian_rectangular_uses_fan_in():
    from oelm_core.orthogonal import gaussian

    G = gaussian(64, 512, generator=gen(0))
    assert abs(G.double().pow(2).sum(1).mean().item() - 1) < 0.05  # 1.012; var 1/rows gives 8
    X = torch.randn(50, 512, generator=gen(3))
    assert jl_distortion(random_projection(32, 512, "gaussian", generator=gen(32)), X)["mean"] < 0.2  # 0.097


def test_orthogonality_and_isometry_errors_known_values():
    from oelm_core.orthogonal import isometry_error

    assert orthogonality_error(0.5 * torch.eye(4)) == pytest.approx(0.75)
    assert orthogonality_error(torch.diag(torch.tensor([2.0, 1.0]))) == pytest.approx(3.0)
    assert isometry_error(torch.diag(torch.tensor([2.0, 1.0])), torch.eye(2)) == pytest.approx(1.0)


def test_attention_logit_stats_splits_heads_by_feature():
    from oelm_core.orthogonal import attention_logit_stats

    x = torch.arange(24, dtype=torch.float64).reshape(3, 8) / 10
    eye = torch.eye(8, dtype=torch.float64)
    s = attention_logit_stats(eye, eye, x, 2)
    assert s["std"] == pytest.approx(2.567379070982243) and s["entropy"] == pytest.approx(0.5594273727139393)


def test_cayley_eigen_angles_stay_below_pi():
    import math

    from oelm_core.orthogonal import orthogonal

    W = orthogonal(64, 64, "cayley", generator=gen(0), dtype=torch.float64)
    ang = torch.linalg.eigvals(W).angle().abs()
    assert 100 < math.degrees(ang.max().item()) < 135 and 55 < math.degrees(ang.mean().item()) < 85


def test_the_ill_conditioned_control_has_the_orthogonal_scale_and_a_100_to_1_spectrum():
    """The orthogonality ablation's control (issue 42): frozen Q/K at the orthogonal's Frobenius
    norm whose singular values span 100:1, against the Gaussian control, whose row norm matches
    the orthogonal's too but whose spectrum spans thousands to one at d = 512."""
    from oelm_core.orthogonal import ILL_CONDITION, gaussian, ill_conditioned

    g = torch.Generator().manual_seed(3)
    for rows, cols in ((512, 512), (128, 512), (512, 128)):
        w = ill_conditioned(rows, cols, generator=g, dtype=torch.float64)
        s = torch.linalg.svdvals(w)
        assert s.max() / s.min() == pytest.approx(ILL_CONDITION, rel=1e-9)
        o = orthogonal(rows, cols, generator=g, dtype=torch.float64)
        assert w.norm().item() == pytest.approx(o.norm().item(), rel=1e-12)
        # log-spaced: each singular value a fixed ratio from the next
        ratios = (s[:-1] / s[1:]).numpy()
        assert ratios.max() == pytest.approx(ratios.min(), rel=1e-6)
    gs = torch.linalg.svdvals(gaussian(512, 512, generator=g, dtype=torch.float64))
    assert gaussian(512, 512, generator=g).norm(dim=1).mean().item() == pytest.approx(1.0, abs=0.01)
    assert (gs.max() / gs.min()).item() > 10 * ILL_CONDITION
