"""The pre-flight time check (oelm_core.preflight.check_step_time): a step that even the device's
top speed would take longer than train.max_step_s over is refused before anything runs, unless
that setting is 0; the figures in the message are the estimate's."""

import pytest
import torch
from train_helpers import params, run, write_params

from oelm_core import preflight
from oelm_core.config import ConfigError, model_config
from oelm_core.preflight import device_flops, step_flops
from oelm_core.train import main

pytestmark = pytest.mark.usefixtures("no_data_override")


def test_a_step_that_would_take_hours_is_refused_unless_allowed(tmp_path, story_folder, capsys, monkeypatch):
    """model.block_size=100000 on the smoke preset fits a machine with 12 GB to spare, and its
    first step ran for over ten minutes: no log line, no checkpoint, and SIGTERM waited for it.
    Its 139 TFLOP a step take hours at a CPU's 20 GFLOP/s: refused in a second, naming
    train.max_step_s, with the figures of the estimate; with train.max_step_s: 0 it starts. On
    this machine's own measured speed a step of a million tokens' context is refused too."""
    import oelm_core.train as T
    from oelm_core.accounting import flops_per_token

    monkeypatch.setattr(preflight, "device_memory", lambda device: (2**50, "the RAM of a large machine"))
    monkeypatch.setattr(preflight, "device_flops", lambda device, processes: (2e10, "a CPU's speed"))
    values = params(tmp_path, story_folder, variant="oelm_freeze", vocab=50257, batch_size=8)
    values["model"] = {"block_size": 100_000}
    path = write_params(tmp_path / "p.yaml", values)
    assert main(["--params", str(path)]) == 2
    flops = flops_per_token(model_config("smoke", "oelm_freeze", block_size=100_000))["total"] * 8 * 100_000
    assert capsys.readouterr().err == (
        f"error: one training step of this run needs {flops / 1e12:.1f} TFLOP: at least {flops / 2e10 / 3600:.1f} h "
        f"on this CPU (20.0 GFLOP/s, a CPU's speed), more than train.max_step_s (300 s), and no log line or "
        f"checkpoint comes before it ends: lower model.block_size (100000; the smoke preset's is 64) or "
        f"train.batch_size (8), or set train.max_step_s: 0 to run it anyway\n"
    )
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()

    monkeypatch.setattr(T, "Trainer", lambda *a: pytest.fail("started"))
    with pytest.raises(pytest.fail.Exception, match="started"):
        run({**values, "train": {**values["train"], "max_step_s": 0}})
    with pytest.raises(ConfigError, match=r"train\.max_step_s must be 0 \(no limit\) or positive, got -1"):
        run({**values, "train": {**values["train"], "max_step_s": -1}})

    monkeypatch.undo()
    monkeypatch.setattr(preflight, "device_memory", lambda device: (2**50, "the RAM of a large machine"))
    values["model"] = {"block_size": 1_000_000}  # 10 PFLOP a step: past 300 s at 30 TFLOP/s
    with pytest.raises(
        ConfigError,
        match=r"^one training step of this run needs [\d.]+ TFLOP: at least [\d.]+ (h|min) on "
        r"this CPU \([\d.]+ [GT]FLOP/s, its speed measured on a 512 x 512 matmul\)",
    ):
        run(values)


def test_the_estimate_is_a_lower_bound_of_a_real_step(tmp_path, folded):
    """The check refuses only what cannot be done: its estimate (the step's FLOPs at the device's
    matmul speed) is below the time a real step of a small run takes, here on this CPU."""
    values = params(tmp_path, folded, steps=6, ckpt_every=6, eval_every=6, log_every=1, batch_size=8)
    values["model"]["block_size"] = 64
    summary = run(values)
    step_s = summary["global_batch_tokens"] / summary["tokens_per_s"]
    from oelm_core.config import run_config_from_dict

    rate, how = device_flops(torch.device("cpu"))
    assert how == "its speed measured on a 512 x 512 matmul" and rate > 1e8
    estimate = step_flops(run_config_from_dict(values)) / rate
    assert 0 < estimate < step_s, (estimate, step_s)
