"""A plan: the trainings and notebooks of a study, a sweep or the ablations, read from one file.

A plan file is a training parameter file (the base of its runs) plus an ``experiment:`` section,
whose keys are ``ExperimentSection``'s (docs/experiments.md has the whole schema):

    experiment:
      name: ablations
      runs: [smoke/gpt_base.yaml, {params: FILE, name: NAME, overrides: [...]}]   # leave out: this file
      variants: [gpt_base, {name: progressive, variant: oelm_freeze, set: {DOTTED.KEY: VALUE}}]
      key: n_layer                           # a sweep axis: the key, and its points
      points: [{value: 2, set: {model.n_layer: 2}}, ...]
      seeds: [0, 1]                          # leave out: each file's own train.seed
      notebooks: [03_training]               # the steps; 03_training stands for the trainings

The plan trains every (seed, point, run, variant), seed outermost, so that a plan cut short has
one seed of each. Every run's parameters are loaded and checked here, before anything runs. The
section is built and checked by the parameter schema's one builder (config.build_section), one
dataclass per part, so that a new key is a new field.

The older sections ``study:`` and ``sweep:`` still load: they are read as ``experiment:`` with
their own defaults made explicit, and a line says what to change in the file.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import yaml

from oelm_core.checkout import REPO
from oelm_core.config import ConfigError, build_section, run_config_from_dict
from oelm_core.config import (
    variants as known_variants,
)
from oelm_core.groups import GROUPS
from oelm_core.notebooks import check_notebook_parameters
from oelm_core.parameter_files import apply_overrides, read_yaml

SECTION = "experiment"
STEPS = ("01_theory", "02_model", "03_training", "04_analysis")  # the notebooks a plan may run, in order
TRAININGS = "03_training"  # the step that stands for the plan's trainings
RUNNERS = ("inprocess", "subprocess", "notebook")
LAUNCHERS = ("local", "slurm")  # where trainings run: child processes here, or SLURM jobs
LAYOUTS = ("axes", "study")  # run folders: OUT/<key>=<value>/<run>/<variant>/seed<S>, or OUT/runs/<run>_s<seed>
# The older plan sections, read as `experiment:` with these defaults (what renaming them needs).
OLDER_SECTIONS = {
    "study": {"layout": "study", "notebooks": list(STEPS)},
    "sweep": {"variants": list(GROUPS), "seeds": [0], "runner": "inprocess", "out": "runs/sweeps/{name}"},
}
# Notebook parameters the plan sets itself (per run, or from its folder): a value given under
# parameters would be overwritten without a word ...
PLAN_SET_PARAMETERS = {
    "03_training": {"params": "{section}.runs", "overrides": "{section}.overrides", "run_dir": "--out"},
    "04_analysis": {"run_dirs": "{section}.runs", "out_dir": "--out"},
}
# ... and those it sets where gpus_per_run > 0: each run's GPUs.
GPU_SET_PARAMETERS = {
    "03_training": {
        "nproc": "each run gets {section}.gpus_per_run processes, one per GPU",
        "cuda_visible_devices": "each run gets {section}.gpus_per_run GPUs of its own, of those in the "
        "{section}'s CUDA_VISIBLE_DEVICES",
    }
}


# --------------------------------------------------------------------------------------------
# The schema: a dataclass per part of the section
# --------------------------------------------------------------------------------------------


@dataclass
class SlurmSettings:
    """``experiment.slurm`` (or the CLI's --partition, --time, ...): how each run's SLURM job asks
    for its resources. None: the cluster's default. GPUs per run: experiment.gpus_per_run."""

    partition: Union[str, int, None] = None
    time: Union[str, int, None] = None  # the time limit, in SLURM's format: "30", "4:00:00", "1-00:00:00"
    account: Union[str, int, None] = None
    nodes: int = 1  # > 1: gpus_per_run GPUs on each of them, one torchrun each
    cpus_per_task: Optional[int] = None  # CPU cores of each node's torchrun (or training)
    mem: Union[str, int, None] = None  # memory per node, e.g. "64G"
    signal_s: int = 120  # seconds before the time limit that USR1 warns the job
    sbatch_args: list = field(default_factory=list)  # further sbatch options, e.g. ["--qos=high"]
    poll_s: float = 15.0  # seconds between two looks at the queue

    def validate(self, where: str) -> "SlurmSettings":
        for key in ("partition", "time", "account", "mem"):  # YAML reads `time: 30` as a number
            if getattr(self, key) is not None:
                setattr(self, key, str(getattr(self, key)))
        for key, least in (("nodes", 1), ("cpus_per_task", 1), ("signal_s", 1)):
            value = getattr(self, key)
            if value is not None and value < least:
                raise ConfigError(f"{where}.{key} must be a whole number of at least {least}, got {value!r}")
        if self.poll_s <= 0:
            raise ConfigError(f"{where}.poll_s must be a positive number of seconds, got {self.poll_s!r}")
        if not all(isinstance(a, str) and a.startswith("--") for a in self.sbatch_args):
            raise ConfigError(
                f"{where}.sbatch_args must be a list of sbatch options, e.g. ['--qos=high'], got {self.sbatch_args!r}"
            )
        return self


@dataclass
class RunEntry:
    """``experiment.runs[i]``, or the bare path it stands for: a parameter file (relative to the
    plan file), the run's name (default: the file's ``name``), --set strings for it alone."""

    params: str = ""
    name: Optional[str] = None
    overrides: Union[list, dict] = field(default_factory=list)


@dataclass
class VariantEntry:
    """``experiment.variants[i]``, or the bare variant name it stands for."""

    variant: str = ""
    name: Optional[str] = None  # default: the variant's name
    set: dict = field(default_factory=dict)


@dataclass
class Point:
    """``experiment.points[i]``: the swept value and the settings that give it."""

    value: Any = None
    set: dict = field(default_factory=dict)


@dataclass
class SmokeSection:
    """``experiment.smoke``: what --smoke trains instead (without it: the first two points)."""

    points: Optional[list] = None
    set: dict = field(default_factory=dict)


@dataclass
class ExperimentSection:
    """The ``experiment:`` section of a plan file, every key optional."""

    name: Optional[str] = None  # default: the file's name
    description: str = ""
    layout: str = "axes"  # "study": run folders OUT/runs/<run>_s<seed> beside the notebooks' outputs
    out: Optional[str] = None  # the plan's folder (default: runs/<name>; --smoke: <out>_smoke)
    runs: Optional[list] = None  # [RunEntry]; None: the plan file's own parameters
    variants: Optional[list] = None  # [VariantEntry]
    key: Optional[str] = None  # the sweep axis' name ...
    points: Optional[list] = None  # ... and its points [Point]
    smoke: SmokeSection = field(default_factory=SmokeSection)
    seeds: Union[list, int, None] = None  # None: each parameter file's train.seed
    overrides: Union[list, dict] = field(default_factory=list)  # --set strings (or {dotted key: value}) for every run
    notebooks: list = field(default_factory=lambda: [TRAININGS])
    parameters: dict = field(default_factory=dict)  # papermill parameters per notebook
    runner: str = "notebook"  # how a training runs: notebook (papermill runs 03_training), subprocess, inprocess
    gpus_per_run: int = 0  # 0: CPU; g: g GPUs (torchrun) per run, side by side
    # k > 1: k trainings share each GPU (set) at once. Small models leave an H200 idle between
    # kernels, so k runs finish sooner than k runs in turn; their tokens/s are then shares of a GPU
    # (summary.json's timed_alone says so, and the analysis leaves their speed out).
    runs_per_gpu: int = 1
    keep_checkpoints: bool = True  # false: a finished run keeps best.pt, not its ckpt/
    launcher: str = "local"  # slurm: each training a SLURM job (runner/slurm.py)
    slurm: SlurmSettings = field(default_factory=SlurmSettings)

    def validate(self, where: str, plan_file: Path) -> "ExperimentSection":
        """Check what the builder's types do not say, and turn the entries into their dataclasses;
        ``where`` names the section in messages, ``plan_file`` anchors the runs' relative paths."""
        for key, choices in (("runner", RUNNERS), ("launcher", LAUNCHERS), ("layout", LAYOUTS)):
            if getattr(self, key) not in choices:
                raise ConfigError(f"{where}.{key} must be one of {', '.join(choices)}; got {getattr(self, key)!r}")
        if self.gpus_per_run < 0:
            raise ConfigError(
                f"{where}.gpus_per_run must be a whole number of GPUs per run (0 for CPU), got {self.gpus_per_run!r}"
            )
        if self.runs_per_gpu < 1 or (self.runs_per_gpu > 1 and (self.gpus_per_run < 1 or self.launcher != "local")):
            raise ConfigError(
                f"{where}.runs_per_gpu must be a whole number of at least 1 (trainings sharing a "
                f"GPU at once), above 1 only with {where}.gpus_per_run >= 1 and the local launcher; "
                f"got {self.runs_per_gpu!r}"
            )
        if self.runner == "inprocess" and self.gpus_per_run > 1:
            raise ConfigError(
                f"runner inprocess trains in this process, on one device at most; for "
                f"{where}.gpus_per_run={self.gpus_per_run} use the runner subprocess or notebook"
            )
        self.slurm.validate(f"{where}.slurm")  # under either launcher: a typo fails now, not on the cluster
        self.seeds = _seeds(self.seeds, f"{where}.seeds")
        self.overrides = set_strings(self.overrides, f"{where}.overrides")
        self.runs = None if self.runs is None else _runs(self.runs, f"{where}.runs", plan_file)
        self.variants = None if self.variants is None else _variants(self.variants, f"{where}.variants")
        if (self.key is None) != (self.points is None):
            raise ConfigError(
                f"a sweep axis needs both {where}.key (the swept value's name) and "
                f"{where}.points ([{{value: v, set: {{dotted.key: value}}}}])"
            )
        self.points = None if self.points is None else _points(self.points, f"{where}.points")
        if self.smoke.points is not None:
            self.smoke.points = _points(self.smoke.points, f"{where}.smoke.points")
        if self.layout == "study" and (self.variants or self.points):
            raise ConfigError(
                f"{where}.layout study names each run folder runs/<run>_s<seed>: it crosses runs "
                f"and seeds alone; for variants or points leave {where}.layout out (axes)"
            )
        _notebooks(self.notebooks, f"{where}.notebooks")
        _notebook_parameters(self.parameters, where, self.gpus_per_run, self.notebooks)
        return self


def set_strings(values: Any, where: str) -> list[str]:
    """A list of --set strings, or a mapping {dotted key: value}, as --set strings."""
    if isinstance(values, dict):
        return [f"{k}={yaml_value(v)}" for k, v in values.items()]
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise ConfigError(
            f"{where} must be a list of key=value strings, e.g. [train.steps=50], "
            f"or a mapping of dotted keys to values, e.g. {{train.steps: 50}}; got {values!r}"
        )
    return list(values)


def yaml_value(value: Any) -> str:
    """``value`` as the YAML text a --set string carries (strings quoted where YAML would read
    them as something else: 'off', '2024', ' #')."""
    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 30, allow_unicode=True).strip()
    return text.removesuffix("\n...").strip()


