"""oelm_core.files: a write that fails part-way leaves the previous file whole, and no temporary;
one that is killed leaves a temporary that temporary_files finds; a folder's lock file is held
by one holder at a time."""

import errno
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from oelm_core.files import (
    LockHeld,
    atomic_folder,
    atomic_write,
    exclusive_lock,
    temporary_files,
    temporary_folders,
    write_text_atomic,
)

REPO = Path(__file__).resolve().parents[1]


def test_a_write_killed_half_way_keeps_the_previous_file(tmp_path):
    path = tmp_path / "summary.json"
    write_text_atomic(path, '{"status": "paused"}\n')

    def dies_half_way(f):
        f.write('{"status": "comp')
        raise KeyboardInterrupt("killed mid-write")

    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, dies_half_way, mode="w")
    assert path.read_text() == '{"status": "paused"}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


def test_a_new_file_in_a_new_folder_is_readable_by_others(tmp_path):
    path = write_text_atomic(tmp_path / "a" / "b" / "config.yaml", "name: x\n")
    assert path.read_text() == "name: x\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    atomic_write(path, lambda f: f.write(b"\x00\x01"))
    assert path.read_bytes() == b"\x00\x01"


KILLED_MID_WRITE = """import os, sys
from oelm_core.files import atomic_write

def killed(f):
    f.write(b"half a checkpoint")
    f.flush()
    os._exit(9)  # a kill: no exception handler runs

atomic_write(sys.argv[1], killed)
"""


def test_temporary_files_are_those_of_writes_killed_mid_way(tmp_path):
    """A process killed inside atomic_write leaves its temporary (a failed write removes it):
    temporary_files finds it, and neither the files nor other dot- or .tmp files of the folder."""
    write_text_atomic(tmp_path / "metrics.jsonl", "{}\n")
    for name in ("notes.tmp", ".hidden", ".step_0000004.pt"):
        (tmp_path / name).write_text("keep")
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_MID_WRITE, str(tmp_path / "step_0000004.pt")],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 9
    left = temporary_files(tmp_path)
    assert len(left) == 1 and left[0].name.startswith(".step_0000004.pt.") and left[0].suffix == ".tmp"
    assert left[0].read_bytes() == b"half a checkpoint" and not (tmp_path / "step_0000004.pt").exists()
    assert temporary_files(tmp_path, "best.pt") == [] and temporary_files(tmp_path, "step_*.pt") == left
    assert temporary_files(tmp_path / "absent") == []


def test_a_folder_is_replaced_whole_or_not_at_all(tmp_path):
    """atomic_folder: the new folder replaces the old one whole (no file of the old one stays); a
    block that fails keeps the old folder and leaves no temporary; temporary_folders finds what
    a killed one leaves."""
    out = tmp_path / "export"
    with atomic_folder(out) as tmp:
        (tmp / "model.safetensors").write_bytes(b"old")
        (tmp / "README.md").write_text("old card")
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    with atomic_folder(out) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".export.") and tmp.suffix == ".tmp"
        (tmp / "model.safetensors").write_bytes(b"new")
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"new"
    with pytest.raises(KeyboardInterrupt):
        with atomic_folder(out) as tmp:
            (tmp / "model.safetensors").write_bytes(b"half")
            raise KeyboardInterrupt("killed mid-write")
    assert (out / "model.safetensors").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"] and temporary_folders(tmp_path) == []
    (tmp_path / ".export.a1b2c3.tmp").mkdir()
    (tmp_path / ".export.d4e5f6.old").mkdir()
    (tmp_path / ".notes.tmp").write_text("a file: temporary_files' business")
    assert [p.name for p in temporary_folders(tmp_path)] == [".export.a1b2c3.tmp", ".export.d4e5f6.old"]


# Two holders in one process: flock locks belong to an open file description, and each
# exclusive_lock (a filelock.FileLock of its own) opens its own, so the second contends with the
# first as another process would.


def test_a_held_lock_refuses_a_second_holder_naming_the_first(tmp_path):
    pytest.importorskip("fcntl")
    path = tmp_path / ".lock"
    path.write_text("stale 999\n")
    with exclusive_lock(path) as locked:
        assert locked is True and path.read_text() == f"{os.getpid()}\n"
        with pytest.raises(LockHeld) as refused:
            with exclusive_lock(path):
                pytest.fail("entered a lock that is held")
        assert refused.value.holder == str(os.getpid())
    with exclusive_lock(path) as locked:  # released on leaving the block
        assert locked is True


def test_a_lock_held_by_a_writer_that_left_no_pid_names_an_unknown_holder(tmp_path):
    fcntl = pytest.importorskip("fcntl")
    with open(tmp_path / ".lock", "w") as other:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(LockHeld, match=r"held by process unknown$"):
            with exclusive_lock(tmp_path / ".lock"):
                pass


def test_a_waiting_holder_says_so_and_enters_when_the_first_leaves(tmp_path):
    pytest.importorskip("fcntl")
    path = tmp_path / ".prepare.lock"
    events = []
    waiting = threading.Event()

    def second():
        with exclusive_lock(path, on_wait=lambda: (events.append("waiting"), waiting.set())) as locked:
            events.append(("entered", locked))

    with exclusive_lock(path):
        thread = threading.Thread(target=second)
        thread.start()
        assert waiting.wait(60)
        time.sleep(0.2)  # time enough to enter, were the lock not held
        assert events == ["waiting"]
    thread.join(60)
    assert events == ["waiting", ("entered", True)]


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP])
def test_on_a_file_system_without_locks_nothing_is_held_and_no_pid_is_written(tmp_path, monkeypatch, code):
    """Some network mounts have no locks: flock fails with ENOLCK there; where flock is not
    implemented at all (ENOSYS, some FUSE file systems: EOPNOTSUPP) it is the same."""
    fcntl = pytest.importorskip("fcntl")

    def refuses(f, operation):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", refuses)
    path = tmp_path / ".lock"
    with exclusive_lock(path) as locked:
        assert locked is False and path.read_text() == ""
        with exclusive_lock(path) as second:  # nothing stops a second holder
            assert second is False
    assert path.read_text() == ""


def test_a_lock_file_that_cannot_be_made_is_an_os_error(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(OSError):
        with exclusive_lock(tmp_path / "file" / ".lock"):
            pytest.fail("entered a lock that has no file")
