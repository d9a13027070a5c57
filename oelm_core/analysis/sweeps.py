"""A plan's run folders read back with their place in the plan, and a sweep's table and figure.

The runner (oelm_core.runner) writes ``sweep_point.json`` beside each run it trains: the plan's
name, its sweep axis (key, value), the variant, the seed, the label (the variant entry's or the
run's name) and whether it was a --smoke run. ``run_rows`` reads run folders back as rows;
``sweep_results`` and ``sweep_figure`` give a sweep's final validation loss per (value, variant).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Optional, Sequence

from oelm_core.analysis.figures import pyplot, save_figure
from oelm_core.analysis.markdown import markdown_table
from oelm_core.analysis.runs import Run, find_run_dirs, load_run
from oelm_core.analysis.stats import mean_std
from oelm_core.config import ConfigError
from oelm_core.groups import GROUP_LABELS

POINT_FILE = "sweep_point.json"


def load_points(root: str | Path) -> list[Run]:
    """Every run folder under ``root`` (analysis.Run), its sweep_point.json as ``run.point`` ({}
    for a run without one: the committed results/ablations' older runs, which their folder names)."""
    runs = []
    for d in find_run_dirs(root):
        run = load_run(d)
        point = d / POINT_FILE
        run.point = json.loads(point.read_text()) if point.is_file() else {}
        runs.append(run)
    return runs


def poet_spectrum_error(run: Run) -> Optional[float]:
    """max |sigma/gain - 1| of the trained POET Q/K in the run's best checkpoint (None: not POET,
    or no readable best.pt: one broken file must not cost the table of every other run)."""
    cfg = run.config.get("model") or {}
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


def run_row(run: Run, spectrum: bool = True) -> dict:
    """One run (as ``load_points`` reads it) as a row: label, variant, seed, point, final/best val
    figures, parameter counts, throughput and (POET, where ``spectrum``) the spectrum error."""
    p = run.point
    return {
        "label": p.get("label") or run.name,
        "variant": run.variant,
        "seed": run.seed,
        "key": p.get("key"),
        "value": p.get("value"),
        "sweep": p.get("sweep"),
        "smoke": bool(p.get("smoke")),
        "status": run.summary.get("status"),
        "steps": run.value("steps"),
        "final_val_loss": run.value("final_val_loss"),
        "final_val_ppl": run.value("final_val_ppl"),
        "best_val_loss": run.value("best_val_loss"),
        "trainable": run.value("trainable"),
        "frozen": run.value("frozen"),
        "total": run.value("total"),
        "tokens_per_s": run.value("tokens_per_s"),
        "wall_time_s": run.value("wall_time_s"),
        "spectrum_err": poet_spectrum_error(run) if spectrum else None,
        "path": str(run.path),
    }


def on_sweep_axis(point: dict) -> bool:
    """Whether a run's sweep_point.json (or row) places it on a sweep axis: an ablation's names
    none (results/ablations' progressive runs name the axis "ablation", their label its value)."""
    return point.get("key") not in (None, "ablation")


def run_rows(root: str | Path, spectrum: bool = True) -> list[dict]:
    """One row per run folder under ``root`` (``run_row``)."""
    return [run_row(run, spectrum) for run in load_points(root)]


def _group(rows: list[dict], keys: Sequence[str]) -> dict[tuple, list[dict]]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault(tuple(r.get(k) for k in keys), []).append(r)
    return groups


def sweep_results(root: str | Path, sweep_name: Optional[str] = None, smoke: Optional[bool] = None) -> dict:
    """Per (value, variant): mean/std final val loss over seeds, from the run folders under root.

    ``sweep_name``: the sweep to read; None, the one sweep root holds (ConfigError where it holds
    several: their points are not one curve). ``smoke``: True, the smoke runs only; False, the
    full runs only; None, whichever kind root holds (ConfigError where it holds both, so a table
    never mixes them).
    """
    runs = [
        r
        for r in run_rows(root, spectrum=False)
        if on_sweep_axis(r) and (sweep_name is None or r["sweep"] == sweep_name)
    ]
    names = sorted({str(r["sweep"]) for r in runs})
    if sweep_name is None and len(names) > 1:
        raise ConfigError(
            f"{root} holds the sweeps {', '.join(names)}; name one: "
            f"sweep_results(root, sweep_name) (CLI: report {root} --sweep --name NAME)"
        )
    if smoke is None and len({r["smoke"] for r in runs}) > 1:
        raise ConfigError(
            f"{root} holds both smoke and full runs{f' of {sweep_name}' if sweep_name else ''}; "
            f"pass smoke=True or smoke=False (CLI: report {root} --sweep --smoke or --full)"
        )
    runs = [r for r in runs if smoke is None or r["smoke"] == smoke]
    rows = []
    for (sweep, key, value, variant), group in _group(runs, ["sweep", "key", "value", "variant"]).items():
        loss, loss_std = mean_std(r["final_val_loss"] for r in group)
        rows.append(
            {
                "sweep": sweep,
                "key": key,
                "value": value,
                "variant": variant,
                "seeds": len(group),
                "val_loss": loss,
                "val_loss_std": loss_std,
                "val_ppl": mean_std(r["final_val_ppl"] for r in group)[0],
                "trainable": group[0]["trainable"],
                "frozen": group[0]["frozen"],
            }
        )
    variant_order = {v: i for i, v in enumerate(GROUP_LABELS)}
    rows.sort(key=lambda r: (r["sweep"] or "", _sortable(r["value"]), variant_order.get(r["variant"], 9), r["variant"]))
    cols = ["sweep", "key", "value", "variant", "seeds", "val_loss", "val_loss_std", "val_ppl", "trainable", "frozen"]
    return {"runs": runs, "rows": rows, "markdown": markdown_table(rows, cols)}


def _sortable(v):
    return (0, float(v), "") if isinstance(v, (int, float)) else (1, 0.0, str(v))


def sweep_figure(results: dict, path: str | Path | None = None, title: Optional[str] = None):
    """Final validation loss against the swept value, one line per variant (error bars: seed std)."""
    plt = pyplot()
    rows = [r for r in results["rows"] if r["val_loss"] is not None]
    fig, ax = plt.subplots(figsize=(6, 4))
    values = sorted({r["value"] for r in rows}, key=_sortable)
    numeric = values and all(isinstance(v, (int, float)) and v > 0 for v in values)
    pos = {v: (v if numeric else i) for i, v in enumerate(values)}
    for variant in dict.fromkeys(r["variant"] for r in rows):
        vr = sorted((r for r in rows if r["variant"] == variant), key=lambda r: _sortable(r["value"]))
        ax.errorbar(
            [pos[r["value"]] for r in vr],
            [r["val_loss"] for r in vr],
            yerr=[r["val_loss_std"] or 0 for r in vr],
            marker="o",
            capsize=3,
            label=GROUP_LABELS.get(variant, variant),
        )
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
