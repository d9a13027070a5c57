# %% [markdown]
# # 01 · Theory: why orthogonal Q/K?
#
# OELM starts the attention projections W_q and W_k as random orthogonal matrices and may freeze
# them. This notebook checks the properties that motivate it, numerically, and fails when one
# does not hold:
#
# 1. an orthogonal W is an **isometry** (it preserves every norm), a Gaussian one is not;
# 2. the four constructions (QR, SVD, Householder, Cayley) are orthogonal to float32 rounding, at
#    different cost;
# 3. random orthogonal projections preserve pairwise distances (Johnson–Lindenstrauss) at least
#    as well as Gaussian ones;
# 4. at initialisation orthogonal Q/K give unit-scale attention logits and attention less uniform
#    than GPT-2's N(0, 0.02), whose near-zero logits give almost uniform attention; still far
#    from peaked (d = 512, 128 tokens: entropy 4.37 nats, uniform 4.85).

# %% tags=["parameters"]
d = 512  # width of the square Q/K matrices
n_head = 8
n_vectors = 256  # random vectors for the isometry check
n_tokens = 128  # tokens for the logit statistics
jl_points = 64  # points whose pairwise distances are projected
jl_trials = 3
construction_repeats = 3
seed = 0
fig_dir = "runs/notebooks/figures"  # a relative path is taken from the repository root

# %%
# Paths in the parameters (parameter files, out_dir, the data cache) are taken from the repository
# root, as on the command line: a kernel that JupyterLab starts in notebooks/ moves there.
import os
import sys
from pathlib import Path

if Path.cwd().name == "notebooks" and (Path.cwd().parent / "oelm_core").is_dir():
    os.chdir(Path.cwd().parent)
if (Path.cwd() / "oelm_core").is_dir() and str(Path.cwd()) not in sys.path:
    sys.path.insert(0, str(Path.cwd()))  # this checkout's oelm_core, installed or not
from IPython.display import Markdown, display

# %matplotlib inline
from oelm_core.notebooks import check_kernel_parameters

check_kernel_parameters("01_theory", globals())  # what papermill injected, too
from oelm_core import analysis as A
from oelm_core.orthogonal import ORTHOGONAL_METHODS

fig_dir = A.REPO / fig_dir  # an absolute path stays as it is

# %% [markdown]
# ## 1 · Isometry, orthogonality error and condition number
#
# `isometry_error` is max | ‖Wx‖/‖x‖ − 1 | over random x; the GPT-2 normal init is rescaled to
# unit row norm so only its shape is judged. Orthogonal matrices have every singular value equal
# to 1 (condition number 1); Gaussian ones spread them over [0, 2] (Marchenko–Pastur).

# %%
iso = A.isometry_table(d, n_vectors, seed=seed)
display(Markdown(A.markdown_table(iso)))
for r in iso:
    if r['method'] in ORTHOGONAL_METHODS:
        assert r['isometry_error'] < 1e-9 and r['orthogonality_error'] < 1e-9, r
        assert abs(r['condition_number'] - 1) < 1e-6, r
    else:  # normal, gaussian: not isometries
        assert r['orthogonality_error'] > 0.5 and r['condition_number'] > 10, r
        assert r['isometry_error'] > 1e-3, r

# %% [markdown]
# ## 2 · The constructions: float32 error and time

# %%
cons = A.construction_table(d, repeats=construction_repeats, seed=seed)
display(Markdown(A.markdown_table(cons)))
assert all(r['orthogonality_error_fp32'] < 1e-5 for r in cons), cons

# %% [markdown]
# ## 3 · Johnson–Lindenstrauss distortion vs target dimension
#
# Project `jl_points` points from d to k dimensions (scaled by √(d/k)) and measure how much their
# pairwise distances change. Both shrink like 1/√k; orthonormal rows do better as k → d because a
# k-dimensional orthogonal slice loses no length within its subspace. Checked: each method
# distorts less at k = d/2 than at k = 8, and there orthonormal rows less than Gaussian ones; from
# 32 points and 64 point-projections (`jl_points` × `jl_trials`), where the differences exceed the
# noise of their estimates. With fewer they are shown, not judged.

# %%
jl = A.jl_curve(d, jl_points, methods=('qr', 'gaussian'), trials=jl_trials, seed=seed)
display(A.jl_figure(jl, fig_dir / 'jl_distortion.png'))
display(Markdown(A.markdown_table(jl)))
verdict = A.jl_checks(jl, jl_points, jl_trials)
print(verdict['why'])
assert verdict['holds'] is not False, verdict

# %% [markdown]
# ## 4 · Attention logits at initialisation
#
# Logit std and mean softmax entropy (nats; `max_entropy` = log n is uniform attention) on
# unit-variance tokens.

# %%
logits = A.logit_stats_table(d, n_head, n_tokens, seed=seed)
display(Markdown(A.markdown_table(logits)))
L = {r['init']: r for r in logits}
assert 0.5 < L['qr']['logit_std'] < 2.0, L['qr']
assert L['normal']['logit_std'] < 0.5, L['normal']
assert L['normal']['max_entropy'] - L['normal']['entropy'] < 0.1  # nearly uniform
assert L['qr']['entropy'] < L['normal']['entropy']

# %% [markdown]
# All checks held: orthogonal Q/K are exact isometries, cheap to build, preserve geometry and
# start attention at a useful logit scale.
