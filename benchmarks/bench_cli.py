"""The training CLI as a user runs it, against the nanoGPT-style reference, in one run on one card (issue 46).

    PYTHONPATH=. python benchmarks/bench_cli.py --batch 16 64 --json cli.json
    # a CPU smoke: the smoke shape, windows of 4 steps, no compilation
    PYTHONPATH=. python benchmarks/bench_cli.py --preset smoke --batch 2 --steps 24 --skip-compile \\
        --set train.log_every=4

bench_train.py times the trainer's step as the benchmark builds it; this times what a user gets.
For each --batch B it runs, in a subprocess from the repository root,

    python -m oelm_core.train --params PARAMS --set train.batch_size=B train.stop_after=N out_dir=RUN \\
        train.eval_every=N train.ckpt_every=N [--set ...]

with the CLI's defaults but for what a benchmark must set: where it stops (train.stop_after: the
run keeps its parameter file's length, which train.compile's default "auto" reads to decide
whether to compile, and pauses after N steps), a run folder of its own (removed afterwards unless
--runs-dir), and evaluations and checkpoints only at the last step, where the loop writes one of
each whatever the settings (no switch turns them off). Then the same with train.compile=true.
A run's figure is the median ``tokens_per_s`` of the log windows in its metrics.jsonl after the
first --warmup-windows: the loop logs step 1 and every train.log_every steps, and a window is the
wall clock from one logged step to the next, the data loading, logging and live curves in it,
evaluations and checkpoints not. The first window is step 1 alone (compilation); the second holds
the CUDA graph's capture (after 2 eager steps). summary.json's tokens_per_s is the median of all
windows; the JSON keeps every window.

The reference is bench_train.py's ``reference`` group, timed by its ``bench_one`` in this
process: benchmarks/reference.py (one fused QKV Linear, SDPA, all logits and F.cross_entropy,
the vocabulary padded to 50,304 rows as nanoGPT pads it) in the trainer's plain step (fused
AdamW, clip, bf16 autocast on CUDA), eager and torch.compile'd without a CUDA graph, on random
batches already in pinned memory, timed with CUDA events (the wall clock on a CPU): the step
alone, no data loading or logging, which if anything favours the reference. It is timed in as many
blocks of as many steps as the CLI's timed log windows, after one block of warm-up, so that both
run about as long: a card under load for seconds may clock lower than in a short burst. Its shape
is the run's preset's (GPT-Base), whatever the parameter file's variant or model keys.

For each batch the runs alternate: reference eager, CLI defaults, reference compiled, CLI
compiled, so that a machine that drifts (clocks, a neighbour) drifts under both. The card's
SM clock and power are sampled during each (``common.CardClocks``: the reference's over its timed
blocks, a CLI run's over the run, summarised where the card was busy). The table comes last:
tokens/s of each, and the CLI's over the compiled reference, then on a GPU the card's clock and
power in each; --json writes the rows (with the ratios to the eager reference too), each run's
details (a CLI run's every window, whether it captured its CUDA graph, any fallback its log
reports, ``card_clocks``) and the card, torch, commit (-dirty: tracked files differ from it) and
date.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_train  # noqa: E402
from common import CardClocks, at_least, card_name, clocks_text, commit, free_between_runs, median, now  # noqa: E402

from oelm_core.config import ConfigError, model_config  # noqa: E402
from oelm_core.distributed import resolve_device  # noqa: E402
from oelm_core.parameter_files import load_run_config  # noqa: E402
from oelm_core.provenance import code_version  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
# The four figures of a batch, in the order they run (alternating): name -> (the CLI's?, compiled?).
RUNS = {
    "reference_eager": (False, False),
    "cli_defaults": (True, False),
    "reference_compiled": (False, True),
    "cli_compile": (True, True),
}
COLUMNS = ("reference_eager", "reference_compiled", "cli_defaults", "cli_compile")  # the table's order
# Lines of the CLI's log that say a fast path did not run as asked.
FELL_BACK = ("torch.compile failed", "CUDA graph capture failed")


def commit_name() -> str:
    """The checkout's commit, with -dirty where tracked files differ from it (OELM_COMMIT wins, as
    in every run's provenance: a copy of the tree on another machine may carry no .git)."""
    code = code_version()
    if code["commit"] is None:
        return commit()
    return code["commit"] + ("-dirty" if code["dirty"] else "")


