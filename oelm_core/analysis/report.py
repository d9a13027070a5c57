"""results.md and results.json: what a study's analysis leaves in its folder."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterable, Sequence

from oelm_core.analysis.budget import smoke_banner, smoke_budget
from oelm_core.analysis.gaps import EQUIVALENT, NOT_EQUIVALENT, UNDECIDED, gap_table
from oelm_core.analysis.groups import group_runs
from oelm_core.analysis.hypotheses import hypotheses, hypotheses_markdown
from oelm_core.analysis.markdown import markdown_table
from oelm_core.analysis.runs import WHICH_WORDS, Run
from oelm_core.analysis.samples import checkpoint_note
from oelm_core.analysis.tables import results_table, significance_tests
from oelm_core.analysis.timing import alone_record, loss_target, time_to_target_table

# The per-run figures results.json lists beside the tables (Run.value's keys).
RUN_FIGURES = (
    "final_val_loss",
    "final_val_ppl",
    "final_val_bpb",
    "best_val_loss",
    "best_val_ppl",
    "best_step",
    "report_val_loss",
    "report_val_ppl",
    "final_train_loss",
    "tokens_per_s",
    "timed_alone",
    "trainable",
    "frozen",
    "total",
    "checkpoint_mb",
    "wall_time_s",
    "epochs",
    "steps",
    "tokens_seen",
)


def write_results(
    runs: Sequence[Run],
    out_dir: str | Path,
    which: str = "final",
    extra_markdown: str = "",
    compare_across: Iterable[str] = (),
    timed_alone: bool | None = None,
) -> dict:
    """Write results.md and results.json to ``out_dir``: the results table, the gaps with their
    intervals, effect sizes and equivalence tests (gaps.gap_table), the hypotheses, the steps
    and training seconds to a target loss, the Welch tests and the per-run figures;
    ``extra_markdown`` (e.g. ``samples_markdown``) ends results.md. ``which``: runs.WHICH
    ("report": the held-out half; ConfigError for runs without it). ``compare_across``: the
    settings that may differ between the groups compared (groups.TUNED_SETTINGS for a study of
    tuned groups; recorded in both files). ``timed_alone``: False leaves H3, H3t and the time to
    the target out whatever the runs record; None or True: the runs' summary.json records decide
    (timing.alone_record). A smoke budget (budget.smoke_budget) puts a bold line at the top of
    results.md saying its verdicts are no evidence. Returns what results.json holds."""
    compare_across = tuple(compare_across)
    table = results_table(runs, which, compare_across=compare_across)
    gaps = gap_table(runs, which, compare_across)
    hyps = hypotheses(runs, which, compare_across=compare_across, timed_alone=timed_alone)
    groups = group_runs(runs)
    record = alone_record(runs)
    alone = record["alone"] is True and timed_alone is not False
    target = loss_target(groups, which)
    timing = time_to_target_table(groups, target) if target is not None and alone else None
    sig = significance_tests(runs, f"{which}_val_ppl", compare_across=compare_across)
    smoke = smoke_budget(runs)
    per_run = [
        {
            "name": r.name,
            "variant": r.variant,
            "preset": r.preset,
            "seed": r.seed,
            "run_dir": str(r.path),
            **{k: r.value(k) for k in RUN_FIGURES},
        }
        for r in runs
    ]
    result = {
        "which": which,
        "compare_across": list(compare_across),
        "timed_alone": False if timed_alone is False else record["alone"],
        "smoke_budget": smoke,
        "equivalence_margin": gaps["margin"],
        "table": table["rows"],
        "gaps": {"groups": gaps["groups"], "pairs": gaps["pairs"]},
        "hypotheses": hyps,
        "time_to_target": timing["rows"] if timing else [],
        "significance": sig,
        "runs": per_run,
    }
    compared = (
        f"Groups are compared each at its own {', '.join(compare_across)} (tuned per group); every "
        f"other setting is shared."
        if compare_across
        else "Groups are compared where they were trained with the same settings apart from the variant."
    )
    md = ["# Results\n"]
    if smoke:
        md += [smoke_banner(smoke), ""]
    md += [
        f"Validation figures: {WHICH_WORDS[which]}; groups averaged over seeds. {compared} "
        f"{_speed_note(record, timed_alone)}\n",
        table["markdown"],
        "\n## Gaps with 95% intervals\n",
        gaps_note(gaps["margin"]),
        "",
        gaps["markdown"],
        "\n## Hypotheses\n",
        hypotheses_markdown(hyps),
    ]
    if timing:
        curves = (
            "; for the held-out (report) figures the target is the highest best evaluation loss, since "
            "the curves it is looked up on are measured on the selection half"
            if which == "report"
            else ""
        )
        md += [
            "\n## Steps and training time to a target validation loss\n",
            f"Target: validation loss {target:.4f}, the highest {'best' if which == 'report' else which} "
            f"validation loss of any run, so that every run reaches it{curves}. Per run, the first "
            f"evaluation at or below it; training "
            f"seconds summed over the log windows (tokens / tokens_per_s), evaluation excluded. Means and "
            f"sample std (n-1) over the seeds; every run records that it had its device alone.\n",
            timing["markdown"],
        ]
    if sig:
        md += [
            "\n## Significance (Welch t-test, Cohen's d)\n",
            markdown_table(sig, ["a", "b", "preset", "metric", "n_a", "n_b", "mean_a", "mean_b", "t", "p", "cohen_d"]),
        ]
    if extra_markdown:
        md += ["", extra_markdown]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)  # only now: a refused ``which`` leaves no empty folder
    (out / "results.md").write_text("\n".join(md) + "\n")
    (out / "results.json").write_text(json.dumps(jsonable(result), indent=2))
    return result


def _speed_note(record: dict, timed_alone: bool | None) -> str:
    """What results.md says of the runs' speed figures."""
    if timed_alone is False:
        return (
            "The runs are taken to have shared their devices (timed_alone=False): their tokens/s, MFU and "
            "seconds are not compared here (H3 and H3t are not judged)."
        )
    if record["alone"] is True:
        return "Every run records that it had its device alone while timed."
    return f"Speed is not compared (H3 and H3t are not judged): {record['why']}."


