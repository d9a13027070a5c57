"""Provenance in every run (oelm_core.provenance, oelm_core.occupancy): the code's commit and
dirtiness, the software and device, the token files' fingerprints and where they came from, and
whether the run had its device alone, each checked against an independent reading."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from train_helpers import REPO, params, run

from oelm_core import occupancy, provenance
from oelm_core.config import DataConfig
from oelm_core.data import prepare, real_source, with_real_source

pytestmark = pytest.mark.usefixtures("no_data_override")


def git(where: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=where, capture_output=True, text=True, check=True).stdout.strip()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def clone(tmp_path) -> Path:
    """A shallow clone of this checkout's HEAD."""
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs git and a git checkout of the project")
    subprocess.run(["git", "clone", "-q", "--depth", "1", f"file://{REPO}", str(tmp_path / "clone")], check=True)
    return tmp_path / "clone"


def test_the_commit_is_the_checkouts_and_dirty_flips_with_a_tracked_file(clone, tmp_path, monkeypatch):
    monkeypatch.delenv("OELM_COMMIT", raising=False)  # it would name the commit instead of git
    clean = provenance.code_version(clone / "oelm_core")
    assert clean["commit"] == git(clone, "rev-parse", "HEAD") and len(clean["commit"]) == 40
    assert clean["dirty"] is False and clean["changed"] == [] and clean["version"]
    (clone / "notes.txt").write_text("an untracked file: not the code's state\n")
    assert provenance.code_version(clone / "oelm_core")["dirty"] is False
    with open(clone / "oelm_core" / "model.py", "a") as f:
        f.write("# edited\n")
    dirty = provenance.code_version(clone / "oelm_core")
    assert dirty["dirty"] is True and dirty["changed"] == ["oelm_core/model.py"] and dirty["n_changed"] == 1
    assert dirty["commit"] == clean["commit"]
    subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "edit"], cwd=clone, check=True
    )
    committed = provenance.code_version(clone / "oelm_core")
    assert committed["dirty"] is False and committed["commit"] == git(clone, "rev-parse", "HEAD") != clean["commit"]
    # A copy outside any checkout (an installed package): no commit, and the reason
    plain = tmp_path / "site" / "oelm_core"
    shutil.copytree(clone / "oelm_core", plain)
    copied = provenance.code_version(plain)
    assert copied["commit"] is None and copied["dirty"] is None and copied["git"].startswith("no git: ")
    assert copied["version"] == clean["version"]


def test_a_benchmark_names_the_commit_of_its_figures_and_says_when_the_tree_differs(clone, monkeypatch):
    """benchmarks/common.commit() in a clone: its short HEAD, "-dirty" once a tracked file differs (a
    GPU machine's copy of a working tree carried a .git of another state, and figures named that
    state's commit), and OELM_COMMIT where set."""
    monkeypatch.delenv("OELM_COMMIT", raising=False)

    def bench_commit(**env) -> str:
        code = "import sys; sys.path[:0] = ['.', 'benchmarks']; from common import commit; print(commit())"
        out = subprocess.run(
            [sys.executable, "-c", code],
            cwd=clone,
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            check=True,
        )
        return out.stdout.strip()

    head = git(clone, "rev-parse", "HEAD")
    assert bench_commit() == head[:7]
    with open(clone / "oelm_core" / "step.py", "a") as f:
        f.write("# edited\n")
    assert bench_commit() == head[:7] + "-dirty"
    assert bench_commit(OELM_COMMIT="0123456789abcdef0123456789abcdef01234567") == "0123456"


def test_a_token_file_rewritten_in_place_is_hashed_again(tmp_path, story_folder):
    data = DataConfig(source=str(story_folder), out_dir=str(tmp_path / "data"), num_proc=1)
    meta = prepare(data, progress=False)
    train = tmp_path / "data" / "train.bin"
    assert meta["train_sha256"] == sha256(train) and meta["val_sha256"] == sha256(tmp_path / "data" / "val.bin")
    record = provenance.data_record(real_source(data.source), data.out_dir, meta)
    assert record["train_sha256"] == meta["train_sha256"] and record["fingerprint"].startswith("meta.json")
    tokens = np.fromfile(train, dtype=np.uint16)
    tokens[0] ^= 1  # same size, other bytes: meta.json's hash no longer describes the file
    time.sleep(0.01)
    tokens.tofile(train)
    again = provenance.data_record(real_source(data.source), data.out_dir, meta)
    assert again["train_sha256"] == sha256(train) != meta["train_sha256"]
    assert again["val_sha256"] == meta["val_sha256"] and "hashed at the run's start (train" in again["fingerprint"]


