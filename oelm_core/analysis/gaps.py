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
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from oelm_core.analysis.groups import BASELINE, Group, group_runs, variant_alone
from oelm_core.analysis.markdown import markdown_table
from oelm_core.analysis.runs import Run, check_which
from oelm_core.analysis.stats import bootstrap_interval, cohen_d, hedges_g, mean_std, present, welch_interval

CONFIDENCE = 0.95
HOLDS, FAILS, UNDECIDED, NOT_JUDGED = "holds", "does not hold", "not decided at this n", "not judged"
# The pairs of the gap table: (a, b), a's gap to b.
GAP_PAIRS = (("oelm_nofreeze", BASELINE), ("oelm_freeze", BASELINE), ("oelm_freeze", "oelm_nofreeze"))


def ppl_gap(loss_a: Iterable[float | None], loss_b: Iterable[float | None],
            confidence: float = CONFIDENCE, n_resamples: int = 9999) -> dict:
    """a's relative PPL gap to b from the seeds' validation losses (nats/token), as fractions:
    {n_a, n_b, gap, welch: (low, high), bootstrap: (low, high), hedges_g, cohen_d}. The
    intervals and effect sizes (of the losses; positive: a's loss is the higher) are None with
    fewer than two seeds on a side; gap is None without a seed on a side."""
    a, b = present(loss_a), present(loss_b)
    out = {"n_a": len(a), "n_b": len(b), "gap": None, "welch": None, "bootstrap": None,
           "hedges_g": None, "cohen_d": None}
    if not (a and b):
        return out
    out["gap"] = math.expm1(mean_std(a)[0] - mean_std(b)[0])
    if len(a) >= 2 and len(b) >= 2:
        out["welch"] = _expm1(welch_interval(a, b, confidence))
        out["bootstrap"] = _expm1(bootstrap_interval(a, b, "difference", confidence, n_resamples))
        out.update(hedges_g=_number(hedges_g(a, b)), cohen_d=_number(cohen_d(a, b)))
    return out


def within_verdict(gap: float, interval: tuple[float, float] | None, threshold: float,
                   strict: bool = False) -> str:
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
    """One group's validation figures over its seeds: {model, seeds (evaluated), val_loss,
    val_loss_std, val_ppl, val_ppl_std}; means and sample standard deviations (n - 1), PPL's
    over the seeds' PPLs (arithmetic, as the results table)."""
    losses = present(r.value(f"{which}_val_loss") for r in group.runs)
    loss, loss_std = mean_std(losses)
    ppl, ppl_std = mean_std(r.value(f"{which}_val_ppl") for r in group.runs)
    return {"model": group.label, "preset": group.preset, "seeds": len(losses), "val_loss": loss,
            "val_loss_std": loss_std, "val_ppl": ppl, "val_ppl_std": ppl_std}


def gap_table(runs: Sequence[Run], which: str = "best", compare_across: Iterable[str] = (),
              pairs: Sequence[tuple[str, str]] = GAP_PAIRS) -> dict:
    """The study's gaps with intervals: {"groups": group_figures rows, "pairs": rows, "markdown"}.

    A pair row, for each (a, b) of ``pairs`` (variants) whose groups of one preset are trained
    alike apart from the variant (``variant_alone`` with ``compare_across``): {a, b, preset,
    n_a, n_b, gap_pct, welch_low_pct, welch_high_pct, boot_low_pct, boot_high_pct, hedges_g,
    cohen_d}, the ``ppl_gap`` of their ``which`` validation losses in %.
    """
    check_which(which)
    compare_across = tuple(compare_across)
    groups = group_runs(runs)
    rows = []
    for ga in groups:
        for va, vb in pairs:
            if ga.variant != va:
                continue
            for gb in (g for g in groups if g.variant == vb and variant_alone(ga, g, compare_across)):
                res = ppl_gap([r.value(f"{which}_val_loss") for r in ga.runs],
                              [r.value(f"{which}_val_loss") for r in gb.runs])
                rows.append({"a": ga.label, "b": gb.label, "preset": ga.preset, "n_a": res["n_a"],
                             "n_b": res["n_b"], **gap_fields(res), "cohen_d": res["cohen_d"]})
    figures = [group_figures(g, which) for g in groups]
    md = (markdown_table(figures, ["model", "preset", "seeds", "val_loss", "val_loss_std", "val_ppl", "val_ppl_std"],
                         ["Model", "Preset", "Seeds", f"{which.capitalize()} val loss (mean)", "Loss std (n-1)",
                          "Val PPL (mean)", "PPL std (n-1)"])
          + "\n\n" + (markdown_table(rows, ["a", "b", "n_a", "n_b", "gap_pct", "welch_low_pct", "welch_high_pct",
                                            "boot_low_pct", "boot_high_pct", "hedges_g", "cohen_d"],
                                     ["A", "B", "n A", "n B", "PPL gap A vs B (%)", "Welch 95% low",
                                      "Welch 95% high", "Bootstrap 95% low", "Bootstrap 95% high",
                                      "Hedges' g (loss)", "Cohen's d (loss)"])
                      if rows else "(no groups trained alike to compare)"))
    return {"groups": figures, "pairs": rows, "markdown": md}


def _expm1(interval: tuple[float, float]) -> tuple[float, float]:
    return math.expm1(interval[0]), math.expm1(interval[1])


def _number(x: float) -> float | None:
    return None if math.isnan(x) else x


def gap_fields(res: dict, prefix: str = "") -> dict:
    """``ppl_gap``'s result as a table row's fields, in %: {PREFIX}gap_pct, the Welch and bootstrap
    bounds ({PREFIX}welch_low_pct, ..._high_pct, {PREFIX}boot_low_pct, ..._high_pct) and
    {PREFIX}hedges_g; None where ``res`` has no such figure."""
    out = {f"{prefix}gap_pct": _pct(res.get("gap"))}
    for name, key in (("welch", "welch"), ("boot", "bootstrap")):
        low, high = res.get(key) or (None, None)
        out.update({f"{prefix}{name}_low_pct": _pct(low), f"{prefix}{name}_high_pct": _pct(high)})
    return {**out, f"{prefix}hedges_g": res.get("hedges_g")}


def _pct(x: float | None) -> float | None:
    return None if x is None else 100 * x
