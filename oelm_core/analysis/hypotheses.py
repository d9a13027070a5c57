"""The study's four hypotheses, judged from the runs: holds, does not hold, or not judged (and why).

    H1  freezing Q/K cuts trainable parameters by ~15% (the original report's claim)
    H2  OELM-Freeze's perplexity is within 5% of OELM-NoFreeze's
    H3  OELM-Freeze trains at least as fast as GPT-Base
    H4  OELM-Freeze's perplexity is within 10% of GPT-Base's

Each compares two groups of seeds trained with the same settings apart from the variant
(``variant_alone``). Where no such pair exists (e.g. the OELM-Freeze runs had another learning
rate) or several do (e.g. a study of two learning rates), the hypothesis is not judged: a verdict
on other settings, or on a mixture, would not be the claim's.
"""

from __future__ import annotations

from typing import Sequence

from oelm_core.analysis.groups import BASELINE, GROUP_LABELS, Group, group_runs, variant_alone
from oelm_core.analysis.markdown import markdown_table
from oelm_core.analysis.runs import Run, check_which

FREEZE = "oelm_freeze"


def hypotheses(runs: Sequence[Run], which: str = "final", preset: str | None = None,
               h1_claim: float = 0.15, h1_tolerance: float = 0.02, h2_max_gap: float = 0.05,
               h3_min_ratio: float = 0.98, h4_max_gap: float = 0.10) -> list[dict]:
    """The four hypotheses judged from the runs of one preset (default: the first with an
    OELM-Freeze run, which every hypothesis needs; without one, the first preset). Each: {id,
    claim, value, threshold, holds, evidence, preset}; holds is None, and the evidence says why,
    when the groups needed to judge it are missing or ambiguous.

    H1  holds within +-h1_tolerance of h1_claim (the share of trainable parameters not trained)
    H2  relative perplexity gap to OELM-NoFreeze < h2_max_gap
    H3  tokens/s ratio to GPT-Base >= h3_min_ratio (2% is timing noise); the train loss at equal
        steps is reported alongside
    H4  relative perplexity gap to GPT-Base <= h4_max_gap
    """
    check_which(which)
    groups = group_runs(runs)
    if preset is None:
        preset = _hypotheses_preset(groups)
    here = [g for g in groups if g.preset == preset]
    to_base = _freeze_pair(here, preset, BASELINE)
    out = [_h1_parameters(*to_base, h1_claim, h1_tolerance),
           _ppl_gap("H2", *_freeze_pair(here, preset, "oelm_nofreeze"), "oelm_nofreeze", which, h2_max_gap,
                    strict=True),
           _h3_speed(*to_base, h3_min_ratio),
           _ppl_gap("H4", *to_base, BASELINE, which, h4_max_gap, strict=False)]
    for h in out:
        h["preset"] = preset
    return out


def hypotheses_judgeable(runs: Sequence[Run]) -> bool:
    """Whether ``hypotheses`` must judge every claim of ``runs``: they are the three study groups
    (GROUP_LABELS), one each, trained with the same settings apart from the variant."""
    groups = group_runs(runs)
    alike = all(variant_alone(groups[0], g) for g in groups)
    return alike and sorted(g.variant for g in groups) == sorted(GROUP_LABELS)


def hypotheses_markdown(hyps: Sequence[dict]) -> str:
    """The Hypotheses table of results.md: one row per hypothesis, its verdict in words."""
    rows = [{"id": h["id"], "claim": h["claim"],
             "verdict": {True: "holds", False: "does not hold", None: "not judged"}[h["holds"]],
             "evidence": h["evidence"]} for h in hyps]
    return markdown_table(rows, ["id", "claim", "verdict", "evidence"],
                          ["Hypothesis", "Claim", "Verdict", "Evidence"])


def _hypotheses_preset(groups: Sequence[Group]) -> str | None:
    """The first preset with an OELM-Freeze group, else the first preset (None without groups)."""
    first = groups[0].preset if groups else None
    return next((g.preset for g in groups if g.variant == FREEZE), first)


