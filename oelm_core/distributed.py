"""Processes and devices: which rank this process is, on which device, and data parallelism.

One process trains alone; under torchrun each process joins the process group that torchrun's
environment describes (RANK, WORLD_SIZE, LOCAL_RANK) and trains on its own device. The reference
step (``oelm_core.step``) wraps the model with ``data_parallel``: DDP. The trainer's step takes
``oelm_core.fast.data_parallel`` instead, which on two GPUs of one host may exchange the
gradients by NVLink copies.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from oelm_core.config import ConfigError, TrainConfig, check_device

log = logging.getLogger(__name__)


@dataclass
class Dist:
    """This process's place in the job (torchrun's RANK / WORLD_SIZE; 0 / 1 alone) and its device
    (LOCAL_RANK picks the GPU: ``resolve_device``)."""

    rank: int
    world_size: int
    device: torch.device
    owns_group: bool  # this process created the process group, so it also destroys it

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The torch.device that ``name`` (train.device: "auto", "cpu", "cuda" or "cuda:N") means on
    this machine, made the current CUDA device when it is one.

    "auto" -> this rank's GPU when there is one, else the CPU; a bare "cuda" gets index
    ``local_rank`` (torchrun's LOCAL_RANK). ConfigError as ``check_device`` says, or for a local
    rank past the GPUs there are.
    """
    device = check_device(("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", local_rank)
            count = torch.cuda.device_count()
            if local_rank >= count:
                raise ConfigError(
                    f"train.device {name!r} puts local rank {local_rank} on {device}, but this "
                    f"machine has {count} CUDA GPU(s), cuda:0..cuda:{count - 1}: start at "
                    f"most {count} processes per node"
                )
        torch.cuda.set_device(device)
    return device


def setup_distributed(tc: TrainConfig) -> Dist:
    """Join the process group torchrun describes in the environment (a no-op for one process),
    with ``train.ddp_timeout_s`` as the time a collective waits for the other ranks."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    device = resolve_device(tc.device, local_rank)
    owns = False
    if world > 1 and not dist.is_initialized():
        init_process_group(
            tc.backend if tc.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo"),
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=tc.ddp_timeout_s),
        )
        owns = True
    if world > 1:
        _store_set(f"process/{rank}", f"host {socket.gethostname()}, pid {os.getpid()}")
    return Dist(rank, world, device, owns)


class RankSilent(RuntimeError):
    """A collective timed out: a rank stopped answering (stopped, hung, or its node gone)."""


# How long the ranks that timed out wait for each other to say so before naming the others.
ANSWER_WAIT_S = 10.0


def silent_ranks(exc: BaseException, d: Dist, timeout_s: float) -> Optional[RankSilent]:
    """The RankSilent that ``exc`` means, or None where it is no collective's timeout (gloo:
    "Timed out waiting ... for recv operation"). Each rank that timed out says so in the process
    group's store and waits up to ANSWER_WAIT_S for the others to: those that do not are named,
    with their host and pid (what ``setup_distributed`` stored). NCCL's watchdog ends a timed-out
    job itself, naming the collective, before this can run."""
    if not d.enabled or not any("timed out" in str(e).lower() or "timeout" in str(e).lower() for e in _chain(exc)):
        return None
    _store_set(f"answered/{d.rank}", "1")
    answered, deadline = [], time.monotonic() + ANSWER_WAIT_S
    for rank in range(d.world_size):
        try:
            _store().wait([_key(f"answered/{rank}")], timedelta(seconds=max(0.1, deadline - time.monotonic())))
            answered.append(rank)
        except Exception:  # not there in time, or no store
            pass
    silent = [r for r in range(d.world_size) if r not in answered] or None
    if silent is None:
        who = "a rank"
    else:
        who = ", ".join(f"rank {r} ({_store_get(f'process/{r}') or 'host unknown'})" for r in silent)
    hint = (
        " Rank 0 prepares the data while the others wait: prepare it first (python -m oelm_core.data) or raise "
        "train.ddp_timeout_s."
        if silent == [0]
        else ""
    )
    return RankSilent(
        f"{who} did not answer for {timeout_s:g} s (train.ddp_timeout_s), and rank {d.rank} stopped "
        f"waiting: the process was stopped (SIGSTOP, a debugger), hangs, or its node is gone; the run "
        f"resumes from its latest checkpoint with --resume.{hint}"
    )


def _chain(exc: Optional[BaseException]):
    while exc is not None:
        yield exc
        exc = exc.__cause__ or exc.__context__


def _key(name: str) -> str:
    return f"oelm/{name}"


def _store():
    # The process group's key-value store (torchrun's, or the one init_process_group made): the
    # one channel the ranks still share once a collective hangs. torch has no public accessor.
    return dist.distributed_c10d._get_default_store()


def _store_set(name: str, value: str) -> None:
    try:
        _store().set(_key(name), value)
    except Exception:  # no store (an init method without one): nothing to name ranks by
        pass


def _store_get(name: str) -> Optional[str]:
    try:
        store = _store()
        return store.get(_key(name)).decode() if store.check([_key(name)]) else None
    except Exception:
        return None


def init_process_group(backend: str, **kwargs) -> None:
    """``dist.init_process_group``, torch._dynamo imported first.

    DDP's constructor imports torch._dynamo. Imported once a process group exists, it keeps
    references to the group (torch 2.13) that outlive destroy_process_group: gloo's threads then
    run on into the interpreter's exit, and one that frees a finished collective there aborts the
    process ("terminate called without an active exception"). Imported first, it holds none.
    """
    import torch._dynamo  # noqa: F401

    dist.init_process_group(backend, **kwargs)


def mean_across_ranks(t: torch.Tensor) -> torch.Tensor:
    """The mean of ``t`` over the ranks (a new tensor), or ``t`` itself with one process."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return t
    t = t.clone()
    dist.all_reduce(t)  # SUM: gloo has no AVG
    return t / dist.get_world_size()


