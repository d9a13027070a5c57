"""Models that travel: a trained GPT as files that load without this repository's pickles, or as
a Hugging Face GPT-2.

    python -m oelm_core.export runs/smoke/oelm_freeze_s0 --out exported/ --format both

Two formats (docs/export.md):

- **safetensors** (``to_safetensors`` / ``load_safetensors``), any variant: ``model.safetensors``
  holds the state dict (parameters and the frozen Q/K buffers), ``config.json`` what rebuilds it
  (the ModelConfig, with ``freeze_qk`` naming the layers frozen *now*), ``README.md`` a model
  card. Loading reads safetensors and JSON only, never a pickle, and gives the model bit for bit.
  The trainer writes one into every run folder (``RUN_EXPORT``).
- **transformers** (``to_transformers``): a ``GPT2LMHeadModel`` folder with GPT-2's tokenizer
  files, for ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained``. At inference every
  dot-product variant is a GPT-2: how W_q, W_k started (orthogonal, Gaussian, any construction)
  and whether they learned (frozen, layer-wise, unfrozen on a schedule) shape the weights, not the
  computation; POET's W = R W0 P is one matrix once composed. Every one scales the logits by
  1/sqrt(d_head), as GPT-2 does (``model.CausalSelfAttention``: SDPA's default scale; ``qk_gain``
  lives in the weights), so nothing has to be folded into W_q. The Synthesizer has no QK^T and
  is refused, as is a vocabulary other than GPT-2's (the tokenizer beside it would not fit).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Iterator, Optional

import torch

from oelm_core.accounting import count_parameters
from oelm_core.checkpoint import CheckpointError, load_model, shape_disagreement
from oelm_core.config import PRESETS, ConfigError, ModelConfig, model_config_from_dict, variant_overrides, variants
from oelm_core.data import EOT, EOT_TEXT
from oelm_core.files import DiskFull, LockHeld, atomic_folder, exclusive_lock
from oelm_core.model import GPT
from oelm_core.orthogonal import QK_INITS
from oelm_core.parameter_files import read_yaml
from oelm_core.run_folder import read_summary

FORMAT = "oelm-core/safetensors"
FORMAT_VERSION = 1
FORMATS = ("safetensors", "transformers", "both")
RUN_EXPORT = "export"  # the run folder's safetensors export, written when a session ends
GPT2_VOCAB = EOT + 1
# Every name an export writes (both formats, and the two subfolders of --format both): a folder
# holding anything else is refused as --out rather than replaced.
EXPORT_NAMES = {
    "model.safetensors",
    "config.json",
    "README.md",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "safetensors",
    "transformers",
}
# GPT-2's config.json keys that transformers builds the model from, and the ModelConfig field
# each must equal.
GPT2_KEYS = {
    "n_layer": "n_layer",
    "n_head": "n_head",
    "n_embd": "d_model",
    "n_inner": "d_ff",
    "n_positions": "block_size",
    "vocab_size": "vocab_size",
}
# What an export killed mid-way leaves in the folder that holds its --out (``atomic_folder``'s
# temporaries, the lock of ``_writing``), as a name pattern of {name}, the folder's name.
LEFT_BY_A_KILL = r"\.{name}\.(.+\.(tmp|old)|lock)"
# model.safetensors' metadata entry holding the ModelConfig it was written with, as JSON: what
# notices a config.json edited without changing any tensor's shape (n_head, freeze_qk).
CONFIG_METADATA = "oelm_model_config"
# Where tiktoken.get_encoding("gpt2") downloads GPT-2's BPE from; its cache names each file by the
# sha1 of its URL (encoder.json: 6c7ea1a7..., vocab.bpe: 6d1cbeee...).
TIKTOKEN_GPT2_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"


class ExportError(RuntimeError):
    """A model, checkpoint or folder that cannot be exported or loaded as asked."""


# --------------------------------------------------------------------------------------------
# What the model is: config.json and the model card
# --------------------------------------------------------------------------------------------


def _preset_and_variant(cfg: ModelConfig) -> tuple[Optional[str], Optional[str]]:
    """The preset whose shape ``cfg`` has and the variant whose settings it has, each None where
    none fits (a run's own names, when known, are used instead)."""
    preset = next(
        (name for name, shape in PRESETS.items() if all(getattr(cfg, k) == v for k, v in shape.items())), None
    )
    keys = {k for name in variants() for k in variant_overrides(name)}
    default = ModelConfig()
    for name in variants():
        overrides = variant_overrides(name)
        expected = dataclasses.replace(cfg, **{k: overrides.get(k, getattr(default, k)) for k in keys})
        # freeze_qk compared by the layers it names: "all" and [0, 1] are one setting at 2 layers
        if (
            dataclasses.replace(expected, freeze_qk=cfg.freeze_qk) == cfg
            and expected.frozen_layers() == cfg.frozen_layers()
        ):
            return preset, name
    return preset, None


def _version() -> str:
    try:
        return metadata.version("oelm-core")
    except metadata.PackageNotFoundError:  # run from a checkout on PYTHONPATH, not installed
        return "unknown"


def describe(model: GPT, card: Optional[dict] = None) -> dict:
    """config.json of the safetensors export: the format tag and oelm_core version, preset and
    variant, the ModelConfig that rebuilds the model, its Q/K construction and frozen layers,
    parameter counts, and ``card`` (what the run knows, ``run_card``) under "run"."""
    card = dict(card or {})
    cfg = model.live_config()  # freeze_qk as the model is now, after any unfreezing
    preset, variant = _preset_and_variant(cfg)
    preset, variant = card.get("preset", preset), card.get("variant", variant)
    counts = count_parameters(model)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "oelm_core_version": _version(),
        "preset": preset,
        "variant": variant,
        "description": variants().get(variant),
        "model_config": dataclasses.asdict(cfg),
        "qk": None
        if cfg.attention != "dot"
        else {
            "construction": cfg.qk_init,
            "about": QK_INITS[cfg.qk_init],
            "gain": cfg.qk_gain,
            "frozen_layers": model.frozen_qk_layers(),
            "poet_block_size": cfg.poet_block_size,
            "logit_scale": "1/sqrt(d_head)",
        },
        "parameters": {k: counts[k] for k in ("trainable", "frozen", "total")},
        "run": card,
    }


