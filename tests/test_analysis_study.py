"""The tuned study's analysis on hand-made run folders and known numbers: gaps with 95% intervals
and the three verdicts, groups compared each at its own tuned settings, training seconds from the
metrics and the time to a target loss, the curves' mean and band, the ablations' gaps."""

import json
import math
import statistics

import numpy as np
import pytest
import yaml
from scipy import stats
from test_analysis import make_run

from oelm_core import analysis as A
from oelm_core.analysis.ablations import ablation_gaps, ablation_gaps_figure, write_ablation_gaps
from oelm_core.config import ConfigError

TUNED_LR = {
    "gpt_base": {"lr": 2e-3, "min_lr": 2e-4},
    "oelm_nofreeze": {"lr": 1e-3, "min_lr": 1e-4},
    "oelm_freeze": {"lr": 2e-3, "min_lr": 2e-4},
}
TUNED_DROPOUT = {"gpt_base": 0.1, "oelm_nofreeze": 0.1, "oelm_freeze": 0.0}


def tuned_study(root, ppl: dict, train: dict | None = None):
    """The three groups, one run per seed of ``ppl[variant]`` (final PPLs), each at its own
    learning rate and dropout (TUNED_LR, TUNED_DROPOUT) and ``train`` settings on top."""
    for variant, values in ppl.items():
        for seed, p in enumerate(values):
            make_run(
                root,
                variant,
                p,
                seed=seed,
                model={"dropout": TUNED_DROPOUT[variant]},
                train={**TUNED_LR[variant], **(train or {})},
            )
    return A.load_runs(root)


# --- gaps and verdicts ------------------------------------------------------------------------


def test_the_gap_and_both_intervals_are_of_the_loss_difference_mapped_through_exp():
    a, b = [2.30, 2.32, 2.31], [2.20, 2.21, 2.19]
    res = A.ppl_gap(a, b)
    assert res["gap"] == pytest.approx(math.exp(statistics.fmean(a) - statistics.fmean(b)) - 1)
    low, high = A.welch_interval(a, b)
    assert res["welch"] == pytest.approx((math.expm1(low), math.expm1(high)))
    low, high = A.bootstrap_interval(a, b, "difference")
    assert res["bootstrap"] == pytest.approx((math.expm1(low), math.expm1(high)))
    assert res["welch"][0] < res["bootstrap"][0] < res["gap"] < res["bootstrap"][1] < res["welch"][1]
    assert res["hedges_g"] == pytest.approx(A.hedges_g(a, b)) and res["cohen_d"] == pytest.approx(A.cohen_d(a, b))
    one = A.ppl_gap([2.3], b)  # one seed: a point estimate, no interval or effect size
    assert one["gap"] == pytest.approx(math.exp(2.3 - 2.2) - 1) and one["welch"] is one["hedges_g"] is None


def test_an_interval_spanning_the_threshold_is_not_decided():
    assert A.within_verdict(0.04, (0.02, 0.06), 0.05) == A.UNDECIDED
    assert A.within_verdict(0.03, (0.02, 0.04), 0.05) == A.HOLDS
    assert A.within_verdict(0.07, (0.06, 0.08), 0.05) == A.FAILS
    # at the threshold itself: "within" is <= unless strict (H2's "< 5%")
    assert A.within_verdict(0.04, (0.03, 0.05), 0.05) == A.HOLDS
    assert A.within_verdict(0.04, (0.03, 0.05), 0.05, strict=True) == A.UNDECIDED
    assert A.within_verdict(0.05, None, 0.05, strict=True) == A.FAILS  # one seed: the point decides


