"""Whether a run had its device to itself while it was timed: summary.json's ``timed_alone``.

A speed figure (tokens/s, time to a loss) compares runs only where each had its device alone;
this records what happened instead of assuming it. ``Occupancy`` samples at the trainer's log
steps, whose figures are already read back (nothing waits on the device for it), at most every
``CPU_EVERY_S`` / ``GPU_EVERY_S`` seconds, and once more when the session ends:

- **CPU**: between two samples, the CPU time that other processes took on the cores this
  process may run on: those cores' busy time (/proc/stat: user, nice, system, irq, softirq
  and steal, the last being other virtual machines) less the CPU time of this run's own
  processes (/proc/PID/stat). Alone when, in every window, the others averaged at most
  ``OTHERS_MAX_CORES`` of a core (room for a machine's daemons, not for a second training or a
  build beside it). Linux only:
  elsewhere the answer is None, with the reason.
- **CUDA**: the compute processes on the run's GPU, from NVML (pynvml) or nvidia-smi, in a
  background thread (a listing can take a second; NVML and nvidia-smi make no CUDA call that
  could disturb the training thread's graph capture). Alone when no process but this run's is
  listed at any sample. Where the listing cannot name this run's own processes (a container
  whose PID namespace hides the host's PIDs), the GPU's used memory is compared instead with
  what this process's allocator holds: more than ``MEMORY_SLACK_GIB`` beyond it (room for this
  process's CUDA context and the NCCL and library buffers the allocator does not count) means
  another process holds memory there. That comparison misses a process holding less; the
  record says which method answered.

A resumed run is alone only if every session was: ``combine`` joins this session's answer with
the one the earlier session's summary.json recorded.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Optional

import torch

CPU_EVERY_S = 1.0
MIN_CPU_WINDOW_S = 0.5
GPU_EVERY_S = 10.0
OTHERS_MAX_CORES = 0.25
MEMORY_SLACK_GIB = 2.0
# /proc/stat's per-CPU columns after the name: user nice system idle iowait irq softirq steal ...
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


class Occupancy:
    """Samples whether anything else ran on this rank's device; ``result`` gives the verdict.

    ``own_pids``: the processes of this run on this host (every rank's, under torchrun)."""

    def __init__(
        self,
        device: torch.device,
        own_pids: set[int],
        cpu_every_s: float = CPU_EVERY_S,
        gpu_every_s: float = GPU_EVERY_S,
    ):
        self.device, self.own = device, set(own_pids)
        self.every_s = gpu_every_s if device.type == "cuda" else cpu_every_s
        self.last_t = -math.inf
        self.samples = 0
        self.alone: Optional[bool] = True  # until a sample says otherwise
        self.unknown: Optional[str] = None  # why a sample could not tell
        self.worst = ""  # the evidence of the sample that counted most
        self.method = ""
        self.worst_weight = 0.0  # how much it counted: cores, processes or GiB
        self._cpu_prev: Optional[tuple[float, int, int]] = None  # (time, busy ticks, own ticks)
        self.last_window: dict = {}  # CPU: the last window's seconds, others' cores, own CPU seconds
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        if device.type == "cuda":
            self._uuid = _normalised_uuid(torch.cuda.get_device_properties(device).uuid)
        self._proc = Path("/proc/stat").is_file()
        if device.type != "cuda" and not self._proc:
            self.alone, self.unknown = None, "no /proc on this system: CPU sharing is not measured"

    # --- sampling ---------------------------------------------------------------------------
    def sample(self, final: bool = False) -> None:
        """A sample where ``every_s`` has passed since the last: call at log steps. ``final``: the
        session's end, sampled whatever the time."""
        now = time.perf_counter()
        if not final and now - self.last_t < self.every_s:
            return
        if self.device.type != "cuda":
            self._cpu_sample(now, final)
            return
        if self._thread is not None and self._thread.is_alive():
            return  # the previous listing is still running: never queue behind it
        self.last_t = now
        reserved = torch.cuda.memory_reserved(self.device)  # the allocator's count: no CUDA call
        self._thread = threading.Thread(target=self._gpu_sample, args=(reserved,), daemon=True)
        self._thread.start()

    def result(self) -> dict:
        """A last sample, then {"timed_alone": True/False/None, "method", "samples", "evidence"}."""
        self.sample(final=True)
        if self._thread is not None:
            self._thread.join(timeout=30)
        with self._lock:
            alone, samples = self.alone, self.samples
            if samples == 0 and alone:
                alone, self.unknown = None, self.unknown or "no sample was taken in this session"
            evidence = self.unknown if alone is None else self.worst
        return {"timed_alone": alone, "method": self.method, "samples": samples, "evidence": evidence}

    def _record(self, alone_here: Optional[bool], evidence: str, method: str, weight: float = 0.0) -> None:
        with self._lock:
            self.samples += 1
            self.method = method
            if alone_here is None:
                if self.alone:
                    self.alone, self.unknown = None, evidence
            elif not alone_here:
                if self.alone is not False or weight > self.worst_weight:
                    self.worst, self.worst_weight = evidence, weight
                self.alone = False
            elif self.alone and weight >= self.worst_weight:
                self.worst, self.worst_weight = evidence, weight

    # --- CPU --------------------------------------------------------------------------------
    def _cpu_sample(self, now: float, final: bool) -> None:
        if not self._proc:
            return
        self.last_t = now
        busy, own = cpu_busy_ticks(cores()), own_ticks(self.own)
        if self._cpu_prev is None:
            self._cpu_prev = (now, busy, own)
            return
        t0, busy0, own0 = self._cpu_prev
        window = now - t0
        # A short last window is a few clock ticks: one stray tick would read as a fifth of a core.
        if window <= 0 or (window < MIN_CPU_WINDOW_S and (self.samples or not final)):
            return
        self._cpu_prev = (now, busy, own)
        others = max(0, (busy - busy0) - (own - own0)) / _ticks_per_s() / window
        self.last_window = {"seconds": window, "others_cores": others, "own_cpu_s": (own - own0) / _ticks_per_s()}
        evidence = (
            f"other processes used {others:.2f} of this run's {len(cores())} cores over a {window:.1f} s "
            f"window (alone: at most {OTHERS_MAX_CORES} in every window)"
        )
        self._record(others <= OTHERS_MAX_CORES, evidence, "CPU time (/proc)", others)

    # --- CUDA -------------------------------------------------------------------------------
    def _gpu_sample(self, reserved: int) -> None:
        try:
            listed, used = gpu_processes(self._uuid)
        except Exception as exc:  # a listing tool that misbehaves must not end the training
            self._record(None, f"the GPU's processes could not be listed ({type(exc).__name__}: {exc})", "")
            return
        if listed is not None and self.own & {pid for pid, _ in listed}:
            others = [(pid, mem) for pid, mem in listed if pid not in self.own]
            evidence = (
                "no other process on the GPU"
                if not others
                else f"{len(others)} other process(es) on the GPU: "
                + ", ".join(f"pid {pid} ({mem / 2**30:.1f} GiB)" for pid, mem in others[:5])
            )
            self._record(not others, evidence, "GPU processes (NVML/nvidia-smi)", float(len(others)))
        elif used is not None:
            beyond = (used - reserved) / 2**30
            evidence = (
                f"the GPU's process list does not show this run's processes (another PID namespace); "
                f"{beyond:.1f} GiB of the GPU's memory in use beyond this process's allocator "
                f"(alone: at most {MEMORY_SLACK_GIB} GiB)"
            )
            self._record(beyond <= MEMORY_SLACK_GIB, evidence, "GPU memory beside this process's", beyond)
        else:
            self._record(None, "neither NVML (pynvml) nor nvidia-smi could list the GPU's processes", "")


def combine(session: Optional[bool], earlier: Optional[bool]) -> Optional[bool]:
    """Alone over two sessions: False if either was not, None if either is not known."""
    if session is False or earlier is False:
        return False
    if session is None or earlier is None:
        return None
    return True


# --------------------------------------------------------------------------------------------
# What the operating system and the driver tell
# --------------------------------------------------------------------------------------------


def cores() -> set[int]:
    """The CPU cores this process may run on (its affinity mask, where the OS has one)."""
    try:
        return os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


def _ticks_per_s() -> int:
    return os.sysconf("SC_CLK_TCK")


def cpu_busy_ticks(cores: set[int]) -> int:
    """Clock ticks the CPUs ``cores`` have spent busy (steal included) since boot (/proc/stat)."""
    total = 0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cores:
            total += sum(int(values[i]) for i in _BUSY_COLUMNS if i < len(values))
    return total


def _stat_fields(pid: int | str) -> list[str]:
    """/proc/PID/stat's fields after the parenthesised name: index i is field i + 3 of proc(5)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def own_ticks(pids: set[int]) -> int:
    """User and system clock ticks of the processes ``pids`` (every thread; /proc/PID/stat); a
    process that has ended counts 0."""
    total = 0
    for pid in pids:
        try:
            fields = _stat_fields(pid)
        except (OSError, IndexError):
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime: fields 14 and 15 of proc(5)
    return total


def process_age_s() -> Optional[float]:
    """Seconds since this process started (Linux's /proc; None elsewhere): at the first step, the
    start-up a run pays before it trains (imports, CUDA's context, data, the model), which trainings
    sharing a GPU pay side by side."""
    try:
        started = int(_stat_fields("self")[19]) / _ticks_per_s()  # starttime: field 22, since boot
        return float(Path("/proc/uptime").read_text().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return None


def _normalised_uuid(uuid) -> str:
    return str(uuid).lower().removeprefix("gpu-")


def gpu_processes(uuid: str) -> tuple[Optional[list[tuple[int, int]]], Optional[int]]:
    """([(pid, bytes used)] of the compute processes on the GPU ``uuid``, bytes used on that GPU),
    from NVML, else nvidia-smi; None for what neither could tell."""
    try:
        import pynvml
    except ImportError:
        pynvml = None
    if pynvml is not None:
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError:
            pynvml = None
    if pynvml is not None:
        try:
            handle = pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
            return [(p.pid, p.usedGpuMemory or 0) for p in procs], int(used)
        except pynvml.NVMLError:
            pass
        finally:
            pynvml.nvmlShutdown()
    return _nvidia_smi_processes(uuid)


def _nvidia_smi_processes(uuid: str) -> tuple[Optional[list[tuple[int, int]]], Optional[int]]:
    if shutil.which("nvidia-smi") is None:
        return None, None

    def query(*args: str) -> Optional[list[list[str]]]:
        try:
            done = subprocess.run(
                ["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode != 0:
            return None
        return [[c.strip() for c in line.split(",")] for line in done.stdout.splitlines() if line.strip()]

    gpus = query("--query-gpu=uuid,memory.used")
    used = next((_mib(m) for u, m in (gpus or []) if _normalised_uuid(u) == uuid), None)
    if used is None:
        return None, None  # this GPU is not among those nvidia-smi lists (MIG, another namespace)
    apps = query("--query-compute-apps=gpu_uuid,pid,used_memory")
    if apps is None:
        return None, used
    return [(int(pid), _mib(mem)) for u, pid, mem in apps if _normalised_uuid(u) == uuid and pid.isdigit()], used


def _mib(value: str) -> int:
    """nvidia-smi's MiB figure in bytes; 0 for "[N/A]" (some drivers' answer for a process)."""
    try:
        return int(float(value) * 2**20)
    except ValueError:
        return 0


# --------------------------------------------------------------------------------------------
# The run's verdict: every rank, every session
# --------------------------------------------------------------------------------------------


def earlier_sessions(summary: dict, step: int) -> dict:
    """What the sessions before a resume at ``step`` recorded: the verdict of the summary.json
    they left, where it was written at that step; else unknown (a session killed after it ran
    steps whose timing the resumed run's figures keep)."""
    if summary.get("steps") != step or "timed_alone" not in summary:
        return {
            "timed_alone": None,
            "evidence": f"the summary.json before this session is not of step {step} (a session was "
            f"killed, or the run predates timed_alone): whether it ran alone is not known",
        }
    occupancy = (summary.get("provenance") or {}).get("occupancy") or {}
    return {"timed_alone": summary["timed_alone"], "evidence": occupancy.get("evidence")}


def verdict(ranks: list[dict], earlier: Optional[dict] = None) -> dict:
    """summary.json's occupancy record from every rank's ``Occupancy.result()`` and, for a
    resumed run, ``earlier_sessions``: alone only where every rank of every session was; the
    evidence of a rank (or the earlier sessions) that decided it."""
    answers = ranks + ([earlier] if earlier is not None else [])
    alone: Optional[bool] = True
    for answer in answers:
        alone = combine(alone, answer["timed_alone"])
    deciding = next(a for a in answers if a["timed_alone"] is alone)
    record = {
        "timed_alone": alone,
        "method": ranks[0]["method"],
        "samples": sum(r["samples"] for r in ranks),
        "evidence": deciding["evidence"],
    }
    if earlier is not None:
        record["earlier_sessions"] = earlier
    return record