def run_card(state: dict, run_dir: Optional[Path] = None, weights: str = "best.pt") -> dict:
    """What a checkpoint (``state``, as ``load_model`` returns it) and its run folder tell about
    the weights, for the card: name, preset, variant, seed, data source and size, the step and
    tokens seen when they were saved, the validation figures of the evaluation they followed,
    and the run's status and steps from summary.json. Keys without a value are left out."""
    run = state.get("run_config")
    if run is None and run_dir is not None and (run_dir / "config.yaml").is_file():
        run = read_yaml(run_dir / "config.yaml")
    run = run or {}
    metrics = state.get("metrics") or {}
    summary = read_summary(run_dir) if run_dir is not None else {}
    # summary.json's provenance (oelm_core.provenance): the code, software, device and token files
    prov = summary.get("provenance") or {}
    code, data, device = prov.get("code") or {}, prov.get("data") or {}, prov.get("device") or {}
    software = prov.get("software") or {}
    card = {
        "name": run.get("name"),
        "preset": run.get("preset"),
        "variant": run.get("variant"),
        "weights": weights,
        "step": state.get("step"),
        "tokens_seen": metrics.get("tokens_seen"),
        "epochs": metrics.get("epochs"),
        "val_loss": metrics.get("val_loss"),
        "val_ppl": metrics.get("val_ppl"),
        "val_bpb": metrics.get("val_bpb"),
        "seed": (run.get("train") or {}).get("seed"),
        "data": data.get("source") or (run.get("data") or {}).get("source"),
        "train_tokens": (state.get("data") or {}).get("train_tokens"),
        "train_sha256": data.get("train_sha256"),
        "val_sha256": data.get("val_sha256"),
        "commit": code.get("commit"),
        "dirty": code.get("dirty"),
        "trained_on": (
            f"{device['name']} x{device.get('count', 1)}, torch {software.get('torch')}"
            + (f", CUDA {software['cuda']}" if software.get("cuda") else "")
        )
        if device
        else None,
        "run_status": summary.get("status"),
        "run_steps": summary.get("steps"),
    }
    return {k: v for k, v in card.items() if v is not None}


