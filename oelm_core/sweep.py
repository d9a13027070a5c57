"""Sweeps (A3-A6: heads, head dimension, context, layers) and the ablations of parameters/ablations/.

A sweep file (``parameters/sweeps/*.yaml``) is a training parameter file plus a ``sweep`` section:

    sweep:
      name: a6_layers
      key: n_layer                     # the x axis
      variants: [gpt_base, oelm_nofreeze, oelm_freeze]
      seeds: [0]
      points:                          # value on the x axis -> dotted overrides of the run
        - {value: 2, set: {model.n_layer: 2}}
      smoke:                           # optional: points and overrides of a quick CPU run
        points: [...]
        set: {train.steps: 8, ...}

``seeds`` is a list of integers and ``variants`` a list of names from ``oelm_core.VARIANTS``,
even for one: ``seeds: [0]``, ``variants: [gpt_base]``.

Each (point, variant, seed) becomes one run folder ``out_root/<name>/<key>=<value>/<variant>/seed<S>``
(smoke runs: ``out_root/<name>_smoke/...``) holding the trainer's files plus ``params.yaml``
(exactly what was trained) and ``sweep_point.json`` (which point it is). Runs whose
``summary.json`` says they ended ("completed" or "stopped_early") are skipped and a run cut short
resumes from its newest checkpoint, so an interrupted sweep continues where it stopped. A folder
whose ``config.yaml`` was trained with other settings is refused (ConfigError), never skipped.

Ablations: every ``parameters/ablations/*.yaml`` x seeds, into ``out_root/<file stem>/seed<S>``;
``ablation_table`` / ``ablation_figure`` read them back (through ``oelm_core.analysis``).

CLI:
    python -m oelm_core.sweep run parameters/sweeps/a6_layers.yaml --out runs/sweeps [--smoke]
    python -m oelm_core.sweep ablations --out runs/ablations [--seeds 0 1] [--only oelm_poet]
    python -m oelm_core.sweep table runs/ablations [--figure F.png] [--markdown T.md]
    python -m oelm_core.sweep table runs/sweeps --sweep [--name a6_layers] [--smoke | --full] [--figure F.png]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml

from oelm_core.analysis import (BASELINE, GROUP_LABELS, assumed_settings, evaluated_seeds, seed_groups,
                                settings_apart)
from oelm_core.config import (ConfigError, apply_overrides, read_yaml, run_config_from_dict, trained_settings,
                              variants as known_variants)
from oelm_core.files import write_text_atomic

REPO = Path(__file__).resolve().parents[1]
RUNNERS = ("inprocess", "subprocess", "notebook")


# --------------------------------------------------------------------------------------------
# Sweep files
# --------------------------------------------------------------------------------------------

@dataclass
class Sweep:
    name: str
    key: str
    variants: list[str]
    seeds: list[int]
    points: list[dict]               # [{"value": v, "set": {dotted key: value}}]
    base: dict                       # the training parameter file without the sweep section
    smoke: dict = field(default_factory=dict)


@dataclass
class RunSpec:
    """One run of a sweep or of the ablations: its parameters and where it goes."""

    out_dir: Path
    params: dict
    info: dict                       # sweep, key, value, variant, seed, label


SWEEP_KEYS = {"name", "key", "variants", "seeds", "points", "smoke"}
SMOKE_KEYS = {"points", "set"}
POINT_KEYS = {"value", "set"}


def _check_keys(values: dict, valid: set[str], where: str, path: Path) -> None:
    unknown = sorted(map(str, set(values) - valid))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(f'{where}.{k}' for k in unknown)}; valid keys "
                          f"of {where}: {', '.join(sorted(valid))}")


def _check_points(points: Any, where: str, path: Path) -> None:
    if not isinstance(points, list) or not points or not all(isinstance(p, dict) and "value" in p
                                                             for p in points):
        raise ConfigError(f"{path}: {where} must be a list of {{value: v, set: {{key: value}}}}")
    for i, point in enumerate(points):
        _check_keys(point, POINT_KEYS, f"{where}[{i}]", path)
        if not isinstance(point.get("set") or {}, dict):
            raise ConfigError(f"{path}: {where}[{i}].set must map dotted keys to values, e.g. "
                              f"{{model.n_layer: 2}}; got {point['set']!r}")


def _check_seeds(seeds: Any, path: Path) -> None:
    if not (isinstance(seeds, list) and seeds
            and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
        raise ConfigError(f"{path}: sweep.seeds must be a list of integers, e.g. [0] or [0, 1]; got {seeds!r}")


def _check_variants(names: Any, path: Path) -> None:
    known = sorted(known_variants())
    if not (isinstance(names, list) and names and all(isinstance(v, str) for v in names)):
        raise ConfigError(f"{path}: sweep.variants must be a list of variant names, e.g. [gpt_base] or "
                          f"[gpt_base, oelm_freeze]; got {names!r}")
    unknown = [v for v in names if v not in known]
    if unknown:
        raise ConfigError(f"{path}: sweep.variants has unknown variant(s) {unknown}; choose from {known}")


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file (every point of every variant is validated up front)."""
    path = Path(path)
    if not path.is_file() and (REPO / path).is_file():  # a path from the root, called elsewhere
        path = REPO / path
    if not path.is_file():
        raise ConfigError(f"sweep file {path} not found; see parameters/sweeps/ for examples")
    values = read_yaml(path)
    spec = values.pop("sweep", None)
    if not isinstance(spec, dict):
        raise ConfigError(f"{path} has no `sweep:` section; it needs name, key, variants, seeds, points")
    _check_keys(spec, SWEEP_KEYS, "sweep", path)
    missing = [k for k in ("key", "points") if k not in spec]
    if missing:
        raise ConfigError(f"{path}: sweep section lacks {missing}")
    points = spec["points"]
    _check_points(points, "sweep.points", path)
    smoke = spec.get("smoke") or {}
    if not isinstance(smoke, dict):
        raise ConfigError(f"{path}: sweep.smoke must be a mapping with points and set, got {smoke!r}")
    _check_keys(smoke, SMOKE_KEYS, "sweep.smoke", path)
    if smoke.get("points"):
        _check_points(smoke["points"], "sweep.smoke.points", path)
    if not isinstance(smoke.get("set") or {}, dict):
        raise ConfigError(f"{path}: sweep.smoke.set must map dotted keys to values, e.g. "
                          f"{{train.steps: 8}}; got {smoke['set']!r}")
    variants = spec.get("variants", list(GROUP_LABELS))
    _check_variants(variants, path)
    seeds = spec.get("seeds", [0])
    _check_seeds(seeds, path)
    sweep = Sweep(name=str(spec.get("name", path.stem)), key=str(spec["key"]), variants=list(variants),
                  seeds=list(seeds), points=list(points), base=values, smoke=dict(smoke))
    for smoke in (False, True):
        if smoke and not sweep.smoke:
            continue
        for run in sweep_runs(sweep, "/tmp/_sweep_check", smoke=smoke):
            run_config_from_dict(run.params)
    return sweep