def test_h2_and_h4_follow_the_interval(tmp_path):
    """H4 at +8%: tight seeds decide it holds; the same mean gap with spread seeds is not decided."""
    tight = tuned_study(
        tmp_path / "tight",
        {"gpt_base": [10.0, 10.02, 9.98], "oelm_nofreeze": [10.0, 10.02, 9.98], "oelm_freeze": [10.8, 10.82, 10.78]},
    )
    hyps = {h["id"]: h for h in A.hypotheses(tight, compare_across=A.TUNED_SETTINGS)}
    assert hyps["H4"]["verdict"] == A.HOLDS and hyps["H4"]["holds"] is True
    assert hyps["H2"]["verdict"] == A.FAILS and hyps["H2"]["holds"] is False
    assert (
        "95% Welch [+7.53%, +8.47%]" in hyps["H4"]["evidence"]
        and "the interval lies within it" in hyps["H4"]["evidence"]
    )
    spread = tuned_study(
        tmp_path / "spread",
        {"gpt_base": [9.0, 10.0, 11.0], "oelm_nofreeze": [9.0, 10.0, 11.0], "oelm_freeze": [9.72, 10.8, 11.88]},
    )
    hyps = {h["id"]: h for h in A.hypotheses(spread, compare_across=A.TUNED_SETTINGS)}
    assert hyps["H4"]["value"] == pytest.approx(0.08) and hyps["H4"]["verdict"] == A.UNDECIDED
    assert hyps["H4"]["holds"] is None and "the interval spans it" in hyps["H4"]["evidence"]
    # 40 steps of 512 tokens: a smoke budget, which each verdict says
    assert A.hypotheses_markdown(hyps.values()).count("| not decided at this n (smoke budget: not evidence) |") == 2


# --- groups each at its own tuned settings ---------------------------------------------------


def test_tuned_groups_are_compared_only_when_asked_and_only_across_the_tuned_settings(tmp_path):
    runs = tuned_study(
        tmp_path / "tuned", {"gpt_base": [10.0, 10.1], "oelm_nofreeze": [10.2, 10.3], "oelm_freeze": [11.0, 11.1]}
    )
    base, nofreeze, freeze = A.group_runs(runs)
    assert not A.variant_alone(freeze, nofreeze)  # the strict default
    assert A.variant_alone(freeze, nofreeze, A.TUNED_SETTINGS)
    assert all(h["verdict"] == A.NOT_JUDGED for h in A.hypotheses(runs)[1:])
    assert not A.hypotheses_judgeable(runs) and A.hypotheses_judgeable(runs, A.TUNED_SETTINGS)
    assert all(h["verdict"] != A.NOT_JUDGED for h in A.hypotheses(runs, compare_across=A.TUNED_SETTINGS))
    assert A.gap_table(runs)["pairs"] == []
    pairs = A.gap_table(runs, "final", A.TUNED_SETTINGS)["pairs"]
    assert [(p["a"], p["b"]) for p in pairs] == [
        ("OELM-NoFreeze", "GPT-Base"),
        ("OELM-Freeze", "GPT-Base"),
        ("OELM-Freeze", "OELM-NoFreeze"),
    ]
    assert pairs[1]["gap_pct"] == pytest.approx(100 * (math.sqrt(11.0 * 11.1 / (10.0 * 10.1)) - 1))
    assert len(A.significance_tests(runs, compare_across=A.TUNED_SETTINGS)) == 3
    # every other setting must still match: OELM-Freeze trained longer is not compared, even tuned
    make_run(tmp_path / "steps", "gpt_base", 10.0, model={"dropout": 0.1}, train=TUNED_LR["gpt_base"])
    make_run(
        tmp_path / "steps",
        "oelm_freeze",
        11.0,
        model={"dropout": 0.0},
        train={**TUNED_LR["oelm_freeze"], "steps": 5000},
    )
    h4 = A.hypotheses(A.load_runs(tmp_path / "steps"), compare_across=A.TUNED_SETTINGS)[4]
    assert (
        h4["verdict"] == A.NOT_JUDGED
        and "apart from the variant and train.lr, train.min_lr, model.dropout" in h4["evidence"]
    )
    with pytest.raises(ConfigError, match="train.learning_rate"):
        A.variant_alone(freeze, base, ["train.learning_rate"])


