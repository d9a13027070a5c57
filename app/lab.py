"""What the demo serves: the study it finds (or the checkpoints it is given) and the models it loads.

The newest trained study under runs/ (``trained_study``: one worth serving, whose models are not
barely trained), the three groups' checkpoints of a study or of --ckpt arguments, each loaded
once (``load_lab``) into a ``Lab``: the models that loaded, and for each that did not, why (a
missing or unreadable file, a checkpoint of another group or shape). The route to readable
stories where none is trained: one seed of the tuned mini study (``MINI_COMMAND``), and what it
would cost on this machine (``mini_study_cost``). The page itself is ``app.demo``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import gradio as gr
import torch

from oelm_core import count_parameters
from oelm_core.analysis import GROUP_LABELS
from oelm_core.checkpoint import CheckpointError, load_model
from oelm_core.config import ConfigError, ModelConfig, check_device, variant_overrides, variants
from oelm_core.groups import GROUPS

# When models are worth comparing: trained on TinyStories they reach a validation perplexity near
# 10 (results/tuned_mini); the smoke study's models stop in the hundreds after 150 steps and write gibberish,
# which a newcomer would otherwise take for what OELM does.
WORTH_STEPS, WORTH_PPL, WORTH_D_MODEL = 1000, 40.0, 128
MINI_STUDY = "parameters/study_tuned_mini.yaml"
MINI_STUDY_OUT = "runs/tuned_mini"
# One seed of the tuned mini study: the three groups, about two minutes on one GPU. The arguments after
# `python`, as make demo runs them and the page shows them.
MINI_ARGS = ["-m", "oelm_core", "run", MINI_STUDY, "--set", "experiment.seeds=[0]"]
MINI_COMMAND = shlex.join(["python", *MINI_ARGS])


@functools.lru_cache(maxsize=None)
def mini_study_cost(device: str = "cpu") -> dict:
    """What one seed of the mini study (MINI_ARGS) costs on ``device``: {"runs", "steps" (each, at
    most: early stopping may end one sooner), "tokens_per_step", "flops" (all runs' steps),
    "flops_per_s" (the device's top speed, ``preflight.device_flops``), "hours" (at that speed: a
    lower bound)}. On a CPU it says whether training it here makes sense. Measured once per
    process: the page and the command line say the same."""
    import torch

    from oelm_core.config import run_config_from_dict
    from oelm_core.preflight import device_flops, step_flops
    from oelm_core.runner import load_plan

    plan = load_plan(MINI_STUDY, sets=["experiment.seeds=[0]"])
    configs = [run_config_from_dict(run.config) for run in plan.runs]
    flops = sum(step_flops(cfg) * cfg.train.steps for cfg in configs)
    rate, _ = device_flops(torch.device(device))
    first = configs[0]
    return {
        "runs": len(configs),
        "steps": max(cfg.train.steps for cfg in configs),
        "tokens_per_step": first.train.batch_size * first.model_config().block_size * first.train.grad_accum,
        "flops": flops,
        "flops_per_s": rate,
        "hours": flops / rate / 3600,
    }


def cpu_route(cost: dict) -> str:
    """What a CPU user reads about readable stories: what the mini study is, how long it takes on
    this CPU (``mini_study_cost``) and on a GPU, and how to bring its models here."""
    return (
        f"The tuned mini study, whose models write readable stories, trains {cost['runs']} models for up to "
        f"{cost['steps']:,} steps of {cost['tokens_per_step']:,} tokens: at least {cost['hours']:,.0f} h on this "
        f"CPU ({cost['flops'] / 1e15:.1f} PFLOP at its measured {cost['flops_per_s'] / 1e9:.1f} GFLOP/s), about "
        f"two minutes on one GPU. Train it on a GPU machine (`{MINI_COMMAND}`) and copy its "
        f"`{MINI_STUDY_OUT}` into `runs/` here: `make demo` serves it then."
    )


def refuse(message: str) -> gr.Error:
    """An input error shown to the user (a message, not a server-side traceback)."""
    return gr.Error(message, print_exception=False)


class SetupError(RuntimeError):
    """The demo cannot be set up: no checkpoints found (no study, a study without a group, ...)
    or a --device this machine lacks."""


# --------------------------------------------------------------------------------------------
# Finding and loading the checkpoints
# --------------------------------------------------------------------------------------------


def group_label(group: str) -> str:
    """'GPT-Base' for 'gpt_base': the study's label of the group (analysis.GROUP_LABELS)."""
    return GROUP_LABELS.get(group, group)


def parse_ckpt_args(items: Sequence[str]) -> dict[str, Path]:
    """['gpt_base=a.pt', ...] -> {'gpt_base': Path('a.pt'), ...}."""
    out: dict[str, Path] = {}
    for item in items or []:
        if "=" not in item:
            raise SetupError(
                f"--ckpt expects GROUP=PATH, e.g. gpt_base=runs/smoke/runs/gpt_base_s42/best.pt "
                f"(the smoke study's GPT-Base run); got {item!r}"
            )
        group, path = item.split("=", 1)
        group = group.strip()
        if group not in GROUPS:
            raise SetupError(f"--ckpt {item!r}: unknown group {group!r}; choose one of {', '.join(GROUPS)}")
        out[group] = Path(path.strip())
    return out


def newest_study(runs_root: str | Path = "runs") -> Path:
    """The newest ``runs/*/study.json`` by modification time."""
    found = sorted(Path(runs_root).glob("*/study.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SetupError(
            f"no study found under {Path(runs_root).resolve()} (no */study.json): run a study "
            f"first (python -m oelm_core run PLAN) or pass checkpoints with "
            f"--ckpt gpt_base=PATH --ckpt oelm_nofreeze=PATH --ckpt oelm_freeze=PATH"
        )
    return found[-1]


def study_checkpoints(study: str | Path) -> dict[str, Path]:
    """Group -> best.pt of one run per group (its lowest seed) of a study folder or study.json."""
    return {g: run_dir / "best.pt" for g, run_dir in study_runs(study).items()}


def study_runs(study: str | Path) -> dict[str, Path]:
    """Group -> run folder of one run per group (its lowest seed) of a study folder or study.json."""
    path = Path(study)
    if path.is_dir():
        path = path / "study.json"
    if not path.is_file():
        raise SetupError(
            f"study file {path} not found; pass a study folder holding study.json "
            f"(e.g. --study runs/smoke) or checkpoints with --ckpt GROUP=PATH"
        )
    try:
        info = json.loads(path.read_text())
        runs = list(info["runs"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SetupError(
            f"{path} is not a readable study file ({type(exc).__name__}: {exc}); "
            f"expected {{'runs': [{{'variant', 'seed', 'run_dir', ...}}]}}"
        ) from exc
    chosen: dict[str, dict] = {}
    for run in runs:
        group = run.get("variant")
        if group not in GROUPS:
            continue
        seed = run.get("seed")
        best = chosen.get(group)
        if best is None or (seed is not None and (best.get("seed") is None or seed < best["seed"])):
            chosen[group] = run
    if not chosen:
        raise SetupError(f"{path} lists no run of the groups {', '.join(GROUPS)}")
    return {g: path.parent / chosen[g]["run_dir"] for g in GROUPS if g in chosen}


def trained_study(runs_root: str | Path = "runs") -> Path | None:
    """The newest ``runs/*/study.json`` whose runs (one per group, as the demo loads them) are
    worth comparing by their summary.json (steps, best validation perplexity); None if none is."""
    for study in sorted(Path(runs_root).glob("*/study.json"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            summaries = [json.loads((d / "summary.json").read_text()) for d in study_runs(study).values()]
        except (SetupError, OSError, ValueError):
            continue
        if summaries and not any(
            barely_trained(s.get("steps"), s.get("best_val_ppl"), WORTH_D_MODEL) for s in summaries
        ):
            return study
    return None


@dataclass
class LoadedModel:
    group: str
    label: str
    path: Path
    model: Any
    state: dict
    counts: dict

    @property
    def cfg(self):
        return self.model.cfg


@dataclass
class Lab:
    """What the page shows: the loaded models, and the errors that kept others from loading
    (``errors``, each naming its group; ``failed``: group -> its error alone)."""

    models: list[LoadedModel] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    device: str = "cpu"
    source: str = ""
    failed: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every checkpoint loaded."""
        return bool(self.models) and not self.errors

    def columns(self) -> list[tuple[str, LoadedModel | None, str | None]]:
        """(group, its model or None, why it did not load or None) for every group asked for, in
        the study's order: one column of the page each."""
        loaded = {m.group: m for m in self.models}
        groups = sorted({*loaded, *self.failed}, key=lambda g: GROUPS.index(g) if g in GROUPS else len(GROUPS))
        return [(g, loaded.get(g), self.failed.get(g)) for g in groups]

    def by_group(self, group: str) -> LoadedModel:
        for m in self.models:
            if m.group == group:
                return m
        raise refuse(f"unknown model {group!r}; choose one of {', '.join(m.group for m in self.models)}")


def pick_device(device: str = "auto") -> str:
    """The device to load the models on; a SetupError naming --device when this machine lacks
    it (else every checkpoint would be reported as one that cannot be loaded)."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        check_device(device, setting="--device")
    except ConfigError as exc:
        raise SetupError(str(exc)) from None
    return device


def variant_fields() -> list[str]:
    """The ModelConfig fields some registered variant sets: what tells the variants apart."""
    return sorted({name for variant in variants() for name in variant_overrides(variant)})


def variant_spec(cfg: ModelConfig) -> dict[str, Any]:
    """``cfg``'s values of ``variant_fields``, freezing as the frozen layers it comes to
    ("all" and [0, 1] are the same model at 2 layers)."""
    spec = {name: getattr(cfg, name) for name in variant_fields()}
    spec["freeze_qk"] = cfg.frozen_layers()
    return spec


def group_spec(group: str, cfg: ModelConfig) -> dict[str, Any]:
    """``variant_spec`` of ``group``'s model at the shape of ``cfg``."""
    defaults = ModelConfig()
    values = {**{name: getattr(defaults, name) for name in variant_fields()}, **variant_overrides(group)}
    return variant_spec(dataclasses.replace(cfg, **values))


def _describe(spec: dict[str, Any], names: list[str]) -> str:
    return ", ".join(f"frozen Q/K layers {spec[n]}" if n == "freeze_qk" else f"{n} {spec[n]!r}" for n in names)


def group_mismatch(group: str, cfg: ModelConfig) -> str | None:
    """Why a model of ``cfg`` is not one of ``group``, or None. Every field a variant sets is
    compared, not only the Q/K initialisation and freezing: a Synthesizer would otherwise pass
    as GPT-Base and a POET model as OELM-NoFreeze, labelled and compared as them."""
    have, want = variant_spec(cfg), group_spec(group, cfg)
    if have == want:
        return None
    differ = [name for name in want if have[name] != want[name]]
    actual = next((v for v in variants() if group_spec(v, cfg) == have), None)
    if actual in GROUPS:
        fix = f"pass it as --ckpt {actual}=PATH"
    elif actual:
        fix = f"it is the {actual} variant, which the demo does not compare: pass the checkpoint of a {group} run"
    else:
        fix = f"pass the checkpoint of a {group} run"
    return f"holds a model with {_describe(have, differ)}, but {group} has {_describe(want, differ)}; {fix}"


def load_source(path: Path, device: str) -> tuple[Any, dict]:
    """(model, checkpoint state) of what --ckpt names: a checkpoint file, a run folder (its
    best.pt), or a folder ``oelm_core.export`` wrote (safetensors or transformers), whose card
    gives the state's step and validation figures. CheckpointError saying what went wrong."""
    if path.is_dir() and (path / "best.pt").is_file():
        return load_model(path / "best.pt", device)
    if path.is_dir() and (path / "config.json").is_file():
        from oelm_core.export import ExportError, load_export  # only for folders: it reads safetensors

        try:
            model, card = load_export(path, device)
        except ExportError as exc:
            raise CheckpointError(str(exc)) from None
        metrics = {k: card[k] for k in ("val_loss", "val_ppl") if k in card}
        return model, {"step": card.get("step"), "metrics": metrics}
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a folder without best.pt or config.json: pass a checkpoint file, "
            f"a run folder, or a folder that python -m oelm_core.export wrote"
        )
    return load_model(path, device)


SHAPE_FIELDS = ("n_layer", "d_model", "n_head", "d_ff", "block_size", "vocab_size")


def shape_of(cfg: ModelConfig) -> tuple:
    return tuple(getattr(cfg, f) for f in SHAPE_FIELDS)


def describe_shape(cfg: ModelConfig) -> str:
    """'a smoke model (2 layers, d_model 64, 4 heads, context 64)': the preset of that shape, if any."""
    from oelm_core.config import PRESETS

    preset = next(
        (
            name
            for name, shape in PRESETS.items()
            if all(getattr(cfg, k) == v for k, v in shape.items() if k in SHAPE_FIELDS)
        ),
        None,
    )
    return (
        f"{f'a {preset}' if preset else 'a'} model ({cfg.n_layer} layers, d_model {cfg.d_model}, "
        f"{cfg.n_head} heads, context {cfg.block_size})"
    )


def study_shapes(study: str | Path) -> dict[str, ModelConfig]:
    """Group -> the ModelConfig its run of the study trained (the run folder's config.yaml), for
    those runs that have one."""
    from oelm_core.config import run_config_from_dict
    from oelm_core.parameter_files import read_yaml

    shapes = {}
    for group, run_dir in study_runs(study).items():
        try:
            shapes[group] = run_config_from_dict(read_yaml(run_dir / "config.yaml")).model_config()
        except (ConfigError, OSError):
            continue
    return shapes


def load_lab(
    paths: dict[str, Path], device: str = "auto", source: str = "", expected: dict[str, ModelConfig] | None = None
) -> Lab:
    """Load every checkpoint once; collect what fails instead of raising. ``expected``: group ->
    the ModelConfig its study trained: a checkpoint of another shape (a smoke model where the
    study trained mini) is refused, naming both."""
    try:
        lab = Lab(device=pick_device(device), source=source)
    except SetupError as exc:
        return Lab(errors=[str(exc)], device=device, source=source)

    def fail(group: str, message: str) -> None:
        lab.failed[group] = message
        lab.errors.append(f"{group_label(group)} ({group}): {message}")

    for group in sorted(paths, key=lambda g: GROUPS.index(g) if g in GROUPS else len(GROUPS)):
        path = Path(paths[group])
        try:
            model, state = load_source(path, lab.device)
        except CheckpointError as exc:
            fail(group, str(exc))
            continue
        except Exception as exc:  # a checkpoint of another shape or config version
            fail(
                group,
                f"checkpoint {path} could not be turned into a model ({type(exc).__name__}: "
                f"{' '.join(str(exc).split())}); it may come from an incompatible version of oelm_core: "
                f"train it again or pass another file",
            )
            continue
        mismatch = group_mismatch(group, model.cfg)
        if mismatch:
            fail(group, f"checkpoint {path} {mismatch}")
            continue
        shape = (expected or {}).get(group)
        if shape is not None and shape_of(model.cfg) != shape_of(shape):
            fail(
                group,
                f"{path} holds {describe_shape(model.cfg)}, but the study trained {describe_shape(shape)} "
                f"there (its config.yaml): the checkpoint was replaced or comes from another run; train "
                f"the run again, or pass a checkpoint of that shape with --ckpt {group}=PATH",
            )
            continue
        lab.models.append(LoadedModel(group, group_label(group), path, model, state, count_parameters(model)))
    if not paths:
        lab.errors.append("no checkpoints were given")
    return lab


def lab_from_args(
    ckpt: Sequence[str] = (), study: str | None = None, runs_root: str = "runs", device: str = "auto"
) -> Lab:
    """The Lab for the command line: --ckpt pairs, else --study, else the newest study in runs/."""
    try:
        resolved = pick_device(device)
        if ckpt:
            paths, source = parse_ckpt_args(ckpt), "--ckpt"
        else:
            study_file = Path(study) if study else newest_study(runs_root)
            paths, source = study_checkpoints(study_file), f"study {study_file}"
            return load_lab(paths, resolved, source, expected=study_shapes(study_file))
    except SetupError as exc:
        return Lab(errors=[str(exc)], device=device)
    return load_lab(paths, resolved, source)


def barely_trained(step: int | None, ppl: float | None, d_model: int) -> bool:
    """Whether a model of this training and width writes gibberish (unknown figures do not count)."""
    return d_model < WORTH_D_MODEL or (step is not None and step < WORTH_STEPS) or (ppl is not None and ppl > WORTH_PPL)
