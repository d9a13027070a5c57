"""A tuned study reported on equal footing: each group at its own best setting, and all groups at
each dropout, with the same tables and verdicts under each view; and the spread of re-runs.

The study folder holds the three groups at both dropouts, each at its best learning rate for
that dropout (the tuning sweep's choice, made on the selection half of the validation windows),
several seeds each. ``protocol_report`` reads it three ways:

    own best      each group at the dropout the tuning chose for it (``tuning_choice``: given,
                  never chosen again here, where the reported figures would choose it)
    dropout=D     all groups at dropout D, for each dropout the study trained: a gap then
                  measures the variant at a shared regularisation, not the dropout

and under each gives the results table, the gaps with 95% Welch and bootstrap intervals, Hedges'
g and the equivalence test, and the hypotheses' verdicts (H2 and H4 among them). Runs are grouped
by (variant, dropout) through ``groups.group_runs``; within a view the groups may differ in
learning rate (and, for "own best", dropout): ``compare_across`` says which.

A GPU run is not bit-repeatable unless trained deterministically, so a seed fixes the initial
weights and the data order, not the result. Where the study holds one configuration twice (the
same trained settings and seed, e.g. a run folder with a name suffix), the second is a re-run: it
is left out of the groups (it is no further seed) and the "re-run spread" section sets the
re-runs' differences beside the seeds' spread.
"""

from __future__ import annotations

import json
import math
import string
from pathlib import Path
from typing import Mapping, Sequence

from oelm_core.analysis.budget import smoke_banner, smoke_budget
from oelm_core.analysis.gaps import EQUIVALENCE_MARGIN, gap_table
from oelm_core.analysis.groups import GROUP_LABELS, TUNED_SETTINGS, group_runs
from oelm_core.analysis.hypotheses import hypotheses, hypotheses_markdown
from oelm_core.analysis.markdown import markdown_table
from oelm_core.analysis.report import gaps_note, jsonable
from oelm_core.analysis.runs import WHICH_WORDS, Run, check_figures
from oelm_core.analysis.stats import mean_std
from oelm_core.analysis.tables import results_table
from oelm_core.config import ConfigError

# What the groups of an equal-dropout view may differ in: each keeps its own best learning rate.
LEARNING_RATE = ("train.lr", "train.min_lr")
DROPOUT = "model.dropout"


