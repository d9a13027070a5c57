"""Everything the study notebooks show: the theory checks, the model accounts, the run results.

The notebooks in ``notebooks/`` only call these functions (``from oelm_core import analysis as A``)
and assert on what they return, so every table, figure and verdict of the study is computed
here, tested here and reusable by the app. One module per concept:

    theory       01: isometry of the Q/K constructions, Johnson-Lindenstrauss distortion, logits
    accounts     02: parameter counts, FLOPs and memory per variant, gradient flow, shape explorer
    runs         a run folder read back (Run, load_runs) and its figures
    groups       the study's groups, the seeds of one setup, what differs in the variant alone
    stats        mean and spread, Welch's test, intervals of a gap, Cohen's d and Hedges' g
    gaps         the PPL gaps between groups with 95% intervals, the three verdicts of a claim
    timing       training seconds from the metrics, steps and seconds to a target loss
    tables       the results table and the tests between groups
    hypotheses   H1-H4 judged from the runs
    curves       training and validation curves, per run or as a group's mean and band
    samples      each group's best.pt and samples from it
    attention    attention maps, per-head entropy and distance, the notebook's figure
    report       results.md and results.json
    budget       whether a study's budget is a smoke budget, whose verdicts are no evidence
    protocol     a tuned study at both dropouts: own-best and equal-dropout views, re-run spread
    scaling      the gaps across model shapes: table and figure
    markdown     markdown tables; figures: lazy matplotlib, saving figures
    heatmaps     the app's attention figures (imports matplotlib: not imported here)

Importing the package loads neither matplotlib nor scipy; the functions that need them import
them when called.
"""

from pathlib import Path

from oelm_core.analysis.accounts import (
    analytic_parameters,
    flops_table,
    gradient_flow_check,
    parameter_table,
    shape_account,
    shape_explorer,
)
from oelm_core.analysis.attention import (
    attention_figure,
    attention_maps,
    attention_summary,
    summarise_attention,
    uniform_reference,
)
from oelm_core.analysis.budget import SMOKE_NOTE, smoke_budget
from oelm_core.analysis.curves import BANDS, curve_band, log_ticks, plot_curves, plot_study_curves
from oelm_core.analysis.figures import pyplot, save_figure
from oelm_core.analysis.gaps import (
    EQUIVALENCE_MARGIN,
    EQUIVALENT,
    FAILS,
    GAP_PAIRS,
    HOLDS,
    NOT_EQUIVALENT,
    NOT_JUDGED,
    UNDECIDED,
    equivalence,
    equivalence_columns,
    gap_table,
    group_figures,
    ppl_gap,
    within_verdict,
)
from oelm_core.analysis.groups import (
    TUNED_SETTINGS,
    Group,
    assumed_settings,
    evaluated_seeds,
    group_runs,
    seed_groups,
    settings_apart,
    variant_alone,
)
from oelm_core.analysis.hypotheses import hypotheses, hypotheses_judgeable, hypotheses_markdown, unjudged
from oelm_core.analysis.markdown import markdown_table
from oelm_core.analysis.protocol import protocol_report, rerun_spread, split_reruns
from oelm_core.analysis.report import samples_markdown, write_results
from oelm_core.analysis.runs import (
    FINISHED,
    WHICH,
    WHICH_WORDS,
    Run,
    check_figures,
    check_which,
    find_run_dirs,
    load_run,
    load_runs,
)
from oelm_core.analysis.samples import SAMPLE_TOP_K, checkpoint_note, load_models, sample_generations
from oelm_core.analysis.scaling import scaling_figure, scaling_table, write_scaling
from oelm_core.analysis.stats import bootstrap_interval, cohen_d, hedges_g, mean_std, significance, tost, welch_interval
from oelm_core.analysis.tables import RESULT_COLUMNS, results_table, significance_tests
from oelm_core.analysis.theory import (
    JL_MIN_POINTS,
    JL_MIN_SAMPLES,
    construction_table,
    isometry_table,
    jl_checks,
    jl_curve,
    jl_dimensions,
    jl_figure,
    logit_stats_table,
)
from oelm_core.analysis.timing import (
    alone_record,
    loss_target,
    seconds_at,
    time_to_target,
    time_to_target_table,
    training_seconds,
)
from oelm_core.groups import BASELINE, GROUP_LABELS, GROUPS

# The repository root: the notebooks take relative output folders from here, so that their
# defaults (under the git-ignored runs/) land in one place whether the kernel runs in notebooks/
# (JupyterLab) or in the root (papermill --cwd).
REPO = Path(__file__).resolve().parents[2]

__all__ = [
    "REPO",
    # theory
    "JL_MIN_POINTS",
    "JL_MIN_SAMPLES",
    "construction_table",
    "isometry_table",
    "jl_checks",
    "jl_curve",
    "jl_dimensions",
    "jl_figure",
    "logit_stats_table",
    # accounts
    "analytic_parameters",
    "flops_table",
    "gradient_flow_check",
    "parameter_table",
    "shape_account",
    "shape_explorer",
    # runs and groups
    "FINISHED",
    "WHICH",
    "Run",
    "check_which",
    "find_run_dirs",
    "load_run",
    "load_runs",
    "BASELINE",
    "GROUPS",
    "GROUP_LABELS",
    "TUNED_SETTINGS",
    "Group",
    "assumed_settings",
    "evaluated_seeds",
    "group_runs",
    "seed_groups",
    "settings_apart",
    "variant_alone",
    # stats, tables, hypotheses, report
    "bootstrap_interval",
    "cohen_d",
    "hedges_g",
    "mean_std",
    "significance",
    "welch_interval",
    "RESULT_COLUMNS",
    "results_table",
    "significance_tests",
    "FAILS",
    "GAP_PAIRS",
    "HOLDS",
    "NOT_JUDGED",
    "UNDECIDED",
    "gap_table",
    "group_figures",
    "ppl_gap",
    "within_verdict",
    "loss_target",
    "seconds_at",
    "time_to_target",
    "time_to_target_table",
    "training_seconds",
    "hypotheses",
    "hypotheses_judgeable",
    "hypotheses_markdown",
    "samples_markdown",
    "write_results",
    # figures, samples, attention
    "BANDS",
    "curve_band",
    "markdown_table",
    "plot_curves",
    "plot_study_curves",
    "pyplot",
    "save_figure",
    "SAMPLE_TOP_K",
    "checkpoint_note",
    "load_models",
    "sample_generations",
    "attention_figure",
    "attention_maps",
    "attention_summary",
    "summarise_attention",
    "uniform_reference",
    # the protocol: held-out figures, equivalence, smoke budgets, timed-alone records, scaling
    "WHICH_WORDS",
    "check_figures",
    "tost",
    "EQUIVALENCE_MARGIN",
    "EQUIVALENT",
    "NOT_EQUIVALENT",
    "equivalence",
    "equivalence_columns",
    "SMOKE_NOTE",
    "smoke_budget",
    "alone_record",
    "unjudged",
    "log_ticks",
    "protocol_report",
    "rerun_spread",
    "split_reruns",
    "scaling_figure",
    "scaling_table",
    "write_scaling",
]
