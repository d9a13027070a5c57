"""The training loop on CPU (oelm_core.train): learning, freezing, progressive unfreezing, what
it logs and summarises, clear errors and divergence handling. Resume: test_resume.py; the step:
test_step.py; processes and DDP: test_distributed.py; the run folder: test_run_folder.py."""

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import FOLDED_VOCAB
from train_helpers import REPO, losses, params, qk_weights, run, write_params

from oelm_core.accounting import count_parameters, flops_per_token
from oelm_core.batches import eval_batches
from oelm_core.checkpoint import load_checkpoint, model_from_state
from oelm_core.config import ConfigError, ModelConfig, run_config_from_dict
from oelm_core.export import load_safetensors
from oelm_core.model import GPT, build_model
from oelm_core.train import main

pytestmark = pytest.mark.usefixtures("no_data_override")


def test_throughput_window_ends_after_waiting_for_the_device(tmp_path, folded, monkeypatch):
    """On a GPU a captured step returns before it has run; reading the loss at a log step waits
    for it. The reported tokens/s must count that wait (it once did not: a CUDA-graph run logged
    23.8M tokens/s on two GPUs that did 1.7M). Here the read is made to take 0.25 s."""
    import oelm_core.train as T

    read = T.mean_across_ranks

    def slow_read(t):
        time.sleep(0.25)
        return read(t)

    monkeypatch.setattr(T, "mean_across_ranks", slow_read)
    values = params(tmp_path, folded, steps=4, log_every=2, eval_every=4, ckpt_every=4)
    run(values)
    rows = [json.loads(line) for line in (Path(values["out_dir"]) / "metrics.jsonl").read_text().splitlines()]
    tokens_per_step = 4 * 32
    for row in rows:  # windows of 1 (step 1) and 2 steps, each with one 0.25 s read
        steps = 1 if row["step"] == 1 else 2
        assert row["tokens_per_s"] <= steps * tokens_per_step / 0.25, row


def test_loss_falls_and_run_folder(tmp_path, story_folder):
    """The real GPT-2 vocabulary: the loss starts near ln(50257) and falls."""
    values = params(
        tmp_path, story_folder, variant="gpt_base", vocab=50257, steps=30, eval_every=15, ckpt_every=15, keep_last=1
    )
    summary = run(values)
    curve = losses(values["out_dir"])
    assert curve[1] > 10.0  # ~ln(50257) at the start
    assert curve[30] < curve[1] - 4.0, curve  # the tiny corpus is learned fast
    out = Path(values["out_dir"])
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["step_0000030.pt"]  # keep_last=1
    assert {"config.yaml", "metrics.jsonl", "summary.json", "best.pt"} <= {p.name for p in out.iterdir()}
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 30
    assert summary["final_val_loss"] < 8.0 and summary["best_val_loss"] <= summary["final_val_loss"]
    assert summary["final_val_bpb"] > 0 and summary["mfu"] is None and summary["tokens_per_s"] > 0
    assert summary["gradients_by"] == "none"
    assert summary["compiled"] is False  # train.compile "auto": the CPU stays eager
    assert summary["setup_s"] > 0  # this (pytest's) process's age when the loop began
    assert summary["checkpoint_bytes"] == (out / "ckpt" / "step_0000030.pt").stat().st_size
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"lr", "grad_norm", "tokens_per_s", "tokens_seen", "epochs", "val_ppl", "val_bpb"} <= set(row)
    assert row["tokens_seen"] == 30 * 4 * 32
    # export/: best.pt's weights, loaded from safetensors and JSON, with what the run knew of them
    assert sorted(p.name for p in (out / "export").iterdir()) == ["README.md", "config.json", "model.safetensors"]
    best = load_checkpoint(out / "best.pt")
    exported = load_safetensors(out / "export").state_dict()
    assert exported.keys() == best["model"].keys()
    assert all(torch.equal(exported[k], best["model"][k]) for k in exported)
    card = json.loads((out / "export" / "config.json").read_text())["run"]
    assert card["step"] == best["step"] and card["val_loss"] == best["metrics"]["val_loss"] == summary["best_val_loss"]
    assert (card["variant"], card["seed"], card["run_status"], card["run_steps"]) == ("gpt_base", 42, "completed", 30)


