"""The local scheduler: a plan's trainings in this process or its children, side by side on the GPUs.

With gpus_per_run = g > 0 and enough GPUs, trainings run side by side, run k on GPUs
[k*g, (k+1)*g) of those this process sees (numbered as torch numbers them: under
CUDA_VISIBLE_DEVICES=2,3, GPU 0 is the machine's GPU 2), and runs_per_gpu of them on each set
at once; with g = 0 one after another on the CPU.
Each training runs as the plan's runner says: ``notebook`` (papermill executes 03_training per
run, which launches it; the executed copy stays in the run folder), ``subprocess`` (the launcher
alone) or ``inprocess`` (``oelm_core.train.train`` here: no start-up per run).
"""

from __future__ import annotations

import math
import os
import queue
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from oelm_core.analysis.runs import FINISHED
from oelm_core.config import ConfigError, run_config_from_dict
from oelm_core.notebooks import execute_notebook
from oelm_core.runner.launch import launch_training
from oelm_core.runner.plan import TRAININGS, Plan, PlannedRun
from oelm_core.runner.scheduler import ExperimentError, Scheduler, ended, row, run_status, write_run_files


def gpu_count() -> int:
    """The CUDA GPUs this process sees (0 without CUDA or torch's CUDA)."""
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def gpu_slots(n_gpu: int, gpus_per_run: int, runs_per_gpu: int, n_runs: int) -> list[str]:
    """The GPU sets (CUDA_VISIBLE_DEVICES strings, as this process numbers its GPUs) trainings run
    on side by side: the n_gpu // gpus_per_run disjoint sets, each ``runs_per_gpu`` times, the sets
    first (a second training joins a GPU only once every GPU has one); no more than ``n_runs``."""
    sets = [",".join(str(k * gpus_per_run + i) for i in range(gpus_per_run)) for k in range(n_gpu // gpus_per_run)]
    return (sets * runs_per_gpu)[:n_runs]


def threads_per_run(side_by_side: int) -> int | None:
    """OMP_NUM_THREADS for each of ``side_by_side`` trainings at once: the cores this process may
    use, shared out (one at least). None, torch's own choice, for one training at a time or where
    OMP_NUM_THREADS is set already (the caller's choice is kept). Each torch otherwise starts a
    thread per core, so k trainings side by side run k threads on every core: their CPU start-up
    slows down, the OELM groups' most (their float64 QR of Q/K; the start-up figures are in
    docs/experiments.md)."""
    if side_by_side <= 1 or os.environ.get("OMP_NUM_THREADS"):
        return None
    from oelm_core.occupancy import cores  # imported late: reading a plan needs no torch

    return max(1, len(cores()) // side_by_side)


class LocalScheduler(Scheduler):
    """Trainings on this machine (see the module's docstring). ``budget_s`` > 0: no run starts
    after that many seconds (the rest are "not started"; the same call again continues with them)."""

    def __init__(self, budget_s: float = 0.0):
        super().__init__()
        if not (isinstance(budget_s, (int, float)) and math.isfinite(budget_s) and budget_s >= 0):
            raise ConfigError(
                f"--budget-s must be a number of seconds after which no training starts, "
                f"or 0 for no budget; got {budget_s!r}"
            )
        self.budget_s = float(budget_s)

    def check(self, plan: Plan) -> None:
        g = plan.gpus_per_run
        if g and plan.runner != "inprocess" and gpu_count() < g:
            raise ExperimentError(
                f"{plan.section}.gpus_per_run={g}, but this machine has {gpu_count()} GPU(s); "
                f"set --set {plan.section}.gpus_per_run=0 for CPU or fewer GPUs per run"
            )

    def slots(self, plan: Plan, log: Callable[[str], None]) -> list[str | None]:
        """The GPU sets trainings run on side by side: indices as this process numbers its GPUs
        (launch_training maps them to the machine's); [None] for one training at a time."""
        g = plan.gpus_per_run
        if g == 0 or plan.runner == "inprocess":
            log(
                f"{plan.tag} {len(plan.runs)} training(s) one after another"
                + (" on CPU" if g == 0 else f", {plan.runner}")
            )
            return [None]
        n_gpu = gpu_count()
        slots = gpu_slots(n_gpu, g, plan.runs_per_gpu, len(plan.runs))
        share = f", {plan.runs_per_gpu} to a GPU" if plan.runs_per_gpu > 1 else ""
        log(f"{plan.tag} {len(plan.runs)} training(s) on {n_gpu} GPU(s), {g} each{share}, {len(slots)} side by side")
        return slots

    def train_runs(self, plan: Plan, *, skip_done: bool, log: Callable[[str], None]) -> list[dict]:
        slots = self.slots(plan, log)
        threads = threads_per_run(len(slots))
        if threads:
            log(f"{plan.tag} {threads} CPU thread(s) to a training (OMP_NUM_THREADS; set it to choose)")
        free: queue.Queue = queue.Queue()
        for s in slots:
            free.put(s)
        t0 = time.perf_counter()

        def one(i: int, run: PlannedRun) -> dict:
            done = ended(plan, run, log) if skip_done else None
            if done is not None:
                return done
            gpus = free.get()
            try:
                elapsed = time.perf_counter() - t0
                if self.budget_s and elapsed > self.budget_s:
                    return row(run)
                log(
                    f"{plan.tag} training {i + 1}/{len(plan.runs)}, {elapsed:.0f}s: {run.name} ({run.variant}, "
                    f"seed {run.seed})" + (f" on GPUs {gpus}" if gpus is not None else "")
                )
                write_run_files(run)
                try:
                    status = train_one(plan, run, gpus, log, threads) or "failed"
                    error = None if status != "failed" else f"no summary.json in {run.run_dir}"
                except Exception as exc:  # one failed run must not lose the others
                    status, error = "failed", f"{type(exc).__name__}: {exc}"
                result = row(run, status, wall_s=time.perf_counter() - t0 - elapsed)
                if error:
                    result["error"] = error
                    log(f"{plan.tag} FAILED {run.name}: {error}")
                else:
                    # The process's whole time, start-up and export included: beside summary.json's
                    # wall_time_s (the training loop's) it tells what sharing a GPU costs outside it.
                    log(f"{plan.tag} {run.name}: {status} after {result['wall_s']:.0f}s")
                    if status in FINISHED and not plan.keep_checkpoints:
                        shutil.rmtree(run.run_dir / "ckpt", ignore_errors=True)  # best.pt stays
                return result
            finally:
                free.put(gpus)

        if len(slots) == 1:
            rows = [one(i, run) for i, run in enumerate(plan.runs)]
        else:
            with ThreadPoolExecutor(len(slots)) as pool:
                rows = list(pool.map(one, range(len(plan.runs)), plan.runs))
        left = sum(r["status"] == "not started" for r in rows)
        if left:
            log(
                f"{plan.tag} time budget of {self.budget_s:.0f}s used: {left} run(s) not started (run the same "
                f"command again to continue)"
            )
        log(
            f"{plan.tag} {sum(r['status'] in FINISHED + ('skipped',) for r in rows)}/{len(rows)} run(s) done "
            f"in {time.perf_counter() - t0:.0f}s"
        )
        return rows


def train_one(
    plan: Plan, run: PlannedRun, gpus: str | None, log: Callable[[str], None], threads: int | None = None
) -> str | None:
    """Train one run with the plan's runner, resuming from its newest checkpoint; returns the
    trainer's final status (None: no summary.json). ``threads``: the training's OMP_NUM_THREADS
    (threads_per_run; None: the environment's)."""
    params_file = run.run_dir / "params.yaml"
    launch = dict(plan.parameters.get(TRAININGS) or {})
    nproc = max(1, plan.gpus_per_run) if gpus is not None else int(launch.get("nproc", 1))
    devices = gpus if gpus is not None else launch.get("cuda_visible_devices", "")
    prefix = f"  [{run.name}] "
    if plan.runner == "inprocess":
        from oelm_core.train import train  # imported late: reading a plan needs no trainer

        return train(run_config_from_dict(run.config), resume=True).get("status")
    if plan.runner == "subprocess":
        launch_training(
            params_file,
            nproc=nproc,
            cuda_visible_devices=devices,
            run_dir=run.run_dir,
            resume=True,
            progress=launch.get("progress_bar"),
            threads=threads,
            echo=lambda line: log(prefix + line),
        )
    else:
        execute_notebook(
            TRAININGS,
            run.run_dir / f"{TRAININGS}.ipynb",
            {
                "resume": True,
                **launch,
                "params": str(params_file.resolve()),
                "overrides": [],
                "run_dir": str(run.run_dir.resolve()),
                "nproc": nproc,
                "cuda_visible_devices": devices,
                "cpu_threads": threads,
            },
            prefix=prefix,
            echo=log,
        )
    return run_status(run.run_dir).get("status")
