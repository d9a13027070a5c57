"""This checkout, and the environment of the processes the toolkit starts from it.

A training (``python -m oelm_core.train``, ``torchrun``), a notebook's kernel (papermill) and a
SLURM job must import this checkout's ``oelm_core`` whether or not the package is installed, and
stream their output line by line: ``child_env`` gives them that environment.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment with REPO first on PYTHONPATH, PYTHONUNBUFFERED set, and
    ``extra`` laid over it."""
    env = dict(os.environ)
    paths = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env
