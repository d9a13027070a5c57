"""Writes the study notebooks (without outputs): python notebooks/make_notebooks.py

The notebooks (01_theory ... 05_sweep) hold narrative, parameters and calls into oelm_core only;
edit them here so that they stay consistent, then re-run this script.
"""

import ast
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = """\
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
%matplotlib inline"""


def setup(name: str, params: str, code: str) -> str:
    """The first code cell after the parameters cell ``params``: SETUP, the call that checks the
    parameters (papermill injects any value it is given, of any type), then ``code``."""
    names = [t.id for node in ast.parse(params).body if isinstance(node, ast.Assign)
             for t in node.targets if isinstance(t, ast.Name)]
    lines, line = [], f'check_notebook_parameters("{name}", {{'
    for item in (f'"{n}": {n}' for n in names):
        if len(line) + len(item) > 96:
            lines.append(line.rstrip())
            line = "    "
        line += item + ", "
    lines.append(line.removesuffix(", ") + "})")
    return "\n".join([SETUP, "from oelm_core.study import check_notebook_parameters", *lines, code])


def notebook(cells):
    nb = new_notebook()
    nb.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                   "language_info": {"name": "python"}}
    out = []
    for kind, src in cells:
        if kind == "md":
            out.append(new_markdown_cell(src))
        elif kind == "params":
            c = new_code_cell(src)
            c.metadata["tags"] = ["parameters"]
            out.append(c)
        else:
            out.append(new_code_cell(src))
    nb.cells = out
    return nb


THEORY_PARAMS = ("d = 512            # width of the square Q/K matrices\n"
                 "n_head = 8\n"
                 "n_vectors = 256    # random vectors for the isometry check\n"
                 "n_tokens = 128     # tokens for the logit statistics\n"
                 "jl_points = 64     # points whose pairwise distances are projected\n"
                 "jl_trials = 3\n"
                 "construction_repeats = 3\n"
                 "seed = 0\n"
                 "fig_dir = \"runs/notebooks/figures\"   # a relative path is taken from the repository root")

