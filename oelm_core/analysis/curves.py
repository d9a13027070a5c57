"""Training curves: the losses of every run of a study against steps or tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from oelm_core.analysis.figures import pyplot, save_figure
from oelm_core.analysis.groups import group_runs
from oelm_core.analysis.runs import Run


def plot_curves(runs: Sequence[Run], path: str | Path | None = None, x: str = "step"):
    """Training loss (left) and validation loss (right) against ``x`` ("step" or "tokens_seen"),
    one colour per group of seeds (group_runs), each run labelled with its group and seed."""
    plt = pyplot()
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(11, 4))
    curves = [(f"C{i}", group.label + ("" if seed is None else f" (seed {seed})"), run)
              for i, group in enumerate(group_runs(runs)) for run, seed in zip(group.runs, group.seeds)]
    for color, label, run in curves:
        tr = run.train_rows()
        if tr:
            ax_t.plot([r.get(x, r["step"]) for r in tr], [r["train_loss"] for r in tr],
                      color=color, alpha=0.85, lw=1.2, label=label)
        ev = run.eval_rows()
        if ev:
            ax_v.plot([r.get(x, r["step"]) for r in ev], [r["val_loss"] for r in ev], "o-",
                      color=color, ms=3, label=label)
    for ax, title in ((ax_t, "training loss"), (ax_v, "validation loss")):
        ax.set(xlabel=x.replace("_", " "), ylabel="loss (nats/token)", title=title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)

