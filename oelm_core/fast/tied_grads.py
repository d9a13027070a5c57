"""DDP: the tied embedding/output weight's gradient reduced in two shares, most of it during the
backward pass.

DDP reduces a parameter once its gradient is complete, and the tied weight's is complete only
after the embedding's backward, the last op of the backward pass: at medium512 its 103 MB (of
180 MB of gradients) were all-reduced with nothing left to hide behind. The fused loss
(``oelm_core.fast.loss.ChunkedOutputLoss``) hands the output layer's share of that gradient to a
hook as the backward starts (``split_tied_gradient``); ``TiedGradReducer`` all-reduces it then,
and gathers only the rows of the batch's tokens of the embedding's share.

Switch: ``train.tied_grad_split`` (under DDP; it needs ``train.fused_loss``, whose loss carries
the hook). Gain: benchmarks/README.md.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn


def split_tied_gradient(model: nn.Module, hook: Optional[Callable[[torch.Tensor], None]]) -> Optional[nn.Parameter]:
    """Hand the output layer's share of the tied weight's gradient to ``hook`` instead of adding
    it to ``wte.weight.grad``, which then holds the embedding's share alone: nonzero only in the
    rows of the batch's tokens. ``hook(g)`` gets g (padded_vocab, d_model), float32, when the
    backward pass starts (the fused loss computes it in the forward).

    Returns the tied weight, or None when there is nothing to split: an untied output layer, or
    an output loss without a ``grad_hook`` (the reference ``model.OutputLoss``: train.fused_loss
    off). ``hook=None`` joins the shares again.
    """
    loss = getattr(model, "output_loss", None)
    if getattr(model, "lm_head", None) is not None or not hasattr(loss, "grad_hook"):
        return None
    loss.grad_hook = hook
    return model.wte.weight


def first_of_each(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids (N,) -> (sorted ids, bool mask of each id's first place): the tied weight's embedding
    rows are sent once each (here and by ``oelm_core.fast.peer_grads``), the repeats as exact
    zeros. The ids must be words (< ``cfg.vocab_size``), as the data's tokens are: the NVLink
    exchange gathers the repeats from a padding row."""
    ids = ids.sort().values
    first = torch.ones_like(ids, dtype=torch.bool)
    first[1:] = ids[1:] != ids[:-1]
    return ids, first


class TiedGradReducer:
    """The data-parallel mean of the tied embedding/output weight's gradient, reduced in two
    shares so that most of it overlaps the backward pass; DDP reduces every other parameter.

    - the output layer's share (dense) arrives as the backward pass starts, and its all-reduce
      starts then, on NCCL's stream, while the rest of the backward runs (``_on_output_grad``);
    - the embedding's share is nonzero only in the rows of this rank's tokens: as soon as it
      is written (``_on_embedding_grad``) those rows are gathered from every rank (tokens x
      d_model floats: 8 MB at 8 x 512 instead of 103 MB), and ``finish`` adds them to the
      reduced output share (``begin`` says when rows pay).

    Each row is sent once (a repeated token adds an exact zero) and every rank adds the ranks'
    rows in the same order, so the weights stay bitwise equal across ranks. Works with NCCL
    (and inside the step's CUDA graph) and with gloo.

    Use (``oelm_core.step.TrainStep``): ``begin(tokens)`` before a step's first backward;
    ``sync = False`` on micro-steps that only accumulate; ``finish()`` after the last backward.
    """

    grad_divisor = 1.0  # finish() leaves the mean in .grad
    gradients_by = "ddp"

    def __init__(self, model: nn.Module, weight: nn.Parameter):
        # Not the model: a reference to it from its own loss's hook would keep it (and what it
        # holds) alive past the trainer, until the garbage collector runs.
        self.loss, self.weight, self.world = model.output_loss, weight, dist.get_world_size()
        # NCCL averages within the all-reduce; gloo has no AVG: sum, then scale.
        self.average = dist.get_backend() == "nccl"
        self.sync = True  # False on micro-steps that only accumulate (DDP's no_sync)
        self._ids: Optional[torch.Tensor] = None  # this step's tokens, when its rows are gathered
        self._first = self._all_ids = self._ids_work = None
        self._out: Optional[torch.Tensor] = None
        self._work = self._rows = self._rows_work = None
        split_tied_gradient(model, self._on_output_grad)
        # Fires when the embedding's backward has written its share, still inside the backward
        # pass: the rows then queue on NCCL ahead of DDP's last buckets instead of after them.
        self._hook = weight.register_post_accumulate_grad_hook(self._on_embedding_grad)

    @classmethod
    def for_model(cls, model: nn.Module) -> Optional["TiedGradReducer"]:
        """A reducer for ``model``'s tied weight, or None if it has none to split or there is one
        rank (nothing to reduce: gathering rows would be work for nothing)."""
        weight = split_tied_gradient(model, None)  # also drops an earlier reducer's hook
        if weight is None or not weight.requires_grad or dist.get_world_size() == 1:
            return None
        return cls(model, weight)

    def remove(self) -> None:
        """Detach from the model (before another reducer or none takes over)."""
        self._hook.remove()
        self.loss.grad_hook = None

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
