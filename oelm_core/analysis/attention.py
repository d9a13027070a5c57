"""Attention of trained models: the maps of one text, per-head entropy and distance, a figure.

The app draws the same maps with its own figures (``oelm_core.analysis.heatmaps``); both read
them through ``attention_maps``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from oelm_core.analysis.figures import pyplot, save_figure


def attention_maps(model, text_or_ids, max_tokens: int | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """(token ids, [per layer (n_head, T, T) attention probabilities]) of one text or id list:
    its first ``max_tokens`` tokens if given. ValueError for an empty text or one longer than
    the model's context (``model.cfg.block_size``)."""
    ids = _encode(text_or_ids, model.cfg.block_size, max_tokens)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    _, maps = model.forward_with_attention(torch.tensor([ids], device=device))
    model.train(was_training)
    return ids, [m[0].float().cpu() for m in maps]


def _encode(text_or_ids, block_size: int, max_tokens: int | None = None) -> list[int]:
    """The ids of a text (GPT-2 BPE) or a sequence of ids, the first ``max_tokens`` of them if
    given. The model's learned positions end at ``block_size``: a longer input is refused, not
    cut at a place the caller did not choose."""
    if isinstance(text_or_ids, str):
        from oelm_core.data import encode_prompt

        ids = encode_prompt(text_or_ids)
    else:
        ids = list(text_or_ids)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if not ids:
        raise ValueError(
            "no tokens to compute attention over: the text is empty; pass at least one token"
            if max_tokens is None or max_tokens > 0
            else f"max_tokens={max_tokens} keeps no tokens; pass max_tokens >= 1"
        )
    if len(ids) > block_size:
        raise ValueError(
            f"{len(ids)} tokens exceed the model's context of {block_size}; pass "
            f"max_tokens={block_size} (or fewer) to keep the first tokens, or shorten the text"
        )
    return ids


def attention_summary(model, text_or_ids, max_tokens: int | None = None) -> list[dict]:
    """Per layer and head: mean attention entropy (nats) and mean attention distance (tokens)
    over the query positions of one text (the tokens of ``attention_maps``)."""
    return summarise_attention(attention_maps(model, text_or_ids, max_tokens)[1])


def summarise_attention(maps: Sequence[torch.Tensor]) -> list[dict]:
    """``attention_summary`` of maps already computed (one (n_head, T, T) tensor per layer, as
    ``attention_maps`` gives them): the app draws and summarises one set of maps."""
    t = maps[0].shape[-1]
    dist = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).clamp(min=0).float()
    rows = []
    for layer, att in enumerate(maps):
        p = att.clamp_min(1e-12)
        entropy = -(att * p.log()).sum(-1).mean(-1)  # (n_head,)
        distance = (att * dist).sum(-1).mean(-1)  # (n_head,)
        for head in range(att.shape[0]):
            rows.append(
                {"layer": layer, "head": head, "entropy": float(entropy[head]), "mean_distance": float(distance[head])}
            )
    return rows


def uniform_reference(t: int) -> dict[str, float]:
    """Entropy (nats) and mean distance (tokens) of uniform causal attention over ``t`` tokens,
    averaged over query positions like ``summarise_attention``: query i sees i + 1 keys, so its
    entropy is log(i + 1) and its mean distance i / 2. The app draws it as the level that a
    head attending to everything before it would reach."""
    pos = torch.arange(max(t, 1), dtype=torch.float64)
    return {"entropy": float(torch.log(pos + 1).mean()), "distance": float((pos / 2).mean())}


def attention_figure(
    models: dict, text: str, layer: int = 0, head: int = 0, max_tokens: int = 32, path: str | Path | None = None
):
    """Attention of ``head`` in ``layer`` of each model on the same text, side by side."""
    from oelm_core.data import get_tokenizer

    plt = pyplot()
    enc = get_tokenizer()
    fig, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 4.4), squeeze=False)
    for ax, (label, model) in zip(axes[0], models.items()):
        ids, maps = attention_maps(model, text, max_tokens)
        lay = min(layer, len(maps) - 1)
        hd = min(head, maps[lay].shape[0] - 1)
        ax.imshow(maps[lay][hd].numpy(), cmap="viridis", vmin=0, vmax=1)
        toks = [enc.decode([i]).replace("\n", "\\n") for i in ids]
        ax.set_xticks(range(len(ids)), toks, rotation=90, fontsize=6)
        ax.set_yticks(range(len(ids)), toks, fontsize=6)
        ax.set_title(f"{label}: layer {lay}, head {hd}", fontsize=9)
    fig.tight_layout()
    return save_figure(fig, path)