def test_write_results_records_the_tuned_comparison(tmp_path):
    runs = tuned_study(
        tmp_path / "runs", {"gpt_base": [10.0, 10.1], "oelm_nofreeze": [10.2, 10.3], "oelm_freeze": [11.0, 11.1]}
    )
    result = A.write_results(runs, tmp_path / "out", "final", compare_across=A.TUNED_SETTINGS)
    assert result["compare_across"] == list(A.TUNED_SETTINGS) and len(result["gaps"]["pairs"]) == 3
    assert [g["val_ppl_std"] for g in result["gaps"]["groups"]] == pytest.approx(
        [statistics.stdev([10.0, 10.1]), statistics.stdev([10.2, 10.3]), statistics.stdev([11.0, 11.1])]
    )
    md = (tmp_path / "out" / "results.md").read_text()
    assert "each at its own train.lr, train.min_lr, model.dropout" in md
    assert "## Gaps with 95% intervals" in md and "Hedges' g (loss)" in md and "## Steps and training time" in md
    assert json.loads((tmp_path / "out" / "results.json").read_text())["time_to_target"][0]["reached"] == 2


# --- H1 against the non-embedding parameters -------------------------------------------------


def test_h1_states_the_share_of_all_and_of_the_non_embedding_parameters(tmp_path):
    runs = tuned_study(tmp_path, {"gpt_base": [10.0], "oelm_nofreeze": [10.2], "oelm_freeze": [10.5]})
    parts = {"embedding": 25_731_584, "position": 262_144, "attn_qk": 3_145_728, "rest": 15_757_312}
    for run in runs:  # the counts of summary.json at Medium-512
        frozen = run.variant == "oelm_freeze"
        run.summary["params"]["by_component"] = {
            k: {"trainable": 0 if frozen and k == "attn_qk" else n, "frozen": n if frozen and k == "attn_qk" else 0}
            for k, n in parts.items()
        }
    h1 = A.hypotheses(runs, compare_across=A.TUNED_SETTINGS)[0]
    assert h1["value"] == pytest.approx(3_145_728 / 44_896_768) and h1["verdict"] == A.FAILS
    assert h1["value_non_embedding"] == pytest.approx(3_145_728 / 18_903_040)
    assert "7.0% fewer" in h1["evidence"] and "18,903,040 non-embedding parameters" in h1["evidence"]
    assert "16.6%, which would be within the claim" in h1["evidence"]


# --- training seconds and the time to a target -----------------------------------------------


def timed_run(root, variant: str, windows: list[tuple[int, float]], evals: dict[int, float], seed: int = 0):
    """A run whose train rows are ``windows``: (step, tokens/s), 100 tokens per step, and whose
    evaluations ``evals``: {step: validation loss} (each on a train row's step)."""
    d = make_run(root, variant, 10.0, seed=seed)
    rows = []
    for step, rate in windows:
        row = {"step": step, "train_loss": 3.0, "tokens_per_s": rate, "tokens_seen": 100 * step, "epochs": step / 50}
        if step in evals:
            row.update(val_loss=evals[step], val_ppl=math.exp(evals[step]))
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = json.loads((d / "summary.json").read_text())
    summary.update(
        best_val_loss=min(evals.values()),
        final_val_loss=evals[max(evals)],
        tokens_per_s=statistics.median(rate for _, rate in windows),
    )
    (d / "summary.json").write_text(json.dumps(summary))
    return A.load_run(d)


def test_training_seconds_sum_the_log_windows_and_leave_evaluation_out(tmp_path):
    # windows of 1,000 tokens at 1,000 tokens/s (1 s), 2,000 at 500 (4 s), 1,000 at 2,000 (0.5 s)
    run = timed_run(tmp_path, "gpt_base", [(10, 1000.0), (30, 500.0), (40, 2000.0)], {30: 2.5, 40: 2.2})
    clock = A.training_seconds(run)
    assert [s for s, _ in clock] == [10, 30, 40] and [t for _, t in clock] == pytest.approx([1.0, 5.0, 5.5])
    assert A.seconds_at(A.training_seconds(run), 35) == pytest.approx(5.0)
    assert A.seconds_at(A.training_seconds(run), 5) is None
    assert A.time_to_target(run, 2.5) == (30, pytest.approx(5.0))
    assert A.time_to_target(run, 2.3) == (40, pytest.approx(5.5))
    assert A.time_to_target(run, 2.0) == (None, None)


