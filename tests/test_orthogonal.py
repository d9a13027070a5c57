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
    assert set(QK_INITS) == {"normal", "qr", "svd", "householder", "cayley", "gaussian"}
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


def test_qr_sign_correction_gives_haar():
    n, draws = 8, 2000
    g = gen(2)
    W = torch.stack([orthogonal(n, n, "qr", generator=g, dtype=torch.float64) for _ in range(draws)])
    # Haar: every entry is symmetric about 0 with E[W_ij^2] = 1/n.
    assert abs(W.diagonal(dim1=1, dim2=2).mean().item()) < 0.05
    assert abs(W[:, 0, 0].var().item() - 1 / n) < 0.015
    # Raw LAPACK QR fixes R's diagonal signs instead, which pushes Q's diagonal negative.
    Q, _ = torch.linalg.qr(torch.randn(draws, n, n, generator=g, dtype=torch.float64))
    assert Q.diagonal(dim1=1, dim2=2).mean().item() < -0.1
    assert (Q[:, 0, 0] < 0).all()


def test_jl_distortion_shrinks_with_k():
    d, n = 512, 50
    X = torch.randn(n, d, generator=gen(3))
    stats = {(m, k): jl_distortion(random_projection(k, d, m, generator=gen(k)), X)
             for m in ("qr", "gaussian") for k in (32, 256)}
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
    normal = attention_logit_stats(init_qk(d, d, "normal", generator=g), init_qk(d, d, "normal", generator=g),
                                   x, n_head)
    assert 0.8 < ortho["std"] < 1.25
    assert normal["std"] < 0.5 * ortho["std"]
    # Smaller logits mean flatter attention, closer to the uniform entropy log(64).
    assert ortho["entropy"] < normal["entropy"] < torch.log(torch.tensor(64.0)).item()
