"""oelm_core.files: a write that fails part-way leaves the previous file whole, and no temporary;
one that is killed leaves a temporary that temporary_files finds."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from oelm_core.files import atomic_write, temporary_files, write_text_atomic

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
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, str(tmp_path / "step_0000004.pt")],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 9
    left = temporary_files(tmp_path)
    assert len(left) == 1 and left[0].name.startswith(".step_0000004.pt.") and left[0].suffix == ".tmp"
    assert left[0].read_bytes() == b"half a checkpoint" and not (tmp_path / "step_0000004.pt").exists()
    assert temporary_files(tmp_path, "best.pt") == [] and temporary_files(tmp_path, "step_*.pt") == left
    assert temporary_files(tmp_path / "absent") == []
