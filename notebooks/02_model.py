# %% [markdown]
# # 02 · The models: groups, variants, parameters and FLOPs
#
# The study compares three groups — **GPT-Base** (standard Q/K), **OELM-NoFreeze** (orthogonal
# Q/K, trained) and **OELM-Freeze** (orthogonal Q/K, frozen) — plus the ablation variants
# registered in `oelm_core.VARIANTS`.

# %% tags=["parameters"]
preset = "medium512"  # the shape whose parameters are tabulated
grad_check_preset = "tiny"  # the small model of the gradient-flow check
all_variants = True  # tabulate the ablation variants too

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

check_kernel_parameters("02_model", globals())  # what papermill injected, too
import oelm_core
from oelm_core import analysis as A

# %% [markdown]
# ## Variants

# %%
display(Markdown(A.markdown_table([{'variant': k, 'description': v} for k, v in oelm_core.VARIANTS.items()])))

# %% [markdown]
# ## Exact parameter counts
#
# Frozen Q/K are buffers, not parameters: 2 · n_layer · d_model² weights. At medium512 that is
# 3,145,728 of 44,896,768, i.e. **7.0%** of the trainable parameters — not the ~15% the original
# report claimed (the 25.7M-parameter embedding dominates).

# %%
names = list(oelm_core.VARIANTS) if all_variants else list(A.GROUP_LABELS)
params = A.parameter_table(preset, names)
display(Markdown(A.markdown_table(params)))
P = {r['variant']: r for r in params}
if preset == 'medium512':
    assert P['gpt_base']['trainable'] == 44_896_768 and P['gpt_base']['frozen'] == 0
    assert P['oelm_nofreeze']['trainable'] == 44_896_768
    assert P['oelm_freeze']['trainable'] == 41_751_040 and P['oelm_freeze']['frozen'] == 3_145_728
    assert abs(P['oelm_freeze']['trainable_reduction'] - 0.0700) < 0.0005
assert P['oelm_freeze']['total'] == P['gpt_base']['total']

# %% [markdown]
# ## What freezing saves: FLOPs per token and optimizer memory
#
# A frozen weight still costs its forward and input-gradient matmuls; only the weight gradient
# (one third of its FLOPs) and its AdamW state disappear.

# %%
flops = A.flops_table(preset, names)
display(Markdown(A.markdown_table(flops)))
F = {r['variant']: r for r in flops}
assert F['oelm_freeze']['forward_flops'] == F['gpt_base']['forward_flops']
assert 0 < F['oelm_freeze']['frozen_saving_pct'] < 10
assert F['oelm_freeze']['state_saving_mb'] > 0

# %% [markdown]
# ## Gradient flow
#
# One forward/backward and optimizer step on a small OELM-Freeze model: the frozen Q/K receive no
# gradient and do not change; every trainable parameter gets one.

# %%
flow = A.gradient_flow_check(grad_check_preset, 'oelm_freeze')
flow

# %%
assert flow['frozen_qk'] and flow['frozen_without_grad'] and flow['qk_unchanged_by_step'], flow
assert flow['trainable_with_grad'], flow['params_without_grad']

# %% [markdown]
# ## Explorer
#
# Move the sliders to change the shape; the counts and FLOPs per token follow (in a live Jupyter
# session; headless runs show the first table). Below it, the same table at GPT-2 small's shape.

# %%
display(A.shape_explorer())
display(Markdown(A.markdown_table(A.shape_account(n_layer=12, d_model=768, n_head=12, d_ff=3072))))
