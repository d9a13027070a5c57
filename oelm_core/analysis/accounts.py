"""The 02 model notebook's accounts of each variant: exact parameter counts, FLOPs and memory per
trained token, a gradient-flow check of the freezing, and an explorer of other shapes.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Iterable

import torch

from oelm_core.analysis.groups import BASELINE, GROUP_LABELS, variant_definition
from oelm_core.analysis.markdown import markdown_table
from oelm_core.config import RunConfig, model_config


def _accounts(preset: str, variant: str, overrides: dict) -> tuple[dict, dict]:
    """(count_parameters, memory_account) of one built model; cached so tables share one build.
    The cache key holds the overrides as JSON (a list value, freeze_qk=[0], is not hashable) and
    what the preset and variant stand for now (variant_definition)."""
    return _accounts_cached(preset, variant, json.dumps(overrides, sort_keys=True), variant_definition(preset, variant))


@functools.lru_cache(maxsize=64)
def _accounts_cached(preset: str, variant: str, overrides_json: str, definition: str) -> tuple[dict, dict]:
    from oelm_core import build_model, count_parameters, memory_account

    model = build_model(preset, variant, **json.loads(overrides_json))
    return count_parameters(model), memory_account(model)


def parameter_table(
    preset: str = RunConfig.preset, variants: Iterable[str] | None = None, **overrides: Any
) -> list[dict]:
    """Exact trainable / frozen / total parameters of each variant at ``preset``.

    ``trainable_reduction`` is the share of GPT-Base's trainable parameters the variant does not train.
    """
    from oelm_core import VARIANTS

    names = list(variants or VARIANTS)
    rows = []
    for v in names:
        c = _accounts(preset, v, overrides)[0]
        rows.append(
            {
                "variant": v,
                "label": GROUP_LABELS.get(v, v),
                "trainable": c["trainable"],
                "frozen": c["frozen"],
                "total": c["total"],
            }
        )
    base = next((r for r in rows if r["variant"] == BASELINE), None)
    for r in rows:
        r["trainable_reduction"] = (1 - r["trainable"] / base["trainable"]) if base else None
    return rows


def analytic_parameters(cfg) -> dict:
    """Trainable/frozen/total parameters of a dot-attention GPT with plain Q/K projections from
    its shape alone (no weights are built, so the explorer can show Large in an instant); equals
    ``count_parameters``. ValueError for POET and Synthesizer configs, whose Q/K differ."""
    if cfg.poet_block_size or cfg.attention != "dot":
        what = (
            f"POET (poet_block_size={cfg.poet_block_size}) learns Q/K through R and P"
            if cfg.poet_block_size
            else f"attention {cfg.attention!r} has no Q/K"
        )
        raise ValueError(
            f"analytic_parameters counts plain Q/K projections, but {what}; count a "
            f"built model instead: count_parameters(build_model(cfg))"
        )
    d, ff, L, V, T = cfg.d_model, cfg.d_ff, cfg.n_layer, cfg.vocab_size, cfg.block_size
    ln = 2 * d if cfg.bias else d
    attn_other = 2 * d * d + (2 * d if cfg.attn_bias else 0)  # V and output projections
    qk = 2 * d * d  # QKProjection has no bias
    mlp = 2 * d * ff + ((ff + d) if cfg.bias else 0)
    per_layer = 2 * ln + attn_other + mlp
    embed = V * d + T * d + (0 if cfg.tie_embeddings else V * d)
    frozen = qk * len(cfg.frozen_layers())
    total = embed + L * (per_layer + qk) + ln
    return {"trainable": total - frozen, "frozen": frozen, "total": total}


def flops_table(preset: str = RunConfig.preset, variants: Iterable[str] | None = None, **overrides: Any) -> list[dict]:
    """FLOPs per trained token (forward, backward) and weight+optimizer memory per variant."""
    from oelm_core import VARIANTS, flops_per_token

    rows = []
    for v in list(variants or VARIANTS):
        cfg = model_config(preset, v, **overrides)
        f = flops_per_token(cfg)
        m = _accounts(preset, v, overrides)[1]
        rows.append(
            {
                "variant": v,
                "forward_flops": f["total_forward"],
                "backward_flops": f["total_backward"],
                "total_flops": f["total"],
                "frozen_saving_flops": f["frozen_saving"]["flops"],
                "frozen_saving_pct": 100 * f["frozen_saving"]["fraction"],
                "state_mb": m["total"] / 2**20,
                "state_saving_mb": m["frozen_saving"] / 2**20,
            }
        )
    return rows


def gradient_flow_check(preset: str = "tiny", variant: str = "oelm_freeze", seed: int = 0) -> dict:
    """One forward/backward and AdamW step on random tokens: are the Q/K of exactly the layers
    the config freezes frozen, and does every trainable parameter get a gradient?

    Returns {'frozen_qk': [names], 'frozen_without_grad': bool, 'qk_unchanged_by_step': bool,
    'trainable_with_grad': bool, 'params_without_grad': [names], 'trainable_qk_in_frozen_layers':
    [names]}. ``frozen_qk`` are the model's Q/K buffers; ``frozen_without_grad`` holds when they
    are those of ``cfg.frozen_layers()``, without gradient, and no Q/K parameter of those layers
    is trainable (listed in ``trainable_qk_in_frozen_layers``); ``qk_unchanged_by_step`` when the
    Q/K of those layers, buffers or not, are bit for bit the same after the step.
    """
    from oelm_core import build_model

    model = build_model(preset, variant, seed=seed)
    cfg = model.cfg
    layers = cfg.frozen_layers()  # none for the Synthesizer and POET (ModelConfig.validate)
    expected = sorted(f"blocks.{i}.attn.qk.weight" for i in layers)
    frozen = {n: b for n, b in model.named_buffers() if n.endswith(".attn.qk.weight")}
    prefixes = tuple(f"blocks.{i}.attn.qk." for i in layers)
    trainable_qk = [n for n, p in model.named_parameters() if p.requires_grad and n.startswith(prefixes)]
    state = model.state_dict()
    before = {n: state[n].clone() for n in expected}
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size), generator=g)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model(idx, idx).backward()
    no_grad = [
        n for n, p in model.named_parameters() if p.requires_grad and (p.grad is None or not p.grad.abs().sum() > 0)
    ]
    opt.step()
    state = model.state_dict()
    return {
        "frozen_qk": sorted(frozen),
        "frozen_without_grad": (
            sorted(frozen) == expected
            and not trainable_qk
            and all(not b.requires_grad and b.grad is None for b in frozen.values())
        ),
        "qk_unchanged_by_step": all(torch.equal(before[n], state[n]) for n in expected),
        "trainable_with_grad": not no_grad,
        "params_without_grad": no_grad,
        "trainable_qk_in_frozen_layers": trainable_qk,
    }


def shape_account(**shape: int) -> list[dict]:
    """Counts and FLOPs per token of the three groups at the default preset (RunConfig.preset)
    with ``shape`` overrides (n_layer, d_model, n_head, d_ff, vocab_size, block_size): the
    explorer's rows."""
    from oelm_core import flops_per_token

    rows = []
    for v in GROUP_LABELS:
        cfg = model_config(RunConfig.preset, v, **shape)
        c, f = analytic_parameters(cfg), flops_per_token(cfg)
        rows.append(
            {
                "variant": GROUP_LABELS[v],
                "trainable": c["trainable"],
                "frozen": c["frozen"],
                "total": c["total"],
                "trainable_reduction_pct": None,
                "gflops_per_token": f["total"] / 1e9,
                "freeze_saves_pct": 100 * f["frozen_saving"]["fraction"],
            }
        )
    base = rows[0]["trainable"]
    for r in rows:
        r["trainable_reduction_pct"] = 100 * (1 - r["trainable"] / base)
    return rows


