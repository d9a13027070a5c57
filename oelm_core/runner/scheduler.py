"""Where a plan's trainings run: the scheduler interface, and the run-folder steps every scheduler shares.

Two schedulers implement ``Scheduler``: ``LocalScheduler`` (runner/local.py: in this process or
its children, side by side on this machine's GPUs) and ``SlurmScheduler`` (runner/slurm.py: each
training a batch job). Each has

    check(plan)               before any step of the plan: ConfigError where it cannot run it here
    train_runs(plan, ...)     every run that is left to train; one row per run

and ``train`` runs the steps they share around ``train_runs``: the plan's folder held against a
second runner and, once per plan (``ready``), ``check``, each run folder checked against the run
planned there, the data prepared.
Each run folder then holds the trainer's files, ``params.yaml`` (exactly what it trained) and
``sweep_point.json`` (its place in the plan); a run whose summary.json says it ended is skipped.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Callable, Iterator

import yaml

from oelm_core.analysis.runs import FINISHED
from oelm_core.config import ConfigError, run_config_from_dict
from oelm_core.files import LockHeld, exclusive_lock, write_text_atomic
from oelm_core.notebooks import say
from oelm_core.parameter_files import read_yaml
from oelm_core.run_settings import trained_settings
from oelm_core.runner.plan import Plan, PlannedRun

# How the data is reached, for a message about data that could not be read or prepared.
DATA_WAYS = (
    "the stories come from the Hugging Face hub when online (data.source roneneldan/TinyStories, "
    "with pip install 'oelm-core[data]'), or offline from a local folder: set OELM_DATA to a folder of "
    "TinyStories files (train/ and validation/) and TIKTOKEN_CACHE_DIR to the GPT-2 BPE files "
    "(docs/data.md)"
)


class ExperimentError(RuntimeError):
    """Trainings that did not finish, or a plan this machine cannot run (the message says which)."""


def run_status(run_dir: Path) -> dict:
    """run_dir/summary.json ({} where there is no readable one)."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return summary if isinstance(summary, dict) else {}


def check_run_folder(run: PlannedRun) -> None:
    """Raise ConfigError when run.run_dir already holds a run trained with other settings: skipping
    or resuming it would report that run as the planned one. Settings the trainer resumes
    across (run_settings.EXECUTION_KEYS) may differ: the folder still holds the planned run."""
    saved_file = run.run_dir / "config.yaml"  # the trainer's own record of what it trained
    if not saved_file.is_file():
        return
    fix = f"train into another folder (--out), or delete {run.run_dir} to train it again"
    try:
        saved = trained_settings(read_yaml(saved_file))
    except ConfigError as exc:
        raise ConfigError(f"{run.run_dir} holds a run whose config.yaml cannot be read ({exc}); {fix}") from None
    planned = trained_settings(run.config)
    changed = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in planned.items() if saved.get(k) != v]
    if changed:
        raise ConfigError(
            f"{run.run_dir} holds a run trained with other settings than planned ({'; '.join(changed)}); {fix}"
        )


def prepare_data(plan: Plan, log: Callable[[str], None]) -> None:
    """Tokenise each distinct data set of the plan once, before runs that may start side by side
    (and, where the plan's analysis draws samples, load the tokenizer). ConfigError, saying how
    data is reached, where it cannot be."""
    from oelm_core.data import get_tokenizer, prepare

    prepared = set()
    try:
        if "04_analysis" in plan.notebooks:
            get_tokenizer()
        for run in plan.runs:
            cfg = run_config_from_dict(run.config).data
            key = (
                cfg.source,
                cfg.out_dir,
                cfg.max_train_stories,
                cfg.max_val_stories,
                cfg.text_field,
                os.environ.get("OELM_DATA"),
            )
            if key not in prepared:
                log(f"{plan.tag} preparing data {cfg.out_dir} (source {os.environ.get('OELM_DATA') or cfg.source})")
                prepare(cfg, progress=False)
                prepared.add(key)
    except ConfigError as exc:
        raise ConfigError(f"{exc}\n  The plan's data: {DATA_WAYS}") from None


