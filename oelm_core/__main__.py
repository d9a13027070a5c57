"""The one command: ``python -m oelm_core train | run | report | tune | export``.

    python -m oelm_core train --params parameters/smoke/oelm_freeze.yaml     # one training (oelm_core.train)
    python -m oelm_core run parameters/study_smoke.yaml                      # a plan (oelm_core.runner)
    python -m oelm_core report runs/ablations                                # the tables of a plan's runs
    python -m oelm_core tune runs/tune_medium512                             # each group's setting (oelm_core.tuning)
    python -m oelm_core export runs/.../ --out exported/                     # weights that travel (oelm_core.export)

Each subcommand takes the options of the module it runs (``python -m oelm_core SUBCOMMAND -h``).
``report`` is this module's own: the ablation table of a folder of a plan's runs, a sweep's table
and figure (--sweep), each ablation's gaps to a study's runs (--comparators), or the scaling curve
of one study per model shape (--scaling).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

COMMANDS = {
    "train": "one training run (also under torchrun: torchrun ... -m oelm_core.train)",
    "run": "a plan: a study, a sweep or the ablations, its trainings and notebooks",
    "report": "the tables and figures of a folder of a plan's runs",
    "tune": "each group's best setting from a tuning sweep, and the study written at it",
    "export": "a run's weights as safetensors and/or a transformers GPT-2",
}


def report(argv: Optional[list[str]] = None, prog: str = "python -m oelm_core report") -> int:
    """``report DIR``: the ablation table (ablations.md, .json, .png); ``--sweep``: a sweep's table
    (and figure); ``--comparators RUNS``: each ablation's PPL gap to a study's runs, with 95%
    intervals; ``--scaling DIR...``: the gaps to GPT-Base of one study per shape (scaling.md,
    .json, .png). 0 written, 2 unusable input."""
    from oelm_core.analysis.ablations import ablation_gaps, ablation_table, write_ablation_gaps, write_ablation_table
    from oelm_core.analysis.groups import TUNED_SETTINGS
    from oelm_core.analysis.runs import WHICH, find_run_dirs
    from oelm_core.analysis.scaling import write_scaling
    from oelm_core.analysis.sweeps import sweep_figure, sweep_results
    from oelm_core.config import ConfigError

    p = argparse.ArgumentParser(prog=prog, description=COMMANDS["report"])
    p.add_argument(
        "root",
        nargs="+",
        help="a folder of a plan's run folders, e.g. runs/ablations, runs/sweeps/a6_layers (--scaling: one study "
        "folder per model shape)",
    )
    p.add_argument(
        "--figure",
        help="where to write the figure (default: ROOT/ablations.png for the ablation table; none for --sweep)",
    )
    p.add_argument(
        "--markdown",
        help="where to write the markdown table (default: ROOT/ablations.md for the "
        "ablation table; none for --sweep, which prints it)",
    )
    sweep = p.add_argument_group("a sweep")
    sweep.add_argument("--sweep", action="store_true", help="the runs of a sweep: loss against the swept value")
    sweep.add_argument("--name", help="the sweep to tabulate (needed where ROOT holds several)")
    kind = sweep.add_mutually_exclusive_group()
    kind.add_argument(
        "--smoke",
        dest="smoke",
        action="store_const",
        const=True,
        help="the smoke runs only (needed where ROOT holds both kinds)",
    )
    kind.add_argument("--full", dest="smoke", action="store_const", const=False, help="the full runs only")
    gaps = p.add_argument_group("gaps to a study's runs")
    gaps.add_argument(
        "--comparators",
        help="folder of the comparator runs (OELM-Freeze and GPT-Base), e.g. results/tuned_medium512/runs",
    )
    gaps.add_argument("--which", choices=WHICH, help="validation figures (default: best; --scaling: report)")
    gaps.add_argument(
        "--tuned",
        action="store_true",
        help=f"GPT-Base at its own tuned setting: {', '.join(TUNED_SETTINGS)} may differ from the ablations'",
    )
    gaps.add_argument("--out", help="where to write ablations.md, .json, .png (default: ROOT; --scaling: needed)")
    scaling = p.add_argument_group("the scaling curve (--which applies; --tuned is implied)")
    scaling.add_argument("--scaling", action="store_true", help="the gaps to GPT-Base of each ROOT, one per shape")
    footing = scaling.add_mutually_exclusive_group()
    footing.add_argument("--dropout", type=float, help="only the runs at this dropout (all groups alike)")
    footing.add_argument(
        "--own-best", action="store_true", help="each group at the dropout its shape's tuning chose (results.json)"
    )
    args = p.parse_args(argv)
    try:
        for root in args.root:
            if not Path(root).is_dir() or not find_run_dirs(root):
                raise ConfigError(
                    f"{root} holds no run folders (summary.json or metrics.jsonl); pass the folder of a "
                    f"plan's runs, e.g. runs/ablations or runs/sweeps/a6_layers"
                )
        if args.scaling:
            if not args.out:
                raise ConfigError("--scaling writes scaling.md, .json and .png into --out DIR: name it")
            which = args.which or "report"  # a study's reported figures: the held-out half
            paths = write_scaling(args.root, args.out, which, dropout=args.dropout, own_best=args.own_best)
            print(paths[0].read_text())
            print("wrote " + ", ".join(map(str, paths)))
            return 0
        if len(args.root) > 1 or args.dropout is not None or args.own_best:
            raise ConfigError("several folders, --dropout and --own-best go with --scaling only")
        args.root, args.which = args.root[0], args.which or "best"
        if args.comparators:
            table = ablation_gaps(args.root, args.comparators, args.which, TUNED_SETTINGS if args.tuned else ())
            print(table["markdown"])
            print("wrote " + ", ".join(map(str, write_ablation_gaps(table, args.out or args.root))))
        elif args.sweep:
            res = sweep_results(args.root, args.name, smoke=args.smoke)
            print(res["markdown"])
            if args.figure:
                sweep_figure(res, args.figure)
            if args.markdown:
                Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
                Path(args.markdown).write_text(res["markdown"] + "\n")
        else:
            table = ablation_table(args.root)
            print("\nPer run:\n" + table["markdown_runs"] + "\n\nPer ablation (mean over seeds):\n" + table["markdown"])
            print("\nwrote " + ", ".join(map(str, write_ablation_table(table, args.root, args.figure, args.markdown))))
    except (ConfigError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(
        prog="python -m oelm_core",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(f"  {name:8}{what}" for name, what in COMMANDS.items()),
    )
    p.add_argument("command", choices=COMMANDS, help="what to do; its options: python -m oelm_core COMMAND -h")
    if not argv or argv[0] not in COMMANDS:
        p.parse_args(argv[:1])  # -h, or an unknown command: argparse's message and exit
    command, rest = argv[0], argv[1:]
    prog = f"python -m oelm_core {command}"
    if command == "train":
        from oelm_core.train import main as train

        return train(rest)
    if command == "export":
        from oelm_core.export import main as export

        return export(rest)
    if command == "run":
        from oelm_core.runner.cli import main as run

        return run(rest, prog=prog)
    if command == "tune":
        from oelm_core.tuning import main as tune

        return tune(rest, prog=prog)
    return report(rest, prog=prog)


if __name__ == "__main__":
    sys.exit(main())
