"""Each group at its own best setting: read a tuning sweep back, choose, and write the study at it.

    python -m oelm_core.tuning runs/tune_medium512 [--markdown T.md] [--figure F.png]
    python -m oelm_core.tuning runs/tune_medium512 --study parameters/study_tuned_medium512.yaml --write S.yaml

A tuning sweep (``parameters/tuning/*.yaml``) trains every (peak learning rate, dropout, group) for a
few seeds. A fair comparison reports each group at the setting that suits it: giving OELM-Freeze
GPT-Base's learning rate would measure the learning rate as much as the model. The rule: per group
(the run's variant), the (lr, dropout) with the lowest validation loss at the early-stopping point
(``best_val_loss``, the checkpoint the study keeps), averaged over the seeds; a setting with a
seed that did not finish is not a candidate.

Beside each choice it lists the cautions that weaken it (``cautions``): a learning rate at the
grid's edge, no seed that stopped early, a runner-up within the seeds' spread.

``--study TEMPLATE --write OUT`` copies a study file (its comment header too) with each run
entry's ``train.lr``, ``train.min_lr`` and ``model.dropout`` set to its group's choice, read from
the chosen runs' config.yaml: the study then trains exactly the setting that won.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import date
from pathlib import Path
from typing import Optional, Sequence

import yaml

from oelm_core.analysis import GROUP_LABELS, TUNED_SETTINGS, find_run_dirs, load_run, markdown_table, mean_std
from oelm_core.config import ConfigError, read_yaml
from oelm_core.experiment import FINISHED
from oelm_core.files import write_text_atomic

def _get(config: dict, dotted: str):
    section, key = dotted.split(".")
    return (config.get(section) or {}).get(key)


def tuning_table(roots: str | Path | Sequence[str | Path], metric: str = "best_val_loss") -> dict:
    """Per (group, lr, dropout): seeds, mean and sample std of ``metric``, the mean step of the
    best evaluation and how many seeds stopped early; and per group the chosen row.

    Returns {"rows": [...], "chosen": {variant: row}, "markdown": str}; each row also holds
    ``settings`` ({train.lr, train.min_lr, model.dropout}) and ``paths`` (its run folders).
    ConfigError where the folders hold no finished run."""
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
        raise ConfigError(f"no run folders under {', '.join(map(str, roots))}; train the tuning sweep first "
                          f"(python -m oelm_core.experiment parameters/tuning/medium512.yaml)")
    rows = []
    for (variant, lr, dropout), cell in cells.items():
        runs = cell["runs"]
        finished = [r for r in runs if r.summary.get("status") in FINISHED]
        values = [r.value(metric) for r in finished]
        mean, std = mean_std(values)
        best_steps = [_best_step(r) for r in finished]
        rows.append({"group": GROUP_LABELS.get(variant, variant), "variant": variant, "lr": lr, "dropout": dropout,
                     "seeds": len(runs), "finished": len(finished), metric: mean, f"{metric}_std": std,
                     "best_step": mean_std(best_steps)[0],
                     "stopped_early": sum(r.summary.get("status") == "stopped_early" for r in finished),
                     "candidate": bool(finished) and len(finished) == len(runs) and None not in values,
                     "settings": cell["settings"], "paths": [str(r.path) for r in runs]})
    order = {v: i for i, v in enumerate(GROUP_LABELS)}
    rows.sort(key=lambda r: (order.get(r["variant"], 9), r["variant"], r["dropout"], r["lr"]))
    chosen = {}
    for row in rows:
        if row["candidate"] and (row["variant"] not in chosen or row[metric] < chosen[row["variant"]][metric]):
            chosen[row["variant"]] = row
    for row in rows:
        row["chosen"] = chosen.get(row["variant"]) is row
    cols = ["group", "lr", "dropout", "seeds", metric, f"{metric}_std", "best_step", "stopped_early", "chosen"]
    return {"rows": rows, "chosen": chosen, "metric": metric, "markdown": markdown_table(rows, cols),
            "cautions": {v: cautions(rows, row, metric) for v, row in chosen.items()}}


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
        out.append(f"lr {chosen['lr']:g} is the {edge} swept at dropout {chosen['dropout']:g}: the best may lie "
                   f"{'above' if edge == 'largest' else 'below'} it; widen the sweep")
    if chosen["stopped_early"] == 0:
        out.append("no seed stopped early: the validation loss was still falling when the budget ended; a longer "
                   "budget may lower it")
    others = [r for r in group if r is not chosen and r["candidate"]]
    if others:
        second = min(others, key=lambda r: r[metric])
        spread = max(r[f"{metric}_std"] or 0.0 for r in (chosen, second))
        behind = second[metric] - chosen[metric]
        if behind < spread:
            out.append(f"a tie: lr {second['lr']:g}, dropout {second['dropout']:g} is {behind:.4f} behind, within "
                       f"the seeds' spread ({spread:.4f}); more seeds decide it")
    return out


def _best_step(run) -> Optional[int]:
    evals = [r for r in run.eval_rows() if r.get("val_loss") is not None]
    return min(evals, key=lambda r: r["val_loss"])["step"] if evals else None


def tuned_study(template: str | Path, chosen: dict, source: str = "", out: str | Path | None = None) -> str:
    """The text of ``template`` (a study file) with each run entry's tuned settings set to its
    group's choice (``tuning_table(...)["chosen"]``), to be written to ``out`` (default: in place
    of the template; the runs' parameter files are named relative to it). The template's leading
    comments are kept. ConfigError where a run's group has no choice."""
    template = Path(template)
    out_dir = Path(out).resolve().parent if out is not None else template.resolve().parent
    raw = read_yaml(template)
    section = raw.get("study")
    if not isinstance(section, dict) or not isinstance(section.get("runs"), list):
        raise ConfigError(f"{template} is not a study file with study.runs; pass one such as "
                          f"parameters/study_tuned_medium512.yaml")
    runs = []
    for entry in section["runs"]:
        entry = {"params": entry} if isinstance(entry, str) else dict(entry)
        params = Path(entry["params"])
        params = params if params.is_absolute() else template.parent / params
        variant = read_yaml(params).get("variant")
        if variant not in chosen:
            raise ConfigError(f"the tuning runs hold no finished setting of {variant} (for {entry['params']} in "
                              f"{template}); tune it first, or leave it out of the study")
        entry["params"] = os.path.relpath(params.resolve(), out_dir)
        kept = [s for s in entry.get("overrides") or [] if s.split("=", 1)[0].strip() not in TUNED_SETTINGS]
        entry["overrides"] = kept + [f"{k}={v}" for k, v in chosen[variant]["settings"].items()]
        runs.append(entry)
    section["runs"] = runs
    header = []
    for line in template.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    note = (f"# Learning rate and dropout per group: written by python -m oelm_core.tuning {source} "
            f"on {date.today().isoformat()}.")
    return "\n".join(header + [note]) + "\n" + yaml.safe_dump(raw, sort_keys=False, width=110)


