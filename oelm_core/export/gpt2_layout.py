"""Our GPT in GPT-2's layout: which models are a GPT-2 at inference (``gpt2_refusal``), their
weights under GPT2LMHeadModel's names and shapes (``gpt2_weights``), and a GPT-2 file's shapes
and config keys under ours (``_gpt2_shapes``, ``GPT2_KEYS``); plain torch, no transformers. Apart
from the transformers format (``gpt2``) because the shape check both loaders share
(``native._shape_disagreement``) reads it while ``gpt2`` builds on ``native``: below both, it
closes no import cycle."""

from __future__ import annotations

import re
from typing import Optional

import torch

from oelm_core.data import EOT
from oelm_core.model import GPT

GPT2_VOCAB = EOT + 1
# GPT-2's config.json keys that transformers builds the model from, and the ModelConfig field
# each must equal.
GPT2_KEYS = {
    "n_layer": "n_layer",
    "n_head": "n_head",
    "n_embd": "d_model",
    "n_inner": "d_ff",
    "n_positions": "block_size",
    "vocab_size": "vocab_size",
}


def gpt2_refusal(model: GPT) -> Optional[str]:
    """Why ``model`` cannot run as transformers' GPT-2; None where it can."""
    cfg = model.cfg
    if cfg.attention != "dot":
        return (
            f"the Synthesizer ({cfg.attention}) has no QK^T at inference: its attention is a learned "
            f"table of position-by-position logits that ignores the input, which GPT-2's attention "
            f"cannot express; export it with --format safetensors (oelm_core.export.load_safetensors)"
        )
    if cfg.vocab_size != GPT2_VOCAB:
        return (
            f"its vocabulary has {cfg.vocab_size} ids, not GPT-2's {GPT2_VOCAB}, so the GPT-2 "
            f"tokenizer written beside it would not fit; export it with --format safetensors"
        )
    return None


@torch.no_grad()
def gpt2_weights(model: GPT) -> dict[str, torch.Tensor]:
    """``model``'s weights under transformers' GPT2LMHeadModel names, on the CPU in the embedding's
    dtype. GPT-2's Conv1D stores (in, out), nn.Linear (out, in): every matrix is transposed, and
    ``c_attn`` is [W_q; W_k; W_v] (3 d, d) transposed to (d, 3 d). The padding rows of the
    vocabulary are dropped; the biases we do not have (Q/K never, V and the output projection
    without ``attn_bias``, MLP and LayerNorm without ``bias``) are zeros."""
    cfg = model.cfg
    d, dtype = cfg.d_model, model.wte.weight.dtype

    def bias(b: Optional[torch.Tensor], n: int) -> torch.Tensor:
        return b if b is not None else torch.zeros(n, dtype=dtype, device=model.wte.weight.device)

    w = {
        "transformer.wte.weight": model.wte.weight[: cfg.vocab_size],
        "transformer.wpe.weight": model.wpe.weight,
        "transformer.ln_f.weight": model.ln_f.weight,
        "transformer.ln_f.bias": bias(model.ln_f.bias, d),
        "lm_head.weight": model.output_weight[: cfg.vocab_size],
    }
    for i, block in enumerate(model.blocks):
        h, attn, mlp = f"transformer.h.{i}.", block.attn, block.mlp
        # qk.weight is what forward multiplies by: for POET, R W0 P with the Neumann-series
        # rotations. POETProjection.merge() would compose the exact Cayley ones instead, which
        # differ by the series' truncation error (and it would change the model).
        qkv = torch.cat([attn.qk.weight.to(dtype), attn.v.weight])
        w.update(
            {
                h + "ln_1.weight": block.ln_1.weight,
                h + "ln_1.bias": bias(block.ln_1.bias, d),
                h + "attn.c_attn.weight": qkv.T,
                h + "attn.c_attn.bias": torch.cat([bias(None, 2 * d), bias(attn.v.bias, d)]),
                h + "attn.c_proj.weight": attn.proj.weight.T,
                h + "attn.c_proj.bias": bias(attn.proj.bias, d),
                h + "ln_2.weight": block.ln_2.weight,
                h + "ln_2.bias": bias(block.ln_2.bias, d),
                h + "mlp.c_fc.weight": mlp.fc.weight.T,
                h + "mlp.c_fc.bias": bias(mlp.fc.bias, cfg.d_ff),
                h + "mlp.c_proj.weight": mlp.proj.weight.T,
                h + "mlp.c_proj.bias": bias(mlp.proj.bias, d),
            }
        )
    return {k: t.detach().to("cpu", dtype).contiguous() for k, t in w.items()}


def _gpt2_shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """The shapes of a transformers GPT-2's ``tensors`` under our names, where a name has an
    equivalent (what ``_shape_disagreement`` reads: embeddings, layers, MLP, head)."""
    ours = {}
    for name, t in tensors.items():
        shape = tuple(t.shape)
        if name in ("transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"):
            ours[name.removeprefix("transformer.")] = shape
        elif m := re.fullmatch(r"transformer\.h\.(\d+)\.mlp\.c_fc\.weight", name):
            ours[f"blocks.{m.group(1)}.mlp.fc.weight"] = shape[::-1]  # Conv1D stores (in, out)
        elif m := re.fullmatch(r"transformer\.h\.(\d+)\.(.*)", name):
            ours[f"blocks.{m.group(1)}.gpt2.{m.group(2)}"] = shape
    return ours