THEORY = [
    ("md", "# 01 · Theory: why orthogonal Q/K?\n\n"
           "OELM starts the attention projections W_q and W_k as random orthogonal matrices and may "
           "freeze them. This notebook checks the properties that motivate it, numerically, and fails "
           "when one does not hold:\n\n"
           "1. an orthogonal W is an **isometry** (it preserves every norm), a Gaussian one is not;\n"
           "2. the four constructions (QR, SVD, Householder, Cayley) are orthogonal to float32 rounding, "
           "at different cost;\n"
           "3. random orthogonal projections preserve pairwise distances (Johnson–Lindenstrauss) at least "
           "as well as Gaussian ones;\n"
           "4. at initialisation orthogonal Q/K give unit-scale attention logits and attention less "
           "uniform than GPT-2's N(0, 0.02), whose near-zero logits give almost uniform attention; "
           "still far from peaked (d = 512, 128 tokens: entropy 4.37 nats, uniform 4.85)."),
    ("params", THEORY_PARAMS),
    ("code", setup("01_theory", THEORY_PARAMS,
                   "from oelm_core import analysis as A\n"
                   "from oelm_core.orthogonal import ORTHOGONAL_METHODS\n"
                   "fig_dir = A.REPO / fig_dir  # an absolute path stays as it is")),
    ("md", "## 1 · Isometry, orthogonality error and condition number\n\n"
           "`isometry_error` is max | ‖Wx‖/‖x‖ − 1 | over random x; the GPT-2 normal init is rescaled "
           "to unit row norm so only its shape is judged. Orthogonal matrices have every singular value "
           "equal to 1 (condition number 1); Gaussian ones spread them over [0, 2] (Marchenko–Pastur)."),
    ("code", "iso = A.isometry_table(d, n_vectors, seed=seed)\n"
             "display(Markdown(A.markdown_table(iso)))\n"
             "for r in iso:\n"
             "    if r['method'] in ORTHOGONAL_METHODS:\n"
             "        assert r['isometry_error'] < 1e-9 and r['orthogonality_error'] < 1e-9, r\n"
             "        assert abs(r['condition_number'] - 1) < 1e-6, r\n"
             "    else:  # normal, gaussian: not isometries\n"
             "        assert r['orthogonality_error'] > 0.5 and r['condition_number'] > 10, r\n"
             "        assert r['isometry_error'] > 1e-3, r"),
    ("md", "## 2 · The constructions: float32 error and time"),
    ("code", "cons = A.construction_table(d, repeats=construction_repeats, seed=seed)\n"
             "display(Markdown(A.markdown_table(cons)))\n"
             "assert all(r['orthogonality_error_fp32'] < 1e-5 for r in cons), cons"),
    ("md", "## 3 · Johnson–Lindenstrauss distortion vs target dimension\n\n"
           "Project `jl_points` points from d to k dimensions (scaled by √(d/k)) and measure how much "
           "their pairwise distances change. Both shrink like 1/√k; orthonormal rows do better as k → d "
           "because a k-dimensional orthogonal slice loses no length within its subspace. Checked: each "
           "method distorts less at k = d/2 than at k = 8, and there orthonormal rows less than "
           "Gaussian ones; from 32 points and 64 point-projections (`jl_points` × `jl_trials`), where "
           "the differences exceed the noise of their estimates. With fewer they are shown, not judged."),
    ("code", "jl = A.jl_curve(d, jl_points, methods=('qr', 'gaussian'), trials=jl_trials, seed=seed)\n"
             "display(A.jl_figure(jl, fig_dir / 'jl_distortion.png'))\n"
             "display(Markdown(A.markdown_table(jl)))\n"
             "verdict = A.jl_checks(jl, jl_points, jl_trials)\n"
             "print(verdict['why'])\n"
             "assert verdict['holds'] is not False, verdict"),
    ("md", "## 4 · Attention logits at initialisation\n\n"
           "Logit std and mean softmax entropy (nats; `max_entropy` = log n is uniform attention) on "
           "unit-variance tokens."),
    ("code", "logits = A.logit_stats_table(d, n_head, n_tokens, seed=seed)\n"
             "display(Markdown(A.markdown_table(logits)))\n"
             "L = {r['init']: r for r in logits}\n"
             "assert 0.5 < L['qr']['logit_std'] < 2.0, L['qr']\n"
             "assert L['normal']['logit_std'] < 0.5, L['normal']\n"
             "assert L['normal']['max_entropy'] - L['normal']['entropy'] < 0.1  # nearly uniform\n"
             "assert L['qr']['entropy'] < L['normal']['entropy']"),
    ("md", "All checks held: orthogonal Q/K are exact isometries, cheap to build, preserve geometry "
           "and start attention at a useful logit scale."),
]

MODEL_PARAMS = ("preset = \"medium512\"       # the shape whose parameters are tabulated\n"
                "grad_check_preset = \"tiny\"  # the small model of the gradient-flow check\n"
                "all_variants = True         # tabulate the ablation variants too")