# These runs' tokens/s are made equal across seeds (the case under test): scipy's t-test warns that
# identical values make its moments imprecise, which is what the test means to give it.
@pytest.mark.filterwarnings("ignore:Precision loss occurred in moment calculation:RuntimeWarning")
def test_time_to_target_is_the_highest_best_loss_which_every_run_reaches(tmp_path):
    windows = [(10, 1000.0), (20, 1000.0), (30, 1000.0)]
    timed_run(tmp_path, "oelm_nofreeze", windows, {10: 2.6, 20: 2.3, 30: 2.2}, seed=0)
    timed_run(tmp_path, "oelm_nofreeze", windows, {10: 2.6, 20: 2.4, 30: 2.25}, seed=1)
    slow = [(10, 500.0), (20, 500.0), (30, 500.0)]
    timed_run(tmp_path, "oelm_freeze", slow, {10: 2.7, 20: 2.5, 30: 2.3}, seed=0)
    timed_run(tmp_path, "oelm_freeze", slow, {10: 2.7, 20: 2.45, 30: 2.35}, seed=1)
    groups = A.group_runs(A.load_runs(tmp_path))
    target = A.loss_target(groups, "best")
    assert target == pytest.approx(2.35)
    nofreeze, freeze = A.time_to_target_table(groups, target)["rows"]
    # OELM-NoFreeze's seeds reach 2.35 at steps 20 and 30 (2 s and 3 s), OELM-Freeze's both at 30 (6 s)
    assert (nofreeze["reached"], nofreeze["steps"], nofreeze["seconds"]) == (2, pytest.approx(25), pytest.approx(2.5))
    assert (freeze["steps"], freeze["seconds"]) == (pytest.approx(30), pytest.approx(6.0))
    h3t = {h["id"]: h for h in A.hypotheses(A.load_runs(tmp_path), "best")}["H3t"]
    # geometric means, 6 s against sqrt(2 x 3) s; the 95% Welch interval of the log ratio, computed by scipy
    assert h3t["target_loss"] == pytest.approx(2.35) and h3t["value"] == pytest.approx(6.0 / math.sqrt(6.0))
    ci = stats.ttest_ind(np.log([6.0, 6.0]), np.log([2.0, 3.0]), equal_var=False).confidence_interval(0.95)
    assert h3t["interval"] == pytest.approx((math.exp(ci.low), math.exp(ci.high)))
    # 2.45 times the time, but one degree of freedom: the interval spans the 1/0.98 the claim allows
    assert h3t["verdict"] == A.UNDECIDED and "evaluation excluded" in h3t["evidence"]
    assert h3t["steps"] == pytest.approx([30, 25])


