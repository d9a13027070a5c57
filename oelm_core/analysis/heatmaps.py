"""The app's attention figures: a heatmap with token labels, several models side by side on one
colour scale, and the per-head summary plot. They take plain arrays: the maps and per-head numbers
come from ``oelm_core.analysis.attention``.

Figures are ``matplotlib.figure.Figure`` objects built without pyplot: they never enter pyplot's
global figure list, so nothing accumulates between requests even when a request fails halfway.
(gr.Plot also calls ``plt.close`` on every figure it renders.) This module imports matplotlib
when it is imported, which is why the package's ``__init__`` does not import it.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from matplotlib.colors import PowerNorm
from matplotlib.figure import Figure

CMAP = "viridis"
MODEL_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b")


def token_label(text: str, width: int = 10) -> str:
    """A token's text as an axis label: newlines and leading spaces made visible, long ones cut."""
    text = text.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    if text.startswith(" "):
        text = "\u00b7" + text[1:]
    if not text:
        text = "\u2205"
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def _label_axes(ax, labels: Sequence[str]) -> None:
    t = len(labels)
    step = max(1, math.ceil(t / 48))
    ticks = list(range(0, t, step))
    size = max(4.5, min(9.0, 360 / max(t, 1)))
    ax.set_xticks(ticks)
    # parse_math=False: tokens are text; two "$" among them made matplotlib read mathtext and fail
    ax.set_xticklabels([labels[i] for i in ticks], rotation=90, fontsize=size, parse_math=False)
    ax.set_yticks(ticks)
    ax.set_yticklabels([labels[i] for i in ticks], fontsize=size, parse_math=False)
    ax.set_xlabel("key (attended-to token)")
    ax.set_ylabel("query token")


def heatmap_figure(matrix: np.ndarray, labels: Sequence[str], title: str) -> Figure:
    """One T x T attention map with the tokens on both axes (rows: queries, columns: keys)."""
    t = len(labels)
    side = float(np.clip(3.0 + 0.09 * t, 5.0, 9.0))
    fig = Figure(figsize=(side + 1.2, side), layout="constrained")
    ax = fig.add_subplot()
    im = ax.imshow(
        matrix, cmap=CMAP, norm=PowerNorm(0.5, vmin=0.0, vmax=max(float(matrix.max()), 1e-6)), interpolation="nearest"
    )
    _label_axes(ax, labels)
    ax.set_title(title, fontsize=11)
    fig.colorbar(im, ax=ax, shrink=0.8, label="attention probability (square-root scale)")
    return fig


def compare_figure(
    panels: Sequence[tuple[str, np.ndarray | None, str]], labels: Sequence[str], suptitle: str
) -> Figure:
    """Maps of several models side by side on one colour scale. ``panels``: (title, matrix or
    None, message shown instead of a matrix)."""
    n = len(panels)
    t = len(labels)
    side = float(np.clip(3.0 + 0.09 * t, 4.0, 8.0))
    fig = Figure(figsize=(side * n + 1.0, side + 0.8), layout="constrained")
    axes = fig.subplots(1, n, squeeze=False)[0]
    vmax = max([float(m.max()) for _, m, _ in panels if m is not None] + [1e-6])
    im = None
    for ax, (title, matrix, message) in zip(axes, panels):
        ax.set_title(title, fontsize=10)
        if matrix is None:
            ax.text(0.5, 0.5, message, ha="center", va="center", wrap=True, transform=ax.transAxes)
            ax.set_axis_off()
            continue
        im = ax.imshow(matrix, cmap=CMAP, norm=PowerNorm(0.5, vmin=0.0, vmax=vmax), interpolation="nearest")
        _label_axes(ax, labels)
    if im is not None:
        fig.colorbar(im, ax=list(axes), shrink=0.8, label="attention probability (square-root scale)")
    fig.suptitle(suptitle, fontsize=11)
    return fig


def summary_figure(rows: Sequence[dict], uniform: dict[str, float], model_labels: Sequence[str]) -> Figure:
    """Per-head entropy and mean distance against layer, one colour per model; hollow markers for
    heads whose Q/K are frozen. Dashed lines: uniform causal attention over the same tokens."""
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    n_models = max(1, len(model_labels))
    for ax, key, name, unit in (
        (axes[0], "entropy", "attention entropy", "nats"),
        (axes[1], "distance", "mean attention distance", "tokens"),
    ):
        for mi, label in enumerate(model_labels):
            colour = MODEL_COLOURS[mi % len(MODEL_COLOURS)]
            mine = [r for r in rows if r["model"] == label]
            if not mine:
                continue
            offset = (mi - (n_models - 1) / 2) * 0.18
            for frozen in (False, True):
                pts = [r for r in mine if (r["qk"] == "frozen") == frozen]
                if pts:
                    ax.scatter(
                        [r["layer"] + offset for r in pts],
                        [r[key] for r in pts],
                        s=28,
                        facecolors="none" if frozen else colour,
                        edgecolors=colour,
                        label=f"{label}{' (frozen Q/K)' if frozen else ''}",
                    )
            layers = sorted({r["layer"] for r in mine})
            means = [np.mean([r[key] for r in mine if r["layer"] == lay]) for lay in layers]
            ax.plot([lay + offset for lay in layers], means, color=colour, alpha=0.6, linewidth=1.2)
        ax.axhline(uniform[key], color="grey", linestyle="--", linewidth=1, label="uniform attention")
        ax.set_xlabel("layer")
        ax.set_ylabel(f"{name} ({unit})")
        ax.set_title(f"{name} per head")
        layers_all = sorted({r["layer"] for r in rows})
        if layers_all:
            ax.set_xticks(layers_all)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize=8)
    return fig