def protocol_report(
    runs: Sequence[Run],
    out_dir: str | Path,
    tuning_choice: Mapping,
    which: str = "report",
    timed_alone: bool | None = None,
    margin: float = EQUIVALENCE_MARGIN,
) -> dict:
    """Write results.md and results.json of a tuned study at both dropouts to ``out_dir`` and
    return what results.json holds: {which, tuning_choice, smoke_budget, views: {name: {runs,
    compare_across, table, gaps, hypotheses}}, reruns}.

    ``tuning_choice``: {variant: dropout} of each group's own best setting, or oelm_core.tuning's
    ``tuning_table(...)["chosen"]`` ({variant: row with "dropout"}). ``which``: runs.WHICH, by
    default "report", the held-out half the tuning did not choose on. ``timed_alone`` and
    ``margin``: as ``write_results`` and ``gap_table`` take them. ConfigError where a view would
    hold other than one group per variant (a group missing at a dropout, or several learning
    rates at one), naming what it found."""
    check_figures(runs, which)
    kept, reruns = split_reruns(runs)
    choice = {variant: _dropout_of(value, variant) for variant, value in tuning_choice.items()}
    dropouts = sorted({_dropout(r) for r in kept})
    views = {"own best": (_own_best(kept, choice), TUNED_SETTINGS)}
    views.update({f"dropout={d:g}": ([r for r in kept if _dropout(r) == d], LEARNING_RATE) for d in dropouts})
    smoke = smoke_budget(runs)
    result = {
        "which": which,
        "tuning_choice": choice,
        "smoke_budget": smoke,
        "equivalence_margin": margin,
        "views": {},
        "reruns": rerun_spread(runs, which),
    }
    md = ["# Results: each group at its own best setting, and all groups at equal dropout\n"]
    if smoke:
        md += [smoke_banner(smoke), ""]
    own = ", ".join(f"{GROUP_LABELS.get(v, v)} {d:g}" for v, d in choice.items())
    trained = ", ".join(f"{d:g}" for d in dropouts)
    md += [
        f"Validation figures: {WHICH_WORDS[which]}; groups averaged over seeds. Each group trained at its best "
        f"learning rate at each dropout here ({trained}). Its own best dropout is the tuning sweep's choice "
        f"({own}), made on the selection half and not chosen again on the figures reported here. Training "
        f"loss is measured with dropout on: compare groups on validation figures.\n",
        gaps_note(margin),
    ]
    letters = {}  # a view's runs -> its letter: a view that holds the same runs as an earlier one says so
    for letter, (name, (view_runs, across)) in zip(string.ascii_lowercase, views.items()):
        _check_view(name, view_runs, choice)
        same = letters.setdefault(frozenset(r.name for r in view_runs), letter)
        table = results_table(view_runs, which, compare_across=across)
        gaps = gap_table(view_runs, which, across, margin=margin)
        hyps = hypotheses(view_runs, which, compare_across=across, timed_alone=timed_alone)
        result["views"][name] = {
            "runs": [r.name for r in view_runs],
            "compare_across": list(across),
            "table": table["rows"],
            "gaps": {"groups": gaps["groups"], "pairs": gaps["pairs"]},
            "hypotheses": hyps,
        }
        if same != letter:
            md += [
                f"\n## ({letter}) {_view_title(name)}\n",
                f"The same runs as ({same}): every group's own best dropout is this one, so ({same})'s tables and "
                f"verdicts are this view's.\n",
            ]
            continue
        md += [
            f"\n## ({letter}) {_view_title(name)}\n",
            f"Compared across {', '.join(across)}; every other setting shared.\n",
            table["markdown"],
            "",
            gaps["markdown"],
            "",
            hypotheses_markdown(hyps),
        ]
    md += ["\n## Re-run spread\n", result["reruns"]["markdown"]]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text("\n".join(md) + "\n")
    (out / "results.json").write_text(json.dumps(jsonable(result), indent=2))
    return result


def split_reruns(runs: Sequence[Run]) -> tuple[list[Run], list[tuple[Run, Run]]]:
    """(the runs with each configuration once, [(kept run, re-run)]): runs whose trained settings
    (Run.settings, seed included) are equal are one configuration; of each, the run with the
    shortest name (then the first by name) is kept, its others are re-runs."""
    by_config: dict[str, list[Run]] = {}
    for run in runs:
        key = json.dumps({"variant": run.variant, "preset": run.preset, **run.settings()}, sort_keys=True, default=repr)
        by_config.setdefault(key, []).append(run)
    kept, reruns = [], []
    for same in by_config.values():
        first, *others = sorted(same, key=lambda r: (len(r.name), r.name))
        kept.append(first)
        reruns += [(first, other) for other in others]
    return kept, reruns


