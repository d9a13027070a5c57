"""One configurable GPT: standard Q/K (GPT-Base), orthogonal Q/K trainable or frozen (OELM), and
the ablations (Gaussian or other orthogonal constructions, per-layer freezing, Synthesizer
attention, POET-style learnable orthogonal Q/K).

Orthogonality is across the whole projection, not per head: W_q and W_k are each one d x d
orthogonal matrix. Every head's d_head x d slice is then row-orthonormal *and* the heads' slices
are mutually orthogonal, so the projection as a whole is an isometry of the residual stream
(what the theory checks measure) and no two heads start by looking at the same subspace.
Per-head constructions would give each head orthonormal rows but let heads overlap.

Frozen Q/K are buffers, not parameters: autograd never computes their weight gradient, the
optimizer never sees them, and they travel with ``state_dict`` like any weight.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

from oelm_core import cublaslt, logits_gemm
from oelm_core.config import ModelConfig, model_config
from oelm_core.orthogonal import init_qk

try:  # the CUDA fast paths of training; CPU-only installs have no Triton and use plain ops
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None


# --------------------------------------------------------------------------------------------
# One-row products on the CPU (a decoding step)
# --------------------------------------------------------------------------------------------

def _one_cpu_row(x: torch.Tensor) -> bool:
    """True for a decoding step's activation on the CPU: one row, no gradient taken."""
    return x.device.type == "cpu" and x.numel() == x.size(-1) and not torch.is_grad_enabled()


# Optimizer steps taken in this process, by any torch.optim optimizer: part of every
# TransposedCopy's key. Fused AdamW (the trainer's, on the CPU too) writes the weights in place
# without bumping their version counters, so versions alone left decoding on the old weights.
_optimizer_steps = 0


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


class TransposedCopy:
    """Weights (out_i, in) concatenated along out and stored transposed, one contiguous
    (in, sum of out_i) tensor, remade whenever one of them moves or changes in place (its
    version counter) and after every optimizer step (``_optimizer_steps``: fused optimizers
    leave the version counters alone). A write that neither sees (through ``weight.data``, or by
    an optimizer outside torch.optim) must be followed by ``GPT.drop_transposed_copies()``.

    Why: a decoding step on the CPU is a chain of matrix-vector products whose speed is how fast
    the weights stream from memory. MKL reads ``x @ W.T`` with W stored (out, 512) at ~10 GB/s
    on an AMD EPYC, and the transposed copy at 18-21 GB/s once out >= 1,024 (a plain sum streams
    at ~30 GB/s; benchmarks/RESULTS.md). Costs one more copy of those weights in memory.
    """

    def __init__(self):
        self._key: Optional[tuple] = None
        self._value: Optional[torch.Tensor] = None

    def __call__(self, *weights: torch.Tensor) -> torch.Tensor:
        if any(w.is_inference() for w in weights):
            # Weights made under torch.inference_mode have no version counter, and inside it they
            # can be written in place (load_state_dict) unseen: keep no copy, read them as they are.
            return (weights[0] if len(weights) == 1 else torch.cat(weights)).t()
        key = (_optimizer_steps, tuple((w.data_ptr(), w._version, w.dtype) for w in weights))
        if key != self._key:
            self._key, self._value = key, torch.cat([w.detach() for w in weights]).t().contiguous()
        return self._value

    def clear(self) -> None:
        """Drop the copy (and its memory); the next call makes it again."""
        self._key = self._value = None