def logged_steps(steps: int, log_every: int) -> list[int]:
    """The steps the loop writes a metrics row at (with eval_every = ckpt_every = steps)."""
    return sorted({1, steps, *range(log_every, steps + 1, log_every)})


def cli_command(params: str, sets: list[str], batch: int, steps: int, out_dir: Path, compiled: bool) -> list[str]:
    """The CLI as a user types it, plus what the benchmark must set; ``sets`` (--set, --preset)
    come after, so that they may change any of it."""
    return [
        sys.executable,
        "-m",
        "oelm_core.train",
        "--params",
        params,
        "--set",
        f"train.batch_size={batch}",
        f"train.stop_after={steps}",
        f"out_dir={out_dir}",
        f"train.eval_every={steps}",
        f"train.ckpt_every={steps}",
        *(["train.compile=true"] if compiled else []),
        *sets,
    ]


def run_cli(cmd: list[str], out_dir: Path, warmup_windows: int) -> dict:
    """Run the CLI ``cmd`` (its run folder ``out_dir``): its median tokens/s over the log windows
    after the first ``warmup_windows``, every window, and what its log says fell back."""
    log_path = out_dir.parent / f"{out_dir.name}.log"  # not in the run folder: the CLI claims that
    # The checkout first on the path, as `python -m` from the root has it, whatever is installed.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    r = {"command": " ".join(cmd[1:]), "wall_s": time.perf_counter() - t0, "log": str(log_path)}
    text = log_path.read_text(errors="replace")
    # tqdm redraws its bar with carriage returns: the log's lines are what follows the last one.
    lines = [line.rsplit("\r", 1)[-1] for line in text.splitlines()]
    r["fell_back"] = [line.strip() for line in lines if any(s in line for s in FELL_BACK)]
    r["cuda_graph_captured"] = any("captured the training step as a CUDA graph" in line for line in lines)
    metrics = out_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.is_file():
        tail = "\n".join(lines[-15:])
        return {**r, "tokens_per_s": None, "error": f"exit status {proc.returncode}; the log's end:\n{tail}"}
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    windows = [row["tokens_per_s"] for row in rows if row.get("tokens_per_s") is not None]
    timed = windows[warmup_windows:]
    summary = json.loads((out_dir / "summary.json").read_text())
    r.update(
        tokens_per_s=median(timed) if timed else None,
        windows=windows,
        window_steps=[row["step"] for row in rows],
        timed_windows=len(timed),
        summary_tokens_per_s=summary.get("tokens_per_s"),
        device=summary.get("device"),
        status=summary.get("status"),
        compiled=summary.get("compiled"),
    )
    if not timed:
        r["error"] = f"{len(windows)} log windows, none after the {warmup_windows} warm-up ones"
    return r


def time_reference(batch: int, compiled: bool, preset: str, device: torch.device, args) -> dict:
    """bench_train.py's reference row at ``batch``: its step's median tokens/s over its blocks."""
    v = {"group": "reference", "compile": "1" if compiled else "0", "pad": "1"}
    v["label"] = bench_train.with_options("reference", compile=v["compile"])
    timing = argparse.Namespace(
        preset=preset, steps=args.ref_steps, blocks=args.ref_blocks, warmup=args.ref_warmup, profile=[]
    )
    try:
        return bench_train.bench_one(v, batch, timing, device)
    except Exception as e:  # keep the other figures
        import traceback

        traceback.print_exc()
        free_between_runs(device.type == "cuda")
        return {"label": v["label"], "batch": batch, "tokens_per_s": None, "error": repr(e)[:300]}


def ratio(a, b):
    return a / b if a and b else None


