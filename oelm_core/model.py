"""The GPT of OELM Lab: one readable reference model for every group and ablation.

GPT-Base is a GPT-2-style decoder. OELM changes only how W_q and W_k of each attention layer start
and whether they learn:

- they start as random **orthogonal** matrices (``ModelConfig.qk_init``, built by
  ``oelm_core.orthogonal``), orthogonal across the whole projection rather than per head: each
  head's d_head x d slice then has orthonormal rows *and* the heads' slices are mutually
  orthogonal, so the projection is an isometry of the residual stream and no two heads start by
  looking at the same subspace;
- **frozen** ones (``ModelConfig.freeze_qk``) are buffers, not parameters: autograd never computes
  their weight gradient, the optimizer never sees them, and they travel with ``state_dict`` like
  any weight.

``QKProjection`` and ``_make_qk`` below are the whole idea. The ablations swap what builds Q/K
(Gaussian or other orthogonal constructions, POET's learnable rotations in ``oelm_core.poet``) or
replace QK^T by input-independent logits (the Synthesizer).

This file is the reference path: plain PyTorch, any device. The speed tricks (a loss that never
holds all logits, a CUDA-graph step and decoder, Triton kernels...) live in
``oelm_core.fast`` and are applied to a built model, tested against this one.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from oelm_core.config import ModelConfig, model_config
from oelm_core.orthogonal import init_qk

# --------------------------------------------------------------------------------------------
# Q/K projections: the OELM idea
# --------------------------------------------------------------------------------------------


class QKProjection(nn.Module):
    """W_q and W_k of one layer stacked as one (2 d_model, d_model) weight: x -> [q | k].

    ``frozen`` stores the weight as a buffer. ``unfreeze`` turns it into a parameter in place
    (progressive unfreezing); the trainer must then hand the returned parameter to its optimizer.
    """

    def __init__(self, w_q: torch.Tensor, w_k: torch.Tensor, frozen: bool):
        super().__init__()
        weight = torch.cat([w_q, w_k], dim=0)
        if frozen:
            self.register_buffer("weight", weight)
        else:
            self.weight = nn.Parameter(weight)

    @property
    def frozen(self) -> bool:
        # Asked of the module's own tables, not of what ``self.weight`` returns: a wrapper of the
        # parameter (a gradient exchange's tap) is no nn.Parameter, yet trainable.
        return "weight" in self._buffers

    def unfreeze(self) -> Optional[nn.Parameter]:
        if not self.frozen:
            return None
        weight = self.weight
        del self._buffers["weight"]
        self.weight = nn.Parameter(weight.detach().clone())
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def _make_qk(cfg: ModelConfig, layer: int, generator: torch.Generator) -> Optional[nn.Module]:
    """Layer ``layer``'s Q/K projection, or None for a Synthesizer (no Q/K at all)."""
    if cfg.attention != "dot":
        return None
    d = cfg.d_model
    w_q = init_qk(d, d, cfg.qk_init, cfg.qk_gain, generator=generator)
    w_k = init_qk(d, d, cfg.qk_init, cfg.qk_gain, generator=generator)
    if cfg.poet_block_size:
        from oelm_core.poet import POETProjection  # the learnable-orthogonal reparametrisation

        return POETProjection(w_q, w_k, cfg, generator=generator)
    return QKProjection(w_q, w_k, frozen=layer in cfg.frozen_layers())


# --------------------------------------------------------------------------------------------
# Attention
# --------------------------------------------------------------------------------------------


