"""The fast paths: the only door to speed. Every speed trick of the toolkit lives in this package
and is chosen here, from its switch, for a plain model, step or generation.

The reference path (``oelm_core.model``, ``oelm_core.step``, ``oelm_core.distributed``,
``oelm_core.generate``) is plain PyTorch, runs anywhere and imports nothing from this package
(``tests/test_fast.py`` walks their imports). Each fast path computes the same thing faster on
some hardware, has one switch, a test that it agrees with the reference (loss, gradients, greedy
tokens), and stays only while it saves at least 2% of a training step (10% of generation) on an
H100 or H200. Their measured gains are in benchmarks/README.md.

What the trainer and the generator ask for, and what each answer holds; with every switch off,
or where a path cannot run, the answer is the reference's own object:

=======================  ============================================  ==========================
ask                      fast paths                                    switches
=======================  ============================================  ==========================
``apply(model, tc)``     fused loss (``loss.ChunkedOutputLoss``, its   ``train.fused_loss``,
                         CUDA kernels ``ce_kernels``); fused logits    ``train.loss_chunk_tokens``,
                         GEMM (``logits_gemm``, Hopper, bf16)          ``train.fused_logits``
``prepare_process``      glibc keeps large freed blocks (``heap``)     ``train.cpu_heap``
``make_step``            the whole step as a CUDA graph                ``train.cuda_graph``
                         (``graph_step.GraphStep``)
``data_parallel``        one host's gradients by NVLink copies         ``train.grad_exchange``
                         (``peer_grads``) instead of DDP
``decoder``,             the CUDA-graph decoder with its Triton step   ``SamplingConfig.fast``
``stream_tokens``        and sampler (``decode``, ``decode_kernels``,
                         ``sample_kernels``); the CPU's weight copies
                         (``cpu_decode``)
=======================  ============================================  ==========================

Importing this package imports none of them, nor the reference modules they build on: each is
imported when it is asked for, and those that load Triton (``ce_kernels``, ``logits_gemm``, the
decode kernels) only on CUDA.
"""

from __future__ import annotations

import itertools
import logging
from typing import Callable, Iterator

import torch
import torch.nn as nn

from oelm_core.config import ConfigError, SamplingConfig, TrainConfig

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def apply(model: nn.Module, tc: TrainConfig) -> nn.Module:
    """Install on the plain GPT ``model`` (module swaps, in place) the training fast paths that
    ``tc`` switches on; returns the model. Each runs its CUDA kernels only where they run (else
    plain torch ops). Call it before ``torch.compile`` and before building the step. With every
    switch off the model stays the reference."""
    if tc.fused_loss:
        from oelm_core.fast import loss

        loss.install(model, tc.loss_chunk_tokens, fused_logits=tc.fused_logits)
    return model


def prepare_process(tc: TrainConfig, device: torch.device) -> None:
    """The process-wide fast paths of a training on ``device``: on the CPU with
    ``train.cpu_heap``, glibc keeps large freed blocks for the next step (``heap``)."""
    if device.type == "cpu" and tc.cpu_heap:
        from oelm_core.fast.heap import keep_large_blocks_in_heap

        keep_large_blocks_in_heap()


def make_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, tc: TrainConfig, device: torch.device, ddp: bool = False
):
    """The trainer's step for ``model`` (already on ``device``): ``graph_step.GraphStep`` with
    ``train.cuda_graph`` where a step can be captured (a CUDA device; under DDP only with NCCL,
    whose collectives can be captured), else the reference ``oelm_core.step.TrainStep``. Under
    ``ddp`` either makes the model data parallel through ``data_parallel`` below."""
    from oelm_core.step import TrainStep

    if tc.cuda_graph and device.type == "cuda" and torch.cuda.is_available():
        from oelm_core.fast.graph_step import GraphStep

        if GraphStep.can_run(ddp):
            return GraphStep(model, optimizer, tc, device, ddp, data_parallel=data_parallel)
    return TrainStep(model, optimizer, tc, device, ddp, data_parallel=data_parallel)


def data_parallel(model: nn.Module, module: nn.Module, tc: TrainConfig, device: torch.device):
    """``module`` (``model`` or its compiled wrapper) made data parallel as ``tc`` says: (what the
    forward runs through, the exchange that reduces gradients instead of DDP, or None).

    ``train.grad_exchange`` "auto": on two CUDA GPUs of one host the NVLink exchange
    (``peer_grads.PeerGradExchange``) replaces DDP; "peer": on any number of them (or a
    ConfigError); otherwise, or with "ddp", the reference's DDP
    (``oelm_core.distributed.data_parallel``)."""
    import torch.distributed as dist

    from oelm_core.distributed import data_parallel as reference_data_parallel

    if tc.grad_exchange == "auto" and dist.get_world_size() != 2:
        # Measured to pay on two GPUs only (benchmarks/README.md); "peer" times it on more.
        log.info(
            "gradients by DDP: grad_exchange auto uses the NVLink copies on two GPUs, here %d", dist.get_world_size()
        )
    elif tc.grad_exchange != "ddp":
        from oelm_core.fast.peer_grads import PeerGradExchange

        exchange = PeerGradExchange.for_model(model, device)
        if exchange is not None:
            log.info("gradients exchanged by NVLink copies during the backward (PeerGradExchange)")
            with torch.no_grad():  # what DDP's constructor does: every rank starts from rank 0's state
                for t in itertools.chain(model.parameters(), model.buffers()):
                    dist.broadcast(t, 0)
            return module, exchange
        if tc.grad_exchange == "peer":
            why = PeerGradExchange.not_here(device) or "here they have no peer access"
            raise ConfigError(
                f"train.grad_exchange: peer needs CUDA GPUs of one host with peer "
                f"access (NVLink) under NCCL ({why}); use auto to fall back to DDP"
            )
    return reference_data_parallel(model, module, tc, device)


# --------------------------------------------------------------------------------------------
# Generation
# --------------------------------------------------------------------------------------------


def decoder(model: nn.Module, cfg: SamplingConfig) -> Callable:
    """The decoding loop for ``model`` under ``cfg``, a ``decoder(model, ids, cfg, seed)`` for
    ``oelm_core.generate.stream_tokens``: the fast decoder (``decode.decode_tokens``) with
    ``cfg.fast`` and ``cfg.use_cache`` where it runs the model (``decode.supports``: eval mode),
    else the reference loop ``oelm_core.generate.reference_tokens``. The same tokens either way."""
    from oelm_core.generate import reference_tokens

    cfg.validate()
    if cfg.use_cache and cfg.fast:
        from oelm_core.fast import decode

        if decode.supports(model):
            return decode.decode_tokens
    return reference_tokens


def stream_tokens(model: nn.Module, prompt_ids: list[int], cfg: SamplingConfig) -> Iterator[int]:
    """``oelm_core.generate.stream_tokens`` through the decoder that ``decoder`` picks: new token
    ids one by one, what the app streams."""
    from oelm_core.generate import stream_tokens as reference_stream_tokens

    yield from reference_stream_tokens(model, prompt_ids, cfg, decoder(model, cfg))
