"""The training loop: one process or many (DDP), CPU or CUDA, resumable, for every variant.

    python -m oelm_core.train --params parameters/smoke/oelm_freeze.yaml [--set train.steps=200] [--resume]
    torchrun --nproc_per_node 8 -m oelm_core.train --params parameters/X.yaml

From Python: ``summary = train(load_run_config("parameters/X.yaml"))``.

Like minGPT's trainer it knows nothing about the model beyond ``build_model``, ``model(x, y)`` ->
mean loss, ``model.unfreeze_qk(layers)`` -> new parameters, ``model.live_config()`` -> its
configuration as it is now (which Q/K are still frozen) and, duck-typed, the modules'
``after_optimizer_step(step)`` hooks. Beside it: the step (``oelm_core.step``), processes and DDP
(``oelm_core.distributed``), what a resume checks and restores (``oelm_core.resume``), the run
folder's files and lock (``oelm_core.run_folder``). Its speed it asks of ``oelm_core.fast``, the
one door to the fast paths: the model's (``fast.apply``), the process's
(``fast.prepare_process``) and the step's (``fast.make_step``: the CUDA-graph step, the NVLink
gradient exchange), each the reference where its switch is off.

Data parallelism is exact: rank r's micro-step m draws its windows as virtual rank r*A + m of
W*A (A = grad_accum, W = world size), so W ranks with grad_accum A see the very batches one
process with grad_accum W*A sees, and the two loss curves agree to float rounding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm

from oelm_core import fast, occupancy, preflight, provenance
from oelm_core.accounting import count_parameters, flops_per_token, peak_flops
from oelm_core.batches import TokenSampler, bits_per_byte, eval_batches, perplexity
from oelm_core.checkpoint import RESUME_KEYS, CheckpointError, save_checkpoint
from oelm_core.config import PRESETS, ConfigError, ModelConfig, RunConfig
from oelm_core.data import load_meta, prepare, real_source
from oelm_core.distributed import (
    Dist,
    RankSilent,
    every_rank,
    mean_across_ranks,
    on_rank_0,
    setup_distributed,
    silent_ranks,
)
from oelm_core.export import RUN_EXPORT, ExportError, export_run
from oelm_core.files import DiskFull
from oelm_core.live_metrics import LiveMetrics
from oelm_core.model import build_model
from oelm_core.parameter_files import load_run_config
from oelm_core.preemption import EXIT_PREEMPTED, StopRequest, stop_on_signals
from oelm_core.resume import DATA_IDENTITY, check_same_data, ended, how_to_go_on, restore_state, resume_point
from oelm_core.run_folder import (
    append_metrics,
    check_folders,
    checkpoints,
    hold_run_folder,
    json_safe,
    read_summary,
    start_files,
    write_summary,
)
from oelm_core.step import autocast_context, configure_optimizer, lr_at

log = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf; the run stopped and its last good checkpoint stays."""


def train(cfg: RunConfig, resume: bool = False) -> dict:
    """Train ``cfg`` (under torchrun: this rank's share) and return the summary dict.

    ``resume``: continue from the newest ``out_dir/ckpt/step_*.pt`` (from step 0 when there is
    none). Raises ConfigError / CheckpointError for unusable settings or files (or an out_dir
    that another training is writing to) and TrainingDiverged for a NaN/inf loss.
    """
    # Before any process group exists: fail fast, everywhere.
    schedule = cfg.validate().train.unfreeze_plan(cfg.model_config().n_layer)
    check_folders(cfg)
    use_deterministic_kernels(cfg.train.deterministic)  # before CUDA starts: cuBLAS reads its setting once
    d = setup_distributed(cfg.train)
    try:
        preflight.check(cfg, d.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), report=d.is_main)
        with hold_run_folder(Path(cfg.out_dir), d):
            fast.prepare_process(cfg.train, d.device)  # the process-wide fast paths tc switches on
            # A temporary: the Trainer, its DDP reducer and captured graph are freed before the
            # process group is destroyed below (destroying it under them can hang at exit).
            return Trainer(cfg, d, schedule, resume).fit()
    except RuntimeError as exc:
        silent = silent_ranks(exc, d, cfg.train.ddp_timeout_s)  # a collective timed out: who went silent
        if silent is None:
            raise
        raise silent from exc
    finally:
        if d.owns_group:
            dist.destroy_process_group()