class KVCache:
    """Keys and values of every layer for incremental decoding.

    Tensors are (batch, n_head, block_size, d_head), filled up to ``length`` positions.
    """

    def __init__(self, cfg: ModelConfig, batch: int, device, dtype):
        shape = (batch, cfg.n_head, cfg.block_size, cfg.d_head)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.n_layer)]
        self.length = 0

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``layer``'s k, v (B, n_head, T_new, d_head) at positions length .. length + T_new - 1
        and return its keys and values so far, (B, n_head, length + T_new, d_head) views of the
        cache. Leaves ``length`` alone: ``GPT.hidden`` advances it once all layers have appended."""
        start, end = self.length, self.length + k.size(2)
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def causal_mask(t_new: int, t_total: int, device) -> torch.Tensor:
    """(t_new, t_total) boolean mask: query i (at position t_total - t_new + i) sees keys <= it."""
    offset = t_total - t_new
    rows = torch.arange(t_new, device=device)[:, None] + offset
    return torch.arange(t_total, device=device)[None, :] <= rows


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, generator: torch.Generator):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        d, h, t = cfg.d_model, cfg.n_head, cfg.block_size
        self.qk = _make_qk(cfg, layer, generator)
        self.v = nn.Linear(d, d, bias=cfg.attn_bias)
        self.proj = nn.Linear(d, d, bias=cfg.attn_bias)
        self.dropout = cfg.dropout
        if cfg.attention != "dot":
            # Synthesizer (Tay et al. 2021): per-head logits that do not depend on the input.
            shapes = {
                "synth_random": [(h, t, t)],
                "synth_factorized": [(h, t, cfg.synth_rank), (h, t, cfg.synth_rank)],
            }[cfg.attention]
            std = 1.0 / math.sqrt(shapes[0][-1])
            tensors = [torch.randn(s, generator=generator) * std for s in shapes]
            for i, tensor in enumerate(tensors):
                if cfg.synth_trainable:
                    self.register_parameter(f"synth_{i}", nn.Parameter(tensor))
                else:
                    self.register_buffer(f"synth_{i}", tensor)

    def synth_logits(self, t_new: int, t_total: int) -> torch.Tensor:
        """(n_head, t_new, t_total) Synthesizer logits of the newest positions."""
        rows = slice(t_total - t_new, t_total)
        if self.cfg.attention == "synth_random":
            return self.synth_0[:, rows, :t_total]
        return self.synth_0[:, rows] @ self.synth_1[:, :t_total].transpose(1, 2)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, d_model) -> (B, n_head, T, d_head)."""
        b, t, _ = x.shape
        return x.view(b, t, self.cfg.n_head, self.cfg.d_head).transpose(1, 2)

    def qkv(self, x: torch.Tensor):
        """x (B, T, d_model) -> q, k, v, each (B, T, d_model); q and k are None for the Synthesizer."""
        d = self.cfg.d_model
        if isinstance(self.qk, QKProjection) and not self.qk.frozen and self.v.bias is None and torch.is_grad_enabled():
            # Trainable Q/K in training: q, k and v in one matmul, as nanoGPT's c_attn computes
            # them. (Without gradients, when decoding, the concatenation would copy the weights
            # on every call for nothing; the products are the same either way.)
            return F.linear(x, torch.cat([self.qk.weight, self.v.weight])).split(d, dim=-1)
        if self.qk is None:
            return None, None, self.v(x)
        # Frozen Q/K apart from V: autograd then never computes the frozen weight's gradient,
        # which is the work that freezing saves.
        q, k = self.qk(x).split(d, dim=-1)
        return q, k, self.v(x)

    def forward(self, x: torch.Tensor, cache: Optional[KVCache] = None, return_attention: bool = False):
        """x: (B, T, d_model) -> (B, T, d_model); with ``return_attention`` also the attention
        probabilities (B, H, T, T_total), or (1, H, T, T_total) for the Synthesizer, whose
        attention does not depend on the input (it broadcasts over the batch)."""
        b, t, d = x.shape
        q, k, v = self.qkv(x)
        v = self.heads(v)
        if self.qk is not None:
            q, k = self.heads(q), self.heads(k)
        else:
            k = v  # the Synthesizer has no keys; the cache's key slot holds the values
        if cache is not None:
            k, v = cache.append(self.layer, k, v)
        t_total = v.size(2)
        p_drop = self.dropout if self.training else 0.0

        att = None
        if self.qk is not None and not return_attention:
            mask = None if t == t_total or t == 1 else causal_mask(t, t_total, x.device)
            # t == 1 (cached decoding): the one new token sees every key, no mask needed.
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p_drop, is_causal=t == t_total and t > 1
            )
        else:  # the probabilities themselves: for the attention maps, and the Synthesizer
            if self.qk is not None:
                logits = (q @ k.transpose(-2, -1)) / math.sqrt(self.cfg.d_head)
            else:
                logits = self.synth_logits(t, t_total).unsqueeze(0).to(v.dtype)
            logits = logits.masked_fill(~causal_mask(t, t_total, x.device), float("-inf"))
            att = torch.softmax(logits.float(), dim=-1).to(v.dtype)
            y = F.dropout(att, p_drop, self.training) @ v
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        # GPT-2's resid_dropout after the output projection, as the MLP drops its output.
        y = F.dropout(self.proj(y), p_drop, self.training)
        return (y, att) if return_attention else y


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LayerNorm transformer block."""

    def __init__(self, cfg: ModelConfig, layer: int, generator: torch.Generator):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg, layer, generator)
        self.ln_2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x, cache=None, return_attention=False):
        a = self.attn(self.ln_1(x), cache, return_attention)
        a, att = a if return_attention else (a, None)
        x = x + a
        x = x + self.mlp(self.ln_2(x))
        return (x, att) if return_attention else x


# --------------------------------------------------------------------------------------------
# GPT
# --------------------------------------------------------------------------------------------


class OutputLoss(nn.Module):
    """The output layer and its cross-entropy, a module of its own so that a faster one can take
    its place (``oelm_core.fast.loss``: the same loss without ever holding all the logits)."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """h (N, d_model), weight (padded_vocab, d_model), targets (N,) token ids, or -1 for a
        position without loss -> the mean loss over the others, 0-dim float32 (nats/token); NaN
        (0/0) when every target is -1."""
        logits = F.linear(h, weight)[:, : self.vocab_size]
        return F.cross_entropy(logits.float(), targets, ignore_index=-1)


class GPT(nn.Module):
    """Decoder-only transformer with learned positions; the output layer reuses the token
    embedding unless ``cfg.tie_embeddings`` is False (then it has its own ``lm_head``).

    ``model(idx)`` -> logits (B, T, vocab_size); ``model(idx, targets)`` -> mean loss (nats/token).
    """

    def __init__(self, cfg: ModelConfig, seed: int = 0):
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        generator = torch.Generator().manual_seed(seed)
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i, generator) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.padded_vocab_size, bias=False)
        self.output_loss = OutputLoss(cfg.vocab_size)
        self._init_weights(generator)

    def _init_weights(self, generator: torch.Generator) -> None:
        # GPT-2's scheme: N(0, 0.02) everywhere, residual output projections shrunk by
        # 1/sqrt(2 n_layer) so the residual stream's variance does not grow with depth.
        # Q/K (and the Synthesizer logits) were set by their own constructions already.
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        with torch.no_grad():
            for name, module in self.named_modules():
                if isinstance(module, nn.Linear):
                    std = residual_std if name.endswith("proj") else 0.02
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                    if module.bias is not None:
                        module.bias.zero_()
                elif isinstance(module, nn.Embedding):
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.02)
            self.wte.weight[self.cfg.vocab_size :].zero_()  # padding rows: never a token, never a logit
            if self.lm_head is not None:
                self.lm_head.weight[self.cfg.vocab_size :].zero_()

    @property
    def output_weight(self) -> torch.Tensor:
        """The output layer's weight, (padded_vocab_size, d_model): ``wte.weight`` when tied, else
        ``lm_head.weight``. Rows from vocab_size on pad the matrix for the tensor cores (50,304 =
        786 x 64); they are zero and never become a logit."""
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def hidden(self, idx: torch.Tensor, cache: Optional[KVCache] = None, return_attention: bool = False):
        """idx: (B, T) token ids -> final normalised hidden states (B, T, d_model); with
        ``return_attention`` also each layer's attention probabilities."""
        t = idx.size(1)
        start = cache.length if cache is not None else 0
        if start + t > self.cfg.block_size:
            if cache is not None:  # cropping the input to block_size would not make room
                raise ValueError(
                    f"the KV cache holds {start} of {self.cfg.block_size} positions, no "
                    f"room for {t} more tokens; reset it (cache.length = 0, or "
                    f"model.new_cache()) and prefill again with at most the last "
                    f"{self.cfg.block_size} tokens"
                )
            raise ValueError(
                f"sequence of {start + t} tokens exceeds the context of "
                f"{self.cfg.block_size}; crop the input to the last "
                f"{self.cfg.block_size} tokens"
            )
        pos = torch.arange(start, start + t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        maps = []
        for block in self.blocks:
            if return_attention:
                x, att = block(x, cache, True)
                maps.append(att)
            else:
                x = block(x, cache)
        if cache is not None:
            cache.length += t
        x = self.ln_f(x)
        return (x, maps) if return_attention else x

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: (..., d_model) -> logits (..., vocab_size), the padding columns cut off."""
        return F.linear(h, self.output_weight)[..., : self.cfg.vocab_size]

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None, cache: Optional[KVCache] = None):
        """idx: (B, T) int64 token ids in [0, vocab_size). Without ``targets``: logits (B, T,
        vocab_size). With ``targets`` (B, T) int64, the next token of each position or -1 for a
        position without loss: the mean cross-entropy over the others, a 0-dim float32 tensor
        (nats/token). ``cache``: a ``KVCache`` holding ``cache.length`` earlier positions; this
        call's T tokens are their continuation (length + T <= block_size, else ValueError), its
        keys and values are stored and ``cache.length`` grows by T. Without a cache T <= block_size."""
        h = self.hidden(idx, cache)
        if targets is None:
            return self.logits(h)
        return self.output_loss(h.flatten(0, 1), self.output_weight, targets.flatten())

    @torch.no_grad()
    def forward_with_attention(self, idx: torch.Tensor):
        """The visualisation path: (logits (B, T, V), [attention probabilities (B, H, T, T)] per
        layer); (1, H, T, T) per layer for the Synthesizer (the same for every sequence)."""
        h, maps = self.hidden(idx, return_attention=True)
        return self.logits(h), maps

    def new_cache(self, batch: int = 1) -> KVCache:
        p = self.wte.weight
        return KVCache(self.cfg, batch, p.device, p.dtype)

    def unfreeze_qk(self, layers="all") -> list[nn.Parameter]:
        """Make frozen Q/K of ``layers`` ("all" or indices) trainable; returns the new parameters,
        which an optimizer must be given. ``live_config`` says what is frozen afterwards."""
        chosen = range(self.cfg.n_layer) if layers == "all" else layers
        new = []
        for i in chosen:
            qk = self.blocks[i].attn.qk
            if isinstance(qk, QKProjection) and qk.frozen:
                new.append(qk.unfreeze())
        return new

    def frozen_qk_layers(self) -> list[int]:
        """The layers whose Q/K are frozen now (buffers): ``cfg.frozen_layers()`` until
        ``unfreeze_qk`` makes some of them trainable."""
        return [
            i for i, block in enumerate(self.blocks) if isinstance(block.attn.qk, QKProjection) and block.attn.qk.frozen
        ]

    def live_config(self) -> ModelConfig:
        """The configuration of the model as it is now: ``cfg`` (what it was built with) with
        ``freeze_qk`` naming the layers frozen now, ``cfg``'s own value while they are the ones it
        names. What rebuilds this very model: checkpoints and exports store it, and the FLOPs of a
        step are counted from it."""
        frozen = self.frozen_qk_layers()
        if frozen == self.cfg.frozen_layers():
            return self.cfg
        return dataclasses.replace(self.cfg, freeze_qk=frozen or "none")


def build_model(
    preset: str | ModelConfig | None = None, variant: str | None = None, seed: int = 0, **overrides: Any
) -> GPT:
    """A GPT of a named preset and variant (see ``oelm_core.VARIANTS``; left out: those
    ``config.model_config`` defaults to), or of a ModelConfig, which is built as it is: any
    variant or overrides with it are an error, not applied. ``seed`` seeds the initial weights."""
    if not isinstance(preset, ModelConfig):
        named = {k: v for k, v in (("preset", preset), ("variant", variant)) if v is not None}
        return GPT(model_config(**named, **overrides), seed=seed)
    if variant is not None or overrides:
        given = ([f"variant={variant!r}"] if variant is not None else []) + sorted(overrides)
        raise TypeError(
            f"build_model got a ModelConfig together with {', '.join(given)}, which it "
            f"would not apply: pass a preset name instead (build_model(preset, variant, "
            f"**overrides)), or change the config first (dataclasses.replace(cfg, ...))"
        )
    return GPT(preset, seed=seed)
