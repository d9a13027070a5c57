"""Shared pieces of the benchmarks: a plain training step, timing, card and commit names."""

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

from oelm_core.config import TrainConfig
from oelm_core.step import configure_optimizer


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
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return "unknown"


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


class PlainStep:
    """forward + backward + clip + AdamW for one (x, y) batch, written out plainly: the baseline
    the trainer's step (``oelm_core.step.TrainStep``) is timed against, not that step. The
    optimiser is the trainer's (``step.configure_optimizer``), but the gradients are clipped by
    ``clip_grad_norm_`` (a separate pass over them) where the trainer's fused AdamW divides them
    inside its kernel (train.fused_clip). ``graph=True`` captures the step whole in a CUDA graph (inputs copied into
    static buffers, the optimiser capturable with its learning rate a device tensor)."""

    def __init__(self, model, fwd, tc: TrainConfig, batch_shape, device, graph: bool = False,
                 autocast: bool = True):
        self.model, self.fwd, self.tc, self.graph = model, fwd, tc, graph
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.device = torch.device(device)
        from oelm_core.train import configure_optimizer  # here: the generation benchmarks need no trainer

        self.opt = configure_optimizer(model, tc, self.device)
        if graph:  # as the trainer's step turns it capturable before its capture
            for group in self.opt.param_groups:
                group["lr"] = torch.tensor(tc.lr, device=self.device)
                group["capturable"] = True
        self.autocast = autocast and self.device.type == "cuda"
        self.x = torch.zeros(batch_shape, dtype=torch.long, device=device)
        self.y = torch.zeros(batch_shape, dtype=torch.long, device=device)
        self.g = None
        self.loss = None

    def _body(self):
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            loss = self.fwd(self.x, self.y)
        loss.backward()
        # As oelm_core.train: the norm is always computed (logged), max_norm=inf when clipping is off.
        torch.nn.utils.clip_grad_norm_(self.params, self.tc.grad_clip or float("inf"))
        self.opt.step()
        return loss

    def warmup(self, x, y, n: int = 3):
        self.x.copy_(x)
        self.y.copy_(y)
        if self.graph:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(n):
                    self._body()
                    self.opt.zero_grad(set_to_none=True)
            torch.cuda.current_stream().wait_stream(s)
            self.g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.g):
                self.loss = self._body()
        else:
            for _ in range(n):
                self(x, y)

    def __call__(self, x, y):
        self.x.copy_(x, non_blocking=True)
        self.y.copy_(y, non_blocking=True)
        if self.g is not None:
            self.g.replay()
            return self.loss
        loss = self._body()
        self.opt.zero_grad(set_to_none=True)
        return loss


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
