"""Training curves: the losses of every run against steps or tokens (``plot_curves``), and a
study's groups as the mean over their seeds with a band (``curve_band``, ``plot_study_curves``)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Sequence

from oelm_core.analysis.figures import pyplot, save_figure
from oelm_core.analysis.groups import group_runs
from oelm_core.analysis.runs import Run
from oelm_core.analysis.stats import mean_std
from oelm_core.analysis.timing import alone_record, seconds_at, training_seconds

# What a band around a group's mean curve spans: +-1 sample standard deviation (n - 1) over the
# seeds, or the seeds' lowest to highest value.
BANDS = ("std", "minmax")


def plot_curves(runs: Sequence[Run], path: str | Path | None = None, x: str = "step"):
    """Training loss (left) and validation loss (right) against ``x`` ("step" or "tokens_seen"),
    one colour per group of seeds (group_runs), each run labelled with its group and seed."""
    plt = pyplot()
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(11, 4))
    curves = [
        (f"C{i}", group.label + ("" if seed is None else f" (seed {seed})"), run)
        for i, group in enumerate(group_runs(runs))
        for run, seed in zip(group.runs, group.seeds)
    ]
    for color, label, run in curves:
        tr = run.train_rows()
        if tr:
            ax_t.plot(
                [r.get(x, r["step"]) for r in tr],
                [r["train_loss"] for r in tr],
                color=color,
                alpha=0.85,
                lw=1.2,
                label=label,
            )
        ev = run.eval_rows()
        if ev:
            ax_v.plot(
                [r.get(x, r["step"]) for r in ev], [r["val_loss"] for r in ev], "o-", color=color, ms=3, label=label
            )
    for ax, title in ((ax_t, "training loss"), (ax_v, "validation loss")):
        ax.set(xlabel=x.replace("_", " "), ylabel="loss (nats/token)", title=title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def curve_band(runs: Sequence[Run], key: str = "val_loss", band: str = "std") -> dict:
    """A group's curve of ``key`` (a metrics.jsonl figure: "val_loss", "train_loss", ...) over its
    seeds ``runs``, at the steps every run logged it: {step, mean, low, high, seconds, epochs},
    lists of one value per such step, and n (the runs). low/high: mean -+ the sample standard
    deviation (``band`` "std"; the mean itself with one run) or the seeds' min and max
    ("minmax"). seconds: the mean training seconds at the step (timing.training_seconds;
    evaluation excluded; None where a run has no tokens/s); epochs: the mean epochs seen."""
    if band not in BANDS:
        raise ValueError(f"band={band!r} is not a band curve_band draws; pass one of {', '.join(map(repr, BANDS))}")
    by_run = [{r["step"]: r for r in run.metrics if r.get(key) is not None} for run in runs]
    steps = sorted(set.intersection(*(set(rows) for rows in by_run))) if by_run else []
    clocks = [training_seconds(run) for run in runs]
    out = {"step": steps, "mean": [], "low": [], "high": [], "seconds": [], "epochs": [], "n": len(runs)}
    for step in steps:
        values = [rows[step][key] for rows in by_run]
        mean, std = mean_std(values)
        low, high = (min(values), max(values)) if band == "minmax" else (mean - (std or 0), mean + (std or 0))
        secs = [seconds_at(clock, step) for clock in clocks]
        epochs = [rows[step].get("epochs") for rows in by_run]
        out["mean"].append(mean)
        out["low"].append(low)
        out["high"].append(high)
        out["seconds"].append(None if None in secs else mean_std(secs)[0])
        out["epochs"].append(None if None in epochs else mean_std(epochs)[0])
    return out


def plot_study_curves(
    runs: Sequence[Run],
    path: str | Path | None = None,
    band: str = "std",
    zoom: float = 1 / 3,
    timed_alone: bool | None = None,
    title: str | None = None,
):
    """The study's curves, one colour per group of seeds (group_runs): its mean over the seeds,
    and a shaded band (``curve_band``'s ``band``). Four panels: training loss (log axis, plain
    tick labels) and validation loss against steps (epochs on the top axis), the validation loss
    over the last ``zoom`` of the steps, and the validation loss against wall-clock training
    seconds (evaluation excluded). The validation curves are the evaluations' (the selection half
    of the windows where the runs held the other half out: the panels say so).

    Where the groups trained at different dropouts the training-loss panel says its curves do not
    compare across them (training loss is measured with dropout on). The wall-clock panel is drawn
    only where every run records that it had its device alone (timing.alone_record) and
    ``timed_alone`` is not False; otherwise it says why it is empty. ``title``: the figure's, above
    the panels (a protocol study's view: which runs these are)."""
    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (ax_t, ax_v), (ax_z, ax_s) = axes
    spread = "+-1 sample std (n-1)" if band == "std" else "min-max"
    last = max((r["step"] for run in runs for r in run.eval_rows()), default=0)
    record = alone_record(runs)
    wall_clock = _wall_clock_missing(runs, record, timed_alone)
    groups = group_runs(runs)
    train_range = []
    for i, group in enumerate(groups):
        color, label = f"C{i}", f"{group.label} (n={len(group.runs)})"
        train, val = curve_band(group.runs, "train_loss", band), curve_band(group.runs, "val_loss", band)
        train_range += train["low"] + train["high"]
        zoomed = [j for j, s in enumerate(val["step"]) if s >= (1 - zoom) * last]
        timed = [j for j, s in enumerate(val["seconds"]) if s is not None]
        panels = [
            (ax_t, train, range(len(train["step"])), "step"),
            (ax_v, val, range(len(val["step"])), "step"),
            (ax_z, val, zoomed, "step"),
        ] + ([(ax_s, val, timed, "seconds")] if not wall_clock else [])
        for ax, curve, at, x in panels:
            xs = [curve[x][j] for j in at]
            ax.plot(xs, [curve["mean"][j] for j in at], color=color, lw=1.4, label=label)
            ax.fill_between(
                xs, [curve["low"][j] for j in at], [curve["high"][j] for j in at], color=color, alpha=0.25, lw=0
            )
    held_out = any((r.summary.get("val_windows") or {}).get("report") for r in runs)
    val_title = "validation loss (selection half)" if held_out else "validation loss"
    for ax, panel, xlabel in (
        (ax_t, "training loss", "step"),
        (ax_v, val_title, "step"),
        (ax_z, f"{val_title}, last {zoom:.0%} of steps", "step"),
        (ax_s, f"{val_title} vs wall-clock training time", "wall-clock training seconds (evaluation excluded)"),
    ):
        ax.set(xlabel=xlabel, ylabel="loss (nats/token)", title=panel)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8, title=f"mean, band {spread}", title_fontsize=8)
    if wall_clock:
        ax_s.text(
            0.5,
            0.5,
            _wrapped(f"not drawn: {wall_clock}", 60),
            ha="center",
            va="center",
            fontsize=8,
            transform=ax_s.transAxes,
        )
    dropouts = _dropouts(groups)
    if len(set(dropouts.values())) > 1:
        note = (
            f"groups differ in dropout ({', '.join(f'{k} {v:g}' for k, v in dropouts.items())}): training "
            f"loss is measured with dropout on, so it does not compare across them; the validation panels do"
        )
        # top left of the panel, between the first steps' fall and the legend: nothing is drawn there
        ax_t.text(
            0.14,
            0.96,
            _wrapped(note, 48),
            fontsize=7,
            transform=ax_t.transAxes,
            va="top",
            bbox={"facecolor": "white", "alpha": 0.8, "lw": 0},
        )
    per_step = _epochs_per_step(runs)
    if per_step:
        for ax in (ax_t, ax_v, ax_z):
            top = ax.secondary_xaxis("top", functions=(lambda s: s * per_step, lambda e: e / per_step))
            top.set_xlabel("epochs", fontsize=8)
    # log scale: the first steps' loss (~11) would flatten the rest; a handful of plain tick labels
    # on it (matplotlib's log ticks label the powers of ten alone: one label between 1 and 11)
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    ax_t.set_yscale("log")
    if train_range:
        ax_t.yaxis.set_major_locator(FixedLocator(log_ticks(min(train_range), max(train_range))))
        ax_t.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax_t.yaxis.set_minor_formatter(NullFormatter())
    if title:
        fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    return save_figure(fig, path)


