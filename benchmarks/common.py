"""Shared pieces of the benchmarks: timing, card and commit names, the card's clock and power."""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import shutil
import statistics
import subprocess
import threading
import time

import torch


def card_name(device=None) -> str:
    """The GPU's name, or for a CPU device (``device`` defaults to CUDA where there is one) the
    processor model with torch's thread count, which sets CPU figures as much as the model does."""
    device = torch.device(device if device is not None else "cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({cpu_model()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def cpu_model() -> str:
    # platform.processor() is empty on most Linux systems and says "x86_64" at best; the kernel
    # knows the model.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def commit() -> str:
    """The code's commit, short, as a run's provenance names it (``oelm_core.provenance.code_version``:
    OELM_COMMIT where set, else git), with "-dirty" where tracked files differ from it: a GPU
    machine's copy of a working tree can carry a .git of another state, and a figure must not name
    a commit that did not make it."""
    from oelm_core.provenance import code_version

    code = code_version()
    if not code["commit"]:
        return "unknown"
    return code["commit"][:7] + ("-dirty" if code["dirty"] else "")


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def at_least(low: int):
    """argparse type: an integer >= ``low`` (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def free_between_runs(cuda: bool) -> None:
    """Drop what one timed configuration left behind (call it once nothing refers to its model,
    step or optimiser), so that the next starts from the same memory and compile state."""
    torch._dynamo.reset()  # first: its caches refer to the compiled graphs, which the gc collects
    gc.collect()
    if cuda:
        # cuBLAS keeps a workspace (from torch's allocator) for every stream it has run on, and each
        # configuration captures on streams of its own: without this, 65 MiB a configuration stayed
        # allocated on an H200 (inductor's CUDA-graph trees clear them for the same reason).
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()


def time_blocks(fn, n_blocks: int, per_block: int, cuda: bool) -> list[float]:
    """Seconds per call of ``fn()`` for each of ``n_blocks`` blocks of ``per_block`` calls; no
    calls (a warm-up of 0 steps) time nothing."""
    if per_block < 1:
        return []
    out = []
    for _ in range(n_blocks):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_block):
                fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1000 / per_block)
        else:
            t0 = time.perf_counter()
            for _ in range(per_block):
                fn()
            out.append((time.perf_counter() - t0) / per_block)
    return out


def median(xs):
    return statistics.median(xs)


# nvidia-smi's fields for CardClocks, in its --query-gpu order.
SMI_FIELDS = ("clocks.sm", "power.draw", "power.limit", "utilization.gpu", "clocks_throttle_reasons.active")
SW_POWER_CAP = 0x4  # a throttle reason: the driver holds the clocks down to keep under the power limit
BUSY_PERCENT = 50  # samples at or above this utilization are the timed work, not the start-up around it


def parse_smi_sample(line: str):
    """One line of ``nvidia-smi --query-gpu=<SMI_FIELDS> --format=csv,noheader,nounits`` as a dict
    (clock MHz, watts, utilization %, throttle reasons as an int), or None for a line that is not one
    (nvidia-smi writes "[N/A]" where a card does not report a field)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(SMI_FIELDS):
        return None
    try:
        return {
            "sm_clock_mhz": float(parts[0]),
            "power_w": float(parts[1]),
            "power_limit_w": float(parts[2]),
            "utilization": float(parts[3]),
            "throttle": int(parts[4], 16),
        }
    except ValueError:
        return None


def summarise_clocks(samples: list):
    """The busy samples' (utilization >= BUSY_PERCENT; all of them if none is) median SM clock
    (MHz) and power (W), the clock's range, the power limit and the share of samples the power cap
    held down; None without samples."""
    if not samples:
        return None
    busy = [s for s in samples if s["utilization"] >= BUSY_PERCENT] or samples
    clocks = [s["sm_clock_mhz"] for s in busy]
    return {
        "sm_clock_mhz": median(clocks),
        "sm_clock_range_mhz": [min(clocks), max(clocks)],
        "power_w": median([s["power_w"] for s in busy]),
        "power_limit_w": busy[-1]["power_limit_w"],
        "power_capped": sum(bool(s["throttle"] & SW_POWER_CAP) for s in busy) / len(busy),
        "samples": len(busy),
    }


class CardClocks:
    """The card's SM clock and power draw while a with-block runs, sampled by nvidia-smi every
    ``every_ms`` milliseconds in a process of its own (the timed process never waits on it).

    Why: a card held at its power limit clocks down under load (an H200 at 64 x 512 ran its
    training steps at 1.5-1.9 GHz of its 1.98: benchmarks/README.md), so two figures taken at
    different clocks differ by that too; each row says what the card ran at. ``summary()``:
    ``summarise_clocks`` of the samples, or None where there is no CUDA device or no nvidia-smi.
    """

    def __init__(self, device, every_ms: int = 200):
        self.device, self.every_ms = torch.device(device), every_ms
        self.samples, self.proc, self.thread = [], None, None

    def __enter__(self):
        if self.device.type == "cuda" and shutil.which("nvidia-smi"):
            uuid = torch.cuda.get_device_properties(self.device).uuid  # the card, whatever the device numbering
            cmd = ["nvidia-smi", "-i", f"GPU-{uuid}", f"--query-gpu={','.join(SMI_FIELDS)}"]
            cmd += ["--format=csv,noheader,nounits", f"-lms={self.every_ms}"]
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self.thread = threading.Thread(target=self._read, daemon=True)
            self.thread.start()
        return self

    def _read(self) -> None:
        for line in self.proc.stdout:
            sample = parse_smi_sample(line)
            if sample is not None:
                self.samples.append(sample)

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
            self.thread.join(timeout=10)

    def summary(self):
        return summarise_clocks(self.samples)


def clocks_text(clocks) -> str:
    """A summary of CardClocks as a table cell: "1,650 MHz 695 W" ("*": the power cap held the
    clocks down in most busy samples), or "-"."""
    if not clocks:
        return "-"
    cap = "*" if clocks["power_capped"] > 0.5 else ""
    return f"{clocks['sm_clock_mhz']:,.0f} MHz {clocks['power_w']:.0f} W{cap}"