def test_h3_is_freeze_against_nofreeze_on_the_welch_interval_of_the_log_ratio(tmp_path):
    """The seeds state H3 against OELM-NoFreeze: tokens/s ratio >= 0.98 on the 95% Welch interval of
    the log ratio over seeds; GPT-Base's speed does not enter it."""

    def study(root, freeze_rates, nofreeze_rates, base_rate=5000.0):
        for variant, rates in (
            ("oelm_freeze", freeze_rates),
            ("oelm_nofreeze", nofreeze_rates),
            ("gpt_base", [base_rate] * len(freeze_rates)),
        ):
            for seed, rate in enumerate(rates):
                make_run(root, variant, 10.0, tok_s=rate, seed=seed)
        return {h["id"]: h for h in A.hypotheses(A.load_runs(root))}

    fast, slow = [1050.0, 1060.0, 1040.0], [1000.0, 1010.0, 990.0]
    held = study(tmp_path / "holds", fast, slow)["H3"]
    ci = stats.ttest_ind(np.log(fast), np.log(slow), equal_var=False).confidence_interval(0.95)
    assert held["value"] == pytest.approx(math.exp(np.log(fast).mean() - np.log(slow).mean()))
    assert held["interval"] == pytest.approx((math.exp(ci.low), math.exp(ci.high)))
    assert held["interval"][0] >= 0.98 and held["verdict"] == A.HOLDS and "OELM-NoFreeze" in held["claim"]
    assert "the interval lies above it" in held["evidence"]
    assert study(tmp_path / "fails", [900.0, 905.0, 895.0], slow)["H3"]["verdict"] == A.FAILS
    # 2% slower on average with seeds that spread: the interval spans 0.98
    spread = study(tmp_path / "spread", [900.0, 980.0, 1060.0], slow)["H3"]
    assert spread["interval"][0] < 0.98 < spread["interval"][1] and spread["verdict"] == A.UNDECIDED


# These runs' tokens/s are made equal across seeds (the case under test): scipy's t-test warns that
# identical values make its moments imprecise, which is what the test means to give it.
@pytest.mark.filterwarnings("ignore:Precision loss occurred in moment calculation:RuntimeWarning")
def test_speed_is_judged_only_where_every_run_records_it_had_its_device_alone(tmp_path):
    """timed_alone comes from summary.json's record: a run that shared its GPU (false) or has no
    record leaves H3 and H3t not judged, naming it; timed_alone=False forces that, True asserts
    nothing; the losses are judged as before."""
    windows = [(10, 1000.0), (20, 1000.0), (30, 1000.0)]
    for seed, (nofreeze, freeze) in enumerate([(2.20, 2.30), (2.25, 2.37)]):
        timed_run(tmp_path / "runs", "oelm_nofreeze", windows, {10: 2.6, 20: 2.4, 30: nofreeze}, seed=seed)
        timed_run(
            tmp_path / "runs",
            "oelm_freeze",
            [(s, 500.0) for s, _ in windows],
            {10: 2.7, 20: 2.5, 30: freeze},
            seed=seed,
        )
    runs = A.load_runs(tmp_path / "runs")
    alone = {h["id"]: h for h in A.hypotheses(runs, "best")}
    assert alone["H3"]["verdict"] == A.FAILS and alone["H3"]["value"] == pytest.approx(0.5)
    assert alone["H3t"]["value"] == pytest.approx(2.0)
    forced = {h["id"]: h for h in A.hypotheses(runs, "best", timed_alone=False)}
    assert forced["H3"]["verdict"] == forced["H3t"]["verdict"] == A.NOT_JUDGED
    assert "timed_alone=False was passed" in forced["H3"]["evidence"]
    assert [forced[k]["verdict"] for k in ("H1", "H2", "H4")] == [alone[k]["verdict"] for k in ("H1", "H2", "H4")]
    assert {h["id"]: h["verdict"] for h in A.hypotheses(runs, "best", timed_alone=True)} == {
        k: h["verdict"] for k, h in alone.items()
    }
    # one run records that it shared its GPU, another records nothing
    for name, record in (("oelm_freeze_s1", False), ("oelm_nofreeze_s0", None)):
        summary = json.loads((tmp_path / "runs" / name / "summary.json").read_text())
        summary["timed_alone"] = record
        (tmp_path / "runs" / name / "summary.json").write_text(json.dumps(summary))
    runs = A.load_runs(tmp_path / "runs")
    record = A.alone_record(runs)
    assert (record["alone"], record["not_alone"], record["unrecorded"]) == (
        False,
        ["oelm_freeze_s1"],
        ["oelm_nofreeze_s0"],
    )
    shared = {h["id"]: h for h in A.hypotheses(runs, "best", timed_alone=True)}
    for h in ("H3", "H3t"):
        assert shared[h]["verdict"] == A.NOT_JUDGED and shared[h]["holds"] is None
        assert "the run oelm_freeze_s1 shared its device while timed" in shared[h]["evidence"]
        assert "the run oelm_nofreeze_s0 does not record whether it had its device alone" in shared[h]["evidence"]
    assert A.unjudged(list(shared.values()), runs) == []  # two groups: nothing must be judged
    result = A.write_results(runs, tmp_path / "out", "best")
    md = (tmp_path / "out" / "results.md").read_text()
    assert result["timed_alone"] is False and result["time_to_target"] == []
    assert "## Steps and training time" not in md and "Speed is not compared (H3 and H3t are not judged)" in md
    assert (
        A.write_results(A.load_runs(tmp_path / "runs"), tmp_path / "out2", "best", timed_alone=None)["timed_alone"]
        is False
    )
    timed = A.plot_study_curves(runs).axes[3]
    assert len(
        timed.lines
    ) == 0 and "not drawn: 1 of 4 runs shared their device while timed; 1 of 4 runs do not record" in timed.texts[
        0
    ].get_text().replace("\n", " ")
    assert timed.get_title() == "validation loss vs wall-clock training time"


