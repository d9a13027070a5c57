"""The SLURM scheduler: each training of a plan as a batch job, written as a plain sbatch script.

    python -m oelm_core run parameters/study_smoke.yaml --launcher slurm --partition gpu --time 4:00:00

Before any step of the plan (data, notebooks) it checks the scheduler: SLURM's commands on PATH,
the controller answering (``scontrol ping``), the partition asked for among the cluster's. Then
``train_runs`` writes each run folder's ``job.sbatch``, submits it with ``sbatch``, waits for the
jobs (``squeue``; ``sacct`` for a job gone from the queue, where the cluster keeps accounting), and
the runner goes on with the plan's next steps (the analysis notebook) as after local trainings.
Why scripts and not submitit: a script is what a cluster user reads and re-submits by hand
(``sbatch RUN/job.sbatch`` resumes the run), and the cluster needs nothing beyond this package;
docs/cluster.md has the details.

In each run folder:

    job.sbatch         the job script: #SBATCH lines, the environment, the training command
    slurm.json         the job id (and earlier ones): a runner started again follows the job
                       instead of submitting a second one
    slurm-<id>.out     the job's log (appended to when the job is requeued)

The job: ``python -m oelm_core.train`` (``torchrun`` for several processes, under ``srun`` on
several nodes) with ``--resume``, in the background. SLURM's warning signal
(``--signal=B:USR1@signal_s``) reaches the script, which forwards it to the training; the training
checkpoints and stops with the status "preempted" (oelm_core.preemption), and the script requeues
the job (``scontrol requeue``), which resumes from that checkpoint.
"""

from __future__ import annotations

import getpass
import json
import os
import shlex
import shutil
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional

from oelm_core.analysis.runs import FINISHED
from oelm_core.checkout import child_env
from oelm_core.config import ConfigError
from oelm_core.files import write_text_atomic
from oelm_core.runner.launch import train_command
from oelm_core.runner.plan import TRAININGS, Plan, PlannedRun, SlurmSettings
from oelm_core.runner.scheduler import Scheduler, ended, row, run_status, write_run_files

SCRIPT, RECORD = "job.sbatch", "slurm.json"
# squeue's and sacct's job states, as the runner reports them; any other state has ended the job.
QUEUED = {"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESV_DEL_HOLD", "SUSPENDED", "RESIZING"}
RUNNING = {"RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT"}
# The environment a training reads that the job script writes down (when set here), so that a
# script re-submitted from another shell trains on the same data; and torch.compile's on-disk
# cache, which a folder the nodes share lets every job of a study reuse.
CARRIED_ENV = (
    "OELM_DATA",
    "TIKTOKEN_CACHE_DIR",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "TORCHINDUCTOR_CACHE_DIR",
)
# Seconds a job must look ended, its run unfinished, before it counts as failed: a requeue passes
# through an ended state (much longer where the run was preempted and the requeue is on its way).
ENDED_WAIT_S, REQUEUE_WAIT_S = 10.0, 60.0
RDZV_PORT = 29500  # the port torchrun's rendezvous listens on, on a multi-node job's first node


# --------------------------------------------------------------------------------------------
# The job script
# --------------------------------------------------------------------------------------------


def _nproc(plan: Plan) -> int:
    """Training processes per node: one per GPU, or on CPU the 03_training nproc (1 by default)."""
    return plan.gpus_per_run or int((plan.parameters.get(TRAININGS) or {}).get("nproc", 1))


