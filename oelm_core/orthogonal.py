"""Random orthogonal matrices for the Q/K projections, and the checks that go with them.

Weights follow nn.Linear's layout: shape (out_features, in_features), applied as ``x @ W.T``.
"Orthogonal" for a rectangular W means semi-orthogonal: for rows <= cols the rows are
orthonormal (W W^T = gain^2 I), for rows > cols the columns are (W^T W = gain^2 I).

Every construction runs in float64 and is cast at the end, so a float32 result is orthogonal
up to float32 rounding (~1e-7) instead of accumulating float32 error inside QR/SVD/solve.
Each random function takes an optional ``torch.Generator`` (CPU) for reproducibility.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

GPT2_STD = 0.02  # GPT-2's initialiser for every Linear, the "normal" baseline

QK_INITS: dict[str, str] = {
    "normal": "GPT-2 default: i.i.d. N(0, 0.02^2) entries; ignores gain",
    "qr": "Haar: QR of a Gaussian with Q's columns multiplied by sign(diag R)",
    "svd": "Haar: U V^T from the SVD of a Gaussian (its polar factor)",
    "householder": "product of n reflections I - 2vv^T with uniform random unit v; not exactly Haar",
    "cayley": "(I - A)(I + A)^-1 of a random skew-symmetric A; orthogonal but not Haar (det +1, no angle pi)",
    "gaussian": "non-orthogonal control: i.i.d. N(0, gain^2/fan_in), the same expected row norm as orthogonal",
    "illcond": "non-orthogonal control: U diag(s) V^T with Haar U, V and singular values log-spaced over a "
    "100:1 range, scaled to the orthogonal's Frobenius norm",
}
# The condition number of "illcond": as far from an isometry as a fixed spectrum goes, at the
# orthogonal's scale, where a square Gaussian's (about 2,400 at d = 512) mixes scale and spectrum.
ILL_CONDITION = 100.0


def _randn(*shape: int, generator: torch.Generator | None) -> Tensor:
    return torch.randn(*shape, generator=generator, dtype=torch.float64)


# Each builder returns an (n, m) float64 matrix with orthonormal columns, n >= m.


def _qr(n: int, m: int, generator: torch.Generator | None) -> Tensor:
    q, r = torch.linalg.qr(_randn(n, m, generator=generator))
    # LAPACK fixes the signs of R's diagonal, which biases Q (e.g. Q[0,0] < 0 always); making
    # diag(R) positive makes the factorisation unique and Q Haar-distributed (Mezzadri 2007).
    d = torch.sign(torch.diagonal(r))
    return q * torch.where(d == 0, torch.ones_like(d), d)


def _svd(n: int, m: int, generator: torch.Generator | None) -> Tensor:
    # The polar factor of a Gaussian inherits its rotation invariance, so it is Haar too.
    u, _, vh = torch.linalg.svd(_randn(n, m, generator=generator), full_matrices=False)
    return u @ vh


def _householder(n: int, m: int, generator: torch.Generator | None) -> Tensor:
    # n random reflections give an exactly orthogonal matrix, but random reflections need about
    # (n/2) log n factors to mix to Haar (Porod 1996), so this is a distinct, cheaper ensemble.
    v = _randn(n, n, generator=generator)
    v = v / v.norm(dim=1, keepdim=True)
    w = torch.eye(n, m, dtype=torch.float64)
    for vi in v:  # apply the reflections to the first m columns of I only: O(n^2 m), not O(n^3)
        w -= 2.0 * torch.outer(vi, vi @ w)
    return w


def _cayley(n: int, m: int, generator: torch.Generator | None) -> Tensor:
    # Entries of A have variance 1/n, so A's eigenvalues i*t lie in t in [-2, 2] and the result's
    # eigen-angles 2 arctan(t) spread over about +-127 degrees; they never reach pi and det is
    # always +1, which is why Cayley alone is not Haar.
    g = _randn(n, n, generator=generator)
    a = (g - g.T) / math.sqrt(2 * n)
    eye = torch.eye(n, dtype=torch.float64)
    # (I - A) and (I + A)^-1 commute, so one solve gives the product.
    return torch.linalg.solve(eye + a, (eye - a)[:, :m])


_BUILDERS: dict[str, Callable[[int, int, torch.Generator | None], Tensor]] = {
    "qr": _qr,
    "svd": _svd,
    "householder": _householder,
    "cayley": _cayley,
}
ORTHOGONAL_METHODS: tuple[str, ...] = tuple(_BUILDERS)


def orthogonal(
    rows: int,
    cols: int,
    method: str = "qr",
    gain: float = 1.0,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """A (rows, cols) matrix with orthonormal rows (rows <= cols) or columns (rows > cols), times gain."""
    if method not in _BUILDERS:
        raise ValueError(f"unknown orthogonal method {method!r}; valid: {', '.join(ORTHOGONAL_METHODS)}")
    w = _BUILDERS[method](max(rows, cols), min(rows, cols), generator)
    if rows < cols:
        w = w.T
    return (gain * w).to(dtype).contiguous()


def gaussian(
    rows: int,
    cols: int,
    gain: float = 1.0,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """(rows, cols) with i.i.d. N(0, gain^2 / cols) entries: E||row||^2 = gain^2, as for orthogonal."""
    return (_randn(rows, cols, generator=generator) * (gain / math.sqrt(cols))).to(dtype)


def ill_conditioned(
    rows: int,
    cols: int,
    gain: float = 1.0,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    condition: float = ILL_CONDITION,
) -> Tensor:
    """(rows, cols) = U diag(s) V^T with U, V Haar (orthonormal columns) and min(rows, cols) singular
    values log-spaced from 1 down to 1 / ``condition``, scaled so that ||W||_F equals an orthogonal
    matrix's of the same gain, gain * sqrt(min(rows, cols)): the same scale, another spectrum."""
    k = min(rows, cols)
    u, v = _qr(rows, k, generator), _qr(cols, k, generator)
    s = torch.logspace(0, -math.log10(condition), k, dtype=torch.float64)
    s *= gain * math.sqrt(k) / s.norm()
    return ((u * s) @ v.T).to(dtype).contiguous()