MODEL = [
    ("md", "# 02 · The models: groups, variants, parameters and FLOPs\n\n"
           "The study compares three groups — **GPT-Base** (standard Q/K), **OELM-NoFreeze** (orthogonal "
           "Q/K, trained) and **OELM-Freeze** (orthogonal Q/K, frozen) — plus the ablation variants "
           "registered in `oelm_core.VARIANTS`."),
    ("params", MODEL_PARAMS),
    ("code", setup("02_model", MODEL_PARAMS,
                   "import oelm_core\nfrom oelm_core import analysis as A")),
    ("md", "## Variants"),
    ("code", "display(Markdown(A.markdown_table([{'variant': k, 'description': v} "
             "for k, v in oelm_core.VARIANTS.items()])))"),
    ("md", "## Exact parameter counts\n\nFrozen Q/K are buffers, not parameters: 2 · n_layer · d_model² "
           "weights. At medium512 that is 3,145,728 of 44,896,768, i.e. **7.0%** of the trainable "
           "parameters — not the ~15% the original report claimed (the 25.7M-parameter embedding dominates)."),
    ("code", "names = list(oelm_core.VARIANTS) if all_variants else list(A.GROUP_LABELS)\n"
             "params = A.parameter_table(preset, names)\n"
             "display(Markdown(A.markdown_table(params)))\n"
             "P = {r['variant']: r for r in params}\n"
             "if preset == 'medium512':\n"
             "    assert P['gpt_base']['trainable'] == 44_896_768 and P['gpt_base']['frozen'] == 0\n"
             "    assert P['oelm_nofreeze']['trainable'] == 44_896_768\n"
             "    assert P['oelm_freeze']['trainable'] == 41_751_040 and P['oelm_freeze']['frozen'] == 3_145_728\n"
             "    assert abs(P['oelm_freeze']['trainable_reduction'] - 0.0700) < 0.0005\n"
             "assert P['oelm_freeze']['total'] == P['gpt_base']['total']"),
    ("md", "## What freezing saves: FLOPs per token and optimizer memory\n\n"
           "A frozen weight still costs its forward and input-gradient matmuls; only the weight "
           "gradient (one third of its FLOPs) and its AdamW state disappear."),
    ("code", "flops = A.flops_table(preset, names)\n"
             "display(Markdown(A.markdown_table(flops)))\n"
             "F = {r['variant']: r for r in flops}\n"
             "assert F['oelm_freeze']['forward_flops'] == F['gpt_base']['forward_flops']\n"
             "assert 0 < F['oelm_freeze']['frozen_saving_pct'] < 10\n"
             "assert F['oelm_freeze']['state_saving_mb'] > 0"),
    ("md", "## Gradient flow\n\nOne forward/backward and optimizer step on a small OELM-Freeze model: the "
           "frozen Q/K receive no gradient and do not change; every trainable parameter gets one."),
    ("code", "flow = A.gradient_flow_check(grad_check_preset, 'oelm_freeze')\n"
             "flow\n"),
    ("code", "assert flow['frozen_qk'] and flow['frozen_without_grad'] and flow['qk_unchanged_by_step'], flow\n"
             "assert flow['trainable_with_grad'], flow['params_without_grad']"),
    ("md", "## Explorer\n\nMove the sliders to change the shape; the counts and FLOPs per token follow "
           "(in a live Jupyter session; headless runs show the first table)."),
    ("code", "display(A.shape_explorer())\n"
             "display(Markdown(A.markdown_table(A.shape_account(n_layer=12, d_model=768, n_head=12, d_ff=3072))))"),
]

TRAINING_PARAMS = ("params = \"parameters/smoke/oelm_freeze.yaml\"\n"
                   "overrides = []                 # --set strings (see above)\n"
                   "nproc = 1                      # processes (GPUs) of this run\n"
                   "cuda_visible_devices = \"\"      # \"\" for CPU, \"0\" for one GPU, \"0,1\" for two\n"
                   "run_dir = None                 # None: the parameter file's out_dir\n"
                   "resume = False                 # True: continue the run in run_dir from its newest checkpoint\n"
                   "progress_bar = False           # a tqdm bar does not stream well into a notebook")