# --------------------------------------------------------------------------------------------
# Q/K projections
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
        # parameter (oelm_core.peer_grads.ParameterTap) is no nn.Parameter, yet trainable.
        return "weight" in self._buffers

    def unfreeze(self) -> Optional[nn.Parameter]:
        if not self.frozen:
            return None
        weight = self.weight
        del self._buffers["weight"]
        self.weight = nn.Parameter(weight.detach().clone())
        return self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def _make_qk(cfg: ModelConfig, layer: int, generator: torch.Generator) -> Optional[nn.Module]:
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

    def write(self, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Fixed-shape decoding: store one position's k, v (B, H, 1, d_head) at ``pos`` (a
        1-element LongTensor on the cache's device) and return the whole (B, H, block_size,
        d_head) buffers. Leaves ``length`` alone (the caller keeps it)."""
        kc, vc = self.k[layer], self.v[layer]
        kc.index_copy_(2, pos, k.to(kc.dtype))
        vc.index_copy_(2, pos, v.to(vc.dtype))
        return kc, vc


def _causal_mask(t_new: int, t_total: int, device) -> torch.Tensor:
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
        self._qkv_t = TransposedCopy()  # [W_q; W_k; W_v] for one-row products on the CPU
        if cfg.attention != "dot":
            # Synthesizer (Tay et al. 2021): per-head logits that do not depend on the input.
            shapes = {"synth_random": [(h, t, t)],
                      "synth_factorized": [(h, t, cfg.synth_rank), (h, t, cfg.synth_rank)]}[cfg.attention]
            std = 1.0 / math.sqrt(shapes[0][-1])
            tensors = [torch.randn(s, generator=generator) * std for s in shapes]
            for i, tensor in enumerate(tensors):
                if cfg.synth_trainable:
                    self.register_parameter(f"synth_{i}", nn.Parameter(tensor))
                else:
                    self.register_buffer(f"synth_{i}", tensor)

    def _synth_logits(self, t_new: int, t_total: int) -> torch.Tensor:
        """(n_head, t_new, t_total) logits of the Synthesizer rows for the newest positions."""
        rows = slice(t_total - t_new, t_total)
        if self.cfg.attention == "synth_random":
            return self.synth_0[:, rows, :t_total]
        return self.synth_0[:, rows] @ self.synth_1[:, :t_total].transpose(1, 2)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return x.view(b, t, self.cfg.n_head, self.cfg.d_head).transpose(1, 2)

    def _qkv(self, x: torch.Tensor):
        d = self.cfg.d_model
        if self.qk is None:
            return None, None, linear(x, self.v.weight, self.v.bias)
        if isinstance(self.qk, QKProjection) and _one_cpu_row(x):
            # A decoding step on the CPU: one product over a kept transposed [W_q; W_k; W_v].
            q, k, v = (x @ self._qkv_t(self.qk.weight, self.v.weight)).split(d, dim=-1)
            return q, k, v if self.v.bias is None else v + self.v.bias
        if (isinstance(self.qk, QKProjection) and not self.qk.frozen and self.v.bias is None
                and torch.is_grad_enabled()):
            # One matmul for q, k and v when all three are trained. Without gradients (eval,
            # decoding) two: the concatenation copies the weights on every call, which for one
            # token costs more than the products themselves.
            q, k, v = linear(x, torch.cat([self.qk.weight, self.v.weight])).split(d, dim=2)
        else:
            # Kept apart so autograd skips the frozen weight's gradient (the point of freezing).
            q, k = self.qk(x).split(d, dim=2)
            v = linear(x, self.v.weight, self.v.bias)
        return q, k, v

    def forward(self, x: torch.Tensor, cache: Optional[KVCache] = None,
                return_attention: bool = False):
        """x: (B, T, d_model) -> (B, T, d_model); with ``return_attention`` also the attention
        probabilities (B, H, T, T_total), or (1, H, T, T_total) for the Synthesizer, whose
        attention does not depend on the input (it broadcasts over the batch)."""
        b, t, _ = x.shape
        q, k, v = self._qkv(x)
        v = self._heads(v)
        k = self._heads(k) if k is not None else None
        q = self._heads(q) if q is not None else None
        if cache is not None:
            # The Synthesizer has no keys; its key slot in the cache holds the values again.
            k, v = cache.append(self.layer, v if k is None else k, v)
        t_total = v.size(2)
        p_drop = self.dropout if self.training else 0.0

        if self.qk is not None and not return_attention:
            if t == t_total:
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=p_drop, is_causal=True)
            elif t == 1:
                # One new token (cached decoding) sees every key: no mask to build or apply.
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=p_drop)
            else:
                mask = _causal_mask(t, t_total, x.device)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p_drop)
            att = None
        else:
            if self.qk is not None:
                logits = (q @ k.transpose(-2, -1)) / math.sqrt(self.cfg.d_head)
            else:
                logits = self._synth_logits(t, t_total).unsqueeze(0).to(v.dtype)
            logits = logits.masked_fill(~_causal_mask(t, t_total, x.device), float("-inf"))
            att = torch.softmax(logits.float(), dim=-1).to(v.dtype)
            y = F.dropout(att, p_drop, self.training) @ v
        y = self.project(y.transpose(1, 2).contiguous().view(b, t, self.cfg.d_model))
        return (y, att) if return_attention else y

    def project(self, y: torch.Tensor) -> torch.Tensor:
        """The output projection of the heads' output, and in training the residual dropout after
        it (GPT-2's resid_dropout), as the MLP drops its output: both branches regularised alike."""
        y = linear(y, self.proj.weight, self.proj.bias)
        return F.dropout(y, self.dropout, self.training) if self.dropout > 0 else y

    def decode(self, x: torch.Tensor, cache: KVCache, pos: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One new token at position ``pos``: x (B, 1, d_model); k, v written into the cache at
        ``pos``; attention over the cache's first t positions with the additive ``mask``
        (1, 1, 1, t), 0 at positions <= pos and -inf after (t = block_size gives shapes that never
        change, for CUDA graphs; t = pos + 1 reads only the keys in use). Returns the heads'
        output (B, 1, d_model) *before* the output projection (``Block.decode`` fuses that with
        the residual add). With ``self.project`` applied, the same numbers as ``forward(x, cache)``
        with ``cache.length == pos``."""
        b = x.size(0)
        q, k, v = self._qkv(x)
        v = self._heads(v)
        # The Synthesizer has no keys; its key slot in the cache holds the values again.
        k_all, v_all = cache.write(self.layer, pos, v if k is None else self._heads(k), v)
        t = mask.size(-1)
        k_all, v_all = k_all[:, :, :t], v_all[:, :, :t]
        if self.qk is not None:
            # One query per head: a batched GEMV with the mask added (baddbmm), a softmax and a
            # second GEMV. SDPA's fused kernels are built for many queries; in float32 over 512
            # keys its memory-efficient kernel took several times longer per layer (H200).
            h, dh = self.cfg.n_head, self.cfg.d_head
            logits = torch.baddbmm(mask.to(q.dtype).view(1, 1, t), self._heads(q).reshape(b * h, 1, dh),
                                   k_all.reshape(b * h, t, dh).transpose(1, 2), alpha=1.0 / math.sqrt(dh))
            logits = logits.view(b, h, 1, t)
        else:
            rows = self.synth_0.index_select(1, pos)  # (H, 1, block_size) or (H, 1, rank)
            logits = (rows[..., :t] if self.cfg.attention == "synth_random"
                      else rows @ self.synth_1[:, :t].transpose(1, 2))
            logits = logits.unsqueeze(0) + mask
        att = torch.softmax(logits.float(), dim=-1).to(v_all.dtype)
        y = F.dropout(att, self.dropout, self.training) @ v_all
        return y.transpose(1, 2).reshape(b, 1, self.cfg.d_model)


def _add_linear(residual: torch.Tensor, h: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """residual + layer(h) for one token, (B, 1, d) each, as one GEMM that accumulates into the
    residual (addmm): one kernel fewer than a linear layer and an add, per projection."""
    b = residual.size(0)
    acc = residual.view(b, -1) if layer.bias is None else residual.view(b, -1) + layer.bias
    return torch.addmm(acc, h.reshape(b, -1), layer.weight.t()).view_as(residual)


# --------------------------------------------------------------------------------------------
# Linear layers of the training step on CUDA: GEMMs through cuBLASLt (oelm_core/cublaslt.py)
# --------------------------------------------------------------------------------------------

class _LtLinear(torch.autograd.Function):
    """x W^T + b for x (M, K), W (N, K), b (N,) or None, all one low-precision dtype, each of the
    three GEMMs (forward, input and weight gradient) with its timed cuBLASLt algorithm. A weight
    that needs no gradient (frozen Q/K) gets none computed."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(x, w)
        return cublaslt.gemm(x, w, b, False, True)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        grad = grad.contiguous()  # (a no-op for the model's gradients; an expanded one is not)
        return (cublaslt.gemm(grad, w, None, False, False) if need_x else None,
                cublaslt.gemm(grad, x, None, True, False) if need_w else None,
                grad.sum(0) if need_b else None)


class _LtGeluMLP(torch.autograd.Function):
    """proj(GELU(fc(x))) for x (M, d_model) with GELU in fc's GEMM epilogue, which writes GELU and
    its input: the forward pass has no GELU pass of its own. Inputs as ``_LtLinear``'s; biases
    may be None."""

    @staticmethod
    def forward(ctx, x, w_fc, b_fc, w_proj, b_proj):
        h, pre = cublaslt.gemm_gelu(x, w_fc, b_fc)
        ctx.save_for_backward(x, w_fc, w_proj, h, pre)
        ctx.biases = (b_fc is not None, b_proj is not None)
        return cublaslt.gemm(h, w_proj, b_proj, False, True)

    @staticmethod
    def backward(ctx, grad):
        x, w_fc, w_proj, h, pre = ctx.saved_tensors
        need_x, need_w_fc, need_b_fc, need_w_proj, need_b_proj = ctx.needs_input_grad
        grad = grad.contiguous()
        # GELU' as torch computes it (compiled, with fc's bias sum): cuBLASLt's DGELU epilogue is
        # slower here (oelm_core/cublaslt.py), and so was a Triton pass of our own for both
        # (benchmarks/RESULTS.md).
        d_pre = torch.ops.aten.gelu_backward(cublaslt.gemm(grad, w_proj, None, False, False), pre,
                                             approximate="tanh")
        return (cublaslt.gemm(d_pre, w_fc, None, False, False) if need_x else None,
                cublaslt.gemm(d_pre, x, None, True, False) if need_w_fc else None,
                d_pre.sum(0) if need_b_fc else None,
                cublaslt.gemm(grad, h, None, True, False) if need_w_proj else None,
                grad.sum(0) if need_b_proj else None)


@torch.compiler.assume_constant_result
def _lt_usable(device: torch.device, dtype: torch.dtype) -> bool:
    return cublaslt.available(device, dtype)


def _lt_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    """The dtype the body's linear layers compute in through cuBLASLt for a training step on
    ``x``, or None where they use torch's ops (CPU, no gradient, no low-precision autocast, no
    cuBLASLt). Without gradients (evaluation, decoding) torch's ops launch faster from Python."""
    if not (x.is_cuda and torch.is_grad_enabled() and torch.is_autocast_enabled("cuda")):
        return None
    dtype = torch.get_autocast_dtype("cuda")
    return dtype if _lt_usable(x.device, dtype) else None


def _as(t: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    return None if t is None else t.to(dtype)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear, through ``_LtLinear`` in a CUDA training step under autocast."""
    dtype = _lt_dtype(x)
    if dtype is None:
        return F.linear(x, weight, bias)
    y = _LtLinear.apply(x.reshape(-1, x.size(-1)).to(dtype), weight.to(dtype), _as(bias, dtype))
    return y.view(*x.shape[:-1], -1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        # fc transposed for one-row products on the CPU. Not proj: stored (d_model, d_ff), its
        # rows are long enough for MKL to stream it as it is.
        self._fc_t = TransposedCopy()

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """(..., d_model) -> GELU(fc(x)) (..., d_ff), the input of the output projection."""
        if _one_cpu_row(x):
            fc = x @ self._fc_t(self.fc.weight)
            return F.gelu(fc if self.fc.bias is None else fc + self.fc.bias, approximate="tanh")
        return F.gelu(self.fc(x), approximate="tanh")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _lt_dtype(x)
        if dtype is None:
            y = self.proj(self.hidden(x))
        else:
            fc, proj = self.fc, self.proj
            y = _LtGeluMLP.apply(x.reshape(-1, x.size(-1)).to(dtype), fc.weight.to(dtype), _as(fc.bias, dtype),
                                 proj.weight.to(dtype), _as(proj.bias, dtype)).view(*x.shape[:-1], -1)
        return self.dropout(y) if self.dropout.p > 0 else y


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

    def decode(self, x, cache, pos, mask):
        """The fixed-shape one-token step (see ``CausalSelfAttention.decode``), each residual add
        folded into its projection's GEMM (in training with dropout, which sits between the
        projection and the add, the plain sums)."""
        y = self.attn.decode(self.ln_1(x), cache, pos, mask)
        if self.training and self.mlp.dropout.p > 0:
            x = x + self.attn.project(y)
            return x + self.mlp(self.ln_2(x))
        x = _add_linear(x, y, self.attn.proj)
        return _add_linear(x, self.mlp.hidden(self.ln_2(x)), self.mlp.proj)


# --------------------------------------------------------------------------------------------
# The loss: output layer and cross-entropy fused over slices of tokens
# --------------------------------------------------------------------------------------------

if triton is not None:
    # How far above the offset (the target's logit) a logit may go in the kernel's one pass: E stays
    # below e^30 (1e13) and S below 50,304 e^30 (5e17), far from overflow in the gradient GEMMs'
    # float32 sums, and the row scale above 1/(n 5e17), far from underflow when it scales x in bf16.
    _CE_HEADROOM = tl.constexpr(30.0)

    @triton.jit
    def _ce_rows_kernel(logits_ptr, stride, targets_ptr, loss_ptr, scale_ptr, inv_n_ptr, x_ptr, xs_ptr,
                        d, vocab, padded, WRITE_GRAD: tl.constexpr, BLOCK: tl.constexpr,
                        BLOCK_D: tl.constexpr):
        """One program per row of logits; loss = lse - logit[target] (0 where ignored).

        WRITE_GRAD: one pass over the row that also writes, in place, E = exp(logit - c) over all
        padded columns (0 past vocab) and E[target] = exp(logit[target] - c) - S, where
        S = sum(exp(logit - c)); then the row's ``scale`` = valid / n_valid / S and the row of
        x (d,) times it into ``xs``. E * scale is the gradient (softmax - one_hot) * valid / n_valid,
        so the weight gradient is E^T xs and the x gradient (E W) * scale (``_ce_forward_cuda``).
        The usual second read of the row, to normalise by a sum known only at its end, is gone.
        The offset c is the target's logit, so S >= 1. A logit more than _CE_HEADROOM above it
        (the row's loss is then above 30 nats: rare) is written as c - logit < 0 instead, and after
        the pass such a row is read and written once more with the offset at its max, whose own
        entry becomes exactly 1. An ignored row's offset is +inf: E = 0, no second pass.
        Every store covers whole blocks: one that skipped the target's column ran 3x slower.
        Not for float16, whose range E and S would leave (``_LinearCrossEntropy`` keeps it apart)."""
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        target = tl.load(targets_ptr + row)
        valid = target >= 0
        safe_t = tl.where(valid, target, 0)
        t_logit = tl.load(base + safe_t).to(tl.float32)
        cols0 = tl.arange(0, BLOCK)
        if WRITE_GRAD:
            c = tl.where(valid, t_logit, float("inf"))
            m = t_logit
            s = tl.full([], 0.0, tl.float32)
            for off in tl.range(0, padded, BLOCK):
                cols = off + cols0
                x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
                m = tl.maximum(m, tl.max(x, 0))
                dist = x - c
                far = dist > _CE_HEADROOM
                e = tl.exp(tl.where(far, 0.0, dist))  # 0 past vocab, where dist = -inf
                s += tl.sum(tl.where(far, 0.0, e), 0)
                tl.store(base + cols, tl.where(far, -dist, e).to(logits_ptr.dtype.element_ty),
                         mask=cols < padded)
            tl.debug_barrier()  # the stores above before the reads and the target's store below
            # A far logit (``far``'s own test, so the two agree): exp(logit - m) from what was written.
            if m - c > _CE_HEADROOM:
                shift = c - m
                # The max's entry as the pass stored it, so that it decodes to exactly 1.
                top = shift.to(logits_ptr.dtype.element_ty).to(tl.float32)
                s = tl.full([], 0.0, tl.float32)
                for off in tl.range(0, padded, BLOCK):
                    cols = off + cols0
                    v = tl.load(base + cols, mask=cols < padded, other=0.0).to(tl.float32)
                    e = tl.where(v < 0, tl.exp(top - v), v * tl.exp(shift))
                    s += tl.sum(e, 0)
                    tl.store(base + cols, e.to(logits_ptr.dtype.element_ty), mask=cols < padded)
                tl.debug_barrier()
                c = m
            lse = c + tl.log(s)
            tl.store(base + safe_t, (tl.exp(t_logit - c) - s).to(logits_ptr.dtype.element_ty))
            scale = tl.where(valid, tl.load(inv_n_ptr) / s, 0.0)
            tl.store(scale_ptr + row, scale)
            dims = tl.arange(0, BLOCK_D)
            xr = tl.load(x_ptr + row * d + dims, mask=dims < d, other=0.0).to(tl.float32)
            tl.store(xs_ptr + row * d + dims, (xr * scale).to(xs_ptr.dtype.element_ty), mask=dims < d)
        else:  # the loss alone: the online log-sum-exp, one exp per logit
            m = tl.full([], float("-inf"), tl.float32)
            s = tl.full([], 0.0, tl.float32)
            for off in tl.range(0, vocab, BLOCK):
                cols = off + cols0
                x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
                m_new = tl.maximum(m, tl.max(x, 0))  # finite from the first block on (vocab > 0)
                s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
                m = m_new
            lse = m + tl.log(s)
        tl.store(loss_ptr + row, tl.where(valid, lse - t_logit, 0.0))

    @triton.jit
    def _scale_rows_kernel(src_ptr, out_ptr, row_scale_ptr, factor_ptr, n_cols,
                           ROW_SCALE: tl.constexpr, BLOCK: tl.constexpr):
        """out[row] = src[row] * factor (* row_scale[row]), one program per row of contiguous
        tensors, computed in float32. (PyTorch's broadcasting multiply by a device
        scalar, or by a column of row scales with a dtype change, is not vectorised: 2-3x slower.)"""
        row = tl.program_id(0).to(tl.int64)
        factor = tl.load(factor_ptr).to(tl.float32)
        if ROW_SCALE:
            factor = factor * tl.load(row_scale_ptr + row)
        for off in tl.range(0, n_cols, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            v = tl.load(src_ptr + row * n_cols + cols, mask=cols < n_cols).to(tl.float32)
            tl.store(out_ptr + row * n_cols + cols, (v * factor).to(out_ptr.dtype.element_ty),
                     mask=cols < n_cols)


def _scale_rows(src: torch.Tensor, factor: torch.Tensor, row_scale: Optional[torch.Tensor] = None,
                dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """src (rows, cols) * factor (a one-element tensor) [* row_scale (rows,) per row], a new tensor
    of ``dtype`` (default src's; src, saved for the backward, stays as it is for a second one):
    the backward's scaling of the loss's gradients."""
    dtype = dtype or src.dtype
    if src.is_cuda and triton is not None:
        return _scale_rows_triton(src, factor, row_scale, dtype)
    return (src * (factor if row_scale is None else row_scale[:, None] * factor)).to(dtype)


def _scale_rows_triton(src, factor, row_scale, dtype):
    src = src.contiguous()
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    _scale_rows_kernel[(src.size(0),)](src, out, src if row_scale is None else row_scale,
                                       factor.reshape(1).float(), src.size(1),
                                       ROW_SCALE=row_scale is not None, BLOCK=512, num_warps=4)
    return out


def _addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (float32) += a @ b for bf16/fp16 a, b: one GEMM accumulating in place where torch has
    the mixed-dtype addmm (CUDA, torch >= 2.8), else a low-precision product added in float32.
    The loss's float32 sum where cuBLASLt does not run (``cublaslt.matmul_into`` does it where it
    does). On an H200, for the output layer's weight gradient of one 8,192-token slice: 0.572-0.610
    against 0.718-0.746 ms (benchmarks/RESULTS.md)."""
    global _HAS_ADDMM_OUT_DTYPE
    if _HAS_ADDMM_OUT_DTYPE:
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            return
        except (TypeError, RuntimeError, NotImplementedError):
            _HAS_ADDMM_OUT_DTYPE = False
    acc += (a @ b).float()


_HAS_ADDMM_OUT_DTYPE = True


def _ce_forward_cuda(x, w, targets, vocab: int, chunk: int, dtype, need_grad: bool):
    """The CUDA path: per slice one matmul over the *padded* vocabulary (aligned for the tensor
    cores), one Triton pass that turns the logits into the loss and, in place, the unnormalised
    gradient E (each row read once, written once; see ``_ce_rows_kernel``), then the two gradient
    matmuls. Returns (loss, grad_x, grad_w, row_scale): grad_w = E^T (row_scale * x) is final,
    grad_x = E W (n, d) is still to be multiplied by row_scale (n,), which the backward does in the
    pass that applies the incoming gradient; without need_grad all but the loss are None.
    Compared with full logits + F.cross_entropy under torch.compile this saves three passes over the
    (tokens x vocab) logits. On an H200, for one 8,192 x 50,304 bf16 slice (benchmarks/bench_ce.py,
    benchmarks/RESULTS.md), the kernel takes 0.44 ms, a plain copy of the slice (one read, one
    write) 0.39-0.41 ms, and the earlier kernel, which read each row twice, 0.64 ms; small programs
    (2,048 columns, 4 warps), many per SM, keep enough loads in flight, where one 32-warp program
    per SM took 0.70 ms. Ignored rows (target -1) cost as much as the others: E is written and
    scaled by 0. With gradients, bf16, on Hopper (``logits_gemm.available``), the matmul and that
    pass are one Triton GEMM that writes E from its accumulator instead (``oelm_core/logits_gemm.py``:
    0.99 against 1.18 ms a slice, 20.9 against 21.8 ms a step at 64 x 512 on an H200)."""
    n, padded = x.size(0), w.size(0)
    xc, wc = x.to(dtype).contiguous(), w.to(dtype)
    targets = targets.contiguous()
    n_valid = (targets >= 0).sum()
    inv_n = (1.0 / n_valid.clamp(min=1).float()).reshape(1)
    row_loss = torch.empty(n, dtype=torch.float32, device=x.device)
    lt = cublaslt.available(x.device, dtype)
    grad_x = grad_w = row_scale = x_scaled = None
    if need_grad:
        grad_x = torch.empty((n, x.size(1)), dtype=dtype, device=x.device)
        row_scale = torch.empty(n, dtype=torch.float32, device=x.device)
        x_scaled = torch.empty_like(xc[:chunk])  # one slice's x times its row scales, reused
        if n > chunk:  # several slices: the weight gradient summed in float32 (cuBLASLt: from the first)
            grad_w = (torch.empty if lt else torch.zeros)(w.shape, dtype=torch.float32, device=x.device)
    fused = need_grad and logits_gemm.available(x.device, dtype, x.size(1), padded)
    if fused:
        wc = wc.contiguous()
    for s in range(0, n, chunk):
        xs = xc[s:s + chunk]
        if fused:  # the logits never reach memory: E comes from the GEMM's epilogue
            logits = logits_gemm.loss_and_grad(xs, wc, targets[s:s + chunk], vocab, inv_n, row_loss[s:s + chunk],
                                               row_scale[s:s + chunk], x_scaled[:xs.size(0)])
        else:
            logits = cublaslt.gemm(xs, wc, None, False, True) if lt else xs @ wc.T
            # Without need_grad, the pointers the kernel does not use are row_loss and xs.
            _ce_rows_kernel[(xs.size(0),)](logits, logits.stride(0), targets[s:s + chunk], row_loss[s:],
                                           row_loss if row_scale is None else row_scale[s:], inv_n,
                                           xs, xs if x_scaled is None else x_scaled, xs.size(1), vocab, padded,
                                           WRITE_GRAD=need_grad, BLOCK=2048,
                                           BLOCK_D=triton.next_power_of_2(xs.size(1)), num_warps=4)
        if need_grad:
            if lt:
                cublaslt.matmul_into(grad_x[s:s + chunk], logits, wc)
            else:
                torch.mm(logits, wc, out=grad_x[s:s + chunk])
            xs = x_scaled[:xs.size(0)]
            if n <= chunk:
                grad_w = cublaslt.gemm(logits, xs, None, True, False) if lt else logits.T @ xs
            elif lt:
                cublaslt.matmul_into(grad_w, logits, xs, trans_a=True, accumulate=s > 0)
            else:
                _addmm_fp32_(grad_w, logits.T, xs)
    loss = row_loss.sum() / n_valid  # every target ignored: 0/0, NaN, as F.cross_entropy gives
    return loss, grad_x, grad_w, row_scale


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``x @ w[:vocab].T`` against ``targets``, never holding all logits.

    The output layer is the largest tensor of the step (tokens x 50,257 floats). Slice by slice,
    the forward computes the logits, their log-sum-exp, the loss *and already the gradients*
    (softmax - one_hot), so the backward only scales them by the incoming scalar: the same
    matmuls as the plain path, with one slice of logits alive instead of all of them in float32.
    Targets: see ``linear_cross_entropy``. On CUDA (with Triton) the per-slice
    softmax/loss/gradient is one fused kernel (``_ce_rows_kernel``) after the logits GEMM, or on
    Hopper the logits GEMM itself (``oelm_core/logits_gemm.py``); the x gradient still has a per-row
    factor to apply (``_ce_forward_cuda``). Elsewhere it is plain torch ops.
    """

    @staticmethod
    def forward(ctx, x, w, targets, vocab: int, chunk: int, w_grad_hook):
        dtype = torch.get_autocast_dtype("cuda") if x.is_cuda and torch.is_autocast_enabled("cuda") else x.dtype
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        ctx.w_grad_hook = w_grad_hook
        if x.is_cuda and triton is not None and dtype != torch.float16:  # (see _ce_rows_kernel)
            loss, grad_x, grad_w, row_scale = _ce_forward_cuda(x, w, targets, vocab, chunk, dtype, need_grad)
            if need_grad:
                ctx.save_for_backward(grad_x, grad_w, row_scale)
                ctx.dtypes = (x.dtype, w.dtype)
            return loss
        if not targets.is_cuda:  # on a GPU the check would wait for it every step
            bad = (targets < -1) | (targets >= vocab)
            if bad.any():
                raise IndexError(f"target id {int(targets[bad][0])} is out of bounds: targets must be "
                                 f"token ids in [0, {vocab}) or -1 (ignored)")
        xc, wc = x.to(dtype), w[:vocab].to(dtype)
        valid = targets != -1
        n_valid = valid.sum()
        grad_x = torch.empty_like(x) if need_grad else None
        grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=x.device)
        for s in range(0, x.size(0), chunk):
            xs, ts, vs = xc[s:s + chunk], targets[s:s + chunk], valid[s:s + chunk]
            logits = (xs @ wc.T).float()
            lse = torch.logsumexp(logits, dim=-1)
            safe_t = ts.clamp(min=0)
            target_logit = logits.gather(1, safe_t[:, None]).squeeze(1)
            loss += ((lse - target_logit) * vs).sum()
            if need_grad:
                g = torch.exp(logits - lse[:, None])
                g[torch.arange(len(ts), device=x.device), safe_t] -= 1.0
                g = (g * (vs[:, None] / n_valid.clamp(min=1))).to(dtype)
                grad_x[s:s + chunk] = (g @ wc).to(x.dtype)
                grad_w[:vocab] += (g.T @ xs).float()
        if need_grad:
            ctx.save_for_backward(grad_x, grad_w, None)
            ctx.dtypes = (x.dtype, w.dtype)
        return loss / n_valid  # every target ignored: 0/0, NaN, as F.cross_entropy gives

    @staticmethod
    @torch.autograd.function.once_differentiable  # the gradients were computed in the forward
    def backward(ctx, grad_loss):
        grad_x, grad_w, row_scale = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        grad_w = _scale_rows(grad_w, grad_loss, dtype=w_dtype)
        if ctx.w_grad_hook is not None:
            ctx.w_grad_hook(grad_w)
            grad_w = None
        return _scale_rows(grad_x, grad_loss, row_scale, dtype=x_dtype), grad_w, None, None, None, None


@torch.compiler.disable
def linear_cross_entropy(x: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, vocab: int,
                         chunk: Optional[int] = None, w_grad_hook: Optional[Callable] = None) -> torch.Tensor:
    """x: (N, d), w: (V_padded, d), targets: (N,) -> scalar mean loss (nats/token).

    ``targets`` are what ``F.cross_entropy(..., ignore_index=-1)`` takes: token ids in
    [0, vocab), or -1 for a position without loss. Any other id raises an IndexError on the CPU;
    on CUDA nothing is checked (a check would wait on the GPU every step): every negative id is
    ignored, and an id >= vocab reads a wrong logit (``_ce_rows_kernel``) or, with the fused logits
    GEMM, gets no loss (it still counts in the mean). The trainer refuses
    token files whose ids exceed the model's vocabulary before it starts. When every target is
    -1 the loss is NaN (0/0) and the gradients 0, as with ``F.cross_entropy``.

    ``chunk``: tokens per slice (> 0), the memory of one slice's logits against launches; None:
    ModelConfig's default ``loss_chunk_tokens``.

    ``w_grad_hook``: if given, w's gradient (float32 or w's dtype, w's shape, already scaled by
    the incoming gradient) is handed to it when the backward pass reaches the loss, its first
    step, instead of flowing back to w through autograd.

    Runs outside torch.compile (a clean graph break: the transformer body is compiled, the loss
    is a few large matmuls and Triton kernels that the compiler would not improve).
    """
    if chunk is None:
        chunk = ModelConfig.loss_chunk_tokens  # the dataclass field's default
    if chunk <= 0:
        raise ValueError(f"linear_cross_entropy: chunk must be a positive number of tokens per "
                         f"slice, got chunk={chunk}")
    return _LinearCrossEntropy.apply(x, w, targets, vocab, chunk, w_grad_hook)


# --------------------------------------------------------------------------------------------
# GPT
# --------------------------------------------------------------------------------------------

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
        self._init_weights(generator)
        self._output_t = TransposedCopy()  # the output weight, for one-row logits on the CPU
        self._tied_grad_hook: Optional[Callable[[torch.Tensor], None]] = None

    def _init_weights(self, generator: torch.Generator) -> None:
        # GPT-2's scheme: N(0, 0.02) everywhere, residual output projections shrunk by
        # 1/sqrt(2 n_layer) so the residual stream's variance does not grow with depth.
        # Q/K (and the Synthesizer logits) were set by their own constructions already.
        residual_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith("proj") else 0.02
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * std)
                    if module.bias is not None:
                        module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                with torch.no_grad():
                    module.weight.copy_(torch.randn(module.weight.shape, generator=generator) * 0.02)
        with torch.no_grad():
            self.wte.weight[self.cfg.vocab_size:].zero_()  # padding rows: never a token, never a logit
            if self.lm_head is not None:
                self.lm_head.weight[self.cfg.vocab_size:].zero_()

    @property
    def output_weight(self) -> torch.Tensor:
        """The output layer's weight, (padded_vocab_size, d_model): ``wte.weight`` when tied, else
        ``lm_head.weight``. Rows from vocab_size on are zero padding and never become a logit."""
        return self.wte.weight if self.lm_head is None else self.lm_head.weight

    def split_tied_gradient(self, hook: Optional[Callable[[torch.Tensor], None]]) -> Optional[nn.Parameter]:
        """Hand the output layer's share of the tied weight's gradient to ``hook`` instead of
        adding it to ``wte.weight.grad``, which then holds the embedding's share alone: nonzero
        only in the rows of the batch's tokens. ``hook(g)`` gets g (padded_vocab, d_model),
        float32, when the backward pass starts (the chunked loss computes it in the forward).

        Why: with tied weights the gradient of the largest tensor of the model is complete only
        after the embedding's backward, the very last step, so a data-parallel all-reduce of it
        could not overlap anything; split, the dense share can be reduced while the backward
        runs, and the rest is a few rows (``oelm_core.train.TiedGradReducer``).
        Returns the tied weight, or None when there is nothing to split (untied output layer, or
        ``loss_impl="full"``); ``hook=None`` joins the shares again.
        """
        if self.lm_head is not None or self.cfg.loss_impl != "chunked":
            return None
        self._tied_grad_hook = hook
        return self.wte.weight

    def hidden(self, idx: torch.Tensor, cache: Optional[KVCache] = None,
               return_attention: bool = False):
        """idx: (B, T) token ids -> final normalised hidden states (B, T, d_model)."""
        t = idx.size(1)
        start = cache.length if cache is not None else 0
        if start + t > self.cfg.block_size:
            if cache is not None:  # cropping the input to block_size would not make room
                raise ValueError(f"the KV cache holds {start} of {self.cfg.block_size} positions, no "
                                 f"room for {t} more tokens; reset it (cache.length = 0, or "
                                 f"model.new_cache()) and prefill again with at most the last "
                                 f"{self.cfg.block_size} tokens")
            raise ValueError(f"sequence of {start + t} tokens exceeds the context of "
                             f"{self.cfg.block_size}; crop the input to the last "
                             f"{self.cfg.block_size} tokens")
        pos = torch.arange(start, start + t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        if self.drop.p > 0:
            x = self.drop(x)
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
        if _one_cpu_row(h):
            # A decoding step: the largest matrix-vector product of the model (medium512: 103 MB,
            # 9.3 ms stored as it is, 3.8 ms transposed, on an AMD EPYC core).
            return (h @ self._output_t(self.output_weight))[..., : self.cfg.vocab_size]
        return F.linear(h, self.output_weight)[..., : self.cfg.vocab_size]

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
                cache: Optional[KVCache] = None):
        """idx: (B, T) int64 token ids in [0, vocab_size). Without ``targets``: logits (B, T,
        vocab_size). With ``targets`` (B, T) int64, the next token of each position or -1 for a
        position without loss: the mean cross-entropy over the others, a 0-dim float32 tensor
        (nats/token). ``cache``: a ``KVCache`` holding ``cache.length`` earlier positions; this
        call's T tokens are their continuation (length + T <= block_size, else ValueError), its
        keys and values are stored and ``cache.length`` grows by T. Without a cache T <= block_size."""
        h = self.hidden(idx, cache)
        if targets is None:
            return self.logits(h)
        if self.cfg.loss_impl == "chunked":
            return linear_cross_entropy(h.flatten(0, 1), self.output_weight, targets.flatten(),
                                        self.cfg.vocab_size, self.cfg.loss_chunk_tokens,
                                        self._tied_grad_hook)
        return F.cross_entropy(self.logits(h).flatten(0, 1).float(), targets.flatten(), ignore_index=-1)

    def decode_step(self, idx: torch.Tensor, pos: torch.Tensor, cache: KVCache,
                    fixed_shape: Optional[bool] = None) -> torch.Tensor:
        """One token per sequence (oelm_core.generate's decoding step).

        idx: (B, 1) token ids at position ``pos`` (a 1-element LongTensor on the model's device,
        < block_size); cache: a ``KVCache`` whose positions < pos hold the earlier tokens.
        Writes this token's keys/values at ``pos``. With ``fixed_shape`` (the default on CUDA,
        for CUDA-graph capture) it attends over the whole block_size cache through one additive
        mask (0 where ``arange(block_size) <= pos``, -inf after), built once for all layers, so
        no shape depends on the position. Otherwise (the default elsewhere; ``pos`` is read on
        the host) it attends over positions <= pos only: a 16-token context then reads 1/32 of
        a 512-position cache.
        Returns logits (B, vocab_size). Neither reads nor updates ``cache.length``.
        """
        x = self.wte(idx) + self.wpe(pos)
        if self.drop.p > 0:
            x = self.drop(x)
        fixed_shape = idx.is_cuda if fixed_shape is None else fixed_shape
        t = self.cfg.block_size if fixed_shape else int(pos) + 1
        future = torch.arange(t, device=idx.device) > pos
        mask = torch.zeros(future.shape, dtype=self.wte.weight.dtype, device=idx.device)
        mask = mask.masked_fill_(future, float("-inf")).view(1, 1, 1, -1)
        for block in self.blocks:
            x = block.decode(x, cache, pos, mask)
        return self.logits(self.ln_f(x))[:, 0]

    @torch.no_grad()
    def forward_with_attention(self, idx: torch.Tensor):
        """The visualisation path: (logits (B, T, V), [attention probabilities (B, H, T, T)] per
        layer); (1, H, T, T) per layer for the Synthesizer (the same for every sequence).

        Computes softmax(QK^T / sqrt(d_head)) explicitly; its output equals the SDPA path's.
        """
        h, maps = self.hidden(idx, return_attention=True)
        return self.logits(h), maps

    def new_cache(self, batch: int = 1) -> KVCache:
        p = self.wte.weight
        return KVCache(self.cfg, batch, p.device, p.dtype)

    def drop_transposed_copies(self) -> None:
        """Forget the transposed weight copies of one-row CPU products (``TransposedCopy``), so
        the next decoding step reads the weights as they are now. Needed only after writes that
        bump no version counter and take no torch.optim step, e.g. ``weight.data.copy_(...)``."""
        for module in self.modules():
            for value in vars(module).values():
                if isinstance(value, TransposedCopy):
                    value.clear()

    def unfreeze_qk(self, layers="all") -> list[nn.Parameter]:
        """Make frozen Q/K of ``layers`` ("all" or indices) trainable; returns the new parameters."""
        chosen = range(self.cfg.n_layer) if layers == "all" else layers
        new = []
        for i in chosen:
            qk = self.blocks[i].attn.qk
            if isinstance(qk, QKProjection) and qk.frozen:
                new.append(qk.unfreeze())
        return new


def build_model(preset: str | ModelConfig | None = None, variant: str | None = None, seed: int = 0,
                **overrides: Any) -> GPT:
    """A GPT of a named preset and variant (see ``oelm_core.VARIANTS``; left out: those
    ``config.model_config`` defaults to), or of a ModelConfig, which is built as it is: any
    variant or overrides with it are an error, not applied. ``seed`` seeds the initial weights."""
    if not isinstance(preset, ModelConfig):
        named = {k: v for k, v in (("preset", preset), ("variant", variant)) if v is not None}
        return GPT(model_config(**named, **overrides), seed=seed)
    if variant is not None or overrides:
        given = ([f"variant={variant!r}"] if variant is not None else []) + sorted(overrides)
        raise TypeError(f"build_model got a ModelConfig together with {', '.join(given)}, which it "
                        f"would not apply: pass a preset name instead (build_model(preset, variant, "
                        f"**overrides)), or change the config first (dataclasses.replace(cfg, ...))")
    return GPT(preset, seed=seed)
