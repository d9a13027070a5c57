"""results.md and results.json: what a study's analysis leaves in its folder."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Sequence

from oelm_core.analysis.gaps import gap_table
from oelm_core.analysis.groups import group_runs
from oelm_core.analysis.hypotheses import hypotheses, hypotheses_markdown
from oelm_core.analysis.markdown import markdown_table
from oelm_core.analysis.runs import Run
from oelm_core.analysis.samples import checkpoint_note
from oelm_core.analysis.tables import results_table, significance_tests
from oelm_core.analysis.timing import loss_target, time_to_target_table

# The per-run figures results.json lists beside the tables (Run.value's keys).
RUN_FIGURES = ("final_val_loss", "final_val_ppl", "final_val_bpb", "best_val_loss", "best_val_ppl",
               "final_train_loss", "tokens_per_s", "trainable", "frozen", "total", "checkpoint_mb",
               "wall_time_s", "epochs", "steps")


def write_results(runs: Sequence[Run], out_dir: str | Path, which: str = "final",
                  extra_markdown: str = "", compare_across: Iterable[str] = (), timed_alone: bool = True) -> dict:
    """Write results.md and results.json to ``out_dir``: the results table, the gaps with their
    intervals and effect sizes (gaps.gap_table), the hypotheses, the steps and training seconds
    to a target loss, the Welch tests and the per-run figures; ``extra_markdown`` (e.g.
    ``samples_markdown``) ends results.md. ``compare_across``: the settings that may differ
    between the groups compared (groups.TUNED_SETTINGS for a study of tuned groups; recorded
    in both files). ``timed_alone``: whether every run trained alone on its GPU; False (runs that
    shared GPUs) leaves H3 not judged and the time to the target out (hypotheses). Returns what
    results.json holds."""
    compare_across = tuple(compare_across)
    table = results_table(runs, which, compare_across=compare_across)
    gaps = gap_table(runs, which, compare_across)
    hyps = hypotheses(runs, which, compare_across=compare_across, timed_alone=timed_alone)
    groups = group_runs(runs)
    target = loss_target(groups, which)
    timing = time_to_target_table(groups, target) if target is not None and timed_alone else None
    sig = significance_tests(runs, f"{which}_val_ppl", compare_across=compare_across)
    per_run = [{"name": r.name, "variant": r.variant, "preset": r.preset, "seed": r.seed,
                "run_dir": str(r.path), **{k: r.value(k) for k in RUN_FIGURES}}
               for r in runs]
    result = {"which": which, "compare_across": list(compare_across), "timed_alone": timed_alone,
              "table": table["rows"],
              "gaps": {"groups": gaps["groups"], "pairs": gaps["pairs"]}, "hypotheses": hyps,
              "time_to_target": timing["rows"] if timing else [], "significance": sig, "runs": per_run}
    compared = (f"Groups are compared each at its own {', '.join(compare_across)} (tuned per group); every "
                f"other setting is shared." if compare_across else
                "Groups are compared where they were trained with the same settings apart from the variant.")
    shared = ("" if timed_alone else " The runs shared their GPUs, several at a time: their tokens/s, MFU and "
              "seconds are shares of a GPU, not compared here (H3 is not judged).")
    md = ["# Results\n", f"Validation figures: {which} evaluation; groups averaged over seeds. {compared}{shared}\n",
          table["markdown"], "\n## Gaps with 95% intervals\n", GAPS_NOTE, "", gaps["markdown"],
          "\n## Hypotheses\n", hypotheses_markdown(hyps)]
    if timing:
        md += ["\n## Steps and training time to a target validation loss\n",
               f"Target: validation loss {target:.4f}, the highest {which} validation loss of any run, so "
               f"that every run reaches it. Per run, the first evaluation at or below it; training seconds "
               f"summed over the log windows (tokens / tokens_per_s), evaluation excluded. Means and "
               f"sample std (n-1) over the seeds; every run trained alone on one GPU of one kind.\n",
               timing["markdown"]]
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


# What results.md says of the gap table's figures (oelm_core.analysis.gaps explains the choice).
GAPS_NOTE = ("Per group: mean and sample std (n-1) over seeds. PPL gap of A to B: exp(mean loss A - mean "
             "loss B) - 1, the gap of the geometric-mean PPLs. Both 95% intervals are of the loss difference, "
             "mapped through exp(.) - 1: Welch's t interval, and the percentile bootstrap (9,999 resamples, "
             "each group resampled on its own; narrower than Welch's at this n). Hedges' g (small-sample "
             "corrected) and Cohen's d of the losses; positive: A's loss is the higher.")


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