def _entries(values: Any, cls: type, bare: str, what: str, where: str, example: str) -> list:
    """``values``, a list of mappings (or of bare strings, each the value of its ``bare`` key: the
    ``what`` an entry names), as ``cls`` instances."""
    if not isinstance(values, list):
        raise ConfigError(f"{where} must be a list of {what}s (or of {example} entries); got {values!r}")
    out = []
    for i, item in enumerate(values):
        item = {bare: item} if isinstance(item, str) else item
        if not isinstance(item, dict) or not isinstance(item.get(bare), str):
            raise ConfigError(f"{where}[{i}] needs a {what}: write it as one, or as {example}; got {item!r}")
        out.append(build_section(cls, item, f"{where}[{i}]"))
    return out


def _runs(values: Any, where: str, plan_file: Path) -> list[RunEntry]:
    runs = _entries(values, RunEntry, "params", "parameter file", where, "{params: PATH, name: NAME, overrides: [...]}")
    for i, run in enumerate(runs):
        params = Path(run.params)
        if not params.is_absolute() and (plan_file.parent / params).is_file():
            run.params = str(plan_file.parent / params)
        run.overrides = set_strings(run.overrides, f"{where}[{i}].overrides")
    return runs


def _variants(values: Any, where: str) -> list[VariantEntry]:
    if not values:
        raise ConfigError(f"{where} must be a non-empty list of variant names, e.g. [gpt_base, oelm_freeze]")
    entries = _entries(
        values, VariantEntry, "variant", "variant name", where, "{name: NAME, variant: VARIANT, set: {...}}"
    )
    for entry in entries:
        entry.name = entry.name or entry.variant
    known = sorted(known_variants())
    unknown = [e.variant for e in entries if e.variant not in known]
    if unknown:
        raise ConfigError(f"{where} has unknown variant(s) {unknown}; choose from {known}")
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where} names a variant twice ({names}); give each entry its own name")
    return entries


