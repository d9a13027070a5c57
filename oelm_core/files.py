"""Files that a killed process never leaves half-written.

Every file a later run reads back (checkpoints, token files, summaries, the run's parameters) is
written to a temporary file in the same folder and renamed over the old one: the rename is atomic
on one file system, so a reader finds the previous file or the new one, never a partial one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, IO


def atomic_write(path: str | Path, write: Callable[[IO], None], mode: str = "wb") -> Path:
    """Create or replace ``path`` with what ``write(f)`` writes to the open file ``f``.

    The temporary is ``.<name>.<random>.tmp`` beside ``path``; a write that fails removes it, a
    process killed mid-write leaves it (see ``temporary_files``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the data reaches the disk before the rename can
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; outputs are shared like any file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``Path.write_text`` through ``atomic_write``."""
    return atomic_write(path, lambda f: f.write(text), mode="w")


def temporary_files(folder: str | Path, name: str = "*") -> list[Path]:
    """The temporaries that atomic writes of files named ``name`` (a glob; any name by default)
    left in ``folder``, which only a process killed mid-write leaves behind. Remove them only
    while no other process can be writing there (under a lock on the folder)."""
    return sorted(p for p in Path(folder).glob(f".{name}.*.tmp") if p.is_file())