def model_card(info: dict, fmt: str) -> str:
    """README.md of an export: Hub front matter, what the model is and how it was trained (what
    ``info``, config.json's content, knows), and how to load it (``fmt``: safetensors or
    transformers)."""
    cfg, run, n = info["model_config"], info["run"], info["parameters"]
    variant = info["variant"] or "custom"
    front = ["---", "tags: [oelm, orthogonal-attention, text-generation]"]
    if fmt == "transformers":
        front += ["library_name: transformers", "pipeline_tag: text-generation"]
    if run.get("data") == "roneneldan/TinyStories":
        front.append("datasets: [roneneldan/TinyStories]")
    front.append("---")
    if info["qk"] is None:
        qk = f"none: Synthesizer attention ({cfg['attention']}), input-independent logits"
    else:
        frozen = info["qk"]["frozen_layers"]
        if cfg["poet_block_size"]:
            learned = (
                f"POET: W = R W0 P, W0 frozen, R and P learned (blocks of {cfg['poet_block_size']}); "
                f"composed into one matrix for GPT-2"
            )
        else:
            learned = f"frozen (buffers) in layers {frozen}" if frozen else "trainable in every layer"
        qk = f"{cfg['qk_init']} ({info['qk']['about']}), gain {cfg['qk_gain']}; {learned}"
    rows = [
        ("variant", f"`{variant}`" + (f": {info['description']}" if info["description"] else "")),
        ("preset", f"`{info['preset']}`" if info["preset"] else "custom"),
        (
            "shape",
            f"{cfg['n_layer']} layers, d_model {cfg['d_model']}, {cfg['n_head']} heads, d_ff "
            f"{cfg['d_ff']}, context {cfg['block_size']}, vocabulary {cfg['vocab_size']:,}",
        ),
        ("Q/K", qk),
        ("parameters", f"{n['trainable']:,} trainable, {n['frozen']:,} frozen, {n['total']:,} total"),
    ]
    if "data" in run:
        rows.append(
            (
                "data",
                f"{run['data']}" + (f" ({run['train_tokens']:,} training tokens)" if "train_tokens" in run else ""),
            )
        )
    if "train_sha256" in run:
        rows.append(
            (
                "token files",
                f"sha256 train.bin `{run['train_sha256'][:16]}`, val.bin "
                f"`{run.get('val_sha256', '?')[:16]}` (config.json: in full)",
            )
        )
    if "step" in run:
        seen = f", {run['tokens_seen']:,} tokens seen" if "tokens_seen" in run else ""
        epochs = f" ({run['epochs']:.2f} epochs)" if "epochs" in run else ""
        of_run = (
            f" of the run's {run['run_steps']:,} ({run['run_status']})"
            if "run_steps" in run and "run_status" in run
            else ""
        )
        weights = f"; weights: {run['weights']}" if "weights" in run else ""
        rows.append(("trained", f"{run['step']:,} steps{of_run}{seen}{epochs}{weights}"))
    if "val_loss" in run:
        which = (
            "the run's lowest" if run.get("weights") == "best.pt" else "the run's latest evaluation up to these weights"
        )
        rows.append(
            (
                "validation",
                f"loss {run['val_loss']:.4f} nats/token, PPL {run['val_ppl']:.2f}, "
                f"{run['val_bpb']:.4f} bits/byte ({which})",
            )
        )
    if "seed" in run:
        rows.append(("seed", f"`{run['seed']}`"))
    if "commit" in run:
        rows.append(("code", f"commit `{run['commit']}`" + (" with uncommitted changes" if run.get("dirty") else "")))
    if "trained_on" in run:
        rows.append(("trained on", run["trained_on"]))
    rows.append(("format", f"{fmt} export, oelm_core {info['oelm_core_version']}"))
    if fmt == "transformers":
        load = (
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
            "model = AutoModelForCausalLM.from_pretrained(\"path/to/this/folder\")\n"
            "tokenizer = AutoTokenizer.from_pretrained(\"path/to/this/folder\")"
        )
        about = (
            "A GPT-2 (`GPT2LMHeadModel`) with the weights of an OELM Lab model: at inference "
            "its Q/K projections are ordinary linear maps, so GPT-2's code runs it exactly."
        )
    else:
        load = (
            "from oelm_core.export import load_safetensors\n"
            "model = load_safetensors(\"path/to/this/folder\")   # safetensors and JSON, no pickle"
        )
        about = "The state dict of an OELM Lab GPT, frozen Q/K buffers included, with config.json to rebuild it."
    title = run.get("name") or variant
    table = "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])
    return (
        f"{chr(10).join(front)}\n\n# {title}\n\n{about} OELM: GPT models whose attention Q/K "
        f"projections start as random orthogonal matrices and may stay frozen.\n\n{table}\n\n"
        f"## Load\n\n```python\n{load}\n```\n"
    )


# --------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------


def _plain(model) -> GPT:
    if not isinstance(model, GPT):
        raise ExportError(
            f"export takes an oelm_core GPT (build_model, checkpoint.load_model), got "
            f"{type(model).__name__}: pass the model inside torch.compile's or DDP's "
            f"wrapper (model._orig_mod, model.module)"
        )
    return model


