"""Live curves: a run's TensorBoard event files, read back through a real TensorBoard server's
HTTP API and compared with metrics.jsonl."""

import importlib.util
import json
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from train_helpers import free_port, kill_at, metric_rows, params, run

from oelm_core.live_metrics import FOLDER, TAGS
from oelm_core.train import Trainer

pytestmark = pytest.mark.usefixtures("no_data_override")


def needs_tensorboard() -> None:
    if importlib.util.find_spec("tensorboard") is None:
        pytest.skip("tensorboard is not installed (pip install -e '.[notebooks]')")


def scalars(port: int, run_name: str, tag: str):
    """[[wall_time, step, value], ...] of ``tag`` in ``run_name``, or None while not loaded."""
    query = urllib.parse.urlencode({"run": run_name, "tag": tag})
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/plugin/scalars/scalars?{query}", timeout=10) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
        return None


@pytest.mark.slow
def test_a_tensorboard_server_shows_the_runs_curves(tmp_path, folded, monkeypatch):
    """A tiny CPU run killed at step 8 and resumed from its checkpoint at step 5: TensorBoard
    serves every tag with each logged step once (the killed session's steps 6 and 7 purged, as
    metrics.jsonl cuts them), at the value metrics.jsonl holds (TensorBoard keeps float32)."""
    needs_tensorboard()
    values = params(tmp_path, folded, steps=10, eval_every=5, ckpt_every=5)
    kill_at(monkeypatch, Trainer, "train_figures", lambda trainer, *args: trainer.step == 8)
    with pytest.raises(KeyboardInterrupt):
        run(values)
    run(values, resume=True)
    rows = metric_rows(values["out_dir"])
    assert len(list((Path(values["out_dir"]) / FOLDER).glob("events.out.tfevents.*"))) == 2
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(tmp_path),
            "--port",
            str(port),
            "--host",
            "127.0.0.1",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run_name = f"run/{FOLDER}"
    try:
        deadline = time.monotonic() + 180
        while (got := scalars(port, run_name, "train/loss")) is None or len(got) < len(rows):
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline, f"TensorBoard served {got} of {len(rows)} rows"
            time.sleep(1)
        checked = 0
        for key, tag in TAGS.items():
            expected = {step: row[key] for step, row in rows.items() if row.get(key) is not None}
            if not expected:
                assert scalars(port, run_name, tag) in (None, []), tag  # mfu: no peak known on a CPU
                continue
            served = scalars(port, run_name, tag)
            assert [step for _, step, _ in served] == sorted(expected), tag  # each step once, resumed or not
            for _, step, value in served:
                assert value == pytest.approx(expected[step], rel=1e-6, abs=1e-12), (tag, step)
            checked += 1
        assert checked == len(TAGS) - 1
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_the_switch_turns_the_event_files_off(tmp_path, folded):
    values = params(tmp_path, folded, steps=2, eval_every=2, ckpt_every=2, tensorboard=False)
    run(values)
    assert not (Path(values["out_dir"]) / FOLDER).exists()
    assert (Path(values["out_dir"]) / "metrics.jsonl").is_file()
