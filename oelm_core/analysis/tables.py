"""The study's results: one row per group of seeds, and Welch tests between groups.

Each row and each test compares groups that differ in the variant alone (``variant_alone``):
a gap to a baseline trained with another learning rate would measure the learning rate too,
unless the study compares groups each at its own tuned settings (``compare_across``).
"""

from __future__ import annotations

from typing import Iterable, Sequence

from oelm_core.analysis.groups import (
    BASELINE,
    GROUP_LABELS,
    assumed_settings,
    evaluated_seeds,
    group_runs,
    variant_alone,
)
from oelm_core.analysis.markdown import markdown_table
from oelm_core.analysis.runs import Run, check_figures
from oelm_core.analysis.stats import mean_std, significance
from oelm_core.analysis.timing import alone_record
from oelm_core.config import ConfigError

# (row key, column header) of the results table; {baseline}: the label of results_table's baseline.
RESULT_COLUMNS = [
    ("model", "Model"),
    ("shape", "Preset"),
    ("seeds", "Seeds"),
    ("val_loss", "Val loss"),
    ("val_ppl", "Val PPL"),
    ("val_ppl_std", "PPL std"),
    ("val_bpb", "Bits/byte"),
    ("train_loss", "Train loss"),
    ("total_params", "Total params"),
    ("trainable_params", "Trainable params"),
    ("checkpoint_mb", "Checkpoint (MB)"),
    ("tokens_per_s", "Tokens/s"),
    ("loss_gap_pct", "Loss gap vs {baseline} (%)"),
    ("ppl_gap_pct", "PPL gap vs {baseline} (%)"),
    ("ppl_per_m_trainable", "PPL per M trainable"),
]


def results_table(
    runs: Sequence[Run], which: str = "final", baseline: str = BASELINE, compare_across: Iterable[str] = ()
) -> dict:
    """The study's results table: one row per group of seeds (group_runs), averaged over them.

    ``which``: "final", "best" or "report" validation figures (runs.WHICH). Gaps are relative to the group of the
    ``baseline`` variant of the same preset, in %; where the preset has several, to the one
    trained with the row's settings apart from the variant and ``compare_across`` (none: no
    gap). The gap columns are headed with the baseline's label. Returns {"rows": [...],
    "markdown": str}.
    """
    from oelm_core import VARIANTS

    check_figures(runs, which)
    compare_across = tuple(compare_across)
    if baseline not in VARIANTS:
        raise ConfigError(f"baseline={baseline!r} is not a variant; pass one of {', '.join(VARIANTS)}")
    groups = group_runs(runs)
    rows = []
    for group in groups:
        assumed_settings(group.label, group.runs)
        ppls = [r.value(f"{which}_val_ppl") for r in group.runs]
        ppl_mean, ppl_std = mean_std(ppls)
        rows.append(
            {
                "variant": group.variant,
                "model": group.label,
                "preset": group.preset,
                "shape": group.shape,
                "seeds": evaluated_seeds(group.label, [r.name for r in group.runs], ppls),
                "val_loss": group.mean(f"{which}_val_loss"),
                "val_ppl": ppl_mean,
                "val_ppl_std": ppl_std,
                "val_bpb": group.mean(f"{which}_val_bpb"),
                "train_loss": group.mean("final_train_loss"),
                "total_params": group.runs[0].value("total"),
                "trainable_params": group.runs[0].value("trainable"),
                "checkpoint_mb": group.mean("checkpoint_mb"),
                # a share of a device that others used too measures the neighbours as much as the model
                "tokens_per_s": None if alone_record(group.runs)["alone"] is False else group.mean("tokens_per_s"),
            }
        )
    for group, row in zip(groups, rows):
        bases = [(g, r) for g, r in zip(groups, rows) if g.variant == baseline and g.preset == group.preset]
        base = (
            bases[0][1]
            if len(bases) == 1
            else next((r for g, r in bases if variant_alone(g, group, compare_across)), None)
        )
        for key, gap in (("val_loss", "loss_gap_pct"), ("val_ppl", "ppl_gap_pct")):
            ok = base is not None and row[key] is not None and base[key]
            row[gap] = 100 * (row[key] / base[key] - 1) if ok else None
        t = row["trainable_params"]
        row["ppl_per_m_trainable"] = row["val_ppl"] / (t / 1e6) if row["val_ppl"] and t else None
    label = GROUP_LABELS.get(baseline, baseline)
    cols = [c for c, _ in RESULT_COLUMNS]
    heads = [h.format(baseline=label) for _, h in RESULT_COLUMNS]
    return {"rows": rows, "markdown": markdown_table(rows, cols, heads)}


def significance_tests(
    runs: Sequence[Run],
    metric: str = "final_val_ppl",
    pairs: Sequence[tuple[str, str]] = (
        ("oelm_freeze", "gpt_base"),
        ("oelm_freeze", "oelm_nofreeze"),
        ("oelm_nofreeze", "gpt_base"),
    ),
    compare_across: Iterable[str] = (),
) -> list[dict]:
    """Welch tests (``significance``) of ``metric`` between the groups of each pair of variants
    that were trained with the same settings apart from the variant (``variant_alone``, with
    ``compare_across``); t, p and d need at least two seeds on each side. Rows: {a, b, preset,
    metric, n_a, n_b, mean_a, mean_b, t, p, df, cohen_d}."""
    compare_across = tuple(compare_across)
    groups = group_runs(runs)
    out = []
    for preset in dict.fromkeys(g.preset for g in groups):
        for va, vb in pairs:
            for ga in (g for g in groups if (g.variant, g.preset) == (va, preset)):
                for gb in (
                    g for g in groups if (g.variant, g.preset) == (vb, preset) and variant_alone(ga, g, compare_across)
                ):
                    res = significance([r.value(metric) for r in ga.runs], [r.value(metric) for r in gb.runs])
                    out.append({"a": ga.label, "b": gb.label, "preset": preset, "metric": metric, **res})
    return out
