"""Exact parameter counts, and the FLOP and memory account of a training step: per token, and
(``step_memory``) the peak bytes of a step, which the trainer checks against the device before it
starts.

Counts exclude the zero rows that pad the vocabulary for speed (``ModelConfig.vocab_pad_multiple``),
so GPT-Base at medium512 counts the study's 44,896,768 whatever the padding.
"""

from __future__ import annotations

import itertools
import math
import os
from collections import defaultdict

import torch
import torch.nn as nn

from oelm_core.config import ConfigError, ModelConfig, TrainConfig

# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) by device-name fragment, for MFU.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe and NVL parts name themselves and peak lower
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "RTX 4090": 165e12,
}


PEAK_FLOPS_ENV = "OELM_PEAK_FLOPS"


def peak_flops(device: torch.device | str | None = None) -> float | None:
    """The card's dense bf16 peak in FLOP/s, or None on CPU and unknown cards.

    ``OELM_PEAK_FLOPS`` (FLOP/s per device, e.g. ``312e12``), when set, is the peak on every
    device, the CPU included: for a card the table lacks, or to check the MFU arithmetic where
    there is no GPU (the tests do, on two gloo ranks)."""
    override = os.environ.get(PEAK_FLOPS_ENV, "").strip()
    if override:
        try:
            value = float(override)
        except ValueError:
            value = float("nan")
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(
                f"{PEAK_FLOPS_ENV}={override!r} is not a peak: give the device's FLOP/s "
                f"as a positive number (e.g. {PEAK_FLOPS_ENV}=989e12), or unset it to "
                f"look the card up by name"
            )
        return value
    if not torch.cuda.is_available() or (device is not None and torch.device(device).type != "cuda"):
        return None
    name = torch.cuda.get_device_name(device)
    matches = [k for k in PEAK_BF16_FLOPS if k in name]
    return PEAK_BF16_FLOPS[max(matches, key=len)] if matches else None


def _component(name: str) -> str:
    """Which part of the model a parameter or buffer belongs to."""
    if name.startswith("wte"):
        return "embedding"
    if name.startswith("wpe"):
        return "position"
    if name.startswith("lm_head"):
        return "output"
    if ".attn.qk" in name:
        return "attn_qk"
    if ".attn.synth" in name:
        return "attn_synth"
    if ".attn.v." in name:
        return "attn_v"
    if ".attn.proj" in name:
        return "attn_out"
    if ".mlp." in name:
        return "mlp"
    if "ln" in name:
        return "layernorm"
    return "other"


def _padding(model: nn.Module, name: str) -> int:
    """Elements of the vocabulary padding inside tensor ``name`` (not counted as parameters)."""
    cfg = getattr(model, "cfg", None)
    if cfg is None or name not in ("wte.weight", "lm_head.weight"):
        return 0
    return (cfg.padded_vocab_size - cfg.vocab_size) * cfg.d_model


def _counted_tensors(model: nn.Module):
    """(name, counted elements, trainable) for every weight: parameters and frozen buffers.

    Frozen weights are the model's floating-point buffers; integer buffers (indices) are not
    weights. Tensors reached twice (tied embeddings) are counted once.
    """
    seen = set()
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            yield name, p.numel() - _padding(model, name), p.requires_grad
    for name, b in model.named_buffers():
        if b.is_floating_point() and id(b) not in seen:
            seen.add(id(b))
            yield name, b.numel() - _padding(model, name), False


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside torch.compile's and (Distributed)DataParallel's wrappers, however nested:
    their names carry a prefix (``_orig_mod.``, ``module.``) that hid every component and the
    vocabulary padding from the counts."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def count_parameters(model: nn.Module) -> dict:
    """{'trainable', 'frozen', 'total', 'by_component': {component: {'trainable', 'frozen'}}};
    of the model itself when given its compiled or DDP wrapper."""
    model = _unwrap(model)
    by_component: dict = defaultdict(lambda: {"trainable": 0, "frozen": 0})
    for name, n, trainable in _counted_tensors(model):
        by_component[_component(name)]["trainable" if trainable else "frozen"] += n
    trainable = sum(c["trainable"] for c in by_component.values())
    frozen = sum(c["frozen"] for c in by_component.values())
    return {"trainable": trainable, "frozen": frozen, "total": trainable + frozen, "by_component": dict(by_component)}


