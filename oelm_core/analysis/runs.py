"""Run folders, read back: the figures of one training run, whatever state it ended in.

A run folder follows the trainer's contract (``oelm_core.train``):

    config.yaml     the RunConfig
    metrics.jsonl   one JSON row per log step (step, train_loss, lr, grad_norm, tokens_per_s, mfu,
                    peak_mem_mb, tokens_seen, epochs); evaluation rows add val_loss, val_ppl, val_bpb
    summary.json    name, variant, preset, params {trainable, frozen, total}, final/best validation
                    loss/ppl/bpb, final train loss, tokens_per_s, wall time, epochs; from
                    train.report_holdout on, best_step and report_val_loss/ppl/bpb (the best
                    weights on the held-out half of the validation windows; the evaluations and
                    best_* read the other half); with the occupancy record, timed_alone
    best.pt         the best checkpoint (oelm_core.checkpoint.load_model): its size is the
                    "Checkpoint (MB)" of the results, in MB of 10^6 bytes

A run still training, or one killed, has metrics.jsonl but no summary.json yet: ``Run.value``
then derives the same figures from the metrics, so that a study can be read while it runs.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

from oelm_core.config import ConfigError, RunConfig
from oelm_core.groups import GROUP_LABELS
from oelm_core.parameter_files import read_yaml
from oelm_core.run_settings import trained_settings

# The validation figures a results table or hypothesis reads: the last evaluation's, the best's
# (both on the evaluations' windows, which chose the best), or "report": the best checkpoint on the
# held-out half of the validation windows that no evaluation chose by (train.report_holdout).
WHICH = ("final", "best", "report")
# summary.json's params.by_component entries that are embeddings (token, position): what a
# non-embedding parameter count leaves out.
EMBEDDINGS = ("embedding", "position")
# What each ``which`` is, in the words results.md uses.
WHICH_WORDS = {
    "final": "the last evaluation, on the windows the evaluations read",
    "best": "the best evaluation, on the windows that chose it",
    "report": "the best checkpoint on the held-out half of the validation windows, which no evaluation chose by",
}
# The trainer's statuses (summary.json) of a run that has ended: nothing is left to train.
FINISHED = ("completed", "stopped_early")


def check_which(which: str) -> None:
    """ConfigError unless ``which`` is one of WHICH: a misspelt one would read no figures at all."""
    if which not in WHICH:
        raise ConfigError(f"which={which!r} names no validation figures; pass one of {', '.join(map(repr, WHICH))}")


def check_figures(runs: Iterable[Run], which: str) -> None:
    """``check_which``, and for which="report" a ConfigError naming the runs whose summary.json has
    no held-out figures (report_val_loss): trained before train.report_holdout, with it off, or
    not finished (the trainer writes them with the summary)."""
    check_which(which)
    if which != "report":
        return
    missing = [r.name for r in runs if r.value("report_val_loss") is None]
    if missing:
        raise ConfigError(
            f"which='report' reads summary.json's report_val_loss, which {', '.join(missing)} "
            f"lack(s): trained before report_holdout (or with train.report_holdout false, or not "
            f"finished): use which=best, and say the figures were chosen on the data they report"
        )


@dataclass
class Run:
    """One training run folder, read back."""

    path: Path
    name: str
    variant: str
    preset: str
    seed: int | None
    config: dict
    summary: dict
    metrics: list[dict] = field(default_factory=list)

    def settings(self) -> dict:
        """What the run learned from: run_settings.trained_settings of its config.yaml (with the
        variant and preset read here), train.seed included, and grad_accum as the global batch
        in micro-batches, grad_accum x the processes (summary.json's world_size), since
        config.yaml does not say how many processes ran it."""
        try:
            settings = trained_settings({**self.config, "variant": self.variant, "preset": self.preset})
        except ConfigError as exc:
            raise ConfigError(
                f"{self.path}/config.yaml does not load ({exc}): without it the analysis "
                f"cannot tell which runs are seeds of one setup"
            ) from None
        world = int(self.summary.get("world_size") or 1)
        settings["train.batches_per_step"] = settings.pop("train.grad_accum") * world
        return settings

    @property
    def label(self) -> str:
        return GROUP_LABELS.get(self.variant, self.variant)

    def train_rows(self) -> list[dict]:
        return [r for r in self.metrics if r.get("train_loss") is not None]

    def eval_rows(self) -> list[dict]:
        return [r for r in self.metrics if r.get("val_loss") is not None]

    def checkpoint(self) -> Path:
        return self.path / "best.pt"

    def value(self, key: str) -> float | None:
        """A result figure: ``key`` of summary.json (oelm_core.train's keys), else the same figure
        derived from metrics.jsonl; None where neither has it. Besides summary.json's keys:
        checkpoint_mb (best.pt's size), trainable / frozen / total, and non_embedding (all
        parameters but EMBEDDINGS', from params.by_component)."""
        s = self.summary
        if key == "checkpoint_mb":
            # best.pt, the weights the app and load_models read; summary.json's checkpoint_bytes is
            # the newest training checkpoint, about three times larger with the AdamW moments.
            ckpt = self.checkpoint()
            return ckpt.stat().st_size / 1e6 if ckpt.is_file() else None
        if key in ("trainable", "frozen", "total"):
            return (s.get("params") or {}).get(key)
        if key == "non_embedding":
            # the convention of scaling-law parameter counts: token and position embeddings left out
            parts = (s.get("params") or {}).get("by_component")
            return (
                sum(c.get("trainable", 0) + c.get("frozen", 0) for name, c in parts.items() if name not in EMBEDDINGS)
                if parts
                else None
            )
        if s.get(key) is not None:
            return None if isinstance(s[key], float) and math.isnan(s[key]) else s[key]
        evals, trains = self.eval_rows(), self.train_rows()
        if key in ("final_val_loss", "final_val_ppl", "final_val_bpb"):
            return evals[-1].get(key.removeprefix("final_")) if evals else None
        if key in ("best_val_loss", "best_val_ppl", "best_val_bpb"):
            values = [r.get(key.removeprefix("best_")) for r in evals]
            return min(values) if values and None not in values else None
        if key == "final_train_loss":
            return trains[-1]["train_loss"] if trains else None
        if key == "tokens_per_s":
            # the figure summary.json holds: the median over the log windows, which the first
            # (compilation, warm-up) cannot move
            rates = [r["tokens_per_s"] for r in trains if r.get("tokens_per_s")]
            return statistics.median(rates) if rates else None
        if key == "epochs":
            return trains[-1].get("epochs") if trains else None
        if key == "steps":
            return self.metrics[-1].get("step") if self.metrics else None
        if key == "tokens_seen":
            return trains[-1].get("tokens_seen") if trains else None
        return None


def load_run(run_dir: str | Path) -> Run:
    """Read a run folder (summary.json, metrics.jsonl, config.yaml); errors say what is missing."""
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(
            f"run folder {path} does not exist; train it first "
            f"(python -m oelm_core.train --params ...) or pass an existing folder"
        )
    summary_file, metrics_file = path / "summary.json", path / "metrics.jsonl"
    if not (summary_file.is_file() or metrics_file.is_file()):
        raise FileNotFoundError(
            f"{path} holds neither summary.json nor metrics.jsonl: not a run "
            f"folder, or its training did not get far enough to write them"
        )
    config = read_yaml(path / "config.yaml") if (path / "config.yaml").is_file() else {}
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    metrics = []
    if metrics_file.is_file():
        for line in metrics_file.read_text().splitlines():
            line = line.strip()
            if line:
                try:
                    metrics.append(json.loads(line))
                except json.JSONDecodeError:  # a half-written last line of a killed run
                    continue
    seed = (config.get("train") or {}).get("seed")
    # A config.yaml without a variant or preset trained RunConfig's.
    return Run(
        path=path,
        name=summary.get("name") or config.get("name") or path.name,
        variant=summary.get("variant") or config.get("variant") or RunConfig.variant,
        preset=summary.get("preset") or config.get("preset") or RunConfig.preset,
        seed=seed,
        config=config,
        summary=summary,
        metrics=metrics,
    )


def find_run_dirs(root: str | Path) -> list[Path]:
    """Run folders under ``root`` (itself, or any folder below holding summary.json/metrics.jsonl)."""
    root = Path(root)
    if (root / "summary.json").is_file() or (root / "metrics.jsonl").is_file():
        return [root]
    found = {p.parent for pat in ("summary.json", "metrics.jsonl") for p in root.rglob(pat)}
    return sorted(found)


def load_runs(paths: str | Path | Iterable[str | Path]) -> list[Run]:
    """Runs from run folders, or from folders containing them (a study folder); a folder found
    twice (a study and one of its runs) is read once, not taken for a second seed."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    found: dict[Path, Path] = {}
    for p in paths:
        for d in find_run_dirs(p):
            found.setdefault(d.resolve(), d)
    dirs = list(found.values())
    if not dirs:
        raise FileNotFoundError(f"no run folders (summary.json / metrics.jsonl) under {list(paths)}")
    return [load_run(d) for d in dirs]
