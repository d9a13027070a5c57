"""The training engine: one process or many (DDP), CPU or CUDA, resumable, for every variant.

    python -m oelm_core.train --params parameters/train_smoke.yaml [--set train.steps=200] [--resume]
    torchrun --nproc_per_node 8 -m oelm_core.train --params parameters/X.yaml

From Python: ``summary = train(load_run_config("parameters/X.yaml"))``.

Like minGPT's trainer it knows nothing about the model beyond ``build_model``, ``model(x, y)`` ->
mean loss, ``model.unfreeze_qk(layers)`` -> new parameters and, duck-typed, the
``module.after_optimizer_step(step)`` hook and (under DDP) ``model.split_tied_gradient(hook)``.
A run folder (``RunConfig.out_dir``) holds:

    config.yaml            the RunConfig as run
    metrics.jsonl          one JSON object per logged step (train figures; eval rows add val_*)
    ckpt/step_XXXXXXX.pt   the last ``keep_last`` step checkpoints (what --resume continues from)
    best.pt                the checkpoint with the lowest validation loss
    summary.json           the run's figures, written when a session ends
    .lock                  held by the session writing the folder (pid inside): one at a time

Data parallelism is exact: rank r's micro-step m draws its windows as virtual rank r*A + m of
W*A (A = grad_accum, W = world size), so W ranks with grad_accum A see the very batches one
process with grad_accum W*A sees, and the two loss curves agree to float rounding.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import inspect
import itertools
import json
import logging
import math
import os
import re
import statistics
import sys
import time
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from oelm_core.accounting import count_parameters, device_memory, flops_per_token, peak_flops, step_memory
from oelm_core.checkpoint import RESUME_KEYS, TRAINING_KEYS, CheckpointError, load_checkpoint, save_checkpoint
from oelm_core.config import (PRESETS, RESUMABLE_CHANGES, ConfigError, ModelConfig, RunConfig, TrainConfig,
                              check_device, load_run_config, run_config_from_dict, save_run_config)
from oelm_core.data import TokenSampler, bits_per_byte, eval_batches, load_meta, perplexity, prepare
from oelm_core.files import LockHeld, exclusive_lock, temporary_files, write_text_atomic
from oelm_core.model import build_model
from oelm_core.peer_grads import PeerGradExchange, first_of_each

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf; the run stopped and its last good checkpoint stays."""


def lr_at(step: int, tc: TrainConfig) -> float:
    """Learning rate of the optimiser step that follows ``step`` completed steps.

    Linear warmup from lr/warmup_steps to lr over the first warmup_steps steps, then a cosine
    from lr down to min_lr, reached at step ``tc.steps``.
    """
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = min(1.0, (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps))
    return tc.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (tc.lr - tc.min_lr)


# --------------------------------------------------------------------------------------------
# Devices and processes
# --------------------------------------------------------------------------------------------

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
                raise ConfigError(f"train.device {name!r} puts local rank {local_rank} on {device}, but this "
                                  f"machine has {count} CUDA GPU(s), cuda:0..cuda:{count - 1}: start at "
                                  f"most {count} processes per node")
        torch.cuda.set_device(device)
    return device


def setup_distributed(tc: TrainConfig) -> Dist:
    """Join the process group torchrun describes in the environment (a no-op for one process)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    device = resolve_device(tc.device, local_rank)
    owns = False
    if world > 1 and not dist.is_initialized():
        backend = tc.backend if tc.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        dist.init_process_group(backend, rank=rank, world_size=world)
        owns = True
    return Dist(rank, world, device, owns)


def autocast_context(dtype: str, device: torch.device):
    """bf16 autocast on CUDA ("auto") or when asked for; float32 otherwise. Reusable context."""
    use_bf16 = dtype == "bf16" or (dtype == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()


# glibc's mallopt parameters (malloc.h) and the size up to which freed blocks stay in the heap
# (mallopt takes a C int: at most 2 GiB - 1).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
HEAP_BLOCK_BYTES = 1 << 30


def keep_large_blocks_in_heap() -> bool:
    """Make glibc keep freed blocks of up to HEAP_BLOCK_BYTES for reuse by the next CPU step.

    Each step allocates and frees the same large temporaries (a 512 x 50,304 float32 logits
    slice: 103 MB). glibc serves a block above its mmap threshold (adaptive, at most 32 MB)
    with fresh pages and hands them back when it is freed, so every step faults all of them in
    again. With both thresholds raised the blocks stay in the heap and are reused: 30 steps of
    parameters/smoke/oelm_freeze.yaml on 2 shared cores took 59 s wall and 11 s system time
    (4.5M page faults) before, 41 s and 0.8 s (0.22M) after. The price: the heap keeps freed
    blocks rather than returning them (peak RSS 0.73 -> 0.90 GiB there), also after training.

    Returns whether glibc took both settings; False, changing nothing, on other C libraries
    (macOS, musl, Windows), whose allocators have other switches or none.
    """
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc")
    except (AttributeError, ValueError, OSError):  # no confstr (Windows), or not that name
        glibc = False
    if not glibc:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all([mallopt(M_MMAP_THRESHOLD, HEAP_BLOCK_BYTES), mallopt(M_TRIM_THRESHOLD, HEAP_BLOCK_BYTES)])


# --------------------------------------------------------------------------------------------
# The run folder
# --------------------------------------------------------------------------------------------

def check_folders(cfg: RunConfig) -> None:
    """ConfigError for an out_dir or data.out_dir that is a file (or lies under one): caught
    before the data is prepared, not as a FileExistsError after it."""
    for key, folder in (("out_dir", Path(cfg.out_dir)), ("data.out_dir", Path(cfg.data.out_dir))):
        existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            where = "is a file" if existing == folder else f"lies under the file {existing}"
            raise ConfigError(f"{key} {folder} {where}, not a folder: set {key} to a folder")


@contextmanager
def hold_run_folder(out: Path, d: Dist):
    """Hold the run folder ``out`` for this session: an exclusive lock on out/.lock (rank 0; the
    file holds its pid), so that a second training into the same folder fails at once instead of
    interleaving metrics.jsonl, config.yaml and the checkpoints with this one's. Under the lock
    nothing else writes there: temporaries of atomic writes killed mid-way (a checkpoint's
    ``.step_*.pt.*.tmp``: 0.5 GB at medium512) are removed.

    ConfigError on every rank when another process holds the lock. The kernel drops the lock of
    a process that dies, so a killed training leaves nothing to clean up. No lock where the
    platform (Windows) or the file system (some network mounts) has none.
    """
    with ExitStack() as held:
        locked, refused = _lock_run_folder(out, held) if d.is_main else (None, None)
        if d.enabled:  # the other ranks stop too, rather than wait for rank 0 in the next collective
            box = [refused]
            dist.broadcast_object_list(box, src=0)
            refused = box[0]
        if refused is not None:
            raise ConfigError(refused)
        if locked:
            _remove_killed_writes(out)
        yield


def _lock_run_folder(out: Path, held: ExitStack) -> tuple[Optional[bool], Optional[str]]:
    """(``exclusive_lock``'s answer for out/.lock, which ``held`` then holds; why the folder is
    refused, or None)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        locked = held.enter_context(exclusive_lock(out / ".lock"))
    except LockHeld as exc:
        return None, f"another training (pid {exc.holder}) is writing to {out}; wait for it or choose another out_dir"
    except OSError as exc:
        return None, f"cannot write to out_dir {out} ({exc.strerror}); set out_dir to a folder you can write to"
    if locked is False:
        log.warning("the file system of %s has no locks: a second training into it would not be stopped", out)
    return locked, None