def _fmt_value(v: Any) -> str:
    return str(v).replace("/", "_").replace(" ", "")


def sweep_dir(sweep: Sweep, out_root: str | Path, smoke: bool = False) -> Path:
    """The folder of a sweep's run folders; smoke runs get their own, so that a full sweep into
    the same out_root never finds (and skips) a smoke run where its own point belongs."""
    return Path(out_root) / (f"{sweep.name}_smoke" if smoke else sweep.name)


def sweep_runs(sweep: Sweep, out_root: str | Path, *, smoke: bool = False,
               variants: Sequence[str] | None = None, seeds: Sequence[int] | None = None,
               overrides: list[str] | dict | None = None) -> list[RunSpec]:
    """Every (point, variant, seed) of ``sweep`` as a RunSpec (points outermost). ``overrides``:
    applied to every run, as --set strings (train.steps=50) or {dotted key: value}."""
    smoke_spec = sweep.smoke if smoke else {}
    points = smoke_spec.get("points") or sweep.points
    if smoke and not sweep.smoke:
        points = sweep.points[:2]
    base = apply_overrides(sweep.base, smoke_spec.get("set"))
    root = sweep_dir(sweep, out_root, smoke)
    runs = []
    for point in points:
        for variant in variants or sweep.variants:
            for seed in seeds if seeds is not None else sweep.seeds:
                out = root / f"{sweep.key}={_fmt_value(point['value'])}" / variant / f"seed{seed}"
                params = apply_overrides(apply_overrides(base, point.get("set")), overrides)
                params.update(variant=variant, name=f"{root.name}/{sweep.key}={point['value']}/{variant}",
                              out_dir=str(out))
                params.setdefault("train", {})["seed"] = int(seed)
                info = {"sweep": sweep.name, "key": sweep.key, "value": point["value"], "variant": variant,
                        "seed": int(seed), "label": variant, "smoke": smoke}
                runs.append(RunSpec(out, params, info))
    return runs


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------

