"""The runner: studies, sweeps and ablation sets are one kind of plan, run by one runner.

    python -m oelm_core run PLAN [--out DIR] [--set KEY=VALUE ...] [--smoke] [--only NAME ...]

One concept per module:

    plan        the plan file's schema (a dataclass per part) and its expansion into runs
    launch      one training in a child process (python -m oelm_core.train, or torchrun)
    scheduler   the scheduler interface, and the run-folder steps the schedulers share
    local       the local scheduler: this process or its children, side by side on the GPUs
    slurm       the SLURM scheduler: each training a batch job from a script in its run folder
    run         a plan's steps in order (trainings and notebooks), recorded in OUT/study.json
    cli         python -m oelm_core run

The notebooks' parameters and their execution by papermill are oelm_core.notebooks, which the
notebooks that launch nothing import without the runner. docs/experiments.md has the plan schema.
"""

from oelm_core.analysis.runs import FINISHED
from oelm_core.runner.launch import child_visible_devices, launch_training, train_command
from oelm_core.runner.local import LocalScheduler
from oelm_core.runner.plan import (
    LAUNCHERS,
    RUNNERS,
    STEPS,
    ExperimentSection,
    Plan,
    PlannedRun,
    SlurmSettings,
    load_plan,
)
from oelm_core.runner.run import run_plan, run_trainings, scheduler_for
from oelm_core.runner.scheduler import ExperimentError, Scheduler, check_run_folder
from oelm_core.runner.slurm import SlurmScheduler

__all__ = [
    "FINISHED",
    "LAUNCHERS",
    "RUNNERS",
    "STEPS",
    "ExperimentError",
    "ExperimentSection",
    "LocalScheduler",
    "Plan",
    "PlannedRun",
    "Scheduler",
    "SlurmScheduler",
    "SlurmSettings",
    "check_run_folder",
    "child_visible_devices",
    "launch_training",
    "load_plan",
    "run_plan",
    "run_trainings",
    "scheduler_for",
    "train_command",
]
