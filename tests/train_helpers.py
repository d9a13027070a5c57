"""What the training tests share: small CPU runs, their metrics, torchrun.

Corpora come from conftest's `story_folder` and `folded` fixtures (the latter: the prepared
tokens folded into a FOLDED_VOCAB-token vocabulary, except where the real GPT-2 vocabulary
matters); each training test module uses conftest's `no_data_override`.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml
from conftest import FOLDED_VOCAB

from oelm_core.config import run_config_from_dict
from oelm_core.model import GPT
from oelm_core.train import train

REPO = Path(__file__).resolve().parents[1]


def params(
    tmp_path: Path, source: Path, variant: str = "oelm_freeze", out: str = "run", vocab: int = FOLDED_VOCAB, **train
) -> dict:
    """A small CPU run: preset smoke at context 32, 4 sequences per step, every step logged."""
    return {
        "name": "test",
        "out_dir": str(tmp_path / out),
        "preset": "smoke",
        "variant": variant,
        "model": {"block_size": 32, "vocab_size": vocab},
        "data": {"source": str(source), "out_dir": str(tmp_path / "data"), "num_proc": 1},
        "train": {
            "steps": 10,
            "batch_size": 4,
            "lr": 3e-3,
            "min_lr": 3e-4,
            "warmup_steps": 2,
            "eval_every": 5,
            "eval_batches": 2,
            "ckpt_every": 5,
            "keep_last": 10,
            "log_every": 1,
            "progress": False,
            "device": "cpu",
            **train,
        },
    }


def run(values: dict, resume: bool = False) -> dict:
    return train(run_config_from_dict(values), resume=resume)


def losses(out_dir: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"duplicate metric rows: {steps}"
    return {r["step"]: r["train_loss"] for r in rows}


def metric_rows(out_dir: str) -> dict[int, dict]:
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def qk_weights(model: GPT) -> list[torch.Tensor]:
    return [b.attn.qk.weight.detach().clone() for b in model.blocks]


def outputs(out: Path) -> dict[str, int]:
    """The run folder's files and their mtimes (ns), without .lock (each session writes its pid
    there) and tb/ (TensorBoard names its event files by time, host and pid)."""
    return {
        p.name: p.stat().st_mtime_ns
        for p in out.rglob("*")
        if p.is_file() and p.name != ".lock" and p.parent.name != "tb"
    }


def write_params(path: Path, values: dict) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_train(
    tmp_path: Path, values: dict, entry: tuple = ("-m", "oelm_core.train"), nproc: int = 2, **env: str
) -> subprocess.CompletedProcess:
    """The CLI (or the script ``entry`` names) under torchrun, ``nproc`` processes on a free local
    port, with ``env`` added."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            *entry,
            "--params",
            str(write_params(tmp_path / "ddp.yaml", values)),
        ],
        cwd=REPO,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def kill_at(monkeypatch, obj, name: str, when) -> None:
    """Make ``obj.name`` raise KeyboardInterrupt (a kill) the first time ``when(*args)`` holds."""
    real = getattr(obj, name)

    def dies(*args, **kwargs):
        if when(*args, **kwargs):
            monkeypatch.setattr(obj, name, real)
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, dies)


def torchrun_nodes(
    tmp_path: Path, values: dict, nodes: int = 2, timeout: float = 120, **env: str
) -> list[subprocess.CompletedProcess]:
    """The CLI as a multi-node job on this host: ``nodes`` torchrun agents of one process each,
    started separately as on separate machines, that find each other by c10d rendezvous on a free
    local port (the first agent to bind it hosts the store; rendezvous numbers the nodes).
    Returns each agent's finished process, its output read from files (nobody reads a pipe while
    the agents run).

    Each agent gets a session of its own: one still running after ``timeout`` seconds (a hang),
    or when the test is interrupted, is stopped with its worker, and its return code is then
    negative (the signal). The join timeout bounds how long an agent waits for one that
    never came."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{free_port()}",
        f"--rdzv_id=oelm-test-{os.getpid()}-{time.monotonic_ns()}",
        "--rdzv_conf=join_timeout=60",
        # The address the workers' process group is reached at: without it the host's name,
        # which a CI container need not resolve.
        "--local_addr=127.0.0.1",
        "--monitor_interval=0.1",
        "-m",
        "oelm_core.train",
        "--params",
        str(write_params(tmp_path / "nodes.yaml", values)),
    ]
    logs = [(tmp_path / f"node{i}.out", tmp_path / f"node{i}.err") for i in range(nodes)]
    procs = []
    try:
        for out, err in logs:
            with open(out, "w") as o, open(err, "w") as e:  # the child keeps its own descriptors
                procs.append(
                    subprocess.Popen(
                        cmd, cwd=REPO, env={**os.environ, **env}, stdout=o, stderr=e, start_new_session=True
                    )
                )
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break  # the finally kills this one and every other still running
    finally:
        # torchrun starts each worker in a session of its own: SIGTERM lets the agent stop its
        # worker before it exits; SIGKILL, to the agent's group, only where it does not.
        running = [p for p in procs if p.poll() is None]
        for p in running:
            os.killpg(p.pid, signal.SIGTERM)
        for p in running:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [
        subprocess.CompletedProcess(p.args, p.returncode, out.read_text(), err.read_text())
        for p, (out, err) in zip(procs, logs)
    ]
