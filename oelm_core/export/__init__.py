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

One concept per module (this package's ``__init__`` is the public API: the CLI, what a run folder
or checkpoint becomes, and every name below re-exported):

    card         what the model is: config.json's description and the README.md model card
    native       the safetensors format, and the weights' checks the GPT-2 loader shares
    gpt2         the transformers format: the GPT-2 folder, its tokenizer files, the way back
    gpt2_layout  our weights under GPT-2's names and shapes; which models are GPT-2s
    folders      the folder an export writes: what --out may replace, atomic, one writer
    errors       ExportError

safetensors and transformers are imported only when a format is written or loaded: the trainer
imports this package, and a GPU image without them still trains.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import torch

from oelm_core.checkpoint import CheckpointError, load_model
from oelm_core.export.card import FORMAT, FORMAT_VERSION, describe, model_card, run_card
from oelm_core.export.errors import ExportError
from oelm_core.export.folders import EXPORT_NAMES, LEFT_BY_A_KILL, _out_folder
from oelm_core.export.gpt2 import (
    TIKTOKEN_GPT2_URL,
    _transformers,
    find_gpt2_tokenizer,
    load_transformers,
    to_transformers,
)
from oelm_core.export.gpt2_layout import GPT2_KEYS, GPT2_VOCAB, gpt2_refusal, gpt2_weights
from oelm_core.export.native import CONFIG_METADATA, RUN_EXPORT, check_config, load_safetensors, to_safetensors
from oelm_core.files import DiskFull
from oelm_core.model import GPT

FORMATS = ("safetensors", "transformers", "both")

__all__ = [
    "CONFIG_METADATA",
    "EXPORT_NAMES",
    "FORMAT",
    "FORMATS",
    "FORMAT_VERSION",
    "GPT2_KEYS",
    "GPT2_VOCAB",
    "LEFT_BY_A_KILL",
    "RUN_EXPORT",
    "TIKTOKEN_GPT2_URL",
    "ExportError",
    "check_config",
    "describe",
    "export",
    "export_run",
    "find_gpt2_tokenizer",
    "gpt2_refusal",
    "gpt2_weights",
    "load_export",
    "load_for_export",
    "load_safetensors",
    "load_transformers",
    "main",
    "model_card",
    "run_card",
    "to_safetensors",
    "to_transformers",
]


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
