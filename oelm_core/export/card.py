"""What the model is: config.json of the safetensors export (``describe``, also the ``oelm``
entry of the transformers one) and the README.md model card of both, from the model and what its
run knows (``run_card``). No format's files are written here: both formats describe the model
the same way, so the description is one module they share."""

from __future__ import annotations

import dataclasses
from importlib import metadata
from pathlib import Path
from typing import Optional

from oelm_core.accounting import count_parameters
from oelm_core.config import PRESETS, ModelConfig, variant_overrides, variants
from oelm_core.model import GPT
from oelm_core.orthogonal import QK_INITS
from oelm_core.parameter_files import read_yaml
from oelm_core.run_folder import read_summary

FORMAT = "oelm-core/safetensors"
FORMAT_VERSION = 1


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
