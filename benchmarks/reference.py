"""The plain reference: the same GPT written the straightforward (nanoGPT) way.

One fused QKV nn.Linear, SDPA attention, full logits and F.cross_entropy, GELU(tanh), pre-LN,
learned positions, tied embeddings. ``pad_vocab=True`` (the default) pads the embedding to
``cfg.padded_vocab_size`` as nanoGPT pads to 50,304, which hands the reference one of the levers
issue 8 lists for the fast path; ``pad_vocab=False`` is the model exactly as the issue lists it
(50,257 rows, an output row stride that is not 16-byte aligned). It computes the same function as
``oelm_core.model.GPT`` (GPT-Base and OELM-NoFreeze; frozen Q/K are simply not given to the
optimiser), so ``copy_from`` makes the two equal (tests/test_model.py checks it) and the benchmarks
can run them side by side on one card. Not used by the toolkit.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from oelm_core.config import ModelConfig


class RefAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.d = cfg.n_head, cfg.d_model
        self.c_attn = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.attn_bias)
        self.c_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.attn_bias)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))


class RefBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = RefAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.c_fc = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class ReferenceGPT(nn.Module):
    def __init__(self, cfg: ModelConfig, pad_vocab: bool = True):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.padded_vocab_size if pad_vocab else cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(RefBlock(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        for n, p in self.named_parameters():
            if n.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))
        with torch.no_grad():
            self.wte.weight[cfg.vocab_size :].zero_()

    def forward(self, idx, targets=None):
        t = idx.size(1)
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)[..., : self.cfg.vocab_size]
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)


@torch.no_grad()
def copy_from(ref: ReferenceGPT, model) -> ReferenceGPT:
    """Load an ``oelm_core`` GPT's weights into the reference (frozen Q/K included)."""
    d = model.cfg.d_model
    ref.wte.weight.copy_(model.wte.weight[: ref.wte.num_embeddings])
    ref.wpe.weight.copy_(model.wpe.weight)
    ref.ln_f.load_state_dict(model.ln_f.state_dict())
    for rb, b in zip(ref.blocks, model.blocks):
        rb.ln_1.load_state_dict(b.ln_1.state_dict())
        rb.ln_2.load_state_dict(b.ln_2.state_dict())
        rb.attn.c_attn.weight[: 2 * d].copy_(b.attn.qk.weight)
        rb.attn.c_attn.weight[2 * d :].copy_(b.attn.v.weight)
        rb.attn.c_proj.load_state_dict(b.attn.proj.state_dict())
        rb.c_fc.load_state_dict(b.mlp.fc.state_dict())
        rb.c_proj.load_state_dict(b.mlp.proj.state_dict())
    return ref


def reference_grads_as_model(ref: ReferenceGPT, model) -> dict:
    """The reference's gradients under the names of ``model``'s parameters (for comparisons)."""
    d = model.cfg.d_model
    out = {"wte.weight": ref.wte.weight.grad, "wpe.weight": ref.wpe.weight.grad}
    for name, p in ref.ln_f.named_parameters():
        out[f"ln_f.{name}"] = p.grad
    for i, rb in enumerate(ref.blocks):
        pre = f"blocks.{i}."
        for ln in ("ln_1", "ln_2"):
            for name, p in getattr(rb, ln).named_parameters():
                out[f"{pre}{ln}.{name}"] = p.grad
        g = rb.attn.c_attn.weight.grad
        out[f"{pre}attn.qk.weight"] = None if g is None else g[: 2 * d]
        out[f"{pre}attn.v.weight"] = None if g is None else g[2 * d :]
        for name, p in rb.attn.c_proj.named_parameters():
            out[f"{pre}attn.proj.{name}"] = p.grad
        for name, p in rb.c_fc.named_parameters():
            out[f"{pre}mlp.fc.{name}"] = p.grad
        for name, p in rb.c_proj.named_parameters():
            out[f"{pre}mlp.proj.{name}"] = p.grad
    return out
