"""The run folder (``RunConfig.out_dir``): its files, and one training session at a time in it.

    config.yaml            the RunConfig as run
    metrics.jsonl          one JSON object per logged step (train figures; eval rows add val_*)
    ckpt/step_XXXXXXX.pt   the last ``keep_last`` step checkpoints (what --resume continues from)
    best.pt                the checkpoint with the lowest validation loss
    summary.json           the run's figures, written when a session ends
    export/                best.pt's weights as safetensors with config.json and a model card,
                           written when a session ends (oelm_core.export; no pickle to load them)
    .oelm-run              says that a training wrote here: written before its first file
    .lock                  held by the session writing the folder (pid inside): one at a time

A run writes only into a folder that is new, empty, or a run folder (``claim_refusal``): never
over files that it did not write. A session that fails before its first write leaves the folder
as it found it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import logging
import math
import re
import shutil
import socket
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Optional

from oelm_core.config import ConfigError, RunConfig
from oelm_core.distributed import Dist, broadcast_object, every_rank
from oelm_core.files import (
    LockHeld,
    exclusive_lock,
    raise_if_disk_full,
    temporary_files,
    temporary_folders,
    write_text_atomic,
)
from oelm_core.parameter_files import read_yaml, save_run_config

log = logging.getLogger(__name__)

STEP_FILE = re.compile(r"step_(\d+)\.pt")
MARKER = ".oelm-run"
# What the toolkit writes into a run folder: the trainer's files, and what the study, sweep and
# SLURM runners put there before the training starts (its parameters, its place in a sweep, the
# notebook that launches it, the job script, its record and log), and temporaries of killed
# writes. A folder holding nothing else is a run folder even without MARKER: an earlier
# version's, or one a runner prepared.
TOOLKIT_NAMES = {
    "config.yaml",
    "metrics.jsonl",
    "summary.json",
    "best.pt",
    "ckpt",
    "export",
    "tb",  # TensorBoard's event files (oelm_core/live_metrics.py)
    MARKER,
    ".lock",
    "params.yaml",
    "sweep_point.json",
    "03_training.ipynb",
    "loss_curve.png",
    "job.sbatch",
    "slurm.json",
}
TOOLKIT_PATTERNS = ("slurm-*.out", ".*.tmp", ".*.old", ".*.lock")


def step_number(path: Path) -> Optional[int]:
    """N of a step checkpoint ckpt/step_N.pt; None for any other name (a backup, a copy)."""
    match = STEP_FILE.fullmatch(path.name)
    return int(match.group(1)) if match else None


def checkpoints(out: Path) -> list[Path]:
    """out/ckpt/step_N.pt, oldest first. Other files there are neither read nor deleted."""
    numbered = ((step_number(p), p) for p in (out / "ckpt").glob("step_*.pt") if p.is_file())
    return [p for n, p in sorted((n, p) for n, p in numbered if n is not None)]


def json_safe(value: Any) -> Any:
    """NaN/inf -> None so metrics.jsonl and summary.json stay standard JSON."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def check_folders(cfg: RunConfig) -> None:
    """ConfigError for an out_dir or data.out_dir that is empty (Path("") is the current folder:
    a run wrote its files among the user's there) or a file (or lies under one): caught before
    the data is prepared, not as a FileExistsError after it."""
    for key, value in (("out_dir", cfg.out_dir), ("data.out_dir", cfg.data.out_dir)):
        if not str(value).strip():
            example = f"runs/train/{cfg.name}" if key == "out_dir" else "data_cache/tinystories"
            raise ConfigError(
                f"{key} is empty, which would put the {'run' if key == 'out_dir' else 'token files'} "
                f"into the current folder among its files: set {key} to a folder of its own, "
                f"e.g. {example}"
            )
    for key, folder in (("out_dir", Path(cfg.out_dir)), ("data.out_dir", Path(cfg.data.out_dir))):
        existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            where = "is a file" if existing == folder else f"lies under the file {existing}"
            raise ConfigError(f"{key} {folder} {where}, not a folder: set {key} to a folder")


