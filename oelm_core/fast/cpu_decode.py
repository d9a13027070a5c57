"""Transposed weight copies for one-row products on the CPU: a decoding step's q/k/v, the MLP's
first layer and the logits.

Why: a decoding step on the CPU is a chain of matrix-vector products whose speed is how fast the
weights stream from memory, and MKL streams ``x @ W.T`` with W stored (out, in) as
``nn.Linear`` keeps it markedly slower than the same weight stored transposed (in, out) once
out >= 1,024 (benchmarks/README.md has the measured gain). So the fast decoder on the CPU keeps
one transposed copy of [W_q; W_k; W_v] per layer, of W_fc per layer and of the output weight,
at the cost of a second copy of those weights in memory. The MLP's second layer and the
attention projection keep their layout: stored (d_model, d_ff) and (d_model, d_model) they gain
nothing.

A copy is never stale: it is remade when one of its weights is another tensor, moved, or changed
in place (its version counter: ``load_state_dict``, ``mul_``), and after every optimizer step
(``_optimizer_steps``: fused AdamW writes the weights without bumping their version counters).
Only a write that none of these sees (through ``weight.data``, or by an optimizer outside
torch.optim) must be followed by ``oelm_core.fast.decode.forget_decoder(model)``.

Importing this module registers the optimizer-step counter, process-wide; nothing else imports it
until a decoder on the CPU uses copies (a copy only exists after that import, so none misses a
step).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from oelm_core.model import GPT, MLP, CausalSelfAttention, QKProjection

# Optimizer steps taken in this process, by any torch.optim optimizer: part of every copy's key.
_optimizer_steps = 0


def _count_optimizer_step(optimizer, args, kwargs) -> None:
    global _optimizer_steps
    _optimizer_steps += 1


register_optimizer_step_post_hook(_count_optimizer_step)


class TransposedCopy:
    """Weights (out_i, in) concatenated along out and stored transposed: one contiguous
    (in, sum of out_i) tensor, remade whenever the weights it was made from are not the same
    tensors any more, moved, or were changed in place, and after every optimizer step."""

    def __init__(self):
        self._key: Optional[tuple] = None
        self._refs: tuple = ()
        self._value: Optional[torch.Tensor] = None

    def __call__(self, *weights: torch.Tensor) -> torch.Tensor:
        if any(w.is_inference() for w in weights):
            # Weights made under torch.inference_mode have no version counter, and inside it they
            # can be written in place (load_state_dict) unseen: keep no copy, read them as they are.
            return (weights[0] if len(weights) == 1 else torch.cat(weights)).t()
        key = (_optimizer_steps, tuple((w.data_ptr(), w._version, w.dtype, w.shape) for w in weights))
        # The tensors themselves too (weakly): a new weight can take a freed one's memory, and
        # both start at version 0.
        same = len(self._refs) == len(weights) and all(r() is w for r, w in zip(self._refs, weights))
        if key != self._key or not same:
            self._value = torch.cat([w.detach() for w in weights]).t().contiguous()
            self._key, self._refs = key, tuple(weakref.ref(w) for w in weights)
        return self._value

    def clear(self) -> None:
        """Drop the copy (and its memory); the next call makes it again."""
        self._key, self._refs, self._value = None, (), None


class CPUCopies:
    """The transposed copies one decoder keeps for ``model``'s one-row products: per layer
    [W_q; W_k; W_v] (plain ``QKProjection`` layers only) and W_fc, and the output weight. Each is
    made at its first use and kept while its weights stay the same (``TransposedCopy``).
    Every product here gives the plain one's numbers (float rounding aside)."""

    def __init__(self, model: GPT):
        n = model.cfg.n_layer
        self._qkv = [TransposedCopy() for _ in range(n)]
        self._fc = [TransposedCopy() for _ in range(n)]
        self._out = TransposedCopy()

    @staticmethod
    def applies(x: torch.Tensor) -> bool:
        """Whether ``x`` is a decoding step's activation on the CPU: one row, no gradient taken."""
        return x.device.type == "cpu" and x.numel() == x.size(-1) and not torch.is_grad_enabled()

    def qkv(self, attn: CausalSelfAttention, x: torch.Tensor):
        """x (1, 1, d_model) -> q, k, v (1, 1, d_model) each, or None for a layer whose Q/K is
        no plain ``QKProjection`` (Synthesizer, POET): the caller computes those as usual."""
        if not isinstance(attn.qk, QKProjection):
            return None
        q, k, v = (x @ self._qkv[attn.layer](attn.qk.weight, attn.v.weight)).split(attn.cfg.d_model, dim=-1)
        return q, k, v if attn.v.bias is None else v + attn.v.bias

    def fc(self, mlp: MLP, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x (1, 1, d_model) -> mlp.fc(x) (1, 1, d_ff)."""
        y = x @ self._fc[layer](mlp.fc.weight)
        return y if mlp.fc.bias is None else y + mlp.fc.bias

    def logits(self, model: GPT, h: torch.Tensor) -> torch.Tensor:
        """h (..., d_model) of one row -> ``model.logits(h)`` (..., vocab_size)."""
        return (h @ self._out(model.output_weight))[..., : model.cfg.vocab_size]

    def clear(self) -> None:
        for copy in [*self._qkv, *self._fc, self._out]:
            copy.clear()