def write_run_files(run: PlannedRun) -> None:
    """params.yaml (what the run trains) and sweep_point.json (its place in the plan)."""
    run.run_dir.mkdir(parents=True, exist_ok=True)
    from oelm_core.data import with_real_source  # the folder OELM_DATA names, not the file's hub id

    write_text_atomic(run.run_dir / "params.yaml", yaml.safe_dump(with_real_source(run.config), sort_keys=False))
    write_text_atomic(run.run_dir / "sweep_point.json", json.dumps(run.info, indent=2) + "\n")


def row(run: PlannedRun, status: str = "not started", **extra) -> dict:
    """One row of a scheduler's answer: the run's sweep_point.json items, status, wall_s, out_dir."""
    return {**run.info, "status": status, "wall_s": 0.0, "out_dir": str(run.run_dir), **extra}


def ended(plan: Plan, run: PlannedRun, log: Callable[[str], None]) -> dict | None:
    """The "skipped" row of a run whose summary.json says it ended (logged), else None."""
    summary = run_status(run.run_dir)
    if summary.get("status") not in FINISHED:
        return None
    log(
        f"{plan.tag} {run.name} already ended ({summary['status']} at step {summary.get('steps')}): "
        f"nothing to train; {run.run_dir}"
    )
    return row(run, "skipped")


_held: dict[Path, int] = {}


@contextmanager
def hold_plan_folder(plan: Plan) -> Iterator[None]:
    """Hold plan.out for this process (an exclusive lock on OUT/.lock, which holds its pid; held
    again in this process, it just nests): a second runner started into the same folder is
    refused before anything runs, instead of training beside the first and meeting its per-run
    locks. The kernel drops the lock of a process that dies."""
    out = plan.out.resolve()
    if out in _held:
        _held[out] += 1
        try:
            yield
        finally:
            _held[out] -= 1
        return
    with ExitStack() as stack:
        try:
            out.mkdir(parents=True, exist_ok=True)
            stack.enter_context(exclusive_lock(out / ".lock"))
        except LockHeld as exc:
            raise ConfigError(
                f"another process is writing here (pid {exc.holder}): {out} is the folder of a plan "
                f"that process runs; wait for it to end, or run this plan into another "
                f"folder (--out)"
            ) from None
        except OSError as exc:
            raise ConfigError(
                f"cannot write to the plan's folder {out} ({exc.strerror}); choose another folder (--out)"
            ) from None
        _held[out] = 1
        try:
            yield
        finally:
            del _held[out]


class Scheduler(ABC):
    """Where a plan's trainings run (see the module's docstring)."""

    def __init__(self) -> None:
        self._ready: set[int] = set()  # the plans checked and prepared (their id)

    def check(self, plan: Plan) -> None:
        """ConfigError, before any step of ``plan`` runs, where this scheduler cannot run it here."""

    def ready(self, plan: Plan, log: Callable[[str], None] = say) -> None:
        """Once per plan, before its first step: ``check``, every run folder checked against the
        run planned there (``check_run_folder``), the data prepared (``prepare_data``)."""
        if id(plan) in self._ready:
            return
        self.check(plan)
        for run in plan.runs:
            check_run_folder(run)
        prepare_data(plan, log)
        self._ready.add(id(plan))

    def train(self, plan: Plan, *, skip_done: bool = True, log: Callable[[str], None] = say) -> list[dict]:
        """Train every run of ``plan``; one row per run (``row``: its sweep_point.json items and
        status, wall_s, out_dir, and error for a failed one). A run that fails is recorded and
        the others go on. ``skip_done``: a run whose summary.json says it ended is skipped.
        ConfigError, before any run, for a run folder that holds a run trained with other settings."""
        with hold_plan_folder(plan):
            self.ready(plan, log)
            return self.train_runs(plan, skip_done=skip_done, log=log)

    @abstractmethod
    def train_runs(self, plan: Plan, *, skip_done: bool, log: Callable[[str], None]) -> list[dict]:
        """Train the runs (the plan ``ready``); one row per run."""
