"""Checkpoints: written atomically, read with ``weights_only=True``, rebuilt into models.

A checkpoint is a plain dict (tensors, numbers, strings, lists, dicts) so that loading never
unpickles arbitrary objects:

    format_version  1
    model           the model's state_dict (frozen Q/K buffers included)
    model_config    ModelConfig fields as a dict
    run_config      the RunConfig as a dict (absent for models saved outside a run)
    step            optimiser steps taken
    metrics         latest figures, e.g. val_loss, val_ppl, train_loss, tokens_seen
    data            the prepared data trained on: text_hash, content_hash, train_tokens, val_tokens
                    (from its meta.json; --resume refuses other data)
    optimizer, rng, sampler   what ``--resume`` needs (training checkpoints only)
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any, Optional

import torch

from oelm_core.config import PRESETS, ConfigError, ModelConfig, model_config_from_dict
from oelm_core.files import atomic_write
from oelm_core.model import GPT

FORMAT_VERSION = 1

# Only the training checkpoints (ckpt/step_N.pt) hold these; best.pt leaves them out.
RESUME_KEYS = ("optimizer", "rng", "sampler")
# What --resume reads from a checkpoint.
TRAINING_KEYS = ("run_config", "step", "metrics", *RESUME_KEYS)


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, truncated or not one of ours."""


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Write ``state`` to ``path`` atomically, so a run killed mid-write leaves the previous
    checkpoint intact; on a full disk ``files.DiskFull`` says how much the checkpoint needs."""
    return atomic_write(
        path,
        lambda f: torch.save({"format_version": FORMAT_VERSION, **state}, f),
        need=lambda: _tensor_bytes(state),
        setting="out_dir",
    )


def _tensor_bytes(value: Any) -> int:
    """The bytes of the tensors in ``value`` (dicts and lists searched): near a checkpoint's size."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint (``weights_only=True``), with an error that says what to do instead."""
    path = Path(path)
    if path.is_dir():
        inside = [p for p in (path / "best.pt", path / "ckpt") if p.exists()]
        raise CheckpointError(
            f"{path} is a folder, not a checkpoint file: pass a .pt file"
            + (f" such as {inside[0]}" + ("/step_*.pt" if inside[0].is_dir() else "") if inside else "")
        )
    if not path.is_file():
        raise CheckpointError(
            f"checkpoint {path} not found; train a run first "
            f"(python -m oelm_core.train --params ...) or pass an existing .pt file"
        )
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        refused = _refused_object(exc)
        if refused is None:
            raise CheckpointError(
                f"checkpoint {path} could not be read ({_what_failed(exc)}); the file is "
                f"truncated or not an OELM checkpoint: use another checkpoint of the run folder "
                f"(best.pt or an earlier step) or train again"
            ) from exc
        name, why = refused
        raise CheckpointError(
            f"checkpoint {path} holds code, not only weights: it names the Python object `{name}`, which "
            f"unpickling would import and call ({why}); weights-only loading refused it, so nothing in the "
            f"file ran. OELM checkpoints hold tensors, numbers, strings, lists and dicts only: do not load "
            f"this one with weights_only=False unless you trust where it came from; use a checkpoint of a "
            f"run folder (best.pt or ckpt/step_*.pt) or train again"
        ) from exc
    except Exception as exc:  # torch raises several types for truncated or foreign files
        raise CheckpointError(
            f"checkpoint {path} could not be read ({_what_failed(exc)}); the file is "
            f"truncated or not an OELM checkpoint: use another checkpoint of the run folder "
            f"(best.pt or an earlier step) or train again"
        ) from exc
    if not isinstance(state, dict) or "model" not in state or "model_config" not in state:
        raise CheckpointError(f"{path} is not an OELM checkpoint (no 'model' / 'model_config' entries)")
    if state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format {state.get('format_version')!r}; this "
            f"oelm_core reads format {FORMAT_VERSION}: load it with the oelm_core "
            f"version that wrote it"
        )
    return state


def _refused_object(exc: pickle.UnpicklingError) -> tuple[str, str] | None:
    """(the dotted name, why it was refused) of the object torch's weights-only unpickler refused
    to import, read from its message; None where the message names none (a damaged pickle).
    torch words it "Trying to load unsupported GLOBAL posix.system whose module posix is
    blocked." for its blocked modules (os, sys and their like), "Unsupported global: GLOBAL
    x.Y was not an allowed global by default." for any other object."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
    found = re.search(r"GLOBAL (\S+?)\.? (whose module (\S+) is blocked|was not an allowed global)", text)
    if found is None:
        return None
    if found.group(3):
        return found.group(1), (
            f"its module {found.group(3)} is one weights-only loading always blocks: it "
            f"reaches the interpreter and the operating system, to run programs and touch files"
        )
    return found.group(1), "weights-only loading allows no such object"


def _what_failed(exc: Exception) -> str:
    """The error's type and torch's first sentence, whole. The rest of its message is advice for
    other situations (torch's weights_only failure goes on for lines about trusting the
    file); where the file holds an object that weights_only refuses, the sentence naming it."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line]
    refused = [line.split(":", 1)[1].strip() for line in lines if line.startswith("WeightsUnpickler error:")]
    first = refused[0] if refused else lines[0] if lines else ""
    sentence = re.match(r"(.+?\.)(\s|$)", first)
    reason = sentence.group(1) if sentence else first
    return f"{type(exc).__name__}: {reason}" if reason else type(exc).__name__


