"""Files and folders that a killed process never leaves half-written; folders one process at a time.

Every file a later run reads back (checkpoints, token files, summaries, the run's parameters) is
written to a temporary file in the same folder and renamed over the old one: the rename is atomic
on one file system, so a reader finds the previous file or the new one, never a partial one.
A folder whose files are read together (an exported model) is written the same way, as a
temporary folder renamed into place (``atomic_folder``).
A folder that one process writes at a time is held through ``exclusive_lock`` on a file in it,
removed when it is let go. A write that fills the disk raises ``DiskFull``: one line naming the
device, the file and what it needs, instead of the writer's own traceback (torch.save's
"unexpected pos", a bare Errno 28).
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Callable, Iterator, Optional

import filelock


def atomic_write(
    path: str | Path,
    write: Callable[[IO], None],
    mode: str = "wb",
    need: Optional[Callable[[], float]] = None,
    setting: str = "the folder",
) -> Path:
    """Create or replace ``path`` with what ``write(f)`` writes to the open file ``f``.

    The temporary is ``.<name>.<random>.tmp`` beside ``path``; a write that fails removes it, a
    process killed mid-write leaves it (see ``temporary_files``). Where the file system fills up
    the error is a ``DiskFull`` naming the device, the file and ``need()`` (the bytes the whole
    file needs, when the caller can tell) and ``setting`` (what moves the file elsewhere)."""
    path = Path(path)
    tmp = write_temporary(path, write, mode, need, setting)
    try:
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def write_temporary(
    path: str | Path,
    write: Callable[[IO], None],
    mode: str = "wb",
    need: Optional[Callable[[], float]] = None,
    setting: str = "the folder",
) -> Path:
    """``atomic_write``'s first half: what ``write(f)`` writes, in a temporary beside ``path``
    (``.<name>.<random>.tmp``, on the disk, readable by others) that the caller renames onto
    ``path`` (``os.replace``) or removes. Several files that must change together (token files
    and their meta.json) are written so, then renamed one after another."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the data reaches the disk before the rename can
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; outputs are shared like any file
    except BaseException as exc:
        written = Path(tmp).stat().st_size if Path(tmp).exists() else 0
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, Exception) and no_space(exc):
            raise DiskFull(path, written, need() if need else None, setting) from None
        raise
    return Path(tmp)


class DiskFull(OSError):
    """The file system of a file being written is full (ENOSPC, or the user's quota: EDQUOT).
    The message names the device and its mount point, the file, how much the file needs (where
    known) and how much is free, and ``setting``, what puts the file elsewhere."""

    def __init__(self, path: Path, written: int, need: Optional[float], setting: str):
        free = _free_bytes(path.parent)
        size = f"about {_mb(need)} needed" if need is not None else f"{_mb(written)} written when it filled up"
        super().__init__(
            errno.ENOSPC,
            f"no space left on {device_of(path.parent)} while writing {path}; "
            f"{size}, {_mb(free)} free there: free some space on it, or set "
            f"{setting} to a folder on another disk",
        )
        self.path, self.need = path, need

    def __str__(self) -> str:
        return self.strerror


def _mb(n: Optional[float]) -> str:
    return "an unknown amount" if n is None else f"{n / 1e6:,.1f} MB"


def _free_bytes(folder: Path) -> Optional[int]:
    try:
        st = os.statvfs(folder)
    except (OSError, AttributeError):  # AttributeError: Windows has no statvfs
        return None
    return st.f_bavail * st.f_frsize


def no_space(exc: BaseException) -> bool:
    """Whether ``exc`` or an exception it was raised from (torch.save's RuntimeError "unexpected
    pos" chains the OSError of the write beneath it) is a full disk or quota."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        # Rust's io::Error reaches Python as text only (safetensors: "... Os { code: 28, ... }").
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def device_of(folder: str | Path) -> str:
    """The device holding ``folder`` and where it is mounted ("/dev/sda1 (mounted at /data)"), as
    /proc/self/mounts says; the mount point alone where that cannot be read."""
    mount = Path(os.path.abspath(folder))
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return str(mount)
    # The last mount on a point is the one in use.
    sources = [
        _unescape(f[0]) for f in (line.split() for line in lines) if len(f) > 1 and _unescape(f[1]) == str(mount)
    ]
    return f"{sources[-1]} (mounted at {mount})" if sources else str(mount)


def _unescape(field: str) -> str:
    """A /proc/self/mounts field as the name it stands for: spaces and the like are octal (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def raise_if_disk_full(exc: BaseException, path: Path, setting: str) -> None:
    """``DiskFull`` for ``path`` from ``exc`` where it is a full disk (a plain write, not through
    ``atomic_write``: an append to metrics.jsonl); else nothing."""
    if no_space(exc):
        raise DiskFull(path, 0, None, setting) from None


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
def atomic_folder(path: str | Path, setting: str = "the folder") -> Iterator[Path]:
    """Create or replace the folder ``path`` with what the with-block writes into the folder it
    is given, ``.<name>.<random>.tmp`` beside ``path``; a block that fails removes it (a full
    disk: ``DiskFull``, ``setting`` naming what puts the folder elsewhere).

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
            # Outputs are shared like any file: mkdtemp makes the folder owner-only, and some
            # writers their files (safetensors 0.8 writes model.safetensors 0600).
            os.chmod(f, 0o755 if f.is_dir() else 0o644)
        os.chmod(tmp, 0o755)
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
            os.replace(path, old)  # onto the empty folder mkdtemp made: rename allows that
        os.replace(tmp, path)
    except BaseException as exc:
        written = sum(f.stat().st_size for f in tmp.rglob("*") if f.is_file()) if tmp.is_dir() else 0
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not path.exists():
            os.replace(old, path)
        if isinstance(exc, Exception) and no_space(exc):
            raise DiskFull(path, written, None, setting) from None
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
    Windows; the file is created if missing and holds the pid of its holder) for the body of the
    with-block. Leaving the block removes the file, so a folder is left as it was found.

    When another process holds it: with ``on_wait`` None raise LockHeld naming that process;
    else call ``on_wait()`` (to say why nothing happens) and wait until it lets go. Yields True
    when held, False where the file system has no locks (some network mounts: nothing is held,
    no pid is written and the file stays). OSError where ``path`` cannot be opened for writing.
    The kernel drops the lock of a process that dies; the file it leaves is taken over by the
    next holder.
    """
    path = Path(path)
    # The pid is written through the locked descriptor, once held: filelock opens the file
    # without truncating it, so a contender still reads the holder's pid.
    held: list[int] = []  # the locked descriptor, as filelock hands it to on_acquired

    def acquired(fd: int) -> None:
        held[:] = [fd]
        _write_pid(fd)

    lock = filelock.FileLock(path, on_acquired=acquired)
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
            _unlink_held(path, held[-1])
            lock.release()


def _unlink_held(path: Path, fd: int) -> None:
    """Remove the lock file whose locked descriptor is ``fd``, while it is still held, where
    ``path`` still names it. A contender that opened it before then locks a file no longer there:
    filelock sees that (no links left) and opens ``path`` anew, so one process holds it at a time."""
    try:
        if os.path.samestat(os.stat(path), os.fstat(fd)):
            path.unlink()
    except OSError:  # gone already, or a file system that refuses: the file stays, harmless
        pass


def _holder(path: Path) -> str:
    # Windows refuses to read a region another process has locked: the holder stays unknown there.
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"
