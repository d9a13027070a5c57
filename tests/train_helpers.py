"""What the training tests share: small CPU runs, their metrics, torchrun.

Corpora come from conftest's `story_folder` and `folded` fixtures (the latter: the prepared
tokens folded into a FOLDED_VOCAB-token vocabulary, except where the real GPT-2 vocabulary
matters); each training test module uses conftest's `no_data_override`.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from conftest import FOLDED_VOCAB
from oelm_core.config import run_config_from_dict
from oelm_core.model import GPT
from oelm_core.train import train

REPO = Path(__file__).resolve().parents[1]


def params(tmp_path: Path, source: Path, variant: str = "oelm_freeze", out: str = "run",
           vocab: int = FOLDED_VOCAB, **train) -> dict:
    """A small CPU run: preset smoke at context 32, 4 sequences per step, every step logged."""
    return {
        "name": "test", "out_dir": str(tmp_path / out), "preset": "smoke", "variant": variant,
        "model": {"block_size": 32, "vocab_size": vocab},
        "data": {"source": str(source), "out_dir": str(tmp_path / "data"), "num_proc": 1},
        "train": {"steps": 10, "batch_size": 4, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2,
                  "eval_every": 5, "eval_batches": 2, "ckpt_every": 5, "keep_last": 10,
                  "log_every": 1, "progress": False, "device": "cpu", **train},
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
    """The run folder's files and their mtimes (ns), without .lock: each session writes its pid there."""
    return {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != ".lock"}


def write_params(path: Path, values: dict) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_train(tmp_path: Path, values: dict, entry: tuple = ("-m", "oelm_core.train"),
                   **env: str) -> subprocess.CompletedProcess:
    """The CLI (or the script ``entry`` names) under torchrun, 2 processes on a free local port,
    with ``env`` added."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
         "127.0.0.1", "--master_port", str(free_port()), *entry,
         "--params", str(write_params(tmp_path / "ddp.yaml", values))],
        cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)


def kill_at(monkeypatch, obj, name: str, when) -> None:
    """Make ``obj.name`` raise KeyboardInterrupt (a kill) the first time ``when(*args)`` holds."""
    real = getattr(obj, name)

    def dies(*args, **kwargs):
        if when(*args, **kwargs):
            monkeypatch.setattr(obj, name, real)
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, dies)