def flops_per_token(cfg: ModelConfig, context: int | None = None) -> dict:
    """FLOPs per trained token, by component, for forward and backward.

    A matmul with a (out, in) weight costs 2*in*out per token forward; backward costs the same
    again for the input gradient and once more for the weight gradient, which frozen weights
    skip. Attention scores (QK^T) and the weighted sum (AV) cost 2*T*d each per token forward
    at context T (counted over the full window, as PaLM's MFU formula does), twice that
    backward. LayerNorm, GELU and softmax are not counted: they are memory-bound, not FLOPs.
    Returns per component {'forward', 'backward'} plus 'total_forward', 'total_backward',
    'total', and 'frozen_saving' (the backward FLOPs freezing removes, and its share of total).
    """
    d, t = cfg.d_model, context or cfg.block_size
    frozen = len(cfg.frozen_layers()) if cfg.attention == "dot" else 0
    layers = cfg.n_layer
    parts: dict[str, dict[str, float]] = {}

    def matmul(name: str, n_in: int, n_out: int, count: int, frozen_count: int = 0) -> None:
        fwd = 2 * n_in * n_out * count
        bwd = 2 * fwd - 2 * n_in * n_out * frozen_count
        parts[name] = {"forward": fwd, "backward": bwd}

    if cfg.attention == "dot":
        matmul("attn_qk", d, 2 * d, layers, frozen)
        scores = 2 * t * d * layers
    else:
        scores = 0
    matmul("attn_v", d, d, layers)
    matmul("attn_out", d, d, layers)
    parts["attn_scores"] = {"forward": scores + 2 * t * d * layers, "backward": 2 * (scores + 2 * t * d * layers)}
    matmul("mlp", d, 2 * cfg.d_ff, layers)  # fc (d -> d_ff) and proj (d_ff -> d)
    matmul("output", d, cfg.vocab_size, 1)
    fwd = sum(p["forward"] for p in parts.values())
    bwd = sum(p["backward"] for p in parts.values())
    saving = 2 * d * 2 * d * frozen
    return {
        **parts,
        "total_forward": fwd,
        "total_backward": bwd,
        "total": fwd + bwd,
        "frozen_saving": {"flops": saving, "fraction": saving / (fwd + bwd + saving)},
    }


def memory_account(model: nn.Module) -> dict:
    """Bytes of weights, gradients and AdamW state (float32 master copies) and what freezing saves.

    Bytes of the tensors as stored: the rows that pad the vocabulary are allocated, get (zero)
    gradients and AdamW state, so they count here though not as parameters. ``state_bytes``
    gives the same from the shape alone; the activations of a step, which depend on batch and
    precision, are ``activation_bytes``'.
    """
    model = _unwrap(model)
    stored = trained = 0
    seen = set()
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.is_floating_point() and id(t) not in seen:  # integer buffers are indices, not weights
            seen.add(id(t))
            stored += t.numel()
            trained += t.numel() if t.requires_grad else 0
    weights, grads, adam = 4 * stored, 4 * trained, 8 * trained
    return {
        "weights": weights,
        "grads": grads,
        "adam_state": adam,
        "total": weights + grads + adam,
        "frozen_saving": 12 * count_parameters(model)["frozen"],
    }


