"""One training in a child process: ``python -m oelm_core.train`` (or ``torchrun``), its log streamed.

The local scheduler, notebook 03 and the SLURM job script all train through the command
``train_command`` writes; the calling process never touches CUDA. ``cuda_visible_devices`` names
a child's GPUs by their index among those this process sees (``child_visible_devices``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Sequence

from oelm_core.checkout import REPO, child_env
from oelm_core.config import ConfigError, run_config_from_dict
from oelm_core.parameter_files import apply_overrides
from oelm_core.runner.plan import training_parameters


def train_command(
    params: str | Path, overrides: Sequence[str] = (), nproc: int = 1, resume: bool = False, nodes: int = 1
) -> list[str]:
    """The command line of one training: ``python -m oelm_core.train`` for one process,
    ``torchrun --standalone --nproc_per_node N -m oelm_core.train`` for several on one host.
    ``nodes`` > 1: the command each of that many hosts runs, ``torchrun --nnodes NODES
    --nproc_per_node N ...``, which meets the others at the rendezvous that torchrun's PET_RDZV_*
    environment variables name (the SLURM job script sets them)."""
    if nproc < 1 or nodes < 1:
        raise ConfigError(f"nproc and nodes must be at least 1, got nproc={nproc}, nodes={nodes}")
    if nproc == 1 and nodes == 1:
        cmd = [sys.executable, "-m", "oelm_core.train"]
    else:
        where = ["--standalone"] if nodes == 1 else [f"--nnodes={nodes}"]
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            *where,
            f"--nproc_per_node={nproc}",
            "-m",
            "oelm_core.train",
        ]
    cmd += ["--params", str(params)]
    for o in overrides:
        cmd += ["--set", o]
    return cmd + (["--resume"] if resume else [])


def child_visible_devices(gpus: str) -> str:
    """CUDA_VISIBLE_DEVICES for a child process that should use ``gpus``: GPU indices as this
    process numbers them, comma-separated ("" for none).

    A child's CUDA_VISIBLE_DEVICES names GPUs as the machine does, not as this process sees them:
    in a job confined to GPUs 2,3 (CUDA_VISIBLE_DEVICES=2,3) index 0 must become "2", or the
    child trains on a GPU the job was not given. Without the variable both numberings agree."""
    text = str(gpus).strip()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not text or visible is None:
        return text
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    try:
        picked = [int(i) for i in text.split(",")]
    except ValueError:
        raise ConfigError(
            f"cuda_visible_devices={text!r}: give GPU indices such as \"0\" or \"0,1\", "
            f"counted among the {len(devices)} GPU(s) this process sees "
            f"(CUDA_VISIBLE_DEVICES={visible})"
        ) from None
    bad = [i for i in picked if not 0 <= i < len(devices)]
    if bad:
        raise ConfigError(
            f"cuda_visible_devices={text!r} names GPU {bad[0]}, but this process sees "
            f"{len(devices)} GPU(s) (CUDA_VISIBLE_DEVICES={visible}); indices count "
            f"from 0 among those"
        )
    return ",".join(devices[i] for i in picked)


def launch_training(
    params: str | Path,
    overrides: Sequence[str] = (),
    nproc: int = 1,
    cuda_visible_devices: str | None = None,
    run_dir: str | Path | None = None,
    resume: bool = False,
    progress: bool | None = None,
    echo: Callable[[str], None] | None = None,
    threads: int | None = None,
) -> Path:
    """Train one run in a subprocess, echoing its log line by line; returns the run folder.

    ``run_dir`` overrides the parameter file's out_dir. ``cuda_visible_devices`` picks the child's
    GPUs by their index in this process ("" hides every GPU; ``child_visible_devices``).
    ``progress`` sets ``train.progress`` (None: the parameter file's; a tqdm bar streams badly
    into a notebook). ``threads``: the child's OMP_NUM_THREADS, its CPU threads per process (None:
    this process's environment; the runner shares the cores out among trainings side by side).
    A non-zero exit raises RuntimeError with the last lines of the log.
    """
    params = Path(params)
    if not params.is_file() and (REPO / params).is_file():  # a path from the root, called elsewhere
        params = REPO / params
    overrides = list(overrides)
    if progress is not None:
        overrides.append(f"train.progress={str(bool(progress)).lower()}")
    if run_dir is not None:
        # quoted: --set values are YAML, where " #" starts a comment and a bare path may be a number
        overrides.append(f"out_dir={json.dumps(str(Path(run_dir).resolve()), ensure_ascii=False)}")
    cfg = run_config_from_dict(apply_overrides(training_parameters(params), overrides))  # fails before a launch
    extra = (
        {} if cuda_visible_devices is None else {"CUDA_VISIBLE_DEVICES": child_visible_devices(cuda_visible_devices)}
    )
    if threads is not None:
        if not (isinstance(threads, int) and threads >= 1):
            raise ConfigError(f"threads={threads!r}: give the training's CPU threads as a whole number >= 1, or None")
        extra["OMP_NUM_THREADS"] = str(threads)
    cmd = train_command(params.resolve(), overrides, nproc, resume)
    echo = echo or (lambda line: print(line, flush=True))
    echo("$ " + " ".join(cmd) + (f"   [{' '.join(f'{k}={v}' for k, v in extra.items())}]" if extra else ""))
    tail: list[str] = []
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=child_env(extra),
        cwd=os.getcwd(),
        bufsize=1,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n").split("\r")[-1]  # a progress bar's redraws: keep the latest
        echo(line)
        tail = (tail + [line])[-30:]
    rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"training of {params} exited with status {rc}; last lines:\n" + "\n".join(tail))
    return Path(cfg.out_dir)