def use_deterministic_kernels(on: bool) -> None:
    """``train.deterministic``: only kernels whose result does not depend on thread timing, so that
    a configuration trained twice on one kind of device gives the same bits. On CUDA that is
    SDPA's backward without atomic adds (flash and memory-efficient attention have such a path;
    cuDNN's is skipped) and cuBLAS with a fixed workspace; an op with no deterministic kernel
    raises rather than run nondeterministically. Set for the whole process, both ways: runs
    trained one after another in one process (the in-process runner) each get their own."""
    if on:
        # cuBLAS reads this when its first handle is made: before any CUDA matmul of the process.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)
    # Under deterministic algorithms torch also fills every new tensor with NaN, a debugging aid
    # that costs a kernel per allocation and is no part of the result: every kernel here writes
    # what it later reads (two runs agreeing bit for bit is the test: tests/test_gpu_determinism.py).
    torch.utils.deterministic.fill_uninitialized_memory = not on


class Trainer:
    """One training session of a run; ``fit`` runs it. Use ``train()`` rather than this directly."""

    def __init__(self, cfg: RunConfig, d: Dist, schedule: dict[int, Any], resume: bool):
        self.cfg, self.tc, self.d, self.schedule = cfg, cfg.train, d, schedule
        self.out, self.device = Path(cfg.out_dir), d.device
        # Checked before the data is prepared: a refused run leaves the token files as they were.
        self.resume_from = resume_point(cfg, resume, d.world_size)
        on_rank_0(lambda: prepare(cfg.data, progress=self.tc.progress), d, "prepare the data")
        self.meta = load_meta(cfg.data.out_dir)
        if self.resume_from is not None:  # the stories' hashes are known once they are prepared
            check_same_data(cfg, self.resume_from[1], self.resume_from[0], self.meta)
        # config.yaml, checkpoints and the card name what was read: the folder OELM_DATA gave,
        # not the parameter file's hub id.
        self.cfg = cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, source=real_source(cfg.data.source))
        )
        peers = every_rank((socket.gethostname(), os.getpid()), d)
        self.occupancy = occupancy.Occupancy(d.device, {pid for host, pid in peers if host == peers[d.rank][0]})
        self.provenance = (
            provenance.of_run(
                cfg.data.source,
                cfg.data.out_dir,
                self.meta,
                d.device,
                d.world_size,
                hosts=len({host for host, _ in peers}),
            )
            if d.is_main
            else None
        )
        self.model_cfg: ModelConfig = cfg.model_config()
        check_vocabulary(cfg, self.model_cfg, self.meta)

        # --- the model, its optimiser and step ---
        if self.device.type == "cuda":
            torch.set_float32_matmul_precision("high")  # TF32 for float32 matmuls outside autocast
        # The seed makes the weights identical on every rank; the offset gives ranks own dropout.
        model = build_model(self.model_cfg, seed=self.tc.seed).to(self.device)
        self.model = fast.apply(model, self.tc)  # the fast paths tc switches on
        torch.manual_seed(self.tc.seed + d.rank)
        self.optimizer = configure_optimizer(self.model, self.tc, self.device)
        self.step_fn = fast.make_step(self.model, self.optimizer, self.tc, self.device, ddp=d.enabled)
        if self.step_fn.compile:
            log.info("torch.compile: the first step compiles the model (train.compile: %s)", self.tc.compile)
        self.autocast = autocast_context(self.tc.dtype, self.device)

        # --- the data: this rank's training windows, the validation batches ---
        block, batch, accum = self.model_cfg.block_size, self.tc.batch_size, self.tc.grad_accum
        data = Path(cfg.data.out_dir)
        vocab = self.meta["vocab_size"]
        self.samplers = [
            TokenSampler(
                data / "train.bin",
                block,
                batch,
                self.tc.seed,
                rank=d.rank * accum + m,
                world_size=d.world_size * accum,
                vocab_size=vocab,
            )
            for m in range(accum)
        ]
        # Evaluations read the selection half of the validation windows; each new best is also
        # measured on the held-out half, which nothing chooses by (train.report_holdout).
        parts = ("selection", "report") if self.tc.report_holdout else ("all", None)
        self.val, self.report_val = (
            None
            if part is None
            else [
                (x.to(self.device), y.to(self.device))
                for x, y in eval_batches(
                    data / "val.bin", block, batch, self.tc.eval_batches, vocab_size=vocab, part=part
                )
            ]
            for part in parts
        )
        self.tokens_per_step = batch * block * accum * d.world_size
        self.peak = peak_flops(self.device)
        self.flops_per_token = flops_per_token(self.model.live_config())["total"]

        # --- the run's progress (what a checkpoint's "metrics" restore) ---
        self.step = 0
        self.wall_before = 0.0  # earlier sessions' seconds
        self.best_val_loss = float("inf")
        self.best_step = 0
        self.report_loss = float("nan")  # the held-out half's loss at the best evaluation
        self.bad_evals = 0  # evaluations since the best one (early stopping)
        self.train_loss = float("nan")
        self.last_eval: dict = {}
        self.throughput: list[float] = []  # tokens/s of each log window of this session
        self.mfus: list[float] = []
        self.stop = StopRequest()  # set by fit(): a signal asks the loop to checkpoint and stop
        self.earlier: Optional[dict] = None  # a resumed run's earlier sessions: did they run alone?
        self.setup_s: Optional[float] = None  # seconds from the process's start to this session's loop

    # --- the session ----------------------------------------------------------------------------
    def fit(self) -> dict:
        self.t_start = time.perf_counter()
        self.setup_s = occupancy.process_age_s()
        if self.resume_from is not None:
            self.restore(*self.resume_from)
            self.resume_from = None  # the state's tensors are the model's and optimiser's now
        status = ended(self.tc, self.step, self.bad_evals)
        if status:
            log.info(
                "%s already ended (%s at step %d): nothing to train; %s",
                self.out,
                status,
                self.step,
                how_to_go_on(self.tc, self.step, self.bad_evals),
            )
            summary = read_summary(self.out)  # the session that ended it wrote it, unless killed first
            if summary.get("status") == status and summary.get("steps") == self.step:
                return summary
            return self.write_summary(status, 0.0)
        if self.d.is_main:
            start_files(self.cfg, self.step)
        self.live = LiveMetrics(self.out, self.tc.tensorboard and self.d.is_main, first_step=self.step)
        self.earlier = occupancy.earlier_sessions(read_summary(self.out), self.step) if self.step else None
        self.occupancy.sample()  # the first window starts here
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

        end = min(self.tc.steps, self.step + self.tc.stop_after) if self.tc.stop_after else self.tc.steps
        status = "completed" if end == self.tc.steps else "paused"
        bar = tqdm(
            total=self.tc.steps,
            initial=self.step,
            unit="step",
            dynamic_ncols=True,
            disable=not (self.d.is_main and self.tc.progress),
        )
        try:
            # The steps' time a stop signal may wait for a boundary: the steps between the ranks'
            # agreements, and an evaluation on the way (its forward passes: a third of a step each).
            apart = (self.tc.log_every if self.d.enabled else 1) + self.tc.eval_batches / 3
            with logging_redirect_tqdm(), stop_on_signals(steps_apart=apart) as self.stop:
                status = self.loop(end, bar, status)
        except TrainingDiverged as exc:
            self.write_summary("diverged", time.perf_counter() - self.t_start, error=str(exc))
            raise
        finally:
            bar.close()
            self.live.close()
        summary = self.write_summary(status, time.perf_counter() - self.t_start)
        # Not when preempted: the scheduler's grace time is for the checkpoint; the session that
        # ends the run exports it.
        if self.d.is_main and status != "preempted" and (self.out / "best.pt").is_file():
            # The best weights as safetensors + JSON: what leaves the run folder (no pickle to load).
            try:
                export_run(self.out)
            except ExportError as exc:  # the run itself is done and saved: say why, do not fail it
                log.warning("no %s/%s: %s", self.out, RUN_EXPORT, exc)
        return summary

    def loop(self, end: int, bar, status: str) -> str:
        """Train up to step ``end``; how the session ended (``status`` unless it stopped early)."""
        tc = self.tc
        window = (self.step, time.perf_counter())  # the steps and time since the last log row
        while self.step < end:
            if self.step in self.schedule:
                self.unfreeze(self.schedule[self.step])
            lr = lr_at(self.step, tc)
            batches = [s.next_batch(self.device) for s in self.samplers]
            loss, grad_norm = self.step_fn(batches, lr, self.step + 1)
            self.step += 1
            bar.update(1)

            # Not at a pause (stop_after): an extra evaluation would move best.pt and early stopping
            # away from those of the uninterrupted run.
            evaluate = self.step % tc.eval_every == 0 or self.step == tc.steps
            save = self.step % tc.ckpt_every == 0 or self.step == end
            logged = evaluate or save or self.step % tc.log_every == 0 or self.step == 1
            preempted = self.stop.agreed(self.d, sync=logged)  # a stop signal (oelm_core.preemption)
            if not (logged or preempted):
                continue  # step 1 is logged too: the curve's starting point
            # The figures of every step that saves: the divergence check runs before any save.
            row = self.train_figures(loss, grad_norm, lr, *window)
            bar.set_postfix(loss=f"{row['train_loss']:.4f}", tok_s=f"{row['tokens_per_s']:.0f}")
            improved = stop = False
            if evaluate:
                figures = self.evaluate()
                row.update(figures)
                self.last_eval = figures
                improved = figures["val_loss"] < self.best_val_loss
                if improved:
                    self.best_val_loss, self.best_step, self.bad_evals = figures["val_loss"], self.step, 0
                    if self.report_val is not None:
                        self.report_loss = self.mean_loss(self.report_val)
                else:
                    self.bad_evals += 1
                stop = 0 < tc.early_stop_patience <= self.bad_evals
                log.info(
                    "step %d: train loss %.4f, val loss %.4f (ppl %.2f, %.4f bits/byte)%s",
                    self.step,
                    row["train_loss"],
                    figures["val_loss"],
                    figures["val_ppl"],
                    figures["val_bpb"],
                    " *" if improved else "",
                )
            # A row only where the uninterrupted run writes one: a resumed run's metrics are its.
            if self.d.is_main and logged:
                append_metrics(self.out, row)
                self.live.write(row)
            self.occupancy.sample()  # at most every few seconds, from figures already read back
            if save or stop or improved or preempted:
                self.save(step_ckpt=save or stop or preempted, best=improved)
            if stop:
                log.info("early stop at step %d: no better val loss in %d evaluations", self.step, self.bad_evals)
                return "stopped_early"
            if preempted:
                log.info(
                    "step %d: %s received: checkpoint saved, stopping; --resume continues from it",
                    self.step,
                    self.stop.signal or "a stop signal (on another rank)",
                )
                return "preempted"
            # The next window starts after eval and saving: tokens/s measures training only.
            window = (self.step, time.perf_counter())
        return status

    def unfreeze(self, layers) -> None:
        """Progressive unfreezing: the model makes Q/K of ``layers`` trainable, the optimizer takes
        the new parameters as a group of their own. The model keeps which layers are frozen now
        (``live_config``): the FLOPs, the checkpoints and the export read it there."""
        new = self.model.unfreeze_qk(layers)
        if new:
            self.optimizer.add_param_group({"params": new, "weight_decay": self.tc.weight_decay})
            self.step_fn.wrap()  # DDP (and compile) must see the new parameter set
        self.flops_per_token = flops_per_token(self.model.live_config())["total"]
        log.info("step %d: unfroze Q/K of layers %s (%d new tensors)", self.step, layers, len(new))

    # --- measuring ------------------------------------------------------------------------------
    def train_figures(
        self, loss: torch.Tensor, grad_norm: torch.Tensor, lr: float, window_start: int, window_t0: float
    ) -> dict:
        """The log row's training figures; raises TrainingDiverged on a NaN/inf loss or norm. The
        window began at step ``window_start``, at perf_counter() ``window_t0``. The all-reduced
        values are the same on every rank, so all ranks stop together."""
        loss_v = mean_across_ranks(loss).item()
        norm_v = grad_norm.item()
        # Only now: the GPU runs behind the host (a captured step returns at once), and reading
        # the loss waited for the window's last step.
        window_s = time.perf_counter() - window_t0
        if not (math.isfinite(loss_v) and math.isfinite(norm_v)):
            kept = checkpoints(self.out)
            raise TrainingDiverged(
                f"training diverged at step {self.step}: loss {loss_v}, grad norm {norm_v}. "
                f"Lower train.lr (now {self.tc.lr}), lengthen train.warmup_steps or keep train.grad_clip "
                f"on, and check the data in {self.cfg.data.out_dir}. The last good checkpoint "
                f"{kept[-1] if kept else '(none yet)'} is kept; nothing was saved after the divergence"
            )
        self.train_loss = loss_v
        self.stop.seconds_per_step = window_s / (self.step - window_start)  # how long a stop signal waits
        tokens_per_s = (self.step - window_start) * self.tokens_per_step / window_s
        mfu = self.flops_per_token * tokens_per_s / (self.peak * self.d.world_size) if self.peak else None
        self.throughput.append(tokens_per_s)
        if mfu is not None:
            self.mfus.append(mfu)
        return {
            "step": self.step,
            "train_loss": loss_v,
            "lr": lr,
            "grad_norm": norm_v,
            "tokens_per_s": tokens_per_s,
            "mfu": mfu,
            "peak_mem_mb": self.peak_mem_mb(),
            "tokens_seen": self.tokens_seen(),
            "epochs": self.tokens_seen() / self.meta["train_tokens"],
        }

    def tokens_seen(self) -> int:
        return self.step * self.tokens_per_step  # the global batch is the run's own (check_resumable)

    def peak_mem_mb(self) -> Optional[float]:
        return torch.cuda.max_memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else None

    def evaluate(self) -> dict:
        """The validation figures of the model now: val_loss (nats/token), val_ppl and val_bpb (bits
        per UTF-8 byte), over the selection half of the validation windows (all of them without
        train.report_holdout)."""
        val_loss = self.mean_loss(self.val)
        return {"val_loss": val_loss, "val_ppl": perplexity(val_loss), "val_bpb": self.bpb(val_loss)}

    @torch.no_grad()
    def mean_loss(self, batches: list) -> float:
        """Mean loss (nats/token) over ``batches``, shared out round-robin across ranks and weighted
        by tokens."""
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self.device)  # (sum of loss x tokens, tokens)
        for x, y in batches[self.d.rank :: self.d.world_size]:
            with self.autocast:
                loss = self.model(x, y)
            total[0] += loss.double() * y.numel()
            total[1] += y.numel()
        self.model.train()
        if self.d.enabled:
            dist.all_reduce(total)
        return (total[0] / total[1]).item()

    def bpb(self, loss: float) -> float:
        return bits_per_byte(loss, self.meta["val_tokens"], self.meta["val_bytes"])

    # --- checkpoints ----------------------------------------------------------------------------
    def state(self) -> Optional[dict]:
        """The checkpoint dict on rank 0 (None elsewhere). Collective: every rank's RNG is gathered."""
        rng = {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
        }
        rngs = [rng]
        if self.d.enabled:
            rngs = [None] * self.d.world_size
            dist.all_gather_object(rngs, rng)
        if not self.d.is_main:
            return None
        # Every sampler slot draws exactly one batch per step, so one slot's state describes all.
        sampler = {**self.samplers[0].state_dict(), "virtual_world": self.d.world_size * self.tc.grad_accum}
        metrics = {
            **self.last_eval,
            "best_val_loss": json_safe(self.best_val_loss),
            "best_step": self.best_step,
            "report_loss": json_safe(self.report_loss),
            "bad_evals": self.bad_evals,
            "train_loss": json_safe(self.train_loss),
            "tokens_seen": self.tokens_seen(),
            "epochs": self.tokens_seen() / self.meta["train_tokens"],
            "wall_time_s": self.wall_before + time.perf_counter() - self.t_start,
        }
        return {
            "model": self.model.state_dict(),
            "model_config": dataclasses.asdict(self.model.live_config()),
            "run_config": self.cfg.to_dict(),
            "step": self.step,
            "data": {key: self.meta.get(key) for key in DATA_IDENTITY},
            "optimizer": self.optimizer.state_dict(),
            "rng": {"cpu": [r["cpu"] for r in rngs], "cuda": [r["cuda"] for r in rngs if r["cuda"] is not None]},
            "sampler": sampler,
            "metrics": metrics,
        }

    def save(self, step_ckpt: bool, best: bool) -> None:
        state = self.state()
        if state is None:
            return
        # best.pt first: a run killed between the two resumes from the step before, evaluates
        # again and rewrites it, where the other order would leave older weights there for good.
        if best:
            # best.pt is for evaluation and the demo, not for resuming: the weights without the
            # optimizer state, a third of the size and of the time to write.
            save_checkpoint({k: v for k, v in state.items() if k not in RESUME_KEYS}, self.out / "best.pt")
        if step_ckpt:
            save_checkpoint(state, self.out / "ckpt" / f"step_{self.step:07d}.pt")
            for old in checkpoints(self.out)[: -self.tc.keep_last]:
                old.unlink()

    def restore(self, path: Path, state: dict) -> None:
        self.step = int(state["step"])
        # Replay the unfreezes already done so the parameters and optimiser groups match the saved ones.
        for at, layers in self.schedule.items():
            if at < self.step:
                self.unfreeze(layers)
        restore_state(state, self.model, self.optimizer, self.samplers, self.d, self.tc.seed)
        m = state["metrics"]
        self.best_val_loss = m["best_val_loss"] if m.get("best_val_loss") is not None else float("inf")
        self.bad_evals = m.get("bad_evals", 0)
        self.best_step = m.get("best_step", 0)
        self.report_loss = m["report_loss"] if m.get("report_loss") is not None else float("nan")
        self.train_loss = m["train_loss"] if m.get("train_loss") is not None else float("nan")
        self.last_eval = {k: m[k] for k in ("val_loss", "val_ppl", "val_bpb") if m.get(k) is not None}
        self.wall_before = float(m.get("wall_time_s") or 0.0)
        log.info("resumed %s at step %d", path, self.step)

    def write_summary(self, status: str, wall_s: float, error: Optional[str] = None) -> dict:
        """summary.json (rank 0) and the summary; ``wall_s``: this session's seconds (earlier
        sessions' are added)."""
        best = self.best_val_loss
        ckpts = checkpoints(self.out)
        shared = occupancy.verdict(every_rank(self.occupancy.result(), self.d), self.earlier)
        summary = {
            "name": self.cfg.name,
            "variant": self.cfg.variant,
            "preset": self.cfg.preset,
            "status": status,
            "params": count_parameters(self.model),
            "steps": self.step,
            "steps_planned": self.tc.steps,
            "final_val_loss": self.last_eval.get("val_loss"),
            "final_val_ppl": self.last_eval.get("val_ppl"),
            "final_val_bpb": self.last_eval.get("val_bpb"),
            "best_val_loss": best,
            "best_val_ppl": perplexity(best),
            "best_val_bpb": self.bpb(best),
            "best_step": self.best_step,
            # The best weights on the validation half no evaluation chose by: what studies report.
            "report_val_loss": self.report_loss,
            "report_val_ppl": perplexity(self.report_loss),
            "report_val_bpb": self.bpb(self.report_loss),
            "val_windows": {
                "selection": sum(len(y) for _, y in self.val),
                "report": sum(len(y) for _, y in self.report_val or []),
            },
            "final_train_loss": self.train_loss,
            "tokens_per_s": statistics.median(self.throughput) if self.throughput else None,
            "mfu": statistics.median(self.mfus) if self.mfus else None,
            "peak_mem_mb": self.peak_mem_mb(),
            "wall_time_s": self.wall_before + wall_s,
            "setup_s": self.setup_s,  # this session's start-up before the training loop
            "world_size": self.d.world_size,
            "gradients_by": self.step_fn.gradients_by,
            "compiled": self.step_fn.compile,  # train.compile as resolved ("auto"), after any fallback
            "device": (
                torch.cuda.get_device_name(self.device)
                if self.device.type == "cuda"
                else f"cpu ({torch.get_num_threads()} threads)"
            ),
            "tokens_seen": self.tokens_seen(),
            "epochs": self.tokens_seen() / self.meta["train_tokens"],
            "global_batch_tokens": self.tokens_per_step,
            "checkpoint_bytes": ckpts[-1].stat().st_size if ckpts else None,
            "timed_alone": shared["timed_alone"],
            "provenance": self.provenance and {**self.provenance, "occupancy": shared},
        }
        if error is not None:
            summary["error"] = error
        summary = {k: json_safe(v) for k, v in summary.items()}
        if self.d.is_main:
            write_summary(self.out, summary)
        return summary