def _out_folder(out_dir: str | Path) -> Path:
    """``out_dir`` when writing there replaces at most an earlier export: a folder holding anything
    else (an --out mistyped as the project's root) is refused, not deleted. What an export killed
    there left (its subfolders' temporaries, with --format both) is no other file."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; pass a folder (new, empty, or an earlier export)")
    ours = [re.compile(LEFT_BY_A_KILL.format(name=re.escape(name))) for name in EXPORT_NAMES]
    other = (
        sorted(
            p.name for p in out.iterdir() if p.name not in EXPORT_NAMES and not any(o.fullmatch(p.name) for o in ours)
        )
        if out.is_dir()
        else []
    )
    if other:
        raise ExportError(
            f"{out} holds files that no export writes ({', '.join(other[:5])}); replacing "
            f"the folder would delete them: pass a new or empty folder as --out"
        )
    return out


@contextmanager
def _writing(out: Path) -> Iterator[Path]:
    """Write the folder ``out`` (``atomic_folder``) holding ``.<name>.lock`` beside it, so that one
    export at a time writes there, and remove what an export killed there left first: its
    temporary ``.<name>.*.tmp`` and ``.<name>.*.old`` folders, which blocked the same command run
    again. ExportError where another export holds the lock; ``files.DiskFull`` on a full disk."""
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with exclusive_lock(out.parent / f".{out.name}.lock"):
            left = re.compile(LEFT_BY_A_KILL.format(name=re.escape(out.name)))
            for p in out.parent.iterdir():
                if left.fullmatch(p.name) and p.is_dir():
                    shutil.rmtree(p)
            with atomic_folder(out, setting="--out") as tmp:
                yield tmp
    except LockHeld as exc:
        raise ExportError(
            f"another export (pid {exc.holder}) is writing {out}; wait for it or pass another --out"
        ) from None


def _safetensors():
    # Imported here: the trainer imports this module, and a GPU image without safetensors still
    # trains (the session then ends without export/, saying why).
    try:
        import safetensors.torch
    except ImportError:
        raise ExportError(
            "the safetensors package is not installed: pip install safetensors (a core dependency of oelm-core)"
        ) from None
    return safetensors


def to_safetensors(model: GPT, out_dir: str | Path, *, card: Optional[dict] = None) -> Path:
    """Write ``model`` to the folder ``out_dir``, created or replaced whole (``atomic_folder``):
    model.safetensors (every tensor of the state dict, on the CPU, in its dtype), config.json
    (``describe``) and README.md (``model_card``). ``card``: what the run knows (``run_card``).
    Returns the folder."""
    model = _plain(model)
    safetensors = _safetensors()
    out = _out_folder(out_dir)
    info = describe(model, card)
    # Tied embeddings are one tensor in the state dict (GPT.lm_head is None, the output layer
    # reads wte.weight), so no tensor is stored twice, which safetensors would refuse.
    tensors = {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}
    with _writing(out) as tmp:
        safetensors.torch.save_file(tensors, tmp / "model.safetensors", metadata=_metadata(info))
        (tmp / "config.json").write_text(json.dumps(info, indent=2) + "\n")
        (tmp / "README.md").write_text(model_card(info, "safetensors"))
    return out


def _metadata(info: dict) -> dict[str, str]:
    """model.safetensors' metadata: PyTorch's format tag, and the ModelConfig (``describe``'s) as
    canonical JSON (``CONFIG_METADATA``)."""
    return {"format": "pt", CONFIG_METADATA: json.dumps(info["model_config"], sort_keys=True)}


def check_config(folder: Path, model_config: dict, weights: Path) -> None:
    """ExportError naming every field where ``model_config`` (what config.json says) differs from
    the ModelConfig ``weights`` (a model.safetensors) was written with: n_head 4 -> 8 changes no
    tensor's shape and loaded another model, freeze_qk all -> none made the frozen Q/K trainable.
    Files exported before the ModelConfig was stored there are not checked."""
    from safetensors import safe_open

    with safe_open(weights, "pt") as f:
        saved = (f.metadata() or {}).get(CONFIG_METADATA)
    if saved is None:
        return
    saved = json.loads(saved)
    differ = [k for k in sorted(set(saved) | set(model_config)) if saved.get(k) != model_config.get(k)]
    if differ:
        said = "; ".join(
            f"{k} is {json.dumps(model_config.get(k))} there, {json.dumps(saved.get(k))} in the weights" for k in differ
        )
        raise ExportError(
            f"{folder}/config.json does not describe {weights.name}: model_config.{said}. "
            f"config.json was edited (or comes from another export): put back the weights' "
            f"values, or export the model again from its checkpoint"
        )


def _our_shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in tensors.items()}


def _gpt2_shapes(tensors: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """The shapes of a transformers GPT-2's ``tensors`` under our names, where a name has an
    equivalent (what ``_shape_disagreement`` reads: embeddings, layers, MLP, head)."""
    ours = {}
    for name, t in tensors.items():
        shape = tuple(t.shape)
        if name in ("transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"):
            ours[name.removeprefix("transformer.")] = shape
        elif m := re.fullmatch(r"transformer\.h\.(\d+)\.mlp\.c_fc\.weight", name):
            ours[f"blocks.{m.group(1)}.mlp.fc.weight"] = shape[::-1]  # Conv1D stores (in, out)
        elif m := re.fullmatch(r"transformer\.h\.(\d+)\.(.*)", name):
            ours[f"blocks.{m.group(1)}.gpt2.{m.group(2)}"] = shape
    return ours


def _shape_disagreement(cfg: ModelConfig, model: GPT, have: dict[str, tuple], gpt2: bool = False) -> Optional[str]:
    """``checkpoint.shape_disagreement`` of config.json's ``cfg`` (``model`` built from it) and a
    file's tensor shapes ``have`` (``_our_shapes``, or ``_gpt2_shapes`` where ``gpt2``)."""
    want = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if gpt2:
        want = _gpt2_shapes(gpt2_weights(model))
        if cfg.tie_embeddings:  # transformers leaves the tied head out of the file
            want.pop("lm_head.weight")
    return shape_disagreement(cfg, want, have, "config.json", padded=not gpt2)


def load_safetensors(folder: str | Path, device: str | torch.device = "cpu") -> GPT:
    """The GPT a ``to_safetensors`` folder holds, in eval mode on ``device``, equal bit for bit to
    the one written (frozen layers frozen again). Reads JSON and safetensors only: no pickle."""
    safetensors = _safetensors()
    folder = Path(folder)
    for name in ("config.json", "model.safetensors"):
        if not (folder / name).is_file():
            raise ExportError(
                f"{folder} holds no {name}: pass a folder that oelm_core.export wrote "
                f"(a run's {RUN_EXPORT}/, or python -m oelm_core.export RUN --out DIR)"
            )
    try:
        info = json.loads((folder / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ExportError(f"{folder}/config.json is not JSON ({exc}); export the model again") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        hint = (
            " (a transformers export: load it with transformers.AutoModelForCausalLM.from_pretrained)"
            if isinstance(info, dict) and info.get("model_type") == "gpt2"
            else ""
        )
        raise ExportError(f"{folder} is not an OELM safetensors export: its config.json has no format {FORMAT!r}{hint}")
    if info.get("format_version") != FORMAT_VERSION:
        raise ExportError(
            f"{folder} has export format {info.get('format_version')!r}; this oelm_core "
            f"reads format {FORMAT_VERSION}: load it with the oelm_core version that wrote "
            f"it ({info.get('oelm_core_version')})"
        )
    try:
        check_config(folder, info["model_config"], folder / "model.safetensors")
        cfg = model_config_from_dict(info["model_config"])
        model = GPT(cfg)
        tensors = safetensors.torch.load_file(folder / "model.safetensors")
    except ExportError:
        raise
    except (ConfigError, RuntimeError, safetensors.SafetensorError, KeyError) as exc:
        raise ExportError(
            f"{folder} holds no model this oelm_core can rebuild ({' '.join(str(exc).split())}); "
            f"export it again from its checkpoint"
        ) from exc
    disagree = _shape_disagreement(cfg, model, _our_shapes(tensors))
    if disagree:
        raise ExportError(
            f"{folder}/config.json does not fit the tensors of model.safetensors: "
            f"{disagree}. config.json was edited (or comes from another export): put back the "
            f"weights' values, or export the model again from its checkpoint"
        )
    model.load_state_dict(tensors)
    return model.to(device).eval()


# --------------------------------------------------------------------------------------------
# transformers (GPT-2)
# --------------------------------------------------------------------------------------------


def gpt2_refusal(model: GPT) -> Optional[str]:
    """Why ``model`` cannot run as transformers' GPT-2; None where it can."""
    cfg = model.cfg
    if cfg.attention != "dot":
        return (
            f"the Synthesizer ({cfg.attention}) has no QK^T at inference: its attention is a learned "
            f"table of position-by-position logits that ignores the input, which GPT-2's attention "
            f"cannot express; export it with --format safetensors (oelm_core.export.load_safetensors)"
        )
    if cfg.vocab_size != GPT2_VOCAB:
        return (
            f"its vocabulary has {cfg.vocab_size} ids, not GPT-2's {GPT2_VOCAB}, so the GPT-2 "
            f"tokenizer written beside it would not fit; export it with --format safetensors"
        )
    return None


@torch.no_grad()
def gpt2_weights(model: GPT) -> dict[str, torch.Tensor]:
    """``model``'s weights under transformers' GPT2LMHeadModel names, on the CPU in the embedding's
    dtype. GPT-2's Conv1D stores (in, out), nn.Linear (out, in): every matrix is transposed, and
    ``c_attn`` is [W_q; W_k; W_v] (3 d, d) transposed to (d, 3 d). The padding rows of the
    vocabulary are dropped; the biases we do not have (Q/K never, V and the output projection
    without ``attn_bias``, MLP and LayerNorm without ``bias``) are zeros."""
    cfg = model.cfg
    d, dtype = cfg.d_model, model.wte.weight.dtype

    def bias(b: Optional[torch.Tensor], n: int) -> torch.Tensor:
        return b if b is not None else torch.zeros(n, dtype=dtype, device=model.wte.weight.device)

    w = {
        "transformer.wte.weight": model.wte.weight[: cfg.vocab_size],
        "transformer.wpe.weight": model.wpe.weight,
        "transformer.ln_f.weight": model.ln_f.weight,
        "transformer.ln_f.bias": bias(model.ln_f.bias, d),
        "lm_head.weight": model.output_weight[: cfg.vocab_size],
    }
    for i, block in enumerate(model.blocks):
        h, attn, mlp = f"transformer.h.{i}.", block.attn, block.mlp
        # qk.weight is what forward multiplies by: for POET, R W0 P with the Neumann-series
        # rotations. POETProjection.merge() would compose the exact Cayley ones instead, which
        # differ by the series' truncation error (and it would change the model).
        qkv = torch.cat([attn.qk.weight.to(dtype), attn.v.weight])
        w.update(
            {
                h + "ln_1.weight": block.ln_1.weight,
                h + "ln_1.bias": bias(block.ln_1.bias, d),
                h + "attn.c_attn.weight": qkv.T,
                h + "attn.c_attn.bias": torch.cat([bias(None, 2 * d), bias(attn.v.bias, d)]),
                h + "attn.c_proj.weight": attn.proj.weight.T,
                h + "attn.c_proj.bias": bias(attn.proj.bias, d),
                h + "ln_2.weight": block.ln_2.weight,
                h + "ln_2.bias": bias(block.ln_2.bias, d),
                h + "mlp.c_fc.weight": mlp.fc.weight.T,
                h + "mlp.c_fc.bias": bias(mlp.fc.bias, cfg.d_ff),
                h + "mlp.c_proj.weight": mlp.proj.weight.T,
                h + "mlp.c_proj.bias": bias(mlp.proj.bias, d),
            }
        )
    return {k: t.detach().to("cpu", dtype).contiguous() for k, t in w.items()}


def _tiktoken_cache() -> tuple[Path, str]:
    """tiktoken's cache folder, found as tiktoken finds it, and how it was found."""
    for var in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if var in os.environ:
            return Path(os.environ[var]), f"{var}={os.environ[var]}"
    folder = Path(tempfile.gettempdir()) / "data-gym-cache"
    return folder, f"tiktoken's default cache {folder} (TIKTOKEN_CACHE_DIR is not set)"


def find_gpt2_tokenizer(tokenizer_dir: str | Path | None = None) -> tuple[Path, Path]:
    """(vocab.json, merges.txt) of GPT-2's BPE: from ``tokenizer_dir`` (Hugging Face's names) when
    given, else tiktoken's cache, which holds the same two files as encoder.json and vocab.bpe
    once ``tiktoken.get_encoding("gpt2")`` has run online. ExportError where neither has them."""
    if tokenizer_dir is not None:
        where = f"tokenizer_dir {tokenizer_dir}"
        files = (Path(tokenizer_dir) / "vocab.json", Path(tokenizer_dir) / "merges.txt")
    else:
        cache, where = _tiktoken_cache()
        files = tuple(
            cache / hashlib.sha1((TIKTOKEN_GPT2_URL + name).encode()).hexdigest()
            for name in ("encoder.json", "vocab.bpe")
        )
    missing = [p.name for p in files if not p.is_file()]
    if missing:
        raise ExportError(
            f"no GPT-2 tokenizer files: {where} lacks {', '.join(missing)}; pass "
            f"--tokenizer-dir (tokenizer_dir=) a folder with GPT-2's vocab.json and "
            f"merges.txt, or set TIKTOKEN_CACHE_DIR to a tiktoken cache holding GPT-2 "
            f"(tiktoken.get_encoding('gpt2') run once online fills it)"
        )
    try:
        vocab = json.loads(files[0].read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        vocab = None
    if not isinstance(vocab, dict) or len(vocab) != GPT2_VOCAB or vocab.get(EOT_TEXT) != EOT:
        raise ExportError(
            f"{files[0]} ({where}) is not GPT-2's vocabulary ({GPT2_VOCAB} entries, "
            f"{EOT_TEXT} = {EOT}); pass the GPT-2 files"
        )
    return files


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ExportError(
            "the transformers format needs the transformers package: pip install "
            "'oelm-core[export]' (or export with --format safetensors)"
        ) from None
    return transformers


def to_transformers(
    model: GPT, out_dir: str | Path, *, card: Optional[dict] = None, tokenizer_dir: str | Path | None = None
) -> Path:
    """Write ``model`` as a transformers GPT-2 to the folder ``out_dir``, created or replaced whole:
    config.json, generation_config.json and model.safetensors (``save_pretrained``), vocab.json,
    merges.txt and tokenizer_config.json (``find_gpt2_tokenizer``), README.md (the card).
    ExportError, before anything is written, where the model is no GPT-2 (``gpt2_refusal``) or the
    tokenizer files are not found. Returns the folder."""
    model = _plain(model)
    why = gpt2_refusal(model)
    if why:
        raise ExportError(f"cannot export this model as a transformers GPT-2: {why}")
    vocab, merges = find_gpt2_tokenizer(tokenizer_dir)
    transformers = _transformers()
    safetensors = _safetensors()
    out = _out_folder(out_dir)
    cfg = model.cfg
    config = transformers.GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.block_size,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=cfg.d_ff,
        # F.gelu(approximate="tanh") in our MLP: GPT-2's own "gelu_new", the same formula
        activation_function="gelu_new",
        layer_norm_epsilon=model.ln_f.eps,
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=EOT,
        eos_token_id=EOT,
        # What rebuilds the oelm_core model from these weights (load_transformers): transformers
        # keeps unknown config keys and writes them to config.json.
        oelm=describe(model, card),
    )
    gpt2 = transformers.GPT2LMHeadModel(config)
    gpt2.load_state_dict(gpt2_weights(model))
    info = config.oelm
    tokenizer_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": EOT_TEXT,
        "eos_token": EOT_TEXT,
        "unk_token": EOT_TEXT,
        "model_max_length": cfg.block_size,
    }
    with _writing(out) as tmp:
        gpt2.save_pretrained(tmp)
        # Its ModelConfig in the weights' metadata too (transformers writes only the format tag).
        weights = tmp / "model.safetensors"
        safetensors.torch.save_file(safetensors.torch.load_file(weights), weights, metadata=_metadata(info))
        shutil.copyfile(vocab, tmp / "vocab.json")
        shutil.copyfile(merges, tmp / "merges.txt")
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
        (tmp / "README.md").write_text(model_card(info, "transformers"))
    return out


def load_transformers(folder: str | Path, device: str | torch.device = "cpu") -> GPT:
    """The oelm_core GPT of a ``to_transformers`` folder, in eval mode on ``device``: the inverse of
    ``gpt2_weights``, read from config.json (its "oelm" entry) and model.safetensors, with neither
    transformers nor a pickle. Its logits equal the exported model's. POET's exported W_q, W_k are
    its rotations composed with W0, from which R, W0 and P cannot be recovered: refused, as is a
    GPT-2 that oelm_core did not export (its Q/K construction is unknown)."""
    safetensors = _safetensors()
    folder = Path(folder)
    try:
        info = json.loads((folder / "config.json").read_text()).get("oelm")
    except (OSError, ValueError, AttributeError) as exc:
        raise ExportError(
            f"{folder} holds no readable config.json ({exc}); pass a folder that "
            f"oelm_core.export wrote with --format transformers"
        ) from None
    if not isinstance(info, dict) or "model_config" not in info:
        raise ExportError(
            f"{folder} is a transformers model that oelm_core did not export (its config.json "
            f"has no 'oelm' entry), so its Q/K construction and freezing are unknown; load "
            f"it with transformers.AutoModelForCausalLM.from_pretrained"
        )
    cfg = model_config_from_dict(info["model_config"])
    if cfg.poet_block_size:
        raise ExportError(
            f"{folder} holds a POET model as GPT-2: its W_q, W_k are R W0 P composed, from which "
            f"POET's rotations cannot be recovered; load its safetensors export instead"
        )
    check_config(folder, info["model_config"], folder / "model.safetensors")
    gpt2_config = json.loads((folder / "config.json").read_text())
    differ = [
        f"{theirs} is {gpt2_config.get(theirs)} there, model_config.{ours} {getattr(cfg, ours)}"
        for theirs, ours in GPT2_KEYS.items()
        if gpt2_config.get(theirs) != getattr(cfg, ours)
    ]
    if differ:
        raise ExportError(
            f"{folder}/config.json disagrees with itself: {'; '.join(differ)} (its 'oelm' entry). It "
            f"was edited: put back the values the weights were exported with, or export the model "
            f"again from its checkpoint"
        )
    model = GPT(cfg)
    gpt2 = safetensors.torch.load_file(folder / "model.safetensors")
    disagree = _shape_disagreement(cfg, model, _gpt2_shapes(gpt2), gpt2=True)
    if disagree:
        raise ExportError(
            f"{folder}/config.json does not fit the tensors of model.safetensors: "
            f"{disagree}. config.json was edited (or comes from another export): put back the "
            f"weights' values, or export the model again from its checkpoint"
        )
    state = model.state_dict()
    d, vocab = cfg.d_model, cfg.vocab_size

    def take(name: str, gpt2_name: str, transpose: bool = False) -> None:
        if name in state:  # the biases and untied head this model has
            t = gpt2[gpt2_name].T if transpose else gpt2[gpt2_name]
            state[name] = state[name].clone()
            state[name][: t.size(0)] = t.to(state[name].dtype)

    take("wte.weight", "transformer.wte.weight")  # the padding rows stay zero
    take("wpe.weight", "transformer.wpe.weight")
    take("lm_head.weight", "lm_head.weight")
    for name in ("weight", "bias"):
        take(f"ln_f.{name}", f"transformer.ln_f.{name}")
    for i in range(cfg.n_layer):
        b, h = f"blocks.{i}.", f"transformer.h.{i}."
        qkv = gpt2[h + "attn.c_attn.weight"].T
        state[b + "attn.qk.weight"] = qkv[: 2 * d].clone()
        state[b + "attn.v.weight"] = qkv[2 * d :].clone()
        if b + "attn.v.bias" in state:
            state[b + "attn.v.bias"] = gpt2[h + "attn.c_attn.bias"][2 * d :].clone()
        for ours, theirs, transpose in (
            ("attn.proj.weight", "attn.c_proj.weight", True),
            ("attn.proj.bias", "attn.c_proj.bias", False),
            ("mlp.fc.weight", "mlp.c_fc.weight", True),
            ("mlp.fc.bias", "mlp.c_fc.bias", False),
            ("mlp.proj.weight", "mlp.c_proj.weight", True),
            ("mlp.proj.bias", "mlp.c_proj.bias", False),
            ("ln_1.weight", "ln_1.weight", False),
            ("ln_1.bias", "ln_1.bias", False),
            ("ln_2.weight", "ln_2.weight", False),
            ("ln_2.bias", "ln_2.bias", False),
        ):
            take(b + ours, h + theirs, transpose)
    if vocab > len(gpt2["transformer.wte.weight"]):
        raise ExportError(
            f"{folder}: its embedding has {len(gpt2['transformer.wte.weight'])} rows for a "
            f"{vocab}-word model; export it again"
        )
    model.load_state_dict(state)
    return model.to(device).eval()


def load_export(folder: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, dict]:
    """(model, card) of a folder either format wrote: ``load_safetensors`` or ``load_transformers``
    by its config.json, and the card of the run it came from (config.json's "run": step,
    validation figures, ...)."""
    folder = Path(folder)
    try:
        info = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ExportError(
            f"{folder} holds no readable config.json ({exc}); pass a checkpoint, a run "
            f"folder or a folder that oelm_core.export wrote"
        ) from None
    if isinstance(info, dict) and info.get("model_type") == "gpt2":
        return load_transformers(folder, device), dict((info.get("oelm") or {}).get("run") or {})
    return load_safetensors(folder, device), dict(info.get("run") or {}) if isinstance(info, dict) else {}


# --------------------------------------------------------------------------------------------
# Checkpoints and run folders; the CLI
# --------------------------------------------------------------------------------------------


def load_for_export(source: str | Path) -> tuple[GPT, dict]:
    """(model, card) of a checkpoint file or a run folder (its best.pt); the card reads the run
    folder's summary.json and config.yaml where they exist (``run_card``)."""
    source = Path(source)
    ckpt = source / "best.pt" if source.is_dir() else source
    if source.is_dir() and not ckpt.is_file():
        raise CheckpointError(
            f"{source} holds no best.pt: pass a run folder that has evaluated at least "
            f"once, or a checkpoint file (its ckpt/step_*.pt)"
        )
    model, state = load_model(ckpt)
    # A step checkpoint lies in the run folder's ckpt/
    run_dir = next(
        (
            d
            for d in (ckpt.parent, ckpt.parent.parent)
            if (d / "config.yaml").is_file() or (d / "summary.json").is_file()
        ),
        None,
    )
    return model, run_card(state, run_dir, weights=ckpt.name)


def export_run(run_dir: str | Path) -> Path:
    """run_dir/export/: the run's best.pt as ``to_safetensors`` writes it, its card naming the
    code, software and token files summary.json records (the trainer calls this as a session ends)."""
    run_dir = Path(run_dir)
    model, card = load_for_export(run_dir)
    try:
        return to_safetensors(model, run_dir / RUN_EXPORT, card=card)
    except DiskFull as exc:  # the run is saved; the trainer says why export/ is missing
        raise ExportError(str(exc)) from None


def export(
    source: str | Path, out: str | Path, fmt: str = "safetensors", tokenizer_dir: str | Path | None = None
) -> list[Path]:
    """The CLI's work: ``source`` (checkpoint or run folder) to ``out`` in ``fmt``; "both" writes
    out/safetensors and out/transformers. What stops the transformers folder (a non-GPT-2, no
    tokenizer files, no transformers) stops the command before it writes anything."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    model, card = load_for_export(source)
    out = Path(out)
    if fmt != "safetensors":
        why = gpt2_refusal(model)
        if why:
            raise ExportError(f"cannot export {source} as a transformers GPT-2: {why}")
        find_gpt2_tokenizer(tokenizer_dir)
        _transformers()
    if fmt == "both":
        _out_folder(out)
        return [
            to_safetensors(model, out / "safetensors", card=card),
            to_transformers(model, out / "transformers", card=card, tokenizer_dir=tokenizer_dir),
        ]
    if fmt == "transformers":
        return [to_transformers(model, out, card=card, tokenizer_dir=tokenizer_dir)]
    return [to_safetensors(model, out, card=card)]


def main(argv: Optional[list[str]] = None) -> int:
    """The CLI; returns the exit code: 0 written, 2 nothing written (the error on one line), 1 the
    disk filled up (nothing written either)."""
    p = argparse.ArgumentParser(
        prog="python -m oelm_core.export",
        description="Export a checkpoint or run folder as safetensors and/or a transformers GPT-2 (docs/export.md).",
    )
    p.add_argument("source", help="a checkpoint (.pt) or a run folder (its best.pt is exported)")
    p.add_argument("--out", required=True, help="the folder to write (new, empty or an earlier export)")
    p.add_argument(
        "--format",
        default="safetensors",
        choices=FORMATS,
        help="safetensors: any variant, loads with oelm_core.export.load_safetensors; "
        "transformers: GPT2LMHeadModel with its tokenizer; both: OUT/safetensors and "
        "OUT/transformers (default: safetensors)",
    )
    p.add_argument(
        "--tokenizer-dir",
        help="a folder with GPT-2's vocab.json and merges.txt (default: tiktoken's cache, TIKTOKEN_CACHE_DIR)",
    )
    args = p.parse_args(argv)
    try:
        written = export(args.source, args.out, args.format, args.tokenizer_dir)
    except (ExportError, CheckpointError, DiskFull) as exc:
        print(f"error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1 if isinstance(exc, DiskFull) else 2
    for folder in written:
        print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