def row_of(batch: int, block_size: int, runs: dict) -> dict:
    """A table row: each run's tokens/s and the CLI's over the reference's."""
    tps = {name: runs[name]["tokens_per_s"] if name in runs else None for name in RUNS}
    return {
        "batch": batch,
        "block_size": block_size,
        "tokens_per_step": batch * block_size,
        **tps,
        "defaults_over_ref_compiled": ratio(tps["cli_defaults"], tps["reference_compiled"]),
        "compile_over_ref_compiled": ratio(tps["cli_compile"], tps["reference_compiled"]),
        "defaults_over_ref_eager": ratio(tps["cli_defaults"], tps["reference_eager"]),
        "compile_over_ref_eager": ratio(tps["cli_compile"], tps["reference_eager"]),
        "runs": runs,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="parameters/medium512/gpt_base.yaml", help="the CLI's parameter file")
    ap.add_argument("--preset", default=None, help="another shape for the CLI and the reference (--set preset=...)")
    ap.add_argument("--batch", type=at_least(1), nargs="+", default=[16, 64])
    ap.add_argument("--steps", type=at_least(2), default=400, help="the steps each CLI run trains (train.stop_after)")
    ap.add_argument(
        "--warmup-windows", type=at_least(0), default=2, help="the CLI's first log windows left out of the median"
    )
    ap.add_argument("--skip-compile", action="store_true", help="neither the compiled reference nor train.compile")
    ap.add_argument(
        "--set",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="more --set for every CLI run (after the benchmark's own), e.g. data.out_dir=... train.log_every=4",
    )
    ap.add_argument(
        "--ref-steps",
        type=at_least(1),
        default=None,
        help="reference: steps per timed block (default: the CLI's train.log_every)",
    )
    ap.add_argument(
        "--ref-blocks",
        type=at_least(1),
        default=None,
        help="reference: timed blocks, median (default: the CLI's timed windows)",
    )
    ap.add_argument(
        "--ref-warmup", type=at_least(0), default=None, help="reference: steps after compilation (default: --ref-steps)"
    )
    ap.add_argument("--runs-dir", default=None, help="keep the CLI's run folders and logs here (default: removed)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    params = str(Path(args.params).resolve())  # the CLI runs from the repository root
    sets = ([f"preset={args.preset}"] if args.preset else []) + args.set
    try:  # what the CLI will read, checked before anything runs
        cfg = load_run_config(params, sets).validate()
        device = resolve_device(cfg.train.device)
    except ConfigError as e:
        ap.error(str(e))
    ref_cfg = model_config(cfg.preset, "gpt_base")
    block = cfg.model_config().block_size
    windows = len(logged_steps(args.steps, cfg.train.log_every))
    if windows <= args.warmup_windows:
        ap.error(
            f"--steps {args.steps} gives {windows} log windows (train.log_every={cfg.train.log_every}), "
            f"none after --warmup-windows {args.warmup_windows}: raise --steps or lower train.log_every"
        )
    # The reference is timed as the CLI is (the module's docstring says why).
    args.ref_steps = args.ref_steps or cfg.train.log_every
    args.ref_blocks = args.ref_blocks or windows - args.warmup_windows
    args.ref_warmup = args.ref_steps if args.ref_warmup is None else args.ref_warmup
    torch.backends.cuda.matmul.allow_tf32 = True  # as bench_train.py, and the CLI's "high" precision
    torch.backends.cudnn.allow_tf32 = True
    meta = {
        "card": card_name(device),
        "torch": torch.__version__,
        "commit": commit_name(),
        "date": now(),
        "command": " ".join(sys.argv),
        "params": args.params,
        "preset": cfg.preset,
        "variant": cfg.variant,
        "device": device.type,
        "block_size": block,
        "steps": args.steps,
        "log_every": cfg.train.log_every,
        "warmup_windows": args.warmup_windows,
        "timed_windows": windows - args.warmup_windows,
        # The CLI's switches in this parameter file with --set (the batch's and compile's aside).
        "cli_train": {
            k: getattr(cfg.train, k)
            for k in ("compile", "cuda_graph", "fused_loss", "fused_logits", "dtype", "deterministic", "tensorboard")
        },
        "reference_timing": {"steps": args.ref_steps, "blocks": args.ref_blocks, "warmup": args.ref_warmup},
        "reference_vocab_rows": ref_cfg.padded_vocab_size,
        "vocab_size": ref_cfg.vocab_size,
    }
    print(json.dumps(meta), flush=True)

    runs_dir = Path(args.runs_dir).resolve() if args.runs_dir else None
    if runs_dir:
        runs_dir.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="bench_cli_", dir=runs_dir))
    rows = []
    try:
        for batch in args.batch:
            runs = {}
            for name, (cli, compiled) in RUNS.items():
                if compiled and args.skip_compile:
                    continue
                if not cli:  # bench_one samples the card's clock over its timed blocks
                    r = time_reference(batch, compiled, cfg.preset, device, args)
                else:
                    out = root / f"b{batch}_{name}"
                    with CardClocks(device) as clocks:  # over the whole run: summarised where the card was busy
                        r = run_cli(
                            cli_command(params, sets, batch, args.steps, out, compiled), out, args.warmup_windows
                        )
                    r["card_clocks"] = clocks.summary()
                    if not runs_dir:
                        shutil.rmtree(out, ignore_errors=True)  # a checkpoint is 0.5 GB at Medium-512
                        del r["log"]
                runs[name] = r
                print(json.dumps({"batch": batch, "run": name, **r}), flush=True)
            rows.append(row_of(batch, block, runs))
    finally:
        if not runs_dir:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print_table(meta, rows)