@contextmanager
def hold_run_folder(out: Path, d: Dist):
    """Hold the run folder ``out`` for this session: an exclusive lock on out/.lock (rank 0; the
    file holds its pid), so that a second training into the same folder fails at once instead of
    interleaving metrics.jsonl, config.yaml and the checkpoints with this one's. Under the lock
    nothing else writes there: temporaries of atomic writes killed mid-way (a checkpoint's
    ``.step_*.pt.*.tmp``: 0.5 GB at medium512) are removed.

    ConfigError on every rank when another process holds the lock, when the folder holds files
    that no training wrote (``claim_refusal``), or when a rank sees other checkpoints there than
    rank 0 (``check_same_checkpoints``). The kernel drops the lock of a process that dies, so a
    killed training leaves nothing to clean up. Where the file system has no locks (some network
    mounts) the session goes on, with a warning. Leaving, the lock file goes, and the folders
    this session made go where it wrote nothing into them: a session that failed before its
    first write (the data could not be prepared, say) leaves no trace.
    """
    with ExitStack() as held:
        if d.is_main:
            made = [p for p in (out, *out.parents) if not p.exists()]
            held.callback(_remove_if_empty, made)  # runs last: after the lock file is gone
        locked, refused = _lock_run_folder(out, held) if d.is_main else (None, None)
        # The other ranks stop too, rather than wait for rank 0 in the next collective.
        refused = broadcast_object(refused, d)
        if refused is not None:
            raise ConfigError(refused)
        check_same_checkpoints(out, d)
        if locked:
            _remove_killed_writes(out)
        yield


def check_same_checkpoints(out: Path, d: Dist) -> None:
    """ConfigError on every rank where a rank finds other step checkpoints in ``out`` than rank 0.

    Rank 0 alone writes the run folder, but every rank reads its newest checkpoint to resume
    (``oelm_core.resume``), so the ranks of a job on several nodes must see one folder: a node
    whose out_dir is a local disk of its own would start afresh, or from another checkpoint,
    beside a resumed rank 0. Names and sizes are compared, on every rank, so that all stop
    together instead of leaving the others waiting in a collective."""
    seen = every_rank((socket.gethostname(), [(p.name, p.stat().st_size) for p in checkpoints(out)]), d)

    def described(rank: int) -> str:
        host, files = seen[rank]
        return f"rank {rank} (host {host}) finds " + (
            ", ".join(f"{name} ({size} bytes)" for name, size in files) if files else "none"
        )

    differ = [r for r in range(1, len(seen)) if seen[r][1] != seen[0][1]]
    if differ:
        raise ConfigError(
            f"the ranks see different checkpoints in {out / 'ckpt'}: {described(0)}, "
            f"{described(differ[0])}. Every rank reads the checkpoint rank 0 writes: "
            f"on several nodes set out_dir (and data.out_dir) to a folder on a file "
            f"system that every node shares"
        )


def _remove_if_empty(folders: list[Path]) -> None:
    """Remove those of ``folders`` (deepest first) that are empty."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:  # not empty (the session wrote there), or gone
            return


def _lock_run_folder(out: Path, held: ExitStack) -> tuple[Optional[bool], Optional[str]]:
    """(``exclusive_lock``'s answer for out/.lock, which ``held`` then holds; why the folder is
    refused, or None)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        locked = held.enter_context(exclusive_lock(out / ".lock"))
    except LockHeld as exc:
        return None, f"another training (pid {exc.holder}) is writing to {out}; wait for it or choose another out_dir"
    except OSError as exc:
        return None, f"cannot write to out_dir {out} ({exc.strerror}); set out_dir to a folder you can write to"
    if not locked:
        log.warning("the file system of %s has no locks: a second training into it would not be stopped", out)
    return locked, claim_refusal(out)


