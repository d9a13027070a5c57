"""oelm_core.analysis.stats: Welch's test and Cohen's d against scipy and known values."""

import math

import pytest

from oelm_core import analysis as A


def test_welch_matches_scipy_and_cohens_d_known_values():
    from scipy import stats

    a, b = [10.1, 10.4, 9.9, 10.3], [10.9, 11.2, 10.6]
    res = A.significance(a, b)
    ref = stats.ttest_ind(a, b, equal_var=False)
    assert res["t"] == pytest.approx(ref.statistic) and res["p"] == pytest.approx(ref.pvalue)
    # Cohen's d with the pooled sd, by hand
    assert A.significance([1, 2, 3], [4, 5, 6])["cohen_d"] == pytest.approx(-3.0)
    assert A.significance([2, 4], [1, 3])["cohen_d"] == pytest.approx(1 / math.sqrt(2))
    one = A.significance([1.0], [2.0, 3.0])
    assert one["t"] is None and one["p"] is None and one["cohen_d"] is None


def test_welch_degrees_of_freedom():
    res = A.significance([10.1, 10.4, 9.9, 10.3], [10.9, 11.2, 10.6])
    assert res["df"] == pytest.approx(3.574584357380371)
