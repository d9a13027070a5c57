# OELM Lab. On a fresh machine, two commands:
#   make study   # the main job: the smoke study (notebooks, three trainings, analysis) -> runs/smoke
#   make test    # the test suite, exactly what CI runs (.ci/run)
# Each creates .venv and installs what it needs. Other targets: make lab, make tensorboard, make demo,
# make bench, make results (every committed table and figure regenerated from the committed run files), and
# on a GPU machine make test-gpu (the GPU tests CI cannot run; PYTHON_BIN=python3 uses that Python).

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STUDY  ?= parameters/study_smoke.yaml
# Any torch >= 2.4 works. 2.13.0 is pinned for the install so that a CPU machine with that
# wheel on disk takes it instead of a multi-GB CUDA build; a torch already in the venv is kept.
TORCH  ?= torch==2.13.0
PYTEST_ARGS ?=
# test-gpu: a Python that already has torch, Triton and pytest (no venv is made); empty: the venv.
PYTHON_BIN ?=

# Offline: oelm.env (`python -m oelm_core.offline ../shared/data`), which the package itself reads
# for every command, make's and plain ones alike. Without it (CI), the TinyStories text and GPT-2
# BPE files beside the checkout when present; online, nothing is set and the data comes from the hub.
ifeq ($(wildcard oelm.env),)
SHARED := $(abspath ../shared/data)
ifneq ($(wildcard $(SHARED)/tinystories),)
export OELM_DATA ?= $(SHARED)/tinystories
endif
ifneq ($(wildcard $(SHARED)/tokenizer/tiktoken_cache),)
export TIKTOKEN_CACHE_DIR ?= $(SHARED)/tokenizer/tiktoken_cache
endif
endif
export GRADIO_ANALYTICS_ENABLED := False

.PHONY: study results notebooks lint test test-gpu lab tensorboard demo bench browser slurm clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	@# Triton's interpreter runs the kernel tests on the CPU; a CUDA torch brings its own Triton.
	if $(BIN)/python -c "import sys, torch; sys.exit(bool(torch.version.cuda or torch.version.hip))"; then \
	  $(BIN)/python -m pip install -q -e ".[interpreter]"; fi
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $@

study: $(VENV)/.installed
	$(BIN)/python -m oelm_core run $(STUDY)

# The notebooks' .ipynb, made from their committed .py sources and git-ignored: what JupyterLab
# opens and papermill runs by hand (notebooks/jupytext.toml). --update keeps a session's outputs;
# a notebook whose cells are those of its .py is left as it is.
notebooks: $(VENV)/.installed
	$(BIN)/python -m jupytext --quiet --to ipynb --update --set-kernel python3 $(wildcard notebooks/[0-9][0-9]_*.py)

