"""python -m app [--study runs/smoke | --ckpt gpt_base=PATH --ckpt ...] [--host H] [--port P] [--share]

Without --study or --ckpt the newest runs/*/study.json is used, one run (the lowest seed) per group.
With --train-mini (what `make demo` runs) the newest study whose models are trained is used; where
there is none and a GPU is, one seed of the mini study is trained first.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m app", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--ckpt", action="append", default=[], metavar="GROUP=PATH",
                     help="a group's model (gpt_base, oelm_nofreeze, oelm_freeze): a checkpoint, a run folder, "
                          "or an export folder (safetensors or transformers); repeat per group")
    src.add_argument("--study", help="study folder (or its study.json): one run per group, lowest seed")
    p.add_argument("--runs-root", default="runs", help="where to look for the newest study (default: runs)")
    p.add_argument("--train-mini", action="store_true",
                   help="without --study/--ckpt: serve the newest trained study; with none and a GPU, "
                        "train one seed of the mini study first (about two minutes)")
    p.add_argument("--device", default="auto", help="auto (cuda when available, else cpu), cpu, cuda, cuda:1 ...")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=7860)
    p.add_argument("--share", action="store_true", help="also open a public gradio.live link (off by default)")
    p.add_argument("--concurrency", type=int, default=2,
                   help="requests of one event (e.g. generation) served at once; the rest queue (default: 2)")
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
    from app.demo import SetupError, build_demo, lab_from_args, launch
    from oelm_core.config import ConfigError

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
            print(f"oelm app: {'these' if lab.models else 'the models'} could not be loaded; the page shows "
                  f"why{' in their columns' if lab.models else ''}:", file=sys.stderr)
            for e in lab.errors:
                print(f"  - {e}", file=sys.stderr)
        demo = build_demo(lab)
    except (ConfigError, SetupError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    launch(demo, host=args.host, port=args.port, share=args.share, concurrency=args.concurrency)
    return 0


def trained_or_mini_study(runs_root: str) -> tuple[str | None, int]:
    """(the study to serve, or None for the newest one; an exit status, 0 to go on): the newest
    trained study under ``runs_root``; where there is none, on a GPU, the mini study trained now
    (its runner shows the progress); on the CPU None: the newest study, with the page's notice."""
    import torch

    from app.demo import MINI_ARGS, MINI_STUDY, MINI_STUDY_OUT, trained_study

    study = trained_study(runs_root)
    if study is not None:
        return str(study.parent), 0
    if not torch.cuda.is_available():
        print("oelm app: no trained study and no GPU: serving the newest study, whose page says how to "
              "train models worth comparing", file=sys.stderr)
        return None, 0
    print(f"oelm app: no trained study under {runs_root}/: training one seed of the mini study on the GPU "
          f"first ({MINI_STUDY})", file=sys.stderr)
    out = str(Path(runs_root) / Path(MINI_STUDY_OUT).name)
    status = subprocess.call([sys.executable, *MINI_ARGS, "--out", out])
    if status:
        print(f"error: the mini study failed (exit status {status}); its output above says why", file=sys.stderr)
    return out, status


if __name__ == "__main__":
    sys.exit(main())
