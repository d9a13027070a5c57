"""Stop signals that no step boundary answers (oelm_core.preemption): a real training process,
stuck inside a step whose main thread runs no Python signal handler (as inside one long PyTorch
operation), ends at once on a second signal or when the wait for the boundary runs out, with the
exit status 128 + the signal, and resumes from its latest checkpoint."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from train_helpers import REPO, params, run, write_params

from oelm_core.preemption import exit_status

# A training process each, stopped by real signals: end to end.
pytestmark = [pytest.mark.usefixtures("no_data_override"), pytest.mark.slow]

# The training CLI with step 3 stuck: its main thread blocks the stop signals and sleeps, so that
# only another thread can notice them, as while the main thread is inside a long C++ operation.
STUCK_AT_STEP_3 = """import signal, sys, time
from oelm_core import preemption
from oelm_core.step import TrainStep
from oelm_core.train import main

preemption.MIN_WAIT_S = float(sys.argv[2])
real = TrainStep.__call__

def stuck(self, batches, lr, step):
    if step == 3:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT, signal.SIGUSR1})
        print("inside step 3", flush=True)
        time.sleep(600)
    return real(self, batches, lr, step)

TrainStep.__call__ = stuck
sys.exit(main(["--params", sys.argv[1]]))
"""


def stuck_training(tmp_path, values, wait_s: float) -> subprocess.Popen:
    """The training of ``values`` in a process of its own, returned once it is inside step 3."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STUCK_AT_STEP_3, str(write_params(tmp_path / "p.yaml", values)), str(wait_s)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        if line.strip() == "inside step 3":
            return proc
    proc.wait()
    pytest.fail(f"the training ended before step 3 (exit {proc.returncode}):\n{proc.stderr.read()[-3000:]}")


def ended(proc: subprocess.Popen, within: float) -> tuple[int, str, float]:
    """(exit status, stderr, seconds it took) of ``proc``, which must end within ``within`` seconds."""
    start = time.monotonic()
    try:
        _, err = proc.communicate(timeout=within)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"still running {within} s after the signal")
    return proc.returncode, err, time.monotonic() - start


def test_a_stop_signal_that_no_step_boundary_answers_ends_the_process_in_its_wait(tmp_path, folded):
    """model.block_size=100000 sat inside its first step, and SIGTERM waited for a boundary that
    never came. One SIGTERM now waits that long (here 3 s) and then ends the process, status 143,
    saying so; the checkpoint of step 2 resumes (exactly: tests/test_resume.py)."""
    values = params(tmp_path, folded, steps=4, ckpt_every=2, eval_every=2)
    proc = stuck_training(tmp_path, values, wait_s=3)
    proc.send_signal(signal.SIGTERM)
    status, err, took = ended(proc, within=60)
    assert status == exit_status(signal.SIGTERM) == 143
    assert 2.5 < took < 30, took
    assert err.endswith(
        "stopped at once by SIGTERM (no step boundary came within 3 s of it): the run resumes from "
        "its latest checkpoint with --resume; exit status 143\n"
    ), err[-2000:]
    assert sorted(p.name for p in (tmp_path / "run" / "ckpt").iterdir()) == ["step_0000002.pt"]
    assert run(values, resume=True)["status"] == "completed"


def test_a_second_sigint_ends_the_process_at_once(tmp_path, folded):
    """Ctrl-C twice: the first asks for a stop at the next boundary (which does not come), the
    second ends the process at once, status 130, long before the wait (60 s) runs out."""
    values = params(tmp_path, folded, steps=4, ckpt_every=2, eval_every=2)
    proc = stuck_training(tmp_path, values, wait_s=60)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    status, err, took = ended(proc, within=30)
    assert status == exit_status(signal.SIGINT) == 130 and took < 20, (status, took)
    assert err.endswith(
        "stopped at once by SIGINT (the second SIGINT): the run resumes from its latest checkpoint "
        "with --resume; exit status 130\n"
    ), err[-2000:]
    summary = tmp_path / "run" / "summary.json"
    assert not summary.exists() or json.loads(summary.read_text())["status"] != "completed"