def _remove_killed_writes(out: Path) -> None:
    """Remove the temporaries that atomic writes killed mid-way left in ``out`` and out/ckpt."""
    stale = temporary_files(out) + temporary_files(out / "ckpt")
    if stale:
        size = sum(p.stat().st_size for p in stale)
        for p in stale:
            p.unlink()
        log.info("removed %d file(s) left by writes that were killed (%.1f MB): %s",
                 len(stale), size / 1e6, ", ".join(p.name for p in stale))


# --------------------------------------------------------------------------------------------
# Optimiser and the training step
# --------------------------------------------------------------------------------------------

def configure_optimizer(model: nn.Module, tc: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters, in two groups.

    Group 0: every tensor with ndim >= 2, with ``tc.weight_decay``: Linear weights, embeddings,
    trainable Q/K, and also POET's skew generators (``skew_*``, whose decay pulls R and P towards
    I between merges) and the Synthesizer's logit tables (``synth_*``). The committed ablation
    results were trained so. Group 1: biases and LayerNorm gains/shifts (ndim 1) without decay:
    shrinking them towards 0 shifts activations rather than regularising a mapping.
    Frozen Q/K are buffers and never reach the optimiser; tied weights appear once.
    Progressive unfreezing appends one decayed group per unfreeze (see ``Trainer._unfreeze``).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # Fused AdamW: one kernel for all tensors instead of a launch per tensor and op; it also
    # applies the gradient clipping inside that kernel (TrainStep._clip_and_step).
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps,
                             fused=True if device.type in ("cuda", "cpu") else None)


# The model's buffers (frozen Q/K, POET's reference weights and permutations) are identical on
# every rank by construction (same seed, same updates): broadcasting them before each forward is
# wasted traffic. torch 2.13 renamed the switch and warns on the old name (its new one still syncs
# once, at construction, which is harmless).
DDP_NO_BUFFER_SYNC = ({"forward_sync_buffers": False}
                      if "forward_sync_buffers" in inspect.signature(DDP).parameters
                      else {"broadcast_buffers": False})


class TiedGradReducer:
    """The data-parallel mean of the tied embedding/output weight's gradient, reduced in two
    shares so that most of it overlaps the backward pass; DDP reduces every other parameter.

    DDP reduces a parameter once its gradient is complete, and the tied weight's is complete
    only after the embedding's backward, the last op of the backward pass: at medium512 its
    103 MB (of 180 MB of gradients) were all-reduced with nothing left to hide behind. With
    ``model.split_tied_gradient``:

    - the output layer's share (dense) arrives as the backward pass starts, and its all-reduce
      starts then, on NCCL's stream, while the rest of the backward runs (``_on_output_grad``);
    - the embedding's share is nonzero only in the rows of this rank's tokens: as soon as it
      is written (``_on_embedding_grad``) those rows are gathered from every rank (tokens x
      d_model floats: 8 MB at 8 x 512 instead of 103 MB), and ``finish`` adds them to the
      reduced output share (``begin`` says when rows pay).

    Each row is sent once (a repeated token adds an exact zero) and every rank adds the ranks'
    rows in the same order, so the weights stay bitwise equal across ranks. Works with NCCL
    (and inside the step's CUDA graph) and with gloo.
    """

    def __init__(self, model: nn.Module, weight: nn.Parameter):
        self.weight, self.world = weight, dist.get_world_size()
        # NCCL averages within the all-reduce; gloo has no AVG: sum, then scale.
        self.average = dist.get_backend() == "nccl"
        self.sync = True  # False on micro-steps that only accumulate (DDP's no_sync)
        self._ids: Optional[torch.Tensor] = None  # this step's tokens, when its rows are gathered
        self._first = self._all_ids = self._ids_work = None
        self._out: Optional[torch.Tensor] = None
        self._work = self._rows = self._rows_work = None
        model.split_tied_gradient(self._on_output_grad)
        # Fires when the embedding's backward has written its share, still inside the backward
        # pass: the rows then queue on NCCL ahead of DDP's last buckets instead of after them.
        self._hook = weight.register_post_accumulate_grad_hook(self._on_embedding_grad)

    @classmethod
    def for_model(cls, model: nn.Module) -> Optional["TiedGradReducer"]:
        """A reducer for ``model``'s tied weight, or None if it has none to split or there is one
        rank (nothing to reduce: gathering rows would be work for nothing)."""
        split = getattr(model, "split_tied_gradient", None)
        weight = split(None) if split is not None else None  # also drops an earlier reducer's hook
        if weight is None or not weight.requires_grad or dist.get_world_size() == 1:
            return None
        return cls(model, weight)

    def remove(self) -> None:
        """Detach from the weight (before another reducer or none takes over)."""
        self._hook.remove()

    def _all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        op = dist.ReduceOp.AVG if self.average else dist.ReduceOp.SUM
        return dist.all_reduce(tensor, op=op, async_op=async_op)

    def begin(self, tokens: list[torch.Tensor]) -> None:
        """Before a step's first backward. ``tokens``: this rank's input ids, one (B, T) tensor
        per micro-step. When the ranks' tokens outnumber the weight's rows (medium512: from 25k
        tokens per GPU on 2 GPUs) the rows are no cheaper to send than the whole share; then both
        shares are added and all-reduced once at the end, as DDP would."""
        ids = torch.cat([t.flatten() for t in tokens])
        if self.world * ids.numel() > self.weight.size(0):
            self._ids = None
            return
        # Sorted, and each id's first place marked: a row is sent once. The ids travel now, while
        # the forward pass runs; the rows once the embedding's backward has run.
        self._ids, self._first = first_of_each(ids)
        # Flat along dim 0: gloo's all_gather_into_tensor takes no stacked output.
        self._all_ids = ids.new_empty(self.world * ids.numel())
        self._ids_work = dist.all_gather_into_tensor(self._all_ids, self._ids, async_op=True)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        self._out = grad if self._out is None else self._out.add_(grad)
        if self.sync and self._ids is not None:
            self._work = self._all_reduce(self._out, async_op=True)

    def _on_embedding_grad(self, weight: torch.Tensor) -> None:
        if self.sync and self._ids is not None:
            rows = weight.grad[self._ids] * self._first.unsqueeze(1)
            self._rows = rows.new_empty((self.world * rows.size(0), rows.size(1)))
            self._rows_work = dist.all_gather_into_tensor(self._rows, rows, async_op=True)

    def finish(self) -> None:
        """After the last micro-step's backward: ``weight.grad`` := the mean over ranks."""
        emb, out = self.weight.grad, self._out  # this rank's embedding share; the output share
        if self._ids is None:
            self._all_reduce(out.add_(emb))
            if not self.average:
                out.mul_(1.0 / self.world)
        else:
            for work in (self._ids_work, self._work, self._rows_work):
                work.wait()
            if not self.average:
                out.mul_(1.0 / self.world)
            for ids_r, rows_r in zip(self._all_ids.chunk(self.world), self._rows.chunk(self.world)):
                out.index_add_(0, ids_r, rows_r, alpha=1.0 / self.world)
        self.weight.grad = out  # the output share's buffer becomes the gradient: no copy
        self._ids = self._first = self._all_ids = self._ids_work = self._out = self._work = None
        self._rows = self._rows_work = None