def check_vocabulary(cfg: RunConfig, model_cfg: ModelConfig, meta: dict) -> None:
    """Refuse token files whose ids the embedding has no row for (torch.embedding would fail
    at the first step with a bare IndexError). The meta's vocabulary is the tokenizer's,
    which bounds every id its files can hold, without reading them."""
    data_vocab, vocab = meta["vocab_size"], model_cfg.vocab_size
    if vocab >= data_vocab:
        return
    fits = [name for name, shape in PRESETS.items() if shape.get("vocab_size", ModelConfig.vocab_size) >= data_vocab]
    origin = "" if "vocab_size" in cfg.model else f" (preset {cfg.preset})"
    raise ConfigError(
        f"the token files in {cfg.data.out_dir} hold {meta['tokenizer']} ids up to "
        f"{data_vocab - 1} (a {data_vocab}-token vocabulary), but model.vocab_size is "
        f"{vocab}{origin}: the embedding has no row for ids from {vocab} on. Use a preset "
        f"with the {meta['tokenizer']} vocabulary ({', '.join(fits)}) or set "
        f"model.vocab_size: {data_vocab}"
    )


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    """The CLI; returns the exit code: 0 done, 2 unusable parameters/data/checkpoint, 3 diverged,
    1 a full disk, 75 (EXIT_PREEMPTED) stopped by a signal with its checkpoint saved (resume
    with --resume)."""
    p = argparse.ArgumentParser(
        prog="python -m oelm_core.train", description="Train a GPT / OELM model (also under torchrun)."
    )
    p.add_argument("--params", required=True, help="YAML parameter file (see parameters/)")
    p.add_argument(
        "--set",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override a parameter, e.g. --set train.steps=200 model.dropout=0.1",
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in out_dir/ckpt")
    args = p.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(message)s")
    try:
        summary = train(load_run_config(args.params, args.set), resume=args.resume)
    except (ConfigError, CheckpointError, TrainingDiverged, DiskFull, RankSilent) as exc:
        if rank == 0 or isinstance(exc, RankSilent):  # a silent rank 0 cannot say it
            print(f"error: {exc}", file=sys.stderr)
        # A full disk or a silent rank exits as the crash it was before (1), with one line
        # instead of tracebacks.
        return 3 if isinstance(exc, TrainingDiverged) else 1 if isinstance(exc, (DiskFull, RankSilent)) else 2
    if rank == 0:
        print(json.dumps(summary, indent=2))
    return EXIT_PREEMPTED if summary.get("status") == "preempted" else 0


if __name__ == "__main__":
    sys.exit(main())
