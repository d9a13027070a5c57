"""The whole study, headless: the notebooks executed by papermill with injected parameters.

    python -m oelm_core.study parameters/study_smoke.yaml [--out runs/<name>] [--set key=value ...]

A study file has one ``study`` section (see parameters/study_smoke.yaml):

    study:
      name: smoke
      runs: [smoke/gpt_base.yaml, ...]    # parameter files, relative to the study file, or
                                           # {params: FILE, name: NAME, overrides: [...]}
      seeds: [42]                          # every run is trained once per seed (train.seed);
                                           # leave the key out for each file's own seed
      overrides: []                        # --set strings applied to every run
      gpus_per_run: 0                      # 0: CPU; g: g GPUs (torchrun) per run
      notebooks: [01_theory, 02_model, 03_training, 04_analysis]   # run in this order; leave
                                           # the key out for all four (an empty list is an error)
      parameters: {01_theory: {...}, ...}  # papermill parameters per notebook: the names its
                                           # parameters cell defines, of the types of its defaults

``--set study.KEY=VALUE`` changes the study section; any other ``--set`` is handed to every run
(e.g. ``--set train.steps=20``). The study folder receives the executed notebooks, figures, one
run folder per (run, seed) with its executed 03_training notebook, results.md/results.json and
study.json, which the app reads: the planned runs, and when each notebook was last executed into
the folder (a call that runs some of them, e.g. --set 'study.notebooks=[03_training]', keeps the
record of the others).

Trainings run one after another; with gpus_per_run = g > 0 and enough GPUs they run side by
side, run k on GPUs [k*g, (k+1)*g) of those the study sees (numbered as torch numbers them:
under CUDA_VISIBLE_DEVICES=2,3, GPU 0 is the machine's GPU 2).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

import yaml

from oelm_core.analysis import WHICH
from oelm_core.config import ConfigError, apply_overrides, load_run_config, read_yaml
from oelm_core.files import write_text_atomic
from oelm_core.sweep import RUNNERS

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO / "notebooks"
ALL_NOTEBOOKS = ("01_theory", "02_model", "03_training", "04_analysis")


class StudyError(RuntimeError):
    """A study that cannot start or a notebook that failed (the message names notebook and cell)."""


# --------------------------------------------------------------------------------------------
# Launching one training (what notebook 03 calls)
# --------------------------------------------------------------------------------------------

def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child process: the repo importable, output unbuffered."""
    env = dict(os.environ)
    paths = [str(REPO)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def train_command(params: str | Path, overrides: Sequence[str] = (), nproc: int = 1,
                  resume: bool = False) -> list[str]:
    """The command line of one training: ``python -m oelm_core.train`` for one process,
    ``torchrun --standalone --nproc_per_node N -m oelm_core.train`` for several."""
    if nproc < 1:
        raise ConfigError(f"nproc must be at least 1, got {nproc}")
    if nproc == 1:
        cmd = [sys.executable, "-m", "oelm_core.train"]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
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
    cfg = load_run_config(params, overrides)  # a bad parameter fails here, before any launch
    extra = ({} if cuda_visible_devices is None
             else {"CUDA_VISIBLE_DEVICES": child_visible_devices(cuda_visible_devices)})
    cmd = train_command(Path(params).resolve(), overrides, nproc, resume)
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
# The study file
# --------------------------------------------------------------------------------------------

@dataclass
class PlannedRun:
    name: str
    params: Path
    seed: int
    variant: str
    preset: str
    run_dir: Path
    overrides: list[str] = field(default_factory=list)


@dataclass
class Study:
    name: str
    path: Path
    out: Path
    runs: list[PlannedRun]
    notebooks: list[str]
    gpus_per_run: int
    parameters: dict[str, dict]
    description: str = ""


STUDY_KEYS = {"name", "description", "runs", "seeds", "overrides", "gpus_per_run", "notebooks",
              "parameters"}
RUN_KEYS = {"params", "name", "overrides"}
# Notebook parameters the study sets itself (per run, or from the study's folder): a value given
# under study.parameters would be overwritten without a word.
STUDY_SET_PARAMETERS = {"03_training": {"params": "study.runs", "overrides": "study.overrides",
                                        "run_dir": "--out"},
                        "04_analysis": {"run_dirs": "study.runs", "out_dir": "--out"}}
# ... and those it sets where study.gpus_per_run > 0: each run's GPUs.
GPU_SET_PARAMETERS = {"03_training": {
    "nproc": "each run gets study.gpus_per_run processes, one per GPU",
    "cuda_visible_devices": "each run gets study.gpus_per_run GPUs of its own, of those in the study's "
                            "CUDA_VISIBLE_DEVICES"}}


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
    import ast

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

    Each notebook calls it first, on its parameters: papermill injects whatever it is given, and
    ``-p overrides train.steps=20`` (a string) would be taken apart into characters. ``where``:
    what the message writes before a parameter's name (the study: "FILE: study.parameters.NAME.");
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


def _check_parameters(parameters: Any, path: Path, gpus_per_run: int) -> dict[str, dict]:
    """study.parameters, checked against the notebooks, the names their parameters cells define
    and the types of the defaults there (``check_notebook_parameters``): a wrong value would
    otherwise surface only when its notebook runs, after every training. Those the study sets
    itself are refused."""
    if not isinstance(parameters, dict):
        raise ConfigError(f"{path}: study.parameters must map notebook names to parameters, e.g. "
                          f"{{01_theory: {{d: 256}}}}; got {parameters!r}")
    for nb, values in parameters.items():
        if nb not in ALL_NOTEBOOKS:
            raise ConfigError(f"{path}: study.parameters names the notebook {nb!r}; choose from "
                              f"{list(ALL_NOTEBOOKS)}")
        if not isinstance(values or {}, dict):
            raise ConfigError(f"{path}: study.parameters.{nb} must map parameter names to values, "
                              f"got {values!r}")
        for key in values or {}:
            where = f"{path}: study.parameters.{nb}.{key}"
            if key in STUDY_SET_PARAMETERS.get(nb, {}):
                raise ConfigError(f"{where} is set by the study itself; "
                                  f"use {STUDY_SET_PARAMETERS[nb][key]} instead")
            if gpus_per_run > 0 and key in GPU_SET_PARAMETERS.get(nb, {}):
                raise ConfigError(f"{where} is set by the study itself where study.gpus_per_run > 0 "
                                  f"({GPU_SET_PARAMETERS[nb][key]}); leave it out of study.parameters.{nb}")
        check_notebook_parameters(nb, values or {}, where=f"{path}: study.parameters.{nb}.")
    return {nb: dict(values or {}) for nb, values in parameters.items()}


def _str_list(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} must be a list of key=value strings, e.g. [train.steps=50], "
                          f"got {value!r}")
    return value