def tuning_figure(table: dict, path: str | Path | None = None):
    """``metric`` against the peak learning rate (log axis), one line per group, one panel per
    dropout; error bars: the seeds' sample std; the chosen settings ringed."""
    from oelm_core.analysis import pyplot, save_figure

    plt = pyplot()
    metric = table["metric"]
    dropouts = sorted({r["dropout"] for r in table["rows"]})
    fig, axes = plt.subplots(1, len(dropouts), figsize=(5.2 * len(dropouts), 4), sharey=True, squeeze=False)
    variants = list(dict.fromkeys(r["variant"] for r in table["rows"]))
    for ax, dropout in zip(axes[0], dropouts):
        for k, variant in enumerate(variants):
            rows = [r for r in table["rows"] if r["variant"] == variant and r["dropout"] == dropout
                    and r[metric] is not None]
            if not rows:
                continue
            color = f"C{k}"
            ax.errorbar([r["lr"] for r in rows], [r[metric] for r in rows],
                        yerr=[r[f"{metric}_std"] or 0 for r in rows], marker="o", capsize=3, color=color,
                        label=GROUP_LABELS.get(variant, variant))
            for r in rows:
                if r["chosen"]:
                    ax.plot(r["lr"], r[metric], "o", ms=13, mfc="none", mec=color, mew=2)
        ax.set_xscale("log")
        # the swept rates as the ticks: the log axis' own minor labels (3e-4, 4e-4, ...) overlap
        rates = sorted({r["lr"] for r in table["rows"]})
        ax.set_xticks(rates, [f"{lr:g}" for lr in rates], minor=False)
        ax.set_xticks([], minor=True)
        ax.set_xlabel("peak learning rate")
        ax.set_title(f"dropout {dropout}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"{metric.replace('_', ' ')} (mean over seeds)")
    axes[0][-1].legend(title="ringed: chosen")
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oelm_core.tuning", description=__doc__.split("\n")[0])
    p.add_argument("roots", nargs="+", help="folders holding the tuning sweep's run folders, e.g. runs/tune_medium512")
    p.add_argument("--metric", default="best_val_loss", help="what is minimised (default: best_val_loss)")
    p.add_argument("--markdown", help="write the table here too")
    p.add_argument("--figure", help="write the figure here")
    p.add_argument("--study", help="a study file whose runs get their group's chosen setting (needs --write)")
    p.add_argument("--write", help="where the study file with the chosen settings goes")
    args = p.parse_args(argv)
    if bool(args.study) != bool(args.write):
        p.error("--study and --write go together: the template study file and where its tuned copy goes")
    try:
        table = tuning_table(args.roots, args.metric)
        print(table["markdown"])
        notes = []
        for variant, row in table["chosen"].items():
            print(f"chosen for {row['group']}: lr {row['lr']}, dropout {row['dropout']} "
                  f"({args.metric} {row[args.metric]:.4f} over {row['finished']} seed(s))")
            notes += [f"- {row['group']}: {c}" for c in table["cautions"][variant]]
        if notes:
            print("cautions:\n" + "\n".join(notes))
        if args.markdown:
            text = table["markdown"] + ("\n\nCautions about the choice:\n\n" + "\n".join(notes) if notes else "")
            write_text_atomic(args.markdown, text + "\n")
        if args.figure:
            tuning_figure(table, args.figure)
        if args.study:
            write_text_atomic(args.write, tuned_study(args.study, table["chosen"], " ".join(args.roots), args.write))
            print(f"wrote {args.write}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
