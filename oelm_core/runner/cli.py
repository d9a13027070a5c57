"""``python -m oelm_core run PLAN``: a plan's trainings and notebooks, headless."""

from __future__ import annotations

import argparse
import sys

from oelm_core.config import ConfigError
from oelm_core.notebooks import say
from oelm_core.runner.plan import LAUNCHERS, RUNNERS, load_plan
from oelm_core.runner.run import run_plan


def main(argv: list[str] | None = None, prog: str = "python -m oelm_core run") -> int:
    """The CLI; returns the exit code: 0 done, 1 a notebook or training failed, 2 unusable input
    (plan file, --set, parameter file, data, scheduler), as for python -m oelm_core.train."""
    p = argparse.ArgumentParser(
        prog=prog, description="Run a plan (a study, a sweep, the ablations): its trainings and notebooks, headless."
    )
    p.add_argument(
        "plan",
        help="a plan file, e.g. parameters/study_smoke.yaml, parameters/ablations.yaml or "
        "parameters/sweeps/a6_layers.yaml",
    )
    p.add_argument("--out", help="the plan's folder (default: its experiment.out, else runs/<name>)")
    p.add_argument(
        "--set",
        dest="sets",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="experiment.KEY=VALUE changes the plan (experiment.seeds=[1,2]); anything else goes "
        "to every run (train.steps=20)",
    )
    p.add_argument("--smoke", action="store_true", help="the plan's smoke points and settings")
    p.add_argument("--only", nargs="+", metavar="NAME", help="the variants (or runs) to train (default: all)")
    p.add_argument("--runner", choices=RUNNERS, help="how each training runs (default: the plan's)")
    p.add_argument(
        "--budget-s", type=float, default=0.0, help="start no training after this many seconds (default 0: no budget)"
    )
    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        help="where the trainings run: local (default) or slurm, a batch job each (docs/cluster.md)",
    )
    p.add_argument("--gpus-per-run", type=int, help="GPUs per training (default: the plan's gpus_per_run)")
    cluster = p.add_argument_group("SLURM jobs (--launcher slurm; default: the plan's slurm section)")
    cluster.add_argument("--partition")
    cluster.add_argument("--time", help="each job's time limit, e.g. 4:00:00")
    cluster.add_argument("--account")
    cluster.add_argument("--nodes", type=int, help="nodes per training (gpus-per-run GPUs on each)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each finished run's ckpt/ folder")
    args = p.parse_args(argv)
    tag = f"[{prog.split()[-1].split('.')[-1]}]"
    try:
        cluster = {
            k: getattr(args, k) for k in ("partition", "time", "account", "nodes") if getattr(args, k) is not None
        }
        plan = load_plan(
            args.plan,
            args.out,
            args.sets,
            smoke=args.smoke,
            only=args.only,
            runner=args.runner,
            launcher=args.launcher,
            cluster=cluster,
            gpus_per_run=args.gpus_per_run,
        )
        plan.keep_checkpoints = plan.keep_checkpoints or args.keep_checkpoints
        say(f"{plan.tag} {len(plan.runs)} run(s), steps {', '.join(plan.notebooks)} -> {plan.out}")
        run_plan(plan, budget_s=args.budget_s)
    except (ConfigError, RuntimeError) as e:  # a failed notebook or training: NotebookError, ExperimentError
        print(f"{tag} FAILED: {e}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, ConfigError) else 1
    return 0