def load_study(path: str | Path, out: str | Path | None = None, sets: Sequence[str] = ()) -> Study:
    """Read and check a study file; every run's parameters are validated before anything runs.

    ``sets``: --set strings; study.KEY=VALUE changes the study section, any other goes to every run."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"study file {path} not found; pass one of parameters/study_*.yaml")
    study_sets = [s for s in sets if s.split("=", 1)[0].strip().startswith("study.")]
    run_sets = [s for s in sets if s not in study_sets]
    spec = _study_section(path, study_sets)
    name = spec.get("name") or path.stem.replace("study_", "")
    out = Path(out) if out is not None else Path("runs") / name
    notebooks = _check_notebooks(spec.get("notebooks", list(ALL_NOTEBOOKS)), path)
    gpus_per_run = _check_gpus_per_run(spec.get("gpus_per_run", 0), path)
    parameters = _check_parameters(spec.get("parameters", {}), path, gpus_per_run)
    seeds = _study_seeds(spec, path)
    common = _str_list(spec.get("overrides", []), f"{path}: study.overrides") + run_sets
    runs = _plan_runs(spec.get("runs", []), seeds, common, path, out)
    needs_runs = [n for n in ("03_training", "04_analysis") if n in notebooks]
    if needs_runs and not runs:
        raise ConfigError(f"{path} lists no runs under study.runs for {' and '.join(needs_runs)}; "
                          f"add parameter files there or leave those notebooks out of study.notebooks")
    return Study(name=name, path=path.resolve(), out=out, runs=runs, notebooks=notebooks,
                 gpus_per_run=gpus_per_run, parameters=parameters,
                 description=spec.get("description", ""))


def _study_section(path: Path, study_sets: list[str]) -> dict:
    """The file's study section with the study.KEY=VALUE sets applied, its keys checked; keys
    written without a value left out."""
    raw = read_yaml(path)
    if not isinstance(raw.get("study"), dict):
        raise ConfigError(f"{path} needs a top-level 'study:' section (see parameters/study_smoke.yaml)")
    spec = apply_overrides(raw, study_sets)["study"]
    unknown = sorted(set(spec) - STUDY_KEYS)
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join('study.' + k for k in unknown)}; valid keys: "
                          f"{', '.join(sorted(STUDY_KEYS))}")
    # A key written without a value (`seeds:`) reads as None: the same as leaving it out.
    spec = {k: v for k, v in spec.items() if v is not None}
    for key in ("name", "description"):
        if not isinstance(spec.get(key, ""), str):
            raise ConfigError(f"{path}: study.{key} must be a string, got {spec[key]!r}")
    return spec


def _check_notebooks(notebooks: Any, path: Path) -> list[str]:
    if not isinstance(notebooks, list) or not notebooks:
        raise ConfigError(f"{path}: study.notebooks must be a non-empty list of notebooks to run, "
                          f"e.g. [03_training, 04_analysis] (leave the key out for all of "
                          f"{list(ALL_NOTEBOOKS)}); got {notebooks!r}")
    bad = [n for n in notebooks if n not in ALL_NOTEBOOKS]
    if bad:
        raise ConfigError(f"{path}: study.notebooks names {bad}; choose from {list(ALL_NOTEBOOKS)}")
    if len(set(notebooks)) != len(notebooks):
        raise ConfigError(f"{path}: study.notebooks lists a notebook twice ({notebooks}); list each once")
    return notebooks


def _check_gpus_per_run(gpus_per_run: Any, path: Path) -> int:
    if not isinstance(gpus_per_run, int) or isinstance(gpus_per_run, bool) or gpus_per_run < 0:
        raise ConfigError(f"{path}: study.gpus_per_run must be a whole number of GPUs per run "
                          f"(0 for CPU), got {gpus_per_run!r}")
    return gpus_per_run


def _study_seeds(spec: dict, path: Path) -> list[int | None]:
    """study.seeds as a list; [None] where the key is left out: each parameter file's train.seed."""
    if "seeds" not in spec:
        return [None]
    seeds = spec["seeds"] if isinstance(spec["seeds"], list) else [spec["seeds"]]
    if not seeds or not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        raise ConfigError(f"{path}: study.seeds must be a non-empty list of whole numbers, e.g. "
                          f"[42, 43] (leave the key out for each parameter file's train.seed); "
                          f"got {spec['seeds']!r}")
    return seeds