# --- curves ----------------------------------------------------------------------------------


def test_curve_band_is_the_mean_with_the_sample_std_or_the_range(tmp_path):
    windows = [(10, 1000.0), (20, 1000.0)]
    runs = [
        timed_run(tmp_path, "gpt_base", windows, {10: loss, 20: loss - 0.5}, seed=seed)
        for seed, loss in enumerate([3.0, 3.2, 3.7])
    ]
    band = A.curve_band(runs, "val_loss")
    sd = statistics.stdev([3.0, 3.2, 3.7])
    assert band["step"] == [10, 20] and band["n"] == 3
    assert band["mean"] == pytest.approx([3.3, 2.8])
    assert band["low"] == pytest.approx([3.3 - sd, 2.8 - sd]) and band["high"] == pytest.approx([3.3 + sd, 2.8 + sd])
    assert band["seconds"] == pytest.approx([1.0, 2.0]) and band["epochs"] == pytest.approx([0.2, 0.4])
    minmax = A.curve_band(runs, "val_loss", "minmax")
    assert minmax["low"] == pytest.approx([3.0, 2.5]) and minmax["high"] == pytest.approx([3.7, 3.2])
    one = A.curve_band(runs[:1], "val_loss")
    assert one["low"] == one["mean"] == one["high"] == pytest.approx([3.0, 2.5])
    with pytest.raises(ValueError, match="band"):
        A.curve_band(runs, "val_loss", "sem")


