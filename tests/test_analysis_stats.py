"""oelm_core.analysis.stats against scipy, R and closed forms: Welch's test and interval, the
bootstrap interval of a gap, Cohen's d and Hedges' g."""

import math
import random
import statistics

import numpy as np
import pytest
from scipy import stats

from oelm_core import analysis as A

# R's `sleep` data (Student 1908): extra hours of sleep under two drugs, ten patients each. R's
# t.test(extra ~ group, data = sleep) prints the Welch test these tests check against:
#   t = -1.8608, df = 17.776, p-value = 0.07939
#   95 percent confidence interval: -3.3654832  0.2054832
SLEEP_1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
SLEEP_2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]
# Three seeds against four of a perplexity, the size of a study's groups.
A4, B3 = [10.1, 10.4, 9.9, 10.3], [10.9, 11.2, 10.6]


def test_welch_matches_scipy_and_cohens_d_known_values():
    res = A.significance(A4, B3)
    ref = stats.ttest_ind(A4, B3, equal_var=False)
    assert res["t"] == pytest.approx(ref.statistic) and res["p"] == pytest.approx(ref.pvalue)
    # Cohen's d with the pooled sd, by hand
    assert A.significance([1, 2, 3], [4, 5, 6])["cohen_d"] == pytest.approx(-3.0)
    assert A.significance([2, 4], [1, 3])["cohen_d"] == pytest.approx(1 / math.sqrt(2))
    one = A.significance([1.0], [2.0, 3.0])
    assert one["t"] is None and one["p"] is None and one["cohen_d"] is None


def test_welch_degrees_of_freedom():
    res = A.significance(A4, B3)
    assert res["df"] == pytest.approx(3.574584357380371)


def test_welch_test_and_interval_match_r_on_the_sleep_data():
    res = A.significance(SLEEP_1, SLEEP_2)
    assert res["t"] == pytest.approx(-1.8608, abs=5e-5) and res["p"] == pytest.approx(0.07939, abs=5e-6)
    assert res["df"] == pytest.approx(17.776, abs=5e-4)
    low, high = A.welch_interval(SLEEP_1, SLEEP_2)
    assert (low, high) == (pytest.approx(-3.3654832, abs=1e-7), pytest.approx(0.2054832, abs=1e-7))


@pytest.mark.parametrize("a, b", [(A4, B3), (SLEEP_1, SLEEP_2), ([20.1, 19.2, 21.4, 20.0, 19.6], [18.3, 18.9, 18.1])])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_welch_interval_is_the_one_scipy_inverts_from_the_test(a, b, confidence):
    """Welch's interval excludes 0 exactly where the test's p is below 1 - confidence."""
    low, high = A.welch_interval(a, b, confidence)
    ref = stats.ttest_ind(a, b, equal_var=False).confidence_interval(confidence)
    assert (low, high) == (pytest.approx(ref.low, rel=1e-9), pytest.approx(ref.high, rel=1e-9))
    assert low < statistics.fmean(a) - statistics.fmean(b) < high
    assert (low > 0 or high < 0) == (A.significance(a, b)["p"] < 1 - confidence)


def test_welch_interval_leaves_out_missing_values_and_refuses_too_few():
    assert A.welch_interval(A4 + [None, math.nan], B3) == A.welch_interval(A4, B3)
    assert all(math.isnan(x) for x in A.welch_interval([1.0, 1.0], [2.0, 2.0]))  # neither group varies
    with pytest.raises(
        ValueError,
        match=r"welch_interval needs at least two values in each group \(None and NaN "
        r"left out\); got 4 and 1",
    ):
        A.welch_interval(A4, [10.9, None])
    with pytest.raises(ValueError, match=r"confidence=95 is not a probability between 0 and 1; pass e.g. 0.95"):
        A.welch_interval(A4, B3, 95)


