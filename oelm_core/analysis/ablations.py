"""The ablations read back: each ablation's seeds averaged, its gap to GPT-Base, and its PPL gaps
with 95% intervals to a study's comparator runs; their tables and figures.

An ablation set is a plan with a variants axis (parameters/ablations.yaml,
parameters/ablations_medium512.yaml): each run folder's sweep_point.json names its ablation
(``label``). ``ablation_table`` averages each ablation's seeds (``write_ablation_table``:
ablations.md, .json, .png); ``ablation_gaps`` sets each ablation against comparator runs trained
elsewhere (a study's OELM-Freeze and GPT-Base), with Welch and bootstrap intervals
(``write_ablation_gaps``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from oelm_core.analysis.figures import pyplot, save_figure
from oelm_core.analysis.gaps import EQUIVALENCE_MARGIN, equivalence_columns, gap_fields, group_figures, ppl_gap
from oelm_core.analysis.groups import (
    Group,
    assumed_settings,
    evaluated_seeds,
    seed_groups,
    settings_apart,
    variant_alone,
)
from oelm_core.analysis.markdown import markdown_table
from oelm_core.analysis.protocol import DROPOUT
from oelm_core.analysis.runs import check_figures, load_runs
from oelm_core.analysis.stats import mean_std
from oelm_core.analysis.sweeps import load_points, on_sweep_axis, run_row
from oelm_core.config import ConfigError
from oelm_core.groups import BASELINE, GROUP_LABELS

ABLATION_ORDER = [
    *GROUP_LABELS,
    "oelm_freeze_gaussian",
    "oelm_freeze_svd",
    "oelm_freeze_householder",
    "oelm_freeze_cayley",
    "oelm_freeze_shallow",
    "oelm_freeze_deep",
    "progressive",
    "progressive_layerwise",
    "oelm_poet",
    "synth_random",
    "synth_random_fixed",
    "synth_factorized",
]


def _order(label: str) -> tuple[int, str]:
    stem = label.split(" (")[0]  # "gpt_base (train.steps=200)": one of several gpt_base groups
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
    loaded = load_points(root)
    sweeps = sorted({str(r.point.get("sweep")) for r in loaded if on_sweep_axis(r.point)})
    if sweeps:
        raise ConfigError(
            f"{root} holds runs of the sweep(s) {', '.join(sweeps)}: tabulate a sweep with "
            f"--sweep (python -m oelm_core report {root} --sweep --name NAME), or point "
            f"the ablation table at a folder of ablation runs only (e.g. runs/ablations)"
        )
    runs = [run_row(run, spectrum) for run in loaded]
    rows = []
    for at in sorted(_ablation_groups(loaded, runs), key=lambda at: _order(runs[at[0]]["label"])):
        group = [runs[i] for i in at]
        assumed_settings(group[0]["label"], [loaded[i] for i in at])
        losses = [r["final_val_loss"] for r in group]
        loss, loss_std = mean_std(losses)
        seeds = evaluated_seeds(group[0]["label"], [str(r["path"]) for r in group], losses)
        rows.append(
            {
                "label": group[0]["label"],
                "variant": group[0]["variant"],
                "seeds": seeds,
                "val_loss": loss,
                "val_loss_std": loss_std,
                "val_ppl": mean_std(r["final_val_ppl"] for r in group)[0],
                "trainable": group[0]["trainable"],
                "frozen": group[0]["frozen"],
                "tokens_per_s": mean_std(r["tokens_per_s"] for r in group)[0],
                "spectrum_err": mean_std(r["spectrum_err"] for r in group)[0],
            }
        )
    runs.sort(key=lambda r: (_order(r["label"]), r["seed"] or 0))
    base = next((r for r in rows if r["label"] == baseline), None)
    for r in rows:
        ok = base is not None and r["val_loss"] is not None and base["val_loss"]
        r["loss_gap_pct"] = 100 * (r["val_loss"] / base["val_loss"] - 1) if ok else None
    run_cols = [
        "label",
        "variant",
        "seed",
        "status",
        "final_val_loss",
        "final_val_ppl",
        "trainable",
        "frozen",
        "tokens_per_s",
        "spectrum_err",
    ]
    cols = [
        "label",
        "seeds",
        "val_loss",
        "val_loss_std",
        "val_ppl",
        "loss_gap_pct",
        "trainable",
        "frozen",
        "tokens_per_s",
        "spectrum_err",
    ]
    heads = [
        "Ablation",
        "Seeds",
        "Val loss",
        "Std",
        "Val PPL",
        f"Loss gap vs {baseline} (%)",
        "Trainable",
        "Frozen",
        "Tokens/s",
        "POET max abs(s-1)",
    ]
    return {
        "runs": runs,
        "rows": rows,
        "markdown_runs": markdown_table(runs, run_cols),
        "markdown": markdown_table(rows, cols, heads),
    }


def ablation_figure(table: dict, path: str | Path | None = None):
    """Final validation loss per ablation: a short thick line at the seed mean, dots at each seed,
    and GPT-Base's mean across the panel. Lines, not bars: the axis is cut to the losses' range,
    where bars' heights would overstate the differences."""
    plt = pyplot()
    rows = [r for r in table["rows"] if r["val_loss"] is not None]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(rows) + 2), 4))
    xs = range(len(rows))
    colors = [
        "tab:gray"
        if r["label"] == BASELINE
        else "tab:purple"
        if r["label"].startswith("synth")
        else "tab:green"
        if "poet" in r["label"]
        else "tab:blue"
        for r in rows
    ]
    for x, r, color in zip(xs, rows, colors):
        ax.plot([x - 0.3, x + 0.3], [r["val_loss"]] * 2, color=color, lw=3, solid_capstyle="butt")
        seeds = [s["final_val_loss"] for s in table["runs"] if s["label"] == r["label"] and s["final_val_loss"]]
        ax.scatter([x] * len(seeds), seeds, color="black", s=12, zorder=3)
    base = next((r["val_loss"] for r in rows if r["label"] == BASELINE), None)
    if base is not None:
        ax.axhline(base, color="tab:gray", lw=0.8, ls="--", zorder=0)
    lo = min(r["val_loss"] for r in rows) if rows else 0
    hi = max(r["val_loss"] for r in rows) if rows else 1
    ax.set_ylim(lo - 0.15 * (hi - lo + 1e-3) - 0.05, hi + 0.15 * (hi - lo + 1e-3) + 0.05)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([r["label"] for r in rows], rotation=45, ha="right")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title("Ablations (lines: mean over seeds; dots: seeds; dashed: GPT-Base's mean)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return save_figure(fig, path)


# An ablation's comparator: OELM-Freeze, which each ablation changes in one respect (its variant, or
# an unfreeze schedule), and GPT-Base. Each ablation is set against both.
ABLATION_COMPARATORS = ("oelm_freeze", BASELINE)
# What an ablation may change of OELM-Freeze beyond the variant: progressive's unfreeze schedule.
ABLATION_SETTINGS = ("train.unfreeze_schedule",)


def ablation_gaps(
    root: str | Path, comparators: str | Path, which: str = "best", compare_across: Sequence[str] = ()
) -> dict:
    """Each ablation under ``root`` against the comparator runs under ``comparators`` (a study's
    run folders: its OELM-Freeze and GPT-Base groups): {"rows", "markdown", "comparators"}.

    A row per group of seeds (ablations, then the comparators): {label, source, seeds, val_loss,
    val_loss_std, val_ppl, val_ppl_std} (``which`` validation figures; sample std, n - 1) and,
    per comparator c of ABLATION_COMPARATORS, c_gap_pct, c_welch_low/high_pct,
    c_boot_low/high_pct, c_hedges_g (analysis.ppl_gap: the geometric-mean PPL gap, 95% Welch and
    bootstrap intervals). A gap is left out (None) unless the two groups were trained alike apart
    from the variant and ABLATION_SETTINGS, and for GPT-Base also ``compare_across`` (e.g.
    TUNED_SETTINGS: GPT-Base at its own tuned setting). Where the study holds a variant at several
    settings (the protocol's both dropouts), the ablations meet the group they were trained alike
    with at their own dropout, and only it is shown. ConfigError where no group, or several, of a
    comparator remain.
    """
    ablations = load_points(root)
    others = load_runs(comparators)
    runs = ablations + others
    check_figures(runs, which)
    labels = [r.point.get("label") or r.name for r in ablations] + [r.variant for r in others]
    groups = [
        Group(
            label, runs[at[0]].variant, runs[at[0]].preset, settings, [runs[i] for i in at], [runs[i].seed for i in at]
        )
        for label, settings, at in seed_groups(runs, labels)
    ]
    sources = ["comparator" if g.runs[0] in others else "ablation" for g in groups]
    ablated = [g for g, src in zip(groups, sources) if src == "ablation"]
    dropouts = {a.settings.get(DROPOUT) for a in ablated}
    bases = {}
    for variant in ABLATION_COMPARATORS:
        across = ABLATION_SETTINGS + (tuple(compare_across) if variant == BASELINE else ())
        found = [g for g, src in zip(groups, sources) if src == "comparator" and g.variant == variant]
        if len(found) > 1:
            # A study holding a group at several settings (the protocol's: each group at both
            # dropouts): the one every ablation was trained alike with, at their dropout where
            # several were (equal footing).
            found = [g for g in found if all(variant_alone(a, g, across) for a in ablated)]
            found = [g for g in found if g.settings.get(DROPOUT) in dropouts] if len(found) > 1 else found
        if len(found) != 1:
            raise ConfigError(
                f"{comparators} holds {len(found)} groups of {variant} that the ablations could be compared with "
                f"(trained alike apart from {', '.join(across)}, at the ablations' dropout where several are); "
                f"they need exactly one: pass a folder of one study's runs"
            )
        bases[variant] = found[0]
    shown = [(g, src) for g, src in zip(groups, sources) if src == "ablation" or g is bases.get(g.variant)]
    for variant in {g.variant for g, src in zip(groups, sources) if src == "comparator"} - set(bases):
        found = [g for g, src in zip(groups, sources) if src == "comparator" and g.variant == variant]
        at_theirs = [g for g in found if g.settings.get(DROPOUT) in dropouts]
        shown += [(g, "comparator") for g in (at_theirs if len(found) > 1 and at_theirs else found)]
    rows = []
    for g, src in sorted(shown, key=lambda gs: (gs[1] == "comparator", _order(gs[0].label))):
        row = {"label": g.label, "source": src, **_figures(g, which)}
        for variant, base in bases.items():
            across = ABLATION_SETTINGS + (tuple(compare_across) if variant == BASELINE else ())
            alike = g is not base and variant_alone(g, base, across)
            res = (
                ppl_gap(
                    [r.value(f"{which}_val_loss") for r in g.runs], [r.value(f"{which}_val_loss") for r in base.runs]
                )
                if alike
                else {}
            )
            row.update(gap_fields(res, f"{variant}_"))
        rows.append(row)
    cols = ["label", "source", "seeds", "val_loss", "val_loss_std", "val_ppl", "val_ppl_std"]
    heads = [
        "Ablation",
        "Runs",
        "Seeds",
        f"{which.capitalize()} val loss (mean)",
        "Loss std (n-1)",
        "Val PPL (mean)",
        "PPL std (n-1)",
    ]
    for variant in bases:
        name = GROUP_LABELS[variant]
        cols += [
            f"{variant}_gap_pct",
            f"{variant}_welch_low_pct",
            f"{variant}_welch_high_pct",
            f"{variant}_boot_low_pct",
            f"{variant}_boot_high_pct",
        ]
        heads += [
            f"PPL gap vs {name} (%)",
            "Welch 95% low",
            "Welch 95% high",
            "Bootstrap 95% low",
            "Bootstrap 95% high",
        ]
        same_cols, same_heads = equivalence_columns(f"{variant}_")
        cols += same_cols
        heads += [f"vs {name}: {h}" for h in same_heads]
    return {
        "rows": rows,
        "markdown": markdown_table(rows, cols, heads),
        "comparators": str(comparators),
        "which": which,
        "compare_across": list(compare_across),
    }


def _figures(group, which: str) -> dict:
    """gaps.group_figures' means and sample stds, its seeds counted by evaluated_seeds (which
    names the runs that ended before an evaluation)."""
    figures = {k: v for k, v in group_figures(group, which).items() if k not in ("model", "preset", "shape")}
    losses = [r.value(f"{which}_val_loss") for r in group.runs]
    return {**figures, "seeds": evaluated_seeds(group.label, [str(r.path) for r in group.runs], losses)}


def ablation_gaps_figure(table: dict, path: str | Path | None = None):
    """``ablation_gaps``' PPL gaps as horizontal bars, one panel per comparator: a bar at each
    group's gap (%), the 95% Welch interval as a black error bar, the 95% bootstrap interval as
    a thick orange line, the equivalence test's margin as a green band; groups without a gap to
    that comparator are left out of its panel."""
    plt = pyplot()
    variants = [v for v in ABLATION_COMPARATORS if any(r.get(f"{v}_gap_pct") is not None for r in table["rows"])]
    panels = max(1, len(variants))
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 0.5 * len(table["rows"]) + 2), squeeze=False)
    for ax, variant in zip(axes[0], variants):
        rows = [r for r in table["rows"] if r.get(f"{variant}_gap_pct") is not None]
        ys = list(range(len(rows)))[::-1]
        gaps = [r[f"{variant}_gap_pct"] for r in rows]
        ax.barh(ys, gaps, color=["tab:gray" if r["source"] == "comparator" else "tab:blue" for r in rows], alpha=0.6)
        welch = [
            (g - (r[f"{variant}_welch_low_pct"] or g), (r[f"{variant}_welch_high_pct"] or g) - g)
            for g, r in zip(gaps, rows)
        ]
        ax.errorbar(
            gaps,
            ys,
            xerr=list(zip(*welch)) if welch else None,
            fmt="none",
            ecolor="black",
            capsize=4,
            label="95% Welch interval",
        )
        for y, r in zip(ys, rows):
            if r[f"{variant}_boot_low_pct"] is not None:
                ax.plot(
                    [r[f"{variant}_boot_low_pct"], r[f"{variant}_boot_high_pct"]],
                    [y, y],
                    color="tab:orange",
                    lw=4,
                    alpha=0.8,
                    solid_capstyle="butt",
                    label="95% bootstrap interval" if y == ys[0] else None,
                )
        ax.axvspan(
            100 * (1 / (1 + EQUIVALENCE_MARGIN) - 1),
            100 * EQUIVALENCE_MARGIN,
            color="tab:green",
            alpha=0.12,
            label=f"TOST margin (±{100 * EQUIVALENCE_MARGIN:g}% of PPL)",
        )
        ax.axvline(0, color="black", lw=0.8)
        ax.set_yticks(ys)
        ax.set_yticklabels([f"{r['label']} (n={r['seeds']})" for r in rows])
        ax.set_xlabel(f"{table['which']} validation PPL gap vs {GROUP_LABELS[variant]} (%)")
        ax.set_title(f"vs {GROUP_LABELS[variant]}")
        ax.grid(axis="x", alpha=0.3)
    from matplotlib.patches import Patch

    handles = [
        Patch(color="tab:blue", alpha=0.6, label="ablation: gap = exp(mean loss difference) - 1"),
        Patch(color="tab:gray", alpha=0.6, label="comparator group (the study's runs)"),
        *axes[0][0].get_legend_handles_labels()[0],
    ]
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.legend(handles=handles, loc="lower center", ncol=2, fontsize=8)
    return save_figure(fig, path)


