"""Whether a study's budget is a smoke budget: one that shows the pipeline runs, whose verdicts are
no evidence about the models.

A study is taken for a smoke budget where any of its runs

- is of a preset made for tests (SMOKE_PRESETS: "smoke", a 2-layer d_model-64 model, and "tiny"),
- ran fewer than MIN_STEPS (1,000) optimizer steps, or
- saw fewer than MIN_TOKENS (1,000,000) training tokens.

Why these lines: ``make study``'s smoke study trains 150 steps of the smoke preset to perplexity
~310, and its results.md stated verdicts on them; the committed studies train 3,000 steps of
8,192 tokens (24.6M tokens). At step 1,000 the tuned Medium-512 study's runs were still 0.5 nats
above their step-3,000 loss (GPT-Base seed 0: 2.68 against 2.17), so below it the groups' order
says how fast each starts more than where it ends. The lines are generous on purpose: a real
study is far above both, a smoke one far below.
"""

from __future__ import annotations

from typing import Iterable

SMOKE_PRESETS = ("smoke", "tiny")
MIN_STEPS = 1_000
MIN_TOKENS = 1_000_000
# What every verdict of such a study carries (hypotheses' "note", results.md's Verdict cells).
SMOKE_NOTE = "smoke budget: not evidence"


def smoke_budget(runs: Iterable) -> str | None:
    """Why the runs (analysis Runs) are a smoke budget, in words naming the runs; None where none
    of them is (the module's three lines). A run whose steps or tokens are unknown (no summary.json,
    no metrics) is judged on what it has."""
    reasons = {"preset": [], "steps": [], "tokens": []}
    for run in runs:
        steps, tokens = run.value("steps"), run.value("tokens_seen")
        if run.preset in SMOKE_PRESETS:
            reasons["preset"].append(f"{run.name} ({run.preset})")
        if steps is not None and steps < MIN_STEPS:
            reasons["steps"].append(f"{run.name} ({steps:,})")
        if tokens is not None and tokens < MIN_TOKENS:
            reasons["tokens"].append(f"{run.name} ({tokens:,})")
    words = {
        "preset": f"a preset made for tests ({'/'.join(SMOKE_PRESETS)})",
        "steps": f"fewer than {MIN_STEPS:,} steps",
        "tokens": f"fewer than {MIN_TOKENS:,} training tokens",
    }
    found = [f"{words[k]}: {_names(v)}" for k, v in reasons.items() if v]
    return "; ".join(found) or None


def smoke_banner(reason: str) -> str:
    """The bold line at the top of a smoke study's results.md."""
    return (
        f"**A smoke budget ({reason}): these runs check that the pipeline works; none of the verdicts "
        f"below is evidence about the models.**"
    )


def _names(items: list[str], shown: int = 3) -> str:
    more = len(items) - shown
    return ", ".join(items[:shown]) + (f" and {more} more" if more > 0 else "")
