"""Gaps between groups of seeds with their uncertainty, and the three verdicts of a claim.

The perplexity gap of group a to group b is the relative gap of their geometric-mean PPLs,

    gap = exp(mean(loss_a) - mean(loss_b)) - 1

where loss is each seed's validation loss (nats/token, PPL = exp(loss)). Both 95% intervals are
taken on the loss difference and mapped through exp(.) - 1: Welch's t interval (``welch_interval``)
and the percentile bootstrap (``bootstrap_interval(..., "difference")``). exp is monotone, so
either interval of the difference maps exactly onto the interval of the geometric-mean PPL ratio
(a t interval of the PPLs' arithmetic means, divided by one of them, would leave that mean's own
uncertainty out). The losses, not the PPLs, are what a t interval assumes close to normal: the
PPLs are their exponentials. The geometric mean PPL is below the arithmetic mean (the results
table's "Val PPL") by about var(loss) / 2 relative, a small fraction of the gaps' width here.

A claim "a within X% of b" then holds where the whole Welch interval is below X, does not hold
where the whole interval is above it, and is "not decided at this n" where it spans X: more
seeds would decide it. Welch's interval decides, not the bootstrap's: at three to five seeds the
bootstrap's is narrower than it should be (``bootstrap_interval``). With one seed a side there
is no interval, and the verdict is the point estimate's (the evidence says so).

"No difference" is a claim of its own, which an interval that merely includes 0 does not make:
each gap also carries an equivalence test (``stats.tost`` on the loss difference, Welch's df) at
a margin of EQUIVALENCE_MARGIN of PPL. "no difference" where TOST shows equivalence within it,
"differs by more than the margin" where the TOST's 90% interval lies wholly beyond it, and
otherwise "not decided at this n".
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from oelm_core.analysis.groups import BASELINE, Group, group_runs, variant_alone
from oelm_core.analysis.markdown import markdown_table
from oelm_core.analysis.runs import Run, check_figures
from oelm_core.analysis.stats import bootstrap_interval, cohen_d, hedges_g, mean_std, present, tost, welch_interval

CONFIDENCE = 0.95
HOLDS, FAILS, UNDECIDED, NOT_JUDGED = "holds", "does not hold", "not decided at this n", "not judged"
# The margin of a "no difference" claim, as a fraction of PPL: the geometric-mean PPL ratio within
# [1/1.02, 1.02], |mean loss difference| < log(1.02) = 0.0198 nats. 2% is about the seed-to-seed
# spread at Medium-512 (sample std of the best validation loss over the tuned study's 5 seeds:
# 0.007 to 0.018 nats, 0.7% to 1.8% of PPL): a difference smaller than one seed's spread is none
# that a study of a few seeds could act on, and a narrower margin would need far more seeds to show.
EQUIVALENCE_MARGIN = 0.02
# The equivalence verdicts (UNDECIDED the third).
EQUIVALENT, NOT_EQUIVALENT = "no difference", "differs by more than the margin"
# The pairs of the gap table: (a, b), a's gap to b.
GAP_PAIRS = (("oelm_nofreeze", BASELINE), ("oelm_freeze", BASELINE), ("oelm_freeze", "oelm_nofreeze"))


def ppl_gap(
    loss_a: Iterable[float | None],
    loss_b: Iterable[float | None],
    confidence: float = CONFIDENCE,
    n_resamples: int = 9999,
    margin: float = EQUIVALENCE_MARGIN,
) -> dict:
    """a's relative PPL gap to b from the seeds' validation losses (nats/token), as fractions:
    {n_a, n_b, gap, welch: (low, high), bootstrap: (low, high), hedges_g, cohen_d, equivalence}.
    The intervals and effect sizes (of the losses; positive: a's loss is the higher) are None with
    fewer than two seeds on a side; gap is None without a seed on a side. equivalence
    (``equivalence``, at ``margin`` of PPL): None with fewer than two seeds on a side."""
    a, b = present(loss_a), present(loss_b)
    out = {
        "n_a": len(a),
        "n_b": len(b),
        "gap": None,
        "welch": None,
        "bootstrap": None,
        "hedges_g": None,
        "cohen_d": None,
        "equivalence": None,
    }
    if not (a and b):
        return out
    out["gap"] = math.expm1(mean_std(a)[0] - mean_std(b)[0])
    if len(a) >= 2 and len(b) >= 2:
        out["welch"] = _expm1(welch_interval(a, b, confidence))
        out["bootstrap"] = _expm1(bootstrap_interval(a, b, "difference", confidence, n_resamples))
        out.update(
            hedges_g=_number(hedges_g(a, b)), cohen_d=_number(cohen_d(a, b)), equivalence=equivalence(a, b, margin)
        )
    return out


def equivalence(
    loss_a: Sequence[float], loss_b: Sequence[float], margin: float = EQUIVALENCE_MARGIN, alpha: float = 1 - CONFIDENCE
) -> dict:
    """Whether two groups' PPLs are equivalent within ``margin`` (a fraction of PPL): ``stats.tost``
    of their validation losses (nats/token) at the margin log(1 + margin), so that the geometric-mean
    PPL ratio must lie within [1 / (1 + margin), 1 + margin]. The default, 2%, is about the
    seed-to-seed spread at Medium-512 (the seeds' sample std of the best validation loss was 0.7%
    to 1.8% of PPL in the tuned study): a smaller difference is within what another seed moves a
    group by, and a narrower margin would need many more seeds to show. Returns {verdict, p, interval90,
    margin}: verdict EQUIVALENT where TOST rejects a difference of the margin or more; NOT_EQUIVALENT
    where its (1 - 2 alpha) interval lies wholly beyond the margin (one-sided test at alpha that
    the difference exceeds it); otherwise UNDECIDED. interval90 is that interval mapped through
    exp(.) - 1, a PPL ratio minus 1 like the gaps'."""
    log_margin = math.log1p(margin)
    res = tost(loss_a, loss_b, log_margin, alpha)
    low, high = res["interval90"]
    verdict = (
        EQUIVALENT if res["equivalent"] else NOT_EQUIVALENT if low >= log_margin or high <= -log_margin else UNDECIDED
    )
    return {"verdict": verdict, "p": res["p"], "interval90": _expm1((low, high)), "margin": margin}


def within_verdict(gap: float, interval: tuple[float, float] | None, threshold: float, strict: bool = False) -> str:
    """The verdict on "gap within threshold" (gap < threshold where ``strict``, else <=): HOLDS
    where the whole ``interval`` is within, FAILS where none of it is, UNDECIDED where it spans
    the threshold; without an interval (one seed a side), the point estimate ``gap``'s verdict."""

    def within(x: float) -> bool:
        return x < threshold if strict else x <= threshold

    if interval is None:
        return HOLDS if within(gap) else FAILS
    low, high = interval
    if within(high):
        return HOLDS
    if not within(low):
        return FAILS
    return UNDECIDED


def group_figures(group: Group, which: str = "best") -> dict:
    """One group's validation figures over its seeds: {model, preset, shape (Group.shape), seeds
    (evaluated), val_loss, val_loss_std, val_ppl, val_ppl_std}; means and sample standard
    deviations (n - 1), PPL's over the seeds' PPLs (arithmetic, as the results table)."""
    losses = present(r.value(f"{which}_val_loss") for r in group.runs)
    loss, loss_std = mean_std(losses)
    ppl, ppl_std = mean_std(r.value(f"{which}_val_ppl") for r in group.runs)
    return {
        "model": group.label,
        "preset": group.preset,
        "shape": group.shape,
        "seeds": len(losses),
        "val_loss": loss,
        "val_loss_std": loss_std,
        "val_ppl": ppl,
        "val_ppl_std": ppl_std,
    }


def gap_table(
    runs: Sequence[Run],
    which: str = "best",
    compare_across: Iterable[str] = (),
    pairs: Sequence[tuple[str, str]] = GAP_PAIRS,
    margin: float = EQUIVALENCE_MARGIN,
) -> dict:
    """The study's gaps with intervals: {"groups": group_figures rows, "pairs": rows, "markdown",
    "margin"}.

    A pair row, for each (a, b) of ``pairs`` (variants) whose groups of one preset are trained
    alike apart from the variant (``variant_alone`` with ``compare_across``): {a, b, preset,
    n_a, n_b, gap_pct, welch_low_pct, welch_high_pct, boot_low_pct, boot_high_pct, hedges_g,
    cohen_d, equivalent, tost_p}, the ``ppl_gap`` of their ``which`` validation losses in %, and
    whether they are equivalent within ``margin`` of PPL (``equivalence``).
    """
    check_figures(runs, which)
    compare_across = tuple(compare_across)
    groups = group_runs(runs)
    rows = []
    for ga in groups:
        for va, vb in pairs:
            if ga.variant != va:
                continue
            for gb in (g for g in groups if g.variant == vb and variant_alone(ga, g, compare_across)):
                res = ppl_gap(
                    [r.value(f"{which}_val_loss") for r in ga.runs],
                    [r.value(f"{which}_val_loss") for r in gb.runs],
                    margin=margin,
                )
                rows.append(
                    {
                        "a": ga.label,
                        "b": gb.label,
                        "preset": ga.preset,
                        "n_a": res["n_a"],
                        "n_b": res["n_b"],
                        **gap_fields(res),
                        "cohen_d": res["cohen_d"],
                    }
                )
    figures = [group_figures(g, which) for g in groups]
    same_cols, same_heads = equivalence_columns("", margin)
    md = (
        markdown_table(
            figures,
            ["model", "shape", "seeds", "val_loss", "val_loss_std", "val_ppl", "val_ppl_std"],
            [
                "Model",
                "Preset",
                "Seeds",
                f"{which.capitalize()} val loss (mean)",
                "Loss std (n-1)",
                "Val PPL (mean)",
                "PPL std (n-1)",
            ],
        )
        + "\n\n"
        + (
            markdown_table(
                rows,
                [
                    "a",
                    "b",
                    "n_a",
                    "n_b",
                    "gap_pct",
                    "welch_low_pct",
                    "welch_high_pct",
                    "boot_low_pct",
                    "boot_high_pct",
                    "hedges_g",
                    "cohen_d",
                    *same_cols,
                ],
                [
                    "A",
                    "B",
                    "n A",
                    "n B",
                    "PPL gap A vs B (%)",
                    "Welch 95% low",
                    "Welch 95% high",
                    "Bootstrap 95% low",
                    "Bootstrap 95% high",
                    "Hedges' g (loss)",
                    "Cohen's d (loss)",
                    *same_heads,
                ],
            )
            if rows
            else "(no groups trained alike to compare)"
        )
    )
    return {"groups": figures, "pairs": rows, "markdown": md, "margin": margin}


def _expm1(interval: tuple[float, float]) -> tuple[float, float]:
    return math.expm1(interval[0]), math.expm1(interval[1])


def _number(x: float) -> float | None:
    return None if math.isnan(x) else x


def gap_fields(res: dict, prefix: str = "") -> dict:
    """``ppl_gap``'s result as a table row's fields, in %: {PREFIX}gap_pct, the Welch and bootstrap
    bounds ({PREFIX}welch_low_pct, ..._high_pct, {PREFIX}boot_low_pct, ..._high_pct),
    {PREFIX}hedges_g, and the equivalence test's verdict and p ({PREFIX}equivalent, {PREFIX}tost_p;
    ``equivalence_columns`` heads them with the margin); None where ``res`` has no such figure."""
    out = {f"{prefix}gap_pct": _pct(res.get("gap"))}
    for name, key in (("welch", "welch"), ("boot", "bootstrap")):
        low, high = res.get(key) or (None, None)
        out.update({f"{prefix}{name}_low_pct": _pct(low), f"{prefix}{name}_high_pct": _pct(high)})
    same = res.get("equivalence") or {}
    return {
        **out,
        f"{prefix}hedges_g": res.get("hedges_g"),
        f"{prefix}equivalent": same.get("verdict"),
        f"{prefix}tost_p": same.get("p"),
    }


def equivalence_columns(prefix: str = "", margin: float = EQUIVALENCE_MARGIN) -> tuple[list[str], list[str]]:
    """(columns, headers) of ``gap_fields``' equivalence fields for a markdown table: the verdict,
    headed with the margin it was tested at, and TOST's p."""
    return ([f"{prefix}equivalent", f"{prefix}tost_p"], [f"Equivalent within ±{100 * margin:g}%? (TOST)", "TOST p"])


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x
