"""What a run will cost and whether its settings make sense, said before anything runs.

``check(cfg, device)``: one training step's memory and FLOPs against what the device has
(refused where it cannot fit, a warning near the limit), its time against ``train.max_step_s``
(refused where even the device's top speed would take longer), and a warning where the warm-up
outlasts the run. Called by ``oelm_core.train.train`` once the process knows its device.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

from oelm_core.accounting import PEAK_FLOPS_ENV, device_memory, flops_per_token, peak_flops, step_memory
from oelm_core.config import PRESETS, ConfigError, RunConfig, TrainConfig

log = logging.getLogger(__name__)


def check(cfg: RunConfig, device: torch.device, local_processes: int = 1, report: bool = True) -> dict:
    """``check_step_memory``, ``check_step_time`` and (where ``report``) ``warn_about_schedule``;
    returns the first's account."""
    need = check_step_memory(cfg, device, local_processes, report)
    check_step_time(cfg, device, local_processes)
    if report:
        warn_about_schedule(cfg.train)
    return need


def warn_about_schedule(tc: TrainConfig) -> None:
    """Log a warning where the warm-up outlasts the run: the learning rate never reaches
    ``train.lr``. Not refused: a short try of a long run's parameter file (``--set
    train.steps=20`` on a 2,000-step warm-up) is a fair thing to do."""
    from oelm_core.step import lr_at  # here: the demo reads this module's estimates without the trainer

    if tc.warmup_steps > tc.steps:
        log.warning(
            "train.warmup_steps=%d is longer than the run (train.steps=%d): the learning rate rises "
            "to %.3g at the last step and never reaches train.lr=%g, nor decays to train.min_lr; set "
            "train.warmup_steps below train.steps (e.g. %d, a tenth of it) to train at train.lr",
            tc.warmup_steps,
            tc.steps,
            lr_at(tc.steps - 1, tc),
            tc.lr,
            max(1, tc.steps // 10),
        )


# A step estimated to need more than this share of the memory there is gets a warning: the
# estimate leaves out the allocator's slack (on a CPU 5-25% under the measured peak, up to half
# where the loss's slices dominate: accounting.activation_bytes) and whatever else the machine runs.
MEMORY_WARNING_SHARE = 0.8


# A FLOP rate no machine that trains falls below: a step that this rate would finish within
# train.max_step_s needs no measurement (the smoke runs of the tests, the CPU study).
SLOWEST_FLOPS = 1e9
MATMUL_SIZE = 512  # the square float32 matmul that measures a CPU: 0.27 GFLOP, a few milliseconds


def _size(n: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**20:.1f} MiB"


def _flops(n: float) -> str:
    for unit, scale in (("TFLOP", 1e12), ("GFLOP", 1e9)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 1e6:.1f} MFLOP"


def check_step_memory(cfg: RunConfig, device: torch.device, local_processes: int = 1, report: bool = True) -> dict:
    """Say what one optimiser step of ``cfg`` costs on ``device`` before anything runs: its peak memory
    (``accounting.step_memory``, bytes: one micro-step's) and FLOPs (``flops_per_token`` times the
    tokens of the step, this process's share). ConfigError, naming the figures and the settings that
    lower them, where the step needs more than the device has (``device_memory``; on the CPU the RAM
    available, shared by the ``local_processes`` of this host); above MEMORY_WARNING_SHARE of it a
    warning, else an info line (neither unless ``report``: one rank speaks for all). Returns
    step_memory's account."""
    mc, tc = cfg.model_config(), cfg.train
    bf16 = tc.dtype == "bf16" or (tc.dtype == "auto" and device.type == "cuda")
    need = step_memory(
        mc, tc.batch_size, "bf16" if bf16 else "float32", device.type, tc.fused_loss, tc.loss_chunk_tokens
    )
    total = need["total"] * (local_processes if device.type == "cpu" else 1)
    flops = flops_per_token(mc)["total"] * tc.batch_size * mc.block_size * tc.grad_accum
    processes = f" x {local_processes} processes" if device.type == "cpu" and local_processes > 1 else ""
    cost = (
        f"one training step of this run needs about {_size(need['total'])}{processes} (weights, gradients "
        f"and AdamW state {_size(need['state'])}, activations of {tc.batch_size} x {mc.block_size} tokens "
        f"{_size(need['activations'])}) and {_flops(flops)} a step"
    )
    available, where = device_memory(device)
    if available is None:
        if report:
            log.info("%s; %s is not known here", cost, where)
        return need
    if total > available:
        preset = PRESETS[cfg.preset].get("block_size")
        block = (
            f"model.block_size ({mc.block_size}; the {cfg.preset} preset's is {preset})"
            if "block_size" in cfg.model and preset != mc.block_size
            else f"model.block_size ({mc.block_size})"
        )
        raise ConfigError(
            f"{cost}, more than {where} ({_size(available)}): lower {block} or "
            f"train.batch_size ({tc.batch_size}; train.grad_accum keeps the tokens a step with "
            f"less memory)"
        )
    if not report:
        return need
    if total > MEMORY_WARNING_SHARE * available:
        log.warning(
            "%s: %.0f%% of %s (%s); it may run out of memory: lower model.block_size or "
            "train.batch_size (train.grad_accum keeps the tokens a step with less memory)",
            cost,
            100 * total / available,
            where,
            _size(available),
        )
    else:
        log.info("%s; %s: %s", cost, where, _size(available))
    return need


def step_flops(cfg: RunConfig) -> float:
    """The FLOPs of one optimiser step of this process: flops_per_token x its tokens."""
    mc, tc = cfg.model_config(), cfg.train
    return flops_per_token(mc)["total"] * tc.batch_size * mc.block_size * tc.grad_accum


def device_flops(device: torch.device, local_processes: int = 1) -> tuple[float, str]:
    """(FLOP/s that bound what ``device`` computes, what the figure is): a card's bf16 peak
    (``accounting.peak_flops``; ``OELM_PEAK_FLOPS`` where set), else a square matmul timed there,
    the best of three, in the dtype the step runs in (bf16 on CUDA); a CPU's shared by the
    ``local_processes`` of this host. A step's FLOPs at this rate are a lower bound of its time."""
    peak = peak_flops(device) if device.type == "cuda" or os.environ.get(PEAK_FLOPS_ENV, "").strip() else None
    if peak:
        return peak, f"the peak of {PEAK_FLOPS_ENV} or this card's bf16 peak"
    n = MATMUL_SIZE * (8 if device.type == "cuda" else 1)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for _ in range(4):  # the first warms up
        start = time.perf_counter()
        (a @ a).sum().item()  # .item(): the clock waits for the device
        best = min(best, time.perf_counter() - start)
    rate = 2 * n**3 / best / (local_processes if device.type == "cpu" else 1)
    shared = f", shared by {local_processes} processes" if device.type == "cpu" and local_processes > 1 else ""
    return rate, f"its speed measured on a {n} x {n} matmul{shared}"


def check_step_time(cfg: RunConfig, device: torch.device, local_processes: int = 1) -> Optional[float]:
    """ConfigError where one optimiser step would take longer than ``train.max_step_s`` even at
    the device's top speed (``device_flops``): ``model.block_size=100000`` on the smoke preset
    sat at step 0 for over ten minutes on a CPU, where neither a log line nor a checkpoint
    comes. 0 turns the check off. Returns the estimate in seconds where it measured (a step
    cheap enough is not measured: None). Under DDP rank 0's measure decides for every rank."""
    limit, flops = cfg.train.max_step_s, step_flops(cfg)
    if not limit or flops / SLOWEST_FLOPS <= limit:
        return None
    rate, how = device_flops(device, local_processes)
    seconds = flops / rate
    refusal = None
    if seconds > limit:
        mc = cfg.model_config()
        preset = PRESETS[cfg.preset].get("block_size")
        block = (
            f"model.block_size ({mc.block_size}; the {cfg.preset} preset's is {preset})"
            if "block_size" in cfg.model and preset != mc.block_size
            else f"model.block_size ({mc.block_size})"
        )
        where = "this CPU" if device.type == "cpu" else f"this GPU ({device})"
        refusal = (
            f"one training step of this run needs {_flops(flops)}: at least {_duration(seconds)} on {where} "
            f"({_flops(rate)}/s, {how}), more than train.max_step_s ({limit:g} s), and no log line or "
            f"checkpoint comes before it ends: lower {block} or train.batch_size ({cfg.train.batch_size}), "
            f"or set train.max_step_s: 0 to run it anyway"
        )
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [refusal]
        dist.broadcast_object_list(box, src=0)
        refusal = box[0]
    if refusal:
        raise ConfigError(refusal)
    return seconds


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"
