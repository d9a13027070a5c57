"""Writes notebooks/05_sweep.ipynb (without outputs): python scripts/make_sweep_notebook.py

The notebook holds narrative, parameters and calls into oelm_core.sweep only.
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

REPO = Path(__file__).resolve().parents[1]

CELLS = [
    ("md", """# 05 · Sweeps A3–A6: heads, head dimension, context, layers

Trains GPT-Base, OELM-NoFreeze and OELM-Freeze at every point of one sweep file in
`parameters/sweeps/` and plots the final validation loss against the swept value.
All logic lives in `oelm_core.sweep`: each (point, variant, seed) is one run folder
`out_root/<sweep>/<key>=<value>/<variant>/seed<S>` (smoke runs under `<sweep>_smoke/`) with
the trainer's files, the exact
`params.yaml` it trained and `sweep_point.json`. Completed runs are skipped, so re-executing
continues an interrupted sweep.

* `runner`: `"inprocess"` (`oelm_core.train.train` in this kernel), `"subprocess"`
  (`python -m oelm_core.train` per run) or `"notebook"` (papermill runs `03_training.ipynb` per run).
* `smoke=True` uses the file's `smoke` section: two points of a tiny model, a few steps (~2 min on CPU).
  On a GPU: `papermill notebooks/05_sweep.ipynb out.ipynb -p smoke False -p sweep_file parameters/sweeps/a3_heads.yaml`."""),
    ("params", """sweep_file = "parameters/sweeps/a6_layers.yaml"   # a3_heads, a4_head_dim, a5_context, a6_layers
out_root = "runs/sweeps"
smoke = True              # the sweep file's smoke points and settings (CPU, ~2 minutes)
runner = "inprocess"      # "inprocess", "subprocess" or "notebook"
variants = None           # None: the file's (gpt_base, oelm_nofreeze, oelm_freeze)
seeds = None              # None: the file's
overrides = {}            # dotted keys applied to every run, e.g. {"train.steps": 400}
figure_path = None        # None: sweep.png in the sweep's folder (<out_root>/<sweep> or <sweep>_smoke)"""),
    ("code", """import os, sys
from pathlib import Path
# the kernel runs in the repository root (papermill --cwd); make oelm_core importable either way
for root in (Path.cwd(), Path.cwd().parent):
    if (root / "oelm_core").is_dir() and str(root) not in sys.path:
        sys.path.insert(0, str(root))
from IPython.display import Markdown, display
import matplotlib
%matplotlib inline
from oelm_core import sweep as S"""),
    ("code", """sweep = S.load_sweep(sweep_file)
plan = S.sweep_runs(sweep, out_root, smoke=smoke, variants=variants, seeds=seeds, overrides=overrides)
print(f"{sweep.name}: {len(plan)} runs over {sweep.key} =", sorted({r.info['value'] for r in plan}, key=str))"""),
    ("code", """status = S.run_sweep(sweep, out_root, smoke=smoke, runner=runner, variants=variants, seeds=seeds,
                     overrides=overrides)
failed = [r for r in status if r["status"] == "failed"]
assert not failed, f"{len(failed)} run(s) failed: " + "; ".join(r.get("error", "") for r in failed)"""),
    ("md", "## Results"),
    ("code", """results = S.sweep_results(out_root, sweep.name, smoke=smoke)
assert len(results["runs"]) >= len(plan), "some run folders have no results"
display(Markdown(results["markdown"]))"""),
    ("code", """fig = S.sweep_figure(results, figure_path or S.sweep_dir(sweep, out_root, smoke) / "sweep.png")
fig"""),
]


def main() -> Path:
    nb = new_notebook()
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                   "language_info": {"name": "python"}}
    for kind, src in CELLS:
        cell = new_markdown_cell(src) if kind == "md" else new_code_cell(src)
        if kind == "params":
            cell.metadata["tags"] = ["parameters"]
        nb.cells.append(cell)
    path = REPO / "notebooks" / "05_sweep.ipynb"
    nbformat.validate(nb)
    nbformat.write(nb, path)
    return path


if __name__ == "__main__":
    print(main())