def _points(values: Any, where: str) -> list[Point]:
    if not isinstance(values, list) or not values or not all(isinstance(p, dict) and "value" in p for p in values):
        raise ConfigError(f"{where} must be a non-empty list of {{value: v, set: {{key: value}}}}; got {values!r}")
    return [build_section(Point, p, f"{where}[{i}]") for i, p in enumerate(values)]


def _seeds(seeds: Any, where: str) -> list[int | None]:
    """The seeds as a list ([None]: each parameter file's own train.seed); one whole number is one seed."""
    if seeds is None:
        return [None]
    seeds = [seeds] if isinstance(seeds, int) and not isinstance(seeds, bool) else seeds
    if not (isinstance(seeds, list) and seeds and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds)):
        raise ConfigError(
            f"{where} must be a non-empty list of whole numbers, e.g. [0] or [0, 1] (leave the key "
            f"out for each parameter file's train.seed); got {seeds!r}"
        )
    return seeds


def _notebooks(notebooks: list, where: str) -> None:
    if not notebooks:
        raise ConfigError(
            f"{where} must be a non-empty list of notebooks to run, e.g. [03_training, 04_analysis]; got {notebooks!r}"
        )
    bad = [n for n in notebooks if n not in STEPS]
    if bad:
        raise ConfigError(f"{where} names {bad}; choose from {list(STEPS)}")
    if len(set(notebooks)) != len(notebooks):
        raise ConfigError(f"{where} lists a notebook twice ({notebooks}); list each once")