class TrainStep:
    """One optimiser step: what the loop runs and what a benchmark should time.

    ``loss, grad_norm = step(batches, lr, step_number)`` with ``batches`` a list of grad_accum
    (x, y) int64 (B, T) pairs on the model's device: forward+backward of each micro-batch (the
    DDP gradient all-reduce only on the last), clip, AdamW at ``lr``, then the modules'
    ``after_optimizer_step(step_number)`` hooks. Returns 0-dim device tensors (this rank's mean
    micro-batch loss in nats/token, the pre-clip global gradient norm) so nothing waits for the GPU.

    ``model`` is the plain module (state_dict and hooks come from it); the forward runs through
    ``self.module``, its compiled and/or DDP wrapper, rebuilt by ``wrap()`` whenever the
    parameter set changes (progressive unfreezing).

    With ``cuda_graph`` the whole step is captured once and replayed: at small batches the step
    is bound by the host launching kernels, and a replay costs one launch. Under DDP (NCCL) the
    gradient exchange is captured with it; every rank captures or none does.

    Data parallel (``ddp``): two CUDA GPUs of one host exchange the gradients through NVLink
    copies (``peer_grads.PeerGradExchange``; ``grad_exchange="auto"`` or ``"peer"``); otherwise
    DDP reduces them, the tied embedding/output weight by ``TiedGradReducer`` (most of it during
    the backward pass), every other parameter by DDP's buckets.
    """

    # Eager steps before the capture: two let compile and the optimiser state settle; DDP asks
    # for 11 (PyTorch's CUDA-graph notes: its reducer rebuilds buckets and finishes its
    # bookkeeping over the first iterations, and a capture must see the steady state).
    WARMUP_STEPS, WARMUP_STEPS_DDP = 2, 11

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, grad_clip: float,
                 autocast, compile: bool = False, compile_tuning: bool = False, ddp: bool = False,
                 cuda_graph: bool = False, bucket_mb: float = TrainConfig.ddp_bucket_mb,
                 grad_exchange: str = TrainConfig.grad_exchange):
        self.model, self.optimizer, self.grad_clip = model, optimizer, grad_clip
        self.autocast, self.compile, self.ddp, self.bucket_mb = autocast, compile, ddp, bucket_mb
        self.compile_options = {"coordinate_descent_tuning": True} if compile_tuning else None
        self.grad_exchange = grad_exchange
        self.cuda_graph = cuda_graph and torch.cuda.is_available() and (
            not ddp or dist.get_backend() == "nccl")  # NCCL (>= 2.9) collectives can be captured
        # DDP is built, warmed up and captured on this one stream: the default stream cannot
        # take part in a capture, and the reducer's hooks run on the stream DDP was built on.
        self.stream = torch.cuda.Stream() if self.cuda_graph else None
        # What reduces the gradients besides DDP, if anything: begin(tokens) / sync / finish().
        self.grads: Optional[PeerGradExchange | TiedGradReducer] = None
        self.wrap()

    def wrap(self) -> None:
        if self.grads is not None:
            self.grads.remove()
            self.grads = None
        device = next(self.model.parameters()).device
        if self.ddp and self.grad_exchange != "ddp":
            self.grads = PeerGradExchange.for_model(self.model, device)
            if self.grads is None and self.grad_exchange == "peer":
                raise ConfigError("train.grad_exchange: peer needs two CUDA GPUs of one host with peer "
                                  "access (NVLink) under NCCL; use auto to fall back to DDP")
        module = self.model
        if self.compile:
            module = torch.compile(module, options=self.compile_options)
        if self.grads is not None:
            log.info("gradients exchanged by NVLink copies during the backward (PeerGradExchange)")
            with torch.no_grad():  # what DDP's constructor does: every rank starts from rank 0's state
                for t in itertools.chain(self.model.parameters(), self.model.buffers()):
                    dist.broadcast(t, 0)
        elif self.ddp:
            self.grads = TiedGradReducer.for_model(self.model)
            if self.grads is not None:  # reduced by self.grads, not by DDP
                DDP._set_params_and_buffers_to_ignore_for_model(
                    module, [name for name, p in module.named_parameters() if p is self.grads.weight])
                log.info("DDP: the tied embedding/output weight is reduced in two shares (TiedGradReducer)")
            # gradient_as_bucket_view: the gradients are views of the all-reduce buckets, so they
            # are not copied back out after each all-reduce. (The copy in, scaled by 1/world, stays:
            # the compiled backward returns fresh tensors; 0.15 ms a step at 8 x 512, RESULTS.md.)
            with self._on_stream():
                module = DDP(module, device_ids=[device.index] if device.type == "cuda" else None,
                             gradient_as_bucket_view=True, bucket_cap_mb=self.bucket_mb,
                             **DDP_NO_BUFFER_SYNC)
        self.module = module
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.hooks = [m.after_optimizer_step for m in self.model.modules()
                      if callable(getattr(m, "after_optimizer_step", None))]
        # torch.compile fails lazily, at the first call; until one call succeeded we may fall back.
        self._compile_verified = not self.compile
        self._graph = None  # a new parameter set is captured anew, after new warm-up steps
        self._graph_warm = 0
        # A captured step leaves its gradients in .grad (the graph's static outputs); the next
        # eager step would add its own to them.
        self.optimizer.zero_grad(set_to_none=True)

    @property
    def gradients_by(self) -> str:
        """What exchanges the gradients between ranks: "nvlink copies", "ddp" or "none"."""
        if isinstance(self.grads, PeerGradExchange):
            return "nvlink copies"
        return "ddp" if isinstance(self.module, DDP) else "none"

    @contextmanager
    def _on_stream(self):
        """Run the block on ``self.stream`` (ordered after the current stream's work, and the
        current stream after it); a no-op without CUDA graphs."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream().wait_stream(self.stream)

    def _forward_backward(self, batches: list) -> torch.Tensor:
        total = torch.zeros((), device=batches[0][0].device)
        if self.grads is not None:
            self.grads.begin([x for x, _ in batches])
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            if self.grads is not None:
                self.grads.sync = last
            # no_sync: accumulate locally, all-reduce once on the last micro-step (covers backward).
            with self.module.no_sync() if isinstance(self.module, DDP) and not last else nullcontext():
                with self.autocast:
                    loss = self.module(x, y)
                (loss / len(batches)).backward()
            total += loss.detach().float()
        if self.grads is not None:
            self.grads.finish()
        return total / len(batches)

    def __call__(self, batches: list, lr: float, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        out = self._graph_step(batches, lr) if self.cuda_graph and batches[0][0].is_cuda else None
        loss, grad_norm = out if out is not None else self._eager_step(batches, lr)
        for hook in self.hooks:
            restart_optimizer_state(self.optimizer, hook(step) or ())
        return loss, grad_norm

    def _graph_step(self, batches: list, lr: float):
        """Replay the captured step; warm up (side stream) and capture first. None: run eagerly."""
        shapes = [(tuple(x.shape), tuple(y.shape)) for x, y in batches]
        if self._graph is not None and shapes == self._graph_shapes:
            for (x, y), (sx, sy) in zip(batches, self._graph_inputs):
                sx.copy_(x, non_blocking=True)
                sy.copy_(y, non_blocking=True)
            for group in self.optimizer.param_groups:
                group["lr"].fill_(lr)
            self._graph.replay()
            return self._graph_out[0].clone(), self._graph_out[1].clone()
        if self._graph_warm < (self.WARMUP_STEPS_DDP if self.ddp else self.WARMUP_STEPS):
            self._graph_warm += 1
            with self._on_stream():
                return self._eager_step(batches, lr)
        device = batches[0][0].device
        self._graph_inputs = [(x.clone(), y.clone()) for x, y in batches]
        for group in self.optimizer.param_groups:
            group["lr"] = torch.tensor(float(lr), device=device)
            group["capturable"] = True
        self.optimizer.zero_grad(set_to_none=True)
        graph, error = torch.cuda.CUDAGraph(), None
        try:
            # thread_local: NCCL's watchdog thread keeps querying events during the capture.
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                loss = self._forward_backward(self._graph_inputs)
                norm = self._clip_and_step()
        except Exception as exc:  # an op that cannot be captured: stay eager, correct either way
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if self.ddp:  # a rank replaying its collectives alone would wait forever: agree first
            failed = torch.tensor(float(error is not None), device=device)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if failed.item() and error is None:
                error = "another rank could not capture its step"
        if error is not None:
            log.warning("CUDA graph capture failed (%s); continuing without it", error)
            torch.cuda.synchronize()
            self.cuda_graph, self._graph, self.stream = False, None, None
            for group in self.optimizer.param_groups:
                group["capturable"] = False
            self.optimizer.zero_grad(set_to_none=True)
            if self.ddp:
                self.wrap()  # a reducer stopped mid-backward cannot run again; a new one can
            return None
        self._graph, self._graph_shapes, self._graph_out = graph, shapes, (loss, norm)
        log.info("captured the training step as a CUDA graph%s", "" if not self.ddp else
                 " with the NVLink gradient exchange" if isinstance(self.grads, PeerGradExchange)
                 else " with DDP's all-reduce")
        return self._graph_step(batches, lr)

    def _eager_step(self, batches: list, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        if self._compile_verified:
            loss = self._forward_backward(batches)
        else:
            try:
                loss = self._forward_backward(batches)
            except Exception as exc:  # Dynamo/Inductor raise many types; eager is always correct
                log.warning("torch.compile failed (%s: %s); continuing in eager mode",
                            type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
                self.compile = False
                self.wrap()  # also drops the failed backward's partial gradients
                loss = self._forward_backward(batches)
            self._compile_verified = True
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm = self._clip_and_step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm

    def _clip_and_step(self) -> torch.Tensor:
        """Scale the gradients down to a global norm of at most ``grad_clip`` and take the
        optimiser step. Returns the norm before clipping (0-dim tensor; computed and logged even
        when clipping is off).

        A fused AdamW takes the clip as its ``grad_scale`` (the divisor AMP's GradScaler hands
        it): the gradients are divided inside its one kernel, which saves clip_grad_norm_'s
        separate scaling pass over every gradient: 0.05 ms of a 4.2 ms step at medium512, 8 x 512
        (RESULTS.md). Gradients that hold a sum over ranks (``grad_divisor``, the NVLink exchange)
        are averaged by the same divisor."""
        max_norm = self.grad_clip or float("inf")
        grads = [p.grad for p in self.params if p.grad is not None]
        divisor = getattr(self.grads, "grad_divisor", 1.0)
        if not all(group.get("fused") for group in self.optimizer.param_groups):
            if divisor != 1.0:
                torch._foreach_mul_(grads, 1.0 / divisor)
            norm = torch.nn.utils.clip_grad_norm_(self.params, max_norm)
            self.optimizer.step()
            return norm
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        if divisor != 1.0:
            norm = norm / divisor
        # clip_grad_norm_'s factor, max_norm / (norm + 1e-6) capped at 1, as a divisor.
        self.optimizer.grad_scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)
        if divisor != 1.0:
            self.optimizer.grad_scale = self.optimizer.grad_scale * divisor
        try:
            self.optimizer.step()
        finally:
            del self.optimizer.grad_scale
        return norm


def restart_optimizer_state(optimizer: torch.optim.Optimizer, params) -> int:
    """Zero the moments of ``params``, which a module restarted (POET's merge returns them from its
    ``after_optimizer_step`` hook). In place, so a captured CUDA graph keeps pointing at the same
    tensors; the step count stays. Returns how many of them had optimizer state."""
    restarted = 0
    for p in params:
        state = optimizer.state.get(p)
        if state:
            restarted += 1
            for name, value in state.items():
                if torch.is_tensor(value) and name != "step":
                    value.zero_()
    return restarted


def make_step(model: nn.Module, optimizer: torch.optim.Optimizer, tc: TrainConfig,
              device: torch.device, ddp: bool = False) -> TrainStep:
    """The trainer's step for ``model`` (already on ``device``) as TrainConfig configures it."""
    return TrainStep(model, optimizer, grad_clip=tc.grad_clip, autocast=autocast_context(tc.dtype, device),
                     compile=tc.compile, compile_tuning=tc.compile_tuning and device.type == "cuda",
                     ddp=ddp, cuda_graph=tc.cuda_graph and device.type == "cuda",
                     bucket_mb=tc.ddp_bucket_mb, grad_exchange=tc.grad_exchange)


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------