# Every table and figure of results/ from the committed run files (no GPU, no checkpoints): the tuned
# Medium-512 and mini studies through notebooks/04_analysis (results.md, results.json, figures/, the
# executed notebook), the ablations against the Medium-512 study's OELM-Freeze and GPT-Base, and the
# tuning sweeps; the protocol's (issue 42): its study through its plan, whose 04_analysis parameters
# carry the tuning's choice, the orthogonality study against it, the shapes' sweep a shape at a time,
# the other shapes' studies and the scaling curve over all four (each at its own best, and at each dropout).
# The mini runs shared one GPU five at a time, so their speed is not compared.
PROTOCOL := parameters/protocol/study_medium512.yaml
TUNED    := results/tuned_medium512
MINI     := results/tuned_mini
TUNED_ACROSS := [train.lr, train.min_lr, model.dropout]
# The scaling curve: the protocol's study at each shape, smallest first (results/protocol_scaling).
SHAPES   := d256 d384 medium512 d768
results: $(VENV)/.installed notebooks
	$(BIN)/python -m papermill notebooks/04_analysis.ipynb $(TUNED)/04_analysis.ipynb --log-level WARNING \
	  -y '{run_dirs: [$(TUNED)/runs], out_dir: $(TUNED), which: best, compare_across: $(TUNED_ACROSS)}'
	$(BIN)/python -m papermill notebooks/04_analysis.ipynb $(MINI)/04_analysis.ipynb --log-level WARNING \
	  -y '{run_dirs: [$(MINI)/runs], out_dir: $(MINI), which: best, compare_across: $(TUNED_ACROSS), timed_alone: false}'
	$(BIN)/python -m oelm_core report results/ablations_medium512 --comparators $(TUNED)/runs --which best --tuned
	for s in medium512 mini; do $(BIN)/python -m oelm_core tune results/tune_$$s \
	  --markdown results/tune_$$s/tuning.md --figure results/tune_$$s/tuning.png || exit 1; done
	$(BIN)/python -m oelm_core tune results/protocol_tune_medium512 --min-seeds 2 --per-dropout \
	  --markdown results/protocol_tune_medium512/tuning.md --figure results/protocol_tune_medium512/tuning.png
	$(BIN)/python -m oelm_core run $(PROTOCOL) --out results/protocol_medium512 --set 'experiment.notebooks=[04_analysis]'
	$(BIN)/python -m oelm_core report results/protocol_orthogonality_medium512 --comparators results/protocol_medium512/runs \
	  --which report --tuned
	$(BIN)/python -m oelm_core run parameters/protocol/speed_medium512.yaml --out results/protocol_speed_medium512 \
	  --set 'experiment.notebooks=[04_analysis]'
	for s in results/protocol_tune_shapes/shape=*; do $(BIN)/python -m oelm_core tune $$s --min-seeds 2 --per-dropout \
	  --markdown $$s/tuning.md --figure $$s/tuning.png || exit 1; done
	for s in $(filter-out medium512,$(SHAPES)); do $(BIN)/python -m oelm_core run parameters/protocol/study_$$s.yaml \
	  --out results/protocol_$$s --set 'experiment.notebooks=[04_analysis]' || exit 1; done
	$(BIN)/python -m oelm_core report $(SHAPES:%=results/protocol_%) --scaling --own-best --out results/protocol_scaling/own_best
	for d in 0 0.1; do $(BIN)/python -m oelm_core report $(SHAPES:%=results/protocol_%) --scaling --dropout $$d \
	  --out results/protocol_scaling/dropout$$d || exit 1; done

# The browser test drives Debian's Chromium (a test tool's own browser download is not
# reachable from CI); installed here when missing and we may use apt.
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
	  || echo "chromium not installed: the browser test will be skipped"; }

# The SLURM tests start a throw-away single-node SLURM (tests/test_slurm.py): Debian's daemons
# and clients, installed here when missing and we may use apt (no services are enabled).
slurm:
	@command -v sbatch >/dev/null && [ -x /usr/sbin/slurmctld ] || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	   slurmctld slurmd slurm-client munge >/dev/null) \
	  || echo "slurm not installed: the SLURM tests will be skipped"; }

# ruff (pyproject.toml's [tool.ruff]): lint, and the format checked; `ruff format .` writes it.
lint: $(VENV)/.installed
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .

test: $(VENV)/.installed browser slurm lint
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# JupyterLab at the repository root, on the project's kernel (python3, installed above); jupytext
# saves each notebook's cells to its .py and its outputs to the git-ignored .ipynb
# (notebooks/jupytext.toml). LAB_ARGS, e.g. --no-browser --port 8888
LAB_ARGS ?=
lab: $(VENV)/.installed notebooks
	$(BIN)/python -m jupyterlab --ServerApp.root_dir="$(CURDIR)" $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

# TensorBoard over every run below RUNS (each run writes RUN/tb/ as it trains: live curves), e.g.
# make tensorboard RUNS=runs/smoke TB_PORT=6007; TB_ARGS, e.g. --bind_all to serve other machines.
RUNS   ?= runs
TB_PORT ?= 6006
TB_ARGS ?=
tensorboard: $(VENV)/.installed
	$(BIN)/python -m tensorboard.main --logdir "$(RUNS)" --port $(TB_PORT) $(TB_ARGS)

# The tests marked `gpu` (Triton kernels on CUDA, CUDA graphs, two GPUs), and a summary:
# card, torch, date, commit, passed/failed/skipped (scripts/test_gpu.sh).
test-gpu: $(if $(PYTHON_BIN),,$(VENV)/.installed)
	PYTHON_BIN="$(or $(PYTHON_BIN),$(BIN)/python)" scripts/test_gpu.sh $(PYTEST_ARGS)

# The newest trained study; with none, on a GPU, one seed of the mini study is trained first; on a
# CPU, what that would take here and how to bring one, and the newest study meanwhile. PORT: its port.
PORT ?= 7860
demo: $(VENV)/.installed
	$(BIN)/python -m app --train-mini --port $(PORT)

bench: $(VENV)/.installed
	$(BIN)/python benchmarks/bench_generate.py

clean:
	rm -rf $(VENV) runs data_cache
