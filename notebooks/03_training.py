# %% [markdown]
# # 03 · One training run
#
# Launches one run of `oelm_core.train` for one parameter file in a subprocess — `python -m
# oelm_core.train` for one process, `torchrun` for `nproc > 1` — and streams its log here line by
# line. The kernel itself never touches CUDA; `cuda_visible_devices` picks the GPUs of the child
# by their index among those this kernel sees (under `CUDA_VISIBLE_DEVICES=2,3`, "0" is the
# machine's GPU 2; "" hides them all: CPU). A non-zero exit fails this notebook. The run folder
# (config, metrics, summary, checkpoints) stays where `run_dir` says.
#
# `overrides` takes `--set` strings such as `"train.steps=50"`; `resume=True` continues a run
# that was cut short from its newest checkpoint (`--resume`). The experiment runner
# (`python -m oelm_core run`) executes this notebook once per run of a plan whose runner is `notebook`.

# %% tags=["parameters"]
params = "parameters/smoke/oelm_freeze.yaml"
overrides = []  # --set strings (see above)
nproc = 1  # processes (GPUs) of this run
cuda_visible_devices = ""  # "" for CPU, "0" for one GPU, "0,1" for two
run_dir = None  # None: the parameter file's out_dir
resume = False  # True: continue the run in run_dir from its newest checkpoint
progress_bar = False  # a tqdm bar does not stream well into a notebook
cpu_threads = None  # the training's CPU threads (OMP_NUM_THREADS); None: this kernel's environment

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

check_kernel_parameters("03_training", globals())  # what papermill injected, too
from oelm_core import analysis as A
from oelm_core.runner.launch import launch_training

# %%
run_dir = launch_training(
    params,
    overrides,
    nproc=nproc,
    cuda_visible_devices=cuda_visible_devices,
    run_dir=run_dir,
    resume=resume,
    progress=progress_bar,
    threads=cpu_threads,
)
run_dir

# %% [markdown]
# ## Result

# %%
run = A.load_run(run_dir)
assert run.summary, f'{run_dir} has no summary.json'
display(A.plot_curves([run], Path(run_dir) / 'loss_curve.png'))
display(Markdown(A.results_table([run])['markdown']))
