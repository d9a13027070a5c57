"""Gradient clipping inside PyTorch's fused AdamW: no separate pass over the gradients.

The plain step divides every gradient by clip_grad_norm_'s factor before ``optimizer.step()``:
one more read and write of all of them. A fused AdamW takes a divisor of the gradients,
``grad_scale`` (what AMP's GradScaler hands it), and applies it inside its one kernel:
``clip_and_step`` passes the clip factor (and the NVLink exchange's ``grad_divisor``, which
averages gradients that hold a sum over ranks) that way. The same division, so the same weights
bit for bit (tests/test_step.py). Switch: ``train.fused_clip``; the step uses it only where every
parameter group is fused. Gain: benchmarks/README.md.
"""

from __future__ import annotations

import torch


def clip_and_step(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], max_norm: float,
                  divisor: float = 1.0) -> torch.Tensor:
    """Clip the gradients of ``params`` (divided by ``divisor`` first) to a global norm of at
    most ``max_norm`` (inf: no clipping) and take ``optimizer``'s (fused) step. Returns the norm
    before clipping, a 0-dim tensor, as ``clip_grad_norm_`` does."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    if divisor != 1.0:
        norm = norm / divisor
    # clip_grad_norm_'s factor, max_norm / (norm + 1e-6) capped at 1, as a divisor.
    scale = torch.clamp((norm + 1e-6) / max_norm, min=1.0)
    optimizer.grad_scale = scale * divisor if divisor != 1.0 else scale
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale
    return norm
