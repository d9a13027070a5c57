"""The whole study, headless: ``python -m oelm_core.study FILE`` runs a study file's plan.

    python -m oelm_core.study parameters/study_smoke.yaml [--out runs/<name>] [--set key=value ...]

A study file's ``study:`` section (runs, seeds, overrides, gpus_per_run, notebooks, parameters;
see parameters/study_smoke.yaml) is one of the plan sections that oelm_core.experiment reads and
runs: the notebooks 01-04 executed by papermill with injected parameters, one training per
(run, seed) in OUT/runs/<run>_s<seed>, side by side on the GPUs where gpus_per_run > 0, and
OUT/study.json, which the app reads. ``--set study.KEY=VALUE`` changes the study section; any
other ``--set`` is handed to every run (e.g. ``--set train.steps=20``). This module keeps the
older names of that runner's parts.
"""

from __future__ import annotations

import sys

from oelm_core.experiment import (ALL_NOTEBOOKS, ExperimentError, Plan, PlannedRun, check_notebook_parameters,
                                  child_visible_devices, execute_notebook, failed_cell, launch_training,
                                  load_plan, notebook_defaults, run_plan, train_command)
from oelm_core.experiment import main as _main

StudyError = ExperimentError
Study = Plan
load_study = load_plan
run_study = run_plan

__all__ = ["ALL_NOTEBOOKS", "PlannedRun", "Study", "StudyError", "check_notebook_parameters",
           "child_visible_devices", "execute_notebook", "failed_cell", "launch_training", "load_study",
           "notebook_defaults", "run_study", "train_command", "main"]


def main(argv: list[str] | None = None) -> int:
    """The CLI of oelm_core.experiment under its older name (messages tagged [study])."""
    return _main(argv, prog="python -m oelm_core.study")


if __name__ == "__main__":
    sys.exit(main())