def test_a_runs_summary_config_and_card_record_its_provenance(tmp_path, story_folder, monkeypatch):
    """OELM_DATA names a folder while the parameter file names the hub: config.yaml, summary.json
    and the model card name the folder; the commit is this checkout's; the fingerprints are the
    token files' sha256; a resumed session carries the earlier session's occupancy."""
    monkeypatch.setenv("OELM_DATA", str(story_folder))
    values = params(
        tmp_path,
        Path("roneneldan/TinyStories"),
        vocab=50257,
        steps=4,
        eval_every=4,
        ckpt_every=4,
        keep_last=1,
        stop_after=2,
        fused_loss=False,
    )
    values["data"]["source"] = "roneneldan/TinyStories"
    first = run(values)
    summary = run(values, resume=True)
    out, data = Path(values["out_dir"]), tmp_path / "data"
    assert summary["status"] == "completed" and first["status"] == "paused"
    prov = summary["provenance"]
    folder = str(story_folder.resolve())
    assert prov["data"]["source"] == folder
    assert yaml.safe_load((out / "config.yaml").read_text())["data"]["source"] == folder
    assert prov["data"]["train_sha256"] == sha256(data / "train.bin")
    assert prov["data"]["val_sha256"] == sha256(data / "val.bin")
    assert prov["data"]["train_tokens"] == (data / "train.bin").stat().st_size // 2
    code = prov["code"]
    if (REPO / ".git").exists() and shutil.which("git"):
        assert provenance.PACKAGE.parent == REPO
        assert code["commit"] == git(REPO, "rev-parse", "HEAD")
        assert code["dirty"] == bool(git(REPO, "status", "--porcelain", "--untracked-files=no"))
    assert prov["software"]["torch"] == torch.__version__ and prov["software"]["numpy"] == np.__version__
    assert prov["software"]["python"] == ".".join(map(str, sys.version_info[:3]))
    assert prov["device"]["type"] == "cpu" and prov["device"]["count"] == 1
    assert prov["device"]["cores"] == len(os.sched_getaffinity(0))
    assert prov["device"]["threads"] == torch.get_num_threads()
    # timed_alone: what the samples saw, in both sessions
    shared = prov["occupancy"]
    assert summary["timed_alone"] == shared["timed_alone"] and shared["samples"] >= 1
    assert shared["earlier_sessions"]["timed_alone"] == first["timed_alone"]
    assert summary["timed_alone"] == occupancy.combine(first["timed_alone"], summary["timed_alone"])
    card = (out / "export" / "README.md").read_text()
    assert f"| data | {folder} (" in card and "roneneldan/TinyStories" not in card
    assert f"sha256 train.bin `{prov['data']['train_sha256'][:16]}`" in card
    if code["commit"]:
        assert f"| code | commit `{code['commit']}`" in card
    exported = json.loads((out / "export" / "config.json").read_text())["run"]
    assert exported["train_sha256"] == prov["data"]["train_sha256"] and exported["data"] == folder

    # Other stories: the token files change, and so does the fingerprint
    with open(story_folder / "train" / "part.txt", "a") as f:
        f.write("A new story about a red kite.\n<|endoftext|>\n")
    other = run(
        {
            **values,
            "out_dir": str(tmp_path / "other"),
            "train": {**values["train"], "steps": 1, "eval_every": 1, "stop_after": 0, "tensorboard": False},
        }
    )
    assert other["provenance"]["data"]["train_sha256"] == sha256(data / "train.bin") != prov["data"]["train_sha256"]


def test_params_yaml_names_the_folder_that_oelm_data_gives(monkeypatch, tmp_path, story_folder):
    planned = {"name": "x", "data": {"source": "roneneldan/TinyStories", "out_dir": "d"}}
    monkeypatch.delenv("OELM_DATA", raising=False)
    assert with_real_source(planned)["data"]["source"] == "roneneldan/TinyStories"
    monkeypatch.chdir(tmp_path)
    assert real_source("stories") == str(story_folder.resolve())  # a relative folder, made absolute
    monkeypatch.setenv("OELM_DATA", "stories")
    assert with_real_source(planned) == {"name": "x", "data": {"source": str(story_folder.resolve()), "out_dir": "d"}}
    assert planned["data"]["source"] == "roneneldan/TinyStories"  # not changed in place


def spinner() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def test_cpu_occupancy_counts_another_process_and_not_this_one():
    """The CPU time another process took is counted, this process's own is not: each against
    the kernel's own count for that process."""
    watch = occupancy.Occupancy(torch.device("cpu"), {os.getpid()})
    busy = spinner()
    try:
        time.sleep(0.3)  # let it start
        own0, other0 = os.times(), occupancy.own_ticks({busy.pid})
        watch.sample(final=True)  # the window starts
        x = torch.randn(256, 256)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.5:  # this process works too
            x = torch.tanh(x @ x)
        watch.sample(final=True)
        own1, other1 = os.times(), occupancy.own_ticks({busy.pid})
    finally:
        busy.kill()
        busy.wait()
    window = watch.last_window
    assert abs(window["own_cpu_s"] - ((own1.user + own1.system) - (own0.user + own0.system))) < 0.1, window
    spinner_cores = (other1 - other0) / os.sysconf("SC_CLK_TCK") / window["seconds"]
    assert window["others_cores"] >= spinner_cores - 0.05, (window, spinner_cores)
    result = watch.result()
    assert result["samples"] >= 1 and result["method"] == "CPU time (/proc)"
    if spinner_cores > occupancy.OTHERS_MAX_CORES + 0.05:
        assert result["timed_alone"] is False and "other processes used" in result["evidence"]