def test_process_age_counts_from_the_process_start():
    """summary.json's setup_s: a fresh process that waits 1.5 s before asking is at least that old,
    and not minutes older (the clock ticks and the boot-relative start time agree)."""
    code = "import time; time.sleep(1.5); from oelm_core.occupancy import process_age_s; print(process_age_s())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert 1.5 <= float(out.stdout) < 60, out.stdout


def _mean_loss(model, batches) -> float:
    with torch.no_grad():
        return sum(model(x, y).item() * y.numel() for x, y in batches) / sum(y.numel() for _, y in batches)


def test_validation_loss_is_the_models_without_dropout(tmp_path, folded):
    """With dropout 0.5 the training forward is noisy; the reported val_loss must be the eval-mode
    loss of the checkpointed weights over the validation batches (the selection half)."""
    values = params(tmp_path, folded, steps=2, eval_every=2, ckpt_every=2)
    values["model"]["dropout"] = 0.5
    summary = run(values)
    model = model_from_state(load_checkpoint(tmp_path / "run" / "ckpt" / "step_0000002.pt")).eval()
    batches = eval_batches(tmp_path / "data" / "val.bin", 32, 4, 2, part="selection")
    expected = _mean_loss(model, batches)
    assert abs(summary["final_val_loss"] - expected) < 1e-6, (summary["final_val_loss"], expected)


def test_the_reported_loss_is_the_best_weights_on_the_held_out_half(tmp_path, folded):
    """train.report_holdout: evaluations (early stopping, best.pt) read the first half of the
    validation windows; the summary's report_val_loss is best.pt's loss on the second half, whose
    windows no evaluation read; without it both are one set."""
    values = params(tmp_path, folded, steps=8, eval_every=2, ckpt_every=8)
    summary = run(values)
    best = load_checkpoint(tmp_path / "run" / "best.pt")
    assert summary["best_step"] == best["step"] and summary["best_val_loss"] == best["metrics"]["val_loss"]
    model = model_from_state(best).eval()
    val = tmp_path / "data" / "val.bin"
    selection, report = (eval_batches(val, 32, 4, 2, part=p) for p in ("selection", "report"))

    def rows(batches):
        return {tuple(r.tolist()) for x, _ in batches for r in x}

    assert not rows(selection) & rows(report)
    assert abs(summary["best_val_loss"] - _mean_loss(model, selection)) < 1e-6
    assert abs(summary["report_val_loss"] - _mean_loss(model, report)) < 1e-6
    assert abs(summary["report_val_loss"] - summary["best_val_loss"]) > 1e-4  # other windows, another loss
    assert summary["val_windows"] == {"selection": 8, "report": 8}

    values = params(tmp_path, folded, out="one_set", steps=2, eval_every=2, ckpt_every=2, report_holdout=False)
    summary = run(values)
    model = model_from_state(load_checkpoint(tmp_path / "one_set" / "best.pt")).eval()
    assert abs(summary["best_val_loss"] - _mean_loss(model, eval_batches(val, 32, 4, 2))) < 1e-6
    assert summary["report_val_loss"] is None and summary["val_windows"]["report"] == 0


def test_frozen_qk_stay_fixed(tmp_path, folded):
    values = params(tmp_path, folded, variant="oelm_freeze")
    summary = run(values)
    cfg = run_config_from_dict(values)
    initial = build_model(cfg.model_config(), seed=cfg.train.seed)
    state = load_checkpoint(Path(values["out_dir"]) / "ckpt" / "step_0000010.pt")
    trained = model_from_state(state)
    for before, after in zip(qk_weights(initial), qk_weights(trained)):
        assert torch.equal(before, after)
    assert not torch.allclose(initial.blocks[0].attn.v.weight, trained.blocks[0].attn.v.weight)
    # The optimiser holds exactly the parameters: its state covers no Q/K element.
    n_opt = sum(s["exp_avg"].numel() for s in state["optimizer"]["state"].values())
    assert n_opt == sum(p.numel() for p in trained.parameters())
    assert not any("qk" in n for n, _ in trained.named_parameters())
    assert summary["params"] == json.loads(json.dumps(count_parameters(trained)))
    assert summary["params"]["frozen"] == 2 * 2 * 64 * 64


