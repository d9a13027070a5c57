"""The transformers format: a dot-product model as a GPT2LMHeadModel folder with GPT-2's
tokenizer files (``to_transformers``), and the way back to our GPT from its config.json and
model.safetensors without transformers (``load_transformers``). transformers is imported only
when writing (the ``export`` extra): loading and the trainer need none of it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch

from oelm_core.config import model_config_from_dict
from oelm_core.data import EOT, EOT_TEXT
from oelm_core.export.card import describe, model_card
from oelm_core.export.errors import ExportError
from oelm_core.export.folders import _out_folder, _writing
from oelm_core.export.gpt2_layout import GPT2_KEYS, GPT2_VOCAB, _gpt2_shapes, gpt2_refusal, gpt2_weights
from oelm_core.export.native import _metadata, _plain, _safetensors, _shape_disagreement, check_config
from oelm_core.model import GPT

# Where tiktoken.get_encoding("gpt2") downloads GPT-2's BPE from; its cache names each file by the
# sha1 of its URL (encoder.json: 6c7ea1a7..., vocab.bpe: 6d1cbeee...).
TIKTOKEN_GPT2_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"


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
