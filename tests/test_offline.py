"""Offline in one documented way: `python -m oelm_core.offline DIR` writes oelm.env, which every
command reads (the environment wins); offline without a local copy, the hub's failure is one
clear line within seconds, not half a minute of retries."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from oelm_core import envfile, offline

# The variables that would point a child process at data or put the hub libraries offline.
DATA_VARIABLES = ("OELM_DATA", "TIKTOKEN_CACHE_DIR", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", envfile.VARIABLE)


def bare_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in DATA_VARIABLES}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def tiktoken_cache() -> Path:
    cache = os.environ.get("TIKTOKEN_CACHE_DIR")
    if not cache:
        pytest.skip("needs the GPT-2 BPE files: TIKTOKEN_CACHE_DIR")
    return Path(cache)


def test_offline_training_fails_at_once_with_the_fix(tmp_path):
    """The README's train command with no local data, the hub unreachable: exit 2 with the one
    line that says what to do, within seconds of starting (datasets' retries took ~26 s)."""
    if offline.hub_unreachable() is None:
        pytest.skip("the Hugging Face hub answers here: this test needs it unreachable")
    main = (
        "import sys, time; import oelm_core.train as t; start = time.perf_counter(); "
        "code = t.main(sys.argv[1:]); print(f'seconds: {time.perf_counter() - start:.2f}', file=sys.stderr); "
        "sys.exit(code)"
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            main,
            "--params",
            str(REPO / "parameters/smoke/oelm_freeze.yaml"),
            "--set",
            f"out_dir={tmp_path / 'run'}",
            f"data.out_dir={tmp_path / 'data'}",
        ],
        cwd=tmp_path,
        env=bare_env(TIKTOKEN_CACHE_DIR=str(tiktoken_cache()), **{envfile.VARIABLE: ""}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    error = next(line for line in lines if line.startswith("error: "))
    assert "could not load 'roneneldan/TinyStories' (train) from the Hugging Face hub" in error
    assert "did not answer" in error and "python -m oelm_core.offline ../shared/data" in error
    assert not any("retry" in line.lower() or "Traceback" in line for line in lines), proc.stderr
    seconds = float(lines[-1].removeprefix("seconds: "))
    assert seconds < offline.PROBE_TIMEOUT_S + 3, proc.stderr  # after the imports, which load decides


def test_a_plain_command_reads_the_settings_file(tmp_path, story_folder):
    """oelm.env written by the documented command points `python -m oelm_core.data`, run with no
    OELM_DATA or TIKTOKEN_CACHE_DIR in its environment, at the local stories."""
    cache = tiktoken_cache()
    (story_folder.parent / "tokenizer").mkdir()
    (story_folder.parent / "tokenizer" / "tiktoken_cache").symlink_to(cache)
    settings = tmp_path / "work" / "oelm.env"
    settings.parent.mkdir()
    assert offline.main([str(story_folder.parent), "--stories", str(story_folder), "--file", str(settings)]) == 0
    written = envfile.read(settings)
    assert written == {
        "OELM_DATA": str(story_folder.resolve()),
        "TIKTOKEN_CACHE_DIR": str(cache.resolve()),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "oelm_core.data", "--out-dir", str(tmp_path / "data"), "--no-progress"],
        cwd=settings.parent,
        env=bare_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads(proc.stdout)
    assert meta["source"] == str(story_folder.resolve()) and meta["train_stories"] == 120


def test_the_environment_wins_over_the_file_and_foreign_files_are_kept(tmp_path, monkeypatch, capsys):
    settings = tmp_path / "oelm.env"
    envfile.write(settings, {"OELM_DATA": "/from/file", "OELM_TEST_ONLY": "'quoted value'"}, ["a test"])
    monkeypatch.setenv(envfile.VARIABLE, str(settings))
    monkeypatch.setenv("OELM_DATA", "/from/environment")
    monkeypatch.delenv("OELM_TEST_ONLY", raising=False)
    assert envfile.load() == {"OELM_TEST_ONLY": "quoted value"}
    assert os.environ["OELM_DATA"] == "/from/environment" and os.environ["OELM_TEST_ONLY"] == "quoted value"

    foreign = tmp_path / "mine.env"
    foreign.write_text("OELM_DATA=/somewhere\n")
    with pytest.raises(FileExistsError, match="not written by oelm_core"):
        envfile.write(foreign, {"OELM_DATA": "/x"}, [])
    assert offline.main(["--off", "--file", str(foreign)]) == 2 and foreign.read_text() == "OELM_DATA=/somewhere\n"
    assert "not written by oelm_core" in capsys.readouterr().err
    assert offline.main(["--off", "--file", str(settings)]) == 0 and not settings.exists()

    foreign.write_text("OELM_DATA=/a\nnot a setting\n")
    monkeypatch.setenv(envfile.VARIABLE, str(foreign))
    assert envfile.load() == {}
    assert f"{foreign}:2: not a KEY=VALUE line" in capsys.readouterr().err


def test_the_offline_command_names_what_is_missing(tmp_path, capsys):
    assert offline.main([str(tmp_path), "--file", str(tmp_path / "oelm.env")]) == 2
    assert f"{tmp_path / 'tinystories'} has no train/ folder" in capsys.readouterr().err
    assert not (tmp_path / "oelm.env").exists()
