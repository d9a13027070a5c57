"""The run folder (oelm_core.run_folder): one training session at a time, what killed writes
left removed, folders that are files refused before anything is prepared, ranks that do not
see rank 0's checkpoints refused."""

import errno
import json
import os
import socket

import pytest
import torch
from train_helpers import params, run, write_params

from oelm_core import run_folder
from oelm_core.config import ConfigError
from oelm_core.distributed import Dist
from oelm_core.run_folder import hold_run_folder
from oelm_core.train import main

pytestmark = pytest.mark.usefixtures("no_data_override")


def test_a_second_training_into_a_held_folder_is_refused_at_once(tmp_path, folded, capsys):
    """Two trainings into one out_dir once both passed the "already holds a run" check and wrote
    into each other's files. A session holds out_dir/.lock (with its pid); another is refused
    before it writes anything. Sessions one after another in one process (a sweep's in-process
    runner) each take and release it, also one that fails; released, the file goes."""
    fcntl = pytest.importorskip("fcntl")
    good = write_params(tmp_path / "p.yaml", params(tmp_path, folded, steps=2, ckpt_every=1, eval_every=2))
    out = tmp_path / "run"
    out.mkdir()
    with open(out / ".lock", "w") as held:  # another training's
        held.write("4242\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(["--params", str(good)]) == 2
        assert capsys.readouterr().err == (
            f"error: another training (pid 4242) is writing to {out}; wait for it or choose another out_dir\n"
        )
        assert [p.name for p in out.iterdir()] == [".lock"]
    assert main(["--params", str(good), "--set", "train.stop_after=1"]) == 0
    assert not (out / ".lock").exists()
    assert main(["--params", str(good)]) == 2  # fails inside the session: the folder holds a run
    assert "pass --resume" in capsys.readouterr().err
    assert main(["--params", str(good), "--resume"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


def test_a_rank_that_sees_other_checkpoints_than_rank_0_is_refused(tmp_path, monkeypatch):
    """On several nodes every rank reads the checkpoint rank 0 wrote (--resume): a node whose
    out_dir is a disk of its own would start afresh beside a resumed rank 0. Rank 1 of two is
    simulated here (rank 0's answers given): it goes on where it sees rank 0's checkpoints, and
    is refused, with what each rank sees and the fix, where it does not. The collective itself
    runs in test_distributed's two-node job."""
    out = tmp_path / "run"
    (out / "ckpt").mkdir(parents=True)
    (out / "ckpt" / "step_0000004.pt").write_bytes(b"0123456789")
    rank_0 = ("node-a", [("step_0000004.pt", 10)])
    monkeypatch.setattr(run_folder, "broadcast_object", lambda value, d: None)  # rank 0 holds the folder
    monkeypatch.setattr(run_folder, "every_rank", lambda value, d: [rank_0, value])
    rank_1 = Dist(1, 2, torch.device("cpu"), False)
    with hold_run_folder(out, rank_1):
        entered = True
    assert entered and not (out / ".lock").exists()  # rank 0 alone takes the lock
    (out / "ckpt" / "step_0000004.pt").unlink()  # rank 1's own disk: rank 0's checkpoint is not there
    with pytest.raises(ConfigError) as refused:
        with hold_run_folder(out, rank_1):
            pytest.fail("entered")
    assert str(refused.value) == (
        f"the ranks see different checkpoints in {out / 'ckpt'}: rank 0 (host node-a) finds "
        f"step_0000004.pt (10 bytes), rank 1 (host {socket.gethostname()}) finds none. Every rank reads "
        f"the checkpoint rank 0 writes: on several nodes set out_dir (and data.out_dir) to a folder on a "
        f"file system that every node shares"
    )


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.ENOSYS])
def test_a_run_folder_without_locks_is_used_with_one_warning(tmp_path, caplog, monkeypatch, code):
    """Where the file system has no locks (flock: ENOLCK, some network mounts; ENOSYS where flock
    is not implemented) a second training would not be stopped: the session says so once, and
    removes no temporaries (one may be another session's live write)."""
    fcntl = pytest.importorskip("fcntl")

    def refuses(f, operation):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", refuses)
    out = tmp_path / "run"
    live = out / "ckpt" / ".step_0000004.pt.k1l2m3.tmp"
    live.parent.mkdir(parents=True)
    live.write_bytes(b"another session's write")
    with caplog.at_level("INFO", logger="oelm_core"):
        with hold_run_folder(out, Dist(0, 1, torch.device("cpu"), False)):
            entered = True
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert entered and live.exists() and "removed" not in caplog.text
    assert warned == [f"the file system of {out} has no locks: a second training into it would not be stopped"]
    assert (out / ".lock").read_text() == ""


def test_a_session_removes_what_killed_writes_left(tmp_path, folded, caplog):
    """A write killed mid-way leaves its temporary (.step_*.pt.*.tmp: 0.5 GB at medium512; an
    export's folder .export.*.tmp); the next session, holding the folder, removes those of out_dir
    and out_dir/ckpt, nothing else."""
    values = params(tmp_path, folded, steps=4, ckpt_every=2, eval_every=2)
    run({**values, "train": {**values["train"], "stop_after": 2}})
    out = tmp_path / "run"
    (out / ".export.q1w2e3.tmp").mkdir()
    left = [
        out / "ckpt" / ".step_0000004.pt.k1l2m3.tmp",
        out / ".best.pt.a1b2c3.tmp",
        out / ".metrics.jsonl.x9y8z7.tmp",
        out / ".export.q1w2e3.tmp" / "model.safetensors",
    ]
    kept = [out / "notes.tmp", out / "ckpt" / ".keep", out / "ckpt" / "step_0000002.pt.tmp"]
    for p in left + kept:
        p.write_bytes(b"\0" * 500_000)
    with caplog.at_level("INFO", logger="oelm_core"):
        assert run(values, resume=True)["steps"] == 4
    assert [p for p in left if p.exists()] == [] and all(p.exists() for p in kept)
    assert not (out / ".export.q1w2e3.tmp").exists() and (out / "export" / "model.safetensors").is_file()
    assert "removed 4 temporaries left by writes that were killed (2.0 MB)" in caplog.text


def test_an_out_dir_that_is_a_file_is_refused_before_the_data_is_prepared(tmp_path, story_folder, capsys):
    """It was a FileExistsError traceback, after the data had been prepared."""
    (tmp_path / "run").write_text("not a folder")
    good = write_params(tmp_path / "p.yaml", params(tmp_path, story_folder, variant="gpt_base", vocab=50257))
    assert main(["--params", str(good)]) == 2
    assert capsys.readouterr().err == (
        f"error: out_dir {tmp_path / 'run'} is a file, not a folder: set out_dir to a folder\n"
    )
    assert not (tmp_path / "data").exists()
    assert main(["--params", str(good), "--set", f"out_dir={tmp_path / 'run' / 'inner'}"]) == 2
    assert f"out_dir {tmp_path / 'run' / 'inner'} lies under the file {tmp_path / 'run'}" in capsys.readouterr().err
    (tmp_path / "data").write_text("not a folder either")
    assert main(["--params", str(good), "--set", f"out_dir={tmp_path / 'run2'}"]) == 2
    assert capsys.readouterr().err == (
        f"error: data.out_dir {tmp_path / 'data'} is a file, not a folder: set data.out_dir to a folder\n"
    )


def files_of(folder) -> dict:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_run_writes_only_into_a_folder_of_its_own(tmp_path, folded, capsys, monkeypatch):
    """`out_dir: ""` trained into the current folder and overwrote the user's own config.yaml and
    summary.json there. An empty out_dir is refused; so is a folder holding files that no
    training wrote, before anything is written there. A folder a runner prepared (params.yaml,
    sweep_point.json) and a run folder of an earlier version (no .oelm-run) are run folders."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.yaml").write_text("experiment: mine\nlr: 0.1\n")
    (project / "summary.json").write_text('{"my": "results"}\n')
    (project / "notes.txt").write_text("notes\n")
    mine = files_of(project)
    monkeypatch.chdir(project)
    values = params(tmp_path, folded, steps=2, ckpt_every=2, eval_every=2)
    for out_dir in ("", "  "):
        assert main(["--params", str(write_params(tmp_path / "p.yaml", {**values, "out_dir": out_dir}))]) == 2
        assert capsys.readouterr().err == (
            "error: out_dir is empty, which would put the run into the current "
            "folder among its files: set out_dir to a folder of its own, e.g. "
            "runs/train/test\n"
        )
    for out_dir in (str(project), "."):
        assert main(["--params", str(write_params(tmp_path / "p.yaml", {**values, "out_dir": out_dir}))]) == 2
        assert capsys.readouterr().err == (
            f"error: out_dir {out_dir} holds files that no training wrote (config.yaml, notes.txt, summary.json); "
            f"a run writes config.yaml, metrics.jsonl, summary.json, best.pt, ckpt/ and export/ into its folder "
            f"and would write beside or over them: set out_dir to a new or empty folder\n"
        )
    assert files_of(project) == mine
    empty_data = {**values, "data": {**values["data"], "out_dir": ""}}
    assert main(["--params", str(write_params(tmp_path / "p.yaml", empty_data))]) == 2
    assert (
        "error: data.out_dir is empty, which would put the token files into the current folder"
        in capsys.readouterr().err
    )
    assert files_of(project) == mine

    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "params.yaml").write_text("name: test\n")
    (prepared / "sweep_point.json").write_text("{}\n")
    assert run({**values, "out_dir": str(prepared)})["status"] == "completed"
    assert (prepared / ".oelm-run").is_file() and (prepared / "params.yaml").read_text() == "name: test\n"

    older = tmp_path / "older"
    run({**values, "out_dir": str(older), "train": {**values["train"], "steps": 4, "stop_after": 2}})
    (older / ".oelm-run").unlink()
    assert run({**values, "out_dir": str(older), "train": {**values["train"], "steps": 4}}, resume=True)["steps"] == 4
    assert (older / ".oelm-run").is_file()


STARTUP_STAGES = {
    "the data": ("oelm_core.train", "prepare"),
    "its meta.json": ("oelm_core.train", "load_meta"),
    "the model": ("oelm_core.train", "build_model"),
    "the optimiser": ("oelm_core.train", "configure_optimizer"),
    "the token files": ("oelm_core.train", "TokenSampler"),
    "the validation batches": ("oelm_core.train", "eval_batches"),
    "the run's files": ("oelm_core.train", "start_files"),
}


@pytest.mark.parametrize("stage", STARTUP_STAGES)
def test_a_run_that_fails_during_start_up_leaves_no_trace(tmp_path, folded, monkeypatch, stage):
    """A failed run left its run folder behind holding a .lock, and the data cache without its
    meta.json and with its .prepare.lock. Killed (KeyboardInterrupt) at each stage of start-up,
    a run into a new folder leaves none of the folders it made, a runner's folder as the runner
    left it, and the data cache as it was; the next run trains."""
    import importlib

    values = params(tmp_path, folded, steps=2, ckpt_every=2, eval_every=2)
    data = tmp_path / "data"
    cache = files_of(data)
    module, name = STARTUP_STAGES[stage]
    module = importlib.import_module(module)
    real = getattr(module, name)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt(f"killed while setting up {stage}")

    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "params.yaml").write_text("name: test\n")
    with monkeypatch.context() as m:
        m.setattr(module, name, killed)
        for out in (tmp_path / "runs" / "new" / "run", prepared):
            with pytest.raises(KeyboardInterrupt):
                run({**values, "out_dir": str(out)})
        assert real is not getattr(module, name)
    assert not (tmp_path / "runs").exists()
    assert files_of(prepared) == {"params.yaml": b"name: test\n"}
    assert files_of(data) == cache
    assert run({**values, "out_dir": str(tmp_path / "runs" / "new" / "run")})["status"] == "completed"