def _run_entry(entry: Any, where: str) -> dict:
    """One item of study.runs as {params, name?, overrides?}: a bare path is {params: path}."""
    entry = {"params": entry} if isinstance(entry, str) else entry
    if not isinstance(entry, dict) or not isinstance(entry.get("params"), str):
        raise ConfigError(f"{where} needs a parameter file: write it as a path, or as "
                          f"{{params: PATH, name: NAME, overrides: [...]}}; got {entry!r}")
    unknown = sorted(set(entry) - RUN_KEYS)
    if unknown:
        raise ConfigError(f"{where} has unknown key(s) {', '.join(map(str, unknown))}; valid keys: "
                          f"{', '.join(sorted(RUN_KEYS))}")
    if not isinstance(entry.get("name", ""), str):
        raise ConfigError(f"{where}.name must be a string, got {entry['name']!r}")
    return entry


def _plan_runs(entries: Any, seeds: list[int | None], common: list[str], path: Path,
               out: Path) -> list[PlannedRun]:
    """One PlannedRun per (study.runs entry, seed), its parameters loaded and checked; the run
    folders go to out/runs/<name>, with _s<seed> appended where the study names seeds."""
    if not isinstance(entries, list):
        raise ConfigError(f"{path}: study.runs must be a list of parameter files (or {{params: "
                          f"PATH, name: NAME, overrides: [...]}} entries); got {entries!r}")
    runs: list[PlannedRun] = []
    for i, entry in enumerate(entries):
        where = f"{path}: study.runs[{i}]"
        entry = _run_entry(entry, where)
        params = Path(entry["params"])
        if not params.is_absolute():
            params = (path.parent / params) if (path.parent / params).is_file() else params
        overrides = common + _str_list(entry.get("overrides") or [], f"{where}.overrides")
        for seed in seeds:
            cfg = load_run_config(params, overrides + ([f"train.seed={seed}"] if seed is not None else []))
            rname = entry.get("name") or cfg.name
            rname = f"{rname}_s{cfg.train.seed}" if seeds != [None] else rname
            # the name quoted: as YAML, a bare `off` or `2024` would be a bool or an int
            run_overrides = overrides + [f"train.seed={cfg.train.seed}",
                                         f"name={json.dumps(rname, ensure_ascii=False)}"]
            runs.append(PlannedRun(rname, params.resolve(), cfg.train.seed, cfg.variant, cfg.preset,
                                   out / "runs" / rname, run_overrides))
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise ConfigError(f"two runs of {path} share a name ({names}); give each run entry a 'name'")
    return runs