def _notebook_parameters(parameters: dict, section: str, gpus_per_run: int, notebooks: Sequence[str]) -> None:
    """The plan's notebook parameters, checked against the notebooks (``check_notebook_parameters``)
    when the plan is read: a wrong value would otherwise surface only when its notebook runs,
    after every training. Those the plan sets itself are refused. Only the ``notebooks`` the plan
    runs are read: a plan narrowed to its trainings keeps the others' parameters for a later call."""
    for nb, values in parameters.items():
        if nb not in STEPS:
            raise ConfigError(f"{section}.parameters names the notebook {nb!r}; choose from {list(STEPS)}")
        if not isinstance(values or {}, dict):
            raise ConfigError(f"{section}.parameters.{nb} must map parameter names to values, got {values!r}")
        parameters[nb] = dict(values or {})
        for key in parameters[nb]:
            where = f"{section}.parameters.{nb}.{key}"
            if key in PLAN_SET_PARAMETERS.get(nb, {}):
                raise ConfigError(
                    f"{where} is set by the plan itself; "
                    f"use {PLAN_SET_PARAMETERS[nb][key].format(section=section)} instead"
                )
            if gpus_per_run > 0 and key in GPU_SET_PARAMETERS.get(nb, {}):
                why = GPU_SET_PARAMETERS[nb][key].format(section=section)
                raise ConfigError(
                    f"{where} is set by the plan itself where {section}.gpus_per_run > 0 "
                    f"({why}); leave it out of {section}.parameters.{nb}"
                )
        if nb in notebooks:
            check_notebook_parameters(nb, parameters[nb], where=f"{section}.parameters.{nb}.")


# --------------------------------------------------------------------------------------------
# The plan: the section expanded into its runs
# --------------------------------------------------------------------------------------------


