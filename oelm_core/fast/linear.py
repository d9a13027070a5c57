"""The body's GEMMs of a CUDA training step through cuBLASLt (``oelm_core.fast.cublaslt``).

``install(model)`` swaps the classes of the attention (``LtAttention``: its Q/K/V product), its
Q/K projection, V and output projection (``LtQKProjection``, ``LtLinear``) and the MLP (``LtMLP``)
for subclasses whose forward runs each GEMM (forward, input and weight gradient) with its timed
cuBLASLt algorithm, and the MLP's GELU in fc's GEMM epilogue. Parameters, buffers and state dict
are untouched (a class swap). Outside a CUDA training step under low-precision autocast (CPU,
float32, evaluation, decoding) and where cuBLASLt does not run, the subclasses compute exactly
what the reference modules do, with the same ops.

Switch: ``train.cublaslt`` (``oelm_core.fast.apply`` installs it on CUDA). Gain, and the comparison
with torch.compile's own GEMM autotuning: benchmarks/README.md.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from oelm_core.fast import cublaslt
from oelm_core.model import MLP, CausalSelfAttention, QKProjection


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
        return cublaslt.gemm(h, w_proj, b_proj, False, True)

    @staticmethod
    def backward(ctx, grad):
        x, w_fc, w_proj, h, pre = ctx.saved_tensors
        need_x, need_w_fc, need_b_fc, need_w_proj, need_b_proj = ctx.needs_input_grad
        grad = grad.contiguous()
        # GELU' as torch computes it (compiled, with fc's bias sum): cuBLASLt's DGELU epilogue is
        # slower here (``oelm_core.fast.cublaslt``), and so was a Triton pass of our own for both.
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


class LtLinear(nn.Linear):
    """nn.Linear through ``linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class LtQKProjection(QKProjection):
    """A Q/K projection through ``linear`` (frozen ones: no weight gradient computed)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


class LtAttention(CausalSelfAttention):
    """Attention whose one Q/K/V product (trainable Q/K) goes through ``linear``; the others go
    through the swapped Q/K and V modules."""

    def qkv(self, x: torch.Tensor):
        if (isinstance(self.qk, QKProjection) and not self.qk.frozen and self.v.bias is None
                and torch.is_grad_enabled()):
            d = self.cfg.d_model
            return linear(x, torch.cat([self.qk.weight, self.v.weight])).split(d, dim=-1)
        return super().qkv(x)


class LtMLP(MLP):
    """The MLP as one ``_LtGeluMLP`` (GELU in fc's epilogue) in a CUDA training step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _lt_dtype(x)
        if dtype is None:
            return super().forward(x)
        fc, proj = self.fc, self.proj
        y = _LtGeluMLP.apply(x.reshape(-1, x.size(-1)).to(dtype), fc.weight.to(dtype), _as(fc.bias, dtype),
                             proj.weight.to(dtype), _as(proj.bias, dtype)).view(*x.shape[:-1], -1)
        return self.dropout(y)


_SWAPS = {QKProjection: LtQKProjection, CausalSelfAttention: LtAttention, MLP: LtMLP}


def install(model: nn.Module) -> nn.Module:
    """Swap the classes of a GPT's attention, Q/K, V, projections and MLPs for their cuBLASLt
    versions, in place (POET's Q/K keeps its own class); returns the model."""
    for block in model.blocks:
        attn, mlp = block.attn, block.mlp
        for module in (attn, attn.qk, mlp):
            if type(module) in _SWAPS:
                module.__class__ = _SWAPS[type(module)]
        for module in (attn.v, attn.proj):
            if type(module) is nn.Linear:
                module.__class__ = LtLinear
    return model