def test_bootstrap_interval_of_groups_whose_resamples_can_be_counted():
    """a = [0, 1] resamples to means 0, 1/2, 1 with chances 1/4, 1/2, 1/4, b = [0, 0] to 0: the
    central 95% of mean(a) - mean(b) runs from 0 to 1. The relative gap of [2, 2.2] to [1, 1]
    takes 1.0, 1.1 and 1.2 alike."""
    assert A.bootstrap_interval([0.0, 1.0], [0.0, 0.0]) == (0.0, 1.0)
    assert A.bootstrap_interval([2.0, 2.2], [1.0, 1.0], "relative") == (pytest.approx(1.0), pytest.approx(1.2))
    assert A.bootstrap_interval([2.0, 2.0, 2.0], [1.0, 1.0, 1.0], "relative") == (1.0, 1.0)


def test_bootstrap_interval_agrees_with_welch_where_the_groups_are_large():
    rng = np.random.default_rng(1)
    a, b = list(rng.normal(1.0, 2.0, 200)), list(rng.normal(0.0, 1.0, 150))
    boot, welch = A.bootstrap_interval(a, b), A.welch_interval(a, b)
    width = welch[1] - welch[0]
    assert boot == (pytest.approx(welch[0], abs=0.03 * width), pytest.approx(welch[1], abs=0.03 * width))


def test_bootstrap_interval_is_seeded_and_narrower_than_welch_at_a_few_seeds():
    """Its docstring's warning, in numbers: at three and four seeds the bootstrap interval is
    much narrower than Welch's (-1.32 to -0.13)."""
    boot = A.bootstrap_interval(A4, B3)
    assert boot == A.bootstrap_interval(A4, B3) == (pytest.approx(-1.05), pytest.approx(-0.40))
    assert A.bootstrap_interval(A4, B3, seed=1) != A.bootstrap_interval(A4, B3, seed=2)
    low, high = A.welch_interval(A4, B3)
    assert low < boot[0] < boot[1] < high and (boot[1] - boot[0]) < 0.6 * (high - low)
    ratio = A.bootstrap_interval(A4, B3, "relative")
    gap = statistics.fmean(A4) / statistics.fmean(B3) - 1
    assert ratio[0] < gap < ratio[1] < 0


def test_bootstrap_interval_refuses_what_it_cannot_compute():
    with pytest.raises(
        ValueError,
        match=r"gap='ratio' is not a gap bootstrap_interval computes; pass one of "
        r"'difference', 'relative'",
    ):
        A.bootstrap_interval(A4, B3, "ratio")
    with pytest.raises(ValueError, match=r"bootstrap_interval needs at least two values in each group .*got 1 and 3"):
        A.bootstrap_interval([10.0, math.nan], B3)
    assert A.bootstrap_interval(A4 + [None], B3) == A.bootstrap_interval(A4, B3)


def test_cohens_d_and_hedges_g_known_values():
    """Cohen's d of the sleep data is R effsize's -0.8321811. Hedges' exact correction J(m) has
    closed forms: 1/sqrt(pi) at m = 2, sqrt(2/pi) at m = 4; the approximation 1 - 3/(4m - 1)
    (effsize's) gives -0.7970 for the sleep data."""
    assert A.cohen_d(SLEEP_1, SLEEP_2) == pytest.approx(-0.8321811, abs=1e-7)
    assert A.hedges_g(SLEEP_1, SLEEP_2) == pytest.approx(-0.8321811 * (1 - 3 / 71), rel=2e-4)
    assert A.hedges_g([2, 4], [1, 3]) == pytest.approx(1 / math.sqrt(2) / math.sqrt(math.pi))
    assert A.hedges_g([1, 2, 3], [4, 5, 6]) == pytest.approx(-3 * math.sqrt(2 / math.pi))
    assert A.cohen_d(A4, B3) == A.significance(A4, B3)["cohen_d"]
    assert math.isnan(A.cohen_d([1.0, 1.0], [2.0, 2.0])) and math.isnan(A.hedges_g([1.0, 1.0], [2.0, 2.0]))
    with pytest.raises(ValueError, match=r"hedges_g needs at least two values in each group .*got 1 and 2"):
        A.hedges_g([1.0], [2.0, 3.0])
    with pytest.raises(ValueError, match=r"cohen_d needs at least two values in each group .*got 2 and 0"):
        A.cohen_d([1.0, 2.0], [None, math.nan])