def claim_refusal(out: Path) -> Optional[str]:
    """Why a training may not write into the existing folder ``out``, or None where it may: a
    folder that holds MARKER, or only what the toolkit writes there (TOOLKIT_NAMES and
    TOOLKIT_PATTERNS, with a config.yaml that is a run's parameters), is a run folder; any other
    file would sit beside config.yaml, metrics.jsonl and summary.json, or be overwritten by them
    (``out_dir: .`` once overwrote the user's own config.yaml)."""
    if (out / MARKER).is_file():
        return None
    names = sorted(p.name for p in out.iterdir())
    foreign = [n for n in names if n not in TOOLKIT_NAMES and not any(fnmatch.fnmatch(n, p) for p in TOOLKIT_PATTERNS)]
    if "config.yaml" in names and not _is_run_config(out / "config.yaml"):
        foreign.insert(0, "config.yaml")
    if not foreign:
        return None
    # Every file there: a summary.json beside a foreign config.yaml is no run's either.
    shown = [n for n in names if n != ".lock"]
    listed = ", ".join(shown[:5]) + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")
    return (
        f"out_dir {out} holds files that no training wrote ({listed}); a run writes config.yaml, "
        f"metrics.jsonl, summary.json, best.pt, ckpt/ and export/ into its folder and would write "
        f"beside or over them: set out_dir to a new or empty folder"
    )


def _is_run_config(path: Path) -> bool:
    """Whether ``path`` holds a run's parameters as the trainer saves them (a mapping with preset,
    variant and train, and no key a RunConfig lacks), whatever the version that wrote it."""
    try:
        values = read_yaml(path)
    except ConfigError:
        return False
    return {"preset", "variant", "train"} <= set(values) <= {f.name for f in dataclasses.fields(RunConfig)}


def _remove_killed_writes(out: Path) -> None:
    """Remove the temporaries that atomic writes killed mid-way left in ``out`` and out/ckpt: files,
    and the folders of an export (export/'s ``.export.*.tmp``)."""
    files = temporary_files(out) + temporary_files(out / "ckpt")
    folders = temporary_folders(out)
    stale = files + folders
    if stale:
        size = sum(f.stat().st_size for f in files + [f for d in folders for f in d.rglob("*") if f.is_file()])
        for p in files:
            p.unlink()
        for d in folders:
            shutil.rmtree(d)
        log.info(
            "removed %d temporaries left by writes that were killed (%.1f MB): %s",
            len(stale),
            size / 1e6,
            ", ".join(p.name for p in stale),
        )


def start_files(cfg: RunConfig, step: int) -> None:
    """config.yaml; metrics.jsonl fresh, or cut back to ``step``, the resumed one (no duplicate
    rows, and none cut short by a kill)."""
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / MARKER).is_file():
        write_text_atomic(
            out / MARKER, "An OELM Lab run folder: python -m oelm_core.train writes here (docs/training.md).\n"
        )
    save_run_config(cfg, out / "config.yaml")
    metrics = out / "metrics.jsonl"
    kept = []
    if step > 0 and metrics.is_file():
        for line in filter(str.strip, metrics.read_text().splitlines()):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a row cut short when the run was killed mid-write
                log.warning("metrics.jsonl: dropped a row that is not JSON: %.80s", line)
                continue
            if row["step"] <= step:
                kept.append(line)
    write_text_atomic(metrics, "".join(line + "\n" for line in kept))  # killed: the old rows stay


def append_metrics(out: Path, row: dict) -> None:
    """One row more in metrics.jsonl; a row cut short by a full disk is dropped on resuming."""
    try:
        with open(out / "metrics.jsonl", "a") as f:
            f.write(json.dumps({k: json_safe(v) for k, v in row.items()}) + "\n")
    except OSError as exc:
        raise_if_disk_full(exc, out / "metrics.jsonl", "out_dir")
        raise


def write_summary(out: Path, summary: dict) -> dict:
    """summary.json (NaN/inf as null); returns what it wrote."""
    summary = {k: json_safe(v) for k, v in summary.items()}
    write_text_atomic(out / "summary.json", json.dumps(summary, indent=2) + "\n")
    return summary


def read_summary(out: Path) -> dict:
    """summary.json, or {} where it is missing or cut short."""
    try:
        return json.loads((out / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
