"""python -m app [--study runs/smoke | --ckpt gpt_base=PATH --ckpt ...] [--host H] [--port P] [--share]

Without --study or --ckpt the newest runs/*/study.json is used, one run (the lowest seed) per group.
With --train-mini (what `make demo` runs) the newest study whose models are trained is used; where
there is none and a GPU is, one seed of the mini study is trained first. On a CPU it says what that
study would cost here and how to bring one trained elsewhere, and serves the newest study meanwhile.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m app", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--ckpt",
        action="append",
        default=[],
        metavar="GROUP=PATH",
        help="a group's model (gpt_base, oelm_nofreeze, oelm_freeze): a checkpoint, a run folder, "
        "or an export folder (safetensors or transformers); repeat per group",
    )
    src.add_argument("--study", help="study folder (or its study.json): one run per group, lowest seed")
    p.add_argument("--runs-root", default="runs", help="where to look for the newest study (default: runs)")
    p.add_argument(
        "--train-mini",
        action="store_true",
        help="without --study/--ckpt: serve the newest trained study; with none and a GPU, "
        "train one seed of the mini study first (about two minutes)",
    )
    p.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:1 ...")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=7860, help="port to listen on (default: 7860; make demo PORT=...)")
    p.add_argument("--share", action="store_true", help="also open a public gradio.live link (off by default)")
    p.add_argument(
        "--concurrency",
        type=int,
        default=2,
        help="requests of one event (e.g. generation) served at once; the rest queue (default: 2)",
    )
    args = p.parse_args(argv)
    if args.concurrency < 1:  # Gradio takes 0 and serves nothing: the page would wait forever
        p.error(f"--concurrency must be at least 1 (requests served at once), got {args.concurrency}")
    return args


def main(argv=None) -> int:
    """Serve the demo; returns the exit code: 2 where the page cannot be built (e.g. offline
    without the GPT-2 tokenizer files), said in one line rather than a traceback. Checkpoints that
    do not load, or a --device this machine lacks, still serve a page that says what went wrong
    (in the column of each model that did not load, beside those that did)."""
    args = parse_args(argv)
    from app.demo import build_demo, launch, port_in_use, port_message
    from app.lab import SetupError, lab_from_args
    from oelm_core.config import ConfigError

    if port_in_use(args.host, args.port):  # before minutes of loading or training
        print(f"error: {port_message(args.host, args.port)}", file=sys.stderr)
        return 2
    if args.train_mini and not (args.study or args.ckpt):
        args.study, status = trained_or_mini_study(args.runs_root)
        if status:
            return status

    try:
        lab = lab_from_args(args.ckpt, args.study, args.runs_root, args.device)
        if lab.models:
            names = ", ".join(f"{m.group} <- {m.path}" for m in lab.models)
            print(f"oelm app: loaded {names} on {lab.device}", file=sys.stderr)
        if lab.errors:
            print(
                f"oelm app: {'these' if lab.models else 'the models'} could not be loaded; the page shows "
                f"why{' in their columns' if lab.models else ''}:",
                file=sys.stderr,
            )
            for e in lab.errors:
                print(f"  - {e}", file=sys.stderr)
        demo = build_demo(lab)
        launch(demo, host=args.host, port=args.port, share=args.share, concurrency=args.concurrency)
    except (ConfigError, SetupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def trained_or_mini_study(runs_root: str) -> tuple[str | None, int]:
    """(the study to serve, or None for the newest one; an exit status, 0 to go on): the newest
    trained study under ``runs_root``; where there is none, on a GPU, the mini study trained now
    (its runner shows the progress). On the CPU, where that study takes days, what it would
    take here and how to bring it (``demo.cpu_route``), then None: the newest study, with the
    page's notice; with no study at all, exit status 2 and how to make one."""
    import torch

    from app.lab import MINI_ARGS, MINI_STUDY, MINI_STUDY_OUT, cpu_route, mini_study_cost, trained_study

    study = trained_study(runs_root)
    if study is not None:
        return str(study.parent), 0
    if not torch.cuda.is_available():
        print(
            f"oelm app: no trained study under {runs_root}/ and no GPU here. {cpu_route(mini_study_cost())}",
            file=sys.stderr,
        )
        if not any(Path(runs_root).glob("*/study.json")):
            print(
                f"error: no study under {runs_root}/ to serve meanwhile: `make study` trains the smoke study "
                f"(several minutes on 2 cores; its models write gibberish, the page says so)",
                file=sys.stderr,
            )
            return None, 2
        print(
            "oelm app: serving the newest study meanwhile; its page says how barely its models are trained",
            file=sys.stderr,
        )
        return None, 0
    print(
        f"oelm app: no trained study under {runs_root}/: training one seed of the mini study on the GPU "
        f"first ({MINI_STUDY})",
        file=sys.stderr,
    )
    out = str(Path(runs_root) / Path(MINI_STUDY_OUT).name)
    status = subprocess.call([sys.executable, *MINI_ARGS, "--out", out])
    if status:
        print(f"error: the mini study failed (exit status {status}); its output above says why", file=sys.stderr)
    return out, status


if __name__ == "__main__":
    sys.exit(main())
