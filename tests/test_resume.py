"""What --resume checks and restores (oelm_core.resume): killed and paused runs resume to the
figures of the run that was never stopped; settings, data, schedules and global batches that
would continue another curve are refused with what to change; ended runs say how to go on."""

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from conftest import STORIES
from train_helpers import REPO, kill_at, losses, metric_rows, outputs, params, run, torchrun_train, write_params

from oelm_core.checkpoint import load_checkpoint, model_from_state, save_checkpoint
from oelm_core.config import ConfigError, DataConfig
from oelm_core.data import prepare
from oelm_core.preemption import EXIT_PREEMPTED
from oelm_core.train import Trainer, main

pytestmark = pytest.mark.usefixtures("no_data_override")


def test_resume_reproduces_uninterrupted_run(tmp_path, folded):
    full = params(tmp_path, folded, out="full", steps=12, ckpt_every=4)
    run(full)
    split = params(tmp_path, folded, out="split", steps=12, ckpt_every=4)
    paused = run({**split, "train": {**split["train"], "stop_after": 6}})
    assert paused["status"] == "paused" and paused["steps"] == 6
    done = run(split, resume=True)
    assert done["status"] == "completed" and done["steps"] == 12
    a, b = losses(full["out_dir"]), losses(split["out_dir"])  # losses() also rejects duplicate rows
    assert a.keys() == b.keys() == set(range(1, 13))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-6, (step, a[step], b[step])


