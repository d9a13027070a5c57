"""A tuning sweep read back: per group, the setting with the lowest mean validation loss, and its cautions.

A tuning sweep (``parameters/tuning/*.yaml``) trains every (peak learning rate, dropout, group) for a
few seeds. A fair comparison reports each group at the setting that suits it: giving OELM-Freeze
GPT-Base's learning rate would measure the learning rate as much as the model. The rule
(``tuning_table``): per group (the run's variant), the (lr, dropout) with the lowest validation loss
at the early-stopping point (``best_val_loss``, the checkpoint the study keeps), averaged over the
seeds; a setting with a seed that did not finish is not a candidate. Beside each choice,
``cautions`` lists what weakens it: a learning rate at the grid's edge, no seed that stopped early,
a runner-up within the seeds' spread. ``tuning_figure`` draws it; oelm_core.tuning writes the study
at the choice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from oelm_core.analysis.figures import pyplot, save_figure
from oelm_core.analysis.groups import TUNED_SETTINGS
from oelm_core.analysis.markdown import markdown_table
from oelm_core.analysis.runs import FINISHED, find_run_dirs, load_run
from oelm_core.analysis.stats import mean_std
from oelm_core.config import ConfigError
from oelm_core.groups import GROUP_LABELS


def _get(config: dict, dotted: str):
    section, key = dotted.split(".")
    return (config.get(section) or {}).get(key)


def tuning_table(roots: str | Path | Sequence[str | Path], metric: str = "best_val_loss", min_seeds: int = 1) -> dict:
    """Per (group, lr, dropout): seeds, mean and sample std of ``metric``, the mean step of the
    best evaluation and how many seeds stopped early; and per group the chosen row.

    Returns {"rows": [...], "chosen": {variant: row}, "per_dropout": {(variant, dropout): row},
    "markdown": str}; "per_dropout" is each group's best learning rate at each dropout (a study on
    equal footing trains each group at both). Each row also holds ``settings`` ({train.lr,
    train.min_lr, model.dropout}) and ``paths`` (its run folders). A setting with fewer than
    ``min_seeds`` finished seeds is no candidate: a choice between settings of one seed and of two
    would favour the noisier. ConfigError where the folders hold no finished run."""
    roots = [roots] if isinstance(roots, (str, Path)) else list(roots)
    cells: dict[tuple, dict] = {}
    for root in roots:
        for d in find_run_dirs(root):
            run = load_run(d)
            settings = {k: _get(run.config, k) for k in TUNED_SETTINGS}
            key = (run.variant, settings["train.lr"], settings["model.dropout"] or 0.0)
            cell = cells.setdefault(key, {"settings": settings, "runs": []})
            cell["runs"].append(run)
    if not cells:
        raise ConfigError(
            f"no run folders under {', '.join(map(str, roots))}; train the tuning sweep first "
            f"(python -m oelm_core run parameters/tuning/medium512.yaml)"
        )
    rows = []
    for (variant, lr, dropout), cell in cells.items():
        runs = cell["runs"]
        finished = [r for r in runs if r.summary.get("status") in FINISHED]
        values = [r.value(metric) for r in finished]
        mean, std = mean_std(values)
        best_steps = [_best_step(r) for r in finished]
        rows.append(
            {
                "group": GROUP_LABELS.get(variant, variant),
                "variant": variant,
                "lr": lr,
                "dropout": dropout,
                "seeds": len(runs),
                "finished": len(finished),
                metric: mean,
                f"{metric}_std": std,
                "best_step": mean_std(best_steps)[0],
                "stopped_early": sum(r.summary.get("status") == "stopped_early" for r in finished),
                "candidate": (
                    bool(finished) and len(finished) == len(runs) and len(finished) >= min_seeds and None not in values
                ),
                "settings": cell["settings"],
                "paths": [str(r.path) for r in runs],
            }
        )
    order = {v: i for i, v in enumerate(GROUP_LABELS)}
    rows.sort(key=lambda r: (order.get(r["variant"], 9), r["variant"], r["dropout"], r["lr"]))
    chosen = _lowest(rows, metric, lambda r: r["variant"])
    per_dropout = _lowest(rows, metric, lambda r: (r["variant"], r["dropout"]))
    for row in rows:
        row["chosen"] = chosen.get(row["variant"]) is row
        row["best_at_dropout"] = per_dropout.get((row["variant"], row["dropout"])) is row
    cols = [
        "group",
        "lr",
        "dropout",
        "seeds",
        metric,
        f"{metric}_std",
        "best_step",
        "stopped_early",
        "best_at_dropout",
        "chosen",
    ]
    return {
        "rows": rows,
        "chosen": chosen,
        "per_dropout": per_dropout,
        "metric": metric,
        "markdown": markdown_table(rows, cols),
        "cautions": {v: cautions(rows, row, metric) for v, row in chosen.items()},
    }


def _lowest(rows: Sequence[dict], metric: str, key) -> dict:
    """{key(row): the candidate row with the lowest ``metric``} over ``rows``."""
    best: dict = {}
    for row in rows:
        if row["candidate"] and (key(row) not in best or row[metric] < best[key(row)][metric]):
            best[key(row)] = row
    return best


def cautions(rows: Sequence[dict], chosen: dict, metric: str = "best_val_loss") -> list[str]:
    """What makes ``chosen`` (a row of ``rows``) a weaker choice than it looks: a learning rate at
    the edge of what its group swept at that dropout (the best may lie beyond), no seed that
    stopped early (the loss was still falling when the budget ended), and a runner-up within the
    seeds' spread (the larger sample std of the two; a tie)."""
    out = []
    group = [r for r in rows if r["variant"] == chosen["variant"]]
    rates = sorted(r["lr"] for r in group if r["dropout"] == chosen["dropout"])
    if len(rates) > 1 and chosen["lr"] in (rates[0], rates[-1]):
        edge = "largest" if chosen["lr"] == rates[-1] else "smallest"
        out.append(
            f"lr {chosen['lr']:g} is the {edge} swept at dropout {chosen['dropout']:g}: the best may lie "
            f"{'above' if edge == 'largest' else 'below'} it; widen the sweep"
        )
    if chosen["stopped_early"] == 0:
        out.append(
            "no seed stopped early: the validation loss was still falling when the budget ended; a longer "
            "budget may lower it"
        )
    others = [r for r in group if r is not chosen and r["candidate"]]
    if others:
        second = min(others, key=lambda r: r[metric])
        spread = max(r[f"{metric}_std"] or 0.0 for r in (chosen, second))
        behind = second[metric] - chosen[metric]
        if behind < spread:
            out.append(
                f"a tie: lr {second['lr']:g}, dropout {second['dropout']:g} is {behind:.4f} behind, within "
                f"the seeds' spread ({spread:.4f}); more seeds decide it"
            )
    return out


