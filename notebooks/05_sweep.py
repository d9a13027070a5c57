# %% [markdown]
# # 05 · Sweeps A3–A6: heads, head dimension, context, layers
#
# Trains GPT-Base, OELM-NoFreeze and OELM-Freeze at every point of one sweep file in
# `parameters/sweeps/` and plots the final validation loss against the swept value. The sweep
# file is a plan of the runner (`oelm_core.runner`, docs/experiments.md): each (seed, point, variant)
# is one run folder `out_root/<sweep>/<key>=<value>/<variant>/seed<S>` (smoke runs under
# `<sweep>_smoke/`) with the trainer's files, the exact `params.yaml` it trained and
# `sweep_point.json`. Finished runs are skipped, so re-executing continues an interrupted sweep.
#
# * `runner`: `"inprocess"` (`oelm_core.train.train` in this kernel), `"subprocess"` (`python -m
#   oelm_core.train` per run) or `"notebook"` (papermill runs `03_training.ipynb` per run).
# * `smoke=True` uses the file's `smoke` section: two points of a tiny model, a few steps (~2 min
#   on CPU). On a GPU: `make notebooks`, then `papermill notebooks/05_sweep.ipynb out.ipynb -p smoke
#   False -p sweep_file parameters/sweeps/a3_heads.yaml`.

# %% tags=["parameters"]
sweep_file = "parameters/sweeps/a6_layers.yaml"  # a3_heads, a4_head_dim, a5_context, a6_layers
out_root = "runs/sweeps"
smoke = True  # the sweep file's smoke points and settings (CPU, ~2 minutes)
runner = "inprocess"  # "inprocess", "subprocess" or "notebook"
variants = None  # None: the file's (gpt_base, oelm_nofreeze, oelm_freeze)
seeds = None  # None: the file's
overrides = {}  # dotted keys applied to every run, e.g. {"train.steps": 400}
figure_path = None  # None: sweep.png in the sweep's folder (<out_root>/<sweep> or <sweep>_smoke)

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

check_kernel_parameters("05_sweep", globals())  # what papermill injected, too
from oelm_core import runner as R
from oelm_core.analysis import sweeps as S

# %%
plan = R.load_plan(
    sweep_file, out_root=out_root, smoke=smoke, runner=runner, variants=variants, seeds=seeds, overrides=overrides
)
print(f"{plan.name}: {len(plan.runs)} runs over {plan.key} =", [p.value for p in plan.points])

# %%
status = R.run_trainings(plan)
failed = [r for r in status if r["status"] == "failed"]
assert not failed, f"{len(failed)} run(s) failed: " + "; ".join(r.get("error", "") for r in failed)

# %% [markdown]
# ## Results

# %%
results = S.sweep_results(plan.out, plan.name, smoke=smoke)
assert len(results["runs"]) >= len(plan.runs), "some run folders have no results"
display(Markdown(results["markdown"]))

# %%
fig = S.sweep_figure(results, figure_path or plan.out / "sweep.png")
fig