def rerun_spread(runs: Sequence[Run], which: str = "report") -> dict:
    """The runs trained twice (``split_reruns``) beside their group's seed spread: {rows, pooled_sd,
    pairs, markdown}. A row per re-run: {model, dropout, seed, run, rerun, loss, rerun_loss,
    difference (re-run minus run), seed_sd (the sample std of the group's seeds, re-runs left
    out)} of the ``which`` validation loss. pooled_sd: sqrt(sum(d^2) / (2 k)) over the k pairs'
    differences d, the standard deviation of one run that re-running alone gives (each
    difference has twice its variance); None without re-runs. Without re-runs the markdown says
    whether every run was deterministic (then a re-run repeats it) or the spread is unmeasured."""
    kept, reruns = split_reruns(runs)
    groups = group_runs(kept)
    key = f"{which}_val_loss"
    rows = []
    for first, again in reruns:
        group = next(g for g in groups if any(r is first for r in g.runs))
        a, b = first.value(key), again.value(key)
        rows.append(
            {
                "model": group.label,
                "dropout": _dropout(first),
                "seed": first.seed,
                "run": first.name,
                "rerun": again.name,
                "loss": a,
                "rerun_loss": b,
                "difference": None if a is None or b is None else b - a,
                "seed_sd": mean_std(r.value(key) for r in group.runs)[1],
            }
        )
    diffs = [r["difference"] for r in rows if r["difference"] is not None]
    pooled = math.sqrt(sum(d * d for d in diffs) / (2 * len(diffs))) if diffs else None
    if rows:
        md = (
            "Runs of one configuration (same trained settings and seed) trained twice: the difference of their "
            f"{which} validation loss (nats/token) beside the sample std (n-1) of their group's seeds. Re-run "
            f"sd from the {len(diffs)} pair(s): {pooled:.4f} (sqrt(sum d^2 / 2k)); a seed fixes the initial "
            f"weights and the data order, not the result.\n\n"
            + markdown_table(
                rows,
                ["model", "dropout", "seed", "run", "rerun", "loss", "rerun_loss", "difference", "seed_sd"],
                [
                    "Model",
                    "Dropout",
                    "Seed",
                    "Run",
                    "Re-run",
                    "Loss",
                    "Re-run loss",
                    "Difference",
                    "Seed sd of the group",
                ],
            )
        )
    elif kept and all((r.config.get("train") or {}).get("deterministic") for r in kept):
        md = (
            "No configuration was trained twice. Every run here trained with train.deterministic: on one "
            "kind of card with the same software a re-run ends on the same bits (tests/test_gpu_determinism.py), "
            "so the seeds' spread is the whole spread."
        )
    else:
        md = (
            "(no configuration was trained twice: the re-run spread is not measured in this study; runs "
            "not trained with train.deterministic may end apart by as much as two seeds)"
        )
    return {"rows": rows, "pooled_sd": pooled, "pairs": len(diffs), "markdown": md}


def _dropout(run: Run) -> float:
    return float(run.settings()[DROPOUT] or 0.0)


def _dropout_of(value, variant: str) -> float:
    """A tuning choice's dropout: a number, or a row of tuning_table's "chosen" ({"dropout": ...})."""
    if isinstance(value, Mapping):
        value = value.get("dropout")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(
            f"tuning_choice[{variant!r}] = {value!r} names no dropout; pass {{variant: dropout}} or "
            f"oelm_core.tuning.tuning_table(...)['chosen']"
        )
    return float(value)


def _own_best(runs: Sequence[Run], choice: dict[str, float]) -> list[Run]:
    missing = sorted(set(GROUP_LABELS) - set(choice))
    if missing:
        raise ConfigError(
            f"tuning_choice has no dropout for {', '.join(missing)}; give each of the three groups "
            f"the dropout its tuning chose"
        )
    return [r for r in runs if r.variant in choice and _dropout(r) == choice[r.variant]]


def _check_view(name: str, runs: Sequence[Run], choice: dict[str, float]) -> None:
    """ConfigError unless ``runs`` hold exactly one group of each of the three variants."""
    groups = group_runs(runs)
    found = {v: [g.label for g in groups if g.variant == v] for v in GROUP_LABELS}
    wrong = {v: labels for v, labels in found.items() if len(labels) != 1}
    if wrong:
        what = "; ".join(f"{GROUP_LABELS[v]}: {', '.join(labels) or 'none'}" for v, labels in wrong.items())
        raise ConfigError(
            f"the view {name!r} needs one group of each of the three variants, and finds {what}; "
            f"the study must hold each group at its best learning rate for each dropout (no other "
            f"learning rates), and tuning_choice {choice} must name dropouts it trained"
        )


def _view_title(name: str) -> str:
    return "Each group at its own best setting" if name == "own best" else f"All groups at {name.replace('=', ' ')}"