TRAINING = [
    ("md", "# 03 · One training run\n\n"
           "Launches one run of `oelm_core.train` for one parameter file in a subprocess — "
           "`python -m oelm_core.train` for one process, `torchrun` for `nproc > 1` — and streams its "
           "log here line by line. The kernel itself never touches CUDA; `cuda_visible_devices` picks "
           "the GPUs of the child by their index among those this kernel sees (under "
           "`CUDA_VISIBLE_DEVICES=2,3`, \"0\" is the machine's GPU 2; \"\" hides them all: CPU). "
           "A non-zero exit fails this notebook. The run folder (config, metrics, summary, "
           "checkpoints) stays where `run_dir` says.\n\n"
           "`overrides` takes `--set` strings such as `\"train.steps=50\"`; `resume=True` continues a run "
           "that was cut short from its newest checkpoint (`--resume`)."),
    # No "=" in the comments of the parameters cell: papermill skips a line holding two.
    ("params", TRAINING_PARAMS),
    ("code", setup("03_training", TRAINING_PARAMS,
                   "from oelm_core import analysis as A\n"
                   "from oelm_core.study import launch_training")),
    ("code", "run_dir = launch_training(params, overrides, nproc=nproc, cuda_visible_devices=cuda_visible_devices,\n"
             "                          run_dir=run_dir, resume=resume, progress=progress_bar)\n"
             "run_dir"),
    ("md", "## Result"),
    ("code", "run = A.load_run(run_dir)\n"
             "assert run.summary, f'{run_dir} has no summary.json'\n"
             "display(A.plot_curves([run], Path(run_dir) / 'loss_curve.png'))\n"
             "display(Markdown(A.results_table([run])['markdown']))"),
]

ANALYSIS_PARAMS = ("run_dirs = []                  # run folders, or folders that hold them (a study folder)\n"
                   "out_dir = \"runs/notebooks/analysis\"   # a relative path is taken from the repository root\n"
                   "fig_dir = None                 # None: <out_dir>/figures\n"
                   "which = \"final\"                # 'final' or 'best' validation figures\n"
                   "attention_text = \"Once upon a time, there was a little girl named Lily. She loved to play outside in the sun.\"\n"
                   "layer = 0\n"
                   "head = 0\n"
                   "max_tokens = 24\n"
                   "sample_prompt = \"Once upon a time\"\n"
                   "max_new_tokens = 40")

