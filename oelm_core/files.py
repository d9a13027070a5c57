"""Files and folders that a killed process never leaves half-written; folders one process at a time.

Every file a later run reads back (checkpoints, token files, summaries, the run's parameters) is
written to a temporary file in the same folder and renamed over the old one: the rename is atomic
on one file system, so a reader finds the previous file or the new one, never a partial one.
A folder whose files are read together (an exported model) is written the same way, as a
temporary folder renamed into place (``atomic_folder``).
A folder that one process writes at a time is held through ``exclusive_lock`` on a file in it.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, IO, Iterator, Optional

import filelock


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


def temporary_folders(folder: str | Path) -> list[Path]:
    """What ``atomic_folder`` writes killed mid-way left in ``folder``: ``.<name>.*.tmp`` folders,
    and ``.<name>.*.old`` ones (a replaced folder not yet removed). Same caution as
    ``temporary_files``."""
    return sorted(p for pattern in (".*.tmp", ".*.old") for p in Path(folder).glob(pattern) if p.is_dir())


@contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """Create or replace the folder ``path`` with what the with-block writes into the folder it
    is given, ``.<name>.<random>.tmp`` beside ``path``; a block that fails removes it.

    Its files reach the disk before the rename, as ``atomic_write``'s do. An existing ``path`` is
    renamed aside first (``.<name>.<random>.old``) and removed once the new folder is in place: a
    reader finds the old folder or the new one, never a mix (between the two renames, briefly,
    neither)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    old = None
    try:
        yield tmp
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as handle:
                    os.fsync(handle.fileno())
        os.chmod(tmp, 0o755)  # mkdtemp makes it owner-only; outputs are shared like any file
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, old)  # onto the empty folder mkdtemp made: rename allows that
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not path.exists():
            os.replace(old, path)
        raise
    if old is not None:
        shutil.rmtree(old)


class LockHeld(RuntimeError):
    """Another process holds the lock; ``holder`` is the pid it wrote in the lock file ("unknown"
    when it wrote none)."""

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path} is held by process {holder}")
        self.holder = holder


# flock's answers on a file system (or platform) without locks: some network mounts, FUSE.
NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}


def _write_pid(fd: int) -> None:
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, f"{os.getpid()}\n".encode())


@contextmanager
def exclusive_lock(path: str | Path, on_wait: Optional[Callable[[], None]] = None) -> Iterator[bool]:
    """Hold an exclusive lock on the file ``path`` (``filelock``: flock on Unix, LockFileEx on
    Windows; the file is created if missing and holds the pid of its latest holder) for the body
    of the with-block.

    When another process holds it: with ``on_wait`` None raise LockHeld naming that process;
    else call ``on_wait()`` (to say why nothing happens) and wait until it lets go. Yields True
    when held, False where the file system has no locks (some network mounts: nothing is held
    and no pid is written). OSError where ``path`` cannot be opened for writing. The kernel drops
    the lock of a process that dies: nothing to clean up.
    """
    path = Path(path)
    # The pid is written through the locked descriptor, once held: filelock opens the file
    # without truncating it, so a contender still reads the holder's pid.
    lock = filelock.FileLock(path, on_acquired=_write_pid)
    try:
        try:
            lock.acquire(blocking=False)
        except filelock.Timeout:
            if on_wait is None:
                raise LockHeld(path, _holder(path)) from None
            on_wait()
            lock.acquire()
        locked = True
    except OSError as exc:
        if exc.errno not in NO_LOCKS:
            raise
        locked = False
    try:
        yield locked
    finally:
        if locked:
            lock.release()


def _holder(path: Path) -> str:
    # Windows refuses to read a region another process has locked: the holder stays unknown there.
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"
