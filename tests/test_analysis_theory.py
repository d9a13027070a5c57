"""oelm_core.analysis.theory: the 01 notebook's isometry, Johnson-Lindenstrauss and logit tables."""

import pytest

from oelm_core import analysis as A


def test_theory_tables_separate_orthogonal_from_gaussian():
    iso = {r["method"]: r for r in A.isometry_table(64, 32)}
    assert iso["qr"]["isometry_error"] < 1e-10 and iso["cayley"]["condition_number"] == pytest.approx(1)
    assert iso["gaussian"]["orthogonality_error"] > 0.5
    jl = A.jl_curve(64, 16, ks=(4, 32), trials=2)
    assert {r["method"] for r in jl} == {"qr", "gaussian"} and len(jl) == 4
    logits = {r["init"]: r for r in A.logit_stats_table(64, 4, 16)}
    assert logits["normal"]["logit_std"] < 0.2 < logits["qr"]["logit_std"]


def test_jl_curve_picks_its_target_dimensions():
    """The 01 notebook chose k itself; jl_curve takes the powers of two from 8 below d/2, then d/2."""
    assert A.jl_dimensions(512) == [8, 16, 32, 64, 128, 256]
    assert A.jl_dimensions(100) == [8, 16, 32, 50]
    assert A.jl_dimensions(32) == [8, 16] and A.jl_dimensions(63) == [8, 16, 31]
    assert sorted({r["k"] for r in A.jl_curve(64, 16, trials=1)}) == [8, 16, 32]
    with pytest.raises(ValueError, match=r"d=16 leaves fewer than two target dimensions .*pass d >= 32"):
        A.jl_curve(16, 8, trials=1)


def test_the_jl_checks_are_judged_only_where_their_sizes_can_order_the_means():
    """01 asserted qr < gaussian at the last k for any sizes: at d 64, 16 points and one trial
    the Gaussian projection came out ahead for 2 of 10 seeds and the notebook failed."""
    for seed in range(10):
        small = A.jl_checks(A.jl_curve(64, 16, trials=1, seed=seed), 16, 1)
        assert small["holds"] is None and small["k"] == 32
        assert small["why"].startswith(
            "not judged: 16 points x 1 trial(s) are too few to order these means "
            "(it takes jl_points >= 32 and jl_points x jl_trials >= 64); at k = 32"
        )
        judged = A.jl_checks(A.jl_curve(63, 32, trials=2, seed=seed), 32, 2)
        assert judged["holds"] is True and judged["k"] == 31 and judged["qr"] < 0.95 * judged["gaussian"]
        assert judged["why"].endswith("every check holds")
    assert A.jl_checks(A.jl_curve(64, 48, trials=1), 48, 1)["holds"] is None  # 48 point-projections
    # what does not hold is named
    rows = [
        {"method": m, "k": k, "mean": mean, "max": 1.0}
        for m, k, mean in (("qr", 8, 0.3), ("qr", 32, 0.12), ("gaussian", 8, 0.1), ("gaussian", 32, 0.1))
    ]
    verdict = A.jl_checks(rows, 64, 3)
    assert verdict["holds"] is False and verdict["failed"] == [
        "gaussian distortion lower at k = 32 than at k = 8",
        "qr distortion lower than gaussian at k = 32",
    ]
    assert verdict["why"] == (
        "at k = 32, orthonormal rows distort distances by 0.1200 on average, Gaussian ones by "
        "0.1000; does NOT hold: gaussian distortion lower at k = 32 than at k = 8; qr "
        "distortion lower than gaussian at k = 32"
    )


def test_normal_init_is_rescaled_by_the_std_it_was_drawn_with(monkeypatch):
    """isometry_table divided the normal init by a copy of GPT-2's 0.02: another std in
    orthogonal.GPT2_STD would have been judged by its scale, not its shape."""
    from oelm_core import orthogonal

    before = {r["method"]: r for r in A.isometry_table(64, 32)}["normal"]
    monkeypatch.setattr(orthogonal, "GPT2_STD", 0.05)
    after = {r["method"]: r for r in A.isometry_table(64, 32)}["normal"]
    assert after["isometry_error"] == pytest.approx(before["isometry_error"], rel=1e-9)
    assert after["condition_number"] == pytest.approx(before["condition_number"], rel=1e-9)
