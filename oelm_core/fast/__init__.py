"""The fast paths: every speed trick of the toolkit, applied on purpose to a plain model or step.

The reference path (``oelm_core.model``, ``oelm_core.generate``, ``oelm_core.step``) is plain
PyTorch and runs anywhere. Each fast path below computes the same thing faster on some hardware;
each has one switch, a test that it agrees with the reference (loss, gradients, greedy tokens),
and stays only while it saves at least 2% of a training step (10% of generation) on an H100:
the measured gains are in benchmarks/README.md.

Importing this package imports none of them: each module loads Triton or the cuBLASLt binding
only when it is used.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from oelm_core.config import TrainConfig


def apply(model: nn.Module, tc: TrainConfig, device: torch.device) -> nn.Module:
    """Install the training fast paths that ``tc`` switches on and ``device`` can run on the
    plain ``model`` (module swaps, in place); returns the model."""
    if tc.fused_loss:
        from oelm_core.fast import loss

        loss.install(model, tc.loss_chunk_tokens)
    if tc.cublaslt and device.type == "cuda":
        from oelm_core.fast import linear

        linear.install(model)
    return model