@dataclass
class PlannedRun:
    """One training of a plan: ``python -m oelm_core.train --params PARAMS --set OVERRIDES...``
    (with the plan's own section left out of PARAMS), into ``run_dir``."""

    name: str
    params: Path  # the parameter file it starts from
    seed: int
    variant: str
    preset: str
    run_dir: Path
    overrides: list[str] = field(default_factory=list)
    config: dict = field(default_factory=dict)  # the parameters it trains (its params.yaml)
    info: dict = field(default_factory=dict)  # its place in the plan (its sweep_point.json)


@dataclass
class Plan:
    """A plan file read and expanded: its settings (ExperimentSection's) and every run."""

    name: str
    path: Path
    out: Path
    section: str  # what the file's messages call the plan section (experiment, or an older name)
    runs: list[PlannedRun]
    notebooks: list[str]
    parameters: dict[str, dict]
    runner: str
    gpus_per_run: int
    keep_checkpoints: bool = True
    runs_per_gpu: int = 1
    description: str = ""
    launcher: str = "local"
    slurm: SlurmSettings = field(default_factory=SlurmSettings)
    layout: str = "axes"
    key: str | None = None  # the sweep axis, and its points (those trained: --smoke's)
    points: list[Point] = field(default_factory=list)
    variants: list[str] = field(default_factory=list)
    seeds: list[int | None] = field(default_factory=lambda: [None])
    smoke: bool = False

    @property
    def records(self) -> bool:
        """Whether the plan executes notebooks, which it records in OUT/study.json."""
        return any(n != TRAININGS or self.runner == "notebook" for n in self.notebooks)

    @property
    def tag(self) -> str:
        """What the runner's lines about this plan start with."""
        return f"[{self.name}]"


def training_parameters(path: str | Path) -> dict:
    """A parameter file's training parameters (a plan file's without its plan section)."""
    if not Path(path).is_file():
        raise ConfigError(f"parameter file {path} not found; pass an existing YAML file (see parameters/ for examples)")
    return {k: v for k, v in read_yaml(path).items() if k not in (SECTION, *OLDER_SECTIONS)}


_said: set[str] = set()


def deprecated(message: str) -> None:
    """One line on stderr, once per process, naming what to change."""
    if message not in _said:
        _said.add(message)
        print(f"deprecated: {message}", file=sys.stderr, flush=True)


def _section(path: Path, raw: dict, sets: list[str]) -> tuple[str, dict]:
    """(the name messages give the plan section, the section with the --set strings ``sets``
    applied, older sections translated)."""
    found = [s for s in (SECTION, *OLDER_SECTIONS) if s in raw]
    if len(found) != 1:
        raise ConfigError(
            f"{path} needs one plan section, `{SECTION}:` (see parameters/ablations.yaml); it has {found or 'none'}"
        )
    section = found[0]
    spec = raw[section]
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: the {section} section must be a mapping of its keys, got {spec!r}")
    spec = dict(spec)
    if section in OLDER_SECTIONS:
        defaults = {k: v for k, v in OLDER_SECTIONS[section].items() if k not in spec}
        name = spec.get("name") or (path.stem.removeprefix("study_") if section == "study" else path.stem)
        defaults = {k: v.format(name=name) if isinstance(v, str) else v for k, v in defaults.items()}
        if section == "sweep" and "key" not in spec:
            raise ConfigError(
                f"{path}: a sweep axis needs both sweep.key (the swept value's name) and "
                f"sweep.points ([{{value: v, set: {{dotted.key: value}}}}])"
            )
        spec = {"name": name, **defaults, "runs": [], **spec} if section == "study" else {**defaults, **spec}
        deprecated(
            f"{path}: the `{section}:` section is read as `{SECTION}:`; rename it `{SECTION}:`"
            + (f" and add {yaml_value(defaults)} (the defaults it had)" if defaults else "")
        )
    for s in sets:  # SECTION.KEY=VALUE, or an older section's name for it
        key, _, value = s.partition("=")
        head, _, rest = key.strip().partition(".")
        if head != SECTION:
            deprecated(f"--set {s!r}: the plan section is `{SECTION}:`; write {SECTION}.{rest}={value}")
        spec = apply_overrides({head: spec}, [s])[head]
    # A key written without a value (`seeds:`) reads as None: the same as leaving it out.
    return section, {k: v for k, v in spec.items() if v is not None}


