"""results.md and results.json: what a study's analysis leaves in its folder."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from oelm_core.analysis.hypotheses import hypotheses, hypotheses_markdown
from oelm_core.analysis.markdown import markdown_table
from oelm_core.analysis.runs import Run
from oelm_core.analysis.samples import checkpoint_note
from oelm_core.analysis.tables import results_table, significance_tests

# The per-run figures results.json lists beside the tables (Run.value's keys).
RUN_FIGURES = ("final_val_loss", "final_val_ppl", "final_val_bpb", "best_val_loss", "best_val_ppl",
               "final_train_loss", "tokens_per_s", "trainable", "frozen", "total", "checkpoint_mb",
               "wall_time_s", "epochs", "steps")


def write_results(runs: Sequence[Run], out_dir: str | Path, which: str = "final",
                  extra_markdown: str = "") -> dict:
    """Write results.md and results.json (table, hypotheses, significance, per-run figures) to
    ``out_dir``; ``extra_markdown`` (e.g. ``samples_markdown``) ends results.md. Returns what
    results.json holds."""
    table = results_table(runs, which)
    hyps = hypotheses(runs, which)
    sig = significance_tests(runs, f"{which}_val_ppl")
    per_run = [{"name": r.name, "variant": r.variant, "preset": r.preset, "seed": r.seed,
                "run_dir": str(r.path), **{k: r.value(k) for k in RUN_FIGURES}}
               for r in runs]
    result = {"which": which, "table": table["rows"], "hypotheses": hyps, "significance": sig,
              "runs": per_run}
    md = ["# Results\n", f"Validation figures: {which} evaluation; groups averaged over seeds.\n",
          table["markdown"], "\n## Hypotheses\n", hypotheses_markdown(hyps)]
    if sig:
        md += ["\n## Significance (Welch t-test, Cohen's d)\n",
               markdown_table(sig, ["a", "b", "preset", "metric", "n_a", "n_b", "mean_a", "mean_b",
                                    "t", "p", "cohen_d"])]
    if extra_markdown:
        md += ["", extra_markdown]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)  # only now: a refused ``which`` leaves no empty folder
    (out / "results.md").write_text("\n".join(md) + "\n")
    (out / "results.json").write_text(json.dumps(_jsonable(result), indent=2))
    return result


def samples_markdown(samples: Sequence[dict], which: str) -> str:
    """The Samples section of results.md (``write_results``' extra_markdown): the checkpoint note
    and the table of ``sample_generations``' rows; "" without samples."""
    if not samples:
        return ""
    return f"## Samples\n\n{checkpoint_note(which)}\n\n{markdown_table(samples)}"


def _jsonable(x):
    """``x`` as strict JSON takes it: NaN and infinity (a group that does not vary) become null,
    paths strings, keys strings."""
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, Path):
        return str(x)
    return x