def shape_explorer():
    """An ipywidgets explorer: sliders for the shape, a table of counts and FLOPs that follows.

    Returns the widget box (display it). Without a front end (headless papermill) it renders
    its first table as plain output and nothing waits for input. Without ipywidgets installed
    (a bare cluster image) it returns the table of the default shape as Markdown instead.
    """
    from IPython.display import Markdown, display

    try:
        import ipywidgets as w
    except ImportError:
        return Markdown(markdown_table(shape_account()) + "\n\n(install ipywidgets for the interactive explorer)")

    start = model_config(RunConfig.preset)  # the sliders start at the study's shape
    sliders = {
        "n_layer": w.IntSlider(start.n_layer, 1, 48, description="layers"),
        "d_model": w.IntSlider(start.d_model, 64, 2048, step=64, description="d_model"),
        "n_head": w.IntSlider(start.n_head, 1, 32, description="heads"),
        "d_ff": w.IntSlider(start.d_ff, 128, 8192, step=128, description="d_ff"),
        "vocab_size": w.IntSlider(start.vocab_size, 256, 100_000, step=1, description="vocab"),
        "block_size": w.IntSlider(start.block_size, 32, 4096, step=32, description="context"),
    }
    out = w.Output()

    def update(_=None):
        values = {k: s.value for k, s in sliders.items()}
        with out:
            out.clear_output(wait=True)
            try:
                display(Markdown(markdown_table(shape_account(**values))))
            except Exception as e:  # e.g. heads that do not divide d_model
                print(f"invalid shape: {e}")

    for s in sliders.values():
        s.observe(update, names="value")
    update()
    return w.VBox([w.HBox(list(sliders.values())[:3]), w.HBox(list(sliders.values())[3:]), out])
