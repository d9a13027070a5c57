"""The OELM Lab web demo: GPT-Base, OELM-NoFreeze and OELM-Freeze side by side.

Start-up loads each group's model once, on the GPU when there is one: from a checkpoint
(``oelm_core.checkpoint.load_model``, weights-only), a run folder, or a folder that
``oelm_core.export`` wrote (safetensors, or transformers' GPT-2). The page then offers

* a card per model (shape, parameter counts, validation perplexity and step of the checkpoint),
* side-by-side generation: one prompt, seed and sampling setting sent to every model, the texts
  streaming into one column each, round-robin, token by token,
* attention maps of a chosen model, layer and head (or the mean over heads) over the prompt and
  the generated text (the token ids it sampled, not the text encoded again), the same map of
  every model side by side, and per-head summaries
  (attention entropy, mean attention distance) to compare frozen with trainable Q/K.

A checkpoint that is missing, unreadable or of another group (its Q/K initialisation, freezing,
attention or POET setting is not the group's) does not stop the server: that model's column
says what went wrong and how to fix it, and the models that loaded are served. Where none
loaded, or --device names a device this machine lacks, the page says why instead of the panels.

Every value the page or the API sends reaches the handlers as it was sent (the events skip
Gradio's preprocessing, whose range checks answered first and named no setting): the handlers
check each one and name the setting, the value and the range.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import gradio as gr
import torch

from oelm_core import VARIANTS, count_parameters
from oelm_core.analysis import GROUP_LABELS, SAMPLE_TOP_K, attention_maps, summarise_attention, uniform_reference
from oelm_core.analysis.heatmaps import compare_figure, heatmap_figure, summary_figure, token_label
from oelm_core.checkpoint import CheckpointError, load_model
from oelm_core.config import ConfigError, ModelConfig, check_device, variant_overrides, variants
from oelm_core.data import encode_prompt, perplexity
from oelm_core.fast import stream_tokens
from oelm_core.generate import SamplingConfig, detokenize
from oelm_core.groups import GROUPS

# Input ranges: the sliders' bounds, checked by the handlers (the API can send anything, and the
# events skip the components' own checks, which name no setting).
LIMITS = {
    "max_new_tokens": (1, 512),
    "temperature": (0.0, 2.0),
    "top_k": (0, 1000),
    "top_p": (0.01, 1.0),
    "seed": (0, 2**31 - 1),
}
MAX_PROMPT_CHARS = 20_000
DEFAULT_PROMPT = "Once upon a time, there was a little girl named Lily. She"
MEAN_HEAD = "mean"

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
    from oelm_core.config import read_yaml, run_config_from_dict

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


# --------------------------------------------------------------------------------------------
# Handlers
# --------------------------------------------------------------------------------------------


def _number(name: str, value, integer: bool = False) -> float:
    """``value`` (as sent: any JSON value) as the number setting ``name`` takes, or gr.Error
    naming the setting, the value and LIMITS' range."""
    lo, hi = LIMITS[name]
    if value is None or (isinstance(value, str) and not value.strip()):
        raise refuse(f"{name} is empty: enter a number between {lo} and {hi}")
    try:
        if isinstance(value, bool):  # float(True) is 1.0: a JSON true is no number
            raise TypeError
        x = float(value)
    except (TypeError, ValueError):
        raise refuse(f"{name} must be a number between {lo} and {hi}, got {value!r}") from None
    if not math.isfinite(x) or not lo <= x <= hi:
        raise refuse(f"{name} must be between {lo} and {hi}, got {value}")
    if integer and x != int(x):
        raise refuse(f"{name} must be a whole number between {lo} and {hi}, got {value}")
    return int(x) if integer else x


def sampling_config(max_new_tokens, temperature, top_k, top_p, seed) -> SamplingConfig:
    """The sampling settings, each checked against its range with a message naming it."""
    return SamplingConfig(
        max_new_tokens=_number("max_new_tokens", max_new_tokens, integer=True),
        temperature=_number("temperature", temperature),
        top_k=_number("top_k", top_k, integer=True),
        top_p=_number("top_p", top_p),
        seed=_number("seed", seed, integer=True),
    ).validate()