def test_progressive_unfreezing_and_resume_across_it(tmp_path, folded):
    values = params(tmp_path, folded, out="full", steps=8, ckpt_every=1, unfreeze_schedule={5: "all"})
    run(values)
    cfg = run_config_from_dict(values)
    initial = qk_weights(build_model(cfg.model_config(), seed=cfg.train.seed))
    ckpt = Path(values["out_dir"]) / "ckpt"
    before, after = load_checkpoint(ckpt / "step_0000005.pt"), load_checkpoint(ckpt / "step_0000006.pt")
    assert before["model_config"]["freeze_qk"] == "all" and after["model_config"]["freeze_qk"] == "none"
    for w0, w5, w6 in zip(initial, qk_weights(model_from_state(before)), qk_weights(model_from_state(after))):
        assert torch.equal(w0, w5) and not torch.equal(w5, w6)
    assert len(before["optimizer"]["param_groups"]) == 2
    groups = after["optimizer"]["param_groups"]
    assert len(groups) == 3 and len(groups[2]["params"]) == 2 and groups[2]["weight_decay"] == 0.1

    # Paused before the unfreeze (step 3) and after it (step 7), each resumed to the end.
    for stop in (3, 7):
        split = params(tmp_path, folded, out=f"split{stop}", steps=8, ckpt_every=1, unfreeze_schedule={5: "all"})
        run({**split, "train": {**split["train"], "stop_after": stop}})
        run(split, resume=True)
        a, b = losses(values["out_dir"]), losses(split["out_dir"])
        assert a.keys() == b.keys()
        assert all(abs(a[s] - b[s]) <= 1e-6 for s in a), (stop, a, b)


# Progressive unfreezing in two steps of a 3-layer OELM-Freeze: layer 1 before step 2, layer 2
# before step 4; layer 0 stays frozen. The layers frozen during each step (and in its checkpoint):
UNFREEZE_IN_STEPS = {1: [1], 3: [2]}
FROZEN_AT = {1: [0, 1, 2], 2: [0, 2], 3: [0, 2], 4: [0], 5: [0]}
PEAK = 1e9  # FLOP/s, through OELM_PEAK_FLOPS: the MFU of each row then gives the FLOPs it counted


def assert_frozen_as_scheduled(out: Path) -> None:
    """Every step's checkpoint, metrics row, the summary and the export of a run trained with
    UNFREEZE_IN_STEPS agree with FROZEN_AT, each against an independent reading: the saved live
    config; which Q/K weights the step moved; the optimizer's groups and the elements it keeps
    moments for, against a model built with those layers frozen; the FLOPs behind the row's MFU
    and the summary's parameter counts, against the accounting of that model."""

    def built(frozen: list[int]) -> GPT:  # the model with exactly these layers frozen, from its config
        return build_model(
            "smoke",
            "oelm_freeze",
            block_size=32,
            vocab_size=FOLDED_VOCAB,
            n_layer=3,
            freeze_qk=frozen or "none",
            seed=42,
        )

    before = {f"blocks.{i}.attn.qk.weight": w for i, w in enumerate(qk_weights(built([0, 1, 2])))}
    rows = {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}
    for step, frozen in FROZEN_AT.items():
        state = load_checkpoint(out / "ckpt" / f"step_{step:07d}.pt")
        assert model_from_state(state).live_config().frozen_layers() == frozen, step
        assert ModelConfig(**state["model_config"]).frozen_layers() == frozen, step
        moved = [
            i
            for i in range(3)
            if not torch.equal(state["model"][f"blocks.{i}.attn.qk.weight"], before[f"blocks.{i}.attn.qk.weight"])
        ]
        assert moved == [i for i in range(3) if i not in frozen], (step, moved)
        before = {name: state["model"][name] for name in before}
        model = built(frozen)
        groups = state["optimizer"]["param_groups"]
        unfrozen_so_far = [len(layers) for at, layers in UNFREEZE_IN_STEPS.items() if at < step]
        assert [len(g["params"]) for g in groups[2:]] == unfrozen_so_far, step
        assert all(g["weight_decay"] == 0.1 for g in groups[2:])
        assert sum(len(g["params"]) for g in groups) == len(list(model.parameters())), step
        moments = sum(s["exp_avg"].numel() for s in state["optimizer"]["state"].values())
        assert moments == count_parameters(model)["trainable"], step
        flops = rows[step]["mfu"] * PEAK / rows[step]["tokens_per_s"]
        assert flops == pytest.approx(flops_per_token(model.cfg)["total"], rel=1e-9), step
    summary = json.loads((out / "summary.json").read_text())
    assert summary["params"] == json.loads(json.dumps(count_parameters(built(FROZEN_AT[5]))))
    assert summary["params"]["frozen"] == 2 * 64 * 64
    exported = json.loads((out / "export" / "config.json").read_text())
    best = load_checkpoint(out / "best.pt")["step"]
    assert exported["qk"]["frozen_layers"] == FROZEN_AT[best]
    assert ModelConfig(**exported["model_config"]).frozen_layers() == FROZEN_AT[best]