def test_study_curves_draw_one_mean_and_band_per_group(tmp_path):
    runs = tuned_study(tmp_path / "runs", {"gpt_base": [10.0, 10.1], "oelm_freeze": [11.0, 11.1]})
    fig = A.plot_study_curves(runs, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 1000
    train, val, zoom, timed = fig.axes[:4]
    for ax in (train, val, zoom, timed):
        assert [line.get_label() for line in ax.lines] == ["GPT-Base (n=2)", "OELM-Freeze (n=2)"]
        assert len(ax.collections) == 2  # the bands
    assert val.lines[0].get_ydata() == pytest.approx(
        [(math.log(10.0) + 1 + math.log(10.1) + 1) / 2, (math.log(10.0) + math.log(10.1)) / 2]
    )
    assert list(zoom.lines[0].get_xdata()) == [40]  # the last third of 40 steps: from 26.7
    assert timed.get_xlabel() == "wall-clock training seconds (evaluation excluded)"
    # epochs on top of the three panels against steps (make_run: 100 steps an epoch)
    assert [len(ax.child_axes) for ax in (train, val, zoom, timed)] == [1, 1, 1, 0]
    assert train.child_axes[0].get_xlabel() == "epochs"


# --- ablations against the study's runs ------------------------------------------------------


def test_ablation_gaps_read_the_ablations_and_the_studys_comparators(tmp_path):
    study = tmp_path / "study"
    tuned_study(study, {"gpt_base": [10.0, 10.2], "oelm_freeze": [11.0, 11.2]})
    root = tmp_path / "ablations"
    for label, variant, ppls, train in (
        ("progressive", "oelm_freeze", [10.4, 10.6], {"unfreeze_schedule": {20: "all"}}),
        ("oelm_freeze_shallow", "oelm_freeze_shallow", [10.8, 10.9], {}),
        ("steps_off", "oelm_freeze", [10.9, 11.0], {"steps": 50}),
    ):
        for seed, ppl in enumerate(ppls):
            d = root / label / f"seed{seed}"
            d.mkdir(parents=True)
            run = make_run(
                d, "oelm_freeze", ppl, seed=seed, model={"dropout": 0.0}, train={**TUNED_LR["oelm_freeze"], **train}
            )
            config = yaml.safe_load((run / "config.yaml").read_text())
            (run / "config.yaml").write_text(yaml.safe_dump({**config, "variant": variant}))
            summary = json.loads((run / "summary.json").read_text())
            (run / "summary.json").write_text(json.dumps({**summary, "variant": variant}))
            (run / "sweep_point.json").write_text(json.dumps({"label": label, "variant": variant, "seed": seed}))
    table = ablation_gaps(root, study, "final", A.TUNED_SETTINGS)
    rows = {r["label"]: r for r in table["rows"]}
    assert list(rows) == ["oelm_freeze_shallow", "progressive", "steps_off", "gpt_base", "oelm_freeze"]
    prog = rows["progressive"]
    assert (prog["source"], prog["seeds"]) == ("ablation", 2)
    assert prog["val_ppl_std"] == pytest.approx(statistics.stdev([10.4, 10.6]))
    expected = A.ppl_gap([math.log(10.4), math.log(10.6)], [math.log(11.0), math.log(11.2)])
    assert prog["oelm_freeze_gap_pct"] == pytest.approx(100 * expected["gap"])
    assert prog["oelm_freeze_welch_low_pct"] == pytest.approx(100 * expected["welch"][0])
    assert prog["oelm_freeze_boot_high_pct"] == pytest.approx(100 * expected["bootstrap"][1])
    assert prog["gpt_base_gap_pct"] == pytest.approx(100 * (math.sqrt(10.4 * 10.6 / (10.0 * 10.2)) - 1))
    # other steps than the comparators' are more than the ablation: no gap to either
    assert rows["steps_off"]["oelm_freeze_gap_pct"] is None and rows["steps_off"]["gpt_base_gap_pct"] is None
    # without the tuned comparison GPT-Base (dropout 0.1) is no comparator of the ablations
    assert ablation_gaps(root, study, "final")["rows"][0]["gpt_base_gap_pct"] is None
    paths = write_ablation_gaps(table, tmp_path / "out")
    assert [p.name for p in paths] == ["ablations.md", "ablations.json", "ablations.png"]
    assert "| progressive | ablation | 2 |" in paths[0].read_text()
    fig = ablation_gaps_figure(table)
    vs_freeze, vs_base = fig.axes
    bars = [[p.get_width() for p in ax.containers[0]] for ax in fig.axes]  # the barh, drawn first
    assert bars[0] == pytest.approx([rows[k]["oelm_freeze_gap_pct"] for k in ("oelm_freeze_shallow", "progressive")])
    assert len(bars[1]) == 3  # shallow, progressive, Freeze
    margin = [p for p in vs_freeze.patches if p.get_label().startswith("TOST margin")]
    assert len(margin) == 1 and margin[0].get_x() == pytest.approx(100 * (1 / 1.02 - 1))
    assert len(fig.legends[0].get_texts()) == 5
    with pytest.raises(ConfigError, match="groups of gpt_base"):
        ablation_gaps(root, study / "oelm_freeze_s0")