# --------------------------------------------------------------------------------------------
# Executing notebooks
# --------------------------------------------------------------------------------------------

_print_lock = threading.Lock()
# papermill's per-cell markers and the reprs of rich outputs say nothing in a log
_NOISE = re.compile(r"^(Ending Cell \d+-*|<IPython\.core\.display\.\w+ object>|<Figure size .*>|"
                    r"VBox\(children=.*|\[IPKernelApp\] WARNING \| Kernel is running over TCP.*)$")


def _say(msg: str) -> None:
    with _print_lock:
        print(msg, flush=True)


def failed_cell(nb_path: str | Path) -> str | None:
    """'cell N (first line of source): Error: message' of the first failed cell of an executed notebook."""
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
                     cwd: str | Path | None = None) -> Path:
    """Execute notebooks/<name>.ipynb with papermill in a child process, streaming its cell
    outputs prefixed by ``prefix``; raises StudyError naming the failed cell."""
    src = NOTEBOOKS / f"{name}.ipynb"
    if not src.is_file():
        raise StudyError(f"notebook {src} not found")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    params_file = out_path.with_suffix(".parameters.yaml")
    params_file.write_text(yaml.safe_dump(parameters, sort_keys=False))
    cmd = [sys.executable, "-m", "papermill", str(src), str(out_path), "-f", str(params_file),
           "--log-output", "--no-progress-bar", "--cwd", str(cwd or os.getcwd()), "-k", "python3"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(), bufsize=1)
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip("\n")
        # papermill logs each output line as "<timestamp> - papermill - INFO - <text>"
        text = line.split(" - INFO - ", 1)[-1] if " - papermill - " in line else line
        if text.strip() and not _NOISE.match(text):
            _say(f"{prefix}{text}")
    rc = proc.wait()
    if rc != 0:
        where = failed_cell(out_path) or "before any cell ran (kernel or parameters; see the log above)"
        raise StudyError(f"notebook {name} failed in {where}\n  executed copy: {out_path}")
    return out_path


