# %% [markdown]
# # 05 · Sweeps A3–A6: heads, head dimension, context, layers
#
# Trains GPT-Base, OELM-NoFreeze and OELM-Freeze at every point of one sweep file in
# `parameters/sweeps/` and plots the final validation loss against the swept value.
# All logic lives in `oelm_core.sweep`: each (point, variant, seed) is one run folder
# `out_root/<sweep>/<key>=<value>/<variant>/seed<S>` (smoke runs under `<sweep>_smoke/`) with
# the trainer's files, the exact
# `params.yaml` it trained and `sweep_point.json`. Completed runs are skipped, so re-executing
# continues an interrupted sweep.
#
# * `runner`: `"inprocess"` (`oelm_core.train.train` in this kernel), `"subprocess"`
#   (`python -m oelm_core.train` per run) or `"notebook"` (papermill runs `03_training.ipynb` per run).
# * `smoke=True` uses the file's `smoke` section: two points of a tiny model, a few steps (~2 min on CPU).
#   On a GPU: `papermill notebooks/05_sweep.ipynb out.ipynb -p smoke False -p sweep_file parameters/sweeps/a3_heads.yaml`.

# %% tags=["parameters"]
sweep_file = "parameters/sweeps/a6_layers.yaml"   # a3_heads, a4_head_dim, a5_context, a6_layers
out_root = "runs/sweeps"
smoke = True              # the sweep file's smoke points and settings (CPU, ~2 minutes)
runner = "inprocess"      # "inprocess", "subprocess" or "notebook"
variants = None           # None: the file's (gpt_base, oelm_nofreeze, oelm_freeze)
seeds = None              # None: the file's
overrides = {}            # dotted keys applied to every run, e.g. {"train.steps": 400}
figure_path = None        # None: sweep.png in the sweep's folder (<out_root>/<sweep> or <sweep>_smoke)

# %%
import os
import sys
from pathlib import Path
# JupyterLab starts the kernel in notebooks/, papermill and the study where they are told (--cwd).
# Relative paths (parameter files, their out_dir and data cache) mean the repository root, as on
# the command line: started in notebooks/, the kernel moves there, or a run would land in
# notebooks/runs. oelm_core is imported from that root without pip install -e.
if Path.cwd().name == "notebooks" and (Path.cwd().parent / "oelm_core").is_dir():
    os.chdir(Path.cwd().parent)
if (Path.cwd() / "oelm_core").is_dir() and str(Path.cwd()) not in sys.path:
    sys.path.insert(0, str(Path.cwd()))
from IPython.display import Markdown, display
# %matplotlib inline
from oelm_core.study import check_notebook_parameters
check_notebook_parameters("05_sweep", {"sweep_file": sweep_file, "out_root": out_root,
    "smoke": smoke, "runner": runner, "variants": variants, "seeds": seeds,
    "overrides": overrides, "figure_path": figure_path})
from oelm_core import sweep as S

# %%
sweep = S.load_sweep(sweep_file)
plan = S.sweep_runs(sweep, out_root, smoke=smoke, variants=variants, seeds=seeds, overrides=overrides)
print(f"{sweep.name}: {len(plan)} runs over {sweep.key} =", sorted({r.info['value'] for r in plan}, key=str))

# %%
status = S.run_sweep(sweep, out_root, smoke=smoke, runner=runner, variants=variants, seeds=seeds,
                     overrides=overrides)
failed = [r for r in status if r["status"] == "failed"]
assert not failed, f"{len(failed)} run(s) failed: " + "; ".join(r.get("error", "") for r in failed)

# %% [markdown]
# ## Results

# %%
results = S.sweep_results(out_root, sweep.name, smoke=smoke)
assert len(results["runs"]) >= len(plan), "some run folders have no results"
display(Markdown(results["markdown"]))

# %%
fig = S.sweep_figure(results, figure_path or S.sweep_dir(sweep, out_root, smoke) / "sweep.png")
fig
