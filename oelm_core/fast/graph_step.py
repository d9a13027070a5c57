"""The training step captured once as a CUDA graph and replayed.

At small batches a step is bound by the host launching kernels; a replay is one launch. The
step is ``oelm_core.step.TrainStep``'s, unchanged: a few eager steps on a side stream let
compile, the optimiser state and (under DDP) the reducer settle, then forward, backward, the
gradient exchange (DDP's all-reduce with NCCL, or the NVLink copies), clip and AdamW are captured
together; the next steps copy their batch into the graph's inputs, set the learning rate and
replay. Every rank captures or none does. A step that cannot be captured runs eagerly, correct
either way.

Switch: ``train.cuda_graph`` (``oelm_core.fast.make_step`` picks this step on a CUDA device).
Gain: benchmarks/README.md.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from oelm_core.config import TrainConfig
from oelm_core.step import TrainStep, _first_line

log = logging.getLogger(__name__)


def capturable(optimizer: torch.optim.Optimizer, lr: float, device: torch.device) -> None:
    """Make ``optimizer``'s step capturable: each param group's learning rate becomes a 0-dim
    tensor on ``device`` holding ``lr`` (the step reads it there, and ``feed`` fills it in place),
    and AdamW keeps its step counts on the device."""
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(float(lr), device=device)
        group["capturable"] = True


def feed(inputs: list, optimizer: torch.optim.Optimizer, batches: list, lr: float) -> None:
    """Give a captured step its next ``batches`` and learning rate ``lr``: copied into the
    tensors the graph was captured on, the static ``inputs`` ((x, y) pairs) and each param
    group's 0-dim ``lr`` tensor. In place: a new tensor (or a Python float) in their stead would
    leave the replays reading the captured ones, the learning rate frozen at its value at capture."""
    for (x, y), (sx, sy) in zip(batches, inputs):
        sx.copy_(x, non_blocking=True)
        sy.copy_(y, non_blocking=True)
    for group in optimizer.param_groups:
        group["lr"].fill_(lr)


class GraphStep(TrainStep):
    """``TrainStep`` whose ``run`` replays a CUDA graph of itself (see the module)."""

    # Eager steps before the capture: two let compile and the optimiser state settle; DDP asks
    # for 11 (PyTorch's CUDA-graph notes: its reducer rebuilds buckets and finishes its
    # bookkeeping over the first iterations, and a capture must see the steady state).
    WARMUP_STEPS, WARMUP_STEPS_DDP = 2, 11

    @staticmethod
    def can_run(ddp: bool) -> bool:
        """Whether a step of this process can be captured: NCCL (>= 2.9) collectives can be,
        gloo's cannot."""
        return torch.cuda.is_available() and (not ddp or dist.get_backend() == "nccl")

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        tc: TrainConfig,
        device: torch.device,
        ddp: bool = False,
        **options,
    ):
        """``TrainStep``'s arguments (``options``: its ``data_parallel``)."""
        # DDP is built, warmed up and captured on this one stream: the default stream cannot
        # take part in a capture, and the reducer's hooks run on the stream DDP was built on.
        self.stream = torch.cuda.Stream(device)
        super().__init__(model, optimizer, tc, device, ddp, **options)

    def wrap(self) -> None:
        super().wrap()
        # A new parameter set is captured anew, after new warm-up steps; a captured step left its
        # gradients in .grad (the graph's static outputs), which wrap() has dropped.
        self.graph, self.warm = None, 0

    def data_parallel(self, module: nn.Module):
        with self.on_stream():
            return super().data_parallel(module)

    @contextmanager
    def on_stream(self):
        """Run the block on ``self.stream`` (ordered after the current stream's work, and the
        current stream after it); a no-op once capturing has been given up."""
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield
        torch.cuda.current_stream().wait_stream(self.stream)

    def run(self, batches: list, lr: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the captured step; warm up (side stream) and capture first."""
        if self.stream is None:  # capturing was given up
            return super().run(batches, lr)
        shapes = [(tuple(x.shape), tuple(y.shape)) for x, y in batches]
        if self.graph is not None and shapes == self.shapes:
            feed(self.inputs, self.optimizer, batches, lr)
            self.graph.replay()
            return self.outputs[0].clone(), self.outputs[1].clone()
        if self.warm < (self.WARMUP_STEPS_DDP if self.ddp else self.WARMUP_STEPS):
            self.warm += 1
            with self.on_stream():
                return super().run(batches, lr)
        if not self.capture(batches, lr):
            return super().run(batches, lr)
        self.shapes = shapes
        return self.run(batches, lr)

    def capture(self, batches: list, lr: float) -> bool:
        """Capture the step on copies of ``batches`` (not run: its first replay runs it);
        whether it worked. On failure on any rank every rank goes on eagerly."""
        device = batches[0][0].device
        self.inputs = [(x.clone(), y.clone()) for x, y in batches]
        capturable(self.optimizer, lr, device)
        self.optimizer.zero_grad(set_to_none=True)
        graph, error = torch.cuda.CUDAGraph(), None
        try:
            # thread_local: NCCL's watchdog thread keeps querying events during the capture.
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                loss = self.forward_backward(self.inputs)
                norm = self.clip_and_step()
        except Exception as exc:  # an op that cannot be captured
            error = _first_line(exc)
        if self.ddp:  # a rank replaying its collectives alone would wait forever: agree first
            failed = torch.tensor(float(error is not None), device=device)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
            if failed.item() and error is None:
                error = "another rank could not capture its step"
        if error is not None:
            log.warning("CUDA graph capture failed (%s); continuing without it", error)
            torch.cuda.synchronize()
            self.stream = None
            for group in self.optimizer.param_groups:
                group["capturable"] = False
            self.optimizer.zero_grad(set_to_none=True)
            if self.ddp:
                self.wrap()  # a reducer stopped mid-backward cannot run again; a new one can
            return False
        self.graph, self.outputs = graph, (loss, norm)
        log.info(
            "captured the training step as a CUDA graph%s",
            ""
            if not self.ddp
            else " with the NVLink gradient exchange"
            if self.gradients_by == "nvlink copies"
            else " with DDP's all-reduce",
        )
        return True