def init_qk(
    rows: int,
    cols: int,
    method: str,
    gain: float = 1.0,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """A (rows, cols) W_q or W_k initialised by one of QK_INITS ("normal" ignores gain)."""
    if method == "normal":
        return (_randn(rows, cols, generator=generator) * GPT2_STD).to(dtype)
    if method == "gaussian":
        return gaussian(rows, cols, gain, generator, dtype)
    if method == "illcond":
        return ill_conditioned(rows, cols, gain, generator, dtype)
    if method in _BUILDERS:
        return orthogonal(rows, cols, method, gain, generator, dtype)
    raise ValueError(f"unknown qk_init {method!r}; valid: {', '.join(QK_INITS)}")


# --------------------------------------------------------------------------------------------
# Checks: all computed in float64, all return plain Python floats
# --------------------------------------------------------------------------------------------


def orthogonality_error(W: Tensor, gain: float = 1.0) -> float:
    """Spectral norm of W W^T / gain^2 - I (W^T W when rows > cols): 0 for exact (semi-)orthogonal.

    It is the largest |sigma_i^2 / gain^2 - 1| over W's singular values sigma_i, so it bounds
    how far any direction's squared length is stretched; a Gaussian square W gives about 3.
    """
    w = W.detach().double()
    gram = w.T @ w if w.shape[0] > w.shape[1] else w @ w.T
    err = gram / gain**2 - torch.eye(gram.shape[0], dtype=torch.float64)
    return torch.linalg.eigvalsh(err).abs().max().item()


def isometry_error(W: Tensor, x: Tensor) -> float:
    """max over the rows x_i of x (n, d) of | ||W x_i|| / ||x_i|| - 1 |, for W of shape (out, d).

    Meant for square or column-orthonormal W (out >= d), which preserve every length. A
    row-orthonormal k x d projection with k < d is no isometry: it keeps only ~sqrt(k/d) of a
    length (see jl_distortion).
    """
    x = x.detach().double()
    ratio = (x @ W.detach().double().T).norm(dim=1) / x.norm(dim=1)
    return (ratio - 1).abs().max().item()


def condition_number(W: Tensor) -> float:
    """Largest over smallest singular value of W; inf when W is rank deficient, the zero matrix
    included.

    Rank deficient means numerically, with numpy's ``matrix_rank`` tolerance: the smallest
    singular value is at most eps * largest * max(W.shape), eps of W's dtype. Below that it is
    rounding noise, and the ratio would be an arbitrary huge number (or 0/0).
    """
    eps = torch.finfo(W.dtype if W.is_floating_point() else torch.float64).eps
    s = torch.linalg.svdvals(W.detach().double())
    if s.min() <= eps * s.max() * max(W.shape):
        return math.inf
    return (s.max() / s.min()).item()


def jl_distortion(P: Tensor, X: Tensor, scale: float | None = None) -> dict[str, float]:
    """Pairwise-distance distortion of the projection x -> scale * P x over the rows of X.

    P: (k, d), X: (n, d) with distinct rows. For every pair i < j the distortion is
    | scale ||P(x_i - x_j)|| / ||x_i - x_j|| - 1 |; returns its "max", "mean" and "std".
    The default scale sqrt(d/k) undoes the expected shrinkage: E||P x||^2 = (k/d) ||x||^2 both
    for orthonormal rows (a random k-dimensional subspace) and for i.i.d. N(0, 1/d) entries.
    """
    k, d = P.shape
    scale = math.sqrt(d / k) if scale is None else scale
    X = X.detach().double()
    # pdist lists the pairs i < j in the same order for both point sets.
    ratio = scale * torch.pdist(X @ P.detach().double().T) / torch.pdist(X)
    dist = (ratio - 1).abs()
    return {"max": dist.max().item(), "mean": dist.mean().item(), "std": dist.std().item()}


def random_projection(
    k: int, d: int, method: str = "qr", generator: torch.Generator | None = None, dtype: torch.dtype = torch.float32
) -> Tensor:
    """A (k, d) Johnson-Lindenstrauss projection: orthonormal rows (any orthogonal method, k <= d)
    or, for method "gaussian", i.i.d. N(0, 1/d) entries."""
    if k > d:
        raise ValueError(
            f"random_projection maps d dimensions to k <= d, got k={k} > d={d}; "
            f"orthogonal(k, d) gives a tall matrix with orthonormal columns instead"
        )
    if method == "gaussian":
        return gaussian(k, d, 1.0, generator, dtype)
    if method in _BUILDERS:
        return orthogonal(k, d, method, 1.0, generator, dtype)
    raise ValueError(f"unknown projection {method!r}; valid: gaussian, {', '.join(ORTHOGONAL_METHODS)}")


def attention_logit_stats(W_q: Tensor, W_k: Tensor, x: Tensor, n_head: int) -> dict[str, float]:
    """Statistics of the attention logits q.k / sqrt(d_head) that W_q, W_k give on the tokens x.

    W_q, W_k: (d, d) applied as x @ W.T; x: (n, d) treated as n keys and n queries (no causal
    mask). Returns "std": the std of all n_head * n * n scaled logits, and "entropy": the mean,
    over heads and queries, of the softmax-over-keys entropy in nats (log n is uniform attention).
    """
    x = x.detach().double()
    n = x.shape[0]
    q = (x @ W_q.detach().double().T).view(n, n_head, -1).transpose(0, 1)  # (n_head, n, d_head)
    k = (x @ W_k.detach().double().T).view(n, n_head, -1).transpose(0, 1)
    logits = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])  # (n_head, n_query, n_key)
    logp = torch.log_softmax(logits, dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return {"std": logits.std().item(), "entropy": entropy.mean().item()}
