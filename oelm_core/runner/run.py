"""Running a plan: its steps in order, recorded in OUT/study.json.

``run_plan`` holds the plan's folder (a second runner into it is refused), asks the plan's
scheduler whether it can run it here and prepares the data, all before the first step; then each
step in turn: 03_training stands for the trainings (the scheduler's), any other step is its
notebook, executed by papermill into OUT/notebooks. A plan that executes notebooks records them
and its runs in OUT/study.json (what the demo app reads).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from oelm_core.config import ConfigError
from oelm_core.files import write_text_atomic
from oelm_core.notebooks import NotebookError, execute_notebook, say
from oelm_core.runner.local import LocalScheduler
from oelm_core.runner.plan import STEPS, TRAININGS, Plan
from oelm_core.runner.scheduler import ExperimentError, Scheduler, hold_plan_folder
from oelm_core.runner.slurm import SlurmScheduler


def scheduler_for(plan: Plan, budget_s: float = 0.0) -> Scheduler:
    """The scheduler of ``plan.launcher``: local (with a time budget, ``budget_s`` > 0) or slurm."""
    if plan.launcher == "slurm":
        if budget_s:
            raise ConfigError(
                "--budget-s starts no local training after that many seconds; under --launcher "
                "slurm each job has its own time limit: use --time instead"
            )
        return SlurmScheduler()
    return LocalScheduler(budget_s)


def run_trainings(
    plan: Plan, *, skip_done: bool = True, budget_s: float = 0.0, log: Callable[[str], None] = say
) -> list[dict]:
    """Every training of ``plan`` on its scheduler (``Scheduler.train``); one row per run."""
    return scheduler_for(plan, budget_s).train(plan, skip_done=skip_done, log=log)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _earlier_notebooks(plan: Plan) -> dict[str, dict]:
    """Name -> record of the notebooks an earlier call of this plan executed into plan.out, from
    its study.json: a partial re-run (notebooks=[03_training]) keeps their record, as their
    outputs stay in the folder."""
    try:
        old = json.loads((plan.out / "study.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(old, dict) or old.get("name") != plan.name:
        return {}
    records = {}
    for item in old.get("notebooks") or []:
        if isinstance(item, dict) and item.get("name") in STEPS:
            records[item["name"]] = item
        elif item in STEPS and old.get("status") == "completed":  # names only: an older study.json
            records[item] = {"name": item, "executed": old.get("created")}
    return records


def _write_record(plan: Plan, status: str, executed: dict[str, dict], created: str, error: str | None = None) -> dict:
    """study.json: this call's status, the record of every notebook executed into the folder
    (``executed``: name -> record, this call's and earlier ones), and the planned runs."""
    notebook = plan.runner == "notebook"
    data = {
        "name": plan.name,
        "created": created,
        "status": status,
        "study_file": str(plan.path),
        "notebooks": [executed[n] for n in STEPS if n in executed],
        "runs": [
            {
                "name": r.name,
                "variant": r.variant,
                "preset": r.preset,
                "seed": r.seed,
                "run_dir": str(r.run_dir.relative_to(plan.out)),
                **({"notebook": str((r.run_dir / f"{TRAININGS}.ipynb").relative_to(plan.out))} if notebook else {}),
            }
            for r in plan.runs
        ],
    }
    if error:
        data["error"] = error
    if plan.records:
        plan.out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(plan.out / "study.json", json.dumps(data, indent=2))
    return data


def run_plan(plan: Plan, *, skip_done: bool = True, budget_s: float = 0.0, log: Callable[[str], None] = say) -> dict:
    """Execute the plan's steps in order into plan.out (03_training: every training, on the
    plan's scheduler; the others: their notebook); returns study.json's content (written where
    the plan executes notebooks). Before the first step: the folder held, the scheduler checked,
    the data prepared. ExperimentError or NotebookError where a training or a notebook failed;
    ConfigError where the plan cannot run here."""
    scheduler = scheduler_for(plan, budget_s)
    with hold_plan_folder(plan):
        if TRAININGS in plan.notebooks:
            scheduler.ready(plan, log)
        created = _now()
        executed = _earlier_notebooks(plan)
        _write_record(plan, "running", executed, created)
        figures = (plan.out / "figures").resolve()
        try:
            for k, name in enumerate(plan.notebooks, 1):
                log(f"{plan.tag} step {k}/{len(plan.notebooks)}: {name}")
                if name == TRAININGS:
                    rows = scheduler.train(plan, skip_done=skip_done, log=log)
                    failed = [r for r in rows if r["status"] in ("failed", "not started")]
                    if failed:
                        raise ExperimentError(
                            f"{len(failed)} of {len(rows)} training(s) did not finish: "
                            + "; ".join(
                                f"{Path(r['out_dir']).name if plan.layout == 'study' else r['out_dir']}: "
                                f"{r.get('error', r['status'])}"
                                for r in failed
                            )
                        )
                else:
                    params = dict(plan.parameters.get(name) or {})
                    if name == "01_theory":
                        params.setdefault("fig_dir", str(figures))
                    if name == "04_analysis":
                        params.update(
                            run_dirs=[str(r.run_dir.resolve()) for r in plan.runs], out_dir=str(plan.out.resolve())
                        )
                        params.setdefault("fig_dir", str(figures))
                    execute_notebook(name, plan.out / "notebooks" / f"{name}.ipynb", params, prefix="  ", echo=log)
                output = f"runs/*/{TRAININGS}.ipynb" if name == TRAININGS else f"notebooks/{name}.ipynb"
                executed[name] = {
                    "name": name,
                    "executed": _now(),
                    **({"output": output} if name != TRAININGS or plan.runner == "notebook" else {}),
                }
                _write_record(plan, "running", executed, created)
        except (ExperimentError, NotebookError, ConfigError) as e:
            _write_record(plan, "failed", executed, created, error=str(e))
            raise
        data = _write_record(plan, "completed", executed, created)
    # results.md only where this call wrote it: an earlier call's would pass for this one's
    log(
        f"{plan.tag} done: {plan.out}"
        + ("/study.json" if plan.records else "")
        + (f", {plan.out}/results.md" if "04_analysis" in plan.notebooks else "")
    )
    return data
