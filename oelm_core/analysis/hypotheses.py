"""The study's four hypotheses, judged from the runs: holds, does not hold, not decided at this
n, or not judged (and why).

    H1  freezing Q/K cuts trainable parameters by ~15% (the original report's claim)
    H2  OELM-Freeze's perplexity is within 5% of OELM-NoFreeze's
    H3  OELM-Freeze trains at least as fast as GPT-Base
    H4  OELM-Freeze's perplexity is within 10% of GPT-Base's

H2 and H4 are judged on the 95% Welch interval of the gap (``gaps``): "not decided at this n"
where it spans the threshold. Each compares two groups of seeds trained with the same settings
apart from the variant (``variant_alone``; a study of tuned groups lets the settings of
``compare_across`` differ too). Where no such pair exists (e.g. the OELM-Freeze runs had another
learning rate) or several do (e.g. a study of two learning rates), the hypothesis is not judged:
a verdict on other settings, or on a mixture, would not be the claim's.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from oelm_core.analysis.gaps import FAILS, HOLDS, NOT_JUDGED, ppl_gap, within_verdict
from oelm_core.analysis.groups import BASELINE, GROUP_LABELS, Group, group_runs, variant_alone
from oelm_core.analysis.markdown import markdown_table
from oelm_core.analysis.runs import Run, check_which
from oelm_core.analysis.stats import mean_std
from oelm_core.analysis.timing import loss_target, time_to_target

FREEZE = "oelm_freeze"
H3_CLAIM = f"{GROUP_LABELS[FREEZE]} trains at least as fast as {GROUP_LABELS[BASELINE]}"
# summary.json's params.by_component entries that are embeddings (token, position): what the
# non-embedding count of H1 leaves out (the convention of scaling-law parameter counts).
EMBEDDINGS = ("embedding", "position")


def hypotheses(runs: Sequence[Run], which: str = "final", preset: str | None = None,
               h1_claim: float = 0.15, h1_tolerance: float = 0.02, h2_max_gap: float = 0.05,
               h3_min_ratio: float = 0.98, h4_max_gap: float = 0.10,
               compare_across: Iterable[str] = (), timed_alone: bool = True) -> list[dict]:
    """The four hypotheses judged from the runs of one preset (default: the first with an
    OELM-Freeze run, which every hypothesis needs; without one, the first preset). Each: {id,
    claim, value, threshold, verdict, holds, evidence, preset} and, per hypothesis, its other
    figures; verdict is one of "holds", "does not hold", "not decided at this n", "not judged";
    holds is True, False, or None for the last two. ``compare_across``: the settings that may
    differ between the groups compared (``variant_alone``; TUNED_SETTINGS for tuned groups).
    ``timed_alone``: whether every run trained alone on its GPU; False (runs that shared GPUs,
    whose tokens/s are shares that depend on what ran beside them) leaves H3 not judged.

    H1  holds within +-h1_tolerance of h1_claim: the share of the baseline's parameters that
        freezing leaves untrained (value), also stated against the non-embedding parameters
        (value_non_embedding; from summary.json's params.by_component)
    H2  relative perplexity gap to OELM-NoFreeze < h2_max_gap, on its 95% Welch interval
    H3  tokens/s ratio to GPT-Base >= h3_min_ratio (2% is timing noise), and OELM-Freeze's
        training seconds to a target validation loss (the highest ``which`` validation loss of
        any run of the two groups, which every run reaches) at most 1 / h3_min_ratio times
        GPT-Base's; the steps to it are reported alongside. Point estimates: the 2% allowance is
        the noise margin
    H4  relative perplexity gap to GPT-Base <= h4_max_gap, on its 95% Welch interval
    """
    check_which(which)
    compare_across = tuple(compare_across)
    groups = group_runs(runs)
    if preset is None:
        preset = _hypotheses_preset(groups)
    here = [g for g in groups if g.preset == preset]
    to_base = _freeze_pair(here, preset, BASELINE, compare_across)
    out = [_h1_parameters(*to_base, h1_claim, h1_tolerance),
           _ppl_gap("H2", *_freeze_pair(here, preset, "oelm_nofreeze", compare_across), "oelm_nofreeze", which,
                    h2_max_gap, strict=True),
           _h3_speed(*to_base, h3_min_ratio, which) if timed_alone else _missing(
               "H3", H3_CLAIM, h3_min_ratio, "the runs shared their GPUs (timed_alone=False), so their tokens/s "
               "and training seconds are shares of a GPU that depend on what ran beside them; time each "
               "group alone on a GPU to judge it"),
           _ppl_gap("H4", *to_base, BASELINE, which, h4_max_gap, strict=False)]
    for h in out:
        h["preset"] = preset
    return out


def hypotheses_judgeable(runs: Sequence[Run], compare_across: Iterable[str] = ()) -> bool:
    """Whether ``hypotheses`` must judge every claim of ``runs``: they are the three study groups
    (GROUP_LABELS), one each, trained with the same settings apart from the variant (and the
    settings of ``compare_across``)."""
    groups = group_runs(runs)
    alike = all(variant_alone(groups[0], g, compare_across) for g in groups)
    return alike and sorted(g.variant for g in groups) == sorted(GROUP_LABELS)


def hypotheses_markdown(hyps: Sequence[dict]) -> str:
    """The Hypotheses table of results.md: one row per hypothesis, its verdict in words."""
    rows = [{"id": h["id"], "claim": h["claim"], "verdict": h["verdict"], "evidence": h["evidence"]} for h in hyps]
    return markdown_table(rows, ["id", "claim", "verdict", "evidence"],
                          ["Hypothesis", "Claim", "Verdict", "Evidence"])


def _hypotheses_preset(groups: Sequence[Group]) -> str | None:
    """The first preset with an OELM-Freeze group, else the first preset (None without groups)."""
    first = groups[0].preset if groups else None
    return next((g.preset for g in groups if g.variant == FREEZE), first)


def _freeze_pair(here: Sequence[Group], preset: str | None, other: str,
                 compare_across: tuple[str, ...]) -> tuple[Group | None, Group | None, str]:
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
        return None, None, (f"no {names} groups at preset {preset} were trained with the same settings "
                            f"apart from {apart} ({', '.join(g.label for g in fs + others)}): they "
                            f"would compare more than the variant")
    return None, None, (f"{len(found)} pairs of {names} groups at preset {preset} differ in the variant "
                        f"alone ({'; '.join(f'{f.label} vs {o.label}' for f, o in found)}): pass the "
                        f"runs of one comparison")


def _h1_parameters(freeze: Group | None, base: Group | None, why: str, claim: float, tolerance: float) -> dict:
    """H1: the share of the baseline's parameters that freezing leaves untrained, of all its
    parameters (the verdict: the claim's "trainable parameters") and of the non-embedding ones."""
    text = f"freezing Q/K reduces trainable parameters by ~{100 * claim:.0f}%"
    tb, tf = (base.mean("trainable"), freeze.mean("trainable")) if base else (None, None)
    if not (tb and tf):
        return _missing("H1", text, claim, why or f"needs the parameter counts of {freeze.label} and {base.label}")
    red = 1 - tf / tb
    holds = abs(red - claim) <= tolerance
    ev = (f"{freeze.label} trains {tf:,.0f} of {base.label}'s {tb:,.0f} parameters: {100 * red:.1f}% "
          f"fewer. The claim of ~{100 * claim:.0f}% (+-{100 * tolerance:.0f} points) "
          f"{'holds' if holds else 'does not hold'}.")
    non_embedding = _non_embedding(base)
    share = (tb - tf) / non_embedding if non_embedding else None
    if share is None:
        ev += " (No non-embedding count: summary.json has no params.by_component.)"
    else:
        near = abs(share - claim) <= tolerance
        ev += (f" Of the {non_embedding:,.0f} non-embedding parameters (token and position embeddings left "
               f"out) the frozen {tb - tf:,.0f} are {100 * share:.1f}%, which "
               f"{'would be' if near else 'would not be'} within the claim: the embedding is most of the model.")
    return dict(id="H1", claim=text, value=red, value_non_embedding=share, threshold=claim,
                verdict=HOLDS if holds else FAILS, holds=holds, evidence=ev)


def _non_embedding(group: Group) -> float | None:
    """The parameters of ``group``'s first run without its embeddings (EMBEDDINGS), trainable and
    frozen, from summary.json's params.by_component; None without it."""
    parts = (group.runs[0].summary.get("params") or {}).get("by_component")
    if not parts:
        return None
    return sum(c.get("trainable", 0) + c.get("frozen", 0) for name, c in parts.items() if name not in EMBEDDINGS)


def _ppl_gap(hid: str, freeze: Group | None, other: Group | None, why: str, other_variant: str, which: str,
             max_gap: float, strict: bool) -> dict:
    """H2 and H4: OELM-Freeze's relative perplexity gap to ``other``'s group (gaps.ppl_gap),
    below ``max_gap`` (``strict``) or at most it, judged on its 95% Welch interval."""
    claim = f"{GROUP_LABELS[FREEZE]} perplexity within {100 * max_gap:.0f}% of {GROUP_LABELS[other_variant]}"
    loss = f"{which}_val_loss"
    res = (ppl_gap([r.value(loss) for r in freeze.runs], [r.value(loss) for r in other.runs])
           if freeze else {"gap": None})
    if res["gap"] is None:
        return _missing(hid, claim, max_gap,
                        why or f"needs the {which} validation loss of {freeze.label} and {other.label}")
    gap, welch, boot = res["gap"], res["welch"], res["bootstrap"]
    verdict = within_verdict(gap, welch, max_gap, strict)
    pf, po = (math.exp(mean_std(r.value(loss) for r in g.runs)[0]) for g in (freeze, other))
    ev = (f"validation PPL {pf:.3f} ({_short(freeze)}) vs {po:.3f} ({_short(other)}) (geometric means over "
          f"{res['n_a']} and {res['n_b']} seeds): {100 * gap:+.2f}%")
    if welch is None:
        ev += f"; one seed a side: no interval, the point estimate against {100 * max_gap:.0f}% decides"
    else:
        ev += (f", 95% Welch [{100 * welch[0]:+.2f}%, {100 * welch[1]:+.2f}%], bootstrap "
               f"[{100 * boot[0]:+.2f}%, {100 * boot[1]:+.2f}%]; threshold {100 * max_gap:.0f}%: "
               + {HOLDS: "the interval lies within it", FAILS: "the interval lies beyond it"}.get(
                   verdict, "the interval spans it"))
    return dict(id=hid, claim=claim, value=gap, interval=welch, bootstrap=boot, threshold=max_gap,
                verdict=verdict, holds={HOLDS: True, FAILS: False}.get(verdict), evidence=ev)


def _h3_speed(freeze: Group | None, base: Group | None, why: str, min_ratio: float, which: str) -> dict:
    """H3: OELM-Freeze's tokens/s over the baseline's, and its training seconds to the target
    validation loss over the baseline's, with the steps to it."""
    sf, sb = (freeze.mean("tokens_per_s"), base.mean("tokens_per_s")) if base else (None, None)
    if not (sf and sb):
        return _missing("H3", H3_CLAIM, min_ratio, why or f"needs the tokens/s of {freeze.label} and {base.label}")
    ratio = sf / sb
    fast = ratio >= min_ratio
    ev = f"{sf:,.0f} vs {sb:,.0f} tokens/s (ratio {ratio:.3f}, needs >= {min_ratio})"
    target = loss_target([freeze, base], which)
    reach = {g.label: [time_to_target(r, target) for r in g.runs] for g in (freeze, base)} if target else {}
    time_ratio = None
    if reach and all(None not in pair for runs in reach.values() for pair in runs):
        mean = {label: [sum(x) / len(x) for x in zip(*runs)] for label, runs in reach.items()}
        (steps_f, secs_f), (steps_b, secs_b) = mean[freeze.label], mean[base.label]
        time_ratio = secs_f / secs_b
        ev += (f"; to validation loss {target:.4f} (the highest {which} validation loss of their runs, which "
               f"every run reaches): step {steps_f:,.0f} and {secs_f:.1f} s of training ({_short(freeze)}) vs "
               f"step {steps_b:,.0f} and {secs_b:.1f} s ({_short(base)}), seconds ratio "
               f"{time_ratio:.3f} (needs <= {1 / min_ratio:.3f}; training time from the log windows' "
               f"tokens/s, evaluation excluded; means over seeds)")
    else:
        ev += "; no time to a target loss (the runs' evaluations or tokens/s are missing)"
    holds = fast and (time_ratio is None or time_ratio <= 1 / min_ratio)
    if time_ratio is not None and fast != (time_ratio <= 1 / min_ratio):
        ev += (f". Both must hold: {_short(freeze)} is {'as fast or faster' if fast else 'slower'} per token, "
               f"{'slower' if fast else 'no slower'} to the target")
    return dict(id="H3", claim=H3_CLAIM, value=ratio, time_ratio=time_ratio, target_loss=target, threshold=min_ratio,
                verdict=HOLDS if holds else FAILS, holds=holds, evidence=ev)


def _short(group: Group) -> str:
    return group.label.removeprefix("OELM-")


def _missing(hid: str, claim: str, threshold: float, why: str) -> dict:
    return dict(id=hid, claim=claim, value=None, threshold=threshold, verdict=NOT_JUDGED, holds=None,
                evidence=f"not judged: {why}")