def load_plan(
    path: str | Path,
    out: str | Path | None = None,
    sets: Sequence[str] = (),
    *,
    smoke: bool = False,
    only: Sequence[str] | None = None,
    overrides: list[str] | dict | None = None,
    variants: Sequence[str] | None = None,
    seeds: Sequence[int] | None = None,
    runner: str | None = None,
    out_root: str | Path | None = None,
    launcher: str | None = None,
    cluster: dict | None = None,
    gpus_per_run: int | None = None,
) -> Plan:
    """Read and check a plan file; every run's parameters are validated before anything runs.

    ``sets``: --set strings; experiment.KEY=VALUE changes the plan section, any other goes to every
    run, after the plan's own settings. ``overrides`` (--set strings or {dotted key: value}) goes
    to every run too. ``smoke``: the section's smoke points and settings (without them: its first
    two points). ``only``: the names of the variants (or runs) to train. ``variants``, ``seeds``,
    ``runner``, ``launcher``, ``gpus_per_run``: replace the section's; ``cluster``: SLURM settings
    laid over its slurm section. ``out``: the plan's folder (default: experiment.out, else
    runs/<name>; with --smoke <that>_smoke); or ``out_root``: the folder that holds it."""
    path = Path(path)
    if not path.is_file() and not path.is_absolute() and (REPO / path).is_file():
        path = REPO / path  # a path from the repository root, called from elsewhere
    if not path.is_file():
        raise ConfigError(
            f"plan file {path} not found; pass a plan such as parameters/study_smoke.yaml, "
            f"parameters/ablations.yaml or parameters/sweeps/a6_layers.yaml"
        )
    raw = read_yaml(path)
    section_sets = [s for s in sets if s.split("=", 1)[0].strip().split(".")[0] in (SECTION, *OLDER_SECTIONS)]
    section, spec = _section(path, raw, section_sets)
    spec.update({k: list(v) for k, v in (("variants", variants), ("seeds", seeds)) if v is not None})
    spec.update(
        {k: v for k, v in (("runner", runner), ("launcher", launcher), ("gpus_per_run", gpus_per_run)) if v is not None}
    )
    if cluster:
        spec["slurm"] = {**(spec.get("slurm") or {}), **cluster}
    try:
        settings = build_section(ExperimentSection, spec, section).validate(section, path)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if settings.launcher == "slurm":
        settings.runner = "subprocess"  # each job runs the training command itself: no notebook, no thread here
    name = settings.name or path.stem
    plan = Plan(
        name=name,
        path=path.resolve(),
        out=Path(),
        section=section,
        runs=[],
        notebooks=list(settings.notebooks),
        parameters=settings.parameters,
        runner=settings.runner,
        gpus_per_run=settings.gpus_per_run,
        keep_checkpoints=settings.keep_checkpoints,
        runs_per_gpu=settings.runs_per_gpu,
        description=settings.description,
        launcher=settings.launcher,
        slurm=settings.slurm,
        layout=settings.layout,
        key=settings.key,
        seeds=settings.seeds,
        smoke=smoke,
    )
    folder = Path(settings.out) if settings.out else Path("runs") / name
    folder = folder.with_name(f"{folder.name}_smoke") if smoke else folder
    plan.out = Path(out) if out is not None else Path(out_root) / folder.name if out_root is not None else folder
    points, first = _smoke(settings, section, path, smoke)
    plan.points = points
    runs = settings.runs if settings.runs is not None else [RunEntry(params=str(path))]
    variants_axis = settings.variants or []
    if only:
        pool = variants_axis or runs
        have = [e.name or "" for e in pool]
        unknown = sorted(set(only) - set(have))
        if unknown:
            raise ConfigError(
                f"--only names {unknown}, which {path} does not plan; its "
                f"{'variants' if variants_axis else 'runs'} are {have}"
            )
        pool[:] = [e for e in pool if e.name in only]
    plan.variants = [e.name for e in variants_axis]
    last = [s for s in sets if s not in section_sets] + set_strings(overrides or [], "overrides")
    plan.runs = _expand(plan, raw, runs, settings.runs is not None, variants_axis, first + settings.overrides, last)
    needs_runs = [n for n in (TRAININGS, "04_analysis") if n in plan.notebooks]
    if needs_runs and not plan.runs:
        raise ConfigError(
            f"{path} lists no runs under {section}.runs for {' and '.join(needs_runs)}; "
            f"add parameter files there or leave those notebooks out of {section}.notebooks"
        )
    return plan