ANALYSIS = [
    ("md", "# 04 · Analysis: results, hypotheses, attention\n\n"
           "Loads any number of run folders (several seeds per group give means, standard deviations "
           "and Welch t-tests; a group is the runs of one variant trained with the same settings apart "
           "from the seed), draws the curves, builds the results table in the original study's "
           "form, judges hypotheses H1–H4 from the data, compares attention maps and samples, and "
           "writes `results.md` / `results.json` to `out_dir`."),
    ("params", ANALYSIS_PARAMS),
    ("code", setup("04_analysis", ANALYSIS_PARAMS,
                   "from oelm_core import analysis as A\n"
                   "out_dir = A.REPO / out_dir  # an absolute path stays as it is\n"
                   "fig_dir = A.REPO / fig_dir if fig_dir else out_dir / 'figures'\n"
                   "runs = A.load_runs(run_dirs)\n"
                   "display(Markdown(A.markdown_table([{'run': r.name, 'variant': r.variant, 'preset': r.preset, "
                   "'seed': r.seed, 'steps': r.value('steps'), 'folder': str(r.path)} for r in runs])))")),
    ("md", "## Training and validation curves"),
    ("code", "display(A.plot_curves(runs, fig_dir / 'curves.png'))"),
    ("md", "## Results table\n\nGaps are relative to GPT-Base of the same preset (positive: worse); where "
           "the preset has several GPT-Base groups, to the one trained with the row's settings apart from "
           "the variant. A variant's runs trained with other settings (per-run overrides, an unfreeze "
           "schedule) are rows of their own, named after their runs."),
    ("code", "table = A.results_table(runs, which)\ndisplay(Markdown(table['markdown']))"),
    ("md", "## Hypotheses\n\n"
           "* **H1** freezing cuts trainable parameters by ~15% (the original report's claim; the exact "
           "figure at medium512 is 7.0%)\n"
           "* **H2** OELM-Freeze perplexity within 5% of OELM-NoFreeze\n"
           "* **H3** OELM-Freeze trains at least as fast as GPT-Base\n"
           "* **H4** OELM-Freeze perplexity within 10% of GPT-Base\n\n"
           "Each compares two groups trained with the same settings apart from the variant; where the runs "
           "hold no such pair, or several, the hypothesis is not judged and its evidence says why."),
    ("code", "hyps = A.hypotheses(runs, which)\ndisplay(Markdown(A.hypotheses_markdown(hyps)))\n"
             "assert [h['id'] for h in hyps] == ['H1', 'H2', 'H3', 'H4']\n"
             "if A.hypotheses_judgeable(runs):\n"
             "    assert all(h['holds'] is not None for h in hyps), hyps"),
    ("md", "## Significance across seeds\n\nWelch's t-test and Cohen's d of the validation perplexity, "
           "where each group has at least two seeds."),
    ("code", "sig = A.significance_tests(runs, f'{which}_val_ppl')\n"
             "display(Markdown(A.markdown_table(sig, ['a', 'b', 'preset', 'n_a', 'n_b', 'mean_a', 'mean_b', "
             "'t', 'p', 'cohen_d']) if sig else '(no groups to compare)'))"),
    ("md", "## Attention maps on the same story"),
    ("code", "models = A.load_models(runs)\n"
             "display(Markdown(A.checkpoint_note(which)))\n"
             "if models:\n"
             "    display(A.attention_figure(models, attention_text, layer, head, max_tokens, "
             "fig_dir / 'attention.png'))\n"
             "    summary = {label: A.attention_summary(m, attention_text, max_tokens) for label, m in models.items()}\n"
             "    display(Markdown(A.markdown_table([{'model': label, **row} for label, rows in summary.items() "
             "for row in rows])))"),
    ("md", "## Samples"),
    ("code", "samples = A.sample_generations(models, sample_prompt, max_new_tokens)\n"
             "display(Markdown(A.markdown_table(samples) if samples else '(no checkpoints)'))"),
    ("md", "## Written results"),
    ("code", "result = A.write_results(runs, out_dir, which, extra_markdown=A.samples_markdown(samples, which))\n"
             "assert (out_dir / 'results.md').is_file() and (out_dir / 'results.json').is_file()\n"
             "print((out_dir / 'results.md').read_text())"),
]


SWEEP_PARAMS = ("""sweep_file = "parameters/sweeps/a6_layers.yaml"   # a3_heads, a4_head_dim, a5_context, a6_layers
out_root = "runs/sweeps"
smoke = True              # the sweep file's smoke points and settings (CPU, ~2 minutes)
runner = "inprocess"      # "inprocess", "subprocess" or "notebook"
variants = None           # None: the file's (gpt_base, oelm_nofreeze, oelm_freeze)
seeds = None              # None: the file's
overrides = {}            # dotted keys applied to every run, e.g. {"train.steps": 400}
figure_path = None        # None: sweep.png in the sweep's folder (<out_root>/<sweep> or <sweep>_smoke)""")

SWEEP = [
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
    ("params", SWEEP_PARAMS),
    ("code", setup("05_sweep", SWEEP_PARAMS,
                   "from oelm_core import sweep as S")),
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


NOTEBOOKS = {"01_theory": THEORY, "02_model": MODEL, "03_training": TRAINING, "04_analysis": ANALYSIS,
             "05_sweep": SWEEP}


def main(folder: Path = HERE) -> None:
    for name, cells in NOTEBOOKS.items():
        path = Path(folder) / f"{name}.ipynb"
        nb = notebook(cells)
        if path.exists():
            # nbformat draws new random cell ids on every run: keep the written ones, position by
            # position, so that while no cell is added or removed a regeneration's diff shows
            # only the cells that were edited.
            for cell, old in zip(nb.cells, nbformat.read(path, as_version=4).cells):
                cell.id = old.id
        nbformat.write(nb, path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