# --------------------------------------------------------------------------------------------
# The study
# --------------------------------------------------------------------------------------------

def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _notebook_record(name: str) -> dict:
    """study.json's record of a notebook executed now: when it ended and where its executed copy is."""
    output = "runs/*/03_training.ipynb" if name == "03_training" else f"notebooks/{name}.ipynb"
    return {"name": name, "executed": _now(), "output": output}


def _earlier_notebooks(study: Study) -> dict[str, dict]:
    """Name -> record of the notebooks an earlier call of this study executed into study.out, from
    its study.json: a partial re-run (study.notebooks=[03_training]) keeps their record, as their
    outputs stay in the folder."""
    try:
        old = json.loads((study.out / "study.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(old, dict) or old.get("name") != study.name:
        return {}
    records = {}
    for item in old.get("notebooks") or []:
        if isinstance(item, dict) and item.get("name") in ALL_NOTEBOOKS:
            records[item["name"]] = item
        elif item in ALL_NOTEBOOKS and old.get("status") == "completed":  # names only: an older study.json
            records[item] = {"name": item, "executed": old.get("created")}
    return records


def _write_study_json(study: Study, status: str, executed: dict[str, dict], created: str,
                      error: str | None = None) -> dict:
    """study.json: this call's status, the record of every notebook executed into the folder
    (``executed``: name -> record, this call's and earlier ones), and the planned runs."""
    data = {"name": study.name, "created": created, "status": status, "study_file": str(study.path),
            "notebooks": [executed[n] for n in ALL_NOTEBOOKS if n in executed],
            "runs": [{"name": r.name, "variant": r.variant, "preset": r.preset, "seed": r.seed,
                      "run_dir": str(r.run_dir.relative_to(study.out)),
                      "notebook": str((r.run_dir / "03_training.ipynb").relative_to(study.out))}
                     for r in study.runs]}
    if error:
        data["error"] = error
    study.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(study.out / "study.json", json.dumps(data, indent=2))
    return data


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0


def _prepare_data(study: Study) -> None:
    """Tokenise each distinct data set once, before runs that may start side by side."""
    from oelm_core.data import prepare

    seen = set()
    for run in study.runs:
        cfg = load_run_config(run.params, run.overrides).data
        key = (cfg.source, cfg.out_dir, cfg.max_train_stories, cfg.max_val_stories, cfg.text_field)
        if key not in seen:
            seen.add(key)
            _say(f"[study] preparing data {cfg.out_dir} (source {os.environ.get('OELM_DATA') or cfg.source})")
            prepare(cfg, progress=False)


def _train_all(study: Study) -> None:
    nb_params = dict(study.parameters.get("03_training") or {})
    g = study.gpus_per_run
    slots: list[str | None]
    if g > 0:
        n_gpu = _gpu_count()
        if n_gpu < g:
            raise StudyError(f"study.gpus_per_run={g}, but this machine has {n_gpu} GPU(s); set "
                             f"--set study.gpus_per_run=0 for CPU or fewer GPUs per run")
        n_slots = min(len(study.runs), n_gpu // g)
        # Indices as this process numbers its GPUs; launch_training maps them to the machine's.
        slots = [",".join(str(k * g + i) for i in range(g)) for k in range(n_slots)]
        _say(f"[study] {len(study.runs)} training(s) on {n_gpu} GPU(s), {g} each, "
             f"{n_slots} side by side")
    else:
        slots = [None]
        _say(f"[study] {len(study.runs)} training(s) on CPU, one after another")
    free: queue.Queue = queue.Queue()
    for s in slots:
        free.put(s)

    def one(i: int, run: PlannedRun) -> None:
        gpus = free.get()
        try:
            _say(f"[study] training {i + 1}/{len(study.runs)}: {run.name} ({run.variant}, seed {run.seed})"
                 + (f" on GPUs {gpus}" if gpus is not None else ""))
            # resume: a study run again continues its runs that were cut short and leaves those
            # that ended as they are (the trainer refuses a run folder trained with other settings).
            params = {"resume": True, **nb_params, "params": str(run.params), "overrides": run.overrides,
                      "run_dir": str(run.run_dir.resolve()),
                      "nproc": max(1, g) if g > 0 else int(nb_params.get("nproc", 1)),
                      "cuda_visible_devices": gpus if gpus is not None else nb_params.get("cuda_visible_devices", "")}
            execute_notebook("03_training", run.run_dir / "03_training.ipynb", params, prefix=f"  [{run.name}] ")
        finally:
            free.put(gpus)

    if len(slots) == 1:
        for i, run in enumerate(study.runs):
            one(i, run)
        return
    with ThreadPoolExecutor(len(slots)) as pool:
        futures = [pool.submit(one, i, r) for i, r in enumerate(study.runs)]
        errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]


def run_study(study: Study) -> dict:
    """Execute the study's notebooks and trainings into study.out; returns study.json's content."""
    out = study.out
    out.mkdir(parents=True, exist_ok=True)
    created = _now()
    executed = _earlier_notebooks(study)
    _write_study_json(study, "running", executed, created)
    figures = (out / "figures").resolve()
    steps = study.notebooks
    try:
        for k, name in enumerate(steps, 1):
            _say(f"[study] step {k}/{len(steps)}: {name}")
            if name == "03_training":
                _prepare_data(study)
                _train_all(study)
            else:
                params = dict(study.parameters.get(name) or {})
                if name == "01_theory":
                    params.setdefault("fig_dir", str(figures))
                if name == "04_analysis":
                    params.update(run_dirs=[str(r.run_dir.resolve()) for r in study.runs],
                                  out_dir=str(out.resolve()))
                    params.setdefault("fig_dir", str(figures))
                execute_notebook(name, out / "notebooks" / f"{name}.ipynb", params, prefix="  ")
            executed[name] = _notebook_record(name)
            _write_study_json(study, "running", executed, created)
    except (StudyError, ConfigError, RuntimeError) as e:
        _write_study_json(study, "failed", executed, created, error=str(e))
        raise
    data = _write_study_json(study, "completed", executed, created)
    # results.md only where this call wrote it: an earlier call's would pass for this one's
    _say(f"[study] done: {out}/study.json" + (f", {out}/results.md" if "04_analysis" in steps else ""))
    return data


def main(argv: list[str] | None = None) -> int:
    """The CLI; returns the exit code: 0 done, 1 a notebook or training failed, 2 unusable input
    (study file, --set, parameter file, data), as for python -m oelm_core.train."""
    p = argparse.ArgumentParser(prog="python -m oelm_core.study",
                                description="Execute a study (notebooks, trainings, analysis) headless.")
    p.add_argument("study", help="a study file, e.g. parameters/study_smoke.yaml")
    p.add_argument("--out", help="study folder (default: runs/<study name>)")
    p.add_argument("--set", dest="sets", action="extend", nargs="+", default=[], metavar="KEY=VALUE",
                   help="study.KEY=VALUE changes the study; anything else goes to every run "
                        "(e.g. --set train.steps=20 study.seeds=[1,2])")
    args = p.parse_args(argv)
    try:
        study = load_study(args.study, args.out, args.sets)
        _say(f"[study] {study.name}: {len(study.runs)} run(s), notebooks {', '.join(study.notebooks)} "
             f"-> {study.out}")
        run_study(study)
    except (ConfigError, RuntimeError) as e:  # a failed notebook (StudyError) or training: RuntimeError
        print(f"[study] FAILED: {e}", file=sys.stderr, flush=True)
        return 2 if isinstance(e, ConfigError) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
