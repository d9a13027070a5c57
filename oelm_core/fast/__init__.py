"""The fast paths: every speed trick of the toolkit, applied on purpose to a plain model or step.

The reference path (``oelm_core.model``, ``oelm_core.generate``, ``oelm_core.step``) is plain
PyTorch and runs anywhere. Each fast path computes the same thing faster on some hardware, has
one switch, a test that it agrees with the reference (loss, gradients, greedy tokens), and stays
only while it saves at least 2% of a training step (10% of generation) on an H100 or H200. Their
measured gains are in benchmarks/README.md.

Training fast paths of the model, installed by ``apply`` (switches: TrainConfig fields):

=====================  =====================================  ===============================
what                   where                                  switch
=====================  =====================================  ===============================
fused loss             ``loss.ChunkedOutputLoss``             ``train.fused_loss``,
                       (its CUDA kernels: ``ce_kernels``)     ``train.loss_chunk_tokens``
fused logits GEMM      ``logits_gemm`` (Hopper, bf16)         ``train.fused_logits``
=====================  =====================================  ===============================

The trainer installs the others itself (``oelm_core.step``, ``oelm_core.distributed``,
``oelm_core.train``): the CUDA-graph step (``graph_step``, ``train.cuda_graph``), the
two-GPU gradient exchange by NVLink copies (``peer_grads``, ``train.grad_exchange``) and glibc's
heap settings on the CPU (``heap``, ``train.cpu_heap``). Generation's are in ``decode`` (the
CUDA-graph decoder with its Triton step and sampler, ``decode_kernels``, ``sample_kernels``; the
CPU's weight copies, ``cpu_decode``), switched by ``SamplingConfig.fast``.

Importing this package imports none of them: each module is imported where it is installed,
and those that load Triton (``ce_kernels``, ``logits_gemm``, the decode kernels) only on CUDA.
"""

from __future__ import annotations

import torch.nn as nn

from oelm_core.config import TrainConfig


def apply(model: nn.Module, tc: TrainConfig) -> nn.Module:
    """Install on the plain GPT ``model`` (module swaps, in place) the training fast paths that
    ``tc`` switches on; returns the model. Each runs its CUDA kernels only where they run (else
    plain torch ops). Call it before ``torch.compile`` and before building the step. With every
    switch off the model stays the reference."""
    if tc.fused_loss:
        from oelm_core.fast import loss

        loss.install(model, tc.loss_chunk_tokens, fused_logits=tc.fused_logits)
    return model
