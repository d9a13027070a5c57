"""Training wall-clock from a run's metrics, and the steps and seconds each run takes to a target loss.

metrics.jsonl's train rows each report tokens_per_s over their log window (the steps since the
previous row) and tokens_seen at its end, so a window lasted (tokens_seen - previous tokens_seen)
/ tokens_per_s seconds, and their running sum is the training time up to each row. It counts
the training steps only: evaluation, checkpointing and start-up are left out (summary.json's
wall_time_s has them), so that runs evaluated differently compare on their training alone.

Those seconds compare runs only where each had its device to itself: several runs on one GPU
each get a share of it, which depends on what ran beside them. The trainer records it in
summary.json's ``timed_alone`` (true, false, or null where it could not tell; measured from the
device's process list during the run, evidence in provenance.occupancy); ``alone_record`` reads
it back, and a speed figure is compared only where every run's record says true.
"""

from __future__ import annotations

import bisect
from typing import Sequence

from oelm_core.analysis.groups import Group
from oelm_core.analysis.markdown import markdown_table
from oelm_core.analysis.stats import mean_std


def training_seconds(run) -> list[tuple[int, float]]:
    """[(step, seconds of training up to the end of that step)] for each train row of ``run``
    (a Run) that reports tokens_per_s and tokens_seen, in step order."""
    out, seconds, seen = [], 0.0, 0
    for row in sorted(run.train_rows(), key=lambda r: r["step"]):
        rate, tokens = row.get("tokens_per_s"), row.get("tokens_seen")
        if not rate or tokens is None:
            continue
        seconds += (tokens - seen) / rate
        seen = tokens
        out.append((row["step"], seconds))
    return out


def seconds_at(clock: list[tuple[int, float]], step: int) -> float | None:
    """The training seconds at ``step`` from ``training_seconds``' rows: those of the last row at
    or before it (an evaluation row may carry no train figures); None before the first row."""
    i = bisect.bisect_right([s for s, _ in clock], step)
    return clock[i - 1][1] if i else None


def time_to_target(run, target: float) -> tuple[int | None, float | None]:
    """(step, training seconds) of ``run``'s first evaluation whose validation loss is at most
    ``target`` (nats/token); (None, None) where no evaluation reaches it."""
    clock = training_seconds(run)
    for row in sorted(run.eval_rows(), key=lambda r: r["step"]):
        if row["val_loss"] <= target:
            return row["step"], seconds_at(clock, row["step"])
    return None, None


def loss_target(groups: Sequence[Group], which: str = "best") -> float | None:
    """The highest ``which`` validation loss of any run of ``groups``: the lowest target that
    every run reaches (None without one). For which="report" the best loss of the evaluations
    (the selection half): the curves a target is looked up on are measured there, and the
    held-out half's figure would be on another scale."""
    which = "best" if which == "report" else which
    values = [r.value(f"{which}_val_loss") for g in groups for r in g.runs]
    values = [v for v in values if v is not None]
    return max(values) if values else None


def time_to_target_table(groups: Sequence[Group], target: float) -> dict:
    """Per group: {model, target, reached (runs that reach ``target``), seeds, steps, steps_std,
    seconds, seconds_std, tokens_per_s}: means and sample standard deviations (n - 1) over the
    runs that reach it, of the step and the training seconds (``training_seconds``) of their
    first evaluation at or below it. Returns {"rows", "markdown"}."""
    rows = []
    for g in groups:
        reached = [(s, t) for s, t in (time_to_target(r, target) for r in g.runs) if s is not None]
        steps, steps_std = mean_std(s for s, _ in reached)
        secs, secs_std = mean_std(t for _, t in reached)
        rows.append(
            {
                "model": g.label,
                "target": target,
                "reached": len(reached),
                "seeds": len(g.runs),
                "steps": steps,
                "steps_std": steps_std,
                "seconds": secs,
                "seconds_std": secs_std,
                "tokens_per_s": g.mean("tokens_per_s"),
            }
        )
    md = markdown_table(
        rows,
        ["model", "target", "reached", "seeds", "steps", "steps_std", "seconds", "seconds_std", "tokens_per_s"],
        [
            "Model",
            "Target val loss",
            "Runs reaching it",
            "Seeds",
            "Steps (mean)",
            "Steps std",
            "Training s (mean)",
            "Training s std",
            "Tokens/s (median per run, mean)",
        ],
    )
    return {"rows": rows, "markdown": md}


def alone_record(runs) -> dict:
    """What the runs' summary.json records of having their device alone while timed:
    {alone, not_alone, unrecorded, why}. alone: True where every run records timed_alone true,
    False where any records false, else None; not_alone / unrecorded: the names of the runs that
    record false / nothing (no key, or null: trained before the record, or the trainer could not
    tell); why: a sentence naming them, for a speed figure left out (None where alone)."""
    runs = list(runs)
    not_alone = [r.name for r in runs if r.summary.get("timed_alone") is False]
    unrecorded = [r.name for r in runs if r.summary.get("timed_alone") not in (True, False)]
    parts = []
    if not_alone:
        parts.append(
            f"{_names(not_alone)} shared {_their(not_alone)} device while timed (summary.json: timed_alone "
            f"false), so {_their(not_alone)} tokens/s and seconds are shares of a device that depend on what "
            f"ran beside {'it' if len(not_alone) == 1 else 'them'}"
        )
    if unrecorded:
        parts.append(
            f"{_names(unrecorded)} {'does' if len(unrecorded) == 1 else 'do'} not record whether "
            f"{'it' if len(unrecorded) == 1 else 'they'} had {_their(unrecorded)} device alone (no "
            f"timed_alone in summary.json, or null: trained before the record, or the trainer could not tell)"
        )
    alone = False if not_alone else (None if unrecorded or not runs else True)
    return {
        "alone": alone,
        "not_alone": not_alone,
        "unrecorded": unrecorded,
        "why": "; ".join(parts) or (None if runs else "no runs"),
    }


def _names(names: list[str]) -> str:
    return f"the run {names[0]}" if len(names) == 1 else f"the runs {', '.join(names[:-1])} and {names[-1]}"


def _their(names: list[str]) -> str:
    return "its" if len(names) == 1 else "their"
