"""The fast paths: every speed trick of the toolkit, applied on purpose to a plain model or step.

The reference path (``oelm_core.model``, ``oelm_core.generate``, ``oelm_core.step``) is plain
PyTorch and runs anywhere. Each fast path computes the same thing faster on some hardware, has
one switch, a test that it agrees with the reference (loss, gradients, greedy tokens), and stays
only while it saves at least 2% of a training step (10% of generation) on an H100. Their
measured gains are in benchmarks/README.md.

Training fast paths of the model, installed by ``apply`` (switches: TrainConfig fields):

=====================  =====================================  ===============================
what                   where                                  switch
=====================  =====================================  ===============================
fused loss             ``loss.ChunkedOutputLoss``             ``train.fused_loss``,
                       (its CUDA kernels: ``ce_kernels``)     ``train.loss_chunk_tokens``
fused logits GEMM      ``logits_gemm`` (Hopper, bf16)         ``train.fused_logits``
cuBLASLt GEMMs         ``linear`` (the body),                 ``train.cublaslt``
                       ``cublaslt`` (the binding; also the
                       fused loss's GEMMs)
=====================  =====================================  ===============================

Importing this package imports none of them: each module is imported where it is installed,
and those that load Triton or the cuBLASLt binding (``ce_kernels``, ``logits_gemm``,
``cublaslt``, ``linear``) only on CUDA.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from oelm_core.config import TrainConfig


def apply(model: nn.Module, tc: TrainConfig, device: torch.device) -> nn.Module:
    """Install on the plain GPT ``model`` (module swaps, in place) the training fast paths that
    ``tc`` switches on and ``device`` runs; returns the model. Call it before ``torch.compile``
    and before building the step. With every switch off the model stays the reference."""
    device = torch.device(device)
    if tc.fused_loss:
        from oelm_core.fast import loss

        loss.install(model, tc.loss_chunk_tokens, fused_logits=tc.fused_logits, cublaslt=tc.cublaslt)
    if tc.cublaslt and device.type == "cuda":
        from oelm_core.fast import linear

        linear.install(model)
    return model
