"""POET-style learnable orthogonal Q/K (Qiu et al. 2025, "Reparameterized LLM Training via
Orthogonal Equivalence Transformation", arXiv 2506.08001).

Each of W_q and W_k is reparameterised as

    W = R W0 P

with W0 the layer's random orthogonal matrix (times ``qk_gain``), kept as a frozen buffer, and
R, P learned orthogonal matrices. An orthogonal equivalence transformation keeps every singular
value of W0, so W stays an exact multiple of an orthogonal matrix (up to the approximation below)
however long it trains: the spectrum OELM-Freeze fixes by freezing, POET fixes by construction
while the directions learn.

R and P are block-stochastic (the paper's BS-POET): block-diagonal with ``b = poet_block_size``
blocks, conjugated by a random permutation Pi (stored as index buffers):

    R = Pi^T diag(G_1, ..., G_{d/b}) Pi

Each block G is the Cayley transform of a skew-symmetric Q, approximated by a truncated Neumann
series (the paper's Cayley-Neumann parameterisation, no matrix inverse in the training graph):

    (I + Q)(I - Q)^{-1}  ~  (I + Q)(I + Q + Q^2 + ... + Q^n),   n = poet_neumann_terms

The truncated product equals (I + Q)(I - Q)^{-1}(I - Q^{n+1}), a polynomial in the normal matrix
Q, so on an eigenvalue i*theta of Q its singular value is |1 - (i theta)^{n+1}|: 1 - theta^{n+1}
or 1 + theta^{n+1} for odd n (n = 1: first-order error theta^2, the divergence the paper reports),
but sqrt(1 + theta^{2n+2}) ~ 1 + theta^{2n+2}/2 for even n. So n = 5 (the paper's choice) and
n = 2 both err by ~theta^6, and n = 4 by ~theta^10/2. With 5 terms, 50 AdamW steps at lr 1e-3
leave the singular values within ~2e-5 of the gain; 1 term drifts by ~4e-2 (tests/test_poet.py).

Trainable parameters are only the strictly upper-triangular entries of every Q: per matrix
(d/b) * b(b-1)/2 numbers, stored as ``skew_*`` tensors of shape (d/b, b(b-1)/2); four matrices
(R and P for each of W_q and W_k) per layer. W0 is a float buffer and counts as frozen.

Merge-then-reinitialise: every ``poet_merge_every`` optimizer steps, ``after_optimizer_step``
folds R and P into W0 (W0 <- R W0 P), resets every Q to 0 (R = P = I) and re-draws the
permutations, so that successive intervals rotate different index pairs and Q stays small.
The merge uses the *exact* Cayley transform of the current Q (a b x b solve per block), not the
Neumann approximation: W0 therefore stays exactly orthogonal across any number of merges and
the truncation error never accumulates; the weight jumps by only the truncation error
O(||Q||^{n+1}) at a merge.

Optimizer state at a merge: the skew parameters are zeroed in place and returned by
``after_optimizer_step``; the trainer then zeroes their AdamW moments (``oelm_core.step.
restart_optimizer_state``), which referred to the previous interval's coordinates that the new
permutations re-assign. A trainer that ignores the returned list still trains correctly; the
stale momentum decays with beta1 within ~10-20 steps.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

# The four orthogonal factors of one layer: (which weight, which side).
_FACTORS = ("q_left", "q_right", "k_left", "k_right")


def skew_from_upper(upper: torch.Tensor, b: int) -> torch.Tensor:
    """(n, b(b-1)/2) strictly-upper-triangular entries -> (n, b, b) skew-symmetric matrices."""
    rows, cols = torch.triu_indices(b, b, offset=1, device=upper.device)
    q = upper.new_zeros(upper.shape[0], b, b)
    q[:, rows, cols] = upper
    return q - q.transpose(1, 2)


def cayley_neumann(q: torch.Tensor, terms: int) -> torch.Tensor:
    """(I + Q)(I + Q + ... + Q^terms) for a batch of (b, b) Q: the Cayley transform, truncated."""
    eye = torch.eye(q.shape[-1], dtype=q.dtype, device=q.device).expand_as(q)
    series, power = eye, eye
    for _ in range(terms):
        power = power @ q
        series = series + power
    return (eye + q) @ series


def cayley_exact(q: torch.Tensor) -> torch.Tensor:
    """(I + Q)(I - Q)^{-1}, exactly orthogonal for skew-symmetric Q (computed in float64)."""
    q64 = q.double()
    eye = torch.eye(q.shape[-1], dtype=torch.float64, device=q.device).expand_as(q64)
    # (I + Q) and (I - Q)^{-1} commute, so (I - Q)^{-1}(I + Q) is the same matrix: one solve.
    return torch.linalg.solve(eye - q64, eye + q64)


def apply_block_rotation(blocks: torch.Tensor, perm: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """R @ m for R = Pi^T diag(blocks) Pi, where (Pi x) = x[perm]; m: (d, c), blocks: (d/b, b, b)."""
    n, b, _ = blocks.shape
    rotated = torch.bmm(blocks.to(m.dtype), m[perm].reshape(n, b, -1)).reshape(m.shape)
    out = torch.empty_like(rotated)
    out[perm] = rotated  # Pi^T: undo the permutation
    return out


class POETProjection(nn.Module):
    """W_q and W_k of one layer as R W0 P (see the module docstring), stacked (2 d, d) like
    ``model.QKProjection``: ``forward(x) = x @ weight.T`` with ``weight = [W_q; W_k]``."""

    def __init__(self, w_q: torch.Tensor, w_k: torch.Tensor, cfg, generator: Optional[torch.Generator] = None):
        super().__init__()
        d = w_q.shape[0]
        if w_q.shape != (d, d) or w_k.shape != (d, d):
            raise ValueError(f"POET needs square W_q, W_k; got {tuple(w_q.shape)} and {tuple(w_k.shape)}")
        b = int(cfg.poet_block_size)
        if b <= 0 or d % b:
            raise ValueError(f"poet_block_size={b} must be a positive divisor of d_model={d}")
        self.d, self.b, self.n_blocks = d, b, d // b
        self.neumann_terms = int(cfg.poet_neumann_terms)
        self.merge_every = int(cfg.poet_merge_every)
        self.register_buffer("w0_q", w_q.detach().clone().float())
        self.register_buffer("w0_k", w_k.detach().clone().float())
        n_upper = b * (b - 1) // 2
        for name in _FACTORS:
            self.register_parameter(f"skew_{name}", nn.Parameter(torch.zeros(self.n_blocks, n_upper)))
        # Permutations are re-drawn at every merge from (seed, merge count), so every DDP rank and
        # a resumed run (both buffers travel in the state_dict) draw the same ones.
        seed = int(torch.randint(0, 2**62, (1,), generator=generator).item())
        self.register_buffer("poet_seed", torch.tensor(seed, dtype=torch.int64))
        self.register_buffer("poet_merges", torch.tensor(0, dtype=torch.int64))
        for name in _FACTORS:
            self.register_buffer(f"perm_{name}", torch.empty(d, dtype=torch.int64))
        self._draw_permutations()

    def skew_parameters(self) -> list[nn.Parameter]:
        return [getattr(self, f"skew_{name}") for name in _FACTORS]

    def _rotations(self, exact: bool = False) -> dict[str, torch.Tensor]:
        out = {}
        for name in _FACTORS:
            q = skew_from_upper(getattr(self, f"skew_{name}").float(), self.b)
            out[name] = cayley_exact(q) if exact else cayley_neumann(q, self.neumann_terms)
        return out

    def _compose(self, rotations: dict[str, torch.Tensor], dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        ws = []
        for which in ("q", "k"):
            w = getattr(self, f"w0_{which}").to(dtype or torch.float32)
            w = apply_block_rotation(rotations[f"{which}_left"], getattr(self, f"perm_{which}_left"), w)
            # W P with P = Pi^T diag(G)^T Pi... parameterised through P^T = Pi^T diag(G) Pi.
            w = apply_block_rotation(rotations[f"{which}_right"], getattr(self, f"perm_{which}_right"), w.T).T
            ws.append(w)
        return torch.cat(ws, dim=0)

    @property
    def weight(self) -> torch.Tensor:
        """The effective stacked (2 d, d) weight [R_q W0_q P_q; R_k W0_k P_k], float32."""
        # Built in float32 even under bf16 autocast: the Neumann series needs the precision;
        # F.linear casts the finished weight like any other.
        with torch.autocast(device_type=self.w0_q.device.type, enabled=False):
            return self._compose(self._rotations())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    # --- merge-then-reinitialise ----------------------------------------------------------------
    def _draw_permutations(self) -> None:
        g = torch.Generator().manual_seed(int(self.poet_seed) + 1_000_003 * int(self.poet_merges))
        for name in _FACTORS:
            getattr(self, f"perm_{name}").copy_(torch.randperm(self.d, generator=g))

    @torch.no_grad()
    def merge(self) -> None:
        """W0 <- R W0 P with the exact Cayley transforms; Q <- 0; new permutations."""
        merged = self._compose(self._rotations(exact=True), dtype=torch.float64)
        self.w0_q.copy_(merged[: self.d])
        self.w0_k.copy_(merged[self.d :])
        for p in self.skew_parameters():
            p.zero_()
        self.poet_merges += 1
        self._draw_permutations()

    def after_optimizer_step(self, step: int) -> list[nn.Parameter]:
        """Called by the trainer after every optimizer step (``step`` = steps taken so far).
        Returns the parameters a merge restarted (their optimizer moments should restart too)."""
        if self.merge_every > 0 and step > 0 and step % self.merge_every == 0:
            self.merge()
            return list(self.skew_parameters())
        return []

    def extra_repr(self) -> str:
        return (
            f"d={self.d}, block={self.b}, blocks={self.n_blocks}, neumann_terms={self.neumann_terms}, "
            f"merge_every={self.merge_every}"
        )


def poet_modules(model: nn.Module) -> list[POETProjection]:
    return [m for m in model.modules() if isinstance(m, POETProjection)]


def spectrum_error(module: POETProjection, gain: float = 1.0) -> float:
    """max |sigma / gain - 1| over the singular values of the effective W_q and W_k (float64)."""
    with torch.no_grad():
        w = module.weight.double()
    s = torch.cat([torch.linalg.svdvals(w[: module.d]), torch.linalg.svdvals(w[module.d :])])
    return (s / gain - 1).abs().max().item()
