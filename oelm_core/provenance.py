"""Where a run came from: the code, the software, the device and the token files it trained on.

``of_run`` gathers it once, when a training session starts, for summary.json's ``provenance``
(and through it the export's model card):

    code      {"commit", "dirty", "changed", "version"}: the git commit of the checkout that
              holds oelm_core, whether tracked files differ from it (and which), the package
              version; outside a git checkout commit and dirty are null and "git" says why
    software  python, torch, CUDA, cuDNN, Triton and numpy versions (null where absent)
    device    type, name, how many the run used, the NVIDIA driver (where it can be read)
    data      the source read (a local folder as its absolute path, else the hub id), the
              token folder, and the sha256 of train.bin and val.bin with where it came from

A result that cannot say which code, software and tokens produced it cannot be checked or
explained: a run that differs from its re-runs can then be traced to one of them.
Nothing here runs inside the training loop.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from oelm_core import occupancy

PACKAGE = Path(__file__).resolve().parent
# Changed files named in the record; the count is always given.
MAX_CHANGED_NAMED = 20
# Token files are hashed in slices of this many bytes: memory stays flat for any corpus size.
HASH_CHUNK = 16 * 2**20


def package_version() -> str:
    """oelm-core's installed version, or "unknown" for a checkout run from PYTHONPATH alone."""
    try:
        return metadata.version("oelm-core")
    except metadata.PackageNotFoundError:
        return "unknown"


def _git(where: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, timeout=20)


