"""Statistics over seeds: mean and spread, Welch's test, intervals of a gap, equivalence (TOST),
effect sizes.

Each function takes plain values, one figure per run (e.g. the validation perplexity of each
seed of a group), and leaves out the values that do not exist (None, NaN: a run cut short before
its first evaluation), as the results table leaves them out of its means. Those of two groups
``a`` and ``b`` measure a - b: a positive gap means ``a``'s figure is the larger. A study has few
seeds per group (three to five): Hedges' g and the intervals' docstrings say where that matters.
scipy is imported where it is used, so that importing the analysis does not load it.
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Sequence

# bootstrap_interval's statistics of two groups, as numpy functions of resampled arrays:
# "difference" is mean(a) - mean(b), "relative" the tables' gap, mean(a) / mean(b) - 1.
GAPS = {
    "difference": lambda a, b, axis: a.mean(axis) - b.mean(axis),
    "relative": lambda a, b, axis: a.mean(axis) / b.mean(axis) - 1,
}


def present(values: Iterable[float | None]) -> list[float]:
    """The values that exist, as floats: None and NaN left out."""
    return [float(v) for v in values if v is not None and not math.isnan(v)]


def mean_std(values: Iterable[float | None]) -> tuple[float | None, float | None]:
    """Mean and sample standard deviation (n - 1 in the denominator) of the values that exist;
    the deviation is None with fewer than two."""
    values = present(values)
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def significance(a: Sequence[float], b: Sequence[float]) -> dict:
    """Welch's t-test of mean(a) != mean(b) and Cohen's d (pooled standard deviation).

    Returns {n_a, n_b, mean_a, mean_b, t, p, df, cohen_d}: n_a and n_b count the values used.
    Needs at least two values on each side; otherwise t, p, df and d are None.
    """
    from scipy import stats

    a, b = present(a), present(b)
    out = {
        "n_a": len(a),
        "n_b": len(b),
        "mean_a": statistics.fmean(a) if a else None,
        "mean_b": statistics.fmean(b) if b else None,
        "t": None,
        "p": None,
        "df": None,
        "cohen_d": None,
    }
    if len(a) < 2 or len(b) < 2:
        return out
    res = stats.ttest_ind(a, b, equal_var=False)
    out.update(t=float(res.statistic), p=float(res.pvalue), df=_welch(a, b)[1], cohen_d=_cohen_d(a, b))
    return out


def welch_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """(low, high): the ``confidence`` interval of mean(a) - mean(b) from Welch's t distribution
    (no equal variances assumed; Welch-Satterthwaite degrees of freedom), the interval that
    ``significance``'s test inverts: it excludes 0 exactly where p < 1 - confidence. NaN bounds
    where neither group varies. ValueError with fewer than two values on a side.

    For a relative gap, mean(a) / mean(b) - 1, dividing these bounds by mean(b) ignores the
    uncertainty of mean(b) itself; ``bootstrap_interval(..., "relative")`` does not.
    """
    from scipy import stats

    _check_confidence(confidence)
    a, b = _two_groups(a, b, "welch_interval")
    se, df = _welch(a, b)
    half = float(stats.t.ppf((1 + confidence) / 2, df)) * se
    gap = statistics.fmean(a) - statistics.fmean(b)
    return gap - half, gap + half


def bootstrap_interval(
    a: Sequence[float],
    b: Sequence[float],
    gap: str = "difference",
    confidence: float = 0.95,
    n_resamples: int = 9999,
    seed: int = 0,
) -> tuple[float, float]:
    """(low, high): the percentile bootstrap ``confidence`` interval of a gap between the two
    groups, each group resampled with replacement on its own (the seeds are independent runs).
    ``gap``: "difference", mean(a) - mean(b), or "relative", mean(a) / mean(b) - 1 (the tables'
    gaps, as a fraction). ``seed`` fixes the resamples, so that a report regenerates exactly.
    ValueError with fewer than two values on a side.

    Percentile, not BCa: BCa's acceleration would be estimated from a jackknife of the three to
    five seeds a group has. At such n the bootstrap interval is narrower than Welch's (a
    resample of n values spreads with (n - 1) / n of the variance, and it has no t tail); report
    it beside ``welch_interval``, not instead of it.
    """
    import numpy as np
    from scipy import stats

    _check_confidence(confidence)
    if gap not in GAPS:
        raise ValueError(
            f"gap={gap!r} is not a gap bootstrap_interval computes; pass one of {', '.join(map(repr, GAPS))}"
        )
    a, b = _two_groups(a, b, "bootstrap_interval")
    res = stats.bootstrap(
        (a, b),
        GAPS[gap],
        n_resamples=n_resamples,
        confidence_level=confidence,
        method="percentile",
        vectorized=True,
        random_state=np.random.default_rng(seed),
    )
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def tost(a: Sequence[float], b: Sequence[float], margin: float, alpha: float = 0.05) -> dict:
    """Equivalence of two groups: Schuirmann's two one-sided tests (TOST) with Welch's standard
    error and degrees of freedom. The null hypothesis is a difference of at least ``margin`` (in
    the values' units, > 0) either way, |mean(a) - mean(b)| >= margin; it is rejected, and the
    groups called equivalent, where both one-sided tests reject at ``alpha``:

        p_lower: H0 mean(a) - mean(b) <= -margin    t = (diff + margin) / se, upper tail
        p_upper: H0 mean(a) - mean(b) >= +margin    t = (diff - margin) / se, lower tail

    Returns {equivalent: p < alpha, p: max(p_lower, p_upper), p_lower, p_upper, interval90, df,
    margin, alpha}. interval90 is the (1 - 2 alpha) Welch interval of the difference (90% at the
    default alpha): equivalent exactly where it lies inside (-margin, margin). Where neither group
    varies, the difference itself decides (p 0 or 1). ValueError with fewer than two values on a
    side, or a margin that is not positive.

    Not rejecting equivalence is not evidence of a difference: at three to five seeds a real
    equivalence within a margin near the seeds' spread is often "not shown"."""
    from scipy import stats

    if not margin > 0:
        raise ValueError(
            f"margin={margin!r}: an equivalence margin must be positive (the largest "
            f"difference that counts as none, in the values' units)"
        )
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha={alpha!r} is not a one-sided test level between 0 and 0.5; pass e.g. 0.05")
    a, b = _two_groups(a, b, "tost")
    se, df = _welch(a, b)
    diff = statistics.fmean(a) - statistics.fmean(b)
    if se == 0:
        p_lower, p_upper = float(diff <= -margin), float(diff >= margin)
        interval = (diff, diff)
    else:
        p_lower = float(stats.t.sf((diff + margin) / se, df))
        p_upper = float(stats.t.cdf((diff - margin) / se, df))
        interval = welch_interval(a, b, 1 - 2 * alpha)
    p = max(p_lower, p_upper)
    return {
        "equivalent": p < alpha,
        "p": p,
        "p_lower": p_lower,
        "p_upper": p_upper,
        "interval90": interval,
        "df": df,
        "margin": margin,
        "alpha": alpha,
    }


def cohen_d(a: Sequence[float], b: Sequence[float]) -> float:
    """Cohen's d: (mean(a) - mean(b)) / the pooled standard deviation, sqrt(((n_a - 1) var_a +
    (n_b - 1) var_b) / (n_a + n_b - 2)). NaN where neither group varies; ValueError with fewer
    than two values on a side. It overstates the effect at small n: see ``hedges_g``."""
    return _cohen_d(*_two_groups(a, b, "cohen_d"))


def hedges_g(a: Sequence[float], b: Sequence[float]) -> float:
    """Hedges' g: Cohen's d times the exact small-sample correction J(m) = Gamma(m/2) /
    (sqrt(m/2) Gamma((m - 1)/2)), m = n_a + n_b - 2, which makes it unbiased (Hedges 1981).
    J is 0.80 at three seeds a side (m = 4) and 0.90 at five; the common approximation
    1 - 3 / (4m - 1) is within 0.3% of it from m = 4. ValueError with fewer than two values
    on a side."""
    a, b = _two_groups(a, b, "hedges_g")
    m = len(a) + len(b) - 2
    return _cohen_d(a, b) * math.exp(math.lgamma(m / 2) - math.lgamma((m - 1) / 2)) / math.sqrt(m / 2)


def _cohen_d(a: list[float], b: list[float]) -> float:
    va, vb = statistics.variance(a), statistics.variance(b)
    na, nb = len(a), len(b)
    pooled = math.sqrt(((na - 1) * va + (nb - 1) * vb) / (na + nb - 2))
    return (statistics.fmean(a) - statistics.fmean(b)) / pooled if pooled > 0 else float("nan")


def _welch(a: list[float], b: list[float]) -> tuple[float, float]:
    """(standard error of mean(a) - mean(b) without equal variances, its Welch-Satterthwaite
    degrees of freedom: NaN where neither group varies)."""
    va, vb = statistics.variance(a), statistics.variance(b)
    na, nb = len(a), len(b)
    df = (
        (va / na + vb / nb) ** 2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1))
        if va + vb > 0
        else float("nan")
    )
    return math.sqrt(va / na + vb / nb), df


def _two_groups(a: Sequence[float], b: Sequence[float], what: str) -> tuple[list[float], list[float]]:
    a, b = present(a), present(b)
    if len(a) < 2 or len(b) < 2:
        raise ValueError(
            f"{what} needs at least two values in each group (None and NaN left out); got "
            f"{len(a)} and {len(b)}: train more seeds of the group with fewer"
        )
    return a, b


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence!r} is not a probability between 0 and 1; pass e.g. 0.95")
