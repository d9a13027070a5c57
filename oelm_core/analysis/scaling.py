"""The scaling curve: what orthogonal Q/K, frozen or not, cost against GPT-Base across model shapes.

One study folder per shape, each holding the three groups (several seeds each, trained on the
same tokens). Per shape, ``scaling_table`` gives the shape (d_model, n_layer), its non-embedding
parameters (all but the token and position embeddings: the count scaling laws use, and the part
of the model freezing touches), the training tokens per non-embedding parameter and the epochs
over the training text (a data-limited regime shows as many epochs), each group's perplexity, and
OELM-Freeze's and OELM-NoFreeze's PPL gaps to GPT-Base with their 95% Welch and bootstrap
intervals (``gaps.ppl_gap``). ``scaling_figure`` draws both gaps against the non-embedding
parameters on a log axis; ``write_scaling`` leaves scaling.md, scaling.json and scaling.png.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Sequence

from oelm_core.analysis.figures import pyplot, save_figure
from oelm_core.analysis.gaps import EQUIVALENCE_MARGIN, equivalence_columns, gap_fields, group_figures, ppl_gap
from oelm_core.analysis.groups import BASELINE, GROUP_LABELS, TUNED_SETTINGS, group_runs, variant_alone
from oelm_core.analysis.markdown import markdown_table
from oelm_core.analysis.protocol import DROPOUT, split_reruns
from oelm_core.analysis.report import jsonable
from oelm_core.analysis.runs import Run, check_figures, load_runs
from oelm_core.config import ConfigError

# The gaps the curve draws: (variant, to GPT-Base).
SCALING_GAPS = ("oelm_freeze", "oelm_nofreeze")


def scaling_table(
    studies: Iterable[str | Path],
    which: str = "report",
    compare_across: Sequence[str] = TUNED_SETTINGS,
    dropout: float | None = None,
    margin: float = EQUIVALENCE_MARGIN,
    own_best: bool = False,
) -> dict:
    """A row per study folder (one model shape each), sorted by non-embedding parameters:
    {study, preset, d_model, n_layer, n_head, non_embedding, tokens_seen, tokens_per_parameter,
    epochs, seeds ({variant: n}), seeds_text ("5", or "5/5/3" in GROUP_LABELS' order where the
    groups differ), dropouts and lrs (each group's, "0.1/0.1/0"), <variant>_ppl (mean over seeds
    of each group's ``which`` validation PPL), and for each variant v of SCALING_GAPS
    gap_fields(ppl_gap(v, GPT-Base), "v_")}: v_gap_pct, v_welch_low_pct, v_welch_high_pct,
    v_boot_low_pct, v_boot_high_pct, v_hedges_g, v_equivalent, v_tost_p. Returns {"rows",
    "markdown", "which", "view"} (view: the footing in words, None where every run was read).

    ``compare_across``: the settings the groups of one study may differ in (default TUNED_SETTINGS:
    each group at its own tuned learning rate and dropout); every other must match, else that gap
    is None. ``dropout``: read only the runs trained at that dropout (a study holding both).
    ``own_best``: each group at the dropout its shape's tuning chose, as the study's analysis
    recorded it (``tuning_choice`` in STUDY/results.json, which 04_analysis writes): a protocol
    study holds both dropouts. Re-runs of one configuration are left out
    (``protocol.split_reruns``). tokens_seen and epochs are GPT-Base's (means over its seeds).
    ConfigError for a study without exactly one group of each of the three variants, naming what
    it holds."""
    if own_best and dropout is not None:
        raise ConfigError("pass dropout= or own_best=True, not both: they are two views of a protocol study")
    rows = []
    for study in studies:
        study = Path(study)
        runs, _ = split_reruns(load_runs(study))
        if dropout is not None:
            runs = [r for r in runs if float(r.settings()[DROPOUT] or 0.0) == dropout]
        if own_best:
            choice = tuning_choice(study)
            runs = [r for r in runs if float(r.settings()[DROPOUT] or 0.0) == choice.get(r.variant)]
        check_figures(runs, which)
        groups = {v: [g for g in group_runs(runs) if g.variant == v] for v in GROUP_LABELS}
        wrong = {v: gs for v, gs in groups.items() if len(gs) != 1}
        if wrong:
            what = "; ".join(
                f"{len(gs)} of {GROUP_LABELS[v]}" + (f" ({', '.join(g.label for g in gs)})" if gs else "")
                for v, gs in wrong.items()
            )
            raise ConfigError(
                f"{study} holds {what}: a scaling study needs one group of each of the three variants "
                f"(for a study trained at two dropouts pass dropout= or own_best=True: report --dropout or --own-best)"
            )
        base = groups[BASELINE][0]
        settings = base.settings
        non_embedding = base.runs[0].value("non_embedding") or _analytic_non_embedding(base.runs[0])
        tokens, epochs = base.mean("tokens_seen"), base.mean("epochs")
        # a study's run folders sit in its runs/: name it by the study's folder
        row = {
            "study": (study.parent if study.name == "runs" else study).name,
            "preset": base.preset,
            "d_model": settings["model.d_model"],
            "n_layer": settings["model.n_layer"],
            "n_head": settings["model.n_head"],
            "non_embedding": non_embedding,
            "tokens_seen": tokens,
            "tokens_per_parameter": tokens / non_embedding if tokens and non_embedding else None,
            "epochs": epochs,
            "seeds": {v: len(gs[0].runs) for v, gs in groups.items()},
        }
        counts = list(row["seeds"].values())
        # one figure where the groups agree, else each group's (in GROUP_LABELS' order)
        row["seeds_text"] = str(counts[0]) if len(set(counts)) == 1 else "/".join(map(str, counts))
        # what each group trained at, in GROUP_LABELS' order: own-best views mix dropouts
        row["dropouts"] = "/".join(f"{float(gs[0].settings.get(DROPOUT) or 0.0):g}" for gs in groups.values())
        row["lrs"] = "/".join(f"{gs[0].settings['train.lr']:g}" for gs in groups.values())
        for v, gs in groups.items():
            row[f"{v}_ppl"] = group_figures(gs[0], which)["val_ppl"]
        for v in SCALING_GAPS:
            group = groups[v][0]
            res = (
                ppl_gap(
                    [r.value(f"{which}_val_loss") for r in group.runs],
                    [r.value(f"{which}_val_loss") for r in base.runs],
                    margin=margin,
                )
                if variant_alone(group, base, compare_across)
                else {}
            )
            row.update(gap_fields(res, f"{v}_"))
        rows.append(row)
    rows.sort(key=lambda r: r["non_embedding"])
    cols = [
        "study",
        "d_model",
        "n_layer",
        "non_embedding",
        "tokens_per_parameter",
        "epochs",
        "seeds_text",
        "dropouts",
        "lrs",
        *(f"{v}_ppl" for v in GROUP_LABELS),
    ]
    heads = [
        "Study",
        "d_model",
        "Layers",
        "Non-embedding params",
        "Tokens per non-emb. param",
        "Epochs",
        "Seeds",
        f"Dropout ({'/'.join(_short(v) for v in GROUP_LABELS)})",
        "Learning rate (same order)",
        *(f"{GROUP_LABELS[v]} PPL" for v in GROUP_LABELS),
    ]
    for v in SCALING_GAPS:
        same_cols, same_heads = equivalence_columns(f"{v}_", margin)
        cols += [f"{v}_gap_pct", f"{v}_welch_low_pct", f"{v}_welch_high_pct", same_cols[0]]
        heads += [f"{_short(v)} gap vs GPT-Base (%)", "Welch 95% low", "Welch 95% high", same_heads[0]]
    view = f"dropout {dropout:g}" if dropout is not None else "each at its own best dropout" if own_best else None
    return {"rows": rows, "markdown": markdown_table(rows, cols, heads), "which": which, "view": view}


def tuning_choice(study: Path) -> dict[str, float]:
    """{variant: dropout} of each group's own best setting at ``study``'s shape: the tuning_choice
    its analysis wrote into STUDY/results.json. ConfigError naming the file where there is none."""
    path = study / "results.json"
    choice = json.loads(path.read_text()).get("tuning_choice") if path.is_file() else None
    if not choice:
        raise ConfigError(
            f"{path} records no tuning_choice, which the own-best view reads: run the study's 04_analysis "
            f"with the tuning's choice first (python -m oelm_core run PLAN --set "
            f"'experiment.notebooks=[04_analysis]'), or pick a dropout for every group"
        )
    return {variant: float(dropout) for variant, dropout in choice.items()}


def scaling_figure(table: dict, path: str | Path | None = None):
    """``scaling_table``'s gaps against the non-embedding parameters (log axis): a point per shape
    for OELM-Freeze and OELM-NoFreeze each (slightly apart sideways so their bars do not cover each
    other), the 95% Welch interval as its error bar, a line at 0 (GPT-Base); each shape's tick
    gives its parameters and its d_model and layers."""
    plt = pyplot()
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = table["rows"]
    for i, v in enumerate(SCALING_GAPS):
        shown = [r for r in rows if r.get(f"{v}_gap_pct") is not None]
        shift = 1.04 ** (i - (len(SCALING_GAPS) - 1) / 2)
        xs = [r["non_embedding"] * shift for r in shown]
        ys = [r[f"{v}_gap_pct"] for r in shown]
        # one seed a side: no interval, no bar
        lows = [y if r[f"{v}_welch_low_pct"] is None else r[f"{v}_welch_low_pct"] for y, r in zip(ys, shown)]
        highs = [y if r[f"{v}_welch_high_pct"] is None else r[f"{v}_welch_high_pct"] for y, r in zip(ys, shown)]
        err = [[y - low for y, low in zip(ys, lows)], [high - y for y, high in zip(ys, highs)]]
        # the study curves' colours: GROUP_LABELS' order
        ax.errorbar(
            xs,
            ys,
            yerr=err,
            fmt="o-",
            color=f"C{list(GROUP_LABELS).index(v)}",
            capsize=4,
            lw=1.2,
            ms=5,
            label=f"{GROUP_LABELS[v]} (95% Welch interval)",
        )
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xscale("log")
    if rows:
        ax.xaxis.set_major_locator(FixedLocator([r["non_embedding"] for r in rows]))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(
            FixedFormatter([f"{_millions(r['non_embedding'])}\nd{r['d_model']} L{r['n_layer']}" for r in rows])
        )
        low, high = rows[0]["non_embedding"], rows[-1]["non_embedding"]
        ax.set_xlim(low / 1.3, high * 1.3)
    ax.set_xlabel("non-embedding parameters (log scale)")
    ax.set_ylabel(f"{table['which']} validation PPL gap vs {GROUP_LABELS[BASELINE]} (%)")
    view = f" ({table['view']})" if table.get("view") else ""
    ax.set_title(f"What orthogonal Q/K cost against GPT-Base, by model size{view}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return save_figure(fig, path)


def write_scaling(
    studies: Iterable[str | Path],
    out: str | Path,
    which: str = "report",
    compare_across: Sequence[str] = TUNED_SETTINGS,
    dropout: float | None = None,
    own_best: bool = False,
) -> list[Path]:
    """``scaling_table`` of ``studies`` into ``out``: scaling.md, scaling.json, scaling.png."""
    table = scaling_table(studies, which, compare_across, dropout, own_best=own_best)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    md, js, png = out / "scaling.md", out / "scaling.json", out / "scaling.png"
    shared = (
        f"at dropout {dropout:g}, "
        if dropout is not None
        else "each group at the dropout its shape's tuning chose, "
        if own_best
        else ""
    )
    across = f"each group at its own {', '.join(compare_across)}" if compare_across else "at shared settings"
    note = (
        f"One study per shape, {shared}{across}; {which} validation figures, means over seeds. Non-embedding "
        f"parameters: all but the token and position embeddings. Tokens per parameter and epochs: GPT-Base's "
        f"training tokens. PPL gap: exp(mean loss A - mean loss B) - 1 with its 95% Welch interval (of the "
        f"loss difference); the equivalence column is TOST at ±{100 * EQUIVALENCE_MARGIN:g}% of PPL."
    )
    md.write_text(f"## Scaling\n\n{note}\n\n{table['markdown']}\n")
    js.write_text(json.dumps(jsonable({k: v for k, v in table.items() if k != "markdown"}), indent=2) + "\n")
    scaling_figure(table, png)
    return [md, js, png]


def _analytic_non_embedding(run: Run) -> int:
    """The non-embedding parameters of ``run``'s model from its shape (a summary.json without
    params.by_component): accounts.analytic_parameters' total less the token and position
    embeddings."""
    from oelm_core.analysis.accounts import analytic_parameters
    from oelm_core.config import model_config

    model = {k.removeprefix("model."): v for k, v in run.settings().items() if k.startswith("model.")}
    cfg = model_config(run.preset, run.variant, **model)
    return analytic_parameters(cfg)["total"] - (cfg.vocab_size + cfg.block_size) * cfg.d_model


def _millions(x: float) -> str:
    return f"{x / 1e6:.3g}M" if x >= 1e6 else f"{x / 1e3:.3g}k"


def _short(variant: str) -> str:
    return GROUP_LABELS[variant].removeprefix("OELM-")