# Tick mantissas for a log axis, sparsest first (log_ticks).
_LOG_MANTISSAS = (
    (1, 2, 5),
    (1, 1.5, 2, 3, 5, 7),
    (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8),
    tuple(round(1 + i / 10, 1) for i in range(90)),
)


def log_ticks(low: float, high: float, fewest: int = 4, most: int = 9) -> list[float]:
    """Tick values for a log axis spanning [low, high] (> 0): the sparsest of _LOG_MANTISSAS' sets
    (times powers of ten) that puts at least ``fewest`` ticks in the range, else the densest with at
    most ``most``."""
    if not 0 < low <= high:
        raise ValueError(f"log_ticks needs 0 < low <= high; got {low}, {high}")
    powers = range(math.floor(math.log10(low)), math.floor(math.log10(high)) + 1)
    chosen: list[float] = []
    for mantissas in _LOG_MANTISSAS:
        ticks = sorted({float(f"{m * 10**k:.6g}") for k in powers for m in mantissas if low <= m * 10**k <= high})
        if len(ticks) > most:
            break
        chosen = ticks
        if len(ticks) >= fewest:
            break
    return chosen


def _wrapped(text: str, width: int) -> str:
    """``text`` in lines of at most ``width`` characters, never broken inside a name (OELM-NoFreeze)."""
    return "\n".join(textwrap.wrap(text, width, break_on_hyphens=False))


def _dropouts(groups) -> dict[str, float]:
    """{group label: its model.dropout} (Run.settings' key)."""
    return {g.label: float(g.settings.get("model.dropout") or 0.0) for g in groups}


def _wall_clock_missing(runs: Sequence[Run], record: dict, timed_alone: bool | None) -> str | None:
    """Why the wall-clock panel stays empty, None where it is drawn."""
    if timed_alone is False:
        return "the runs are taken to have shared their devices (timed_alone=False), so their seconds do not compare"
    if record["alone"] is not True:
        n = len(runs)
        parts = (
            [f"{len(record['not_alone'])} of {n} runs shared their device while timed"] if record["not_alone"] else []
        ) + (
            [
                f"{len(record['unrecorded'])} of {n} runs do not record whether they had their device "
                f"alone (summary.json's timed_alone)"
            ]
            if record["unrecorded"]
            else []
        )
        return f"{'; '.join(parts)}; wall-clock seconds compare only runs that each had a device alone"
    if not any(training_seconds(run) for run in runs):
        return "no run's metrics hold tokens/s and tokens seen, from which training seconds are summed"
    return None


def _epochs_per_step(runs: Sequence[Run]) -> float | None:
    """Epochs per step of the runs' last train rows (equal steps of tokens: a constant), None
    without epochs in the metrics or where the runs disagree (the top axis would mislabel one)."""
    rates = {
        round(rows[-1]["epochs"] / rows[-1]["step"], 12)
        for run in runs
        if (rows := run.train_rows()) and rows[-1].get("epochs") and rows[-1]["step"]
    }
    return rates.pop() if len(rates) == 1 else None