def code_version(where: Path = PACKAGE) -> dict:
    """The code of the package folder ``where``: {"commit": sha, "dirty": bool, "changed":
    [paths], "n_changed": int, "version": str}; dirty means a tracked file differs from the
    commit (untracked files, such as run folders, do not count: ``git describe --dirty``'s
    rule). Every record has "source_sha256" (``source_sha256``). OELM_COMMIT, where set, names
    the commit instead of git (dirty is then None). Without either, or where ``where`` is not
    tracked by a git checkout (an installed package, even inside another repository), commit and
    dirty are None and "git" says why."""
    version = package_version()
    record = _code_without_git(where, version)
    if record["commit"] is not None:
        # Named by whoever copied the tree: a copy may carry a .git of another state (a GPU
        # machine's copy of a working tree, say), so git's answer there is not the code's.
        return record
    if shutil.which("git") is None:
        return {**record, "git": "no git: the git command is not installed"}
    try:
        # The package's own files must be tracked: an installed copy inside some other checkout
        # (a venv under a project folder) would otherwise report that project's commit.
        tracked = _git(where, "ls-files", "--error-unmatch", "__init__.py")
        if tracked.returncode != 0:
            why = (tracked.stderr.strip().splitlines() or ["not tracked"])[-1]
            return {**record, "git": f"no git: {where} is not a tracked folder of a git checkout ({why})"}
        commit = _git(where, "rev-parse", "HEAD").stdout.strip()
        # Porcelain paths are relative to the checkout's root wherever git runs.
        status = _git(where, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {**record, "git": f"no git: {type(exc).__name__}: {exc}"}
    if status.returncode != 0 or not commit:
        return {**record, "git": f"no git: {(status.stderr.strip().splitlines() or ['git status failed'])[-1]}"}
    changed = [line[3:] for line in status.stdout.splitlines() if line.strip()]
    return {
        "commit": commit,
        "dirty": bool(changed),
        "changed": changed[:MAX_CHANGED_NAMED],
        "n_changed": len(changed),
        "version": version,
        "source_sha256": record["source_sha256"],
    }


def source_sha256(where: Path = PACKAGE) -> str:
    """sha256 over the package's .py files (their paths below ``where`` and contents, in path
    order): the code that ran, comparable with any commit's (``git archive`` it and hash the same
    way) where the run's machine had a copy without git."""
    h = hashlib.sha256()
    for path in sorted(where.rglob("*.py")):
        h.update(path.relative_to(where).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _code_without_git(where: Path, version: str) -> dict:
    """What can be said of the code without git: the package's source hash, and the commit the
    environment names (OELM_COMMIT: a copy of a checkout carried to another machine, as
    scripts/test_gpu.sh takes it; it wins over git there), which the hash lets anyone check."""
    named = os.environ.get("OELM_COMMIT") or None
    return {
        "commit": named,
        "dirty": None,
        "version": version,
        "source_sha256": source_sha256(where),
        **({"commit_from": "OELM_COMMIT"} if named else {}),
    }


def _distribution_version(name: str) -> Optional[str]:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def software_versions() -> dict:
    """Versions of what computes a run; None for what is absent (CUDA and cuDNN on a CPU torch)."""
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": cudnn,
        # a CUDA torch pins its own Triton wheel (pytorch-triton on nightlies)
        "triton": _distribution_version("triton") or _distribution_version("pytorch-triton"),
        "numpy": np.__version__,
    }


def nvidia_driver() -> Optional[str]:
    """The NVIDIA driver's version (NVML, else nvidia-smi), or None where neither answers."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception:  # no pynvml, or NVML without a driver: try the command line
        pass
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.split()
    return lines[0] if done.returncode == 0 and lines else None


def device_record(device: torch.device, world_size: int, hosts: int = 1) -> dict:
    """The device this rank trains on, and how many the run uses (``world_size`` processes, one
    device each, on ``hosts`` machines). On a CPU, the model and how many cores and threads; on a
    GPU, the card and this process's CPU threads."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        # The card itself, so that runs of one faulty GPU can be found among a study's.
        uuid = str(getattr(props, "uuid", "")) or None
        return {
            "type": "cuda",
            "name": torch.cuda.get_device_name(device),
            "count": world_size,
            "hosts": hosts,
            "driver": nvidia_driver(),
            "uuid": uuid and f"GPU-{uuid}",
            "memory_gib": round(torch.cuda.get_device_properties(device).total_memory / 2**30, 1),
            "cpu_threads": torch.get_num_threads(),  # its host side (runs side by side share the cores)
        }
    return {
        "type": device.type,
        "name": _cpu_name(),
        "count": world_size,
        "hosts": hosts,
        "cores": len(occupancy.cores()),
        "threads": torch.get_num_threads(),
    }


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def sha256_file(path: Path) -> str:
    """sha256 of a file's bytes, read in HASH_CHUNK slices."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def data_record(source: str, out_dir: str | Path, meta: dict) -> dict:
    """The data a run read: ``source`` (what it was prepared from: data.real_source's answer),
    the token folder, token counts, and each token file's sha256. The hashes are meta.json's,
    computed while preparation wrote the files, where the file is still the one they were
    computed for (its size and mtime as meta.json recorded them); otherwise (a folder prepared
    before meta.json held them, or a file rewritten since) the file is hashed now, and
    "fingerprint" says which."""
    out = Path(out_dir)
    record = {
        "source": source,
        "out_dir": str(out.resolve()),
        "train_tokens": meta.get("train_tokens"),
        "val_tokens": meta.get("val_tokens"),
        "text_hash": meta.get("text_hash"),
    }
    computed = []
    for split in ("train", "val"):
        path = out / f"{split}.bin"
        stat = path.stat()
        stored = meta.get(f"{split}_sha256")
        if stored and (stat.st_size, stat.st_mtime_ns) == (
            2 * meta.get(f"{split}_tokens", -1),
            meta.get(f"{split}_mtime_ns"),
        ):
            record[f"{split}_sha256"] = stored
        else:
            record[f"{split}_sha256"] = sha256_file(path)
            computed.append(split)
    record["fingerprint"] = (
        "meta.json (computed when the token files were written)"
        if not computed
        else f"hashed at the run's start ({', '.join(computed)}: meta.json holds no hash for the file as it is now)"
    )
    return record


def of_run(source: str, out_dir: str | Path, meta: dict, device: torch.device, world_size: int, hosts: int = 1) -> dict:
    """summary.json's ``provenance``: ``code_version``, ``software_versions``, ``device_record``,
    ``data_record`` and the host that wrote the summary."""
    return {
        "code": code_version(),
        "software": software_versions(),
        "device": device_record(device, world_size, hosts),
        "host": socket.gethostname(),
        "data": data_record(source, out_dir, meta),
    }