def _lr_moves(step: int, before: TrainConfig, after: TrainConfig) -> bool:
    """Whether ``after`` trains the step that follows ``step`` at another learning rate than ``before``."""
    return not math.isclose(lr_at(step, before), lr_at(step, after), rel_tol=1e-9)


def _json_safe(value: Any) -> Any:
    """NaN/inf -> None so metrics.jsonl and summary.json stay standard JSON."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


STEP_FILE = re.compile(r"step_(\d+)\.pt")


def _step_number(path: Path) -> Optional[int]:
    """N of a step checkpoint ckpt/step_N.pt; None for any other name (a backup, a copy)."""
    match = STEP_FILE.fullmatch(path.name)
    return int(match.group(1)) if match else None


# What identifies the prepared data a run trains on: meta.json's entries, stored in checkpoints.
# text_hash is the same for the same stories from the hub or a folder; content_hash is not, and
# is all that checkpoints written before text_hash existed have (prepare adds text_hash to data
# prepared before then, so the data always has one).
DATA_IDENTITY = ("text_hash", "content_hash", "train_tokens", "val_tokens")


class Trainer:
    """State of one training session; ``fit`` runs it. Use ``train()`` rather than this directly."""

    def __init__(self, cfg: RunConfig, d: Dist, schedule: dict[int, Any], resume: bool):
        self.cfg, self.tc, self.d, self.schedule = cfg, cfg.train, d, schedule
        self.out = Path(cfg.out_dir)
        self.ckpt_dir = self.out / "ckpt"
        self.device = d.device
        # Checked before the data is prepared: a refused run leaves the token files as they were.
        self.resume_from = self._resume_point(resume)
        self.meta = self._prepare_data()
        # what the checkpoints record of the data, for a resume to check (_check_same_data)
        self.data_identity = {key: self.meta.get(key) for key in DATA_IDENTITY}
        if self.resume_from is not None:  # the stories' hashes are known once they are prepared
            self._check_same_data(self.resume_from[1], self.resume_from[0])

        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 for float32 matmuls outside autocast
        self.model_cfg: ModelConfig = cfg.model_config()
        self._check_vocabulary()
        self.frozen = self.model_cfg.frozen_layers()  # layers whose Q/K are still buffers
        # The seed makes the weights identical on every rank; the offset gives ranks own dropout.
        self.model = build_model(self.model_cfg, seed=self.tc.seed).to(self.device)
        torch.manual_seed(self.tc.seed + d.rank)
        self.optimizer = configure_optimizer(self.model, self.tc, self.device)
        self.autocast = autocast_context(self.tc.dtype, self.device)
        self.step_fn = make_step(self.model, self.optimizer, self.tc, self.device, ddp=d.enabled)

        block, batch, accum = self.model_cfg.block_size, self.tc.batch_size, self.tc.grad_accum
        data = Path(cfg.data.out_dir)
        vocab = self.meta["vocab_size"]
        self.samplers = [TokenSampler(data / "train.bin", block, batch, self.tc.seed,
                                      rank=d.rank * accum + m, world_size=d.world_size * accum, vocab_size=vocab)
                         for m in range(accum)]
        self.val = [(x.to(self.device), y.to(self.device))
                    for x, y in eval_batches(data / "val.bin", block, batch, self.tc.eval_batches, vocab_size=vocab)]
        self.tokens_per_step = batch * block * accum * d.world_size
        self.peak = peak_flops(self.device)
        self.flops_per_token = flops_per_token(self.model_cfg)["total"]

        self.step = 0
        self.wall_before = 0.0         # earlier sessions' seconds
        self.best_val_loss = float("inf")
        self.bad_evals = 0             # evaluations since the best one (early stopping)
        self.train_loss = float("nan")
        self.last_eval: dict = {}
        self.throughput: list[float] = []  # tokens/s of each log window of this session
        self.mfus: list[float] = []

    # --- set-up -------------------------------------------------------------------------------
    def _prepare_data(self) -> dict:
        """Tokenise on rank 0 only; the others wait for it (the broadcast is the barrier)."""
        failure: Optional[BaseException] = None
        if self.d.is_main:
            try:
                prepare(self.cfg.data, progress=self.tc.progress)
            except Exception as exc:
                failure = exc
        if self.d.enabled:
            box = [None if failure is None else f"{type(failure).__name__}: {failure}"]
            dist.broadcast_object_list(box, src=0)
            if box[0] is not None and failure is None:
                raise ConfigError(f"rank 0 could not prepare the data: {box[0]}")
        if failure is not None:
            raise failure
        return load_meta(self.cfg.data.out_dir)

    def _check_vocabulary(self) -> None:
        """Refuse token files whose ids the embedding has no row for (torch.embedding would fail
        at the first step with a bare IndexError). The meta's vocabulary is the tokenizer's,
        which bounds every id its files can hold, without reading them."""
        data_vocab, vocab = self.meta["vocab_size"], self.model_cfg.vocab_size
        if vocab >= data_vocab:
            return
        fits = [name for name, shape in PRESETS.items()
                if shape.get("vocab_size", ModelConfig.vocab_size) >= data_vocab]
        origin = "" if "vocab_size" in self.cfg.model else f" (preset {self.cfg.preset})"
        raise ConfigError(
            f"the token files in {self.cfg.data.out_dir} hold {self.meta['tokenizer']} ids up to "
            f"{data_vocab - 1} (a {data_vocab}-token vocabulary), but model.vocab_size is "
            f"{vocab}{origin}: the embedding has no row for ids from {vocab} on. Use a preset "
            f"with the {self.meta['tokenizer']} vocabulary ({', '.join(fits)}) or set "
            f"model.vocab_size: {data_vocab}")

    def _model_config_now(self) -> ModelConfig:
        """The model as it is now: freeze_qk lists the layers still frozen after unfreezing."""
        all_layers = list(range(self.model_cfg.n_layer))
        frozen = "none" if not self.frozen else "all" if self.frozen == all_layers else list(self.frozen)
        return dataclasses.replace(self.model_cfg, freeze_qk=frozen)

    def _unfreeze(self, layers) -> None:
        new = self.model.unfreeze_qk(layers)
        self.frozen = [] if layers == "all" else [i for i in self.frozen if i not in layers]
        if new:
            self.optimizer.add_param_group({"params": new, "weight_decay": self.tc.weight_decay})
            self.step_fn.wrap()  # DDP (and compile) must see the new parameter set
        self.flops_per_token = flops_per_token(self._model_config_now())["total"]
        log.info("step %d: unfroze Q/K of layers %s (%d new tensors)", self.step, layers, len(new))

    def _checkpoints(self) -> list[Path]:
        """ckpt/step_N.pt, oldest first. Other files there are neither read nor deleted."""
        numbered = ((_step_number(p), p) for p in self.ckpt_dir.glob("step_*.pt") if p.is_file())
        return [p for n, p in sorted((n, p) for n, p in numbered if n is not None)]

    def _resume_point(self, resume: bool) -> Optional[tuple[Path, dict]]:
        """The newest checkpoint and its state when resuming (None: start at step 0), after
        checking that this run may continue it and that a fresh start overwrites nothing."""
        existing = self._checkpoints()
        if existing and not resume:
            raise ConfigError(f"{self.out} already holds a run (checkpoints up to step "
                              f"{_step_number(existing[-1])}); pass --resume to continue it, or set "
                              f"out_dir to a new folder (or delete it) to start over")
        if not existing:
            if resume:
                log.info("nothing to resume in %s; starting at step 0", self.ckpt_dir)
            return None
        path = existing[-1]
        try:
            state = load_checkpoint(path, map_location="cpu")
        except CheckpointError as exc:
            fix = (f"To resume from the checkpoint before it ({existing[-2].name}), delete {path}"
                   if len(existing) > 1 else
                   f"It is the run's only checkpoint: deleting {path} makes --resume start the run "
                   f"again from step 0")
            raise CheckpointError(f"cannot resume: {exc}. {fix}") from None
        if any(key not in state for key in TRAINING_KEYS):
            raise CheckpointError(f"{path} holds weights only, not a training checkpoint (best.pt?); "
                                  f"remove it from {self.ckpt_dir}")
        self._check_resumable(state, path)
        return path, state

    def _check_same_data(self, state: dict, path: Path) -> None:
        """Refuse a resume on other data than the run's: data.source and data.out_dir may change
        (the same stories may move, or come from a folder instead of the hub), the stories may
        not. Compared by text hash, or by content hash where the checkpoint predates text hashes.
        Checkpoints from before the trainer recorded its data resume unchecked."""
        saved = state.get("data")
        now = self.data_identity
        if saved is None:
            return
        by = "text_hash" if saved.get("text_hash") else "content_hash"
        same_counts = all(saved.get(key) == now.get(key) for key in ("train_tokens", "val_tokens"))
        if same_counts and saved.get(by) == now.get(by):
            return

        def described(d: dict) -> str:
            return (f"{by.replace('_', ' ')} {str(d.get(by))[:12]}..., {d.get('train_tokens')} train "
                    f"/ {d.get('val_tokens')} val tokens")

        trained = run_config_from_dict(state["run_config"]).data
        if by == "content_hash" and same_counts:
            # The content hash of hub data is one of the dataset's name, that of a folder one of
            # its texts: the same stories, from the hub once and from a folder now, differ by it.
            unset = " and OELM_DATA unset" if os.environ.get("OELM_DATA") else ""
            raise ConfigError(
                f"cannot resume {path}: it predates text hashes and records only the content hash of its "
                f"data ({described(saved)}, from {trained.source}), which differs from that of "
                f"{self.cfg.data.out_dir} ({described(now)}, prepared from {self.meta.get('source')}). The "
                f"stories may be the same (from the hub once and from a folder now, or the other way "
                f"round), which that hash cannot tell. Resume once from the source it was trained on "
                f"(--set data.source={trained.source} data.out_dir={trained.out_dir}{unset}) until it "
                f"writes a checkpoint: that one records the text hash, which is the same from either source")
        raise ConfigError(
            f"cannot resume {path}: it was trained on other data ({described(saved)}, from "
            f"{trained.source}) than {self.cfg.data.out_dir} holds now ({described(now)}, prepared from "
            f"{self.meta.get('source')}). Resume with the stories the run trained on, or train on "
            f"these from step 0 with out_dir set to a new folder")

    def _check_resumable(self, state: dict, path: Path) -> None:
        """Refuse a resume whose settings would continue the run along another curve."""
        saved_cfg = run_config_from_dict(state["run_config"])
        saved, now = saved_cfg.model_config(), self.cfg.model_config()
        if saved != now:
            diff = [f.name for f in dataclasses.fields(ModelConfig) if getattr(saved, f.name) != getattr(now, f.name)]
            raise ConfigError(f"{path} was trained with a different model (model keys {diff} differ); "
                              f"resume with the run's own parameters ({self.out / 'config.yaml'}) "
                              f"or set out_dir to a new folder")
        changed = [f"{section}.{key}: {getattr(getattr(saved_cfg, section), key)!r} -> {value!r}"
                   for section in ("train", "data")
                   for key, value in dataclasses.asdict(getattr(self.cfg, section)).items()
                   if key not in RESUMABLE_CHANGES[section]
                   and getattr(getattr(saved_cfg, section), key) != value]
        if changed:
            raise ConfigError(f"{path} was trained with other settings ({'; '.join(changed)}); resume "
                              f"with the run's own parameters ({self.out / 'config.yaml'}) or set "
                              f"out_dir to a new folder. Only these may change on resume: "
                              f"{', '.join(f'{s}.{k}' for s in RESUMABLE_CHANGES for k in sorted(RESUMABLE_CHANGES[s]))}")
        saved_batch = state["sampler"]["virtual_world"]
        if saved_batch != self.d.world_size * self.tc.grad_accum:
            fix = (f"train.grad_accum: {saved_batch // self.d.world_size}"
                   if saved_batch % self.d.world_size == 0 else
                   f"a number of processes that divides {saved_batch}")
            raise ConfigError(
                f"{path} was trained with world size x train.grad_accum = {saved_batch} batches a "
                f"step, this run would take {self.d.world_size} x {self.tc.grad_accum}: the global "
                f"batch shapes the curve. Resume with {fix}, or set out_dir to a new folder")
        self._check_schedule(saved_cfg.train, int(state["step"]), path)

    def _restore(self, path: Path, state: dict) -> None:
        self.step = int(state["step"])
        # Replay the unfreezes already done so the parameters and optimiser groups match the saved ones.
        for at, layers in self.schedule.items():
            if at < self.step:
                self._unfreeze(layers)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        for sampler in self.samplers:
            sampler.load_state_dict(state["sampler"])
        rng = state["rng"]
        if len(rng["cpu"]) == self.d.world_size:
            torch.set_rng_state(rng["cpu"][self.d.rank])
            if self.device.type == "cuda" and len(rng["cuda"]) == self.d.world_size:
                torch.cuda.set_rng_state(rng["cuda"][self.d.rank], self.device)
        else:
            torch.manual_seed(self.tc.seed + self.d.rank + self.step)
        m = state["metrics"]
        self.best_val_loss = m["best_val_loss"] if m.get("best_val_loss") is not None else float("inf")
        self.bad_evals = m.get("bad_evals", 0)
        self.train_loss = m["train_loss"] if m.get("train_loss") is not None else float("nan")
        self.last_eval = {k: m[k] for k in ("val_loss", "val_ppl", "val_bpb") if m.get(k) is not None}
        self.wall_before = float(m.get("wall_time_s") or 0.0)
        log.info("resumed %s at step %d", path, self.step)

    def _check_schedule(self, saved: TrainConfig, step: int, path: Path) -> None:
        """Refuse resumable changes (train.steps) that move the learning rate of the next step:
        the resumed curve would jump there and match neither the old run nor a new one.

        Equal there, the run goes on as one started with the new settings would have: a resume
        within the warm-up, or a schedule that does not read train.steps (min_lr = lr)."""
        if not _lr_moves(step, saved, self.tc):
            return
        was, now = lr_at(step, saved), lr_at(step, self.tc)
        # Only resumable keys differ here (_check_resumable refused the others): name those that move it.
        moved = [f"train.{key} {getattr(saved, key)!r} -> {getattr(self.tc, key)!r}"
                 for key in sorted(RESUMABLE_CHANGES["train"])
                 if _lr_moves(step, saved, dataclasses.replace(saved, **{key: getattr(self.tc, key)}))]
        raise ConfigError(
            f"cannot resume {path}: {', '.join(moved)} changes the learning rate of step "
            f"{step + 1} from {was:.4g} to {now:.4g} (the cosine decays to train.min_lr at "
            f"train.steps), and the curve would jump there. Keep train.steps: {saved.steps} to "
            f"continue this run, or train from step 0 with out_dir set to a new folder. Only a run "
            f"with train.min_lr equal to train.lr (constant after warm-up) can be extended")

    def _tokens_seen(self) -> int:
        return self.step * self.tokens_per_step  # the global batch is the run's own (_check_resumable)

    def _how_to_go_on(self) -> str:
        """What lets a run that ended train on: the settings --resume would accept."""
        tc, at_end = self.tc, self.step >= self.tc.steps
        if at_end and _lr_moves(self.step, tc, dataclasses.replace(tc, steps=self.step + 1)):
            return (f"its learning rate has decayed to train.min_lr at train.steps ({tc.steps}) and more "
                    f"steps would raise it again, which --resume refuses: to train longer, train from "
                    f"step 0 with a larger train.steps and out_dir set to a new folder")
        ways = ["raise train.steps"] if at_end else []
        if 0 < tc.early_stop_patience <= self.bad_evals:
            ways.append(f"raise train.early_stop_patience above {self.bad_evals} (0 turns early "
                        f"stopping off)")
        return " and ".join(ways) + " to go on"

    def _finished(self) -> Optional[str]:
        """How the restored run ended ("completed", "stopped_early"), or None: it has steps to go."""
        if 0 < self.tc.early_stop_patience <= self.bad_evals:
            return "stopped_early"
        return "completed" if self.step >= self.tc.steps else None

    def _start_files(self, resumed: bool) -> None:
        """config.yaml; metrics.jsonl fresh, or cut back to the resumed step (no duplicate rows)."""
        self.out.mkdir(parents=True, exist_ok=True)
        save_run_config(self.cfg, self.out / "config.yaml")
        metrics = self.out / "metrics.jsonl"
        kept = []
        if resumed and metrics.is_file():
            for line in filter(str.strip, metrics.read_text().splitlines()):
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:  # a row cut short when the run was killed mid-write
                    log.warning("metrics.jsonl: dropped a row that is not JSON: %.80s", line)
                    continue
                if row["step"] <= self.step:
                    kept.append(line)
        write_text_atomic(metrics, "".join(line + "\n" for line in kept))  # killed: the old rows stay

    # --- measuring ------------------------------------------------------------------------------
    def _mean_across_ranks(self, t: torch.Tensor) -> torch.Tensor:
        if self.d.enabled:
            t = t.clone()
            dist.all_reduce(t)  # SUM: gloo has no AVG
            t /= self.d.world_size
        return t

    def _train_figures(self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float,
                       window_steps: int, window_t0: float) -> dict:
        """The log row's training figures; raises TrainingDiverged on a NaN/inf loss or norm.
        ``window_t0``: perf_counter() when the window of ``window_steps`` steps began.

        The all-reduced values are the same on every rank, so all ranks stop together.
        """
        loss_v = self._mean_across_ranks(loss).item()
        norm_v = grad_norm.item()
        # Only now: the GPU runs behind the host (a captured step returns at once), and reading
        # the loss waited for the window's last step.
        window_s = time.perf_counter() - window_t0
        if not (math.isfinite(loss_v) and math.isfinite(norm_v)):
            kept = self._checkpoints()
            raise TrainingDiverged(
                f"training diverged at step {self.step}: loss {loss_v}, grad norm {norm_v}. "
                f"Lower train.lr (now {self.tc.lr}), lengthen train.warmup_steps or keep train.grad_clip "
                f"on, and check the data in {self.cfg.data.out_dir}. The last good checkpoint "
                f"{kept[-1] if kept else '(none yet)'} is kept; nothing was saved after the divergence")
        self.train_loss = loss_v
        tokens_per_s = window_steps * self.tokens_per_step / window_s
        mfu = (self.flops_per_token * tokens_per_s / (self.peak * self.d.world_size)
               if self.peak else None)
        self.throughput.append(tokens_per_s)
        if mfu is not None:
            self.mfus.append(mfu)
        tokens_seen = self._tokens_seen()
        return {"step": self.step, "train_loss": loss_v, "lr": lr, "grad_norm": norm_v,
                "tokens_per_s": tokens_per_s, "mfu": mfu, "peak_mem_mb": self._peak_mem_mb(),
                "tokens_seen": tokens_seen, "epochs": tokens_seen / self.meta["train_tokens"]}

    def _peak_mem_mb(self) -> Optional[float]:
        return torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else None

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean loss over the fixed validation batches (shared out round-robin across ranks, weighted
        by tokens), as val_loss (nats/token), val_ppl and val_bpb (bits per UTF-8 byte)."""
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # (sum of loss x tokens, tokens)
        for x, y in self.val[self.d.rank::self.d.world_size]:
            with self.autocast:
                loss = self.model(x, y)
            total[0] += loss.double() * y.numel()
            total[1] += y.numel()
        self.model.train()
        if self.d.enabled:
            dist.all_reduce(total)
        val_loss = (total[0] / total[1]).item()
        return {"val_loss": val_loss, "val_ppl": perplexity(val_loss),
                "val_bpb": bits_per_byte(val_loss, self.meta["val_tokens"], self.meta["val_bytes"])}

    # --- checkpoints ----------------------------------------------------------------------------
    def _state(self) -> Optional[dict]:
        """The checkpoint dict on rank 0 (None elsewhere). Collective: every rank's RNG is gathered."""
        rng = {"cpu": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None}
        rngs = [rng]
        if self.d.enabled:
            rngs = [None] * self.d.world_size
            dist.all_gather_object(rngs, rng)
        if not self.d.is_main:
            return None
        # Every sampler slot draws exactly one batch per step, so one slot's state describes all.
        sampler = {**self.samplers[0].state_dict(), "virtual_world": self.d.world_size * self.tc.grad_accum}
        metrics = {**self.last_eval, "best_val_loss": _json_safe(self.best_val_loss),
                   "bad_evals": self.bad_evals, "train_loss": _json_safe(self.train_loss),
                   "tokens_seen": self._tokens_seen(),
                   "epochs": self._tokens_seen() / self.meta["train_tokens"],
                   "wall_time_s": self.wall_before + time.perf_counter() - self.t_start}
        return {"model": self.model.state_dict(),
                "model_config": dataclasses.asdict(self._model_config_now()),
                "run_config": self.cfg.to_dict(), "step": self.step,
                "data": self.data_identity,
                "optimizer": self.optimizer.state_dict(),
                "rng": {"cpu": [r["cpu"] for r in rngs],
                        "cuda": [r["cuda"] for r in rngs if r["cuda"] is not None]},
                "sampler": sampler, "metrics": metrics}

    def _save(self, step_ckpt: bool, best: bool) -> None:
        state = self._state()
        if state is None:
            return
        # best.pt first: a run killed between the two resumes from the step before, evaluates
        # again and rewrites it, where the other order would leave older weights there for good.
        if best:
            # best.pt is for evaluation and the demo, not for resuming: the weights without the
            # optimizer state, a third of the size and of the time to write.
            save_checkpoint({k: v for k, v in state.items() if k not in RESUME_KEYS}, self.out / "best.pt")
        if step_ckpt:
            save_checkpoint(state, self.ckpt_dir / f"step_{self.step:07d}.pt")
            for old in self._checkpoints()[:-self.tc.keep_last]:
                old.unlink()

    # --- the session ----------------------------------------------------------------------------
    def fit(self) -> dict:
        self.t_start = time.perf_counter()
        if self.resume_from is not None:
            self._restore(*self.resume_from)
            self.resume_from = None  # the state's tensors are the model's and optimiser's now
        finished = self._finished()
        if finished:
            log.info("%s already ended (%s at step %d): nothing to train; %s", self.out, finished,
                     self.step, self._how_to_go_on())
            return self._summary_of_ended_run(finished)
        start = self.step
        if self.d.is_main:
            self._start_files(resumed=start > 0)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

        end = min(self.tc.steps, start + self.tc.stop_after) if self.tc.stop_after else self.tc.steps
        status = "completed" if end == self.tc.steps else "paused"
        bar = tqdm(total=self.tc.steps, initial=start, unit="step", dynamic_ncols=True,
                   disable=not (self.d.is_main and self.tc.progress))
        try:
            with logging_redirect_tqdm():
                status = self._loop(end, bar, status)
        except TrainingDiverged as exc:
            if self.d.is_main:
                self._write_summary("diverged", time.perf_counter() - self.t_start, error=str(exc))
            raise
        finally:
            bar.close()
        return self._write_summary(status, time.perf_counter() - self.t_start)

    def _loop(self, end: int, bar, status: str) -> str:
        tc = self.tc
        window_start, window_t0 = self.step, time.perf_counter()
        while self.step < end:
            if self.step in self.schedule:
                self._unfreeze(self.schedule[self.step])
            lr = lr_at(self.step, tc)
            batches = [s.next_batch(self.device) for s in self.samplers]
            loss, grad_norm = self.step_fn(batches, lr, self.step + 1)
            self.step += 1
            bar.update(1)

            # Not at a pause (stop_after): an extra evaluation would move best.pt and early stopping
            # away from those of the uninterrupted run.
            evaluate = self.step % tc.eval_every == 0 or self.step == tc.steps
            save = self.step % tc.ckpt_every == 0 or self.step == end
            if not (evaluate or save or self.step % tc.log_every == 0 or self.step == 1):
                continue  # step 1 is logged too: the curve's starting point
            # Every checkpoint step is a logged step: the divergence check runs before any save.
            row = self._train_figures(loss, grad_norm, lr, self.step - window_start, window_t0)
            bar.set_postfix(loss=f"{row['train_loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
            improved = stop = False
            if evaluate:
                figures = self.evaluate()
                row.update(figures)
                self.last_eval = figures
                improved = figures["val_loss"] < self.best_val_loss
                if improved:
                    self.best_val_loss, self.bad_evals = figures["val_loss"], 0
                else:
                    self.bad_evals += 1
                stop = 0 < tc.early_stop_patience <= self.bad_evals
                log.info("step %d: train loss %.4f, val loss %.4f (ppl %.2f, %.4f bits/byte)%s",
                         self.step, row["train_loss"], figures["val_loss"], figures["val_ppl"],
                         figures["val_bpb"], " *" if improved else "")
            if self.d.is_main:
                with open(self.out / "metrics.jsonl", "a") as f:
                    f.write(json.dumps({k: _json_safe(v) for k, v in row.items()}) + "\n")
            if save or stop or improved:
                self._save(step_ckpt=save or stop, best=improved)
            if stop:
                log.info("early stop at step %d: no better val loss in %d evaluations",
                         self.step, self.bad_evals)
                return "stopped_early"
            # The next window starts after eval and saving: tokens/s measures training only.
            window_start, window_t0 = self.step, time.perf_counter()
        return status

    def _summary_of_ended_run(self, status: str) -> dict:
        """summary.json of the session that ended the run, or a new one where the file is another
        session's (one killed after its last checkpoint left an earlier summary) or cut short."""
        try:
            summary = json.loads((self.out / "summary.json").read_text())
        except (OSError, json.JSONDecodeError):
            summary = {}
        if summary.get("status") == status and summary.get("steps") == self.step:
            return summary
        return self._write_summary(status, 0.0)

    def _write_summary(self, status: str, wall_s: float, error: Optional[str] = None) -> dict:
        """summary.json; ``wall_s``: this session's seconds (earlier sessions' are added)."""
        best = self.best_val_loss
        ckpts = self._checkpoints()
        tokens_seen = self._tokens_seen()
        summary = {
            "name": self.cfg.name, "variant": self.cfg.variant, "preset": self.cfg.preset,
            "status": status, "params": count_parameters(self.model),
            "steps": self.step, "steps_planned": self.tc.steps,
            "final_val_loss": self.last_eval.get("val_loss"),
            "final_val_ppl": self.last_eval.get("val_ppl"),
            "final_val_bpb": self.last_eval.get("val_bpb"),
            "best_val_loss": best, "best_val_ppl": perplexity(best),
            "best_val_bpb": bits_per_byte(best, self.meta["val_tokens"], self.meta["val_bytes"]),
            "final_train_loss": self.train_loss,
            "tokens_per_s": statistics.median(self.throughput) if self.throughput else None,
            "mfu": statistics.median(self.mfus) if self.mfus else None,
            "peak_mem_mb": self._peak_mem_mb(), "wall_time_s": self.wall_before + wall_s,
            "world_size": self.d.world_size, "gradients_by": self.step_fn.gradients_by,
            "device": (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                       else f"cpu ({torch.get_num_threads()} threads)"),
            "tokens_seen": tokens_seen, "epochs": tokens_seen / self.meta["train_tokens"],
            "global_batch_tokens": self.tokens_per_step,
            "checkpoint_bytes": ckpts[-1].stat().st_size if ckpts else None,
        }
        if error is not None:
            summary["error"] = error
        summary = {k: _json_safe(v) for k, v in summary.items()}
        if self.d.is_main:
            write_text_atomic(self.out / "summary.json", json.dumps(summary, indent=2) + "\n")
        return summary


def warn_about_schedule(tc: TrainConfig) -> None:
    """Log a warning where the warm-up outlasts the run: the learning rate never reaches
    ``train.lr``. Not refused: a short try of a long run's parameter file (``--set
    train.steps=20`` on a 2,000-step warm-up) is a fair thing to do."""
    if tc.warmup_steps > tc.steps:
        log.warning("train.warmup_steps=%d is longer than the run (train.steps=%d): the learning rate rises "
                    "to %.3g at the last step and never reaches train.lr=%g, nor decays to train.min_lr; set "
                    "train.warmup_steps below train.steps (e.g. %d, a tenth of it) to train at train.lr",
                    tc.warmup_steps, tc.steps, lr_at(tc.steps - 1, tc), tc.lr, max(1, tc.steps // 10))


# A step estimated to need more than this share of the memory there is gets a warning: the
# estimate leaves out the allocator's slack (on a CPU 5-25% under the measured peak, up to half
# where the loss's slices dominate: accounting.activation_bytes) and whatever else the machine runs.
MEMORY_WARNING_SHARE = 0.8


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


def check_step_memory(cfg: RunConfig, device: torch.device, local_processes: int = 1,
                      report: bool = True) -> dict:
    """Say what one optimiser step of ``cfg`` costs on ``device`` before anything runs: its peak
    memory (``accounting.step_memory``, bytes: one micro-step's) and FLOPs (``flops_per_token``
    times the tokens of the step, this process's share). ConfigError, naming the figures and the settings that lower them, where the step
    needs more than the device has (``device_memory``; on the CPU the RAM available, shared by
    the ``local_processes`` of this host); above MEMORY_WARNING_SHARE of it a warning, else an
    info line (neither unless ``report``: one rank speaks for all). Returns step_memory's account."""
    mc, tc = cfg.model_config(), cfg.train
    bf16 = tc.dtype == "bf16" or (tc.dtype == "auto" and device.type == "cuda")
    need = step_memory(mc, tc.batch_size, "bf16" if bf16 else "float32", device.type)
    total = need["total"] * (local_processes if device.type == "cpu" else 1)
    flops = flops_per_token(mc)["total"] * tc.batch_size * mc.block_size * tc.grad_accum
    processes = f" x {local_processes} processes" if device.type == "cpu" and local_processes > 1 else ""
    cost = (f"one training step of this run needs about {_size(need['total'])}{processes} (weights, gradients "
            f"and AdamW state {_size(need['state'])}, activations of {tc.batch_size} x {mc.block_size} tokens "
            f"{_size(need['activations'])}) and {_flops(flops)} a step")
    available, where = device_memory(device)
    if available is None:
        if report:
            log.info("%s; %s is not known here", cost, where)
        return need
    if total > available:
        preset = PRESETS[cfg.preset].get("block_size")
        block = (f"model.block_size ({mc.block_size}; the {cfg.preset} preset's is {preset})"
                 if "block_size" in cfg.model and preset != mc.block_size else f"model.block_size ({mc.block_size})")
        raise ConfigError(f"{cost}, more than {where} ({_size(available)}): lower {block} or "
                          f"train.batch_size ({tc.batch_size}; train.grad_accum keeps the tokens a step with "
                          f"less memory)")
    if not report:
        return need
    if total > MEMORY_WARNING_SHARE * available:
        log.warning("%s: %.0f%% of %s (%s); it may run out of memory: lower model.block_size or "
                    "train.batch_size (train.grad_accum keeps the tokens a step with less memory)",
                    cost, 100 * total / available, where, _size(available))
    else:
        log.info("%s; %s: %s", cost, where, _size(available))
    return need


def train(cfg: RunConfig, resume: bool = False) -> dict:
    """Train ``cfg`` (under torchrun: this rank's share) and return the summary dict.

    ``resume``: continue from the newest ``out_dir/ckpt/step_*.pt`` (from step 0 when there is
    none). Raises ConfigError / CheckpointError for unusable settings or files (or an out_dir
    that another training is writing to) and TrainingDiverged for a NaN/inf loss.
    """
    # Before any process group exists: fail fast, everywhere.
    schedule = cfg.validate().train.unfreeze_plan(cfg.model_config().n_layer)
    check_folders(cfg)
    d = setup_distributed(cfg.train)
    try:
        check_step_memory(cfg, d.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), report=d.is_main)
        if d.is_main:
            warn_about_schedule(cfg.train)
        with hold_run_folder(Path(cfg.out_dir), d):
            if d.device.type == "cpu":
                keep_large_blocks_in_heap()
            # A temporary: the Trainer, its DDP reducer and captured graph are freed before the
            # process group is destroyed below (destroying it under them can hang at exit).
            return Trainer(cfg, d, schedule, resume).fit()
    finally:
        if d.owns_group:
            dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> int:
    """The CLI; returns the exit code: 0 done, 2 unusable parameters/data/checkpoint, 3 diverged."""
    p = argparse.ArgumentParser(prog="python -m oelm_core.train",
                                description="Train a GPT / OELM model (also under torchrun).")
    p.add_argument("--params", required=True, help="YAML parameter file (see parameters/)")
    p.add_argument("--set", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="override a parameter, e.g. --set train.steps=200 model.dropout=0.1")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in out_dir/ckpt")
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    try:
        summary = train(load_run_config(args.params, args.set), resume=args.resume)
    except (ConfigError, CheckpointError) as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrainingDiverged as exc:
        if rank == 0:
            print(f"error: {exc}", file=sys.stderr)
        return 3
    if rank == 0:
        print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
