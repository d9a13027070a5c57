"""Files that a killed process never leaves half-written, and folders one process at a time.

Every file a later run reads back (checkpoints, token files, summaries, the run's parameters) is
written to a temporary file in the same folder and renamed over the old one: the rename is atomic
on one file system, so a reader finds the previous file or the new one, never a partial one.
A folder that one process writes at a time is held through ``exclusive_lock`` on a file in it.
"""

from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, IO, Iterator, Optional

try:
    import fcntl
except ImportError:  # Windows: no advisory locks (exclusive_lock holds none there)
    fcntl = None


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


class LockHeld(RuntimeError):
    """Another process holds the lock; ``holder`` is the pid it wrote in the lock file ("unknown"
    when it wrote none)."""

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path} is held by process {holder}")
        self.holder = holder


@contextmanager
def exclusive_lock(path: str | Path, on_wait: Optional[Callable[[], None]] = None) -> Iterator[Optional[bool]]:
    """Hold an exclusive advisory lock on the file ``path`` (created if missing; it then holds
    this process's pid) for the body of the with-block.

    When another process holds it: with ``on_wait`` None raise LockHeld naming that process;
    else call ``on_wait()`` (to say why nothing happens) and wait until it lets go. Yields True
    when held, False where the file system has no locks (some network mounts), None where the
    platform has none (Windows: no file is created there). OSError where ``path`` cannot be
    opened for writing. The kernel drops the lock of a process that dies: nothing to clean up.
    """
    if fcntl is None:
        yield None
        return
    with open(path, "a+") as f:
        locked = True
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is None:
                f.seek(0)
                raise LockHeld(Path(path), f.read().strip() or "unknown") from None
            on_wait()
            fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:  # a file system without locks
            locked = False
        if locked:
            f.truncate(0)  # "a+" writes at the end, which is now the start
            f.write(f"{os.getpid()}\n")
            f.flush()
        try:
            yield locked
        finally:
            if locked:
                # Unlocked explicitly: a child process forked meanwhile shares the lock and would
                # hold it past close() for as long as it lives.
                fcntl.flock(f, fcntl.LOCK_UN)
