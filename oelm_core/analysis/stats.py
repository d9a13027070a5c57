"""Statistics over seeds: mean and spread, Welch's test, Cohen's d.

Each function takes plain values, one figure per run (e.g. the validation perplexity of each
seed of a group), and leaves out the values that do not exist (None, NaN: a run cut short before
its first evaluation), as the results table leaves them out of its means. scipy is imported
where it is used, so that importing the analysis does not load it.
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Sequence


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
    out = {"n_a": len(a), "n_b": len(b), "mean_a": statistics.fmean(a) if a else None,
           "mean_b": statistics.fmean(b) if b else None, "t": None, "p": None, "df": None,
           "cohen_d": None}
    if len(a) < 2 or len(b) < 2:
        return out
    res = stats.ttest_ind(a, b, equal_var=False)
    out.update(t=float(res.statistic), p=float(res.pvalue), df=_welch_df(a, b), cohen_d=_cohen_d(a, b))
    return out


def _cohen_d(a: list[float], b: list[float]) -> float:
    va, vb = statistics.variance(a), statistics.variance(b)
    na, nb = len(a), len(b)
    pooled = math.sqrt(((na - 1) * va + (nb - 1) * vb) / (na + nb - 2))
    return (statistics.fmean(a) - statistics.fmean(b)) / pooled if pooled > 0 else float("nan")


def _welch_df(a: list[float], b: list[float]) -> float:
    """The Welch-Satterthwaite degrees of freedom of mean(a) - mean(b): NaN where neither group varies."""
    va, vb = statistics.variance(a), statistics.variance(b)
    na, nb = len(a), len(b)
    return (va / na + vb / nb) ** 2 / ((va / na) ** 2 / (na - 1) + (vb / nb) ** 2 / (nb - 1)) \
        if va + vb > 0 else float("nan")