def shape_disagreement(
    cfg: ModelConfig, want: dict[str, tuple], have: dict[str, tuple], where: str, padded: bool = True
) -> Optional[str]:
    """What in ``cfg`` (as ``where`` states it: "config.json") the tensor shapes ``have`` (a
    file's, under the names of GPT's state dict) contradict, where ``want`` are the shapes a
    model of ``cfg`` has: each key named with both values and the tensor that shows it, and the
    preset the weights' shape is, if any ("the weights are a smoke model's"); None where they
    agree. PyTorch's own message lists tensors, never the setting. ``padded``: the embedding's
    rows are the vocabulary padded to vocab_pad_multiple (a GPT-2 file's are not)."""
    if want == have:
        return None

    def held(name: str, axis: int) -> Optional[int]:
        return have[name][axis] if name in have and len(have[name]) > axis else None

    layers = {int(k.split(".")[1]) for k in have if re.match(r"blocks\.\d+\.", k)}
    fc = "blocks.0.mlp.fc.weight"
    found = {  # key: (the config's value, the weights' value, the tensor that shows it)
        "n_layer": (cfg.n_layer, max(layers) + 1 if layers else 0, f"blocks.0 .. blocks.{max(layers, default=0)}"),
        "d_model": (cfg.d_model, held("wte.weight", 1), f"wte.weight {have.get('wte.weight')}"),
        "block_size": (cfg.block_size, held("wpe.weight", 0), f"wpe.weight {have.get('wpe.weight')}"),
        "d_ff": (cfg.d_ff, held(fc, 0), f"{fc} {have.get(fc)}"),
        "vocab_size": (
            want.get("wte.weight", (0,))[0],
            held("wte.weight", 0),
            f"wte.weight {have.get('wte.weight')}"
            + (": its rows are the vocabulary padded to vocab_pad_multiple" if padded else ""),
        ),
        "tie_embeddings": (cfg.tie_embeddings, "lm_head.weight" not in have, "lm_head.weight"),
    }
    if padded:
        found.update(
            bias=(cfg.bias, "ln_f.bias" in have, "ln_f.bias"),
            attn_bias=(cfg.attn_bias, "blocks.0.attn.v.bias" in have, "blocks.0.attn.v.bias"),
        )
    said = [
        f"model_config.{k} is {json.dumps(mine)} in {where}, {json.dumps(theirs)} in the weights ({shown})"
        for k, (mine, theirs, shown) in found.items()
        if theirs is not None and mine != theirs
    ]
    if not said:  # another attention or Q/K construction: other tensor names
        missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
        odd = sorted(k for k in set(want) & set(have) if want[k] != have[k])
        said = [
            f"the weights lack {', '.join(missing[:3])}" if missing else "",
            f"they hold {', '.join(extra[:3])} that the model of {where} has not" if extra else "",
            f"{odd[0]} is {have[odd[0]]} there, {want[odd[0]]} for {where}" if odd else "",
        ]
        said = [x for x in said if x] + ["check model_config's attention, qk_init and poet_block_size"]
    shape = {k: found[k][1] for k in ("n_layer", "d_model", "block_size", "d_ff")}
    preset = next((name for name, p in PRESETS.items() if all(p.get(k) == v for k, v in shape.items())), None)
    return "; ".join(said) + (f" (the weights are a {preset} model's)" if preset else "")


def model_from_state(state: dict[str, Any], device: str | torch.device = "cpu", source: str = "the checkpoint") -> GPT:
    """Rebuild the GPT a checkpoint holds. ``model_config`` describes the model as saved: a run
    that unfroze Q/K on a schedule saves ``freeze_qk`` with the layers still frozen then.
    CheckpointError, naming ``source``, where the config is unusable or the weights do not fit it
    exactly (a loose load would leave the missing weights random), the keys named."""
    try:
        cfg: ModelConfig = model_config_from_dict(dict(state["model_config"]))
        model = GPT(cfg)
    except ConfigError as exc:
        raise CheckpointError(
            f"{source} holds no model this oelm_core can rebuild ({' '.join(str(exc).split())}); "
            f"it was not written by this oelm_core's trainer, or was edited: use another "
            f"checkpoint or train again"
        ) from exc
    weights = state["model"]
    disagree = shape_disagreement(
        cfg,
        {k: tuple(v.shape) for k, v in model.state_dict().items()},
        {k: tuple(v.shape) for k, v in weights.items()},
        "the checkpoint",
    )
    if disagree:
        raise CheckpointError(
            f"{source} holds weights that do not fit its model_config: {disagree}; it was "
            f"edited, or its weights come from another run: use another checkpoint or train again"
        )
    try:
        model.load_state_dict(weights)
    except RuntimeError as exc:
        raise CheckpointError(
            f"{source} holds no model this oelm_core can rebuild ({' '.join(str(exc).split())}); "
            f"use another checkpoint or train again"
        ) from exc
    return model.to(device)


def load_model(path: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, dict[str, Any]]:
    """(model in eval mode on ``device``, the checkpoint dict without its optimizer state)."""
    state = load_checkpoint(path)
    model = model_from_state(state, device, source=str(path)).eval()
    state.pop("optimizer", None)
    return model, state
