"""Shared pieces of the benchmarks: timing, card and commit names."""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import statistics
import subprocess
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
    if os.environ.get("OELM_COMMIT"):
        return os.environ["OELM_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except Exception:
        return "unknown"


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
