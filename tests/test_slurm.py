"""The SLURM scheduler (oelm_core.runner.slurm) against a real scheduler, not a mock.

A throw-away single-node SLURM runs on localhost for the session (``slurm_cluster``): munged with
its own key and socket, slurmctld and slurmd with a minimal slurm.conf, all in a temp dir, CPU
only, no accounting (so sacct has nothing and the runner falls back to squeue and the run
folders). It needs Debian's slurmctld, slurmd, slurm-client and munge packages (`make test`
installs them as root with apt, as it does Chromium) and root: slurmd starts each job as its user.
Without them these tests skip and say why.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, write_corpus
from train_helpers import free_port, metric_rows

SBIN = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "sinfo", "scancel")


def _slurm_missing() -> str | None:
    missing = [b for b in DAEMONS + CLIENTS if shutil.which(b, path=SBIN) is None]
    if missing:
        return (
            f"no SLURM here ({', '.join(missing)} missing): apt-get install slurmctld slurmd slurm-client "
            f"munge (make test does, as root)"
        )
    if os.geteuid() != 0:
        return "the throw-away SLURM needs root (slurmd starts each job as its user)"
    return None


def _start(cmd: list[str], root: Path) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, "PATH": SBIN})
    if proc.returncode != 0:
        logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted(root.glob("*.log")))
        pytest.fail(f"{cmd[0]} did not start ({proc.returncode}): {proc.stderr}\n{logs}")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A single-node SLURM on localhost (partition ``debug``), SLURM_CONF set for the session."""
    reason = _slurm_missing()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    (root / "state").mkdir()
    (root / "spool").mkdir()
    key = root / "munge.key"  # munged refuses a key others may read
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    socket_path = root / "munge.socket"
    _start(
        [
            "munged",
            "--force",
            f"--socket={socket_path}",
            f"--key-file={key}",
            f"--pid-file={root}/munged.pid",
            f"--log-file={root}/munged.log",
            f"--seed-file={root}/munged.seed",
        ],
        root,
    )
    conf = root / "slurm.conf"
    conf.write_text(
        "\n".join(
            [
                f"ClusterName=oelmtest{os.getpid()}",
                "SlurmctldHost=localhost",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                # cred_expire: how long a requeued job waits before it may start again (SLURM's default: 120 s)
                "AuthType=auth/munge",
                f"AuthInfo=socket={socket_path},cred_expire=5",
                f"StateSaveLocation={root}/state",
                f"SlurmdSpoolDir={root}/spool",
                f"SlurmctldPidFile={root}/slurmctld.pid",
                f"SlurmdPidFile={root}/slurmd.pid",
                f"SlurmctldLogFile={root}/slurmctld.log",
                f"SlurmdLogFile={root}/slurmd.log",
                # no cgroups in a container: processes tracked by their parents, no task binding
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "SchedulerType=sched/builtin",
                "SchedulerParameters=sched_interval=1",  # a requeued job starts within a second of its BeginTime
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "MpiDefault=none",
                "ReturnToService=2",
                "KillWait=5",
                f"NodeName=localhost NodeHostname={socket.gethostname()} CPUs={os.cpu_count()} "
                "RealMemory=2000 State=UNKNOWN",
                "PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )
    )
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(conf)
    try:
        _start(["slurmctld"], root)
        _start(["slurmd", "-N", "localhost"], root)
        deadline = time.monotonic() + 30
        while subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True).stdout.strip() != "idle":
            if time.monotonic() > deadline:
                pytest.fail("the node did not become idle in 30 s:\n" + (root / "slurmctld.log").read_text()[-3000:])
            time.sleep(0.2)
        yield root
    finally:
        subprocess.run(["scancel", "-u", "root"], capture_output=True)
        for daemon in ("slurmd", "slurmctld", "munged"):
            pid_file = root / f"{daemon}.pid"
            if pid_file.is_file():
                try:
                    os.kill(int(pid_file.read_text().split()[0]), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before


TINY = [
    "train.batch_size=2",
    "model.block_size=32",
    "train.eval_batches=1",
    "train.warmup_steps=1",
    "train.log_every=1",
    "train.progress=false",
]


def _runner(plan: Path, out: Path, base: Path, *args: str, popen: bool = False, threads: int | None = None):
    env = dict(os.environ, OELM_DATA=str(base / "stories"), PYTHONPATH=str(REPO))
    if threads:  # the jobs' OMP_NUM_THREADS (slurm.cpus_per_task): the same arithmetic, bit for bit
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [
        sys.executable,
        "-m",
        "oelm_core",
        "run",
        str(plan),
        "--out",
        str(out),
        "--set",
        f"data.out_dir={base / 'data'}",
        *args,
    ]
    if popen:
        return subprocess.Popen(cmd, cwd=base, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=base, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def stories(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("slurm_runs")
    write_corpus(base / "stories")
    return base


def _losses(run_dir: Path) -> dict:
    """(step, "train_loss" or "val_loss") -> the loss of that step's metrics row."""
    return {
        (s, k): r[k]
        for s, r in metric_rows(str(run_dir)).items()
        for k in ("train_loss", "val_loss")
        if r.get(k) is not None
    }


@pytest.mark.slow  # ~45 s on 2 cores: three jobs, the analysis notebook, the same study locally
def test_a_study_on_slurm_trains_as_jobs_and_tabulates_like_the_local_launcher(slurm_cluster, stories):
    """The smoke study's three trainings as SLURM jobs, then its analysis notebook: the same
    figures, run for run and in results.json's table, as the same study trained locally."""
    sets = [s for t in TINY + ["train.steps=4", "train.eval_every=2", "train.ckpt_every=4"] for s in ("--set", t)]
    study = REPO / "parameters" / "study_smoke.yaml"
    on_slurm = _runner(
        study,
        stories / "slurm",
        stories,
        "--launcher",
        "slurm",
        *sets,
        "--set",
        "experiment.notebooks=[03_training,04_analysis]",
        "--set",
        "experiment.slurm.poll_s=0.5",
        "--set",
        "experiment.slurm.cpus_per_task=1",
        "--set",
        "experiment.parameters.04_analysis.max_new_tokens=4",
    )
    assert on_slurm.returncode == 0, on_slurm.stdout[-4000:] + on_slurm.stderr[-4000:]
    local = _runner(
        study,
        stories / "local",
        stories,
        "--runner",
        "inprocess",
        *sets,
        "--set",
        "experiment.notebooks=[03_training]",
        threads=1,
    )
    assert local.returncode == 0, local.stdout[-4000:] + local.stderr[-4000:]

    out = on_slurm.stdout
    for name in ("gpt_base_s42", "oelm_nofreeze_s42", "oelm_freeze_s42"):
        run_dir = stories / "slurm" / "runs" / name
        job = json.loads((run_dir / "slurm.json").read_text())["job_id"]
        assert f"submitted {name} as job {job}" in out and f"job {job} {name}: running -> done" in out
        assert (run_dir / f"slurm-{job}.out").is_file() and (run_dir / "job.sbatch").is_file()
        assert _losses(run_dir) == pytest.approx(_losses(stories / "local" / "runs" / name), abs=1e-6)
    assert "0 queued, 0 running, 3 done, 0 failed" in out and "step 2/2: 04_analysis" in out

    from oelm_core import analysis as A

    runs = A.load_runs(sorted((stories / "local" / "runs").iterdir()))
    figures = (
        "seeds",
        "val_loss",
        "val_ppl",
        "val_bpb",
        "train_loss",
        "trainable_params",
        "loss_gap_pct",
        "ppl_gap_pct",
    )  # all but speed, which differs from run to run

    def cells(rows):
        return {(r["variant"], k): r[k] for r in rows for k in figures}

    on_slurm_table = json.loads((stories / "slurm" / "results.json").read_text())["table"]
    assert len(on_slurm_table) == 3
    assert cells(on_slurm_table) == pytest.approx(cells(A.results_table(runs, "final")["rows"]), abs=1e-6)


def test_a_warned_job_checkpoints_requeues_and_ends_with_the_uninterrupted_losses(slurm_cluster, stories):
    """USR1 to the batch shell mid-run (what #SBATCH --signal=B:USR1@... sends): the training
    checkpoints and stops, the job requeues itself and resumes; its losses are those of a run
    never stopped. The runner, killed after submitting, is started again and follows the same
    job instead of submitting a second one."""
    plan = stories / "one_run.yaml"
    plan.write_text(
        yaml.safe_dump(
            {
                "experiment": {"name": "one", "slurm": {"poll_s": 0.5, "cpus_per_task": 1}},
                "name": "one",
                "preset": "smoke",
                "variant": "oelm_freeze",
                "model": {"dropout": 0.1},
                "train": {"steps": 30, "eval_every": 10, "ckpt_every": 30, "lr": 1e-3},
            }
        )
    )
    sets = [s for t in TINY for s in ("--set", t)]
    run_dir = stories / "preempted" / "one"

    first = _runner(plan, run_dir.parent, stories, "--launcher", "slurm", *sets, popen=True)
    for line in first.stdout:  # killed once its job is submitted: a runner that crashed
        if "submitted" in line:
            break
    first.kill()
    first.wait()
    job = json.loads((run_dir / "slurm.json").read_text())["job_id"]
    runner = _runner(plan, run_dir.parent, stories, "--launcher", "slurm", *sets, popen=True)

    deadline = time.monotonic() + 120
    while not any(step >= 3 for step in (metric_rows(str(run_dir)) if (run_dir / "metrics.jsonl").is_file() else {})):
        assert time.monotonic() < deadline and runner.poll() is None, "the job did not start training"
        time.sleep(0.1)
    subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
    output, _ = runner.communicate(timeout=180)
    assert runner.returncode == 0, output[-4000:]
    assert f"job {job} submitted earlier is" in output and output.count("submitted one as job") == 0

    log = (run_dir / f"slurm-{job}.out").read_text()
    assert "checkpoint saved: requeueing" in log and "(restart 1)" in log
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"
    assert json.loads((run_dir / "slurm.json").read_text())["job_id"] == job

    uninterrupted = _runner(plan, stories / "uninterrupted", stories, "--runner", "inprocess", *sets, threads=1)
    assert uninterrupted.returncode == 0, uninterrupted.stdout[-3000:] + uninterrupted.stderr[-3000:]
    assert _losses(run_dir) == pytest.approx(_losses(stories / "uninterrupted" / "one"), abs=1e-6)


def test_a_partition_slurm_does_not_have_is_named_before_any_notebook_or_data(slurm_cluster, stories, tmp_path):
    """It was named only after the data was prepared and notebooks 01-02 had run."""
    proc = _runner(
        REPO / "parameters" / "study_smoke.yaml",
        tmp_path / "bad",
        stories,
        "--launcher",
        "slurm",
        "--partition",
        "nosuch",
        "--set",
        f"data.out_dir={tmp_path / 'data'}",
    )
    assert proc.returncode == 2
    assert "SLURM has no partition 'nosuch'" in proc.stderr, proc.stderr
    assert "one of this cluster's partitions: debug" in proc.stderr, proc.stderr
    assert "step 1/4" not in proc.stdout and not (tmp_path / "bad" / "notebooks").exists()
    assert not (tmp_path / "data").exists() and not list((tmp_path / "bad").rglob("slurm.json"))


def test_an_unreachable_controller_is_named_with_the_fix_before_anything_runs(tmp_path):
    """squeue's "Could not establish a configuration source", after data and notebooks, suggested
    nothing: now `scontrol ping` is asked first (here: the controller is DOWN), and the message
    names SLURM_CONF and the check."""
    missing = [c for c in ("sbatch", "squeue", "scontrol", "sinfo") if shutil.which(c, path=SBIN) is None]
    if missing:
        pytest.skip(f"needs SLURM's client commands ({', '.join(missing)} missing)")
    conf = tmp_path / "slurm.conf"  # a controller nothing listens for
    conf.write_text(
        f"ClusterName=nowhere\nSlurmctldHost=localhost\nSlurmctldPort={free_port()}\n"
        f"AuthType=auth/munge\nAuthInfo=socket={tmp_path / 'munge.socket'}\n"
    )
    env = dict(os.environ, PATH=SBIN, PYTHONPATH=str(REPO), SLURM_CONF=str(conf))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "oelm_core",
            "run",
            str(REPO / "parameters" / "study_smoke.yaml"),
            "--out",
            str(tmp_path / "out"),
            "--launcher",
            "slurm",
            "--set",
            f"data.out_dir={tmp_path / 'data'}",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "the SLURM controller does not answer (scontrol ping:" in proc.stderr
    assert f"SLURM_CONF (now {conf})" in proc.stderr and "`scontrol ping` answers UP" in proc.stderr
    assert "step 1/4" not in proc.stdout and not (tmp_path / "data").exists()


def test_without_sbatch_the_launcher_says_where_to_run(tmp_path):
    """No SLURM commands on PATH (a laptop): a clear error before anything is written."""
    env = dict(os.environ, PATH=str(Path(sys.executable).parent), PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "oelm_core",
            "run",
            str(REPO / "parameters" / "study_smoke.yaml"),
            "--out",
            str(tmp_path / "out"),
            "--launcher",
            "slurm",
            "--set",
            "experiment.notebooks=[03_training]",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "needs SLURM's sbatch" in proc.stderr and "--launcher local" in proc.stderr, proc.stderr


def test_the_job_script_carries_the_data_and_compile_cache_environment(tmp_path, monkeypatch):
    """job.sbatch exports what a training reads from the environment where it is set here (the
    data, the BPE files, torch.compile's cache folder), and nothing of it where it is not."""
    from oelm_core.runner import load_plan
    from oelm_core.runner.plan import SlurmSettings
    from oelm_core.runner.slurm import job_script

    plan = load_plan(REPO / "parameters/study_smoke.yaml", out=tmp_path / "study")
    monkeypatch.setenv("OELM_DATA", "/shared/stories")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/shared/compile cache")
    monkeypatch.delenv("HF_HOME", raising=False)
    script = job_script(plan, plan.runs[0], SlurmSettings())
    assert "export OELM_DATA=/shared/stories" in script.splitlines()
    assert "export TORCHINDUCTOR_CACHE_DIR='/shared/compile cache'" in script.splitlines()
    assert "HF_HOME" not in script
