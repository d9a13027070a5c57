"""``python -m oelm_core.sweep run|ablations|table|gaps``: the older names of ``run`` and ``report``.

sweep run FILE --out ROOT [--smoke]   = run FILE --out ROOT/<name>[_smoke], then report it --sweep
sweep ablations --out OUT             = run parameters/ablations.yaml --out OUT, then report OUT
sweep table ROOT [--sweep ...]        = report ROOT [--sweep ...]
sweep gaps ROOT --comparators RUNS    = report ROOT --comparators RUNS
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from oelm_core.__main__ import report
from oelm_core.analysis.ablations import ablation_table, write_ablation_table
from oelm_core.analysis.sweeps import sweep_figure, sweep_results
from oelm_core.config import ConfigError
from oelm_core.runner import RUNNERS, load_plan, run_trainings

NEW = {
    "run": "python -m oelm_core run FILE, then python -m oelm_core report OUT --sweep",
    "ablations": "python -m oelm_core run parameters/ablations.yaml, then python -m oelm_core report OUT",
    "table": "python -m oelm_core report",
    "gaps": "python -m oelm_core report ROOT --comparators RUNS",
}


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in NEW:
        print(f"python -m oelm_core.sweep {argv[0]} is now {NEW[argv[0]]}", file=sys.stderr, flush=True)
    if argv and argv[0] in ("table", "gaps"):
        return report(argv[1:], prog=f"python -m oelm_core.sweep {argv[0]}")
    p = argparse.ArgumentParser(prog="python -m oelm_core.sweep", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train every point of a sweep file, then tabulate and plot it")
    r.add_argument("sweep_file")
    r.add_argument("--out", default="runs/sweeps", help="the folder of the sweep's folder (default: runs/sweeps)")
    r.add_argument("--smoke", action="store_true")
    r.add_argument("--runner", choices=RUNNERS, default="inprocess")
    r.add_argument("--variants", nargs="+", metavar="VARIANT")
    r.add_argument("--seeds", nargs="+", type=int, metavar="SEED")
    r.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE")
    a = sub.add_parser("ablations", help="train every ablation x seed, then tabulate")
    a.add_argument("--plan", default="parameters/ablations.yaml")
    a.add_argument("--out", default="runs/ablations")
    a.add_argument("--seeds", nargs="+", type=int, metavar="SEED")
    a.add_argument("--only", nargs="+")
    a.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE")
    a.add_argument("--runner", choices=RUNNERS)
    a.add_argument("--budget-s", type=float, default=0.0)
    a.add_argument("--keep-checkpoints", action="store_true")
    sub.add_parser("table")
    sub.add_parser("gaps")
    args = p.parse_args(argv)
    try:
        if args.cmd == "run":
            plan = load_plan(
                args.sweep_file,
                out_root=args.out,
                smoke=args.smoke,
                runner=args.runner,
                variants=args.variants,
                seeds=args.seeds,
                overrides=args.set,
            )
            rows = run_trainings(plan, log=print)
            res = sweep_results(plan.out, plan.name, smoke=args.smoke)
            print(res["markdown"])
            sweep_figure(res, plan.out / "sweep.png")
        else:
            plan = load_plan(
                args.plan, args.out, seeds=args.seeds, only=args.only, overrides=args.set, runner=args.runner
            )
            plan.keep_checkpoints = plan.keep_checkpoints or args.keep_checkpoints
            rows = run_trainings(plan, budget_s=args.budget_s, log=print)
            print("wrote " + ", ".join(map(str, write_ablation_table(ablation_table(args.out), args.out))))
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 1 if any(r["status"] == "failed" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