def state_bytes(cfg: ModelConfig) -> dict:
    """``memory_account``'s 'weights', 'grads', 'adam_state' and 'total' (bytes, float32) from the
    shape alone: no weight is built, so that a model too large for the machine (a Synthesizer's
    n_head x T x T logit tables at a long context) can be costed before it is refused."""
    d, ff, h, t = cfg.d_model, cfg.d_ff, cfg.n_head, cfg.block_size
    ln = 2 * d if cfg.bias else d
    frozen = set(cfg.frozen_layers()) if cfg.attention == "dot" else set()
    parts = [(cfg.padded_vocab_size * d, True), (t * d, True), (ln, True)]  # wte, wpe, ln_f
    if not cfg.tie_embeddings:
        parts.append((cfg.padded_vocab_size * d, True))
    for layer in range(cfg.n_layer):
        parts += [
            (2 * ln, True),
            (2 * d * d + (2 * d if cfg.attn_bias else 0), True),  # LNs, V and out
            (2 * d * ff + ((ff + d) if cfg.bias else 0), True),
        ]  # the MLP
        if cfg.attention == "synth_random":
            parts.append((h * t * t, cfg.synth_trainable))
        elif cfg.attention == "synth_factorized":
            parts.append((2 * h * t * cfg.synth_rank, cfg.synth_trainable))
        elif cfg.poet_block_size:  # W0_q, W0_k frozen; four block-diagonal skew generators trained
            b = cfg.poet_block_size
            parts += [(2 * d * d, False), (4 * (d // b) * (b * (b - 1) // 2), True)]
        else:
            parts.append((2 * d * d, layer not in frozen))
    stored = sum(n for n, _ in parts)
    trained = sum(n for n, trainable in parts if trainable)
    weights, grads, adam = 4 * stored, 4 * trained, 8 * trained
    return {"weights": weights, "grads": grads, "adam_state": adam, "total": weights + grads + adam}


def activation_bytes(
    cfg: ModelConfig,
    batch_size: int,
    dtype: str = "float32",
    device_type: str = "cpu",
    fused_loss: bool = True,
    loss_chunk_tokens: int = TrainConfig.loss_chunk_tokens,
) -> dict:
    """Bytes of activations one training micro-step holds at its peak: ``batch_size`` sequences
    of ``cfg.block_size`` tokens, ``dtype`` "float32" or "bf16" (autocast), on ``device_type``,
    with the fused loss (``train.fused_loss``, slices of ``loss_chunk_tokens``) or the reference's.

    'saved': what autograd keeps from the forward for the backward, per layer and token: the
    LayerNorm inputs (the residual stream, float32 under autocast too) and statistics, the inputs
    of the Q/K/V, output, fc and proj matmuls, q, k, v and the attention output with its
    log-sum-exp, the GELU's input; then the final LayerNorm's input and the chunked loss's input
    gradient (N x d) and float32 weight gradient (vocab x d). The Synthesizer keeps its per-head
    T x T attention for every sequence (its matmul broadcasts it) and once more with its mask, a
    run with the reference loss its N x vocab log-probabilities, a bf16 run its weights cast to bf16,
    dropout its masks (and on the CPU the attention's T x T weights: PyTorch's math path).
    'loss_workspace': one slice of the fused loss (``loss_chunk_tokens`` rows of the vocabulary's
    logits): on the CPU the logits, their shifted copy and the gradient, float32, and one more that
    the heap holds back of the freed ones (``train.keep_large_blocks_in_heap``); on CUDA one bf16
    slice. For the reference loss, the logits and their float32 copy.
    'backward_workspace': the largest gradients of one layer's backward, two d_ff wide (on the CPU
    doubled, as the loss's slices, for the heap).
    'total': 'saved' and the larger workspace (they are not alive together).

    'saved' is within a few percent of the tensors autograd keeps in the float32 reference path,
    and 'total' plus ``state_bytes`` 5-25% under a CPU step's measured peak where the activations
    dominate; where the loss's slices do, the heap holds back a number of freed slices that varies
    from run to run (the estimate counts one), and the peak came out up to twice the estimate
    (tests/test_accounting.py). On CUDA (bf16, compiled), 'total' plus ``state_bytes`` came
    within 15% of the peaks that benchmarks/bench_train.py measured for medium512 at 16 and
    64 x 512 (benchmarks/README.md).
    """
    if dtype not in ("float32", "bf16"):
        raise ValueError(f"dtype must be 'float32' or 'bf16', got {dtype!r}")
    a, r = (2 if dtype == "bf16" else 4), 4  # bytes of matmul operands; of the residual stream
    d, ff, h, t, layers = cfg.d_model, cfg.d_ff, cfg.n_head, cfg.block_size, cfg.n_layer
    vocab, padded = cfg.vocab_size, cfg.padded_vocab_size
    n = batch_size * t
    drop = 1 if cfg.dropout > 0 else 0  # dropout keeps the mask of what it drops

    layer = 2 * (r * d + 2 * 4)  # ln_1 and ln_2: input, mean and rstd
    layer += 2 * a * d  # their outputs: the Q/K/V and the fc matmuls' inputs
    layer += 4 * a * d  # q, k, v and the attention output (proj's input)
    layer += 2 * a * ff  # the GELU's input and output
    layer += drop * 2 * a * d  # the attention's and the MLP's output dropout masks
    if cfg.attention != "dot":  # no q or k: the T x T weights broadcast over the
        layer += a * h * t - (2 if cfg.synth_trainable else 3) * a * d  # batch; v once, or not at all
    elif cfg.dropout > 0 and device_type == "cpu":  # PyTorch's math path: the weights, their mask
        layer += 3 * a * h * t  # and the dropped copy
    else:
        layer += 4 * h  # the attention's log-sum-exp, float32
    per_token = layers * layer + r * d + 2 * 4 + drop * a * d  # ln_f; the embedding's dropout mask
    per_token += a * d if fused_loss else 4 * vocab  # the loss's input gradient; log-probabilities
    saved = n * per_token
    if fused_loss:
        saved += 4 * padded * d  # the output weight's gradient, from the forward
    if cfg.attention != "dot" and cfg.synth_trainable:
        saved += layers * (4 * h * t * t + t * t)  # the softmax output (once for all sequences), the mask
    if cfg.poet_block_size:  # per layer: the four factors' Cayley-Neumann terms, W0 permuted, the weight
        b = cfg.poet_block_size
        saved += layers * 4 * (4 * (cfg.poet_neumann_terms + 3) * d * b + 6 * d * d + 2 * b * (b - 1))
    if dtype == "bf16":
        saved += a * state_bytes(cfg)["weights"] // 4  # autocast's bf16 copies of the weights
    elif cfg.attention == "dot" and not cfg.poet_block_size and not cfg.attn_bias:
        # Q, K and V trained together are one matmul over the concatenated weights, kept for it.
        saved += 4 * 3 * d * d * (layers - len(cfg.frozen_layers()))

    rows = min(n, loss_chunk_tokens)
    if not fused_loss:
        loss = n * vocab * (a + 4)
    elif device_type == "cuda":
        loss = rows * padded * a
    else:
        loss = 4 * rows * vocab * 4
    backward = (2 if device_type == "cuda" else 4) * n * ff * a
    total = saved + max(loss, backward)
    return {"saved": saved, "loss_workspace": loss, "backward_workspace": backward, "total": total}


def step_memory(
    cfg: ModelConfig,
    batch_size: int,
    dtype: str = "float32",
    device_type: str = "cpu",
    fused_loss: bool = True,
    loss_chunk_tokens: int = TrainConfig.loss_chunk_tokens,
) -> dict:
    """Estimated peak bytes of one training micro-step: ``state_bytes`` (weights, gradients, AdamW
    state) plus ``activation_bytes`` at the peak. {'state', 'activations', 'saved',
    'loss_workspace', 'total'}, bytes. Gradient accumulation adds nothing: each micro-step frees
    its activations before the next."""
    state = state_bytes(cfg)["total"]
    act = activation_bytes(cfg, batch_size, dtype, device_type, fused_loss, loss_chunk_tokens)
    return {
        "state": state,
        "activations": act["total"],
        "saved": act["saved"],
        "loss_workspace": act["loss_workspace"],
        "total": state + act["total"],
    }


def device_memory(device: torch.device | str) -> tuple[int | None, str]:
    """(bytes a training on ``device`` can use, what they are, as a noun phrase): a CUDA device's
    total memory; on the CPU the RAM the kernel reports available (MemAvailable; else the free
    pages). None where the platform says neither."""
    device = torch.device(device)
    if device.type == "cuda":
        return (
            torch.cuda.get_device_properties(device).total_memory,
            f"the memory of the {torch.cuda.get_device_name(device)} ({device})",
        )
    where = "the RAM available on this machine"
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:")) * 1024, where
    except (OSError, StopIteration, ValueError):  # not Linux, or a kernel before 3.14
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), where
    except (AttributeError, OSError, ValueError):  # macOS, Windows
        return None, where
