"""The training step: forward and backward over the micro-batches, clip, AdamW.

    step = TrainStep(model, configure_optimizer(model, tc, device), tc, device, ddp=False)
    loss, grad_norm = step(batches, lr, step_number)

``TrainStep`` is the reference step. The trainer asks ``oelm_core.fast.make_step`` for its
step: this one, or where ``train.cuda_graph`` lets it its CUDA-graph subclass
(``oelm_core.fast.graph_step``), which captures this very step once and replays it.
"""

from __future__ import annotations

import logging
import math
from contextlib import nullcontext
from typing import Callable

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from oelm_core.config import TrainConfig
from oelm_core.distributed import data_parallel

log = logging.getLogger(__name__)


def lr_at(step: int, tc: TrainConfig) -> float:
    """Learning rate of the optimiser step that follows ``step`` completed steps.

    Linear warmup from lr/warmup_steps to lr over the first warmup_steps steps, then a cosine
    from lr down to min_lr, reached at step ``tc.steps``.
    """
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    progress = min(1.0, (step - tc.warmup_steps) / max(1, tc.steps - tc.warmup_steps))
    return tc.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (tc.lr - tc.min_lr)


def configure_optimizer(model: nn.Module, tc: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW over the model's trainable parameters, in two groups.

    Group 0: every tensor with ndim >= 2, with ``tc.weight_decay``: Linear weights, embeddings,
    trainable Q/K, and also POET's skew generators (``skew_*``, whose decay pulls R and P towards
    I between merges) and the Synthesizer's logit tables (``synth_*``). The committed ablation
    results were trained so. Group 1: biases and LayerNorm gains/shifts (ndim 1) without decay:
    shrinking them towards 0 shifts activations rather than regularising a mapping.
    Frozen Q/K are buffers and never reach the optimiser; tied weights appear once.
    Progressive unfreezing appends one decayed group per unfreeze (``Trainer.unfreeze``).
    PyTorch's fused AdamW where the device has one (CUDA, CPU), as nanoGPT takes it.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": tc.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), eps=tc.eps, fused=True if device.type in ("cuda", "cpu") else None
    )


def autocast_context(dtype: str, device: torch.device):
    """bf16 autocast on CUDA ("auto") or when asked for; float32 otherwise. Reusable context."""
    use_bf16 = dtype == "bf16" or (dtype == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16) if use_bf16 else nullcontext()


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


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


class TrainStep:
    """One optimiser step: what the loop runs and what a benchmark should time.

    ``loss, grad_norm = step(batches, lr, step_number)`` with ``batches`` a list of grad_accum
    (x, y) int64 (B, T) pairs on the model's device: forward+backward of each micro-batch (the
    gradient exchange between ranks only on the last), clip, AdamW at ``lr``, then the modules'
    ``after_optimizer_step(step_number)`` hooks. Returns 0-dim device tensors (this rank's mean
    micro-batch loss in nats/token, the pre-clip global gradient norm) so nothing waits for the GPU.

    ``model`` is the plain module (state_dict and hooks come from it); the forward runs through
    ``self.module``, its compiled and/or data-parallel wrapper, rebuilt by ``wrap()`` whenever the
    parameter set changes (progressive unfreezing). With ``ddp`` the gradients are averaged over
    the ranks by DDP and/or ``self.exchange``, as ``data_parallel(model, module, tc, device)`` ->
    (module, exchange or None) makes them: the reference's DDP
    (``oelm_core.distributed.data_parallel``) unless the caller gives another
    (``oelm_core.fast.data_parallel``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        tc: TrainConfig,
        device: torch.device,
        ddp: bool = False,
        data_parallel: Callable = data_parallel,
    ):
        self.model, self.optimizer, self.tc, self.device, self.ddp = model, optimizer, tc, device, ddp
        self.make_data_parallel = data_parallel
        self.autocast = autocast_context(tc.dtype, device)
        self.compile = tc.compiles(device.type)
        self.exchange = None
        self.wrap()

    def wrap(self) -> None:
        """(Re)build ``self.module`` around the model's current parameters."""
        if self.exchange is not None:
            self.exchange.remove()
            self.exchange = None
        module = torch.compile(self.model) if self.compile else self.model
        if self.ddp:
            module, self.exchange = self.data_parallel(module)
        self.module = module
        self.params = [p for group in self.optimizer.param_groups for p in group["params"]]
        self.hooks = [
            m.after_optimizer_step for m in self.model.modules() if callable(getattr(m, "after_optimizer_step", None))
        ]
        # torch.compile fails lazily, at the first call; until one call succeeded we may fall back.
        self.compile_verified = not self.compile
        self.optimizer.zero_grad(set_to_none=True)

    def data_parallel(self, module: nn.Module):
        return self.make_data_parallel(self.model, module, self.tc, self.device)

    @property
    def gradients_by(self) -> str:
        """What exchanges the gradients between ranks: "nvlink copies", "ddp" or "none"."""
        if isinstance(self.module, DDP):
            return "ddp"
        return getattr(self.exchange, "gradients_by", "none")

    def __call__(self, batches: list, lr: float, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        loss, grad_norm = self.run(batches, lr)
        for hook in self.hooks:
            restart_optimizer_state(self.optimizer, hook(step) or ())
        return loss, grad_norm

    def run(self, batches: list, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward/backward, clip and AdamW at ``lr``: (mean loss, grad norm)."""
        try:
            loss = self.forward_backward(batches)
        except Exception as exc:  # Dynamo/Inductor raise many types; eager is always correct
            if self.compile_verified:
                raise
            log.warning("torch.compile failed (%s); continuing in eager mode", _first_line(exc))
            self.compile = False
            self.wrap()  # also drops the failed backward's partial gradients
            loss = self.forward_backward(batches)
        self.compile_verified = True
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        grad_norm = self.clip_and_step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm

    def forward_backward(self, batches: list) -> torch.Tensor:
        """Accumulate the gradients of the micro-batches; the mean of their losses (0-dim)."""
        total = torch.zeros((), device=batches[0][0].device)
        if self.exchange is not None:
            self.exchange.begin([x for x, _ in batches])
        for i, (x, y) in enumerate(batches):
            last = i == len(batches) - 1
            if self.exchange is not None:
                self.exchange.sync = last
            # no_sync: accumulate locally, all-reduce once on the last micro-step (covers backward).
            with self.module.no_sync() if isinstance(self.module, DDP) and not last else nullcontext():
                with self.autocast:
                    loss = self.module(x, y)
                (loss / len(batches)).backward()
            total += loss.detach().float()
        if self.exchange is not None:
            self.exchange.finish()
        return total / len(batches)

    def clip_and_step(self) -> torch.Tensor:
        """Scale the gradients down to a global norm of at most ``train.grad_clip`` and take the
        optimiser step. Returns the norm before clipping (0-dim tensor; computed and logged even
        when clipping is off). Gradients that hold a sum over ranks (the NVLink exchange's
        ``grad_divisor``) are averaged first."""
        max_norm = self.tc.grad_clip or float("inf")
        divisor = getattr(self.exchange, "grad_divisor", 1.0)
        grads = [p.grad for p in self.params if p.grad is not None]
        if divisor != 1.0:
            torch._foreach_mul_(grads, 1.0 / divisor)
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
        # clip_grad_norm_'s factor max_norm / (norm + 1e-6), capped at 1, applied as a division
        # (the rounding the study's runs were trained with), without a sync: capturable in a graph.
        torch._foreach_div_(grads, torch.clamp((norm + 1e-6) / max_norm, min=1.0))
        self.optimizer.step()
        return norm
