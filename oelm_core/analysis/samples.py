"""The trained models the 04 notebook shows (each group's best.pt), and samples from them."""

from __future__ import annotations

from typing import Any, Sequence

from oelm_core.analysis.groups import group_runs
from oelm_core.analysis.runs import Run, check_which
from oelm_core.generate import SamplingConfig

# Samples shown to people (the notebooks' and the app's) are drawn from the 50 likeliest tokens,
# not from the whole vocabulary (SamplingConfig's top_k=0): a small model trained briefly spreads
# probability over a long tail of unlikely tokens, and sampling all of them strews those through
# the text. Temperature and top-p are SamplingConfig's.
SAMPLE_TOP_K = 50


def load_models(runs: Sequence[Run], device: str = "cpu") -> dict[str, Any]:
    """Group label -> the model in best.pt, the checkpoint of the lowest validation loss, of the
    group's first seed that has one. It is best.pt whether the tables read the best or the final
    validation figures, so a caller showing both says which checkpoint its samples come from
    (``checkpoint_note``)."""
    from oelm_core.checkpoint import load_model

    models = {}
    for group in group_runs(runs):
        run = next((r for r in group.runs if r.checkpoint().is_file()), None)
        if run is not None:
            label = group.label if group.label not in models else f"{group.label} ({group.preset})"
            models[label] = load_model(run.checkpoint(), device)[0]
    return models


def checkpoint_note(which: str) -> str:
    """Which weights the attention maps and samples of ``load_models`` show, beside the ``which``
    validation figures the tables read."""
    check_which(which)
    return (
        "Attention maps and samples: each group's best.pt, the weights of its lowest validation loss "
        "(its first seed that has one). The table reads "
        + {
            "final": "the final evaluation, which may be a later step.",
            "best": "the best evaluation.",
            "report": "the same weights on the held-out half of the validation windows.",
        }[which]
    )


def sample_generations(
    models: dict,
    prompt: str,
    max_new_tokens: int = 40,
    seed: int = 0,
    temperature: float = SamplingConfig.temperature,
    top_k: int = SAMPLE_TOP_K,
) -> list[dict]:
    """One seeded continuation of ``prompt`` per model: [{model, prompt, text}]."""
    from oelm_core.generate import generate

    cfg = SamplingConfig(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, seed=seed)
    return [{"model": label, "prompt": prompt, "text": generate(model, prompt, cfg)} for label, model in models.items()]
