"""The fused loss: the output layer and its cross-entropy in slices of tokens.

The output layer is the largest tensor of the step (tokens x 50,257 floats). ``ChunkedOutputLoss``
takes ``model.output_loss``'s place (``install``) and computes the same mean cross-entropy slice by
slice: the logits of one slice, their log-sum-exp, the loss *and already the gradients* (softmax -
one_hot), so the backward only scales them by the incoming scalar. The same matmuls as
``oelm_core.model.OutputLoss``, with one slice of logits alive instead of all of them in float32.

Where it runs: on the CPU (and on a GPU without Triton, or under float16 autocast) the slices are
plain torch ops, the same ops in the same order as before this module existed. On CUDA with Triton
each slice is the logits GEMM and one Triton pass (``oelm_core.fast.ce_kernels``), and on Hopper
in bf16 with ``fused_logits`` the logits GEMM itself writes the loss's exponentials
(``oelm_core.fast.logits_gemm``).

Switches (TrainConfig): ``train.fused_loss`` installs it, ``train.loss_chunk_tokens`` sets the
slice, ``train.fused_logits`` chooses its CUDA logits kernel. Gain:
benchmarks/README.md.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

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


def _scale_rows(
    src: torch.Tensor,
    factor: torch.Tensor,
    row_scale: Optional[torch.Tensor] = None,
    dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """src (rows, cols) * factor (a one-element tensor) [* row_scale (rows,) per row], a new tensor
    of ``dtype`` (default src's; src, saved for the backward, stays as it is for a second one):
    the backward's scaling of the loss's gradients."""
    dtype = dtype or src.dtype
    if src.is_cuda and _cuda_kernels() is not None:
        return _cuda_kernels().scale_rows(src, factor, row_scale, dtype)
    return (src * (factor if row_scale is None else row_scale[:, None] * factor)).to(dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``x @ w[:vocab].T`` against ``targets``, never holding all logits
    (``linear_cross_entropy`` says what the arguments are). The forward computes the gradients
    too; the backward only scales them by the incoming gradient."""

    @staticmethod
    def forward(ctx, x, w, targets, vocab: int, chunk: int, w_grad_hook, fused_logits: bool):
        dtype = torch.get_autocast_dtype("cuda") if x.is_cuda and torch.is_autocast_enabled("cuda") else x.dtype
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        ctx.w_grad_hook = w_grad_hook
        ctx.dtypes = (x.dtype, w.dtype)
        kernels = _cuda_kernels() if x.is_cuda else None
        if kernels is not None and dtype != torch.float16:  # (float16: see ce_kernels._ce_rows_kernel)
            loss, grad_x, grad_w, row_scale = kernels.forward(
                x, w, targets, vocab, chunk, dtype, need_grad, fused_logits=fused_logits
            )
            if need_grad:
                ctx.save_for_backward(grad_x, grad_w, row_scale)
            return loss
        if not targets.is_cuda:  # on a GPU the check would wait for it every step
            bad = (targets < -1) | (targets >= vocab)
            if bad.any():
                raise IndexError(
                    f"target id {int(targets[bad][0])} is out of bounds: targets must be "
                    f"token ids in [0, {vocab}) or -1 (ignored)"
                )
        xc, wc = x.to(dtype), w[:vocab].to(dtype)
        valid = targets != -1
        n_valid = valid.sum()
        grad_x = torch.empty_like(x) if need_grad else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        for s in range(0, x.size(0), chunk):
            xs, ts, vs = xc[s : s + chunk], targets[s : s + chunk], valid[s : s + chunk]
            logits = (xs @ wc.T).float()
            lse = torch.logsumexp(logits, dim=-1)
            safe_t = ts.clamp(min=0)
            target_logit = logits.gather(1, safe_t[:, None]).squeeze(1)
            loss += ((lse - target_logit) * vs).sum()
            if need_grad:
                g = torch.exp(logits - lse[:, None])
                g[torch.arange(len(ts), device=x.device), safe_t] -= 1.0
                g = (g * (vs[:, None] / n_valid.clamp(min=1))).to(dtype)
                grad_x[s : s + chunk] = (g @ wc).to(x.dtype)
                grad_w[:vocab] += (g.T @ xs).float()
        if need_grad:
            ctx.save_for_backward(grad_x, grad_w, None)
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
        return (_scale_rows(grad_x, grad_loss, row_scale, dtype=x_dtype), grad_w, None, None, None, None, None)


def linear_cross_entropy(
    x: torch.Tensor,
    w: torch.Tensor,
    targets: torch.Tensor,
    vocab: int,
    chunk: Optional[int] = None,
    w_grad_hook: Optional[Callable] = None,
    *,
    fused_logits: bool = True,
) -> torch.Tensor:
    """x: (N, d), w: (V_padded, d), targets: (N,) -> scalar mean loss (nats/token), float32.

    ``targets`` are what ``F.cross_entropy(..., ignore_index=-1)`` takes: token ids in
    [0, vocab), or -1 for a position without loss. Any other id raises an IndexError on the CPU;
    on CUDA nothing is checked (a check would wait on the GPU every step): every negative id is
    ignored, and an id >= vocab reads a wrong logit (``_ce_rows_kernel``) or, with the fused logits
    GEMM, gets no loss (it still counts in the mean). The trainer refuses token files whose ids
    exceed the model's vocabulary before it starts. When every target is -1 the loss is NaN (0/0)
    and the gradients 0, as with ``F.cross_entropy``. Rows of w from ``vocab`` on (the padding)
    never become a logit and get a zero gradient.

    ``chunk``: tokens per slice (> 0), the memory of one slice's logits against launches; None:
    TrainConfig's default ``loss_chunk_tokens``.

    ``w_grad_hook``: if given, w's gradient (w's shape and dtype, already scaled by the incoming
    gradient) is handed to it when the backward pass reaches the loss, its first step, instead of
    flowing back to w through autograd (``ChunkedOutputLoss.grad_hook``).

    ``fused_logits``: on CUDA, whether the logits GEMM may compute the exponentials itself
    (``oelm_core.fast.logits_gemm``; used only where it runs: Hopper, bf16). No effect elsewhere.

    ``ChunkedOutputLoss`` runs it outside torch.compile: a clean graph break, the transformer body
    compiled, the loss a few large matmuls and Triton kernels that the compiler would not improve.
    """
    if chunk is None:
        chunk = TrainConfig.loss_chunk_tokens  # the dataclass field's default
    if chunk <= 0:
        raise ValueError(
            f"linear_cross_entropy: chunk must be a positive number of tokens per slice, got chunk={chunk}"
        )
    return _LinearCrossEntropy.apply(x, w, targets, vocab, chunk, w_grad_hook, fused_logits)


class ChunkedOutputLoss(nn.Module):
    """``oelm_core.model.OutputLoss`` computed by ``linear_cross_entropy``: the same forward
    signature and value, the logits never held for more than ``chunk`` tokens at once.

    ``grad_hook`` (None, or a callable taking one tensor): when set, the output weight's gradient
    goes to ``grad_hook(g)`` instead of into the weight's ``.grad``. g is (padded_vocab, d_model)
    of the weight's dtype (float32 in training: the weights stay float32 under autocast), already
    scaled by the gradient of whatever was backpropagated (``(0.5 * loss).backward()`` halves it),
    and it arrives when the backward pass starts: the loss computed it in its forward. With tied
    weights (``model.lm_head is None``) ``wte.weight.grad`` then holds the embedding's share alone,
    nonzero only in the rows of the batch's tokens, and the two shares add up to the plain
    gradient; setting ``grad_hook = None`` joins them again. (Untied, ``lm_head.weight.grad`` stays
    None and its whole gradient goes to the hook.) ``split_tied_gradient`` sets it for a model.

    Why: with tied weights the gradient of the model's largest tensor is complete only after the
    embedding's backward, the very last step, so a data-parallel all-reduce of it could not overlap
    anything. Split, the dense output share can be reduced while the rest of the backward runs, and
    the embedding's share is a few rows (``oelm_core.fast.peer_grads``).
    """

    def __init__(self, vocab_size: int, chunk: int = TrainConfig.loss_chunk_tokens, *, fused_logits: bool = True):
        super().__init__()
        if chunk <= 0:
            raise ValueError(
                f"ChunkedOutputLoss: chunk must be a positive number of tokens per "
                f"slice (train.loss_chunk_tokens), got {chunk}"
            )
        self.vocab_size, self.chunk = vocab_size, chunk
        self.fused_logits = fused_logits
        self.grad_hook: Optional[Callable[[torch.Tensor], None]] = None
        # Made here, not by decorating the function: torch.compiler.disable imports torch._dynamo,
        # which imports Triton where it is installed, and importing this module must not.
        self._outside_compile = torch.compiler.disable(linear_cross_entropy)

    def forward(self, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """h (N, d_model), weight (padded_vocab, d_model), targets (N,) token ids or -1 -> the mean
        loss over the counted positions, 0-dim float32 (nats/token), as ``OutputLoss``."""
        return self._outside_compile(
            h, weight, targets, self.vocab_size, self.chunk, self.grad_hook, fused_logits=self.fused_logits
        )

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, chunk={self.chunk}, fused_logits={self.fused_logits}"


def install(
    model: nn.Module, chunk: int = TrainConfig.loss_chunk_tokens, *, fused_logits: bool = True
) -> ChunkedOutputLoss:
    """Swap ``model.output_loss`` (a GPT's) for a ``ChunkedOutputLoss``; returns it. The model's
    parameters and state dict are untouched."""
    model.output_loss = ChunkedOutputLoss(model.cfg.vocab_size, chunk, fused_logits=fused_logits)
    return model.output_loss


def split_tied_gradient(model: nn.Module, hook: Optional[Callable[[torch.Tensor], None]]) -> Optional[nn.Parameter]:
    """Hand the output layer's share of a GPT's tied embedding/output gradient to ``hook`` (see
    ``ChunkedOutputLoss.grad_hook``); ``hook=None`` joins the shares again.

    Returns the tied weight (``model.wte.weight``), or None, setting nothing, where there is
    nothing to split: an untied output layer, or no fused loss installed (the plain
    ``OutputLoss`` computes the gradient in the backward, as one)."""
    if model.lm_head is not None or not isinstance(model.output_loss, ChunkedOutputLoss):
        return None
    model.output_loss.grad_hook = hook
    return model.wte.weight