# The trainer's statuses of a run that has ended: nothing is left to train.
FINISHED = ("completed", "stopped_early")


def _status(out_dir: Path) -> Optional[str]:
    """The status in out_dir/summary.json (None: no readable summary)."""
    try:
        return json.loads((out_dir / "summary.json").read_text()).get("status")
    except (OSError, json.JSONDecodeError):
        return None


def _check_run_folder(run: RunSpec) -> None:
    """Raise ConfigError when run.out_dir already holds a run trained with other settings: skipping
    or resuming it would report that run as the planned one. Settings the trainer resumes
    across (config.EXECUTION_KEYS) may differ: the folder still holds the planned run."""
    saved_file = run.out_dir / "config.yaml"   # the trainer's own record of what it trained
    if not saved_file.is_file():
        return
    fix = f"train into another folder (--out / out_root), or delete {run.out_dir} to train it again"
    try:
        saved = trained_settings(read_yaml(saved_file))
    except ConfigError as exc:
        raise ConfigError(f"{run.out_dir} holds a run whose config.yaml cannot be read ({exc}); {fix}") from None
    planned = trained_settings(run.params)
    changed = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in planned.items() if saved.get(k) != v]
    if changed:
        raise ConfigError(f"{run.out_dir} holds a run trained with other settings than planned "
                          f"({'; '.join(changed)}); {fix}")


def _notebook_path() -> Path:
    return REPO / "notebooks" / "03_training.ipynb"


def run_one(run: RunSpec, runner: str = "inprocess", skip_done: bool = True, log=print) -> dict:
    """Train one RunSpec; returns {"status", "wall_s", "out_dir", **info} (never raises for a
    run that fails: the error is recorded, the sweep goes on)."""
    if runner not in RUNNERS:
        raise ConfigError(f"runner must be one of {RUNNERS}, got {runner!r}")
    _check_run_folder(run)
    out = run.out_dir
    if skip_done and _status(out) in FINISHED:
        log(f"  skip (finished): {out}")
        return {**run.info, "status": "skipped", "wall_s": 0.0, "out_dir": str(out)}
    out.mkdir(parents=True, exist_ok=True)
    params_file = out / "params.yaml"
    write_text_atomic(params_file, yaml.safe_dump(run.params, sort_keys=False))
    write_text_atomic(out / "sweep_point.json", json.dumps(run.info, indent=2) + "\n")
    t0 = time.perf_counter()
    status, error = "completed", None
    try:
        if runner == "inprocess":
            from oelm_core.train import train  # imported late: the CLI `table` needs no torch start

            # resume: a run cut short (killed, paused) continues from its newest checkpoint
            summary = train(run_config_from_dict(run.params), resume=True)
            status = summary.get("status", status)
        elif runner == "subprocess":
            with open(out / "train.log", "a") as logf:
                rc = subprocess.call([sys.executable, "-m", "oelm_core.train", "--params", str(params_file),
                                      "--resume"], stdout=logf, stderr=subprocess.STDOUT, cwd=os.getcwd())
            if rc != 0:
                status, error = "failed", f"exit code {rc}; see {out / 'train.log'}"
            else:
                status = _status(out) or status
        else:  # notebook: papermill runs notebooks/03_training.ipynb with the parameter file
            import papermill as pm

            nb = _notebook_path()
            if not nb.is_file():
                raise ConfigError(f"{nb} does not exist; use runner 'subprocess' or 'inprocess'")
            import torch

            # the first GPU this process sees (the notebook maps the index to the machine's number)
            gpu = "0" if torch.cuda.is_available() else ""
            pm.execute_notebook(str(nb), str(out / "03_training.ipynb"),
                                parameters={"params": str(params_file.resolve()), "run_dir": str(out.resolve()),
                                            "overrides": [], "nproc": 1, "resume": True,
                                            "cuda_visible_devices": gpu},
                                cwd=str(REPO), progress_bar=False)
            status = _status(out)
            if status is None:
                status, error = "failed", f"no summary.json; see {out / '03_training.ipynb'}"
    except Exception as exc:  # one failed point must not lose the rest of the sweep
        status, error = "failed", f"{type(exc).__name__}: {exc}"
    wall = time.perf_counter() - t0
    row = {**run.info, "status": status, "wall_s": wall, "out_dir": str(out)}
    if error:
        row["error"] = error
        log(f"  FAILED {out}: {error}")
    else:
        log(f"  done in {wall:.1f}s: {out}")
    return row