def test_hedges_g_removes_the_small_sample_bias_of_cohens_d():
    """Three seeds a side drawn with a true effect of 1 (unit variances): d averages 1/J(4) =
    sqrt(pi/2) = 1.25, g averages 1 (4,000 draws: standard error 0.02)."""
    rng = random.Random(0)
    draws = [([rng.gauss(1, 1) for _ in range(3)], [rng.gauss(0, 1) for _ in range(3)]) for _ in range(4000)]
    d = statistics.fmean(A.cohen_d(a, b) for a, b in draws)
    g = statistics.fmean(A.hedges_g(a, b) for a, b in draws)
    assert d == pytest.approx(math.sqrt(math.pi / 2), abs=0.06)
    assert g == pytest.approx(1.0, abs=0.06)


def test_mean_std_is_the_sample_standard_deviation_of_the_values_that_exist():
    assert A.mean_std([10.0, 10.2, 9.8, None, math.nan]) == (pytest.approx(10.0), pytest.approx(0.2))
    assert A.mean_std([3]) == (3.0, None) and A.mean_std([None]) == (None, None)


# --- equivalence: two one-sided tests --------------------------------------------------------


@pytest.mark.parametrize(
    "a, b, margin",
    [
        ([2.170, 2.181, 2.162, 2.175, 2.168], [2.176, 2.183, 2.171, 2.181, 2.177], math.log(1.02)),  # near: equivalent
        ([2.170, 2.181, 2.162, 2.175, 2.168], [2.310, 2.335, 2.322, 2.351, 2.327], math.log(1.02)),  # far apart
        ([2.17, 2.23, 2.12], [2.18, 2.26, 2.14], math.log(1.02)),  # spread
        (SLEEP_1, SLEEP_2, 1.0),
    ],
)
def test_tost_is_two_one_sided_welch_tests_at_the_margin(a, b, margin):
    """Each one-sided p is scipy's Welch test of a shifted by the margin; equivalence is p < alpha,
    which is the 90% Welch interval lying within the margin."""
    res = A.tost(a, b, margin)
    shifted = np.asarray(a, dtype=float)
    lower = stats.ttest_ind(shifted + margin, b, equal_var=False, alternative="greater").pvalue
    upper = stats.ttest_ind(shifted - margin, b, equal_var=False, alternative="less").pvalue
    assert res["p_lower"] == pytest.approx(lower, rel=1e-9) and res["p_upper"] == pytest.approx(upper, rel=1e-9)
    assert res["p"] == pytest.approx(max(lower, upper), rel=1e-9)
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.90)
    assert res["interval90"] == (pytest.approx(ci.low, rel=1e-9), pytest.approx(ci.high, rel=1e-9))
    assert res["equivalent"] == (res["p"] < 0.05) == (-margin < ci.low and ci.high < margin)
    assert res["df"] == pytest.approx(A.significance(a, b)["df"])


def test_tost_decides_equivalence_only_where_the_data_show_it():
    near = [2.170, 2.181, 2.162, 2.175, 2.168], [2.176, 2.183, 2.171, 2.181, 2.177]
    assert A.tost(*near, math.log(1.02))["equivalent"] is True  # 0.0064 nats apart, 5 tight seeds
    assert A.tost(*near, 0.003)["equivalent"] is False  # a margin below the difference
    spread = [2.17, 2.23, 2.12], [2.18, 2.26, 2.14]
    res = A.tost(*spread, math.log(1.02))
    assert res["equivalent"] is False and res["p"] > 0.05  # 0.02 apart, but 3 spread seeds cannot show it
    # a group that does not vary: the difference itself decides
    assert A.tost([1.0, 1.0], [1.01, 1.01], 0.02)["p"] == 0.0
    assert A.tost([1.0, 1.0], [1.05, 1.05], 0.02)["p"] == 1.0
    with pytest.raises(ValueError, match="margin=0"):
        A.tost(*near, 0)
    with pytest.raises(ValueError, match="at least two values in each group"):
        A.tost([1.0], [1.0, 2.0], 0.1)
    with pytest.raises(ValueError, match="alpha=0.5"):
        A.tost(*near, 0.02, alpha=0.5)