def _smoke(settings: ExperimentSection, section: str, path: Path, smoke: bool) -> tuple[list[Point], list[str]]:
    """(the points trained, the --set strings every run gets first): --smoke's where asked for."""
    points = settings.points or []
    if not smoke:
        return points, []
    given = settings.smoke.points is not None or settings.smoke.set
    if not given and not points:
        raise ConfigError(f"{path} has no {section}.smoke section (points, set) for --smoke")
    return settings.smoke.points or points[:2], [f"{k}={yaml_value(v)}" for k, v in settings.smoke.set.items()]


def _fmt_value(v: Any) -> str:
    return str(v).replace("/", "_").replace(" ", "")


def _expand(
    plan: Plan,
    raw: dict,
    runs: list[RunEntry],
    listed_runs: bool,
    variants: list[VariantEntry],
    first: list[str],
    last: list[str],
) -> list[PlannedRun]:
    """Every (seed, point, run, variant) as a PlannedRun, seed outermost, its parameters loaded and
    checked. Its --set strings, in order: the plan's (``first``: --smoke's, the section's
    overrides), the run entry's, the point's, the variant's, the caller's (``last``), then the
    variant, seed and name the plan gives it."""
    base = {k: v for k, v in raw.items() if k not in (SECTION, *OLDER_SECTIONS)}
    planned: list[PlannedRun] = []
    for seed in plan.seeds:
        for point in plan.points or [None]:
            for entry in runs:
                values = base if Path(entry.params).resolve() == plan.path else training_parameters(entry.params)
                for variant in variants or [None]:
                    sets = first + entry.overrides
                    sets += [f"{k}={yaml_value(v)}" for k, v in (point.set if point else {}).items()]
                    sets += [f"{k}={yaml_value(v)}" for k, v in (variant.set if variant else {}).items()]
                    sets += last + ([f"variant={variant.variant}"] if variant else [])
                    sets += [f"train.seed={seed}"] if seed is not None else []
                    cfg = run_config_from_dict(apply_overrides(values, sets))
                    run_name = entry.name or cfg.name
                    if plan.layout == "study":
                        name = f"{run_name}_s{cfg.train.seed}" if plan.seeds != [None] else run_name
                        run_dir = plan.out / "runs" / name
                    else:
                        parts = (
                            ([f"{plan.key}={_fmt_value(point.value)}"] if point else [])
                            + ([run_name] if listed_runs else [])
                            + ([variant.name] if variant else [])
                            + ([f"seed{cfg.train.seed}"] if seed is not None else [])
                        )
                        name = "/".join(parts or [run_name])
                        run_dir = plan.out / name
                    # the name quoted: as YAML, a bare `off` or `2024` would be a bool or an int
                    sets += ([f"train.seed={cfg.train.seed}"] if seed is None else []) + [
                        f"name={json.dumps(name, ensure_ascii=False)}"
                    ]
                    config = {**apply_overrides(values, sets), "out_dir": str(run_dir)}
                    info = {
                        "sweep": plan.name,
                        "key": plan.key,
                        "value": point.value if point else None,
                        "variant": cfg.variant,
                        "seed": cfg.train.seed,
                        "label": variant.name if variant else run_name,
                        "smoke": plan.smoke,
                    }
                    planned.append(
                        PlannedRun(
                            name,
                            Path(entry.params).resolve(),
                            cfg.train.seed,
                            cfg.variant,
                            cfg.preset,
                            run_dir,
                            sets,
                            config,
                            info,
                        )
                    )
    names = [r.name for r in planned]
    if len(set(names)) != len(names):
        raise ConfigError(f"two runs of {plan.path} share a name ({names}); give each run entry a 'name'")
    return planned
