"""Sweeps (A3-A6) and the ablations: their CLI, and the tables and figures read back from their runs.

A sweep file (``parameters/sweeps/*.yaml``: a ``sweep:`` section with key, points, variants,
seeds and smoke) and the ablations (``parameters/ablations.yaml``: one ``experiment:`` section
listing the variants) are plans of oelm_core.experiment, which trains them:

    python -m oelm_core.sweep run parameters/sweeps/a6_layers.yaml --out runs/sweeps [--smoke]
    python -m oelm_core.sweep ablations --out runs/ablations [--seeds 0 1] [--only oelm_poet]
    python -m oelm_core.sweep table runs/ablations [--figure F.png] [--markdown T.md]
    python -m oelm_core.sweep table runs/sweeps --sweep [--name a6_layers] [--smoke | --full] [--figure F.png]
    python -m oelm_core.sweep gaps results/ablations_medium512 --comparators results/tuned_medium512/runs --tuned

``run`` trains a sweep into OUT/<sweep>/<key>=<value>/<variant>/seed<S> (--smoke: OUT/<sweep>_smoke/...),
then tabulates and plots it; ``ablations`` trains every ablation x seed into OUT/<name>/seed<S>
(``--params-dir DIR``: one run per DIR/*.yaml instead, the older layout of the ablations), then
writes the table (ablations.md, .json, .png). Each run folder holds the trainer's files,
``params.yaml`` and ``sweep_point.json`` (which point, variant and seed it is); runs that ended
are skipped and runs cut short resume. ``ablation_table`` / ``sweep_results`` and their figures
read run folders back, the committed results/ablations (older runs without sweep_point.json)
included. ``gaps`` (``ablation_gaps``) sets each ablation against comparator runs trained
elsewhere (a study's OELM-Freeze and GPT-Base): gaps with 95% intervals, ablations.md/.json/.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Optional, Sequence

import yaml

from oelm_core.analysis import (BASELINE, GROUP_LABELS, TUNED_SETTINGS, Group, assumed_settings, evaluated_seeds,
                                seed_groups, settings_apart)
from oelm_core.analysis.gaps import gap_fields, group_figures
from oelm_core.config import ConfigError
from oelm_core.experiment import REPO, RUNNERS, Plan, load_plan, run_trainings
from oelm_core.files import write_text_atomic

ABLATIONS = REPO / "parameters" / "ablations.yaml"


def sweep_dir(name: str, out_root: str | Path, smoke: bool = False) -> Path:
    """The folder of a sweep's run folders; smoke runs get their own, so that a full sweep into
    the same out_root never finds (and skips) a smoke run where its own point belongs."""
    return Path(out_root) / (f"{name}_smoke" if smoke else name)


def ablation_plan(plan_file: str | Path = ABLATIONS, out: str | Path = "runs/ablations",
                  seeds: Sequence[int] | None = None, only: Sequence[str] | None = None,
                  overrides: list[str] | dict | None = None, params_dir: str | Path | None = None) -> Plan:
    """The ablations as a plan: every variant of ``plan_file`` x seed (its own seeds, 0 and 1, by
    default), into OUT/<name>/seed<S>. ``params_dir``: one run per DIR/*.yaml instead (named by
    the file), the layout of the ablations before parameters/ablations.yaml."""
    if params_dir is None:
        return load_plan(plan_file, out, seeds=seeds, only=only, overrides=overrides)
    files = sorted(Path(params_dir).glob("*.yaml"))
    if not files:
        raise ConfigError(f"no *.yaml ablation files in {params_dir}")
    plan_file = Path(out) / "ablations_plan.yaml"   # the folder as a plan: what was trained, beside it
    plan_file.parent.mkdir(parents=True, exist_ok=True)
    spec = {"name": "ablations", "runs": [{"params": str(f.resolve()), "name": f.stem} for f in files],
            "seeds": list(seeds if seeds is not None else (0, 1)), "runner": "inprocess", "keep_checkpoints": False}
    write_text_atomic(plan_file, yaml.safe_dump({"experiment": spec}, sort_keys=False))
    return load_plan(plan_file, out, only=only, overrides=overrides)


# --------------------------------------------------------------------------------------------
# Reading back: tables and figures
# --------------------------------------------------------------------------------------------

def _load(root: str | Path):
    from oelm_core import analysis

    runs = []
    for d in analysis.find_run_dirs(root):
        run = analysis.load_run(d)
        point = d / "sweep_point.json"
        run.point = json.loads(point.read_text()) if point.is_file() else {}
        runs.append(run)
    return runs


def _poet_spectrum_error(run) -> Optional[float]:
    """max |sigma/gain - 1| of the trained POET Q/K in the run's best checkpoint (None: not POET,
    or no readable best.pt: one broken file must not cost the table of every other run)."""
    cfg = (run.config.get("model") or {})
    if run.variant != "oelm_poet" and not cfg.get("poet_block_size"):
        return None
    ckpt = run.checkpoint()
    if not ckpt.is_file():
        return None
    from oelm_core.checkpoint import CheckpointError, load_model
    from oelm_core.poet import poet_modules, spectrum_error

    try:
        model, _ = load_model(ckpt)
    except CheckpointError as exc:
        warnings.warn(f"no POET spectrum error for {run.path}: {exc}", stacklevel=2)
        return None
    mods = poet_modules(model)
    return max(spectrum_error(m, model.cfg.qk_gain) for m in mods) if mods else None


def _row(run, spectrum: bool = True) -> dict:
    """``run_rows``' row of one run (an analysis.Run with its sweep point, as ``_load`` reads it)."""
    p = run.point
    return {
        "label": p.get("label") or run.name, "variant": run.variant, "seed": run.seed,
        "key": p.get("key"), "value": p.get("value"), "sweep": p.get("sweep"), "smoke": bool(p.get("smoke")),
        "status": run.summary.get("status"), "steps": run.value("steps"),
        "final_val_loss": run.value("final_val_loss"), "final_val_ppl": run.value("final_val_ppl"),
        "best_val_loss": run.value("best_val_loss"),
        "trainable": run.value("trainable"), "frozen": run.value("frozen"), "total": run.value("total"),
        "tokens_per_s": run.value("tokens_per_s"), "wall_time_s": run.value("wall_time_s"),
        "spectrum_err": _poet_spectrum_error(run) if spectrum else None,
        "path": str(run.path),
    }


def _swept(point: dict) -> bool:
    """Whether a run's sweep_point.json (or row) places it on a sweep axis: an ablation's names
    none (the older ones name the axis "ablation", their label as its value)."""
    return point.get("key") not in (None, "ablation")


def run_rows(root: str | Path, spectrum: bool = True) -> list[dict]:
    """One row per run folder under ``root``: label, variant, seed, point, final/best val figures,
    parameter counts, throughput and (POET) the spectrum error of the trained Q/K."""
    return [_row(run, spectrum) for run in _load(root)]


def _group(rows: list[dict], keys: Sequence[str]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    return groups


ABLATION_ORDER = [*GROUP_LABELS, "oelm_freeze_gaussian", "oelm_freeze_svd",
                  "oelm_freeze_householder", "oelm_freeze_cayley", "oelm_freeze_shallow", "oelm_freeze_deep",
                  "progressive", "progressive_layerwise", "oelm_poet", "synth_random", "synth_random_fixed",
                  "synth_factorized"]


def _order(label: str) -> tuple[int, str]:
    stem = label.split(" (")[0]   # "gpt_base (train.steps=200)": one of several gpt_base groups
    return (ABLATION_ORDER.index(stem) if stem in ABLATION_ORDER else len(ABLATION_ORDER), label)


def _ablation_groups(runs: list, rows: list[dict]) -> list[list[int]]:
    """The positions of ``rows`` (one per run of ``runs``) as groups of seeds: one label, and
    trained settings equal apart from train.seed (analysis.seed_groups), so that runs trained
    otherwise (another --set) are never averaged as seeds. Where a label has several groups, each
    row's label gets the settings that tell them apart: "gpt_base (train.steps=200)". ConfigError
    for two runs of one group with the same seed: the same training twice, not two seeds."""
    groups = seed_groups(runs, [row["label"] for row in rows])
    for label, settings, at in groups:
        siblings = [g[1] for g in groups if g[0] == label]
        if len(siblings) > 1:
            for i in at:
                rows[i]["label"] = f"{label} ({settings_apart(settings, siblings)})"
    return [at for _, _, at in groups]


def ablation_table(root: str | Path, baseline: str = BASELINE, spectrum: bool = True) -> dict:
    """{"runs": per-run rows, "rows": per-ablation means over seeds, "markdown_runs", "markdown"}.

    Per ablation: mean (and std over seeds) final val loss and ppl, the gap to ``baseline`` in %,
    trainable/frozen parameters, tokens/s and, for POET, the trained Q/K's spectrum error. An
    ablation's seeds are its runs trained with the same settings apart from train.seed
    (``_ablation_groups``); "seeds" counts the evaluated ones: a run that ended before its first
    evaluation is left out of the validation figures and named in a warning, as
    analysis.results_table does; a run without config.yaml is averaged with its variant's default
    settings, which it is taken to have trained, and named in a warning too. ConfigError where
    ``root`` holds a sweep's runs: their points share labels (the variant), so ``sweep_results``
    tabulates them.
    """
    from oelm_core.analysis import markdown_table, mean_std

    loaded = _load(root)
    sweeps = sorted({str(r.point.get("sweep")) for r in loaded if _swept(r.point)})
    if sweeps:
        raise ConfigError(f"{root} holds runs of the sweep(s) {', '.join(sweeps)}: tabulate a sweep with "
                          f"--sweep (python -m oelm_core.sweep table {root} --sweep --name NAME), or point "
                          f"the ablation table at a folder of ablation runs only (e.g. runs/ablations)")
    runs = [_row(run, spectrum) for run in loaded]
    rows = []
    for at in sorted(_ablation_groups(loaded, runs), key=lambda at: _order(runs[at[0]]["label"])):
        group = [runs[i] for i in at]
        assumed_settings(group[0]["label"], [loaded[i] for i in at])
        losses = [r["final_val_loss"] for r in group]
        loss, loss_std = mean_std(losses)
        seeds = evaluated_seeds(group[0]["label"], [str(r["path"]) for r in group], losses)
        rows.append({"label": group[0]["label"], "variant": group[0]["variant"], "seeds": seeds,
                     "val_loss": loss, "val_loss_std": loss_std,
                     "val_ppl": mean_std(r["final_val_ppl"] for r in group)[0],
                     "trainable": group[0]["trainable"], "frozen": group[0]["frozen"],
                     "tokens_per_s": mean_std(r["tokens_per_s"] for r in group)[0],
                     "spectrum_err": mean_std(r["spectrum_err"] for r in group)[0]})
    runs.sort(key=lambda r: (_order(r["label"]), r["seed"] or 0))
    base = next((r for r in rows if r["label"] == baseline), None)
    for r in rows:
        ok = base is not None and r["val_loss"] is not None and base["val_loss"]
        r["loss_gap_pct"] = 100 * (r["val_loss"] / base["val_loss"] - 1) if ok else None
    run_cols = ["label", "variant", "seed", "status", "final_val_loss", "final_val_ppl", "trainable", "frozen",
                "tokens_per_s", "spectrum_err"]
    cols = ["label", "seeds", "val_loss", "val_loss_std", "val_ppl", "loss_gap_pct", "trainable", "frozen",
            "tokens_per_s", "spectrum_err"]
    heads = ["Ablation", "Seeds", "Val loss", "Std", "Val PPL", f"Loss gap vs {baseline} (%)", "Trainable",
             "Frozen", "Tokens/s", "POET max abs(s-1)"]
    return {"runs": runs, "rows": rows, "markdown_runs": markdown_table(runs, run_cols),
            "markdown": markdown_table(rows, cols, heads)}


def ablation_figure(table: dict, path: str | Path | None = None):
    """Final validation loss per ablation: bars at the seed mean, dots at each seed."""
    from oelm_core.analysis import _plt, save_figure

    plt = _plt()
    rows = [r for r in table["rows"] if r["val_loss"] is not None]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4))
    xs = range(len(rows))
    colors = ["tab:gray" if r["label"] == BASELINE else "tab:purple" if r["label"].startswith("synth")
              else "tab:green" if "poet" in r["label"] else "tab:blue" for r in rows]
    ax.bar(xs, [r["val_loss"] for r in rows], color=colors, alpha=0.6)
    for x, r in zip(xs, rows):
        seeds = [s["final_val_loss"] for s in table["runs"] if s["label"] == r["label"] and s["final_val_loss"]]
        ax.scatter([x] * len(seeds), seeds, color="black", s=12, zorder=3)
    lo = min(r["val_loss"] for r in rows) if rows else 0
    hi = max(r["val_loss"] for r in rows) if rows else 1
    ax.set_ylim(lo - 0.15 * (hi - lo + 1e-3) - 0.05, hi + 0.15 * (hi - lo + 1e-3) + 0.05)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["label"] for r in rows], rotation=45, ha="right")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title("Ablations (bars: mean over seeds; dots: seeds)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)


# An ablation's comparator: OELM-Freeze, which each ablation changes in one respect (its variant, or
# an unfreeze schedule), and GPT-Base. Each ablation is set against both.
ABLATION_COMPARATORS = ("oelm_freeze", BASELINE)
# What an ablation may change of OELM-Freeze beyond the variant: progressive's unfreeze schedule.
ABLATION_SETTINGS = ("train.unfreeze_schedule",)


def ablation_gaps(root: str | Path, comparators: str | Path, which: str = "best",
                  compare_across: Sequence[str] = ()) -> dict:
    """Each ablation under ``root`` against the comparator runs under ``comparators`` (a study's
    run folders: its OELM-Freeze and GPT-Base groups): {"rows", "markdown", "comparators"}.

    A row per group of seeds (ablations, then the comparators): {label, source, seeds, val_loss,
    val_loss_std, val_ppl, val_ppl_std} (``which`` validation figures; sample std, n - 1) and,
    per comparator c of ABLATION_COMPARATORS, c_gap_pct, c_welch_low/high_pct,
    c_boot_low/high_pct, c_hedges_g (analysis.ppl_gap: the geometric-mean PPL gap, 95% Welch and
    bootstrap intervals). A gap is left out (None) unless the two groups were trained alike apart
    from the variant and ABLATION_SETTINGS, and for GPT-Base also ``compare_across`` (e.g.
    TUNED_SETTINGS: GPT-Base at its own tuned setting). ConfigError without a comparator group,
    or with several of one variant.
    """
    from oelm_core import analysis

    analysis.check_which(which)
    ablations = _load(root)
    others = analysis.load_runs(comparators)
    runs = ablations + others
    labels = [r.point.get("label") or r.name for r in ablations] + [r.variant for r in others]
    groups = [Group(label, runs[at[0]].variant, runs[at[0]].preset, settings, [runs[i] for i in at],
                    [runs[i].seed for i in at]) for label, settings, at in seed_groups(runs, labels)]
    sources = ["comparator" if g.runs[0] in others else "ablation" for g in groups]
    bases = {}
    for variant in ABLATION_COMPARATORS:
        found = [g for g, src in zip(groups, sources) if src == "comparator" and g.variant == variant]
        if len(found) != 1:
            raise ConfigError(f"{comparators} holds {len(found)} groups of {variant}; the ablations need exactly "
                              f"one to compare with")
        bases[variant] = found[0]
    rows = []
    for g, src in sorted(zip(groups, sources), key=lambda gs: (gs[1] == "comparator", _order(gs[0].label))):
        row = {"label": g.label, "source": src, **_figures(g, which)}
        for variant, base in bases.items():
            across = ABLATION_SETTINGS + (tuple(compare_across) if variant == BASELINE else ())
            alike = g is not base and analysis.variant_alone(g, base, across)
            res = analysis.ppl_gap([r.value(f"{which}_val_loss") for r in g.runs],
                                   [r.value(f"{which}_val_loss") for r in base.runs]) if alike else {}
            row.update(gap_fields(res, f"{variant}_"))
        rows.append(row)
    cols = ["label", "source", "seeds", "val_loss", "val_loss_std", "val_ppl", "val_ppl_std"]
    heads = ["Ablation", "Runs", "Seeds", f"{which.capitalize()} val loss (mean)", "Loss std (n-1)",
             "Val PPL (mean)", "PPL std (n-1)"]
    for variant in bases:
        name = GROUP_LABELS[variant]
        cols += [f"{variant}_gap_pct", f"{variant}_welch_low_pct", f"{variant}_welch_high_pct",
                 f"{variant}_boot_low_pct", f"{variant}_boot_high_pct"]
        heads += [f"PPL gap vs {name} (%)", "Welch 95% low", "Welch 95% high", "Bootstrap 95% low",
                  "Bootstrap 95% high"]
    return {"rows": rows, "markdown": analysis.markdown_table(rows, cols, heads),
            "comparators": str(comparators), "which": which, "compare_across": list(compare_across)}


def _figures(group, which: str) -> dict:
    """gaps.group_figures' means and sample stds, its seeds counted by evaluated_seeds (which
    names the runs that ended before an evaluation)."""
    figures = {k: v for k, v in group_figures(group, which).items() if k not in ("model", "preset")}
    losses = [r.value(f"{which}_val_loss") for r in group.runs]
    return {**figures, "seeds": evaluated_seeds(group.label, [str(r.path) for r in group.runs], losses)}


def ablation_gaps_figure(table: dict, path: str | Path | None = None):
    """``ablation_gaps``' PPL gaps as horizontal bars, one panel per comparator: a bar at each
    group's gap (%), the 95% Welch interval as a black error bar, the 95% bootstrap interval as
    a thick grey line; groups without a gap to that comparator are left out of its panel."""
    from oelm_core.analysis import _plt, save_figure

    plt = _plt()
    variants = [v for v in ABLATION_COMPARATORS if any(r.get(f"{v}_gap_pct") is not None for r in table["rows"])]
    fig, axes = plt.subplots(1, max(1, len(variants)), figsize=(6 * max(1, len(variants)), 0.5 * len(table["rows"]) + 2),
                             squeeze=False)
    for ax, variant in zip(axes[0], variants):
        rows = [r for r in table["rows"] if r.get(f"{variant}_gap_pct") is not None]
        ys = list(range(len(rows)))[::-1]
        gaps = [r[f"{variant}_gap_pct"] for r in rows]
        ax.barh(ys, gaps, color=["tab:gray" if r["source"] == "comparator" else "tab:blue" for r in rows],
                alpha=0.6)
        welch = [(g - (r[f"{variant}_welch_low_pct"] or g), (r[f"{variant}_welch_high_pct"] or g) - g)
                 for g, r in zip(gaps, rows)]
        ax.errorbar(gaps, ys, xerr=list(zip(*welch)) if welch else None, fmt="none", ecolor="black",
                    capsize=4, label="95% Welch interval")
        for y, r in zip(ys, rows):
            if r[f"{variant}_boot_low_pct"] is not None:
                ax.plot([r[f"{variant}_boot_low_pct"], r[f"{variant}_boot_high_pct"]], [y, y], color="tab:orange",
                        lw=4, alpha=0.8, solid_capstyle="butt",
                        label="95% bootstrap interval" if y == ys[0] else None)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(ys)
        ax.set_yticklabels([f"{r['label']} (n={r['seeds']})" for r in rows])
        ax.set_xlabel(f"{table['which']} validation PPL gap vs {GROUP_LABELS[variant]} (%)")
        ax.set_title(f"vs {GROUP_LABELS[variant]}")
        ax.grid(axis="x", alpha=0.3)
    from matplotlib.patches import Patch

    handles = [Patch(color="tab:blue", alpha=0.6, label="ablation: gap = exp(mean loss difference) - 1"),
               Patch(color="tab:gray", alpha=0.6, label="comparator group (the study's runs)"),
               *axes[0][0].get_legend_handles_labels()[0]]
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8)
    return save_figure(fig, path)


def write_ablation_gaps(table: dict, out: str | Path) -> list[Path]:
    """``ablation_gaps``' table into ``out``: ablations.md, ablations.json, ablations.png."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    across = f", GPT-Base at its own {', '.join(table['compare_across'])}" if table["compare_across"] else ""
    note = (f"Ablations against the comparator runs under {table['comparators']} ({table['which']} validation "
            f"figures; means and sample std, n-1, over seeds). PPL gap: exp(mean loss A - mean loss B) - 1, the "
            f"gap of the geometric-mean PPLs; both 95% intervals are of the loss difference mapped through "
            f"exp(.) - 1 (Welch's t; percentile bootstrap, 9,999 resamples). A gap is shown only between groups "
            f"trained alike apart from the variant and the unfreeze schedule{across}.")
    md, js, png = out / "ablations.md", out / "ablations.json", out / "ablations.png"
    md.write_text(f"## Ablations\n\n{note}\n\n{table['markdown']}\n")
    js.write_text(json.dumps({k: v for k, v in table.items() if k != "markdown"}, indent=2) + "\n")
    ablation_gaps_figure(table, png)
    return [md, js, png]


def sweep_results(root: str | Path, sweep_name: Optional[str] = None, smoke: Optional[bool] = None) -> dict:
    """Per (value, variant): mean/std final val loss over seeds, from the run folders under root.

    ``sweep_name``: the sweep to read; None, the one sweep root holds (ConfigError where it holds
    several: their points are not one curve). ``smoke``: True, the smoke runs only; False, the
    full runs only; None, whichever kind root holds (ConfigError where it holds both, so a table
    never mixes them).
    """
    from oelm_core.analysis import markdown_table, mean_std

    runs = [r for r in run_rows(root, spectrum=False) if _swept(r)
            and (sweep_name is None or r["sweep"] == sweep_name)]
    names = sorted({str(r["sweep"]) for r in runs})
    if sweep_name is None and len(names) > 1:
        raise ConfigError(f"{root} holds the sweeps {', '.join(names)}; name one: "
                          f"sweep_results(root, sweep_name) (CLI: table --sweep --name NAME)")
    if smoke is None and len({r["smoke"] for r in runs}) > 1:
        raise ConfigError(f"{root} holds both smoke and full runs{f' of {sweep_name}' if sweep_name else ''}; "
                          f"pass smoke=True or smoke=False (CLI: table --sweep --smoke or --full)")
    runs = [r for r in runs if smoke is None or r["smoke"] == smoke]
    rows = []
    for (sweep, key, value, variant), group in _group(runs, ["sweep", "key", "value", "variant"]).items():
        loss, loss_std = mean_std(r["final_val_loss"] for r in group)
        rows.append({"sweep": sweep, "key": key, "value": value, "variant": variant, "seeds": len(group),
                     "val_loss": loss, "val_loss_std": loss_std,
                     "val_ppl": mean_std(r["final_val_ppl"] for r in group)[0],
                     "trainable": group[0]["trainable"], "frozen": group[0]["frozen"]})
    variant_order = {v: i for i, v in enumerate(GROUP_LABELS)}
    rows.sort(key=lambda r: (r["sweep"] or "", _sortable(r["value"]), variant_order.get(r["variant"], 9), r["variant"]))
    cols = ["sweep", "key", "value", "variant", "seeds", "val_loss", "val_loss_std", "val_ppl", "trainable", "frozen"]
    return {"runs": runs, "rows": rows, "markdown": markdown_table(rows, cols)}


def _sortable(v):
    return (0, float(v), "") if isinstance(v, (int, float)) else (1, 0.0, str(v))


def sweep_figure(results: dict, path: str | Path | None = None, title: Optional[str] = None):
    """Final validation loss against the swept value, one line per variant (error bars: seed std)."""
    from oelm_core.analysis import _plt, save_figure

    plt = _plt()
    rows = [r for r in results["rows"] if r["val_loss"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    values = sorted({r["value"] for r in rows}, key=_sortable)
    numeric = values and all(isinstance(v, (int, float)) and v > 0 for v in values)
    pos = {v: (v if numeric else i) for i, v in enumerate(values)}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        vr = sorted((r for r in rows if r["variant"] == variant), key=lambda r: _sortable(r["value"]))
        ax.errorbar([pos[r["value"]] for r in vr], [r["val_loss"] for r in vr],
                    yerr=[r["val_loss_std"] or 0 for r in vr], marker="o", capsize=3,
                    label=GROUP_LABELS.get(variant, variant))
    if numeric and max(values) / min(values) >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks([pos[v] for v in values])
    ax.set_xticklabels([str(v) for v in values])
    ax.minorticks_off()
    key = rows[0]["key"] if rows else ""
    ax.set_xlabel(key)
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title(title or (f"{rows[0]['sweep']}: validation loss vs {key}" if rows else "sweep"))
    ax.grid(alpha=0.3)
    if rows:
        ax.legend()
    fig.tight_layout()
    return save_figure(fig, path)


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oelm_core.sweep", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train every point of a sweep file, then tabulate and plot it")
    r.add_argument("sweep_file", help="a sweep file, e.g. parameters/sweeps/a6_layers.yaml")
    r.add_argument("--out", default="runs/sweeps",
                   help="folder of the sweeps' run folders: OUT/<sweep>/<key>=<value>/<variant>/seed<S> "
                        "(OUT/<sweep>_smoke/... with --smoke) (default: runs/sweeps)")
    r.add_argument("--smoke", action="store_true", help="the file's smoke points and settings")
    r.add_argument("--runner", choices=RUNNERS, default="inprocess",
                   help="inprocess: train in this process; subprocess: python -m oelm_core.train per run; "
                        "notebook: papermill runs notebooks/03_training.ipynb per run (default: inprocess)")
    r.add_argument("--variants", nargs="+", metavar="VARIANT",
                   help="variants to train (default: the sweep file's sweep.variants)")
    r.add_argument("--seeds", nargs="+", type=int, metavar="SEED",
                   help="seeds to train (default: the sweep file's sweep.seeds)")
    r.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override a parameter of every run, e.g. --set train.steps=200 train.lr=1e-3")
    a = sub.add_parser("ablations", help="train every ablation x seed, then tabulate")
    a.add_argument("--plan", default=str(ABLATIONS.relative_to(REPO)),
                   help="the ablations' plan file (default: parameters/ablations.yaml)")
    a.add_argument("--params-dir", help="a folder of parameter files instead, one run per *.yaml and seed")
    a.add_argument("--out", default="runs/ablations",
                   help="folder of the run folders, OUT/<name>/seed<S>, and of the table "
                        "(ablations.md, .json, .png) (default: runs/ablations)")
    a.add_argument("--seeds", nargs="+", type=int, metavar="SEED", help="seeds (default: the plan's, 0 1)")
    a.add_argument("--only", nargs="+", help="ablations to run, by name (default: all)")
    a.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override a parameter of every run, e.g. --set train.steps=200 train.lr=1e-3")
    a.add_argument("--runner", choices=RUNNERS, help="as for run (default: the plan's, inprocess)")
    a.add_argument("--budget-s", type=float, default=0.0, help="start no run after this many seconds (0: none)")
    a.add_argument("--keep-checkpoints", action="store_true", help="keep each run's ckpt/ folder")
    t = sub.add_parser("table", help="tabulate (and plot) the ablation or sweep runs under a folder")
    t.add_argument("root", help="folder holding the run folders, e.g. runs/ablations, or runs/sweeps with --sweep")
    t.add_argument("--sweep", action="store_true", help="a sweep folder (default: ablations)")
    t.add_argument("--name", help="with --sweep: the sweep to tabulate (needed where the folder holds several)")
    kind = t.add_mutually_exclusive_group()
    kind.add_argument("--smoke", dest="smoke", action="store_const", const=True,
                      help="with --sweep: the smoke runs only (needed where the folder holds both kinds)")
    kind.add_argument("--full", dest="smoke", action="store_const", const=False,
                      help="with --sweep: the full runs only")
    t.add_argument("--figure", help="where to write the figure (default: ROOT/ablations.png for ablations; "
                                    "none for --sweep)")
    t.add_argument("--markdown", help="where to write the markdown table (default: ROOT/ablations.md for "
                                      "ablations; none for --sweep, which prints it)")
    g = sub.add_parser("gaps", help="each ablation's PPL gap to comparator runs, with 95%% intervals")
    g.add_argument("root", help="folder of the ablations' run folders, e.g. results/ablations_medium512")
    g.add_argument("--comparators", required=True,
                   help="folder of the comparator runs (OELM-Freeze and GPT-Base), e.g. results/tuned_medium512/runs")
    g.add_argument("--which", choices=("final", "best"), default="best", help="validation figures (default: best)")
    g.add_argument("--tuned", action="store_true",
                   help=f"GPT-Base at its own tuned setting: {', '.join(TUNED_SETTINGS)} may differ from the ablations'")
    g.add_argument("--out", help="where to write ablations.md, .json, .png (default: ROOT)")
    args = p.parse_args(argv)
    try:
        if args.cmd == "run":
            plan = load_plan(args.sweep_file, out_root=args.out, smoke=args.smoke, runner=args.runner,
                             variants=args.variants, seeds=args.seeds, overrides=args.set)
            rows = run_trainings(plan, log=print)
            res = sweep_results(args.out, plan.name, smoke=args.smoke)
            print(res["markdown"])
            sweep_figure(res, plan.out / "sweep.png")
            return 1 if any(r["status"] == "failed" for r in rows) else 0
        if args.cmd == "ablations":
            plan = ablation_plan(args.plan, args.out, args.seeds, args.only, args.set, args.params_dir)
            plan.runner = args.runner or plan.runner
            plan.keep_checkpoints = plan.keep_checkpoints or args.keep_checkpoints
            rows = run_trainings(plan, budget_s=args.budget_s, log=print)
            _write_table(ablation_table(args.out), args.out, None, None)
            return 1 if any(r["status"] == "failed" for r in rows) else 0
        if args.cmd == "gaps":
            table = ablation_gaps(args.root, args.comparators, args.which, TUNED_SETTINGS if args.tuned else ())
            print(table["markdown"])
            print("wrote " + ", ".join(map(str, write_ablation_gaps(table, args.out or args.root))))
            return 0
        if args.sweep:
            res = sweep_results(args.root, args.name, smoke=args.smoke)
            print(res["markdown"])
            if args.figure:
                sweep_figure(res, args.figure)
            if args.markdown:
                Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
                Path(args.markdown).write_text(res["markdown"] + "\n")
            return 0
        _write_table(ablation_table(args.root), args.root, args.figure, args.markdown)
        return 0
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _write_table(table: dict, root, figure, markdown) -> None:
    root = Path(root)
    print("\nPer run:\n" + table["markdown_runs"] + "\n\nPer ablation (mean over seeds):\n" + table["markdown"])
    md = Path(markdown) if markdown else root / "ablations.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("## Per ablation\n\n" + table["markdown"] + "\n\n## Per run\n\n" + table["markdown_runs"] + "\n")
    (root / "ablations.json").write_text(json.dumps({"rows": table["rows"], "runs": table["runs"]}, indent=2) + "\n")
    ablation_figure(table, Path(figure) if figure else root / "ablations.png")
    print(f"\nwrote {md}, {root / 'ablations.json'}, {Path(figure) if figure else root / 'ablations.png'}")


if __name__ == "__main__":
    sys.exit(main())