def job_script(plan: Plan, run: PlannedRun, settings: SlurmSettings) -> str:
    """The sbatch script that trains ``run`` (its params.yaml, into its run folder) with --resume."""
    run_dir = run.run_dir.resolve()
    nodes, nproc = settings.nodes, _nproc(plan)
    overrides = [
        "train.progress=false",  # a log file, not a terminal: no progress bar redraws
        f"out_dir={json.dumps(str(run_dir), ensure_ascii=False)}",
    ]
    cmd = shlex.join(train_command(run_dir / "params.yaml", overrides, nproc, resume=True, nodes=nodes))
    options = [
        f"--job-name=oelm-{plan.name}-{run.name.replace('/', '-')}",
        f"--output={run_dir}/slurm-%j.out",
        "--open-mode=append",  # a requeued job adds to its log instead of replacing it
        f"--chdir={Path.cwd()}",  # relative paths in the parameters mean what they mean here
        f"--nodes={nodes}",
        "--ntasks-per-node=1",
    ]
    options += [f"--cpus-per-task={settings.cpus_per_task}"] if settings.cpus_per_task else []
    options += [f"--gpus-per-node={plan.gpus_per_run}"] if plan.gpus_per_run else []
    options += [
        f"--{key}={getattr(settings, key)}"
        for key in ("partition", "time", "account", "mem")
        if getattr(settings, key) is not None
    ]
    options += ["--requeue", f"--signal=B:USR1@{settings.signal_s}", *settings.sbatch_args]
    env = {
        "PYTHONPATH": child_env()["PYTHONPATH"],
        "PYTHONUNBUFFERED": "1",
        **{k: os.environ[k] for k in CARRIED_ENV if k in os.environ},
        # torch would start a thread per core of the node, the other jobs' cores too
        **({"OMP_NUM_THREADS": str(settings.cpus_per_task)} if settings.cpus_per_task and nproc == 1 else {}),
        # torchrun passes these on to its workers; SIGUSR1 is not among its defaults
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
    }
    lines = [
        "#!/bin/bash",
        f"# OELM Lab: run {run.name} of the plan {plan.name} ({plan.path}),",
        "# written by the runner's SLURM scheduler (oelm_core/runner/slurm.py, docs/cluster.md).",
        f"# Re-submit by hand with: sbatch {run_dir / SCRIPT}   (it resumes from the newest checkpoint)",
        *(f"#SBATCH {o}" for o in options),
        "set -uo pipefail",
        *(f"export {k}={shlex.quote(v)}" for k, v in env.items()),
    ]
    if nodes > 1:
        lines += [
            "# torchrun on every node (srun starts one per node), meeting on the first node",
            'head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
            f'export PET_RDZV_BACKEND=c10d PET_RDZV_ENDPOINT="$head:{RDZV_PORT}" PET_RDZV_ID="$SLURM_JOB_ID"',
            f"cmd=(srun --kill-on-bad-exit=1 {cmd})",
        ]
    else:
        lines += [f"cmd=({cmd})"]
    lines += [
        f"run={shlex.quote(str(run_dir))}",
        'echo "[slurm] job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}) on $(hostname), $(date -Is)"',
        "# SLURM's warning before the time limit (or a preemption): the training saves a checkpoint",
        "# and stops with the status \"preempted\"; the job then requeues itself and resumes from it.",
        "warned=0",
        "trap 'warned=1; echo \"[slurm] USR1: asking the training to checkpoint and stop\"; "
        "kill -USR1 \"$pid\" 2>/dev/null' USR1",
        '"${cmd[@]}" &',
        "pid=$!",
        "# wait returns when the trap runs: wait again until the training has ended",
        'while :; do wait "$pid"; rc=$?; kill -0 "$pid" 2>/dev/null || break; done',
        'if [ "$warned" = 1 ] && grep -q \'"status": "preempted"\' "$run/summary.json" 2>/dev/null; then',
        '  echo "[slurm] checkpoint saved: requeueing job $SLURM_JOB_ID"',
        '  scontrol requeue "$SLURM_JOB_ID"',
        "  exit 0",
        "fi",
        'echo "[slurm] the training exited with status $rc, $(date -Is)"',
        'exit "$rc"',
    ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------
# Talking to SLURM: sbatch, squeue, sacct
# --------------------------------------------------------------------------------------------


def require_sbatch() -> None:
    """ConfigError unless SLURM's commands are on PATH."""
    missing = [c for c in ("sbatch", "squeue", "scontrol") if shutil.which(c) is None]
    if missing:
        raise ConfigError(
            f"--launcher slurm needs SLURM's {', '.join(missing)}, which this machine does not have "
            f"on PATH: run the plan on the cluster's login node (where `sbatch --version` works; "
            f"some clusters need `module load slurm` first), or train here with --launcher local"
        )


def _slurm(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def _controller_hint() -> str:
    """What to check where SLURM's controller does not answer."""
    conf = os.environ.get("SLURM_CONF")
    return (
        f"check that SLURM_CONF ({f'now {conf}' if conf else 'not set: the default /etc/slurm/slurm.conf'}) "
        f"names this cluster's slurm.conf and that `scontrol ping` answers UP here (on the cluster's "
        f"login node; some clusters need `module load slurm` first)"
    )


def check_scheduler(settings: SlurmSettings) -> None:
    """ConfigError, with the fix, unless SLURM's commands are on PATH, its controller answers
    (``scontrol ping``) and the partition ``settings`` ask for is one ``sinfo`` lists."""
    require_sbatch()
    try:
        ping = _slurm(["scontrol", "ping"])
    except subprocess.TimeoutExpired:
        raise ConfigError(
            f"the SLURM controller did not answer `scontrol ping` within 120 s; {_controller_hint()}"
        ) from None
    said = " ".join((ping.stdout + " " + ping.stderr).split())
    if ping.returncode != 0 or "DOWN" in ping.stdout or "UP" not in ping.stdout:
        raise ConfigError(f"the SLURM controller does not answer (scontrol ping: {said[:400]}); {_controller_hint()}")
    have = partitions()
    if settings.partition is not None and have and settings.partition not in have:
        raise ConfigError(
            f"SLURM has no partition {settings.partition!r}: set slurm.partition (or --partition) "
            f"to one of this cluster's partitions: {', '.join(have)}"
        )


def partitions() -> list[str]:
    """The cluster's partitions (sinfo), [] where sinfo cannot say."""
    try:
        out = _slurm(["sinfo", "-h", "-o", "%P"])
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [p.strip().rstrip("*") for p in out.stdout.split()] if out.returncode == 0 else []


def check_submission(script: Path, settings: SlurmSettings) -> None:
    """``sbatch --test-only``: ConfigError, before any job is submitted, where SLURM would refuse
    the script (a partition, account, time limit or GPU count it does not have), with the fix."""
    out = _slurm(["sbatch", "--test-only", str(script)])
    if out.returncode == 0:
        return
    why = out.stderr.strip() or out.stdout.strip()
    if "partition" in why.lower():
        have = partitions()
        fix = (
            f"set slurm.partition (or --partition) to one of this cluster's partitions: "
            f"{', '.join(have) or '(sinfo lists none)'}"
        )
    else:
        fix = (
            "change the slurm section's settings (partition, time, account, nodes, mem, sbatch_args) "
            "or --partition/--time/--account/--nodes/--gpus-per-run to what the cluster offers (`sinfo`)"
        )
    raise ConfigError(f"SLURM refuses the job script {script} (sbatch --test-only: {why}); {fix}")


def submit(script: Path) -> str:
    """Submit ``script``; its job id."""
    out = _slurm(["sbatch", "--parsable", str(script)])
    if out.returncode != 0:
        raise ConfigError(f"sbatch {script} failed: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip().split(";")[0]  # --parsable: "ID" or "ID;CLUSTER"


def queue_states() -> dict[str, tuple[str, str]]:
    """Job id -> (state, reason) of this user's jobs that squeue still lists (ended ones for
    MinJobAge, 5 minutes by default)."""
    out = _slurm(["squeue", "-h", "-t", "all", "-u", getpass.getuser(), "-o", "%i|%T|%r"])
    if out.returncode != 0:
        raise RuntimeError(f"squeue failed: {out.stderr.strip()}; {_controller_hint()}")
    states = {}
    for line in out.stdout.splitlines():
        job, state, reason = (line.split("|") + ["", ""])[:3]
        states[job.strip()] = (state.strip(), reason.strip())
    return states


def accounting_state(job_id: str) -> Optional[tuple[str, str]]:
    """(state, exit code) of a job from sacct; None where sacct does not know it or the cluster
    keeps no accounting ("Slurm accounting storage is disabled")."""
    try:
        out = _slurm(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State,ExitCode"])
    except (OSError, subprocess.TimeoutExpired):
        return None
    line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    if not line:
        return None
    state, code = (line.split("|") + [""])[:2]
    return state.split()[0], code  # "CANCELLED by 0" -> CANCELLED


# --------------------------------------------------------------------------------------------
# The runner's part: submit, follow, report
# --------------------------------------------------------------------------------------------


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def read_record(run_dir: Path) -> dict:
    try:
        record = json.loads((run_dir / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _log_tail(path: Path, n: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log yet)"


def _step(run_dir: Path) -> Optional[int]:
    """The last logged step of a run (metrics.jsonl's last row), None before the first."""
    try:
        with open(run_dir / "metrics.jsonl", "rb") as f:
            f.seek(max(0, f.seek(0, 2) - 4096))
            last = f.read().decode(errors="replace").strip().splitlines()[-1]
        return int(json.loads(last)["step"])
    except (OSError, IndexError, ValueError, KeyError, TypeError):
        return None


class Job:
    """One run's job as the runner follows it."""

    def __init__(self, run: PlannedRun, job_id: str, submitted: float):
        self.run, self.id, self.t0 = run, job_id, submitted
        self.state = "queued"  # queued, running, done, failed
        self.error: Optional[str] = None
        self.ended_s = 0.0
        self.ended_at: Optional[float] = None  # when a look first found it ended, its run unfinished

    @property
    def log(self) -> Path:
        return self.run.run_dir.resolve() / f"slurm-{self.id}.out"


class SlurmScheduler(Scheduler):
    """Each training a SLURM job (see the module's docstring), with the plan's slurm settings."""

    def check(self, plan: Plan) -> None:
        """SLURM's commands on PATH, its controller answering, the partition asked for among the
        cluster's: ConfigError with the fix, before the plan prepares data or runs a notebook."""
        check_scheduler(plan.slurm)

    def train_runs(self, plan: Plan, *, skip_done: bool, log: Callable[[str], None]) -> list[dict]:
        """Train every run as a SLURM job and wait for them; one row per run, plus job_id. A run
        whose job (slurm.json) is still queued or running is followed, not submitted again; one
        that ended is skipped; any other is submitted (and resumes)."""
        settings = plan.slurm
        rows: dict[int, dict] = {}
        jobs: dict[int, Job] = {}
        queue = queue_states()
        checked = False
        for i, run in enumerate(plan.runs):
            done = ended(plan, run, log) if skip_done else None
            if done is not None:
                rows[i] = done
                continue
            earlier = read_record(run.run_dir).get("job_id")
            if earlier is not None and queue.get(str(earlier), ("",))[0] in QUEUED | RUNNING:
                log(
                    f"{plan.tag} {run.name}: job {earlier} submitted earlier is "
                    f"{queue[str(earlier)][0].lower()}; following it"
                )
                jobs[i] = Job(run, str(earlier), time.time())
                continue
            write_run_files(run)
            script = run.run_dir / SCRIPT
            write_text_atomic(script, job_script(plan, run, settings))
            if not checked:  # the settings are the same for every job: SLURM's verdict on one stands for all
                check_submission(script, settings)
                checked = True
            job_id = submit(script)
            record = read_record(run.run_dir)
            write_text_atomic(
                run.run_dir / RECORD,
                json.dumps(
                    {
                        "job_id": job_id,
                        "submitted": _now(),
                        "script": SCRIPT,
                        "log": f"slurm-{job_id}.out",
                        "earlier_jobs": record.get("earlier_jobs", [])
                        + ([record["job_id"]] if "job_id" in record else []),
                    },
                    indent=2,
                )
                + "\n",
            )
            log(f"{plan.tag} submitted {run.name} as job {job_id}: {script}")
            jobs[i] = Job(run, job_id, time.time())
        _follow(plan, jobs, settings, log)
        for i, job in jobs.items():
            if job.state == "done":
                rows[i] = row(job.run, run_status(job.run.run_dir).get("status"), wall_s=job.ended_s, job_id=job.id)
            else:
                rows[i] = row(job.run, "failed", wall_s=job.ended_s, job_id=job.id, error=job.error)
        ordered = [rows[i] for i in range(len(plan.runs))]
        log(
            f"{plan.tag} {sum(r['status'] in FINISHED + ('skipped',) for r in ordered)}/{len(ordered)} "
            f"run(s) done on SLURM"
        )
        return ordered


def _follow(plan: Plan, jobs: dict[int, Job], settings: SlurmSettings, log: Callable[[str], None]) -> None:
    """Poll the queue until every job has ended; a line for each change of state and an overview."""
    tag = plan.tag
    while any(j.state in ("queued", "running") for j in jobs.values()):
        queue = queue_states()
        changed = False
        for job in jobs.values():
            if job.state not in ("queued", "running"):
                continue
            state, reason = queue.get(job.id) or accounting_state(job.id) or ("", "")
            summary = run_status(job.run.run_dir).get("status")
            if state in QUEUED | RUNNING:
                new, job.ended_at = ("queued" if state in QUEUED else "running"), None
            elif summary in FINISHED:
                new = "done"
            else:
                # A job that requeues itself looks ended for a moment (CANCELLED "due to job requeue"),
                # longer on a busy controller; one whose run says "preempted" has its requeue coming.
                job.ended_at = job.ended_at or time.time()
                if time.time() - job.ended_at < (REQUEUE_WAIT_S if summary == "preempted" else ENDED_WAIT_S):
                    continue
                new = "failed"
                summary = summary or "no summary.json"
                job.error = (
                    f"SLURM job {job.id} ended {state or '(gone from the queue)'}"
                    f"{f' ({reason})' if reason and reason != 'None' else ''} before the run finished "
                    f"({summary}); log: {job.log}\n  last lines:\n    " + _log_tail(job.log).replace("\n", "\n    ")
                )
            if new != job.state:
                changed = True
                if new in ("done", "failed"):
                    job.ended_s = time.time() - job.t0
                step = _step(job.run.run_dir)
                where = f", step {step}/{job.run.config.get('train', {}).get('steps', '?')}" if step else ""
                log(
                    f"{tag} job {job.id} {job.run.name}: {job.state} -> {new}{where}"
                    + (f"\n  {job.error}" if new == "failed" else "")
                )
                job.state = new
        if changed:
            counts = {s: sum(j.state == s for j in jobs.values()) for s in ("queued", "running", "done", "failed")}
            log(f"{tag} SLURM jobs: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
        if any(j.state in ("queued", "running") for j in jobs.values()):
            time.sleep(settings.poll_s)
