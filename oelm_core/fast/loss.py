"""The output layer and its cross-entropy in slices of tokens: the fused loss.

The output layer is the largest tensor of the step (tokens x 50,257 floats). ``ChunkedOutputLoss``
takes ``model.output_loss``'s place (``install``) and computes the same mean cross-entropy slice by
slice: the logits of one slice, their log-sum-exp, the loss *and already the gradients* (softmax -
one_hot), so the backward only scales them by the incoming scalar. The same matmuls as the plain
path, with one slice of logits alive instead of all of them in float32. On CUDA the per-slice work
is the Triton kernels of ``oelm_core.fast.ce_kernels``; elsewhere plain torch ops.

Switch: ``train.fused_loss`` (and ``train.loss_chunk_tokens``, ``train.fused_logits``).
"""

from __future__ import annotations

from typing import Callable, Optional

import functools
import torch
import torch.nn as nn

from oelm_core.config import TrainConfig


@functools.lru_cache(maxsize=1)
def _cuda_kernels():
    """``oelm_core.fast.ce_kernels``, imported on first use on a GPU; None without Triton."""
    try:
        from oelm_core.fast import ce_kernels
    except ImportError:
        return None
    return ce_kernels

def _scale_rows(src: torch.Tensor, factor: torch.Tensor, row_scale: Optional[torch.Tensor] = None,
                dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """src (rows, cols) * factor (a one-element tensor) [* row_scale (rows,) per row], a new tensor
    of ``dtype`` (default src's; src, saved for the backward, stays as it is for a second one):
    the backward's scaling of the loss's gradients."""
    dtype = dtype or src.dtype
    if src.is_cuda and _cuda_kernels() is not None:
        return _cuda_kernels()._scale_rows_triton(src, factor, row_scale, dtype)
    return (src * (factor if row_scale is None else row_scale[:, None] * factor)).to(dtype)



class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``x @ w[:vocab].T`` against ``targets``, never holding all logits.

    The output layer is the largest tensor of the step (tokens x 50,257 floats). Slice by slice,
    the forward computes the logits, their log-sum-exp, the loss *and already the gradients*
    (softmax - one_hot), so the backward only scales them by the incoming scalar: the same
    matmuls as the plain path, with one slice of logits alive instead of all of them in float32.
    Targets: see ``linear_cross_entropy``. On CUDA (with Triton) the per-slice
    softmax/loss/gradient is one fused kernel (``_ce_rows_kernel``) after the logits GEMM, or on
    Hopper the logits GEMM itself (``oelm_core/logits_gemm.py``); the x gradient still has a per-row
    factor to apply (``_ce_forward_cuda``). Elsewhere it is plain torch ops.
    """

    @staticmethod
    def forward(ctx, x, w, targets, vocab: int, chunk: int, w_grad_hook):
        dtype = torch.get_autocast_dtype("cuda") if x.is_cuda and torch.is_autocast_enabled("cuda") else x.dtype
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        ctx.w_grad_hook = w_grad_hook
        kernels = _cuda_kernels() if x.is_cuda else None
        if kernels is not None and dtype != torch.float16:  # (see ce_kernels._ce_rows_kernel)
            loss, grad_x, grad_w, row_scale = kernels._ce_forward_cuda(x, w, targets, vocab, chunk, dtype, need_grad)
            if need_grad:
                ctx.save_for_backward(grad_x, grad_w, row_scale)
                ctx.dtypes = (x.dtype, w.dtype)
            return loss
        if not targets.is_cuda:  # on a GPU the check would wait for it every step
            bad = (targets < -1) | (targets >= vocab)
            if bad.any():
                raise IndexError(f"target id {int(targets[bad][0])} is out of bounds: targets must be "
                                 f"token ids in [0, {vocab}) or -1 (ignored)")
        xc, wc = x.to(dtype), w[:vocab].to(dtype)
        valid = targets != -1
        n_valid = valid.sum()
        grad_x = torch.empty_like(x) if need_grad else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        for s in range(0, x.size(0), chunk):
            xs, ts, vs = xc[s:s + chunk], targets[s:s + chunk], valid[s:s + chunk]
            logits = (xs @ wc.T).float()
            lse = torch.logsumexp(logits, dim=-1)
            safe_t = ts.clamp(min=0)
            target_logit = logits.gather(1, safe_t[:, None]).squeeze(1)
            loss += ((lse - target_logit) * vs).sum()
            if need_grad:
                g = torch.exp(logits - lse[:, None])
                g[torch.arange(len(ts), device=x.device), safe_t] -= 1.0
                g = (g * (vs[:, None] / n_valid.clamp(min=1))).to(dtype)
                grad_x[s:s + chunk] = (g @ wc).to(x.dtype)
                grad_w[:vocab] += (g.T @ xs).float()
        if need_grad:
            ctx.save_for_backward(grad_x, grad_w, None)
            ctx.dtypes = (x.dtype, w.dtype)
        return loss / n_valid  # every target ignored: 0/0, NaN, as F.cross_entropy gives

    @staticmethod
    @torch.autograd.function.once_differentiable  # the gradients were computed in the forward
    def backward(ctx, grad_loss):
        grad_x, grad_w, row_scale = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        grad_w = _scale_rows(grad_w, grad_loss, dtype=w_dtype)
        if ctx.w_grad_hook is not None:
            ctx.w_grad_hook(grad_w)
            grad_w = None
        return _scale_rows(grad_x, grad_loss, row_scale, dtype=x_dtype), grad_w, None, None, None, None


@torch.compiler.disable
def linear_cross_entropy(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, vocab: int,
                         chunk: Optional[int] = None, w_grad_hook: Optional[Callable] = None) -> torch.Tensor:
    """x: (N, d), w: (V_padded, d), targets: (N,) -> scalar mean loss (nats/token).

    ``targets`` are what ``F.cross_entropy(..., ignore_index=-1)`` takes: token ids in
    [0, vocab), or -1 for a position without loss. Any other id raises an IndexError on the CPU;
    on CUDA nothing is checked (a check would wait on the GPU every step): every negative id is
    ignored, and an id >= vocab reads a wrong logit (``_ce_rows_kernel``) or, with the fused logits
    GEMM, gets no loss (it still counts in the mean). The trainer refuses
    token files whose ids exceed the model's vocabulary before it starts. When every target is
    -1 the loss is NaN (0/0) and the gradients 0, as with ``F.cross_entropy``.

    ``chunk``: tokens per slice (> 0), the memory of one slice's logits against launches; None:
    TrainConfig's default ``loss_chunk_tokens``.

    ``w_grad_hook``: if given, w's gradient (float32 or w's dtype, w's shape, already scaled by
    the incoming gradient) is handed to it when the backward pass reaches the loss, its first
    step, instead of flowing back to w through autograd.

    Runs outside torch.compile (a clean graph break: the transformer body is compiled, the loss
    is a few large matmuls and Triton kernels that the compiler would not improve).
    """
    if chunk is None:
        chunk = TrainConfig.loss_chunk_tokens  # the dataclass field's default
    if chunk <= 0:
        raise ValueError(f"linear_cross_entropy: chunk must be a positive number of tokens per "
                         f"slice, got chunk={chunk}")
    return _LinearCrossEntropy.apply(x, w, targets, vocab, chunk, w_grad_hook)



class ChunkedOutputLoss(nn.Module):
    """``model.OutputLoss`` computed by ``linear_cross_entropy``: the same forward signature and
    value, the logits never held for more than ``chunk`` tokens at once.

    ``grad_hook``: if set, the output weight's gradient goes to it when the backward pass reaches
    the loss, its first step, instead of into the weight's ``.grad`` (which then holds the
    embedding's share alone when the weights are tied). The data-parallel exchanges use it to
    reduce the largest gradient while the rest of the backward runs (``oelm_core.fast.tied_grads``,
    ``oelm_core.fast.peer_grads``).
    """

    def __init__(self, vocab_size: int, chunk: int = TrainConfig.loss_chunk_tokens):
        super().__init__()
        self.vocab_size, self.chunk = vocab_size, chunk
        self.grad_hook: Optional[Callable[[torch.Tensor], None]] = None

    def forward(self, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(h, weight, targets, self.vocab_size, self.chunk, self.grad_hook)


def install(model: nn.Module, chunk: int = TrainConfig.loss_chunk_tokens) -> ChunkedOutputLoss:
    """Swap ``model.output_loss`` for a ``ChunkedOutputLoss``; returns it."""
    model.output_loss = ChunkedOutputLoss(model.cfg.vocab_size, chunk)
    return model.output_loss