def write_ablation_gaps(table: dict, out: str | Path) -> list[Path]:
    """``ablation_gaps``' table into ``out``: ablations.md, ablations.json, ablations.png."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    across = f", GPT-Base at its own {', '.join(table['compare_across'])}" if table["compare_across"] else ""
    note = (
        f"Ablations against the comparator runs under {table['comparators']} ({table['which']} validation "
        f"figures; means and sample std, n-1, over seeds). PPL gap: exp(mean loss A - mean loss B) - 1, the "
        f"gap of the geometric-mean PPLs; both 95% intervals are of the loss difference mapped through "
        f"exp(.) - 1 (Welch's t; percentile bootstrap, 9,999 resamples). A gap is shown only between groups "
        f"trained alike apart from the variant and the unfreeze schedule{across}."
    )
    md, js, png = out / "ablations.md", out / "ablations.json", out / "ablations.png"
    md.write_text(f"## Ablations\n\n{note}\n\n{table['markdown']}\n")
    js.write_text(json.dumps({k: v for k, v in table.items() if k != "markdown"}, indent=2) + "\n")
    ablation_gaps_figure(table, png)
    return [md, js, png]


def write_ablation_table(
    table: dict, root: str | Path, figure: str | Path | None = None, markdown: str | Path | None = None
) -> list[Path]:
    """``ablation_table``'s table written: the markdown (default ROOT/ablations.md), ROOT/ablations.json
    and the figure (default ROOT/ablations.png); returns the three paths."""
    root = Path(root)
    md = Path(markdown) if markdown else root / "ablations.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("## Per ablation\n\n" + table["markdown"] + "\n\n## Per run\n\n" + table["markdown_runs"] + "\n")
    js = root / "ablations.json"
    js.write_text(json.dumps({"rows": table["rows"], "runs": table["runs"]}, indent=2) + "\n")
    png = Path(figure) if figure else root / "ablations.png"
    ablation_figure(table, png)
    return [md, js, png]