def test_a_killed_run_resumes_where_it_stopped(tmp_path, folded, monkeypatch):
    """Killed at step 7 (past the checkpoint of step 4, with dropout so that the restored random
    state matters, and a half-written metrics row), resumed: the same train and val figures,
    best.pt and tokens as the run that was never stopped."""
    common = dict(steps=12, ckpt_every=4, eval_every=3)
    full = params(tmp_path, folded, out="full", **common)
    full["model"]["dropout"] = 0.1
    run(full)
    killed = params(tmp_path, folded, out="killed", **common)
    killed["model"]["dropout"] = 0.1

    from oelm_core.step import TrainStep

    real_call = TrainStep.__call__

    def dies_at_step_7(self, batches, lr, step):
        if step == 7:
            raise KeyboardInterrupt("killed")
        return real_call(self, batches, lr, step)

    monkeypatch.setattr(TrainStep, "__call__", dies_at_step_7)
    with pytest.raises(KeyboardInterrupt):
        run(killed)
    monkeypatch.setattr(TrainStep, "__call__", real_call)
    with open(Path(killed["out_dir"]) / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "train_lo')  # the kill cut a row short
    done = run(killed, resume=True)

    a, b = metric_rows(full["out_dir"]), metric_rows(killed["out_dir"])
    assert a.keys() == b.keys() == set(range(1, 13))
    for step in a:
        for key in ("train_loss", "val_loss", "tokens_seen"):
            assert (a[step].get(key) is None) == (b[step].get(key) is None), (step, key)
            if a[step].get(key) is not None:
                assert abs(a[step][key] - b[step][key]) <= 1e-6, (step, key, a[step][key], b[step][key])
    first = json.loads((Path(full["out_dir"]) / "summary.json").read_text())
    assert done["best_val_loss"] == first["best_val_loss"] and done["tokens_seen"] == first["tokens_seen"]
    best = [load_checkpoint(Path(v["out_dir"]) / "best.pt") for v in (full, killed)]
    assert best[0]["step"] == best[1]["step"]
    for name, tensor in best[0]["model"].items():
        torch.testing.assert_close(best[1]["model"][name], tensor, rtol=0, atol=1e-6, msg=name)


def test_a_run_killed_before_its_summary_reports_how_it_ended(tmp_path, folded, monkeypatch):
    """Killed after its last checkpoint but before summary.json: the earlier session's "paused"
    summary is on disk, and a resume must report the run that ended instead; so must a resume
    that finds summary.json cut short."""
    common = dict(steps=12, ckpt_every=4, eval_every=4)
    full = run(params(tmp_path, folded, out="full", **common))
    values = params(tmp_path, folded, out="killed", **common)
    assert run({**values, "train": {**values["train"], "stop_after": 6}})["status"] == "paused"
    kill_at(monkeypatch, Trainer, "write_summary", lambda self, status, *a, **k: status == "completed")
    with pytest.raises(KeyboardInterrupt):
        run(values, resume=True)
    summary = Path(values["out_dir"]) / "summary.json"
    assert json.loads(summary.read_text())["status"] == "paused"
    for _ in range(2):
        again = run(values, resume=True)
        assert (again["status"], again["steps"]) == ("completed", 12)
        assert again["final_val_loss"] == full["final_val_loss"] and again["best_val_loss"] == full["best_val_loss"]
        assert json.loads(summary.read_text()) == again
        summary.write_text(summary.read_text()[:40])  # the kill cut the file short


def test_a_run_killed_while_writing_best_pt_resumes_to_the_same_best_pt(tmp_path, folded, monkeypatch):
    """An evaluation step that is also a checkpoint step writes best.pt and step_N.pt; killed
    between the two, the resumed run must still end with the uninterrupted run's best.pt."""
    common = dict(steps=12, ckpt_every=4, eval_every=4)
    run(params(tmp_path, folded, out="full", **common))
    values = params(tmp_path, folded, out="killed", **common)
    import oelm_core.train as T

    kill_at(monkeypatch, T, "save_checkpoint", lambda state, path: Path(path).name == "best.pt" and state["step"] == 12)
    with pytest.raises(KeyboardInterrupt):
        run(values)
    run(values, resume=True)
    best = [load_checkpoint(tmp_path / out / "best.pt") for out in ("full", "killed")]
    assert best[0]["step"] == best[1]["step"] == 12
    assert best[0]["metrics"]["val_loss"] == best[1]["metrics"]["val_loss"]
    for name, tensor in best[0]["model"].items():
        assert torch.equal(tensor, best[1]["model"][name]), name


def test_a_pause_changes_neither_evaluations_nor_early_stopping(tmp_path, folded):
    """A session ended by stop_after checkpoints but does not evaluate: an extra evaluation at the
    pause would move best.pt and the early stop away from the uninterrupted run's."""
    common = dict(steps=20, eval_every=5, ckpt_every=5, lr=0.03, early_stop_patience=1)
    full = params(tmp_path, folded, out="full", **common)
    straight = run(full)
    split = params(tmp_path, folded, out="split", **common)
    paused = run({**split, "train": {**split["train"], "stop_after": 7}})
    assert paused["status"] == "paused" and paused["steps"] == 7
    resumed = run(split, resume=True)
    a, b = metric_rows(full["out_dir"]), metric_rows(split["out_dir"])
    assert [s for s in a if "val_loss" in a[s]] == [s for s in b if "val_loss" in b[s]]
    assert all(s % 5 == 0 for s in a if "val_loss" in a[s])
    for key in ("status", "steps", "best_val_loss"):
        assert straight[key] == resumed[key], key
    assert (
        load_checkpoint(Path(full["out_dir"]) / "best.pt")["step"]
        == load_checkpoint(Path(split["out_dir"]) / "best.pt")["step"]
    )


def test_resuming_a_run_that_ended_changes_nothing(tmp_path, folded):
    values = params(tmp_path, folded, steps=6, ckpt_every=3, eval_every=3)
    first = run(values)
    out = Path(values["out_dir"])
    before = outputs(out)
    again = run(values, resume=True)
    assert again == first and first["tokens_per_s"] > 0
    assert outputs(out) == before


def test_a_constant_schedule_run_extends_like_a_longer_run(tmp_path, folded):
    """With min_lr = lr the schedule does not read train.steps: more steps continue a finished
    run from its last checkpoint, and the curve is that of a run planned that long."""
    constant = dict(ckpt_every=3, eval_every=3, min_lr=3e-3)
    values = params(tmp_path, folded, steps=6, **constant)
    first = run(values)
    longer = run({**values, "train": {**values["train"], "steps": 9}}, resume=True)
    assert longer["status"] == "completed" and longer["steps"] == 9
    assert longer["wall_time_s"] > first["wall_time_s"]  # both sessions' time
    assert longer["tokens_seen"] == 9 * 4 * 32
    planned = params(tmp_path, folded, out="planned", steps=9, **constant)
    run(planned)
    a, b = metric_rows(planned["out_dir"]), metric_rows(values["out_dir"])
    assert a.keys() == b.keys() == set(range(1, 10))
    for step in a:
        assert a[step]["lr"] == b[step]["lr"] == 3e-3 * min(1, step / 2)  # 2 warm-up steps
        assert abs(a[step]["train_loss"] - b[step]["train_loss"]) <= 1e-6, (step, a[step], b[step])


def test_resume_refuses_a_step_count_that_moves_the_learning_rate(tmp_path, folded, capsys):
    """The cosine ends at train.steps: going on from a finished 10-step run with 20 steps would
    train step 11 at the learning rate of mid-schedule (it once did, and the curve jumped)."""
    values = params(tmp_path, folded, steps=10, ckpt_every=5)
    good = write_params(tmp_path / "p.yaml", values)
    assert main(["--params", str(good)]) == 0
    out = Path(values["out_dir"])
    before = outputs(out)
    capsys.readouterr()
    assert main(["--params", str(good), "--resume", "--set", "train.steps=20"]) == 2
    error = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("error: "))
    # Step 11 of 20 is mid-cosine (0.001884); the 10-step run ended at min_lr.
    assert "train.steps 10 -> 20 changes the learning rate of step 11 from 0.0003 to 0.001884" in error
    assert "Keep train.steps: 10" in error and "out_dir set to a new folder" in error
    assert "train.min_lr equal to train.lr" in error
    assert outputs(out) == before