def test_progressive_unfreezing_in_steps_agrees_everywhere_and_after_a_resume(tmp_path, folded, monkeypatch):
    """Unfrozen in two steps, the model's buffers and parameters, the optimizer's groups, the
    saved live config, the accounting and the export agree after each unfreeze on which layers
    are frozen; a run paused at the second unfreeze's step and resumed agrees too, with the
    uninterrupted run's losses and weights."""
    monkeypatch.setenv("OELM_PEAK_FLOPS", str(PEAK))
    common = dict(steps=5, ckpt_every=1, eval_every=2, unfreeze_schedule=UNFREEZE_IN_STEPS)
    runs = {}
    for name, stop in (("full", 0), ("split", 3)):
        values = params(tmp_path, folded, out=name, **common)
        values["model"]["n_layer"] = 3
        if stop:
            assert run({**values, "train": {**values["train"], "stop_after": stop}})["status"] == "paused"
        assert run(values, resume=bool(stop))["status"] == "completed"
        runs[name] = Path(values["out_dir"])
        assert_frozen_as_scheduled(runs[name])
    a, b = losses(str(runs["full"])), losses(str(runs["split"]))
    assert a.keys() == b.keys() == set(FROZEN_AT)
    assert all(abs(a[s] - b[s]) <= 1e-6 for s in a), (a, b)
    last = [load_checkpoint(out / "ckpt" / "step_0000005.pt")["model"] for out in runs.values()]
    for name, tensor in last[0].items():
        torch.testing.assert_close(last[1][name], tensor, rtol=0, atol=1e-6, msg=name)