def _freeze_pair(here: Sequence[Group], preset: str | None, other: str) -> tuple[Group | None, Group | None, str]:
    """(OELM-Freeze group, ``other``'s group) of the groups ``here`` (one preset's) that differ in
    the variant alone, or (None, None, why they cannot be told)."""
    names = f"{GROUP_LABELS[FREEZE]} and {GROUP_LABELS[other]}"
    fs = [g for g in here if g.variant == FREEZE]
    others = [g for g in here if g.variant == other]
    if not fs or not others:
        return None, None, f"needs runs of {names} at preset {preset}"
    found = [(f, o) for f in fs for o in others if variant_alone(f, o)]
    if len(found) == 1:
        return found[0][0], found[0][1], ""
    if not found:
        return None, None, (f"no {names} groups at preset {preset} were trained with the same settings "
                            f"apart from the variant ({', '.join(g.label for g in fs + others)}): they "
                            f"would compare more than the variant")
    return None, None, (f"{len(found)} pairs of {names} groups at preset {preset} differ in the variant "
                        f"alone ({'; '.join(f'{f.label} vs {o.label}' for f, o in found)}): pass the "
                        f"runs of one comparison")


def _h1_parameters(freeze: Group | None, base: Group | None, why: str, claim: float, tolerance: float) -> dict:
    """H1: the share of the baseline's trainable parameters that freezing leaves untrained."""
    text = f"freezing Q/K reduces trainable parameters by ~{100 * claim:.0f}%"
    tb, tf = (base.mean("trainable"), freeze.mean("trainable")) if base else (None, None)
    if not (tb and tf):
        return _missing("H1", text, claim, why or f"needs the parameter counts of {freeze.label} and {base.label}")
    red = 1 - tf / tb
    holds = abs(red - claim) <= tolerance
    ev = (f"{freeze.label} trains {tf:,.0f} of {base.label}'s {tb:,.0f} parameters: {100 * red:.1f}% "
          f"fewer. The claim of ~{100 * claim:.0f}% {'holds' if holds else 'does not hold'}"
          f"{'' if holds else ' (only 2*n_layer*d_model^2 Q/K weights are frozen; the embedding dominates)'}.")
    return dict(id="H1", claim=text, value=red, threshold=claim, holds=holds, evidence=ev)


def _ppl_gap(hid: str, freeze: Group | None, other: Group | None, why: str, other_variant: str, which: str,
             max_gap: float, strict: bool) -> dict:
    """H2 and H4: OELM-Freeze's relative perplexity gap to ``other``'s group, below ``max_gap``
    (``strict``) or at most it."""
    claim = f"{GROUP_LABELS[FREEZE]} perplexity within {100 * max_gap:.0f}% of {GROUP_LABELS[other_variant]}"
    ppl = f"{which}_val_ppl"
    pf, po = (freeze.mean(ppl), other.mean(ppl)) if freeze else (None, None)
    if not (pf and po):
        return _missing(hid, claim, max_gap,
                        why or f"needs the {which} validation PPL of {freeze.label} and {other.label}")
    gap = pf / po - 1
    holds = gap < max_gap if strict else gap <= max_gap
    ok, not_ok = ("<", ">=") if strict else ("<=", ">")
    ev = (f"validation PPL {pf:.3f} ({_short(freeze)}) vs {po:.3f} ({_short(other)}): "
          f"{100 * gap:+.2f}% {ok if holds else not_ok} {100 * max_gap:.0f}%")
    return dict(id=hid, claim=claim, value=gap, threshold=max_gap, holds=holds, evidence=ev)


def _h3_speed(freeze: Group | None, base: Group | None, why: str, min_ratio: float) -> dict:
    """H3: OELM-Freeze's tokens/s over the baseline's, with the train losses after equal steps."""
    text = f"{GROUP_LABELS[FREEZE]} trains at least as fast as {GROUP_LABELS[BASELINE]}"
    sf, sb = (freeze.mean("tokens_per_s"), base.mean("tokens_per_s")) if base else (None, None)
    if not (sf and sb):
        return _missing("H3", text, min_ratio, why or f"needs the tokens/s of {freeze.label} and {base.label}")
    ratio = sf / sb
    holds = ratio >= min_ratio
    lf, lb = freeze.mean("final_train_loss"), base.mean("final_train_loss")
    ev = f"{sf:,.0f} vs {sb:,.0f} tokens/s (ratio {ratio:.3f}, needs >= {min_ratio})"
    if lf is not None and lb is not None:
        ev += (f"; train loss after the same steps {lf:.3f} ({_short(freeze)}) vs {lb:.3f} ({_short(base)}): "
               f"{'no slower' if lf <= lb else 'slower'} per step")
    return dict(id="H3", claim=text, value=ratio, threshold=min_ratio, holds=holds, evidence=ev)


def _short(group: Group) -> str:
    return group.label.removeprefix("OELM-")


def _missing(hid: str, claim: str, threshold: float, why: str) -> dict:
    return dict(id=hid, claim=claim, value=None, threshold=threshold, holds=None, evidence=f"not judged: {why}")
