"""The study's hypotheses, judged from the runs: holds, does not hold, not decided at this n,
or not judged (and why). As the original study's seeds state them:

    H1   freezing Q/K cuts trainable parameters by ~15% (the original report's claim)
    H2   OELM-Freeze's perplexity is within 5% of OELM-NoFreeze's
    H3   OELM-Freeze trains at least as fast as OELM-NoFreeze: tokens/s
    H3t  ... and reaches a target validation loss in at most OELM-NoFreeze's training time
    H4   OELM-Freeze's perplexity is within 10% of GPT-Base's

H2 and H4 are judged on the 95% Welch interval of the gap (``gaps``), H3 and H3t on the 95%
Welch interval of the log ratio over seeds (tokens/s; seconds to the target): "not decided at
this n" where it spans the threshold; with one seed a side the point estimate decides and the
evidence says so. Each compares two groups of seeds trained with the same settings apart from
the variant (``variant_alone``; a study of tuned groups lets the settings of ``compare_across``
differ too). Where no such pair exists (e.g. the OELM-Freeze runs had another learning rate) or
several do (e.g. a study of two learning rates), the hypothesis is not judged: a verdict on
other settings, or on a mixture, would not be the claim's. H3 and H3t are judged only where every
run compared records in summary.json that it had its device alone (``timing.alone_record``).

Runs of a smoke budget (``budget``) are judged as any others, and each verdict carries the note
that it is no evidence.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from oelm_core.analysis.budget import SMOKE_NOTE, smoke_budget
from oelm_core.analysis.gaps import CONFIDENCE, FAILS, HOLDS, NOT_JUDGED, UNDECIDED, ppl_gap, within_verdict
from oelm_core.analysis.groups import BASELINE, GROUP_LABELS, Group, group_runs, variant_alone
from oelm_core.analysis.markdown import markdown_table
from oelm_core.analysis.runs import Run, check_figures
from oelm_core.analysis.stats import mean_std, present, welch_interval
from oelm_core.analysis.timing import alone_record, loss_target, time_to_target

FREEZE, NOFREEZE = "oelm_freeze", "oelm_nofreeze"
H3_CLAIM = f"{GROUP_LABELS[FREEZE]} trains at least as fast as {GROUP_LABELS[NOFREEZE]} (tokens/s)"
H3T_CLAIM = (
    f"{GROUP_LABELS[FREEZE]} reaches a target validation loss in at most {GROUP_LABELS[NOFREEZE]}'s training time"
)


def hypotheses(
    runs: Sequence[Run],
    which: str = "final",
    preset: str | None = None,
    h1_claim: float = 0.15,
    h1_tolerance: float = 0.02,
    h2_max_gap: float = 0.05,
    h3_min_ratio: float = 0.98,
    h4_max_gap: float = 0.10,
    compare_across: Iterable[str] = (),
    timed_alone: bool | None = None,
) -> list[dict]:
    """The hypotheses H1, H2, H3, H3t, H4 judged from the runs of one preset (default: the first
    with an OELM-Freeze run, which every hypothesis needs; without one, the first preset). Each:
    {id, claim, value, threshold, verdict, holds, evidence, preset, note} and, per hypothesis, its
    other figures; verdict is one of "holds", "does not hold", "not decided at this n", "not
    judged"; holds is True, False, or None for the last two; note is budget.SMOKE_NOTE and why,
    for runs of a smoke budget, else None. ``which``: "final", "best" or "report" validation
    figures (runs.WHICH; "report" needs summary.json's report_val_*). ``compare_across``: the
    settings that may differ between the groups compared (``variant_alone``; TUNED_SETTINGS for
    tuned groups). ``timed_alone``: False leaves H3 and H3t not judged whatever the runs record
    (e.g. runs known to have shared GPUs before the trainer recorded it); None or True: the
    runs' summary.json records decide (True asserts nothing).

    H1   holds within +-h1_tolerance of h1_claim: the share of the baseline's parameters that
         freezing leaves untrained (value), also stated against the non-embedding parameters
         (value_non_embedding; from summary.json's params.by_component)
    H2   relative perplexity gap to OELM-NoFreeze < h2_max_gap, on its 95% Welch interval
    H3   tokens/s ratio to OELM-NoFreeze (geometric means over seeds of each run's median) >=
         h3_min_ratio (2% is timing noise), on the 95% Welch interval of the log ratio
    H3t  training seconds to a target validation loss (the highest ``which`` validation loss of
         any run of the two groups, which every run reaches; for "report" the best, since the
         curves are measured on the selection half), ratio to OELM-NoFreeze <= 1 / h3_min_ratio,
         on the 95% Welch interval of the log ratio; the steps to it are reported alongside
    H4   relative perplexity gap to GPT-Base <= h4_max_gap, on its 95% Welch interval
    """
    check_figures(runs, which)
    compare_across = tuple(compare_across)
    groups = group_runs(runs)
    if preset is None:
        preset = _hypotheses_preset(groups)
    here = [g for g in groups if g.preset == preset]
    to_base = _freeze_pair(here, preset, BASELINE, compare_across)
    to_nofreeze = _freeze_pair(here, preset, NOFREEZE, compare_across)
    speed = [_h3_speed(*to_nofreeze, h3_min_ratio), _h3_time(*to_nofreeze, h3_min_ratio, which)]
    if to_nofreeze[0] is not None:
        record = alone_record(to_nofreeze[0].runs + to_nofreeze[1].runs)
        why = (
            "timed_alone=False was passed: the runs are taken to have shared their devices, so their "
            "tokens/s and training seconds are shares of a device that depend on what ran beside them"
            if timed_alone is False
            else None
            if record["alone"]
            else record["why"]
        )
        if why:
            speed = [
                _missing(
                    h["id"],
                    h["claim"],
                    h["threshold"],
                    f"{why}; time each group alone on a device (the trainer records it) to judge it",
                )
                for h in speed
            ]
    out = [
        _h1_parameters(*to_base, h1_claim, h1_tolerance),
        _ppl_gap("H2", *to_nofreeze, NOFREEZE, which, h2_max_gap, strict=True),
        *speed,
        _ppl_gap("H4", *to_base, BASELINE, which, h4_max_gap, strict=False),
    ]
    smoke = smoke_budget(runs)
    for h in out:
        h["preset"] = preset
        h["note"] = f"{SMOKE_NOTE} ({smoke})" if smoke else None
    return out


def hypotheses_judgeable(runs: Sequence[Run], compare_across: Iterable[str] = ()) -> bool:
    """Whether ``hypotheses`` must judge every claim of ``runs`` but H3 and H3t (which also need
    the runs' records of having their devices alone): they are the three study groups
    (GROUP_LABELS), one each, trained with the same settings apart from the variant (and the
    settings of ``compare_across``)."""
    groups = group_runs(runs)
    alike = all(variant_alone(groups[0], g, compare_across) for g in groups)
    return alike and sorted(g.variant for g in groups) == sorted(GROUP_LABELS)


def unjudged(
    hyps: Sequence[dict], runs: Sequence[Run], compare_across: Iterable[str] = (), timed_alone: bool | None = None
) -> list[dict]:
    """The hypotheses of ``hyps`` (``hypotheses(runs, ...)``) left "not judged" although the runs
    allow a verdict: none where not ``hypotheses_judgeable``; else every one, except H3 and H3t
    where ``timed_alone`` is False or not every run records that it had its device alone. What
    the 04 notebook asserts is empty."""
    if not hypotheses_judgeable(runs, compare_across):
        return []
    timed = timed_alone is not False and alone_record(runs)["alone"] is True
    return [h for h in hyps if h["verdict"] == NOT_JUDGED and (timed or h["id"] not in ("H3", "H3t"))]


def hypotheses_markdown(hyps: Sequence[dict]) -> str:
    """The Hypotheses table of results.md: one row per hypothesis, its verdict in words (with the
    smoke-budget note where the hypothesis has one)."""
    rows = [
        {
            "id": h["id"],
            "claim": h["claim"],
            "evidence": h["evidence"],
            "verdict": h["verdict"] + (f" ({SMOKE_NOTE})" if h.get("note") else ""),
        }
        for h in hyps
    ]
    return markdown_table(rows, ["id", "claim", "verdict", "evidence"], ["Hypothesis", "Claim", "Verdict", "Evidence"])


def _hypotheses_preset(groups: Sequence[Group]) -> str | None:
    """The first preset with an OELM-Freeze group, else the first preset (None without groups)."""
    first = groups[0].preset if groups else None
    return next((g.preset for g in groups if g.variant == FREEZE), first)


def _freeze_pair(
    here: Sequence[Group], preset: str | None, other: str, compare_across: tuple[str, ...]
) -> tuple[Group | None, Group | None, str]:
    """(OELM-Freeze group, ``other``'s group) of the groups ``here`` (one preset's) that differ in
    the variant alone (and ``compare_across``), or (None, None, why they cannot be told)."""
    names = f"{GROUP_LABELS[FREEZE]} and {GROUP_LABELS[other]}"
    fs = [g for g in here if g.variant == FREEZE]
    others = [g for g in here if g.variant == other]
    if not fs or not others:
        return None, None, f"needs runs of {names} at preset {preset}"
    found = [(f, o) for f in fs for o in others if variant_alone(f, o, compare_across)]
    if len(found) == 1:
        return found[0][0], found[0][1], ""
    if not found:
        apart = f"the variant and {', '.join(compare_across)}" if compare_across else "the variant"
        return (
            None,
            None,
            (
                f"no {names} groups at preset {preset} were trained with the same settings "
                f"apart from {apart} ({', '.join(g.label for g in fs + others)}): they "
                f"would compare more than the variant"
            ),
        )
    return (
        None,
        None,
        (
            f"{len(found)} pairs of {names} groups at preset {preset} differ in the variant "
            f"alone ({'; '.join(f'{f.label} vs {o.label}' for f, o in found)}): pass the "
            f"runs of one comparison"
        ),
    )


def _h1_parameters(freeze: Group | None, base: Group | None, why: str, claim: float, tolerance: float) -> dict:
    """H1: the share of the baseline's parameters that freezing leaves untrained, of all its
    parameters (the verdict: the claim's "trainable parameters") and of the non-embedding ones."""
    text = f"freezing Q/K reduces trainable parameters by ~{100 * claim:.0f}%"
    tb, tf = (base.mean("trainable"), freeze.mean("trainable")) if base else (None, None)
    if not (tb and tf):
        return _missing("H1", text, claim, why or f"needs the parameter counts of {freeze.label} and {base.label}")
    red = 1 - tf / tb
    holds = abs(red - claim) <= tolerance
    ev = (
        f"{freeze.label} trains {tf:,.0f} of {base.label}'s {tb:,.0f} parameters: {100 * red:.1f}% "
        f"fewer. The claim of ~{100 * claim:.0f}% (+-{100 * tolerance:.0f} points) "
        f"{'holds' if holds else 'does not hold'}."
    )
    non_embedding = _non_embedding(base)
    share = (tb - tf) / non_embedding if non_embedding else None
    if share is None:
        ev += " (No non-embedding count: summary.json has no params.by_component.)"
    else:
        near = abs(share - claim) <= tolerance
        ev += (
            f" Of the {non_embedding:,.0f} non-embedding parameters (token and position embeddings left "
            f"out) the frozen {tb - tf:,.0f} are {100 * share:.1f}%, which "
            f"{'would be' if near else 'would not be'} within the claim: the embedding is most of the model."
        )
    return dict(
        id="H1",
        claim=text,
        value=red,
        value_non_embedding=share,
        threshold=claim,
        verdict=HOLDS if holds else FAILS,
        holds=holds,
        evidence=ev,
    )


def _non_embedding(group: Group) -> float | None:
    """The parameters of ``group``'s first run without its embeddings (Run.value's non_embedding)."""
    return group.runs[0].value("non_embedding")


def _ppl_gap(
    hid: str,
    freeze: Group | None,
    other: Group | None,
    why: str,
    other_variant: str,
    which: str,
    max_gap: float,
    strict: bool,
) -> dict:
    """H2 and H4: OELM-Freeze's relative perplexity gap to ``other``'s group (gaps.ppl_gap),
    below ``max_gap`` (``strict``) or at most it, judged on its 95% Welch interval."""
    claim = f"{GROUP_LABELS[FREEZE]} perplexity within {100 * max_gap:.0f}% of {GROUP_LABELS[other_variant]}"
    loss = f"{which}_val_loss"
    res = (
        ppl_gap([r.value(loss) for r in freeze.runs], [r.value(loss) for r in other.runs]) if freeze else {"gap": None}
    )
    if res["gap"] is None:
        return _missing(
            hid, claim, max_gap, why or f"needs the {which} validation loss of {freeze.label} and {other.label}"
        )
    gap, welch, boot = res["gap"], res["welch"], res["bootstrap"]
    verdict = within_verdict(gap, welch, max_gap, strict)
    pf, po = (math.exp(mean_std(r.value(loss) for r in g.runs)[0]) for g in (freeze, other))
    held_out = "held-out " if which == "report" else ""
    ev = (
        f"{held_out}validation PPL {pf:.3f} ({_short(freeze)}) vs {po:.3f} ({_short(other)}) (geometric means over "
        f"{res['n_a']} and {res['n_b']} seeds): {100 * gap:+.2f}%"
    )
    if welch is None:
        ev += f"; one seed a side: no interval, the point estimate against {100 * max_gap:.0f}% decides"
    else:
        ev += (
            f", 95% Welch [{100 * welch[0]:+.2f}%, {100 * welch[1]:+.2f}%], bootstrap "
            f"[{100 * boot[0]:+.2f}%, {100 * boot[1]:+.2f}%]; threshold {100 * max_gap:.0f}%: "
            + {HOLDS: "the interval lies within it", FAILS: "the interval lies beyond it"}.get(
                verdict, "the interval spans it"
            )
        )
    return dict(
        id=hid,
        claim=claim,
        value=gap,
        interval=welch,
        bootstrap=boot,
        threshold=max_gap,
        verdict=verdict,
        holds={HOLDS: True, FAILS: False}.get(verdict),
        evidence=ev,
    )


def _h3_speed(freeze: Group | None, other: Group | None, why: str, min_ratio: float) -> dict:
    """H3: OELM-Freeze's tokens/s over OELM-NoFreeze's (each run's median over its log windows;
    the ratio of the groups' geometric means), judged on the 95% Welch interval of the log ratio."""
    rates = [[r.value("tokens_per_s") for r in g.runs] for g in (freeze, other)] if freeze else [[], []]
    if not (present(rates[0]) and present(rates[1])):
        return _missing("H3", H3_CLAIM, min_ratio, why or f"needs the tokens/s of {freeze.label} and {other.label}")
    res = _log_ratio(*rates)
    verdict = _at_least(res["ratio"], res["interval"], min_ratio)
    ev = (
        f"{res['mean_a']:,.0f} vs {res['mean_b']:,.0f} tokens/s ({_short(freeze)} vs {_short(other)}, geometric "
        f"means over {res['n_a']} and {res['n_b']} runs of each run's median): ratio {res['ratio']:.3f}"
        + _ratio_evidence(res["interval"], f">= {min_ratio}", verdict, "above", "below")
    )
    return dict(
        id="H3",
        claim=H3_CLAIM,
        value=res["ratio"],
        interval=res["interval"],
        threshold=min_ratio,
        verdict=verdict,
        holds={HOLDS: True, FAILS: False}.get(verdict),
        evidence=ev,
    )


def _h3_time(freeze: Group | None, other: Group | None, why: str, min_ratio: float, which: str) -> dict:
    """H3t: OELM-Freeze's training seconds to the target validation loss over OELM-NoFreeze's
    (geometric means over seeds), at most 1 / min_ratio, judged on the 95% Welch interval of the
    log ratio; the steps to it alongside."""
    limit = 1 / min_ratio
    if freeze is None:
        return _missing("H3t", H3T_CLAIM, limit, why)
    target = loss_target([freeze, other], which)
    reach = [[time_to_target(r, target) for r in g.runs] for g in (freeze, other)] if target is not None else []
    if not reach or any(secs is None for runs in reach for _, secs in runs):
        return _missing(
            "H3t", H3T_CLAIM, limit, "the runs' evaluations or tokens/s are missing, so no time to a target loss"
        )
    res = _log_ratio(*([secs for _, secs in runs] for runs in reach))
    verdict = within_verdict(res["ratio"], res["interval"], limit)
    steps = [mean_std(step for step, _ in runs)[0] for runs in reach]
    curves = (
        " (the best evaluation's loss, on the selection half the curves are measured on: the held-out "
        "figures are not on the curves)"
        if which == "report"
        else ""
    )
    ev = (
        f"to validation loss {target:.4f} (the highest {'best' if which == 'report' else which} validation "
        f"loss of their runs, which every run reaches{curves}): step {steps[0]:,.0f} and {res['mean_a']:.1f} s "
        f"of training ({_short(freeze)}) vs step {steps[1]:,.0f} and {res['mean_b']:.1f} s ({_short(other)}); "
        f"training time from the log windows' tokens/s, evaluation excluded; geometric means over "
        f"{res['n_a']} and {res['n_b']} seeds: seconds ratio {res['ratio']:.3f}"
        + _ratio_evidence(res["interval"], f"<= {limit:.3f}", verdict, "below", "above")
    )
    return dict(
        id="H3t",
        claim=H3T_CLAIM,
        value=res["ratio"],
        interval=res["interval"],
        target_loss=target,
        steps=steps,
        threshold=limit,
        verdict=verdict,
        holds={HOLDS: True, FAILS: False}.get(verdict),
        evidence=ev,
    )


def _log_ratio(a: Sequence[float | None], b: Sequence[float | None]) -> dict:
    """The ratio of the geometric means of ``a`` and ``b`` (positive values), exp(mean log a - mean
    log b), and its 95% Welch interval (of the log difference, mapped through exp; None with
    fewer than two values on a side; the ratio itself where no value varies, which only
    identical copies of runs give): {ratio, interval, mean_a, mean_b, n_a, n_b}."""
    la, lb = ([math.log(x) for x in present(v)] for v in (a, b))
    ma, mb = mean_std(la)[0], mean_std(lb)[0]
    interval = None
    if len(la) >= 2 and len(lb) >= 2:
        low, high = welch_interval(la, lb, CONFIDENCE)
        interval = (math.exp(low), math.exp(high)) if not math.isnan(low) else (math.exp(ma - mb),) * 2
    return {
        "ratio": math.exp(ma - mb),
        "interval": interval,
        "mean_a": math.exp(ma),
        "mean_b": math.exp(mb),
        "n_a": len(la),
        "n_b": len(lb),
    }


def _at_least(value: float, interval: tuple[float, float] | None, threshold: float) -> str:
    """The verdict on "value >= threshold": HOLDS where the whole interval is at or above it, FAILS
    where all of it is below, UNDECIDED where it spans it; without an interval, the point's."""
    if interval is None:
        return HOLDS if value >= threshold else FAILS
    return HOLDS if interval[0] >= threshold else FAILS if interval[1] < threshold else UNDECIDED


def _ratio_evidence(interval: tuple[float, float] | None, needs: str, verdict: str, good: str, bad: str) -> str:
    if interval is None:
        return f" (needs {needs}); one run a side: no interval, the point estimate decides"
    where = {HOLDS: f"the interval lies {good} it", FAILS: f"the interval lies {bad} it"}.get(
        verdict, "the interval spans it"
    )
    return f", 95% Welch [{interval[0]:.3f}, {interval[1]:.3f}] (of the log ratio over seeds); needs {needs}: {where}"


def _short(group: Group) -> str:
    return group.label.removeprefix("OELM-")


def _missing(hid: str, claim: str, threshold: float, why: str) -> dict:
    return dict(
        id=hid,
        claim=claim,
        value=None,
        threshold=threshold,
        verdict=NOT_JUDGED,
        holds=None,
        evidence=f"not judged: {why}",
    )
