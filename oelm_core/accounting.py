"""Exact parameter counts, and the FLOP and memory account of a training step per token.

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

from oelm_core.config import ConfigError, ModelConfig

# Dense bf16 tensor-core peaks (FLOP/s, no sparsity) by device-name fragment, for MFU.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,   # SXM; the PCIe and NVL parts name themselves and peak lower
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
            raise ConfigError(f"{PEAK_FLOPS_ENV}={override!r} is not a peak: give the device's FLOP/s "
                             f"as a positive number (e.g. {PEAK_FLOPS_ENV}=989e12), or unset it to "
                             f"look the card up by name")
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
    return {"trainable": trainable, "frozen": frozen, "total": trainable + frozen,
            "by_component": dict(by_component)}


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
    parts["attn_scores"] = {"forward": scores + 2 * t * d * layers,
                            "backward": 2 * (scores + 2 * t * d * layers)}
    matmul("mlp", d, 2 * cfg.d_ff, layers)  # fc (d -> d_ff) and proj (d_ff -> d)
    matmul("output", d, cfg.vocab_size, 1)
    fwd = sum(p["forward"] for p in parts.values())
    bwd = sum(p["backward"] for p in parts.values())
    saving = 2 * d * 2 * d * frozen
    return {**parts, "total_forward": fwd, "total_backward": bwd, "total": fwd + bwd,
            "frozen_saving": {"flops": saving, "fraction": saving / (fwd + bwd + saving)}}


def memory_account(model: nn.Module) -> dict:
    """Bytes of weights, gradients and AdamW state (float32 master copies) and what freezing saves.

    Bytes of the tensors as stored: the rows that pad the vocabulary are allocated, get (zero)
    gradients and AdamW state, so they count here though not as parameters. Activations depend
    on batch and precision and are measured by the benchmarks instead.
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
    return {"weights": weights, "grads": grads, "adam_state": adam,
            "total": weights + grads + adam, "frozen_saving": 12 * count_parameters(model)["frozen"]}