def test_resume_refuses_settings_that_shape_the_curve(tmp_path, folded, capsys):
    values = params(tmp_path, folded, steps=8, ckpt_every=2)
    good = write_params(tmp_path / "p.yaml", values)
    assert main(["--params", str(good), "--set", "train.stop_after=4"]) == 0
    capsys.readouterr()
    data = Path(values["data"]["out_dir"])
    prepared = {p.name: p.stat().st_mtime_ns for p in data.iterdir()}
    assert (
        main(
            [
                "--params",
                str(good),
                "--resume",
                "--set",
                "train.batch_size=2",
                "train.seed=7",
                "data.max_train_stories=5",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "train.seed: 42 -> 7" in err and "train.batch_size: 4 -> 2" in err and "config.yaml" in err
    assert "data.max_train_stories: 0 -> 5" in err
    # Refused before the data is prepared: the token files the run trained on are untouched.
    assert {p.name: p.stat().st_mtime_ns for p in data.iterdir()} == prepared
    assert yaml.safe_load((Path(values["out_dir"]) / "config.yaml").read_text())["train"]["seed"] == 42
    # How often it reports may change.
    assert main(["--params", str(good), "--resume", "--set", "train.log_every=2"]) == 0
    assert json.loads((Path(values["out_dir"]) / "summary.json").read_text())["steps"] == 8


def test_a_two_rank_run_resumes_in_one_process_with_the_same_global_batch(tmp_path, folded, capsys):
    """world size x grad_accum is the global batch: a 2-rank run paused at step 3 goes on in one
    process with grad_accum 2 along the curve of a run trained that way throughout, and a
    resume that would change the global batch is refused with the grad_accum that keeps it."""
    common = dict(steps=6, eval_every=3, ckpt_every=3)
    single = params(tmp_path, folded, out="single", grad_accum=2, **common)
    run(single)
    ddp = params(tmp_path, folded, out="ddp", grad_accum=1, stop_after=3, **common)
    proc = torchrun_train(tmp_path, ddp, OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp["train"].pop("stop_after")
    resumed = write_params(tmp_path / "resumed.yaml", ddp)
    assert main(["--params", str(resumed), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "world size x train.grad_accum = 2" in err and "Resume with train.grad_accum: 2" in err
    assert main(["--params", str(resumed), "--resume", "--set", "train.grad_accum=2"]) == 0
    a, b = metric_rows(single["out_dir"]), metric_rows(ddp["out_dir"])
    assert a.keys() == b.keys() == set(range(1, 7))
    for step in a:
        for key in ("train_loss", "val_loss", "tokens_seen"):
            if key in a[step]:
                assert abs(a[step][key] - b[step][key]) < 1e-5, (step, key, a[step], b[step])


def test_one_process_may_not_change_the_global_batch_on_resume(tmp_path, folded, capsys):
    values = params(tmp_path, folded, steps=4, ckpt_every=2)
    good = write_params(tmp_path / "p.yaml", values)
    assert main(["--params", str(good), "--set", "train.stop_after=2"]) == 0
    capsys.readouterr()
    assert main(["--params", str(good), "--resume", "--set", "train.grad_accum=2"]) == 2
    assert "world size x train.grad_accum = 1" in capsys.readouterr().err


def test_resume_refuses_other_stories_and_accepts_the_same_ones_moved(tmp_path, story_folder, capsys):
    """The checkpoint records the prepared data's text and content hashes and token counts. After a story
    file changed (one name: the token counts stay), --resume is refused, naming both; the same
    stories in another folder, prepared into another data folder, resume (data.source and
    data.out_dir may change)."""
    values = params(tmp_path, story_folder, variant="gpt_base", vocab=50257, steps=4, ckpt_every=2, eval_every=2)
    good = write_params(tmp_path / "p.yaml", values)
    assert main(["--params", str(good), "--set", "train.stop_after=2"]) == 0
    trained = json.loads((tmp_path / "data" / "meta.json").read_text())
    identity = ("text_hash", "content_hash", "train_tokens", "val_tokens")
    assert load_checkpoint(tmp_path / "run" / "ckpt" / "step_0000002.pt")["data"] == {k: trained[k] for k in identity}
    moved = shutil.copytree(story_folder, tmp_path / "moved")

    part = story_folder / "train" / "part.txt"
    part.write_text(part.read_text().replace("Tom", "Tim"))
    capsys.readouterr()
    assert main(["--params", str(good), "--resume"]) == 2
    err = capsys.readouterr().err
    now = json.loads((tmp_path / "data" / "meta.json").read_text())  # prepared from the changed stories
    assert now["text_hash"] != trained["text_hash"] and now["train_tokens"] == trained["train_tokens"]
    assert err.startswith(
        f"error: cannot resume {tmp_path / 'run' / 'ckpt' / 'step_0000002.pt'}: it was "
        f"trained on other data (text hash {trained['text_hash'][:12]}..., "
        f"{trained['train_tokens']} train / {trained['val_tokens']} val tokens, from "
        f"{story_folder}) than {tmp_path / 'data'} holds now (text hash "
        f"{now['text_hash'][:12]}..., {now['train_tokens']} train / "
    ), err
    assert "out_dir set to a new folder" in err and err.count("\n") == 1
    assert sorted(p.name for p in (tmp_path / "run" / "ckpt").iterdir()) == ["step_0000002.pt"]

    assert (
        main(
            [
                "--params",
                str(good),
                "--resume",
                "--set",
                f"data.source={moved}",
                f"data.out_dir={tmp_path / 'moved_data'}",
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4


def hub_params(tmp_path: Path, story_folder: Path, datasets, monkeypatch) -> Path:
    """The parameter file of a 4-step run on the hub's TinyStories (into tmp_path/hub_data), a
    checkpoint every step; the hub is simulated: it serves story_folder's stories."""
    rows = {"train": STORIES * 20, "validation": STORIES[:3] * 10}  # story_folder's, see conftest
    monkeypatch.setattr(
        datasets, "load_dataset", lambda name, split, streaming=False: iter([{"text": t} for t in rows[split]])
    )
    monkeypatch.setattr("oelm_core.offline.hub_unreachable", lambda: None)  # and it answers
    values = params(tmp_path, story_folder, variant="gpt_base", vocab=50257, steps=4, ckpt_every=1, eval_every=2)
    values["data"] = {"source": "roneneldan/TinyStories", "out_dir": str(tmp_path / "hub_data"), "num_proc": 1}
    return write_params(tmp_path / "p.yaml", values)


def test_a_run_from_the_hub_resumes_from_a_local_copy_of_its_stories_and_back(
    tmp_path, story_folder, monkeypatch, capsys
):
    """The content hash of hub data is one of (name, column, caps), that of a folder one of its
    texts: a run trained from the hub was refused when resumed offline from a local copy of the
    same stories. Resume compares the stories' text hash, the same from either source (the hub
    is simulated: it serves story_folder's stories); other stories are still refused. A
    checkpoint from before the text hash (content hash only) resumes on the same data."""
    datasets = pytest.importorskip("datasets")
    good = hub_params(tmp_path, story_folder, datasets, monkeypatch)
    once = ["--set", "train.stop_after=1"]
    assert main(["--params", str(good), *once]) == 0
    ckpt = tmp_path / "run" / "ckpt"
    from_hub = load_checkpoint(ckpt / "step_0000001.pt")["data"]

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'roneneldan/TinyStories' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    other = shutil.copytree(story_folder, tmp_path / "other")
    part = other / "train" / "part.txt"
    part.write_text(part.read_text().replace("Tom", "Tim"))
    capsys.readouterr()
    assert (
        main(
            [
                "--params",
                str(good),
                "--resume",
                "--set",
                f"data.source={other}",
                f"data.out_dir={tmp_path / 'other_data'}",
            ]
        )
        == 2
    )
    assert f"trained on other data (text hash {from_hub['text_hash'][:12]}...," in capsys.readouterr().err

    local = ["--set", f"data.source={story_folder}", f"data.out_dir={tmp_path / 'local_data'}"]
    assert main(["--params", str(good), "--resume", *local, *once]) == 0
    from_folder = load_checkpoint(ckpt / "step_0000002.pt")["data"]
    assert from_folder["content_hash"] != from_hub["content_hash"] and from_folder == {
        **from_hub,
        "content_hash": from_folder["content_hash"],
    }
    assert main(["--params", str(good), "--resume", *once]) == 0  # back to the hub's data, cached

    # A checkpoint written before checkpoints recorded the text hash.
    state = load_checkpoint(ckpt / "step_0000003.pt")
    del state["data"]["text_hash"]
    save_checkpoint(state, ckpt / "step_0000003.pt")
    assert main(["--params", str(good), "--resume"]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4


def test_data_prepared_before_text_hashes_resumes_from_the_hub_or_a_folder(tmp_path, story_folder, monkeypatch):
    """Data folders prepared before meta.json held a text hash kept their meta, so a run on the
    hub's stories recorded no text hash and a resume from a local copy compared content hashes
    (one of the hub's name, one of the folder's texts): refused as "other data". prepare now adds
    the text hash to such a meta from the token files, without tokenising again."""
    datasets = pytest.importorskip("datasets")
    good = hub_params(tmp_path, story_folder, datasets, monkeypatch)
    folders = {"roneneldan/TinyStories": tmp_path / "hub_data", str(story_folder): tmp_path / "local_data"}
    for source, out in folders.items():
        prepare(DataConfig(source=source, out_dir=str(out), num_proc=1), progress=False)
        meta = json.loads((out / "meta.json").read_text())
        (out / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "text_hash"}))
    written = {out: (out / "train.bin").stat().st_mtime_ns for out in folders.values()}
    once = ["--set", "train.stop_after=1"]
    assert main(["--params", str(good), *once]) == 0
    local = ["--set", f"data.source={story_folder}", f"data.out_dir={tmp_path / 'local_data'}"]
    assert main(["--params", str(good), "--resume", *local, *once]) == 0

    hub, folder = (json.loads((out / "meta.json").read_text()) for out in folders.values())
    assert hub["content_hash"] != folder["content_hash"] and hub["text_hash"] == folder["text_hash"]
    assert {out: (out / "train.bin").stat().st_mtime_ns for out in folders.values()} == written
    ckpt = tmp_path / "run" / "ckpt"
    recorded = [load_checkpoint(ckpt / f"step_000000{n}.pt")["data"]["text_hash"] for n in (1, 2)]
    assert recorded == [hub["text_hash"]] * 2


def test_a_checkpoint_from_before_text_hashes_says_how_to_move_to_another_source(
    tmp_path, story_folder, monkeypatch, capsys
):
    """A checkpoint that records only the content hash cannot tell the hub's stories from the
    same ones in a folder: the refusal said "other data". It says that the stories may be the
    same and how to go on; done as it says, the run then resumes from the folder."""
    datasets = pytest.importorskip("datasets")
    good = hub_params(tmp_path, story_folder, datasets, monkeypatch)
    once = ["--set", "train.stop_after=1"]
    assert main(["--params", str(good), *once]) == 0
    path = tmp_path / "run" / "ckpt" / "step_0000001.pt"
    state = load_checkpoint(path)
    del state["data"]["text_hash"]
    save_checkpoint(state, path)
    trained = state["data"]

    local = ["--set", f"data.source={story_folder}", f"data.out_dir={tmp_path / 'local_data'}"]
    capsys.readouterr()
    assert main(["--params", str(good), "--resume", *local, *once]) == 2
    now = json.loads((tmp_path / "local_data" / "meta.json").read_text())
    err = capsys.readouterr().err
    fix = f"--set data.source=roneneldan/TinyStories data.out_dir={tmp_path / 'hub_data'}"
    assert err == (
        f"error: cannot resume {path}: it predates text hashes and records only the content hash "
        f"of its data (content hash {trained['content_hash'][:12]}..., {trained['train_tokens']} "
        f"train / {trained['val_tokens']} val tokens, from roneneldan/TinyStories), which differs "
        f"from that of {tmp_path / 'local_data'} (content hash {now['content_hash'][:12]}..., "
        f"{now['train_tokens']} train / {now['val_tokens']} val tokens, prepared from "
        f"{story_folder}). The stories may be the same (from the hub once and from a folder now, "
        f"or the other way round), which that hash cannot tell. Resume once from the source it "
        f"was trained on ({fix}) until it writes a checkpoint: that one records the text hash, "
        f"which is the same from either source\n"
    )
    assert main(["--params", str(good), "--resume", *fix.split(), *once]) == 0
    assert main(["--params", str(good), "--resume", *local]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4


def test_stray_files_in_ckpt_are_ignored_or_named(tmp_path, folded, capsys):
    """ckpt/ is the trainer's, but people put files there. A backup under another name once
    crashed every start (ValueError); it is left alone now. A step_N.pt without the training
    state (a copy of best.pt, weights saved by hand) once failed with KeyError 'sampler' or
    'run_config'; it is named now, with what to do."""
    good = write_params(tmp_path / "p.yaml", params(tmp_path, folded, steps=4, ckpt_every=2, eval_every=2, keep_last=1))
    ckpt = tmp_path / "run" / "ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / "step_0000021.bak.pt").write_bytes(b"a backup")
    assert main(["--params", str(good), "--set", "train.stop_after=2"]) == 0
    assert main(["--params", str(good), "--resume"]) == 0
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_0000004.pt", "step_0000021.bak.pt"]

    best = load_checkpoint(tmp_path / "run" / "best.pt")
    model = model_from_state(best)
    save_checkpoint({k: v for k, v in best.items() if k != "format_version"}, ckpt / "step_0000005.pt")
    save_checkpoint(
        {"model": model.state_dict(), "model_config": dataclasses.asdict(model.cfg)}, ckpt / "step_0000006.pt"
    )
    capsys.readouterr()
    for name in ("step_0000006.pt", "step_0000005.pt"):
        assert main(["--params", str(good), "--resume", "--set", "train.steps=8", "train.min_lr=3e-3"]) == 2
        assert capsys.readouterr().err == (
            f"error: {ckpt / name} holds weights only, not a training checkpoint (best.pt?); remove it from {ckpt}\n"
        )
        (ckpt / name).unlink()


def test_an_unreadable_only_checkpoint_says_that_deleting_it_restarts_the_run(tmp_path, folded, capsys):
    """The fallback once read "to resume from the checkpoint before it, delete ..." where there
    was none before it: deleting the only one starts the run again from step 0."""
    good = write_params(tmp_path / "p.yaml", params(tmp_path, folded, steps=4, ckpt_every=2, eval_every=2))
    assert main(["--params", str(good), "--set", "train.stop_after=2"]) == 0
    only = tmp_path / "run" / "ckpt" / "step_0000002.pt"
    only.write_bytes(only.read_bytes()[:-100])
    capsys.readouterr()
    assert main(["--params", str(good), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.endswith(
        f"failed finding central directory.); the file is truncated or not an OELM "
        f"checkpoint: use another checkpoint of the run folder (best.pt or an earlier step) "
        f"or train again. It is the run's only checkpoint: deleting {only} makes --resume "
        f"start the run again from step 0\n"
    ), err


def test_an_ended_run_says_what_lets_it_go_on(tmp_path, folded, caplog, monkeypatch):
    """Resuming a run that ended once said "raise train.steps (or train.early_stop_patience)",
    which --resume refuses for a cosine that reached min_lr. Now: a new out_dir for that one,
    more steps where the schedule allows them, the patience where the run stopped early; and
    each hint works."""

    def hint(values: dict) -> str:
        caplog.clear()
        with caplog.at_level("INFO", logger="oelm_core"):
            run(values, resume=True)
        return next(r.getMessage() for r in caplog.records if "already ended" in r.getMessage())

    def longer(values: dict, **train) -> dict:
        return {**values, "train": {**values["train"], **train}}

    cosine = params(tmp_path, folded, out="cosine", steps=4, ckpt_every=2, eval_every=2)
    run(cosine)
    message = hint(cosine)
    assert message.endswith(
        "already ended (completed at step 4): nothing to train; its learning rate has "
        "decayed to train.min_lr at train.steps (4) and more steps would raise it again, "
        "which --resume refuses: to train longer, train from step 0 with a larger "
        "train.steps and out_dir set to a new folder"
    ), message
    with pytest.raises(ConfigError, match="changes the learning rate of step 5"):
        run(longer(cosine, steps=6), resume=True)

    constant = params(tmp_path, folded, out="constant", steps=4, ckpt_every=2, eval_every=2, min_lr=3e-3)
    run(constant)
    assert hint(constant).endswith("(completed at step 4): nothing to train; raise train.steps to go on")
    assert run(longer(constant, steps=6), resume=True)["steps"] == 6

    # Every evaluation worse than the one before: patience 1 stops at the second (step 4).
    monkeypatch.setattr(
        Trainer, "evaluate", lambda self: {"val_loss": float(self.step), "val_ppl": 1.0, "val_bpb": 1.0}
    )
    early = params(tmp_path, folded, out="early", steps=8, ckpt_every=2, eval_every=2, early_stop_patience=1)
    assert run(early)["status"] == "stopped_early"
    assert hint(early).endswith(
        "(stopped_early at step 4): nothing to train; raise "
        "train.early_stop_patience above 1 (0 turns early stopping off) to go on"
    )
    assert run(longer(early, early_stop_patience=0), resume=True)["steps"] == 8


def test_resume_at_the_unfreeze_step(tmp_path, folded):
    full = params(tmp_path, folded, out="full", steps=8, ckpt_every=1, unfreeze_schedule={5: "all"})
    run(full)
    split = params(tmp_path, folded, out="split", steps=8, ckpt_every=1, unfreeze_schedule={5: "all"})
    run({**split, "train": {**split["train"], "stop_after": 5}})
    run(split, resume=True)
    a, b = losses(full["out_dir"]), losses(split["out_dir"])
    assert a.keys() == b.keys() and all(abs(a[s] - b[s]) <= 1e-6 for s in a)


def test_a_pause_keeps_the_count_of_evaluations_without_improvement(tmp_path, folded, monkeypatch):
    import math

    scripted = {3: 3.0, 6: 3.5, 9: 3.6, 12: 3.7, 15: 3.8}  # best at 3, then only worse

    def evaluate(self):
        v = scripted[self.step]
        return {"val_loss": v, "val_ppl": math.exp(v), "val_bpb": v}

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    common = dict(steps=15, eval_every=3, ckpt_every=3, early_stop_patience=2)
    straight = run(params(tmp_path, folded, out="full", **common))
    split = params(tmp_path, folded, out="split", **common)
    run({**split, "train": {**split["train"], "stop_after": 7}})  # paused with one bad evaluation
    resumed = run(split, resume=True)
    assert straight["status"] == resumed["status"] == "stopped_early"
    assert straight["steps"] == resumed["steps"] == 9


def test_every_session_ends_on_a_checkpoint(tmp_path, folded):
    values = params(tmp_path, folded, steps=7, ckpt_every=4, eval_every=4)
    run({**values, "train": {**values["train"], "stop_after": 5}})
    run(values, resume=True)
    names = sorted(p.name for p in (Path(values["out_dir"]) / "ckpt").iterdir())
    assert names == ["step_0000004.pt", "step_0000005.pt", "step_0000007.pt"]


@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
def test_a_stop_signal_ends_the_session_on_a_checkpoint_that_resumes_exactly(tmp_path, folded, monkeypatch, signum):
    """SLURM's warning (SIGUSR1, forwarded by the job script) or SIGTERM at step 7, between the
    checkpoints of steps 4 and 8 and off the logged steps: the CLI saves step 7, says "preempted"
    and exits 75; --resume gives the figures, best.pt and metrics rows of the run never stopped."""
    common = dict(steps=12, ckpt_every=4, eval_every=3, log_every=2)
    full = params(tmp_path, folded, out="full", **common)
    full["model"]["dropout"] = 0.1
    run(full)
    stopped = params(tmp_path, folded, out="stopped", **common)
    stopped["model"]["dropout"] = 0.1
    file = write_params(tmp_path / "stopped.yaml", stopped)

    from oelm_core.step import TrainStep

    real_call = TrainStep.__call__

    def signalled_at_step_7(self, batches, lr, step):
        if step == 7:
            os.kill(os.getpid(), signum)  # the real signal, to this process's handler
        return real_call(self, batches, lr, step)

    monkeypatch.setattr(TrainStep, "__call__", signalled_at_step_7)
    assert main(["--params", str(file)]) == EXIT_PREEMPTED
    monkeypatch.setattr(TrainStep, "__call__", real_call)
    assert signal.getsignal(signum) is signal.SIG_DFL  # the handler is gone after the session
    summary = json.loads((Path(stopped["out_dir"]) / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["steps"] == 7
    assert (Path(stopped["out_dir"]) / "ckpt" / "step_0000007.pt").is_file()
    assert not (Path(stopped["out_dir"]) / "export").exists()  # the grace time is for the checkpoint
    done = run(stopped, resume=True)

    assert done["status"] == "completed"
    a, b = metric_rows(full["out_dir"]), metric_rows(stopped["out_dir"])
    assert a.keys() == b.keys()
    for step in a:
        for key in ("train_loss", "val_loss", "tokens_seen"):
            assert a[step].get(key) == pytest.approx(b[step].get(key), abs=1e-6), (step, key)
    first = json.loads((Path(full["out_dir"]) / "summary.json").read_text())
    assert done["best_val_loss"] == pytest.approx(first["best_val_loss"], abs=1e-6)
    assert done["final_train_loss"] == pytest.approx(first["final_train_loss"], abs=1e-6)


# The training CLI, recording the batches of every step (a JSON line [step, a hash of each micro-
# batch] per step, in the file BATCHES.<rank>) and, at the step KILL_AT_STEP, killed as the step
# begins: SIGKILL, which no handler sees and no clean-up follows.
RECORDING_CLI = """import hashlib, json, os, signal, sys
from oelm_core.step import TrainStep
call = TrainStep.__call__
def recorded(self, batches, lr, step):
    if step == int(os.environ.get("KILL_AT_STEP", "0")):
        os.kill(os.getpid(), signal.SIGKILL)
    hashes = [hashlib.sha1(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest() for x, y in batches]
    with open(os.environ["BATCHES"] + "." + os.environ.get("RANK", "0"), "a") as f:
        f.write(json.dumps([step, hashes]) + "\\n")
    return call(self, batches, lr, step)
TrainStep.__call__ = recorded
from oelm_core.train import main
sys.exit(main(sys.argv[1:]))
"""


def recorded_batches(prefix: Path, rank: int = 0) -> dict[int, list[str]]:
    """{step: the hashes of its micro-batches} as RECORDING_CLI wrote them for ``rank``."""
    lines = Path(f"{prefix}.{rank}").read_text().splitlines()
    steps = [json.loads(line) for line in lines]
    assert len({s for s, _ in steps}) == len(steps), "a step recorded twice in one session"
    return dict(steps)


def recording_cli(tmp_path: Path, values: dict, batches: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "recording_cli.py"
    script.write_text(RECORDING_CLI)
    file = write_params(tmp_path / f"{Path(values['out_dir']).name}.yaml", values)
    return subprocess.run(
        [sys.executable, str(script), "--params", str(file), *args],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "BATCHES": str(batches), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def assert_same_figures(a_dir: str, b_dir: str, tolerance: float) -> None:
    a, b = metric_rows(a_dir), metric_rows(b_dir)
    assert a.keys() == b.keys()
    losses(b_dir)  # no step's row written twice
    for step in a:
        for key in ("train_loss", "val_loss", "tokens_seen"):
            assert (a[step].get(key) is None) == (b[step].get(key) is None), (step, key)
            if a[step].get(key) is not None:
                assert abs(a[step][key] - b[step][key]) <= tolerance, (step, key, a[step][key], b[step][key])


def test_a_killed_process_accumulating_micro_batches_resumes_to_the_same_batches_and_losses(tmp_path, folded):
    """grad_accum 2: a CLI process killed (SIGKILL) at step 8, two steps past its checkpoint of
    step 6, and resumed draws at steps 7..10 the very micro-batches of the run never killed, and
    ends with its losses, weights and samplers' places."""
    common = dict(steps=10, ckpt_every=3, eval_every=5, batch_size=2, grad_accum=2)
    full, killed = (params(tmp_path, folded, out=out, **common) for out in ("full", "killed"))
    proc = recording_cli(tmp_path, full, tmp_path / "full")
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = recording_cli(tmp_path, killed, tmp_path / "killed", KILL_AT_STEP="8")
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "killed" / "ckpt").iterdir()) == ["step_0000003.pt", "step_0000006.pt"]
    proc = recording_cli(tmp_path, killed, tmp_path / "resumed", "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]

    uninterrupted = recorded_batches(tmp_path / "full")
    before, after = recorded_batches(tmp_path / "killed"), recorded_batches(tmp_path / "resumed")
    assert list(before) == list(range(1, 8)) and list(after) == list(range(7, 11))
    assert all(len(hashes) == 2 for hashes in uninterrupted.values())
    assert {**before, **after} == uninterrupted
    assert_same_figures(full["out_dir"], killed["out_dir"], tolerance=1e-6)
    ends = [load_checkpoint(Path(v["out_dir"]) / "ckpt" / "step_0000010.pt") for v in (full, killed)]
    assert ends[0]["sampler"] == ends[1]["sampler"] == {"batches_drawn": 10, "virtual_world": 2}
    for name, tensor in ends[0]["model"].items():
        torch.testing.assert_close(ends[1]["model"][name], tensor, rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow
def test_two_killed_ranks_accumulating_micro_batches_resume_to_the_same_batches_and_losses(tmp_path, folded):
    """2 gloo ranks x grad_accum 2, killed (SIGKILL on both) at step 5, past the checkpoint of
    step 4, and resumed under torchrun: rank r's micro-batches m at every step are those of
    virtual rank 2r + m of one process with grad_accum 4 that was never killed, and the figures
    are its, to the rounding of another order of summation."""
    common = dict(steps=8, ckpt_every=4, eval_every=4, batch_size=2)
    single = params(tmp_path, folded, out="single", grad_accum=4, **common)
    proc = recording_cli(tmp_path, single, tmp_path / "single")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp = params(tmp_path, folded, out="ddp", grad_accum=2, **common)
    script = str(tmp_path / "recording_cli.py")
    proc = torchrun_train(
        tmp_path,
        ddp,
        (script,),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
        BATCHES=str(tmp_path / "killed"),
        KILL_AT_STEP="5",
    )
    assert proc.returncode != 0 and "Signal 9 (SIGKILL) received" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in (tmp_path / "ddp" / "ckpt").iterdir()) == ["step_0000004.pt"]
    proc = torchrun_train(
        tmp_path,
        ddp,
        (script, "--resume"),
        OMP_NUM_THREADS="1",
        PYTHONPATH=str(REPO),
        BATCHES=str(tmp_path / "resumed"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    uninterrupted = recorded_batches(tmp_path / "single")
    for rank in (0, 1):
        before, after = recorded_batches(tmp_path / "killed", rank), recorded_batches(tmp_path / "resumed", rank)
        assert list(before) == list(range(1, 5)) and list(after) == list(range(5, 9))
        assert {**before, **after} == {step: hashes[2 * rank : 2 * rank + 2] for step, hashes in uninterrupted.items()}
    assert_same_figures(single["out_dir"], ddp["out_dir"], tolerance=1e-5)
