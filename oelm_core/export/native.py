"""The safetensors format, oelm_core's own: any variant as model.safetensors (the whole state
dict, frozen Q/K buffers included), config.json and README.md, loaded back bit for bit from
safetensors and JSON alone (no pickle). The transformers format writes and reads the same
model.safetensors, so it reuses what is here: the plain-GPT check, the lazily imported
safetensors package, the ModelConfig kept in the weights' metadata, and the checks of an edited
config.json against it and against the tensors' shapes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from oelm_core.checkpoint import shape_disagreement
from oelm_core.config import ConfigError, ModelConfig, model_config_from_dict
from oelm_core.export.card import FORMAT, FORMAT_VERSION, describe, model_card
from oelm_core.export.errors import ExportError
from oelm_core.export.folders import _out_folder, _writing
from oelm_core.export.gpt2_layout import _gpt2_shapes, gpt2_weights
from oelm_core.model import GPT

RUN_EXPORT = "export"  # the run folder's safetensors export, written when a session ends
# model.safetensors' metadata entry holding the ModelConfig it was written with, as JSON: what
# notices a config.json edited without changing any tensor's shape (n_head, freeze_qk).
CONFIG_METADATA = "oelm_model_config"


def _plain(model) -> GPT:
    if not isinstance(model, GPT):
        raise ExportError(
            f"export takes an oelm_core GPT (build_model, checkpoint.load_model), got "
            f"{type(model).__name__}: pass the model inside torch.compile's or DDP's "
            f"wrapper (model._orig_mod, model.module)"
        )
    return model


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