def test_a_run_beside_a_busy_process_is_not_timed_alone(tmp_path, folded):
    busy = spinner()
    try:
        summary = run(params(tmp_path, folded, steps=40, eval_every=20, ckpt_every=40, log_every=5))
    finally:
        busy.kill()
        busy.wait()
    shared = summary["provenance"]["occupancy"]
    assert summary["timed_alone"] is False, shared
    assert shared["samples"] >= 1 and "other processes used" in shared["evidence"]


def test_the_verdict_joins_ranks_and_sessions():
    alone = {"timed_alone": True, "method": "m", "samples": 3, "evidence": "none else"}
    shared = {"timed_alone": False, "method": "m", "samples": 2, "evidence": "pid 7"}
    unknown = {"timed_alone": None, "method": "", "samples": 0, "evidence": "no tool"}
    assert occupancy.verdict([alone, alone])["timed_alone"] is True
    assert occupancy.verdict([alone, shared]) == {
        "timed_alone": False,
        "method": "m",
        "samples": 5,
        "evidence": "pid 7",
    }
    assert occupancy.verdict([alone, unknown])["timed_alone"] is None
    assert occupancy.verdict([unknown, shared])["timed_alone"] is False
    killed = occupancy.earlier_sessions({"steps": 40, "timed_alone": True}, 60)
    assert killed["timed_alone"] is None and "not of step 60" in killed["evidence"]
    assert occupancy.verdict([alone], killed)["timed_alone"] is None
    paused = occupancy.earlier_sessions(
        {"steps": 60, "timed_alone": False, "provenance": {"occupancy": {"evidence": "pid 9"}}}, 60
    )
    assert occupancy.verdict([alone], paused)["evidence"] == "pid 9"


@pytest.mark.gpu
def test_gpu_occupancy_sees_another_process_and_the_device_is_recorded():
    """Run on a GPU no other job uses: a second process holding 3 GiB there makes the verdict
    False; the device record names the card and the driver."""
    device = torch.device("cuda", 0)
    torch.zeros(1, device=device)  # this process's context: the listing shows it
    record = provenance.device_record(device, world_size=1)
    assert record["name"] == torch.cuda.get_device_name(device)
    if shutil.which("nvidia-smi"):
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True, text=True
        ).stdout.split()[0]
        assert record["driver"] == driver
    alone = occupancy.Occupancy(device, {os.getpid()})
    alone.sample(final=True)
    before = alone.result()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import torch, time; x = torch.empty(3 * 2**30, dtype=torch.uint8, "
            "device='cuda:0'); print('ready', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        watch = occupancy.Occupancy(device, {os.getpid()})
        watch.sample(final=True)
        result = watch.result()
    finally:
        holder.kill()
        holder.wait()
    assert before["samples"] >= 1 and result["samples"] >= 1
    assert result["timed_alone"] is False, (before, result)
    if result["method"].startswith("GPU processes"):
        assert f"pid {holder.pid}" in result["evidence"]


def test_a_copy_without_git_names_the_commit_it_was_given_and_hashes_its_source(tmp_path, monkeypatch):
    """A GPU machine gets the tree without .git: the record then holds OELM_COMMIT (what the
    copy says it is) and the source hash, which equals the hash of that commit's files: a run
    can be checked against the commit it claims."""
    from oelm_core.provenance import PACKAGE, code_version, source_sha256

    copy = tmp_path / "copy" / "oelm_core"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("OELM_COMMIT", "0123abc")
    record = code_version(copy)
    assert code_version()["commit"] == "0123abc"  # it wins over the git of the checkout too
    assert record["commit"] == "0123abc" and record["commit_from"] == "OELM_COMMIT" and record["dirty"] is None
    assert record["source_sha256"] == source_sha256(PACKAGE) == code_version()["source_sha256"]
    (copy / "model.py").write_text((copy / "model.py").read_text() + "\n# changed\n")
    assert code_version(copy)["source_sha256"] != record["source_sha256"]


@pytest.mark.slow
def test_a_studys_runs_record_the_folder_they_read(smoke_study):
    """The smoke study under OELM_DATA (the runner's params.yaml, the trainer's config.yaml and
    summary.json, each through notebook 03's subprocess): the folder, never the hub's id."""
    out, _ = smoke_study
    folder = str((out.parent / "stories").resolve())
    runs = sorted(p for p in (out / "runs").iterdir() if p.is_dir())
    assert len(runs) == 3
    for run_dir in runs:
        assert yaml.safe_load((run_dir / "params.yaml").read_text())["data"]["source"] == folder
        assert yaml.safe_load((run_dir / "config.yaml").read_text())["data"]["source"] == folder
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["provenance"]["data"]["source"] == folder
        assert summary["timed_alone"] in (True, False) and summary["provenance"]["occupancy"]["samples"] >= 1