def print_table(meta: dict, rows: list[dict]) -> None:
    print(f"\n{meta['card']}  torch {meta['torch']}  {meta['date']}  commit {meta['commit']}")
    print(
        f"CLI: {meta['params']} (preset {meta['preset']}, {meta['variant']}), {meta['steps']} steps, "
        f"median tokens/s of {meta['timed_windows']} log windows of {meta['log_every']} steps after "
        f"{meta['warmup_windows']} warm-up ones; its switches: "
        + " ".join(f"{k}={v}" for k, v in meta["cli_train"].items())
    )
    pad = meta["reference_vocab_rows"]
    print(
        f"reference: benchmarks/reference.py, its vocabulary padded {meta['vocab_size']:,} -> {pad:,} rows "
        f"({'as nanoGPT pads it' if pad == 50304 else 'nanoGPT pads to 50,304'}), step alone, compiled without "
        "a CUDA graph"
    )
    for r in rows:
        for name, run in r["runs"].items():
            if run.get("error"):
                print(f"  ERROR batch {r['batch']} {name}: {run['error'][-300:]}")
            for line in run.get("fell_back", []):
                print(f"  note: batch {r['batch']} {name}: {line}")
            graph_expected = meta["device"] == "cuda" and meta["cli_train"]["cuda_graph"]
            if graph_expected and name.startswith("cli") and not run.get("cuda_graph_captured", True):
                print(f"  note: batch {r['batch']} {name}: no CUDA graph captured (its log does not say so)")
    heads = (
        f"batch x {meta['block_size']}",
        "reference eager",
        "reference compiled",
        "CLI defaults",
        "CLI compile",
        "defaults / ref compiled",
        "compile / ref compiled",
    )
    print("tokens/s:")
    print("  ".join(f"{h:>{max(len(h), 10)}s}" for h in heads))
    for r in rows:
        cells = [str(r["batch"])]
        cells += [f"{r[name]:,.0f}" if r[name] else "-" for name in COLUMNS]
        cells += [f"{x:.3f}" if x else "-" for x in (r["defaults_over_ref_compiled"], r["compile_over_ref_compiled"])]
        print("  ".join(f"{c:>{max(len(h), 10)}s}" for c, h in zip(cells, heads)))
    if any(run.get("card_clocks") for r in rows for run in r["runs"].values()):
        print("the card while busy (median SM clock, power; *: held down by its power limit):")
        for r in rows:
            cells = [clocks_text(r["runs"].get(name, {}).get("card_clocks")) for name in COLUMNS]
            print("  ".join(f"{c:>{max(len(h), 10)}s}" for c, h in zip([str(r["batch"]), *cells], heads)))


if __name__ == "__main__":
    main()