def test_clear_errors(tmp_path, folded, capsys):
    # Unknown key, through a real subprocess: exit code 2, one line that names the key and the fix.
    good = write_params(tmp_path / "p.yaml", params(tmp_path, folded, steps=4, ckpt_every=2))
    proc = subprocess.run(
        [sys.executable, "-m", "oelm_core.train", "--params", str(good), "--set", "train.stepz=5"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "train.stepz" in proc.stderr and "valid keys" in proc.stderr and "steps" in proc.stderr

    # YAML that does not parse, in the file or in --set: exit code 2 and one line naming where.
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  lr: [1\n")
    assert main(["--params", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {broken} is not valid YAML") and err.count("\n") == 1
    assert main(["--params", str(good), "--set", "train.lr=[1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --set 'train.lr=[1': the value is not valid YAML") and err.count("\n") == 1

    # Wrong type.
    assert main(["--params", str(good), "--set", "train.steps=abc"]) == 2
    err = capsys.readouterr().err
    assert "train.steps should be int" in err and "'abc'" in err

    # A value the loop cannot use.
    assert main(["--params", str(good), "--set", "train.ddp_bucket_mb=0"]) == 2
    assert "train.ddp_bucket_mb must be positive, got 0" in capsys.readouterr().err

    # Missing data folder.
    missing = dict(params(tmp_path, tmp_path / "nowhere"), out_dir=str(tmp_path / "other"))
    missing["data"]["out_dir"] = str(tmp_path / "data2")
    assert main(["--params", str(write_params(tmp_path / "m.yaml", missing))]) == 2
    err = capsys.readouterr().err
    assert "nowhere does not exist" in err and "data.source" in err

    # Truncated newest checkpoint on --resume: names the file and how to fall back.
    assert main(["--params", str(good)]) == 0
    capsys.readouterr()
    last = tmp_path / "run" / "ckpt" / "step_0000004.pt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    assert main(["--params", str(good), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "step_0000004.pt" in err and "truncated" in err
    assert f"To resume from the checkpoint before it (step_0000002.pt), delete {last}" in err

    # A second fresh start into the same folder refuses to overwrite the run.
    assert main(["--params", str(good)]) == 2
    assert "--resume" in capsys.readouterr().err


def test_a_model_vocabulary_smaller_than_the_datas_is_refused(tmp_path, story_folder):
    """The tiny preset (128 tokens) on GPT-2 token files: once a bare IndexError from
    torch.embedding at the first step; now a ConfigError before the model is built."""
    values = params(tmp_path, story_folder)
    values["preset"], values["model"] = "tiny", {}
    with pytest.raises(ConfigError) as exc:
        run(values)
    message = str(exc.value)
    assert "gpt2 ids up to 50256 (a 50257-token vocabulary), but model.vocab_size is 128 (preset tiny)" in message
    assert "a preset with the gpt2 vocabulary (medium512, small, base, large, mini, smoke)" in message
    assert "model.vocab_size: 50257" in message
    assert not (tmp_path / "run" / "ckpt").exists()


def test_divergence_stops_and_keeps_last_good_checkpoint(tmp_path, folded, monkeypatch, capsys):
    forward = GPT.forward
    calls = {"n": 0}

    def poisoned(self, idx, targets=None, cache=None):
        loss = forward(self, idx, targets, cache)
        if self.training:
            calls["n"] += 1
            if calls["n"] >= 8:  # training step 8 onwards
                return loss * float("nan")
        return loss

    monkeypatch.setattr(GPT, "forward", poisoned)
    values = params(tmp_path, folded, steps=20, ckpt_every=5, log_every=5, eval_every=5)
    assert main(["--params", str(write_params(tmp_path / "p.yaml", values))]) == 3
    err = capsys.readouterr().err
    assert "diverged at step 10" in err and "loss nan" in err and "Lower train.lr" in err
    assert "step_0000005.pt is kept" in err
    ckpt = Path(values["out_dir"]) / "ckpt"
    assert [p.name for p in ckpt.iterdir()] == ["step_0000005.pt"]
    state = load_checkpoint(ckpt / "step_0000005.pt")
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    model_from_state(state)
    summary = json.loads((Path(values["out_dir"]) / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["steps"] == 10


def test_tokens_seen_count_every_micro_batch(tmp_path, folded):
    summary = run(params(tmp_path, folded, steps=2, ckpt_every=2, eval_every=2, grad_accum=2))
    assert summary["global_batch_tokens"] == 2 * 4 * 32 and summary["tokens_seen"] == 2 * 2 * 4 * 32


# --- what a run is told before it starts (oelm_core.preflight) -------------------------------


def test_token_ids_damaged_in_place_are_refused_before_the_first_step(tmp_path, folded, capsys):
    """Ids past the vocabulary, the file's size unchanged: once a bare IndexError from the model
    at the first step; now one line naming the file, the id and the rebuild."""
    values = params(tmp_path, folded)
    run(values)  # prepares and trains: the files are good
    train_bin = tmp_path / "data" / "train.bin"
    tokens = np.fromfile(train_bin, dtype=np.uint16)
    tokens[123] = FOLDED_VOCAB + 44  # a GPT-2 id, but past this data's 256-token vocabulary
    tokens.tofile(train_bin)
    values["out_dir"] = str(tmp_path / "second")
    assert main(["--params", str(write_params(tmp_path / "p.yaml", values))]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        f"error: {train_bin} holds 1 token id(s) past the 256-token vocabulary it was "
        f"prepared with (ids 0..255), the largest 300, the first at position 123: the file was "
        f"damaged or written by something else; rebuild with `python -m oelm_core.data"
    )
    assert f"--out-dir {tmp_path / 'data'} --force`" in err and err.count("\n") == 1


def test_a_warmup_longer_than_the_run_is_named_with_what_it_does(tmp_path, folded, caplog):
    """train.steps=10 with train.warmup_steps=50 ran without a word, its learning rate never
    reaching train.lr. Warned, not refused: a short try of a long run's parameter file
    (--set train.steps=20 on a 2000-step warm-up) is a fair thing to do."""
    values = params(tmp_path, folded, steps=10, warmup_steps=50, stop_after=2)
    with caplog.at_level("INFO", logger="oelm_core.preflight"):
        run(values)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [
        "train.warmup_steps=50 is longer than the run (train.steps=10): the learning rate "
        "rises to 0.0006 at the last step and never reaches train.lr=0.003, nor decays to "
        "train.min_lr; set train.warmup_steps below train.steps (e.g. 1, a tenth of it) to train "
        "at train.lr"
    ], warned
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([0.003 / 50, 0.003 * 2 / 50])
    caplog.clear()
    with caplog.at_level("INFO", logger="oelm_core.preflight"):
        run(params(tmp_path, folded, out="other", steps=10, warmup_steps=10, stop_after=1))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_context_far_beyond_the_preset_is_costed_and_refused_before_anything_runs(
    tmp_path, story_folder, monkeypatch, capsys, caplog
):
    """model.block_size=100000 on the smoke preset sat at step 0 for minutes using gigabytes. The
    step's memory (accounting.step_memory) is said before starting, and a step that cannot fit
    the machine is refused, before the data is prepared."""
    import oelm_core.preflight as P
    import oelm_core.train as T
    from oelm_core.accounting import flops_per_token, step_memory
    from oelm_core.config import model_config

    # max_step_s 0: the time check (tests/test_preflight.py) would refuse it too
    values = params(tmp_path, story_folder, variant="gpt_base", vocab=50257, batch_size=16, max_step_s=0)
    values["model"] = {"block_size": 100_000}
    cfg = model_config("smoke", "gpt_base", block_size=100_000)
    need = step_memory(cfg, 16)
    assert 15 * 2**30 < need["total"] < 30 * 2**30  # 1.6M tokens a micro-step
    tflop = flops_per_token(cfg)["total"] * 16 * 100_000 / 1e12
    assert tflop > 100  # hours on a CPU
    path = write_params(tmp_path / "p.yaml", values)
    monkeypatch.setattr(P, "device_memory", lambda device: (8 * 2**30, "the RAM available on this machine"))
    assert main(["--params", str(path)]) == 2
    err = capsys.readouterr().err
    cost = (
        f"one training step of this run needs about {need['total'] / 2**30:.1f} GiB (weights, gradients "
        f"and AdamW state {need['state'] / 2**20:.1f} MiB, activations of 16 x 100000 tokens "
        f"{need['activations'] / 2**30:.1f} GiB) and {tflop:.1f} TFLOP a step"
    )
    assert err == (
        f"error: {cost}, more than the RAM available on this machine (8.0 GiB): lower "
        f"model.block_size (100000; the smoke preset's is 64) or train.batch_size (16; "
        f"train.grad_accum keeps the tokens a step with less memory)\n"
    ), err
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()

    # Close to what there is: a warning that names both, and the run goes on.
    monkeypatch.setattr(P, "device_memory", lambda device: (int(need["total"] * 1.1), "the RAM of a test"))
    monkeypatch.setattr(T, "Trainer", lambda *a: pytest.fail("stop here: the warning came before"))
    with caplog.at_level("INFO", logger="oelm_core.preflight"), pytest.raises(pytest.fail.Exception):
        run(values)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [
        f"{cost}: 91% of the RAM of a test ({need['total'] * 1.1 / 2**30:.1f} GiB); it may run "
        f"out of memory: lower model.block_size or train.batch_size (train.grad_accum keeps the "
        f"tokens a step with less memory)"
    ]

    # The machine's own figure: a step no machine has the memory for.
    monkeypatch.undo()
    values["model"] = {"block_size": 10_000_000}
    with pytest.raises(
        ConfigError,
        match=r"^one training step of this run needs about \d+\.\d TiB .*, more than "
        r"the RAM available on this machine \(\d+\.\d GiB\): lower model\.block_size",
    ):
        run(values)


def test_every_run_logs_what_its_step_costs(tmp_path, folded, caplog):
    from oelm_core.accounting import step_memory
    from oelm_core.config import model_config

    with caplog.at_level("INFO", logger="oelm_core.preflight"):
        run(params(tmp_path, folded, steps=1, ckpt_every=1, eval_every=1))
    need = step_memory(model_config("smoke", "oelm_freeze", block_size=32, vocab_size=FOLDED_VOCAB), 4)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("one training step"))
    assert line.startswith(
        f"one training step of this run needs about {need['total'] / 2**20:.1f} MiB "
        f"(weights, gradients and AdamW state {need['state'] / 2**20:.1f} MiB, activations "
        f"of 4 x 32 tokens {need['activations'] / 2**20:.1f} MiB) and "
    ), line
    assert " MFLOP a step; the RAM available on this machine: " in line and line.endswith(" GiB"), line
