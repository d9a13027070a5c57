"""oelm_core.files: a write that fails part-way leaves the previous file whole, and no temporary."""

import stat

import pytest

from oelm_core.files import atomic_write, write_text_atomic


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