def _best_step(run) -> Optional[int]:
    evals = [r for r in run.eval_rows() if r.get("val_loss") is not None]
    return min(evals, key=lambda r: r["val_loss"])["step"] if evals else None


# Settings more than this above the lowest (in the metric's units: nats for the losses) are off
# the figure's scale: a diverged rate's loss (3-4 nats where the contenders lie within 0.3) would
# squeeze them into a sliver. They are drawn on the top edge, as triangles labelled with their value.
FAR_ABOVE_BEST = 1.0


def tuning_figure(table: dict, path: str | Path | None = None):
    """``metric`` against the peak learning rate (log axis), one line per group, one panel per
    dropout; error bars: the seeds' sample std; the chosen settings ringed; settings more than
    ``FAR_ABOVE_BEST`` above the lowest on the top edge, with their value."""
    plt = pyplot()
    metric = table["metric"]
    dropouts = sorted({r["dropout"] for r in table["rows"]})
    fig, axes = plt.subplots(1, len(dropouts), figsize=(5.2 * len(dropouts), 4), sharey=True, squeeze=False)
    variants = list(dict.fromkeys(r["variant"] for r in table["rows"]))
    values = [r[metric] for r in table["rows"] if r[metric] is not None]
    far = min(values, default=0.0) + FAR_ABOVE_BEST
    # the top edge: just above the highest error bar on the scale
    shown = [r[metric] + (r[f"{metric}_std"] or 0) for r in table["rows"] if r[metric] is not None and r[metric] <= far]
    clip = len(shown) < len(values)
    top = max(shown, default=0.0) + 0.1 * (max(shown, default=0.0) - min(values, default=0.0))
    rates = sorted({r["lr"] for r in table["rows"]})
    for ax, dropout in zip(axes[0], dropouts):
        for k, variant in enumerate(variants):
            rows = [
                r
                for r in table["rows"]
                if r["variant"] == variant and r["dropout"] == dropout and r[metric] is not None
            ]
            if not rows:
                continue
            color = f"C{k}"
            ax.errorbar(
                [r["lr"] for r in rows],
                [top if r[metric] > far else r[metric] for r in rows],
                yerr=[0 if r[metric] > far else (r[f"{metric}_std"] or 0) for r in rows],
                marker="o",
                capsize=3,
                color=color,
                label=GROUP_LABELS.get(variant, variant),
            )
            for r in rows:
                if r["chosen"]:
                    ax.plot(r["lr"], r[metric], "o", ms=13, mfc="none", mec=color, mew=2)
                if r[metric] > far:
                    ax.plot(r["lr"], top, "^", ms=9, color=color)
                    last = r["lr"] == max(rates)  # its label on the left, inside the panel
                    ax.annotate(
                        f"{r[metric]:.2f}",
                        (r["lr"], top),
                        xytext=(-6 if last else 6, -4 - 10 * k),
                        textcoords="offset points",
                        color=color,
                        fontsize=8,
                        va="top",
                        ha="right" if last else "left",
                    )
        ax.set_xscale("log")
        # the swept rates as the ticks: the log axis' own minor labels (3e-4, 4e-4, ...) overlap
        ax.set_xticks(rates, [f"{lr:g}" for lr in rates], minor=False)
        ax.set_xticks([], minor=True)
        ax.set_xlabel("peak learning rate")
        ax.set_title(f"dropout {dropout}")
        ax.grid(alpha=0.3)
    if clip:
        axes[0][0].set_ylim(top=top + 0.02 * (top - min(values)))
    axes[0][0].set_ylabel(
        f"{metric.replace('_', ' ')} (mean over seeds)" + ("\n(triangles: above, value beside)" if clip else "")
    )
    axes[0][-1].legend(title="ringed: chosen")
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig
