"""One experiment runner: studies, sweeps and ablation sets are one kind of plan.

    python -m oelm_core.experiment PLAN [--out DIR] [--set KEY=VALUE ...] [--smoke] [--only NAME ...]

A plan file is a training parameter file (the base of its runs) plus one plan section:

    experiment:
      name: ablations
      runs: [smoke/gpt_base.yaml, ...]     # parameter files (relative to the plan file) or
                                           # {params: FILE, name: NAME, overrides: [...]};
                                           # leave the key out to train this file's own parameters
      variants: [gpt_base, {name: progressive, variant: oelm_freeze, set: {DOTTED.KEY: VALUE}}]
      key: n_layer                         # a sweep axis: the key, and its points
      points: [{value: 2, set: {model.n_layer: 2}}, ...]
      smoke: {points: [...], set: {...}}   # --smoke: other points and settings, for a quick run
      seeds: [0, 1]                        # leave the key out for each file's own train.seed
      overrides: [train.steps=50]          # --set strings (or {dotted key: value}) for every run
      notebooks: [03_training]             # steps, in order; 03_training stands for the trainings
      parameters: {04_analysis: {...}}     # papermill parameters per notebook
      runner: notebook                     # how a training runs: notebook (papermill executes
                                           # 03_training, which launches it), subprocess, inprocess
      gpus_per_run: 0                      # 0: CPU; g: g GPUs (torchrun) per run, side by side
      keep_checkpoints: true               # false: a finished run keeps best.pt, not its ckpt/
      launcher: local                      # slurm: each training a SLURM job (oelm_core.slurm)
      slurm: {partition: gpu, time: "4:00:00", account: ..., nodes: 1}   # its jobs' resources

Every key is optional (without runs, variants or points the plan trains its file's own parameters
once). The plan trains every (seed, point, run, variant), seed outermost, so that a plan cut short
has one seed of each. The older sections load into the same plan with their own keys and
defaults: ``study:`` (parameters/study_*.yaml: runs, seeds, overrides, gpus_per_run, notebooks,
parameters; notebooks 01-04 by default, trainings through notebook 03) and ``sweep:``
(parameters/sweeps/*.yaml: key, points, variants, seeds, smoke; the three groups and seed 0 by
default, trainings in this process).

Run folders: a study's ``OUT/runs/<run>_s<seed>`` (``OUT/runs/<run>`` without seeds), beside its
notebooks, figures and results.md; any other plan's
``OUT/[<key>=<value>/][<run>/][<variant>/][seed<S>]``, a part for each axis the plan has (the
ablations: ``runs/ablations/progressive/seed0``). Each holds
the trainer's files, ``params.yaml`` (exactly what it trained) and ``sweep_point.json`` (its place
in the plan). A run whose summary.json says it ended is skipped, one cut short resumes from its
newest checkpoint, and a folder trained with other settings is refused before anything runs.
A plan that executes notebooks records them and its runs in ``OUT/study.json`` (what the app reads).

One launcher (``launch_training``: ``python -m oelm_core.train`` or ``torchrun`` in a child
process), one papermill call (``execute_notebook``, papermill's Python API) and one check of
notebook parameters (``check_notebook_parameters``: the plan's, the runner's, each notebook's own).
With gpus_per_run = g > 0 and enough GPUs, trainings run side by side, run k on GPUs
[k*g, (k+1)*g) of those this process sees (numbered as torch numbers them: under
CUDA_VISIBLE_DEVICES=2,3, GPU 0 is the machine's GPU 2).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from oelm_core import slurm
from oelm_core.analysis import WHICH
from oelm_core.config import (ConfigError, apply_overrides, read_yaml, run_config_from_dict, trained_settings,
                              variants as known_variants)
from oelm_core.files import write_text_atomic

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
ALL_NOTEBOOKS = ("01_theory", "02_model", "03_training", "04_analysis")   # a plan's steps
RUNNERS = ("inprocess", "subprocess", "notebook")
LAUNCHERS = ("local", "slurm")   # where trainings run: child processes here, or SLURM jobs
GROUPS = ("gpt_base", "oelm_nofreeze", "oelm_freeze")
# The trainer's statuses of a run that has ended: nothing is left to train.
FINISHED = ("completed", "stopped_early")


class ExperimentError(RuntimeError):
    """A notebook or training that failed (the message names the notebook's cell or the run)."""


def _say(msg: str, _lock=threading.Lock()) -> None:
    with _lock:   # trainings side by side: one line at a time
        print(msg, flush=True)


# --------------------------------------------------------------------------------------------
# The launcher: one training in a child process
# --------------------------------------------------------------------------------------------

def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process: this checkout importable, output unbuffered."""
    env = dict(os.environ)
    paths = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def train_command(params: str | Path, overrides: Sequence[str] = (), nproc: int = 1,
                  resume: bool = False, nodes: int = 1) -> list[str]:
    """The command line of one training: ``python -m oelm_core.train`` for one process,
    ``torchrun --standalone --nproc_per_node N -m oelm_core.train`` for several on one host.
    ``nodes`` > 1: the command each of that many hosts runs, ``torchrun --nnodes NODES
    --nproc_per_node N ...``, which meets the others at the rendezvous that torchrun's PET_RDZV_*
    environment variables name (oelm_core.slurm's job script sets them)."""
    if nproc < 1 or nodes < 1:
        raise ConfigError(f"nproc and nodes must be at least 1, got nproc={nproc}, nodes={nodes}")
    if nproc == 1 and nodes == 1:
        cmd = [sys.executable, "-m", "oelm_core.train"]
    else:
        where = ["--standalone"] if nodes == 1 else [f"--nnodes={nodes}"]
        cmd = [sys.executable, "-m", "torch.distributed.run", *where,
               f"--nproc_per_node={nproc}", "-m", "oelm_core.train"]
    cmd += ["--params", str(params)]
    for o in overrides:
        cmd += ["--set", o]
    return cmd + (["--resume"] if resume else [])


def child_visible_devices(gpus: str) -> str:
    """CUDA_VISIBLE_DEVICES for a child process that should use ``gpus``: GPU indices as this
    process numbers them, comma-separated ("" for none).

    A child's CUDA_VISIBLE_DEVICES names GPUs as the machine does, not as this process sees them:
    in a job confined to GPUs 2,3 (CUDA_VISIBLE_DEVICES=2,3) index 0 must become "2", or the
    child trains on a GPU the job was not given. Without the variable both numberings agree."""
    text = str(gpus).strip()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not text or visible is None:
        return text
    devices = [d.strip() for d in visible.split(",") if d.strip()]
    try:
        picked = [int(i) for i in text.split(",")]
    except ValueError:
        raise ConfigError(f"cuda_visible_devices={text!r}: give GPU indices such as \"0\" or \"0,1\", "
                          f"counted among the {len(devices)} GPU(s) this process sees "
                          f"(CUDA_VISIBLE_DEVICES={visible})") from None
    bad = [i for i in picked if not 0 <= i < len(devices)]
    if bad:
        raise ConfigError(f"cuda_visible_devices={text!r} names GPU {bad[0]}, but this process sees "
                          f"{len(devices)} GPU(s) (CUDA_VISIBLE_DEVICES={visible}); indices count "
                          f"from 0 among those")
    return ",".join(devices[i] for i in picked)


def launch_training(params: str | Path, overrides: Sequence[str] = (), nproc: int = 1,
                    cuda_visible_devices: str | None = None, run_dir: str | Path | None = None,
                    resume: bool = False, progress: bool | None = None,
                    echo: Callable[[str], None] | None = None) -> Path:
    """Train one run in a subprocess, echoing its log line by line; returns the run folder.

    ``run_dir`` overrides the parameter file's out_dir. ``cuda_visible_devices`` picks the child's
    GPUs by their index in this process ("" hides every GPU; ``child_visible_devices``); the
    calling process never touches CUDA. ``progress`` sets ``train.progress`` (None: the parameter
    file's; a tqdm bar streams badly into a notebook). A non-zero exit raises RuntimeError with
    the last lines of the log.
    """
    params = Path(params)
    if not params.is_file() and (REPO / params).is_file():  # a path from the root, called elsewhere
        params = REPO / params
    overrides = list(overrides)
    if progress is not None:
        overrides.append(f"train.progress={str(bool(progress)).lower()}")
    if run_dir is not None:
        # quoted: --set values are YAML, where " #" starts a comment and a bare path may be a number
        overrides.append(f"out_dir={json.dumps(str(Path(run_dir).resolve()), ensure_ascii=False)}")
    cfg = run_config_from_dict(apply_overrides(_parameters(params), overrides))  # fails before a launch
    extra = ({} if cuda_visible_devices is None
             else {"CUDA_VISIBLE_DEVICES": child_visible_devices(cuda_visible_devices)})
    cmd = train_command(params.resolve(), overrides, nproc, resume)
    echo = echo or (lambda line: print(line, flush=True))
    echo("$ " + " ".join(cmd) + (f"   [CUDA_VISIBLE_DEVICES={extra['CUDA_VISIBLE_DEVICES']}]" if extra else ""))
    tail: list[str] = []
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(extra), cwd=os.getcwd(), bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n").split("\r")[-1]  # a progress bar's redraws: keep the latest
        echo(line)
        tail = (tail + [line])[-30:]
    rc = proc.wait()
    if rc != 0:
        raise RuntimeError(f"training of {params} exited with status {rc}; last lines:\n" + "\n".join(tail))
    return Path(cfg.out_dir)


# --------------------------------------------------------------------------------------------
# Notebook parameters: the one check
# --------------------------------------------------------------------------------------------

# Notebook parameters whose type does not say enough: the values the notebook accepts ...
PARAMETER_CHOICES = {"04_analysis": {"which": WHICH}, "05_sweep": {"runner": RUNNERS}}
# ... the least values of those whose smaller values leave the notebook nothing to measure or
# its checks to chance, and why ...
PARAMETER_MINIMA = {"01_theory": {
    "d": (32, "the JL curve needs the target dimensions 8 and d/2 >= 16"),
    "n_head": (1, "one head at least"),
    "n_vectors": (1, "the isometry check needs a vector"),
    "n_tokens": (8, "with fewer the logit statistics of one draw stray past the checked bounds"),
    "jl_points": (3, "the spread of the distances' distortion needs two pairs of points"),
    "jl_trials": (1, "one projection at least"),
    "construction_repeats": (1, "one timing at least")}}
# ... parameters that must divide another one ...
PARAMETER_DIVIDES = {"01_theory": {"n_head": "d"}}
# ... and those whose default, None, names no type: the type of any other value.
NONE_DEFAULT_TYPES = {"03_training": {"run_dir": str}, "04_analysis": {"fig_dir": str},
                      "05_sweep": {"variants": list, "seeds": list, "figure_path": str}}
_TYPE_NAMES = {bool: "true or false", int: "a whole number (int)", float: "a number (float)",
               str: "a string", list: "a list", dict: "a mapping"}


def notebook_defaults(name: str) -> dict[str, Any]:
    """Name -> default value of what notebooks/<name>.ipynb's parameters cell assigns: the
    parameters it reads. papermill parameters cells hold literals, so no code is run."""
    import nbformat

    path = NOTEBOOKS / f"{name}.ipynb"
    if not path.is_file():
        raise ConfigError(f"no notebook {name!r}: notebooks/ holds "
                          f"{', '.join(sorted(p.stem for p in NOTEBOOKS.glob('*.ipynb')))}")
    nb = nbformat.read(str(path), as_version=4)
    cell = next((c for c in nb.cells if "parameters" in c.metadata.get("tags", [])), None)
    if cell is None:
        return {}
    return {t.id: ast.literal_eval(node.value) for node in ast.parse(cell.source).body
            if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}


def _fits(value: Any, kind: type | None) -> bool:
    """Whether ``value`` is of type ``kind`` (any value for None, which names no type); bool is not
    taken for a number, a whole number is for a float."""
    if kind is None:
        return True
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def check_notebook_parameters(name: str, values: dict[str, Any], where: str | None = None) -> None:
    """Raise ConfigError unless every item of ``values`` is a parameter of notebooks/<name>.ipynb,
    of the type of its default there (where that is None: None or the type in
    ``NONE_DEFAULT_TYPES``) and, where listed, one of its ``PARAMETER_CHOICES``, at least its
    ``PARAMETER_MINIMA`` and a divisor of its ``PARAMETER_DIVIDES`` (a parameter left out of
    ``values`` counts with its default). The message names the parameter, the value and what
    it must be.

    The plan calls it when it is read, the runner before it executes a notebook, and each
    notebook first, on its parameters: papermill injects whatever it is given, and
    ``-p overrides train.steps=20`` (a string) would be taken apart into characters. ``where``:
    what the message writes before a parameter's name (a plan: "FILE: study.parameters.NAME.");
    None: a notebook's own call."""
    defaults = notebook_defaults(name)
    label = where if where is not None else f"notebook {name}: parameter "
    for key, value in values.items():
        if key not in defaults:
            raise ConfigError(f"{label}{key} is not a parameter of {name}.ipynb; its parameters are "
                              f"{', '.join(defaults)}")
        default = defaults[key]
        kind = type(default) if default is not None else NONE_DEFAULT_TYPES.get(name, {}).get(key)
        if not (_fits(value, kind) or (value is None and default is None)):
            expected = _TYPE_NAMES.get(kind, kind.__name__)
            expected = f"None or {expected}" if default is None else expected
            # papermill's -p passes text (or a number): a list or mapping needs -y
            hint = (f"; give a list or mapping to papermill as YAML with -y, e.g. -y '{key}: "
                    f"{'[...]' if kind is list else '{...}'}'"
                    if where is None and kind in (list, dict) and isinstance(value, str) else "")
            raise ConfigError(f"{label}{key} must be {expected} (the notebook's default is {default!r}); "
                              f"got {value!r}{hint}")
        choices = PARAMETER_CHOICES.get(name, {}).get(key)
        if choices is not None and value not in choices:
            raise ConfigError(f"{label}{key} must be one of {', '.join(choices)}; got {value!r}")
        minimum, why = PARAMETER_MINIMA.get(name, {}).get(key, (None, ""))
        if minimum is not None and value < minimum:
            raise ConfigError(f"{label}{key} must be at least {minimum} ({why}); got {value!r}")
    for key, other in PARAMETER_DIVIDES.get(name, {}).items():
        value, total = values.get(key, defaults[key]), values.get(other, defaults[other])
        if total % value:
            raise ConfigError(f"{label}{key} must divide {other} ({other} = {total} is split into {key} "
                              f"equal parts); got {key} = {value}")


# --------------------------------------------------------------------------------------------
# Executing a notebook: the one papermill call
# --------------------------------------------------------------------------------------------

class _Lines:
    """A file-like sink for papermill's stdout_file/stderr_file: whole lines, prefixed, to ``echo``."""

    def __init__(self, prefix: str, echo: Callable[[str], None]):
        self.prefix, self.echo, self.partial = prefix, echo, ""

    def write(self, text: str) -> None:
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            line = line.split("\r")[-1]   # a progress bar's redraws: keep the latest
            if line.strip():
                self.echo(self.prefix + line)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.write("\n")


def failed_cell(nb_path: str | Path) -> str | None:
    """'code cell N (`first line of source`): Error: message' of the first failed cell of an
    executed notebook (None: none failed, or no readable notebook)."""
    import nbformat

    try:
        nb = nbformat.read(str(nb_path), as_version=4)
    except Exception:
        return None
    code_index = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        code_index += 1
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                first = next((ln for ln in cell.source.splitlines() if ln.strip()), "")
                return (f"code cell {code_index} (`{first[:80]}`): {out.get('ename')}: "
                        f"{str(out.get('evalue'))[:500]}")
    return None


def execute_notebook(name: str, out_path: Path, parameters: dict[str, Any], prefix: str = "",
                     cwd: str | Path | None = None, echo: Callable[[str], None] = _say) -> Path:
    """Execute notebooks/<name>.ipynb with papermill into ``out_path``, its parameters checked
    first, its cells' printed output echoed line by line after ``prefix``; the kernel starts in
    ``cwd`` (default: this process's working directory). ExperimentError names the failed cell."""
    import papermill as pm

    src = NOTEBOOKS / f"{name}.ipynb"
    if not src.is_file():
        raise ExperimentError(f"notebook {src} not found")
    check_notebook_parameters(name, parameters)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # The kernel inherits this environment: it imports this checkout's oelm_core wherever it starts.
    os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]
    out, err = _Lines(prefix, echo), _Lines(prefix, echo)
    try:
        # The kernel's own log at ERROR: its start-up warning (TCP without encryption, on
        # localhost) would fill the log of a study once per notebook and run.
        pm.execute_notebook(str(src), str(out_path), parameters=parameters, kernel_name="python3",
                            cwd=str(cwd or os.getcwd()), progress_bar=False, stdout_file=out, stderr_file=err,
                            extra_arguments=["--IPKernelApp.log_level=ERROR"])
    except pm.PapermillExecutionError:
        raise ExperimentError(f"notebook {name} failed in {failed_cell(out_path)}\n"
                              f"  executed copy: {out_path}") from None
    except Exception as exc:   # the kernel did not start or died: no cell holds the error
        raise ExperimentError(f"notebook {name} failed before its cells ran ({type(exc).__name__}: {exc})\n"
                              f"  executed copy: {out_path}") from exc
    finally:
        out.close()
        err.close()
    return out_path


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------

@dataclass
class PlannedRun:
    """One training of a plan: ``python -m oelm_core.train --params PARAMS --set OVERRIDES...``
    (with the plan's own section left out of PARAMS), into ``run_dir``."""

    name: str
    params: Path                  # the parameter file it starts from
    seed: int
    variant: str
    preset: str
    run_dir: Path
    overrides: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)   # the parameters it trains (its params.yaml)
    info: dict = field(default_factory=dict)     # its place in the plan (its sweep_point.json)


@dataclass
class Plan:
    name: str
    kind: str                     # the file's plan section: experiment, study or sweep
    path: Path
    out: Path
    runs: list[PlannedRun]
    notebooks: list[str]
    parameters: dict[str, dict]
    runner: str
    gpus_per_run: int
    keep_checkpoints: bool = True
    description: str = ""
    launcher: str = "local"
    slurm: Any = None             # the SLURM jobs' settings (slurm.SlurmSettings) where launcher is slurm
    key: str | None = None        # the sweep axis, and its points (those trained: --smoke's)
    points: list[dict] = field(default_factory=list)
    variants: list[str] = field(default_factory=list)
    seeds: list[int | None] = field(default_factory=lambda: [None])
    smoke: bool = False

    @property
    def records(self) -> bool:
        """Whether the plan executes notebooks, which it records in OUT/study.json."""
        return any(n != "03_training" or self.runner == "notebook" for n in self.notebooks)


SECTIONS = ("experiment", "study", "sweep")
KEYS = {"experiment": {"name", "description", "runs", "variants", "key", "points", "smoke", "seeds", "overrides",
                       "notebooks", "parameters", "runner", "gpus_per_run", "keep_checkpoints", "launcher", "slurm"},
        "study": {"name", "description", "runs", "seeds", "overrides", "gpus_per_run", "notebooks", "parameters",
                  "launcher", "slurm"},
        "sweep": {"name", "key", "variants", "seeds", "points", "smoke", "launcher", "slurm"}}
DEFAULTS = {"experiment": {"notebooks": ["03_training"], "runner": "notebook"},
            "study": {"notebooks": list(ALL_NOTEBOOKS), "runner": "notebook"},
            "sweep": {"notebooks": ["03_training"], "runner": "inprocess", "variants": list(GROUPS), "seeds": [0]}}
RUN_KEYS = {"params", "name", "overrides"}
VARIANT_KEYS = {"name", "variant", "set"}
POINT_KEYS = {"value", "set"}
SMOKE_KEYS = {"points", "set"}
# Notebook parameters the plan sets itself (per run, or from its folder): a value given under
# parameters would be overwritten without a word ...
PLAN_SET_PARAMETERS = {"03_training": {"params": "{section}.runs", "overrides": "{section}.overrides",
                                       "run_dir": "--out"},
                       "04_analysis": {"run_dirs": "{section}.runs", "out_dir": "--out"}}
# ... and those it sets where gpus_per_run > 0: each run's GPUs.
GPU_SET_PARAMETERS = {"03_training": {
    "nproc": "each run gets {section}.gpus_per_run processes, one per GPU",
    "cuda_visible_devices": "each run gets {section}.gpus_per_run GPUs of its own, of those in the "
                            "{section}'s CUDA_VISIBLE_DEVICES"}}


def _check_keys(values: dict, valid: set[str], where: str, path: Path) -> None:
    unknown = sorted(map(str, set(values) - valid))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(f'{where}.{k}' for k in unknown)}; valid keys "
                          f"of {where}: {', '.join(sorted(valid))}")


def _yaml_value(value: Any) -> str:
    """``value`` as the YAML text a --set string carries (strings quoted where YAML would read
    them as something else: 'off', '2024', ' #')."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True).strip()
    return text.removesuffix("\n...").strip()


def _set_strings(values: Any, where: str, path: Path) -> list[str]:
    """A list of --set strings, or a mapping {dotted key: value}, as --set strings."""
    if isinstance(values, dict):
        return [f"{k}={_yaml_value(v)}" for k, v in values.items()]
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ConfigError(f"{path}: {where} must be a list of key=value strings, e.g. [train.steps=50], "
                          f"or a mapping of dotted keys to values, e.g. {{train.steps: 50}}; got {values!r}")
    return list(values)


def _set_mapping(values: Any, where: str, path: Path) -> dict:
    if not isinstance(values or {}, dict):
        raise ConfigError(f"{path}: {where} must map dotted keys to values, e.g. {{model.n_layer: 2}}; "
                          f"got {values!r}")
    return dict(values or {})


def _check_points(points: Any, where: str, path: Path) -> list[dict]:
    if not isinstance(points, list) or not points or not all(isinstance(p, dict) and "value" in p
                                                             for p in points):
        raise ConfigError(f"{path}: {where} must be a list of {{value: v, set: {{key: value}}}}; got {points!r}")
    for i, point in enumerate(points):
        _check_keys(point, POINT_KEYS, f"{where}[{i}]", path)
        _set_mapping(point.get("set"), f"{where}[{i}].set", path)
    return points


def _check_seeds(seeds: Any, where: str, path: Path, default: list[int] | None) -> list[int]:
    if not (isinstance(seeds, list) and seeds
            and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
        otherwise = default or "each parameter file's train.seed"
        raise ConfigError(f"{path}: {where} must be a non-empty list of whole numbers, e.g. [0] or [0, 1] "
                          f"(leave the key out for {otherwise}); got {seeds!r}")
    return seeds


def _check_variants(entries: Any, where: str, path: Path) -> list[dict]:
    """The variants axis as [{name, variant, set}]: a bare name is {name: it, variant: it}."""
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: {where} must be a list of variant names, e.g. [gpt_base] or [gpt_base, "
                          f"oelm_freeze], or of {{name: NAME, variant: VARIANT, set: {{...}}}}; got {entries!r}")
    out = []
    for i, entry in enumerate(entries):
        entry = {"name": entry, "variant": entry} if isinstance(entry, str) else entry
        if not isinstance(entry, dict) or not isinstance(entry.get("variant"), str):
            raise ConfigError(f"{path}: {where}[{i}] must be a variant name or {{name: NAME, variant: "
                              f"VARIANT, set: {{...}}}}; got {entry!r}")
        _check_keys(entry, VARIANT_KEYS, f"{where}[{i}]", path)
        out.append({"name": str(entry.get("name", entry["variant"])), "variant": entry["variant"],
                    "set": _set_mapping(entry.get("set"), f"{where}[{i}].set", path)})
    known = sorted(known_variants())
    unknown = [e["variant"] for e in out if e["variant"] not in known]
    if unknown:
        raise ConfigError(f"{path}: {where} has unknown variant(s) {unknown}; choose from {known}")
    names = [e["name"] for e in out]
    if len(set(names)) != len(names):
        raise ConfigError(f"{path}: {where} names a variant twice ({names}); give each entry its own name")
    return out


def _check_runs(entries: Any, where: str, path: Path) -> list[dict]:
    """The runs axis as [{params, name?, overrides}]: a bare path is {params: path}."""
    if not isinstance(entries, list):
        raise ConfigError(f"{path}: {where} must be a list of parameter files (or {{params: PATH, name: NAME, "
                          f"overrides: [...]}} entries); got {entries!r}")
    out = []
    for i, entry in enumerate(entries):
        entry = {"params": entry} if isinstance(entry, str) else entry
        if not isinstance(entry, dict) or not isinstance(entry.get("params"), str):
            raise ConfigError(f"{path}: {where}[{i}] needs a parameter file: write it as a path, or as "
                              f"{{params: PATH, name: NAME, overrides: [...]}}; got {entry!r}")
        _check_keys(entry, RUN_KEYS, f"{where}[{i}]", path)
        if not isinstance(entry.get("name", ""), str):
            raise ConfigError(f"{path}: {where}[{i}].name must be a string, got {entry['name']!r}")
        params = Path(entry["params"])
        if not params.is_absolute() and (path.parent / params).is_file():
            params = path.parent / params
        out.append({"params": params, "name": entry.get("name"),
                    "overrides": _set_strings(entry.get("overrides") or [], f"{where}[{i}].overrides", path)})
    return out


def _check_notebooks(notebooks: Any, where: str, path: Path, default: list[str]) -> list[str]:
    if not isinstance(notebooks, list) or not notebooks:
        raise ConfigError(f"{path}: {where} must be a non-empty list of notebooks to run, e.g. [03_training, "
                          f"04_analysis] (leave the key out for {default}); got {notebooks!r}")
    bad = [n for n in notebooks if n not in ALL_NOTEBOOKS]
    if bad:
        raise ConfigError(f"{path}: {where} names {bad}; choose from {list(ALL_NOTEBOOKS)}")
    if len(set(notebooks)) != len(notebooks):
        raise ConfigError(f"{path}: {where} lists a notebook twice ({notebooks}); list each once")
    return notebooks


def _check_parameters(parameters: Any, section: str, path: Path, gpus_per_run: int,
                      notebooks: Sequence[str]) -> dict[str, dict]:
    """The plan's notebook parameters, checked against the notebooks (``check_notebook_parameters``)
    when the plan is read: a wrong value would otherwise surface only when its notebook runs,
    after every training. Those the plan sets itself are refused. Only the ``notebooks`` the plan
    runs are opened: a plan narrowed to its trainings (--set study.notebooks=[03_training], on a
    GPU image without nbformat) keeps the others' parameters for a later call."""
    if not isinstance(parameters, dict):
        raise ConfigError(f"{path}: {section}.parameters must map notebook names to parameters, e.g. "
                          f"{{01_theory: {{d: 256}}}}; got {parameters!r}")
    for nb, values in parameters.items():
        if nb not in ALL_NOTEBOOKS:
            raise ConfigError(f"{path}: {section}.parameters names the notebook {nb!r}; choose from "
                              f"{list(ALL_NOTEBOOKS)}")
        if not isinstance(values or {}, dict):
            raise ConfigError(f"{path}: {section}.parameters.{nb} must map parameter names to values, "
                              f"got {values!r}")
        for key in values or {}:
            where = f"{path}: {section}.parameters.{nb}.{key}"
            if key in PLAN_SET_PARAMETERS.get(nb, {}):
                raise ConfigError(f"{where} is set by the {section} itself; "
                                  f"use {PLAN_SET_PARAMETERS[nb][key].format(section=section)} instead")
            if gpus_per_run > 0 and key in GPU_SET_PARAMETERS.get(nb, {}):
                why = GPU_SET_PARAMETERS[nb][key].format(section=section)
                raise ConfigError(f"{where} is set by the {section} itself where {section}.gpus_per_run > 0 "
                                  f"({why}); leave it out of {section}.parameters.{nb}")
        if nb in notebooks:
            check_notebook_parameters(nb, values or {}, where=f"{path}: {section}.parameters.{nb}.")
    return {nb: dict(values or {}) for nb, values in parameters.items()}


def _read_plan(path: Path, section_sets: list[str]) -> tuple[str, dict, dict]:
    """(section name, the section with its --set strings applied, the file's training parameters)."""
    raw = read_yaml(path)
    found = [s for s in SECTIONS if s in raw]
    if len(found) != 1:
        raise ConfigError(f"{path} needs one plan section, `experiment:` (see parameters/ablations.yaml), "
                          f"or the older `study:` or `sweep:`; it has {found or 'none'}")
    section = found[0]
    if not isinstance(raw[section], dict):
        raise ConfigError(f"{path}: the {section} section must be a mapping of its keys, got {raw[section]!r}")
    for s in section_sets:
        if s.split("=", 1)[0].strip().split(".")[0] != section:
            raise ConfigError(f"--set {s!r}: this file's plan section is `{section}:`; write "
                              f"{section}.{s.split('.', 1)[-1]}")
    spec = apply_overrides(raw, section_sets)[section]
    _check_keys(spec, KEYS[section], section, path)
    # A key written without a value (`seeds:`) reads as None: the same as leaving it out.
    spec = {k: v for k, v in spec.items() if v is not None}
    base = {k: v for k, v in raw.items() if k != section}
    return section, spec, base


def _parameters(path: Path) -> dict:
    """A parameter file's training parameters (a plan file's without its plan section)."""
    if not Path(path).is_file():
        raise ConfigError(f"parameter file {path} not found; pass an existing YAML file "
                          f"(see parameters/ for examples)")
    return {k: v for k, v in read_yaml(path).items() if k not in SECTIONS}


@dataclass
class _Axes:
    """What a plan trains: every (seed, point, run, variant), with the --set strings every run gets
    before its own (``first``: the smoke settings, the section's overrides) and after (``last``:
    the caller's)."""

    runs: list[dict]              # [{params, name, overrides}]
    listed_runs: bool             # the section lists runs (else: the plan file's own parameters)
    variants: list[dict]          # [{name, variant, set}]
    key: str | None
    points: list[dict]            # [{value, set}]
    seeds: list[int | None]       # [None]: each file's own train.seed
    first: list[str]
    last: list[str]


def load_plan(path: str | Path, out: str | Path | None = None, sets: Sequence[str] = (), *,
              smoke: bool = False, only: Sequence[str] | None = None,
              overrides: list[str] | dict | None = None, variants: Sequence[str] | None = None,
              seeds: Sequence[int] | None = None, runner: str | None = None,
              out_root: str | Path | None = None, launcher: str | None = None,
              cluster: dict | None = None, gpus_per_run: int | None = None) -> Plan:
    """Read and check a plan file; every run's parameters are validated before anything runs.

    ``sets``: --set strings; SECTION.KEY=VALUE (study.seeds=[1,2]) changes the plan section, any
    other goes to every run, after the plan's own settings. ``overrides`` (--set strings or
    {dotted key: value}) goes to every run too. ``smoke``: the section's smoke points and settings
    (a sweep without them: its first two points). ``only``: the names of the variants (or runs)
    to train. ``variants``, ``seeds``, ``runner``, ``launcher``, ``gpus_per_run``: replace the
    section's; ``cluster``: SLURM settings laid over its slurm section. ``out``: the plan's
    folder (default runs/<name>, runs/<name>_smoke for --smoke; a sweep's runs/sweeps/<name>);
    or ``out_root``: the folder that holds it."""
    path = Path(path)
    if not path.is_file() and not path.is_absolute() and (REPO / path).is_file():
        path = REPO / path   # a path from the repository root, called from elsewhere
    if not path.is_file():
        raise ConfigError(f"plan file {path} not found; pass a study (parameters/study_*.yaml), a sweep "
                          f"(parameters/sweeps/*.yaml) or parameters/ablations.yaml")
    section_sets = [s for s in sets if s.split("=", 1)[0].strip().split(".")[0] in SECTIONS]
    section, spec, base = _read_plan(path, section_sets)
    spec.update({k: list(v) for k, v in (("variants", variants), ("seeds", seeds)) if v is not None})
    spec.update({k: v for k, v in (("runner", runner), ("launcher", launcher), ("gpus_per_run", gpus_per_run))
                 if v is not None})
    if cluster:
        spec["slurm"] = {**(spec.get("slurm") or {}), **cluster}
    plan = _plan_settings(section, spec, path)
    axes = _axes(section, spec, path, smoke, only)
    axes.last = [s for s in sets if s not in section_sets] + _set_strings(overrides or [], "overrides", path)
    folder = f"{plan.name}_smoke" if smoke else plan.name
    plan.out = Path(out) if out is not None else Path(out_root) / folder if out_root is not None else (
        Path("runs") / "sweeps" / folder if section == "sweep" else Path("runs") / folder)
    plan.key, plan.points, plan.seeds = axes.key, axes.points, axes.seeds
    plan.variants, plan.smoke = [e["name"] for e in axes.variants], smoke
    plan.runs = _plan_runs(plan, base, axes)
    needs_runs = [n for n in ("03_training", "04_analysis") if n in plan.notebooks]
    if needs_runs and not plan.runs:
        raise ConfigError(f"{path} lists no runs under {section}.runs for {' and '.join(needs_runs)}; "
                          f"add parameter files there or leave those notebooks out of {section}.notebooks")
    return plan


def _plan_settings(section: str, spec: dict, path: Path) -> Plan:
    """A Plan of the section's settings (name, notebooks and their parameters, runner, GPUs per
    run, checkpoints kept), its runs still to come."""
    defaults = DEFAULTS[section]
    for key in ("name", "description"):
        if not isinstance(spec.get(key, ""), str):
            raise ConfigError(f"{path}: {section}.{key} must be a string, got {spec[key]!r}")
    gpus_per_run = spec.get("gpus_per_run", 0)
    if not isinstance(gpus_per_run, int) or isinstance(gpus_per_run, bool) or gpus_per_run < 0:
        raise ConfigError(f"{path}: {section}.gpus_per_run must be a whole number of GPUs per run "
                          f"(0 for CPU), got {gpus_per_run!r}")
    runner = spec.get("runner", defaults["runner"])
    if runner not in RUNNERS:
        raise ConfigError(f"{path}: {section}.runner must be one of {', '.join(RUNNERS)}; got {runner!r}")
    if runner == "inprocess" and gpus_per_run > 1:
        raise ConfigError(f"{path}: runner inprocess trains in this process, on one device at most; for "
                          f"{section}.gpus_per_run={gpus_per_run} use the runner subprocess or notebook")
    keep = spec.get("keep_checkpoints", True)
    if not isinstance(keep, bool):
        raise ConfigError(f"{path}: {section}.keep_checkpoints must be true or false, got {keep!r}")
    launcher = spec.get("launcher", "local")
    if launcher not in LAUNCHERS:
        raise ConfigError(f"{path}: {section}.launcher must be one of {', '.join(LAUNCHERS)}; got {launcher!r}")
    # Checked under either launcher: a typo there fails now, not when the plan reaches the cluster.
    settings = slurm.SlurmSettings.from_dict(spec.get("slurm") or {}, f"{path}: {section}.slurm")
    if launcher == "slurm":
        runner = "subprocess"   # each job runs the training command itself: no notebook, no thread here
    notebooks = _check_notebooks(spec.get("notebooks", defaults["notebooks"]), f"{section}.notebooks", path,
                                 defaults["notebooks"])
    return Plan(name=spec.get("name") or (path.stem.removeprefix("study_") if section == "study" else path.stem),
                kind=section, path=path.resolve(), out=Path(), runs=[], notebooks=notebooks,
                parameters=_check_parameters(spec.get("parameters", {}), section, path, gpus_per_run, notebooks),
                runner=runner, gpus_per_run=gpus_per_run, keep_checkpoints=keep,
                description=spec.get("description", ""), launcher=launcher,
                slurm=settings if launcher == "slurm" else None)


def _axes(section: str, spec: dict, path: Path, smoke: bool, only: Sequence[str] | None) -> _Axes:
    """The section's axes, checked: runs, variants, the sweep axis (--smoke's points), seeds."""
    defaults = DEFAULTS[section]
    seeds = spec.get("seeds", defaults.get("seeds", [None]))
    if section == "study" and isinstance(seeds, int) and not isinstance(seeds, bool):
        seeds = [seeds]   # the study's shorthand: seeds: 7
    if "seeds" in spec:
        _check_seeds(seeds, f"{section}.seeds", path, defaults.get("seeds"))
    variants = (_check_variants(spec.get("variants", defaults.get("variants")), f"{section}.variants", path)
                if "variants" in spec or "variants" in defaults else [])
    key = spec.get("key")
    if ("key" in spec) != ("points" in spec) or (section == "sweep" and key is None):
        raise ConfigError(f"{path}: a sweep axis needs both {section}.key (the swept value's name) and "
                          f"{section}.points ([{{value: v, set: {{dotted.key: value}}}}])")
    points = _check_points(spec["points"], f"{section}.points", path) if "points" in spec else []
    smoke_spec = spec.get("smoke") or {}
    if not isinstance(smoke_spec, dict):
        raise ConfigError(f"{path}: {section}.smoke must be a mapping with points and set, got {smoke_spec!r}")
    _check_keys(smoke_spec, SMOKE_KEYS, f"{section}.smoke", path)
    if smoke_spec.get("points"):
        _check_points(smoke_spec["points"], f"{section}.smoke.points", path)
    smoke_set = _set_mapping(smoke_spec.get("set"), f"{section}.smoke.set", path)
    if smoke:
        if not smoke_spec and not points:
            raise ConfigError(f"{path} has no {section}.smoke section (points, set) for --smoke")
        points = smoke_spec.get("points") or points[:2]
    if "runs" in spec:
        runs = _check_runs(spec["runs"], f"{section}.runs", path)
    else:   # a study names its parameter files; any other plan may train its own parameters
        runs = [] if section == "study" else [{"params": path, "name": None, "overrides": []}]
    if only:
        pool = variants or runs
        have = [e["name"] or "" for e in pool]
        unknown = sorted(set(only) - set(have))
        if unknown:
            raise ConfigError(f"--only names {unknown}, which {path} does not plan; its "
                              f"{'variants' if variants else 'runs'} are {have}")
        pool[:] = [e for e in pool if e["name"] in only]
    first = ([f"{k}={_yaml_value(v)}" for k, v in smoke_set.items()] if smoke else []) \
        + _set_strings(spec.get("overrides", []), f"{section}.overrides", path)
    return _Axes(runs, "runs" in spec, variants, key, points, list(seeds), first, [])


def _fmt_value(v: Any) -> str:
    return str(v).replace("/", "_").replace(" ", "")


def _plan_runs(plan: Plan, base: dict, axes: _Axes) -> list[PlannedRun]:
    """Every (seed, point, run, variant) as a PlannedRun, seed outermost, its parameters loaded and
    checked. Its --set strings, in order: the plan's (axes.first), the run entry's, the point's,
    the variant's, the caller's (axes.last), then the variant, seed and name the plan gives it."""
    runs: list[PlannedRun] = []
    for seed in axes.seeds:
        for point in axes.points or [None]:
            for entry in axes.runs:
                own = Path(entry["params"]).resolve() == plan.path
                values = base if own else _parameters(entry["params"])
                for variant in axes.variants or [None]:
                    sets = axes.first + entry["overrides"]
                    sets += [f"{k}={_yaml_value(v)}" for k, v in (point or {}).get("set", {}).items()]
                    sets += [f"{k}={_yaml_value(v)}" for k, v in (variant or {}).get("set", {}).items()]
                    sets += axes.last + ([f"variant={variant['variant']}"] if variant else [])
                    sets += [f"train.seed={seed}"] if seed is not None else []
                    cfg = run_config_from_dict(apply_overrides(values, sets))
                    run_name = entry["name"] or cfg.name
                    if plan.kind == "study":
                        name = f"{run_name}_s{cfg.train.seed}" if axes.seeds != [None] else run_name
                        run_dir = plan.out / "runs" / name
                    else:
                        parts = ([f"{axes.key}={_fmt_value(point['value'])}"] if point else []) \
                            + ([run_name] if axes.listed_runs else []) \
                            + ([variant["name"]] if variant else []) \
                            + ([f"seed{cfg.train.seed}"] if seed is not None else [])
                        name = "/".join(parts or [run_name])
                        run_dir = plan.out / name
                    # the name quoted: as YAML, a bare `off` or `2024` would be a bool or an int
                    sets += ([f"train.seed={cfg.train.seed}"] if seed is None else []) \
                        + [f"name={json.dumps(name, ensure_ascii=False)}"]
                    config = {**apply_overrides(values, sets), "out_dir": str(run_dir)}
                    info = {"sweep": plan.name, "key": axes.key, "value": point["value"] if point else None,
                            "variant": cfg.variant, "seed": cfg.train.seed,
                            "label": variant["name"] if variant else run_name, "smoke": plan.smoke}
                    runs.append(PlannedRun(name, Path(entry["params"]).resolve(), cfg.train.seed, cfg.variant,
                                           cfg.preset, run_dir, sets, config, info))
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ConfigError(f"two runs of {plan.path} share a name ({names}); give each run entry a 'name'")
    return runs


# --------------------------------------------------------------------------------------------
# Running: the trainings side by side, then the plan's notebooks
# --------------------------------------------------------------------------------------------

def _status(run_dir: Path) -> dict:
    """run_dir/summary.json ({} where there is no readable one)."""
    try:
        summary = json.loads((Path(run_dir) / "summary.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return summary if isinstance(summary, dict) else {}


def check_run_folder(run: PlannedRun) -> None:
    """Raise ConfigError when run.run_dir already holds a run trained with other settings: skipping
    or resuming it would report that run as the planned one. Settings the trainer resumes
    across (config.EXECUTION_KEYS) may differ: the folder still holds the planned run."""
    saved_file = run.run_dir / "config.yaml"   # the trainer's own record of what it trained
    if not saved_file.is_file():
        return
    fix = f"train into another folder (--out), or delete {run.run_dir} to train it again"
    try:
        saved = trained_settings(read_yaml(saved_file))
    except ConfigError as exc:
        raise ConfigError(f"{run.run_dir} holds a run whose config.yaml cannot be read ({exc}); {fix}") from None
    planned = trained_settings(run.config)
    changed = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in planned.items() if saved.get(k) != v]
    if changed:
        raise ConfigError(f"{run.run_dir} holds a run trained with other settings than planned "
                          f"({'; '.join(changed)}); {fix}")


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def _prepare_data(plan: Plan, log: Callable[[str], None]) -> None:
    """Tokenise each distinct data set once, before runs that may start side by side."""
    from oelm_core.data import prepare

    seen = set()
    for run in plan.runs:
        cfg = run_config_from_dict(run.config).data
        key = (cfg.source, cfg.out_dir, cfg.max_train_stories, cfg.max_val_stories, cfg.text_field)
        if key not in seen:
            seen.add(key)
            log(f"[{plan.kind}] preparing data {cfg.out_dir} (source {os.environ.get('OELM_DATA') or cfg.source})")
            prepare(cfg, progress=False)


def _slots(plan: Plan, log: Callable[[str], None]) -> list[str | None]:
    """The GPU sets trainings run on side by side: indices as this process numbers its GPUs
    (launch_training maps them to the machine's); [None] for one training at a time."""
    g = plan.gpus_per_run
    if g == 0 or plan.runner == "inprocess":
        log(f"[{plan.kind}] {len(plan.runs)} training(s) one after another"
            + (" on CPU" if g == 0 else f", {plan.runner}"))
        return [None]
    n_gpu = _gpu_count()
    if n_gpu < g:
        raise ExperimentError(f"{plan.kind}.gpus_per_run={g}, but this machine has {n_gpu} GPU(s); set "
                              f"--set {plan.kind}.gpus_per_run=0 for CPU or fewer GPUs per run")
    n_slots = min(len(plan.runs), n_gpu // g)
    log(f"[{plan.kind}] {len(plan.runs)} training(s) on {n_gpu} GPU(s), {g} each, {n_slots} side by side")
    return [",".join(str(k * g + i) for i in range(g)) for k in range(n_slots)]


def _train(plan: Plan, run: PlannedRun, gpus: str | None, log: Callable[[str], None]) -> str | None:
    """Train one run with the plan's runner, resuming from its newest checkpoint; returns the
    trainer's final status (None: no summary.json)."""
    params_file = run.run_dir / "params.yaml"
    launch = dict(plan.parameters.get("03_training") or {})
    nproc = max(1, plan.gpus_per_run) if gpus is not None else int(launch.get("nproc", 1))
    devices = gpus if gpus is not None else launch.get("cuda_visible_devices", "")
    prefix = f"  [{run.name}] "
    if plan.runner == "inprocess":
        from oelm_core.train import train  # imported late: reading a plan needs no torch start

        return train(run_config_from_dict(run.config), resume=True).get("status")
    if plan.runner == "subprocess":
        launch_training(params_file, nproc=nproc, cuda_visible_devices=devices, run_dir=run.run_dir,
                        resume=True, progress=launch.get("progress_bar"), echo=lambda line: log(prefix + line))
    else:
        execute_notebook("03_training", run.run_dir / "03_training.ipynb",
                         {"resume": True, **launch, "params": str(params_file.resolve()), "overrides": [],
                          "run_dir": str(run.run_dir.resolve()), "nproc": nproc, "cuda_visible_devices": devices},
                         prefix=prefix, echo=log)
    return _status(run.run_dir).get("status")


def run_trainings(plan: Plan, *, skip_done: bool = True, budget_s: float = 0.0,
                  log: Callable[[str], None] = _say) -> list[dict]:
    """Train every run of ``plan`` (seed-major), side by side on the GPUs where gpus_per_run > 0;
    returns one row per run: its sweep_point.json items and status, wall_s, out_dir (and error).

    A run that fails is recorded and the others go on. ``skip_done``: a run whose summary.json
    says it ended is skipped. ``budget_s`` > 0: no run starts after that many seconds (the rest
    are "not started"; the same call again continues with them). ConfigError, before any run,
    for a run folder that holds a run trained with other settings."""
    for run in plan.runs:
        check_run_folder(run)
    _prepare_data(plan, log)
    from oelm_core.data import with_real_source  # as _prepare_data: reading a plan needs no torch
    slots = _slots(plan, log)
    free: queue.Queue = queue.Queue()
    for s in slots:
        free.put(s)
    t0 = time.perf_counter()

    def one(i: int, run: PlannedRun) -> dict:
        row = {**run.info, "status": "not started", "wall_s": 0.0, "out_dir": str(run.run_dir)}
        summary = _status(run.run_dir)
        if skip_done and summary.get("status") in FINISHED:
            log(f"[{plan.kind}] {run.name} already ended ({summary['status']} at step {summary.get('steps')}): "
                f"nothing to train; {run.run_dir}")
            return {**row, "status": "skipped"}
        gpus = free.get()
        try:
            elapsed = time.perf_counter() - t0
            if budget_s and elapsed > budget_s:
                return row
            log(f"[{plan.kind}] training {i + 1}/{len(plan.runs)}, {elapsed:.0f}s: {run.name} ({run.variant}, "
                f"seed {run.seed})" + (f" on GPUs {gpus}" if gpus is not None else ""))
            run.run_dir.mkdir(parents=True, exist_ok=True)
            # the folder OELM_DATA names, not the plan's hub id: what the run reads
            write_text_atomic(run.run_dir / "params.yaml", yaml.safe_dump(with_real_source(run.config), sort_keys=False))
            write_text_atomic(run.run_dir / "sweep_point.json", json.dumps(run.info, indent=2) + "\n")
            try:
                status = _train(plan, run, gpus, log) or "failed"
                error = None if status != "failed" else f"no summary.json in {run.run_dir}"
            except Exception as exc:  # one failed run must not lose the others
                status, error = "failed", f"{type(exc).__name__}: {exc}"
            row.update(status=status, wall_s=time.perf_counter() - t0 - elapsed)
            if error:
                row["error"] = error
                log(f"[{plan.kind}] FAILED {run.name}: {error}")
            elif status in FINISHED and not plan.keep_checkpoints:
                shutil.rmtree(run.run_dir / "ckpt", ignore_errors=True)   # best.pt stays
            return row
        finally:
            free.put(gpus)

    if len(slots) == 1:
        rows = [one(i, run) for i, run in enumerate(plan.runs)]
    else:
        with ThreadPoolExecutor(len(slots)) as pool:
            rows = list(pool.map(one, range(len(plan.runs)), plan.runs))
    left = sum(r["status"] == "not started" for r in rows)
    if left:
        log(f"[{plan.kind}] time budget of {budget_s:.0f}s used: {left} run(s) not started (run the same "
            f"command again to continue)")
    log(f"[{plan.kind}] {sum(r['status'] in FINISHED + ('skipped',) for r in rows)}/{len(rows)} run(s) done "
        f"in {time.perf_counter() - t0:.0f}s")
    return rows


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _earlier_notebooks(plan: Plan) -> dict[str, dict]:
    """Name -> record of the notebooks an earlier call of this plan executed into plan.out, from
    its study.json: a partial re-run (notebooks=[03_training]) keeps their record, as their
    outputs stay in the folder."""
    try:
        old = json.loads((plan.out / "study.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(old, dict) or old.get("name") != plan.name:
        return {}
    records = {}
    for item in old.get("notebooks") or []:
        if isinstance(item, dict) and item.get("name") in ALL_NOTEBOOKS:
            records[item["name"]] = item
        elif item in ALL_NOTEBOOKS and old.get("status") == "completed":  # names only: an older study.json
            records[item] = {"name": item, "executed": old.get("created")}
    return records


def _write_record(plan: Plan, status: str, executed: dict[str, dict], created: str,
                  error: str | None = None) -> dict:
    """study.json: this call's status, the record of every notebook executed into the folder
    (``executed``: name -> record, this call's and earlier ones), and the planned runs."""
    notebook = plan.runner == "notebook"
    data = {"name": plan.name, "created": created, "status": status, "study_file": str(plan.path),
            "notebooks": [executed[n] for n in ALL_NOTEBOOKS if n in executed],
            "runs": [{"name": r.name, "variant": r.variant, "preset": r.preset, "seed": r.seed,
                      "run_dir": str(r.run_dir.relative_to(plan.out)),
                      **({"notebook": str((r.run_dir / "03_training.ipynb").relative_to(plan.out))}
                         if notebook else {})}
                     for r in plan.runs]}
    if error:
        data["error"] = error
    if plan.records:
        plan.out.mkdir(parents=True, exist_ok=True)
        write_text_atomic(plan.out / "study.json", json.dumps(data, indent=2))
    return data


def run_plan(plan: Plan, *, skip_done: bool = True, budget_s: float = 0.0,
             log: Callable[[str], None] = _say) -> dict:
    """Execute the plan's steps in order into plan.out (03_training: every training,
    ``run_trainings``; the others: their notebook); returns study.json's content (written where
    the plan executes notebooks). ExperimentError where a notebook or a training failed."""
    plan.out.mkdir(parents=True, exist_ok=True)
    created = _now()
    executed = _earlier_notebooks(plan)
    _write_record(plan, "running", executed, created)
    figures = (plan.out / "figures").resolve()
    try:
        for k, name in enumerate(plan.notebooks, 1):
            log(f"[{plan.kind}] step {k}/{len(plan.notebooks)}: {name}")
            if name == "03_training":
                rows = (slurm.run_trainings(plan, plan.slurm, skip_done=skip_done, log=log)
                        if plan.launcher == "slurm" else
                        run_trainings(plan, skip_done=skip_done, budget_s=budget_s, log=log))
                failed = [r for r in rows if r["status"] in ("failed", "not started")]
                if failed:
                    raise ExperimentError(f"{len(failed)} of {len(rows)} training(s) did not finish: " + "; ".join(
                        f"{Path(r['out_dir']).name if plan.kind == 'study' else r['out_dir']}: "
                        f"{r.get('error', r['status'])}" for r in failed))
            else:
                params = dict(plan.parameters.get(name) or {})
                if name == "01_theory":
                    params.setdefault("fig_dir", str(figures))
                if name == "04_analysis":
                    params.update(run_dirs=[str(r.run_dir.resolve()) for r in plan.runs],
                                  out_dir=str(plan.out.resolve()))
                    params.setdefault("fig_dir", str(figures))
                execute_notebook(name, plan.out / "notebooks" / f"{name}.ipynb", params, prefix="  ", echo=log)
            output = "runs/*/03_training.ipynb" if name == "03_training" else f"notebooks/{name}.ipynb"
            executed[name] = {"name": name, "executed": _now(),
                              **({"output": output} if name != "03_training" or plan.runner == "notebook" else {})}
            _write_record(plan, "running", executed, created)
    except (ExperimentError, ConfigError) as e:
        _write_record(plan, "failed", executed, created, error=str(e))
        raise
    data = _write_record(plan, "completed", executed, created)
    # results.md only where this call wrote it: an earlier call's would pass for this one's
    log(f"[{plan.kind}] done: {plan.out}" + ("/study.json" if plan.records else "")
        + (f", {plan.out}/results.md" if "04_analysis" in plan.notebooks else ""))
    return data


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None, prog: str = "python -m oelm_core.experiment") -> int:
    """The CLI; returns the exit code: 0 done, 1 a notebook or training failed, 2 unusable input
    (plan file, --set, parameter file, data), as for python -m oelm_core.train."""
    p = argparse.ArgumentParser(prog=prog, description="Run a plan (a study, a sweep, the ablations): its "
                                                       "trainings and notebooks, headless.")
    p.add_argument("plan", help="a plan file, e.g. parameters/study_smoke.yaml, parameters/ablations.yaml or "
                                "parameters/sweeps/a6_layers.yaml")
    p.add_argument("--out", help="the plan's folder (default: runs/<name>; a sweep's runs/sweeps/<name>)")
    p.add_argument("--set", dest="sets", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="SECTION.KEY=VALUE changes the plan section (study.seeds=[1,2]); anything else goes "
                        "to every run (train.steps=20)")
    p.add_argument("--smoke", action="store_true", help="the plan's smoke points and settings")
    p.add_argument("--only", nargs="+", metavar="NAME", help="the variants (or runs) to train (default: all)")
    p.add_argument("--runner", choices=RUNNERS, help="how each training runs (default: the plan's)")
    p.add_argument("--budget-s", type=float, default=0.0, help="start no training after this many seconds")
    p.add_argument("--launcher", choices=LAUNCHERS, help="where the trainings run: local (default) or slurm, "
                                                         "a batch job each (docs/cluster.md)")
    p.add_argument("--gpus-per-run", type=int, help="GPUs per training (default: the plan's gpus_per_run)")
    cluster = p.add_argument_group("SLURM jobs (--launcher slurm; default: the plan's slurm section)")
    cluster.add_argument("--partition")
    cluster.add_argument("--time", help="each job's time limit, e.g. 4:00:00")
    cluster.add_argument("--account")
    cluster.add_argument("--nodes", type=int, help="nodes per training (gpus-per-run GPUs on each)")
    p.add_argument("--keep-checkpoints", action="store_true", help="keep each finished run's ckpt/ folder")
    args = p.parse_args(argv)
    tag = f"[{prog.split('.')[-1]}]"
    try:
        cluster = {k: getattr(args, k) for k in ("partition", "time", "account", "nodes") if getattr(args, k) is not None}
        plan = load_plan(args.plan, args.out, args.sets, smoke=args.smoke, only=args.only, runner=args.runner,
                         launcher=args.launcher, cluster=cluster, gpus_per_run=args.gpus_per_run)
        if plan.launcher == "slurm" and args.budget_s:
            raise ConfigError("--budget-s starts no local training after that many seconds; under --launcher "
                              "slurm each job has its own time limit: use --time instead")
        plan.keep_checkpoints = plan.keep_checkpoints or args.keep_checkpoints
        _say(f"[{plan.kind}] {plan.name}: {len(plan.runs)} run(s), steps {', '.join(plan.notebooks)} -> {plan.out}")
        run_plan(plan, budget_s=args.budget_s)
    except (ConfigError, RuntimeError) as e:  # a failed notebook or training: ExperimentError
        print(f"{tag} FAILED: {e}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, ConfigError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