# glibc's mallopt parameter (malloc.h) for the number of heaps ("arenas") threads allocate from.
M_ARENA_MAX = -8
SERVER_ARENAS = 2


def _glibc():
    """The C library when it is glibc (its malloc_trim and mallopt), else None (macOS, musl,
    Windows: other allocators, other switches)."""
    import ctypes
    import os

    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return None
        return ctypes.CDLL(None)
    except (AttributeError, ValueError, OSError):
        return None


def bound_server_memory() -> bool:
    """Let the server's threads share SERVER_ARENAS heaps: glibc gives each thread that
    allocates a heap of its own, up to 8 per core, and keeps in each what the largest request
    it served left there. Gradio serves requests from a pool of up to 40 threads, so the RSS
    climbed with the core count (0.73 -> 1.4 GB over 150 requests on a larger machine). On 2
    cores, smoke models, generation and attention alternating: 0.53 GB at the start, 0.81 GB
    from the 80th request on, 0.83 GB idle; with two heaps and ``return_freed_memory`` after
    each request, 0.65-0.72 GB over 240 requests and idle. Call before the server starts its
    threads. False, changing nothing, where the C library is not glibc."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(M_ARENA_MAX, SERVER_ARENAS))


def return_freed_memory() -> None:
    """Give the pages of the blocks a request freed back to the system (glibc's malloc_trim),
    so that an idle server holds what its models need, not what its last requests did."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)


class Demo:
    """The page's handlers, bound to one Lab (kept apart from the layout so tests call them)."""

    def __init__(self, lab: Lab):
        from oelm_core.data import get_tokenizer

        self.lab = lab
        self.enc = get_tokenizer() if lab.models else None
        self.context = min((m.cfg.block_size for m in lab.models), default=0)

    # ---- prompt -------------------------------------------------------------------------
    def check_prompt(self, prompt) -> list[int]:
        if prompt is not None and not isinstance(prompt, str):
            raise refuse(f"prompt must be text, got {type(prompt).__name__} {prompt!r}")
        if prompt is None or not prompt.strip():
            raise refuse(f"The prompt is empty: type the beginning of a story, e.g. \u201c{DEFAULT_PROMPT}\u201d")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise refuse(
                f"The prompt is {len(prompt):,} characters long; the models read at most "
                f"{self.context} tokens, so shorten it"
            )
        ids = encode_prompt(prompt)  # <|endoftext|> typed is the end-of-text token, as in GPT-2's tokenizer
        if len(ids) >= self.context:
            raise refuse(
                f"The prompt is {len(ids)} tokens long, but the models' context holds "
                f"{self.context} tokens: shorten it to fewer than {self.context} tokens "
                f"(the generated text needs room too)"
            )
        return ids

    # ---- generation ---------------------------------------------------------------------
    def generate(self, prompt, max_new_tokens, temperature, top_k, top_p, seed) -> Iterator[tuple]:
        """Stream every model's continuation of ``prompt`` together: after each round (one new
        piece from every model still going) yield the texts so far, one per model, and then what
        ``attention`` needs to map the tokens the models read: {'prompt': prompt, 'runs':
        {group: {'text': text so far, 'ids': prompt and sampled ids}}}."""
        ids = self.check_prompt(prompt)
        base = sampling_config(max_new_tokens, temperature, top_k, top_p, seed)
        if len(ids) + base.max_new_tokens > self.context:
            gr.Warning(
                f"Prompt ({len(ids)} tokens) plus {base.max_new_tokens} new tokens exceed the "
                f"context of {self.context}: the oldest tokens slide out of the window, and the "
                f"attention maps show the last {self.context} tokens."
            )
        sampled: list[list[int]] = [[] for _ in self.lab.models]

        def recorded(i: int, m: LoadedModel) -> Iterator[int]:
            for token in stream_tokens(m.model, ids, SamplingConfig(**vars(base))):
                sampled[i].append(token)
                yield token

        streams = [detokenize(recorded(i, m), self.enc) for i, m in enumerate(self.lab.models)]
        texts = [""] * len(streams)
        active = list(range(len(streams)))

        def update() -> tuple:
            # A fresh record per update: a stopped generation leaves the texts shown so far.
            runs = {m.group: {"text": texts[i], "ids": ids + sampled[i]} for i, m in enumerate(self.lab.models)}
            return (*texts, {"prompt": prompt, "runs": runs})

        try:
            yield update()
            while active:
                for i in list(active):
                    try:
                        texts[i] += next(streams[i])
                    except StopIteration:
                        active.remove(i)
                yield update()
        finally:  # also when Stop cancels it
            return_freed_memory()

    # ---- attention ----------------------------------------------------------------------
    def _tokens(self, prompt, continuation, generated, group: str) -> list[int]:
        """The ids the model read for ``continuation``: the sampled ones where it is the text
        ``generate`` gave for ``prompt`` (encoding the text again can merge its bytes into other
        tokens than were sampled, e.g. ' a' 'per' 'ote' for ' ape' 'rote'); else, for text from
        elsewhere (an API caller's), the text encoded."""
        self.check_prompt(prompt)
        generated = generated or {}
        run = generated.get("runs", {}).get(group) if generated.get("prompt") == prompt else None
        if run is not None and run["text"] == (continuation or ""):
            ids = run["ids"]
        else:
            ids = encode_prompt(str(prompt) + str(continuation or ""))
        return ids[-self.context :]

    def _head_index(self, head, model: LoadedModel) -> int | None:
        if head in (None, "", MEAN_HEAD):
            return None
        try:
            if isinstance(head, bool) or (isinstance(head, float) and not head.is_integer()):
                raise TypeError
            h = int(head)
        except (TypeError, ValueError):
            raise refuse(
                f"head must be '{MEAN_HEAD}' or a head number 0..{model.cfg.n_head - 1}, got {head!r}"
            ) from None
        if not 0 <= h < model.cfg.n_head:
            raise refuse(f"{model.label} has heads 0..{model.cfg.n_head - 1}; head {h} does not exist")
        return h

    def attention(self, prompt, model_group, layer, head, generated, *continuations):
        """Attention of the chosen model over prompt + that model's generated text, as the token
        ids it sampled where ``generated`` (from ``generate``) holds them for that text.

        Returns (heatmap, the models side by side, per-head summary figure, summary rows, details)
        where details = {'model', 'layer', 'head', 'n_tokens', 'shape', 'tokens'}.
        """
        chosen = self.lab.by_group(model_group)
        index = self.lab.models.index(chosen)
        continuation = continuations[index] if index < len(continuations) else ""
        try:
            if isinstance(layer, bool):
                raise TypeError
            layer_f = float(layer)
        except (TypeError, ValueError):
            raise refuse(f"layer must be a layer number 0..{chosen.cfg.n_layer - 1}, got {layer!r}") from None
        if not (math.isfinite(layer_f) and layer_f == int(layer_f) and 0 <= layer_f < chosen.cfg.n_layer):
            raise refuse(f"{chosen.label} has layers 0..{chosen.cfg.n_layer - 1}; layer {layer} does not exist")
        layer_i = int(layer_f)
        head_i = self._head_index(head, chosen)
        ids = self._tokens(prompt, continuation, generated, chosen.group)
        labels = [token_label(self.enc.decode([i])) for i in ids]
        head_name = "mean over heads" if head_i is None else f"head {head_i}"

        maps = {m.group: attention_maps(m.model, ids)[1] for m in self.lab.models}

        def pick(m: LoadedModel):
            layers = maps[m.group]
            if layer_i >= len(layers):
                return None, f"{m.label} has only {len(layers)} layers"
            att = layers[layer_i]
            if head_i is None:
                return att.mean(0).numpy(), ""
            if head_i >= att.size(0):
                return None, f"{m.label} has only {att.size(0)} heads"
            return att[head_i].numpy(), ""

        matrix, _ = pick(chosen)
        heat = heatmap_figure(matrix, labels, f"{chosen.label}: layer {layer_i}, {head_name} ({len(ids)} tokens)")
        panels = []
        for m in self.lab.models:
            mat, msg = pick(m)
            panels.append((f"{m.label} ({self._qk_state(m, layer_i)} Q/K)", mat, msg))
        compare = compare_figure(
            panels,
            labels,
            f"Layer {layer_i}, {head_name}: the same {len(ids)} tokens (text of {chosen.label}) through every model",
        )

        rows, uniform = self.summary_rows(maps, len(ids))
        summary = summary_figure(rows, uniform, [m.label for m in self.lab.models])
        table = [
            [r["model"], r["layer"], r["head"], r["qk"], round(r["entropy"], 4), round(r["distance"], 3)] for r in rows
        ]
        details = {
            "model": chosen.group,
            "layer": layer_i,
            "head": head_name,
            "n_tokens": len(ids),
            "shape": list(matrix.shape),
            "tokens": labels,
        }
        maps.clear()  # the attention maps go before the heap is trimmed
        return_freed_memory()
        return heat, compare, summary, table, details

    @staticmethod
    def _qk_state(m: LoadedModel, layer: int) -> str:
        return "frozen" if layer in m.cfg.frozen_layers() else "trainable"

    def summary_rows(self, maps: dict[str, list], n_tokens: int) -> tuple[list[dict], dict[str, float]]:
        """Per-head entropy and mean distance of every model from its maps of one text of
        ``n_tokens`` tokens (group -> attention_maps' list of (n_head, T, T) per layer), with the
        model's label and whether the layer's Q/K are frozen; and the uniform baseline."""
        rows = []
        for m in self.lab.models:
            for r in summarise_attention(maps[m.group]):
                rows.append(
                    {
                        "model": m.label,
                        "layer": r["layer"],
                        "head": r["head"],
                        "qk": self._qk_state(m, r["layer"]),
                        "entropy": r["entropy"],
                        "distance": r["mean_distance"],
                    }
                )
        return rows, uniform_reference(n_tokens)


# --------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------


def _fmt_int(n: int) -> str:
    return f"{n:,}"


def model_card(m: LoadedModel, device: str) -> str:
    cfg, c = m.cfg, m.counts
    ppl = checkpoint_ppl(m.state)
    ppl_s = f"{ppl:.2f}" if ppl is not None else "not recorded"
    step = m.state.get("step")
    frozen_layers = cfg.frozen_layers()
    qk = (
        "frozen in every layer"
        if len(frozen_layers) == cfg.n_layer and cfg.n_layer
        else f"frozen in layers {frozen_layers}"
        if frozen_layers
        else "trainable"
    )
    return (
        f"### {m.label}\n"
        f"`{m.group}` \u2014 {VARIANTS.get(m.group, '').split(':', 1)[-1].strip()}\n\n"
        f"| | |\n|:--|:--|\n"
        f"| shape | {cfg.n_layer} layers \u00b7 d_model {cfg.d_model} \u00b7 {cfg.n_head} heads \u00b7 "
        f"context {cfg.block_size} |\n"
        f"| Q/K init | {cfg.qk_init}, {qk} |\n"
        f"| parameters | {_fmt_int(c['total'])} total |\n"
        f"| trainable | {_fmt_int(c['trainable'])} |\n"
        f"| frozen | {_fmt_int(c['frozen'])} |\n"
        f"| validation perplexity | {ppl_s} |\n"
        f"| step | {step if step is not None else 'not recorded'} |\n\n"
        f"<small>checkpoint `{m.path}` on {device}</small>\n"
    )


def checkpoint_ppl(state: dict) -> float | None:
    """The validation perplexity a checkpoint records, or None."""
    metrics = state.get("metrics") or {}
    ppl, loss = metrics.get("val_ppl"), metrics.get("val_loss")
    if ppl is None and isinstance(loss, (int, float)):
        ppl = perplexity(loss)
    return ppl if isinstance(ppl, (int, float)) else None


def barely_trained(step: int | None, ppl: float | None, d_model: int) -> bool:
    """Whether a model of this training and width writes gibberish (unknown figures do not count)."""
    return d_model < WORTH_D_MODEL or (step is not None and step < WORTH_STEPS) or (ppl is not None and ppl > WORTH_PPL)


def undertrained_notice(lab: Lab) -> str | None:
    """What the top of the page says when the loaded models are smoke-sized or barely trained:
    each one's steps and validation perplexity, and the command that trains models worth
    comparing. None when they all look trained."""
    weak = [m for m in lab.models if barely_trained(m.state.get("step"), checkpoint_ppl(m.state), m.cfg.d_model)]
    if not weak:
        return None

    def figures(m: LoadedModel) -> str:
        step, ppl = m.state.get("step"), checkpoint_ppl(m.state)
        return (
            f"{m.label}: {step if step is not None else 'unknown'} steps, validation perplexity "
            f"{f'{ppl:,.0f}' if ppl is not None else 'not recorded'}, d_model {m.cfg.d_model}"
        )

    head = (
        "**These models are barely trained: expect gibberish.** "
        + "; ".join(figures(m) for m in weak)
        + ". Models trained on TinyStories reach a perplexity near 20. "
    )
    if lab.device == "cpu" and not torch.cuda.is_available():
        return head + cpu_route(mini_study_cost())
    return head + (
        f"To compare models worth comparing, train the mini study on a GPU (about two minutes): "
        f"`{MINI_COMMAND}`, then `python -m app --study {MINI_STUDY_OUT}` (or `make demo`, which "
        f"does both)."
    )


def failed_card(group: str, error: str) -> str:
    """The column of a model whose checkpoint did not load: what went wrong and how to fix it."""
    return (
        f"### {group_label(group)}\n`{group}` \u2014 **not loaded**\n\n{error}\n\n"
        f"**How to fix it:** start the demo again with a working checkpoint for {group}: "
        f"`python -m app --ckpt {group}=PATH`, with `--ckpt GROUP=PATH` for each of the others. "
        f"The other models work meanwhile.\n"
    )


def error_page(lab: Lab) -> str:
    items = "\n".join(f"- {e}" for e in lab.errors)
    return (
        "## The models could not be loaded\n\n"
        f"{items}\n\n"
        "**How to fix it:** train the study (`python -m oelm_core run PLAN`), or start the demo "
        "with existing checkpoints: `python -m app --study runs/<study>` or "
        "`python -m app --ckpt gpt_base=PATH --ckpt oelm_nofreeze=PATH --ckpt oelm_freeze=PATH`, "
        "then reload this page."
    )


CSS = """
#load-error, .model-error { border: 2px solid #d62728; border-radius: 8px; padding: 12px 20px; }
.model-card table { font-size: 0.9em; width: 100%; }
.model-card td:first-child { white-space: nowrap; font-weight: 600; }
.model-card thead { display: none; }
.model-card small code { overflow-wrap: anywhere; }
"""


def build_demo(lab: Lab) -> gr.Blocks:
    """The page for ``lab``: a column per model, where a checkpoint that did not load says why;
    the error page where none loaded."""
    with gr.Blocks(title="OELM Lab", analytics_enabled=False) as demo:
        gr.Markdown(
            "# OELM Lab: orthogonal, frozen attention Q/K side by side\n"
            "GPT-Base trains standard Q/K; OELM-NoFreeze starts Q/K as random orthogonal "
            "matrices and trains them; OELM-Freeze keeps them fixed."
        )
        if not lab.models:
            gr.Markdown(error_page(lab), elem_id="load-error")
            return demo

        handlers = Demo(lab)
        demo.oelm = handlers  # tests and scripts reach the handlers through the Blocks
        gr.Markdown(
            f"Checkpoints from {lab.source or 'the command line'}, on **{lab.device}**; "
            f"context {handlers.context} tokens.",
            elem_id="source",
        )
        notice = undertrained_notice(lab)
        if notice:
            gr.Markdown(notice, elem_id="undertrained")
        with gr.Row(equal_height=True):
            for group, m, error in lab.columns():
                with gr.Column():
                    if m is None:
                        gr.Markdown(
                            failed_card(group, error),
                            elem_id=f"card-{group}",
                            elem_classes=["model-card", "model-error"],
                        )
                    else:
                        gr.Markdown(model_card(m, lab.device), elem_id=f"card-{m.group}", elem_classes="model-card")

        gr.Markdown("## Generate")
        prompt = gr.Textbox(
            DEFAULT_PROMPT,
            label="Prompt",
            lines=3,
            elem_id="prompt",
            info=f"sent to every model; fewer than {handlers.context} tokens",
        )
        with gr.Row():
            max_new = gr.Slider(
                *LIMITS["max_new_tokens"], value=max(1, min(60, handlers.context - 24)), step=1, label="max new tokens"
            )
            temperature = gr.Slider(
                *LIMITS["temperature"],
                value=SamplingConfig.temperature,
                step=0.05,
                label="temperature",
                info="0: always the most likely token",
            )
            top_k = gr.Slider(*LIMITS["top_k"], value=SAMPLE_TOP_K, step=1, label="top-k", info="0: off")
            top_p = gr.Slider(*LIMITS["top_p"], value=SamplingConfig.top_p, step=0.01, label="top-p", info="1: off")
            seed = gr.Number(
                1234,
                label="seed",
                precision=0,
                minimum=LIMITS["seed"][0],
                maximum=LIMITS["seed"][1],
                info="same seed, same texts",
            )
        with gr.Row():
            go = gr.Button("Generate", variant="primary", elem_id="generate-btn")
            stop = gr.Button("Stop", elem_id="stop-btn")
        outputs = []
        with gr.Row(equal_height=True):
            for group, m, _ in lab.columns():
                if m is None:
                    gr.Markdown(
                        f"*{group_label(group)} did not load: its card above says why.*", elem_id=f"out-{group}-missing"
                    )
                else:
                    outputs.append(
                        gr.Textbox(label=m.label, lines=8, max_lines=20, interactive=False, elem_id=f"out-{m.group}")
                    )

        gr.Markdown(
            "## Attention\nOver the prompt and the chosen model's generated text "
            "(the last tokens that fit the context). Rows are queries, columns the tokens "
            "they attend to."
        )
        max_layers = max(m.cfg.n_layer for m in lab.models)
        max_heads = max(m.cfg.n_head for m in lab.models)
        with gr.Row():
            model_dd = gr.Dropdown(
                [(m.label, m.group) for m in lab.models],
                value=lab.models[-1].group,
                label="model",
                elem_id="attn-model",
            )
            layer = gr.Slider(
                0,
                max(max_layers - 1, 1),
                value=0,
                step=1,
                label="layer",
                elem_id="attn-layer",
                info=f"0..{max_layers - 1}",
            )
            head = gr.Dropdown(
                [("mean over heads", MEAN_HEAD)] + [(f"head {h}", str(h)) for h in range(max_heads)],
                value=MEAN_HEAD,
                label="head",
                elem_id="attn-head",
            )
            show = gr.Button("Show attention", elem_id="attn-btn")
        with gr.Row():
            heat = gr.Plot(label="attention map", show_label=False, elem_id="attn-plot")
        compare = gr.Plot(label="the three models, same layer and head", show_label=False, elem_id="attn-compare")
        gr.Markdown(
            "### Per-head summaries\nEntropy: how spread a head's attention is (uniform "
            "attention is the dashed line). Distance: how many tokens back it looks on average. "
            "Hollow markers: frozen Q/K."
        )
        summary = gr.Plot(label="per-head summaries", show_label=False, elem_id="attn-summary")
        table = gr.Dataframe(
            headers=["model", "layer", "head", "Q/K", "entropy (nats)", "mean distance (tokens)"],
            label="per-head summaries",
            interactive=False,
            elem_id="attn-table",
        )
        with gr.Accordion("map details", open=False):
            details = gr.JSON(label="tokens and shape of the map", elem_id="attn-details")

        generated = gr.State()  # the token ids behind the texts, per session
        gen_inputs = [prompt, max_new, temperature, top_k, top_p, seed]
        attn_inputs = [prompt, model_dd, layer, head, generated, *outputs]
        attn_outputs = [heat, compare, summary, table, details]
        # preprocess=False: the values reach the handlers as sent, and their checks, which name the
        # setting and its range, answer instead of the components' ("Value 0 is less than minimum
        # value 1.", or "Could not preprocess input component at index 1" for a wrong type).
        raw = dict(preprocess=False)
        gen = go.click(handlers.generate, gen_inputs, [*outputs, generated], api_name="generate", **raw)
        gen.success(handlers.attention, attn_inputs, attn_outputs, api_name=False, **raw)
        submitted = prompt.submit(handlers.generate, gen_inputs, [*outputs, generated], api_name=False, **raw)
        submitted.success(handlers.attention, attn_inputs, attn_outputs, api_name=False, **raw)
        stop.click(None, None, None, cancels=[gen, submitted])
        show.click(handlers.attention, attn_inputs, attn_outputs, api_name="attention", **raw)
    return demo


THEME_FONTS = dict(font=["ui-sans-serif", "system-ui", "sans-serif"], font_mono=["ui-monospace", "monospace"])


def launch(
    demo: gr.Blocks,
    host: str = "127.0.0.1",
    port: int | None = 7860,
    share: bool = False,
    concurrency: int = 2,
    **kwargs,
):
    """Queue (at most ``concurrency`` requests of an event at once, 32 waiting) and serve.

    System fonts only: the default theme would fetch web fonts, which the offline machines lack.
    A port in use is a SetupError naming --port (Gradio's own message names its launch() and an
    environment variable). Unless ``quiet``, the app says where it serves and how to share it
    (--share: Gradio's hint names its launch() argument).
    """
    quiet = kwargs.pop("quiet", False)
    block = not kwargs.pop("prevent_thread_lock", False)
    if port is not None and port_in_use(host, port):
        raise SetupError(port_message(host, port))
    bound_server_memory()
    demo.queue(default_concurrency_limit=concurrency, max_size=32)
    try:
        served = demo.launch(
            server_name=host,
            server_port=port,
            share=share,
            ssr_mode=False,
            show_error=True,
            theme=gr.themes.Soft(**THEME_FONTS),
            css=CSS,
            quiet=True,
            prevent_thread_lock=True,
            **kwargs,
        )
    except OSError as exc:  # taken between the check and the start
        if port is not None and "port" in str(exc).lower():
            raise SetupError(port_message(host, port)) from None
        raise
    if not quiet:
        print(f"* Running on local URL:  {demo.local_url}")
        print(
            f"* Running on public URL: {demo.share_url}"
            if share and demo.share_url
            else "* To create a public link, start the app with --share."
        )
    if block:
        demo.block_thread()
    return served


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on ``port`` at ``host`` already (another demo, a notebook)."""
    import socket

    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Gradio binds: a closed port is free
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def port_message(host: str, port: int) -> str:
    return (
        f"port {port} on {host} is in use (another demo or server is running there): start the app with "
        f"another port, python -m app --port {port + 1} (make demo PORT={port + 1}), or stop the other one"
    )