def broadcast_object(value: Any, d: Dist) -> Any:
    """Rank 0's ``value`` on every rank (the others' is ignored); ``value`` itself alone."""
    if not d.enabled:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def every_rank(value: Any, d: Dist) -> list:
    """Every rank's ``value``, in rank order, on every rank (``[value]`` alone): what lets all
    ranks take the same decision from what each one sees."""
    if not d.enabled:
        return [value]
    values = [None] * d.world_size
    dist.all_gather_object(values, value)
    return values


# The model's buffers (frozen Q/K, POET's reference weights and permutations) are identical on
# every rank by construction (same seed, same updates): broadcasting them before each forward is
# wasted traffic. torch 2.13 renamed the switch and warns on the old name (its new one still syncs
# once, at construction, which is harmless).
DDP_NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DDP).parameters
    else {"broadcast_buffers": False}
)


def wrap_ddp(module: nn.Module, device: torch.device, bucket_mb: float) -> DDP:
    """``module`` in DistributedDataParallel with ``bucket_mb`` MB buckets (train.ddp_bucket_mb)
    and no buffer broadcasts."""
    # gradient_as_bucket_view: the gradients are views of the all-reduce buckets, so they are not
    # copied back out after each all-reduce.
    return DDP(
        module,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=True,
        bucket_cap_mb=bucket_mb,
        **DDP_NO_BUFFER_SYNC,
    )


def data_parallel(model: nn.Module, module: nn.Module, tc: TrainConfig, device: torch.device):
    """``module`` (``model`` or its compiled wrapper) made data parallel: (``module`` in DDP, None).
    The second is the exchange that reduces the gradients where DDP does not: none here. An
    exchange is an object with ``begin(tokens)``, ``sync``, ``finish()``, ``remove()`` and
    ``grad_divisor`` (``oelm_core.step.TrainStep`` calls them; ``oelm_core.fast.data_parallel``
    may return one)."""
    return wrap_ddp(module, device, tc.ddp_bucket_mb), None


def on_rank_0(fn: Callable[[], Any], d: Dist, what: str) -> None:
    """``fn()`` on rank 0 while the other ranks wait for it (the broadcast is the barrier); its
    exception is raised on rank 0, a ConfigError saying that rank 0 could not ``what`` on the
    others."""
    failure: Optional[BaseException] = None
    if d.is_main:
        try:
            fn()
        except Exception as exc:
            failure = exc
    message = broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}", d)
    if failure is not None:
        raise failure
    if message is not None:
        raise ConfigError(f"rank 0 could not {what}: {message}")