def run_sweep(sweep: str | Path | Sweep, out_root: str | Path = "runs/sweeps", *, smoke: bool = False,
              runner: str = "inprocess", variants: Sequence[str] | None = None,
              seeds: Sequence[int] | None = None, overrides: list[str] | dict | None = None,
              skip_done: bool = True, log=print) -> list[dict]:
    """Train every point of a sweep; returns one status row per run (see ``sweep_results``)."""
    if not isinstance(sweep, Sweep):
        sweep = load_sweep(sweep)
    runs = sweep_runs(sweep, out_root, smoke=smoke, variants=variants, seeds=seeds, overrides=overrides)
    for r in runs:   # fail before the first run, not at the last
        run_config_from_dict(r.params)
        _check_run_folder(r)
    rows = []
    for i, run in enumerate(runs):
        log(f"[{i + 1}/{len(runs)}] {sweep.key}={run.info['value']} {run.info['variant']} seed {run.info['seed']}")
        rows.append(run_one(run, runner, skip_done, log))
    return rows


def ablation_runs(params_dir: str | Path = "parameters/ablations", out_root: str | Path = "runs/ablations",
                  seeds: Sequence[int] = (0, 1), only: Sequence[str] | None = None,
                  overrides: list[str] | dict | None = None) -> list[RunSpec]:
    """Every ablation file x seed, seed-major (all files at seed 0 first)."""
    files = sorted(Path(params_dir).glob("*.yaml"))
    if only:
        unknown = set(only) - {f.stem for f in files}
        if unknown:
            raise ConfigError(f"no ablation file for {sorted(unknown)} in {params_dir}; "
                              f"have {[f.stem for f in files]}")
        files = [f for f in files if f.stem in only]
    if not files:
        raise ConfigError(f"no *.yaml ablation files in {params_dir}")
    runs = []
    for seed in seeds:
        for f in files:
            params = apply_overrides(read_yaml(f), overrides)
            out = Path(out_root) / f.stem / f"seed{seed}"
            params.update(name=f.stem, out_dir=str(out))
            params.setdefault("train", {})["seed"] = int(seed)
            info = {"sweep": "ablations", "key": "ablation", "value": f.stem,
                    "variant": run_config_from_dict(params).variant, "seed": int(seed), "label": f.stem}
            runs.append(RunSpec(out, params, info))
    return runs


