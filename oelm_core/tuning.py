"""Each group at its own best setting: a tuning sweep read back, the choice, and the study written at it.

    python -m oelm_core tune runs/tune_medium512 [--markdown T.md] [--figure F.png]
    python -m oelm_core tune runs/tune_medium512 --study parameters/study_tuned_medium512.yaml --write S.yaml
    python -m oelm_core tune runs/T --min-seeds 2 --per-dropout --study TEMPLATE --write S.yaml   # equal footing

The table, the choice and its cautions are oelm_core.analysis.tuning's (``tuning_table``). ``--study
TEMPLATE --write OUT`` copies a plan file (its comment header too) with each run entry's
``train.lr``, ``train.min_lr`` and ``model.dropout`` set to its group's choice, read from the chosen
runs' config.yaml: the study then trains exactly the setting that won. ``--name NAME`` writes a study
of its own from a template of another model shape (the shapes' sweep, tune_shapes.yaml, from the
Medium-512 study): each entry also gets the model settings its chosen runs trained with where the
template's differ (d_model, heads, d_ff), and the plan is named NAME (its runs go to runs/NAME).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from datetime import date
from pathlib import Path
from typing import Optional

import yaml

from oelm_core.analysis.groups import GROUP_LABELS, TUNED_SETTINGS
from oelm_core.analysis.tuning import tuning_figure, tuning_table
from oelm_core.config import ConfigError
from oelm_core.files import write_text_atomic
from oelm_core.parameter_files import apply_overrides, read_yaml
from oelm_core.run_settings import trained_settings

NOTE = "# Learning rate and dropout per group:"
SHAPE_NOTE = "# Model shape: the tuning runs'"
ANALYSIS = "04_analysis"
_PER_DROPOUT_NAME = re.compile(r"_drop[0-9.]+$")


def tuned_study(
    template: str | Path,
    chosen: dict,
    source: str = "",
    out: str | Path | None = None,
    per_dropout: dict | None = None,
    name: str | None = None,
) -> str:
    """The text of ``template`` (a study file) with each run entry's tuned settings set to its
    group's choice (``tuning_table(...)["chosen"]``), to be written to ``out`` (default: in place
    of the template; the runs' parameter files are named relative to it). The template's leading
    comments are kept. ``per_dropout`` (``tuning_table(...)["per_dropout"]``): each entry becomes
    one per swept dropout instead, named ``<name>_drop<dropout>``, at its group's best learning
    rate there (a study on equal footing), and a plan that runs 04_analysis passes it each
    group's chosen dropout (``tuning_choice``: the own-best view of its report). A study this
    wrote may be its own template: it is written again the same, at the new choice. ``name``: the
    written plan's experiment.name, and each entry carries the model settings its chosen runs
    trained with where the template's differ (``shape_overrides``). ConfigError where a run's group
    has no choice, or (without ``name``) where the chosen runs trained another model shape than the
    template's: a study written at their rates but the template's shape would train a setting no
    sweep chose."""
    template = Path(template)
    out_dir = Path(out).resolve().parent if out is not None else template.resolve().parent
    raw = read_yaml(template)
    section = next((raw[s] for s in ("experiment", "study") if s in raw), None)
    if not isinstance(section, dict) or not isinstance(section.get("runs"), list):
        raise ConfigError(
            f"{template} is not a plan file with experiment.runs; pass one such as "
            f"parameters/study_tuned_medium512.yaml"
        )
    runs, seen, variants, shapes = [], set(), [], set()
    for entry in section["runs"]:
        entry = {"params": entry} if isinstance(entry, str) else dict(entry)
        params = Path(entry["params"])
        params = params if params.is_absolute() else template.parent / params
        variant = read_yaml(params).get("variant")
        variants.append(variant)
        if variant not in chosen:
            raise ConfigError(
                f"the tuning runs hold no finished setting of {variant} (for {entry['params']} in "
                f"{template}); tune it first, or leave it out of the study"
            )
        entry["params"] = os.path.relpath(params.resolve(), out_dir)
        kept = [s for s in entry.get("overrides") or [] if s.split("=", 1)[0].strip() not in TUNED_SETTINGS]
        shape = shape_overrides(params, [*(section.get("overrides") or []), *kept], chosen[variant])
        if shape and name is None:
            raise ConfigError(
                f"the tuning runs of {variant} trained {', '.join(shape)}, which {template} does not: pass --name "
                f"NAME to write a study of that shape (its runs go to runs/NAME), or a template of that shape"
            )
        kept = [s for s in kept if s.split("=", 1)[0].strip() not in {o.split("=", 1)[0] for o in shape}] + shape
        shapes.update(shape)
        if per_dropout is None:
            runs.append({**entry, "overrides": kept + [f"{k}={v}" for k, v in chosen[variant]["settings"].items()]})
            continue
        # a study this wrote before (rewritten in place) holds an entry per dropout already: one
        # entry per group again, whose name loses its _drop<d>
        base = _PER_DROPOUT_NAME.sub("", entry.get("name") or params.stem)
        if (params.resolve(), base) in seen:
            continue
        seen.add((params.resolve(), base))
        for (v, dropout), row in sorted(per_dropout.items(), key=lambda item: item[0][1]):
            if v == variant:
                runs.append(
                    {
                        **entry,
                        "name": f"{base}_drop{dropout:g}",
                        "overrides": kept + [f"{k}={x}" for k, x in row["settings"].items()],
                    }
                )
    section["runs"] = runs
    if name is not None:
        section["name"] = name
    shape_text = ", ".join(sorted(shapes))
    if shapes and section.get("description"):
        # the template's description names its own shape: a study of another one says its own
        groups = " vs ".join(dict.fromkeys(GROUP_LABELS.get(v, v) for v in variants))
        seeds = len(section.get("seeds") or [])
        section["description"] = (
            f"{groups} at the tuning runs' model shape ({shape_text}), each at its best learning rate "
            f"{'at every swept dropout' if per_dropout is not None else 'and dropout'}, {seeds} seeds"
        )
    if per_dropout is not None and ANALYSIS in (section.get("notebooks") or []):
        # the analysis reads each group at its own best dropout as this choice says, never
        # choosing again on the figures it reports
        parameters = section.setdefault("parameters", {}) or {}
        section["parameters"] = parameters
        parameters[ANALYSIS] = {
            **(parameters.get(ANALYSIS) or {}),
            "tuning_choice": {v: float(chosen[v]["dropout"]) for v in dict.fromkeys(variants)},
        }
    header = []
    for line in template.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith(NOTE):  # the note of an earlier rewrite
            header.append(line)
    if shapes and not any(line.startswith(SHAPE_NOTE) for line in header):
        # the template's comments describe the template's study, not this one
        header = [
            f"# The protocol's study {name or ''} at another model shape than its template's: the settings, seeds",
            f"# and analysis of {template.name}, each group at what the tuning runs chose for this shape.",
            f"#   python -m oelm_core run {os.path.relpath(out_dir / Path(out).name) if out else template}",
            f"{SHAPE_NOTE} ({shape_text}), not the template's ({template.name}).",
        ]
    note = f"{NOTE} written by python -m oelm_core tune {source} on {date.today().isoformat()}."
    return "\n".join(header + [note]) + "\n" + yaml.safe_dump(raw, sort_keys=False, width=110)


def shape_overrides(params: Path, overrides: list[str], row: dict) -> list[str]:
    """``model.KEY=VALUE`` for each model setting (bar the tuned dropout) that the runs of the
    chosen ``row`` (tuning_table's) trained with and the parameter file ``params`` with
    ``overrides`` would not: [] where the sweep trained the template's shape."""
    planned = trained_settings(apply_overrides(read_yaml(params), overrides))
    trained = trained_settings(read_yaml(Path(row["paths"][0]) / "config.yaml"))
    return [
        f"{key}={json.dumps(trained[key])}"
        for key in sorted(trained)
        if key.startswith("model.") and key not in TUNED_SETTINGS and trained[key] != planned.get(key)
    ]


def main(argv: Optional[list[str]] = None, prog: str = "python -m oelm_core tune") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    p.add_argument("roots", nargs="+", help="folders holding the tuning sweep's run folders, e.g. runs/tune_medium512")
    p.add_argument("--metric", default="best_val_loss", help="what is minimised (default: best_val_loss)")
    p.add_argument("--markdown", help="write the table here too")
    p.add_argument("--figure", help="write the figure here")
    p.add_argument("--study", help="a study file whose runs get their group's chosen setting (needs --write)")
    p.add_argument("--write", help="where the study file with the chosen settings goes")
    p.add_argument(
        "--per-dropout",
        action="store_true",
        help="--write each group at every swept dropout, at its best learning rate there",
    )
    p.add_argument(
        "--min-seeds", type=int, default=1, help="settings with fewer finished seeds are no candidates (default 1)"
    )
    p.add_argument(
        "--name",
        help="--write a plan of this name at the model shape the sweep trained (a template of another shape)",
    )
    args = p.parse_args(argv)
    if bool(args.study) != bool(args.write):
        p.error("--study and --write go together: the template study file and where its tuned copy goes")
    try:
        table = tuning_table(args.roots, args.metric, min_seeds=args.min_seeds)
        print(table["markdown"])
        for (variant, dropout), row in table["per_dropout"].items():
            print(
                f"best at dropout {dropout:g} for {row['group']}: lr {row['lr']} ({args.metric} "
                f"{row[args.metric]:.4f} over {row['finished']} seed(s))"
            )
        notes = []
        for variant, row in table["chosen"].items():
            print(
                f"chosen for {row['group']}: lr {row['lr']}, dropout {row['dropout']} "
                f"({args.metric} {row[args.metric]:.4f} over {row['finished']} seed(s))"
            )
            notes += [f"- {row['group']}: {c}" for c in table["cautions"][variant]]
        if notes:
            print("cautions:\n" + "\n".join(notes))
        if args.markdown:
            text = table["markdown"] + ("\n\nCautions about the choice:\n\n" + "\n".join(notes) if notes else "")
            write_text_atomic(args.markdown, text + "\n")
        if args.figure:
            tuning_figure(table, args.figure)
        if args.study:
            write_text_atomic(
                args.write,
                tuned_study(
                    args.study,
                    table["chosen"],
                    " ".join(args.roots),
                    args.write,
                    table["per_dropout"] if args.per_dropout else None,
                    args.name,
                ),
            )
            print(f"wrote {args.write}")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