# What results.md says of the gap table's figures (oelm_core.analysis.gaps explains the choice).
GAPS_NOTE = (
    "Per group: mean and sample std (n-1) over seeds. PPL gap of A to B: exp(mean loss A - mean "
    "loss B) - 1, the gap of the geometric-mean PPLs. Both 95% intervals are of the loss difference, "
    "mapped through exp(.) - 1: Welch's t interval, and the percentile bootstrap (9,999 resamples, "
    "each group resampled on its own; narrower than Welch's at this n). Hedges' g (small-sample "
    "corrected) and Cohen's d of the losses; positive: A's loss is the higher."
)


def gaps_note(margin: float) -> str:
    """GAPS_NOTE and what the equivalence column says, at ``margin`` (a fraction of PPL)."""
    return (
        f"{GAPS_NOTE} Equivalent within ±{100 * margin:g}%: two one-sided Welch tests (TOST, 5% each) of "
        f"the loss difference against ±log(1 + {margin:g}); \"{EQUIVALENT}\" only where both reject, "
        f"\"{NOT_EQUIVALENT}\" where the 90% interval lies wholly beyond the margin, otherwise \"{UNDECIDED}\" "
        f"(an interval that includes 0 is not evidence of no difference)."
    )


def samples_markdown(samples: Sequence[dict], which: str) -> str:
    """The Samples section of results.md (``write_results``' extra_markdown): the checkpoint note
    and the table of ``sample_generations``' rows; "" without samples."""
    if not samples:
        return ""
    return f"## Samples\n\n{checkpoint_note(which)}\n\n{markdown_table(samples)}"


def jsonable(x):
    """``x`` as strict JSON takes it: NaN and infinity (a group that does not vary) become null,
    paths strings, keys strings."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, Path):
        return str(x)
    return x