def run_ablations(params_dir: str | Path = "parameters/ablations", out_root: str | Path = "runs/ablations",
                  seeds: Sequence[int] = (0, 1), only: Sequence[str] | None = None,
                  overrides: list[str] | dict | None = None, runner: str = "inprocess", skip_done: bool = True,
                  budget_s: float = 0.0, prune_checkpoints: bool = True, log=print) -> list[dict]:
    """Train every ablation x seed (seed-major, so a cut-short session still has one seed of each).

    ``budget_s`` > 0: start no new run once that many seconds have passed (the rest are listed as
    "not started"; re-running continues with them). ``prune_checkpoints``: delete each finished
    run's rolling ``ckpt/`` folder (its ``best.pt`` stays for analysis).
    """
    import shutil

    runs = ablation_runs(params_dir, out_root, seeds, only, overrides)
    for r in runs:   # fail before the first run, not at the last
        _check_run_folder(r)
    rows, t0 = [], time.perf_counter()
    for i, run in enumerate(runs):
        elapsed = time.perf_counter() - t0
        if budget_s and elapsed > budget_s:
            log(f"time budget of {budget_s:.0f}s used: {len(runs) - i} run(s) not started "
                f"(run the same command again to continue)")
            rows += [{**r.info, "status": "not started", "wall_s": 0.0, "out_dir": str(r.out_dir)} for r in runs[i:]]
            break
        log(f"[{i + 1}/{len(runs)}, {elapsed:.0f}s] {run.info['label']} seed {run.info['seed']}")
        row = run_one(run, runner, skip_done, log)
        if prune_checkpoints and row["status"] in FINISHED:
            shutil.rmtree(run.out_dir / "ckpt", ignore_errors=True)
        rows.append(row)
    log(f"ablations: {sum(r['status'] in FINISHED + ('skipped',) for r in rows)}/{len(runs)} runs done "
        f"in {time.perf_counter() - t0:.0f}s")
    return rows


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
    sweeps = sorted({str(r.point["sweep"]) for r in loaded if r.point.get("sweep") not in (None, "ablations")})
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


def sweep_results(root: str | Path, sweep_name: Optional[str] = None, smoke: Optional[bool] = None) -> dict:
    """Per (value, variant): mean/std final val loss over seeds, from the run folders under root.

    ``sweep_name``: the sweep to read; None, the one sweep root holds (ConfigError where it holds
    several: their points are not one curve). ``smoke``: True, the smoke runs only; False, the
    full runs only; None, whichever kind root holds (ConfigError where it holds both, so a table
    never mixes them).
    """
    from oelm_core.analysis import markdown_table, mean_std

    runs = [r for r in run_rows(root, spectrum=False) if r["key"] and r["sweep"] != "ablations"
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
    a = sub.add_parser("ablations", help="train every parameters/ablations file x seeds, then tabulate")
    a.add_argument("--params-dir", default="parameters/ablations",
                   help="folder of the ablations' parameter files, one run per *.yaml and seed "
                        "(default: parameters/ablations)")
    a.add_argument("--out", default="runs/ablations",
                   help="folder of the run folders, OUT/<file stem>/seed<S>, and of the table "
                        "(ablations.md, .json, .png) (default: runs/ablations)")
    a.add_argument("--seeds", nargs="+", type=int, default=[0, 1], metavar="SEED",
                   help="seeds to train each ablation with (default: 0 1)")
    a.add_argument("--only", nargs="+", help="file stems to run (default: all)")
    a.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override a parameter of every run, e.g. --set train.steps=200 train.lr=1e-3")
    a.add_argument("--runner", choices=RUNNERS, default="inprocess",
                   help="as for run: inprocess, subprocess or notebook (default: inprocess)")
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
    args = p.parse_args(argv)
    try:
        if args.cmd == "run":
            sweep = load_sweep(args.sweep_file)
            rows = run_sweep(sweep, args.out, smoke=args.smoke, runner=args.runner, variants=args.variants,
                             seeds=args.seeds, overrides=args.set)
            res = sweep_results(args.out, sweep.name, smoke=args.smoke)
            print(res["markdown"])
            sweep_figure(res, sweep_dir(sweep, args.out, args.smoke) / "sweep.png")
            return 1 if any(r["status"] == "failed" for r in rows) else 0
        if args.cmd == "ablations":
            rows = run_ablations(args.params_dir, args.out, args.seeds, args.only, args.set,
                                 args.runner, budget_s=args.budget_s, prune_checkpoints=not args.keep_checkpoints)
            table = ablation_table(args.out)
            _write_table(table, args.out, None, None)
            return 1 if any(r["status"] == "failed" for r in rows) else 0
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
