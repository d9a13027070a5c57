"""The study's protocol on hand-made run folders and known numbers: figures on the held-out half
(which="report"), equivalence tests in the gap tables, the smoke-budget note, each group at its own
best setting and all at equal dropout with the re-run spread, the scaling table and figure, and
the curves' labels."""

import json
import math
import shutil
import statistics

import numpy as np
import pytest
from scipy import stats
from test_analysis import make_run

from oelm_core import analysis as A
from oelm_core.config import ConfigError

LR = {"gpt_base": 2e-3, "oelm_nofreeze": 1e-3, "oelm_freeze": 4e-3}


def full_budget(run_dir, steps: int = 3000, tokens: int = 24_576_000):
    """Give a make_run folder a real study's budget in summary.json (make_run's is 40 steps)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, "steps": steps, "tokens_seen": tokens}))
    return run_dir


def losses(runs, key):
    return [r.value(key) for r in runs]


# --- which="report": the held-out half -------------------------------------------------------


def held_out_study(root, report: dict, best_shift: float = -0.05, **kwargs):
    """The three groups, a run per seed of ``report[variant]`` (held-out PPLs); the best PPL on
    the selection half is exp(``best_shift``) times it, the final PPL 1.02 times that."""
    for variant, values in report.items():
        for seed, p in enumerate(values):
            best = p * math.exp(best_shift)
            full_budget(make_run(root, variant, best * 1.02, best=best, seed=seed, report=p, **kwargs))
    return A.load_runs(root)


def test_report_figures_are_the_held_out_half_everywhere_which_is_accepted(tmp_path):
    report = {"gpt_base": [10.0, 10.1, 9.9], "oelm_nofreeze": [10.2, 10.3, 10.1], "oelm_freeze": [11.0, 11.2, 10.9]}
    runs = held_out_study(tmp_path / "runs", report)
    assert "report" in A.WHICH
    rows = {r["variant"]: r for r in A.results_table(runs, "report")["rows"]}
    assert rows["oelm_freeze"]["val_ppl"] == pytest.approx(statistics.fmean(report["oelm_freeze"]))
    assert rows["oelm_freeze"]["val_bpb"] == pytest.approx(
        statistics.fmean(math.log(p) / 3 for p in report["oelm_freeze"])
    )
    pairs = {(p["a"], p["b"]): p for p in A.gap_table(runs, "report")["pairs"]}
    freeze, base = np.log(report["oelm_freeze"]), np.log(report["gpt_base"])
    gap = pairs[("OELM-Freeze", "GPT-Base")]
    assert gap["gap_pct"] == pytest.approx(100 * math.expm1(freeze.mean() - base.mean()))
    ci = stats.ttest_ind(freeze, base, equal_var=False).confidence_interval(0.95)
    assert (gap["welch_low_pct"], gap["welch_high_pct"]) == (
        pytest.approx(100 * math.expm1(ci.low)),
        pytest.approx(100 * math.expm1(ci.high)),
    )
    hyps = {h["id"]: h for h in A.hypotheses(runs, "report")}
    assert hyps["H4"]["value"] == pytest.approx(math.expm1(freeze.mean() - base.mean()))
    assert hyps["H4"]["evidence"].startswith("held-out validation PPL")
    # the time to a target reads the curves, which are the selection half's: the target is the
    # highest best loss, not a held-out figure, and the evidence says so
    best = max(r.value("best_val_loss") for r in runs if r.variant in ("oelm_freeze", "oelm_nofreeze"))
    assert hyps["H3t"]["target_loss"] == pytest.approx(best) and "selection half" in hyps["H3t"]["evidence"]
    assert A.checkpoint_note("report").endswith("the same weights on the held-out half of the validation windows.")
    result = A.write_results(runs, tmp_path / "out", "report")
    md = (tmp_path / "out" / "results.md").read_text()
    assert "Validation figures: the best checkpoint on the held-out half of the validation windows" in md
    assert "since the curves it is looked up on are measured on the selection half" in md
    assert result["runs"][0]["report_val_loss"] == pytest.approx(math.log(report["gpt_base"][0]))


def test_report_figures_of_runs_trained_before_the_holdout_are_refused_by_name(tmp_path):
    make_run(tmp_path / "runs", "gpt_base", 10.0, report=10.1)
    make_run(tmp_path / "runs", "oelm_freeze", 10.5)  # trained before report_holdout
    runs = A.load_runs(tmp_path / "runs")
    message = (
        r"which='report' reads summary.json's report_val_loss, which oelm_freeze_s42 lack\(s\): trained "
        r"before report_holdout .* use which=best, and say the figures were chosen on the data they report"
    )
    for call in (A.results_table, A.gap_table, A.hypotheses, lambda r, w: A.write_results(r, tmp_path / "out", w)):
        with pytest.raises(ConfigError, match=message):
            call(runs, "report")
    assert not (tmp_path / "out").exists()
    assert A.results_table(runs, "best")["rows"]  # best still reads them


# --- equivalence in the gap tables ------------------------------------------------------------


def test_gap_tables_say_no_difference_only_where_tost_shows_equivalence(tmp_path):
    """Within ±2% of PPL on TOST: "no difference"; the 90% interval wholly beyond: "differs by more
    than the margin"; otherwise "not decided at this n", also where the gap's interval holds 0."""
    base = [2.170, 2.181, 2.162, 2.175, 2.168]
    cases = {
        "near": [2.176, 2.183, 2.171, 2.181, 2.177],
        "far": [2.310, 2.335, 2.322, 2.351, 2.327],
        "spread": [2.12, 2.25, 2.15, 2.23, 2.19],
    }
    verdicts = {}
    for name, nofreeze in cases.items():
        for seed, (b, n) in enumerate(zip(base, nofreeze)):
            make_run(tmp_path / name, "gpt_base", math.exp(b), seed=seed)
            make_run(tmp_path / name, "oelm_nofreeze", math.exp(n), seed=seed)
        table = A.gap_table(A.load_runs(tmp_path / name), "final")
        (row,) = table["pairs"]
        ref = A.tost(nofreeze, base, math.log(1.02))
        assert row["tost_p"] == pytest.approx(ref["p"])
        verdicts[name] = row["equivalent"]
        assert "| Equivalent within ±2%? (TOST) | TOST p |" in table["markdown"]
        if name == "spread":
            assert row["welch_low_pct"] < 0 < row["welch_high_pct"]  # an interval holding 0 is not "no difference"
    assert verdicts == {"near": A.EQUIVALENT, "far": A.NOT_EQUIVALENT, "spread": A.UNDECIDED}
    # the margin is a parameter, and the header says which
    wide = A.gap_table(A.load_runs(tmp_path / "spread"), "final", margin=0.10)
    assert wide["pairs"][0]["equivalent"] == A.EQUIVALENT and "Equivalent within ±10%? (TOST)" in wide["markdown"]


def test_the_ablation_rows_carry_the_equivalence_test(tmp_path):
    """gaps.gap_fields is what the ablations' table writes per comparator: an ablation as good as
    OELM-Freeze within ±2% is "no difference" only where TOST shows it."""
    from oelm_core.analysis.ablations import ablation_gaps

    study, root = tmp_path / "study", tmp_path / "ablations"
    freeze = [2.310, 2.321, 2.302, 2.315, 2.308]
    for seed, loss in enumerate(freeze):
        make_run(study, "gpt_base", math.exp(loss - 0.15), seed=seed)
        make_run(study, "oelm_freeze", math.exp(loss), seed=seed)
    gaussian = [2.316, 2.323, 2.311, 2.321, 2.317]
    for seed, loss in enumerate(gaussian):
        d = root / "oelm_freeze_gaussian" / f"seed{seed}"
        d.mkdir(parents=True)
        run = make_run(d, "oelm_freeze", math.exp(loss), seed=seed)
        for name in ("config.yaml", "summary.json"):
            text = (run / name).read_text().replace("oelm_freeze", "oelm_freeze_gaussian")
            (run / name).write_text(text)
        (run / "sweep_point.json").write_text(
            json.dumps({"label": "gaussian", "variant": "oelm_freeze_gaussian", "seed": seed})
        )
    row = next(r for r in ablation_gaps(root, study, "final")["rows"] if r["label"] == "gaussian")
    assert row["oelm_freeze_equivalent"] == A.EQUIVALENT
    assert "vs OELM-Freeze: Equivalent within ±2%? (TOST)" in ablation_gaps(root, study, "final")["markdown"]
    assert row["oelm_freeze_tost_p"] == pytest.approx(A.tost(gaussian, freeze, math.log(1.02))["p"])
    assert row["gpt_base_equivalent"] == A.NOT_EQUIVALENT


# --- smoke budgets ----------------------------------------------------------------------------


def test_a_smoke_budget_says_so_at_the_top_and_beside_every_verdict(tmp_path):
    ppl = {"gpt_base": [10.0, 10.1], "oelm_nofreeze": [10.2, 10.3], "oelm_freeze": [10.4, 10.5]}
    for variant, values in ppl.items():
        for seed, p in enumerate(values):
            make_run(tmp_path / "smoke", variant, p, seed=seed)  # 40 steps of 512 tokens
            full_budget(make_run(tmp_path / "real", variant, p, seed=seed))
            full_budget(make_run(tmp_path / "few_tokens", variant, p, seed=seed), tokens=800_000)
    smoke = A.load_runs(tmp_path / "smoke")
    assert A.smoke_budget(smoke).startswith("fewer than 1,000 steps: gpt_base_s0 (40), ")
    assert A.smoke_budget(A.load_runs(tmp_path / "real")) is None
    assert A.smoke_budget(A.load_runs(tmp_path / "few_tokens")).startswith("fewer than 1,000,000 training tokens")
    tiny = make_run(tmp_path / "tiny", "gpt_base", 10.0, preset="smoke")
    assert A.smoke_budget(A.load_runs(full_budget(tiny))).startswith("a preset made for tests (smoke/tiny)")
    result = A.write_results(smoke, tmp_path / "out")
    md = (tmp_path / "out" / "results.md").read_text()
    assert md.splitlines()[2].startswith("**A smoke budget (fewer than 1,000 steps") and md.splitlines()[2].endswith(
        "none of the verdicts below is evidence about the models.**"
    )
    judged = [h for h in result["hypotheses"] if h["verdict"] != A.NOT_JUDGED]
    assert judged and all(h["note"].startswith(A.SMOKE_NOTE) for h in result["hypotheses"])
    assert md.count(f" ({A.SMOKE_NOTE}) |") == len(result["hypotheses"])
    real = A.write_results(A.load_runs(tmp_path / "real"), tmp_path / "out_real")
    assert real["smoke_budget"] is None and all(h["note"] is None for h in real["hypotheses"])
    assert "smoke" not in (tmp_path / "out_real" / "results.md").read_text()


# --- each group at its own best setting, all groups at equal dropout --------------------------

# Held-out PPLs per (variant, dropout), three seeds; a group's learning rate is its own (LR), the
# dropout-0 GPT-Base at a lower one (what a tuning at each dropout might choose).
PROTOCOL = {
    ("gpt_base", 0.0): [9.60, 9.70, 9.65],
    ("gpt_base", 0.1): [9.30, 9.35, 9.25],
    ("oelm_nofreeze", 0.0): [9.70, 9.75, 9.68],
    ("oelm_nofreeze", 0.1): [9.40, 9.45, 9.38],
    ("oelm_freeze", 0.0): [10.05, 10.10, 10.00],
    ("oelm_freeze", 0.1): [10.50, 10.60, 10.45],
}
OWN = {"gpt_base": 0.1, "oelm_nofreeze": 0.1, "oelm_freeze": 0.0}


def protocol_study(root):
    for (variant, dropout), values in PROTOCOL.items():
        lr = LR[variant] / (2 if (variant, dropout) == ("gpt_base", 0.0) else 1)
        for seed, p in enumerate(values):
            full_budget(
                make_run(
                    root,
                    variant,
                    p * 1.05,
                    best=p * 1.01,
                    seed=seed,
                    report=p,
                    name=f"{variant}_d{dropout:g}",
                    model={"dropout": dropout},
                    train={"lr": lr, "min_lr": lr / 10},
                )
            )
    # seed 1 of Freeze at dropout 0 trained again: the same configuration, another result
    again = full_budget(
        make_run(
            root,
            "oelm_freeze",
            10.3 * 1.05,
            best=10.3 * 1.01,
            seed=1,
            report=10.3,
            name="oelm_freeze_d0_rerun",
            model={"dropout": 0.0},
            train={"lr": LR["oelm_freeze"], "min_lr": LR["oelm_freeze"] / 10},
        )
    )
    return A.load_runs(root), again


def expected_gap(a_key, b_key):
    a, b = np.log(PROTOCOL[a_key]), np.log(PROTOCOL[b_key])
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    return 100 * math.expm1(a.mean() - b.mean()), 100 * math.expm1(ci.low), 100 * math.expm1(ci.high)


def test_protocol_report_gives_own_best_and_each_equal_dropout_view(tmp_path):
    runs, _ = protocol_study(tmp_path / "study")
    result = A.protocol_report(runs, tmp_path / "out", OWN)
    assert list(result["views"]) == ["own best", "dropout=0", "dropout=0.1"]
    for view, dropouts in (
        ("own best", OWN),
        ("dropout=0", dict.fromkeys(OWN, 0.0)),
        ("dropout=0.1", dict.fromkeys(OWN, 0.1)),
    ):
        pairs = {(p["a"], p["b"]): p for p in result["views"][view]["gaps"]["pairs"]}
        assert len(pairs) == 3, view
        for a, b in (("oelm_freeze", "gpt_base"), ("oelm_nofreeze", "gpt_base"), ("oelm_freeze", "oelm_nofreeze")):
            row = pairs[(A.GROUP_LABELS[a], A.GROUP_LABELS[b])]
            gap, low, high = expected_gap((a, dropouts[a]), (b, dropouts[b]))
            assert (row["gap_pct"], row["welch_low_pct"], row["welch_high_pct"]) == (
                pytest.approx(gap),
                pytest.approx(low),
                pytest.approx(high),
            ), (view, a, b)
            la, lb = np.log(PROTOCOL[(a, dropouts[a])]), np.log(PROTOCOL[(b, dropouts[b])])
            assert row["hedges_g"] == pytest.approx(A.hedges_g(la, lb))
        hyps = {h["id"]: h for h in result["views"][view]["hypotheses"]}
        gap_h4 = expected_gap(("oelm_freeze", dropouts["oelm_freeze"]), ("gpt_base", dropouts["gpt_base"]))
        assert hyps["H4"]["value"] == pytest.approx(gap_h4[0] / 100)
        assert hyps["H2"]["verdict"] in (A.HOLDS, A.FAILS, A.UNDECIDED) and hyps["H4"]["verdict"] != A.NOT_JUDGED
    # the re-run is no fourth seed: each view's Freeze group has three
    own = {r["model"]: r for r in result["views"]["own best"]["table"]}
    assert own["OELM-Freeze"]["seeds"] == 3
    assert own["OELM-Freeze"]["val_ppl"] == pytest.approx(statistics.fmean(PROTOCOL[("oelm_freeze", 0.0)]))
    # H4 at Freeze's own best (dropout 0, +7.3% of GPT-Base at 0.1) and at dropout 0.1 (+13.0%)
    assert result["views"]["own best"]["hypotheses"][4]["verdict"] == A.HOLDS
    assert result["views"]["dropout=0.1"]["hypotheses"][4]["verdict"] == A.FAILS
    md = (tmp_path / "out" / "results.md").read_text()
    for title in (
        "## (a) Each group at its own best setting",
        "## (b) All groups at dropout 0",
        "## (c) All groups at dropout 0.1",
        "## Re-run spread",
    ):
        assert title in md
    assert "the tuning sweep's choice (GPT-Base 0.1, OELM-NoFreeze 0.1, OELM-Freeze 0)" in md
    assert json.loads((tmp_path / "out" / "results.json").read_text())["tuning_choice"] == OWN


def test_the_rerun_spread_sits_beside_the_seed_spread(tmp_path):
    runs, again = protocol_study(tmp_path / "study")
    kept, reruns = A.split_reruns(runs)
    assert len(kept) == 18 and [(a.name, b.name) for a, b in reruns] == [
        ("oelm_freeze_d0_s1", "oelm_freeze_d0_rerun_s1")
    ]
    spread = A.rerun_spread(runs, "report")
    (row,) = spread["rows"]
    assert row["difference"] == pytest.approx(math.log(10.3) - math.log(10.10))
    assert row["seed_sd"] == pytest.approx(statistics.stdev(np.log(PROTOCOL[("oelm_freeze", 0.0)])))
    assert spread["pooled_sd"] == pytest.approx(abs(math.log(10.3 / 10.10)) / math.sqrt(2))
    assert "Re-run sd from the 1 pair(s): 0.0139" in spread["markdown"]
    without = A.rerun_spread([r for r in runs if r.path != again], "report")
    assert without["rows"] == [] and without["pooled_sd"] is None and "not measured" in without["markdown"]
    # runs trained deterministically repeat their bits: the seeds' spread is the whole spread
    alone = [r for r in runs if r.path != again]
    for r in alone:
        r.config.setdefault("train", {})["deterministic"] = True
    assert "same bits" in A.rerun_spread(alone, "report")["markdown"]
    alone[0].config["train"]["deterministic"] = False
    assert "not measured" in A.rerun_spread(alone, "report")["markdown"]


def test_protocol_report_takes_tunings_choice_and_refuses_a_view_it_cannot_fill(tmp_path):
    runs, _ = protocol_study(tmp_path / "study")
    chosen = {v: {"group": A.GROUP_LABELS[v], "lr": LR[v], "dropout": d} for v, d in OWN.items()}  # tuning_table's rows
    assert A.protocol_report(runs, tmp_path / "a", chosen)["tuning_choice"] == OWN
    with pytest.raises(ConfigError, match="tuning_choice has no dropout for oelm_freeze"):
        A.protocol_report(runs, tmp_path / "b", {k: v for k, v in OWN.items() if k != "oelm_freeze"})
    no_freeze_at_01 = [r for r in runs if not (r.variant == "oelm_freeze" and r.settings()["model.dropout"] == 0.1)]
    with pytest.raises(
        ConfigError,
        match=r"the view 'dropout=0.1' needs one group of each of the three variants, "
        r"and finds OELM-Freeze: none",
    ):
        A.protocol_report(no_freeze_at_01, tmp_path / "c", OWN)


def test_a_study_at_one_dropout_says_its_equal_dropout_view_is_its_own_best(tmp_path):
    """Every group's own best at dropout 0.1 and only that dropout trained (the committed protocol
    study so far): the dropout=0.1 view holds the own-best runs, and results.md says so instead
    of printing the same tables twice."""
    runs, _ = protocol_study(tmp_path / "study")
    at_01 = [r for r in runs if r.settings()["model.dropout"] == 0.1]
    result = A.protocol_report(at_01, tmp_path / "out", dict.fromkeys(OWN, 0.1))
    assert list(result["views"]) == ["own best", "dropout=0.1"]
    assert result["views"]["own best"]["runs"] == result["views"]["dropout=0.1"]["runs"]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "best learning rate at each dropout here (0.1)" in md
    assert "## (b) All groups at dropout 0.1\n\nThe same runs as (a): every group's own best dropout" in md
    assert md.count("| Hypothesis |") == 1


# --- the scaling curve ------------------------------------------------------------------------

SHAPES = [(128, 2, 2), (256, 4, 4), (384, 6, 6), (512, 8, 8)]  # d_model, n_layer, n_head (64-dimensional heads)
TOKENS = 20_000_000


def scaling_studies(root, gaps: dict, by_component: bool = True):
    """A study folder per shape of SHAPES: three seeds per group, held-out PPLs at GPT-Base 10 -+ 0.1
    and the other groups ``gaps[variant][i]`` (relative) above it at shape i; summary.json with
    params.by_component (embedding d x 50,304 rows, position 256 x d, the rest 12 d^2 per layer)."""
    studies = []
    for i, (d, n_layer, n_head) in enumerate(SHAPES):
        study = root / f"d{d}"
        for variant in A.GROUP_LABELS:
            for seed, noise in enumerate((-0.1, 0.0, 0.1)):
                ppl = (10.0 + noise) * (1 + gaps.get(variant, [0.0] * len(SHAPES))[i])
                run = make_run(
                    study,
                    variant,
                    ppl,
                    seed=seed,
                    preset="mini",
                    report=ppl,
                    model={"d_model": d, "n_layer": n_layer, "n_head": n_head, "d_ff": 4 * d},
                )
                summary = json.loads((run / "summary.json").read_text())
                parts = {"embedding": 50_304 * d, "position": 256 * d, "blocks": 12 * d * d * n_layer}
                summary.update(
                    steps=3000,
                    tokens_seen=TOKENS,
                    epochs=TOKENS / 3_700_000,
                    params={
                        **summary["params"],
                        **(
                            {"by_component": {k: {"trainable": v, "frozen": 0} for k, v in parts.items()}}
                            if by_component
                            else {}
                        ),
                    },
                )
                (run / "summary.json").write_text(json.dumps(summary))
        studies.append(study)
    return studies


def test_scaling_table_has_a_row_per_shape_with_the_gaps_and_their_intervals(tmp_path):
    gaps = {"oelm_freeze": [0.02, 0.05, 0.08, 0.12], "oelm_nofreeze": [0.0, 0.01, -0.01, 0.005]}
    studies = scaling_studies(tmp_path, gaps)
    table = A.scaling_table(reversed(studies))  # sorted by size whatever the order given
    rows = table["rows"]
    assert [(r["d_model"], r["n_layer"]) for r in rows] == [(d, n) for d, n, _ in SHAPES]
    for row, (d, n_layer, _), i in zip(rows, SHAPES, range(4)):
        assert row["non_embedding"] == 12 * d * d * n_layer
        assert row["tokens_per_parameter"] == pytest.approx(TOKENS / (12 * d * d * n_layer))
        assert row["epochs"] == pytest.approx(TOKENS / 3_700_000)
        assert row["gpt_base_ppl"] == pytest.approx(10.0)
        base = np.log([9.9, 10.0, 10.1])
        for variant in ("oelm_freeze", "oelm_nofreeze"):
            other = np.log(np.array([9.9, 10.0, 10.1]) * (1 + gaps[variant][i]))
            ci = stats.ttest_ind(other, base, equal_var=False).confidence_interval(0.95)
            assert row[f"{variant}_gap_pct"] == pytest.approx(100 * gaps[variant][i], abs=1e-9)
            assert (row[f"{variant}_welch_low_pct"], row[f"{variant}_welch_high_pct"]) == (
                pytest.approx(100 * math.expm1(ci.low)),
                pytest.approx(100 * math.expm1(ci.high)),
            )
    assert "| d128 | 128 | 2 | 393,216 |" in table["markdown"]
    paths = A.write_scaling(studies, tmp_path / "out")
    assert [p.name for p in paths] == ["scaling.md", "scaling.json", "scaling.png"]
    assert json.loads(paths[1].read_text())["rows"][3]["oelm_freeze_gap_pct"] == pytest.approx(12.0)


def test_scaling_figure_draws_both_gaps_against_non_embedding_parameters(tmp_path):
    gaps = {"oelm_freeze": [0.02, 0.05, 0.08, 0.12], "oelm_nofreeze": [0.0, 0.01, -0.01, 0.005]}
    table = A.scaling_table(scaling_studies(tmp_path, gaps))
    fig = A.scaling_figure(table)
    (ax,) = fig.axes
    fig.canvas.draw()
    assert ax.get_xscale() == "log" and ax.get_xlabel() == "non-embedding parameters (log scale)"
    assert ax.get_ylabel() == "report validation PPL gap vs GPT-Base (%)"
    assert [t.get_text() for t in ax.get_xticklabels()] == [
        "393k\nd128 L2",
        "3.15M\nd256 L4",
        "10.6M\nd384 L6",
        "25.2M\nd512 L8",
    ]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "OELM-Freeze (95% Welch interval)",
        "OELM-NoFreeze (95% Welch interval)",
    ]
    freeze, nofreeze = ax.containers  # errorbar's: (line, caps, bars)
    xs = freeze.lines[0].get_xdata()
    assert list(freeze.lines[0].get_ydata()) == pytest.approx([r["oelm_freeze_gap_pct"] for r in table["rows"]])
    assert all(
        x / r["non_embedding"] == pytest.approx(xs[0] / table["rows"][0]["non_embedding"])
        for x, r in zip(xs, table["rows"])
    )  # one sideways shift, not a different x
    bars = freeze.lines[2][0].get_segments()  # the Welch interval of each point
    assert [tuple(s[:, 1]) for s in bars] == [
        pytest.approx((r["oelm_freeze_welch_low_pct"], r["oelm_freeze_welch_high_pct"])) for r in table["rows"]
    ]
    assert len(nofreeze.lines[0].get_xdata()) == 4
    assert freeze.lines[0].get_color() == "C2" and nofreeze.lines[0].get_color() == "C1"  # the curves' colours


def test_the_tables_name_a_shape_that_is_not_its_presets(tmp_path):
    """A shape study's runs keep a preset's parameter files and set the width: its tables say so
    (the preset alone would name another model)."""
    studies = scaling_studies(tmp_path, {})
    narrow, mini = (A.load_runs(s) for s in studies[:2])  # d128 L2; d256 L4 is mini's own shape
    assert {r["shape"] for r in A.results_table(narrow, "report")["rows"]} == {
        "mini at n_layer 2, d_model 128, n_head 2, d_ff 512"
    }
    assert (
        "| GPT-Base | mini at n_layer 2, d_model 128, n_head 2, d_ff 512 | 3 |"
        in A.gap_table(narrow, "report")["markdown"]
    )
    assert {r["shape"] for r in A.results_table(mini, "report")["rows"]} == {"mini"}


def test_scaling_counts_the_shape_without_params_by_component_and_refuses_a_study_short_of_a_group(tmp_path):
    import torch

    from oelm_core import build_model, count_parameters

    studies = scaling_studies(tmp_path, {}, by_component=False)
    rows = A.scaling_table(studies[:1])["rows"]
    model = build_model("mini", "gpt_base", d_model=128, n_layer=2, n_head=2, d_ff=512)
    counts = count_parameters(model)["by_component"]
    expected = sum(c["trainable"] + c["frozen"] for k, c in counts.items() if k not in ("embedding", "position"))
    assert rows[0]["non_embedding"] == expected and torch.is_tensor(next(model.parameters()))
    assert (
        rows[0]["seeds_text"] == "3"
        and "| 3 | 0/0/0 | 0.0003/0.0003/0.0003 | 10 |" in A.scaling_table(studies[:1])["markdown"]
    )
    shutil.rmtree(studies[0] / "oelm_freeze_s2")  # a group short of a seed: each group's count
    assert A.scaling_table(studies[:1])["rows"][0]["seeds_text"] == "3/3/2"
    for run in (studies[1]).glob("oelm_nofreeze_s*"):
        for f in run.iterdir():
            f.unlink()
        run.rmdir()
    with pytest.raises(ConfigError, match=r"d256 holds 0 of OELM-NoFreeze: a scaling study needs one group of each"):
        A.scaling_table(studies)


def test_the_scaling_curve_of_studies_at_both_dropouts_has_each_footing(tmp_path, capsys):
    """A protocol study per shape holds every group at dropout 0 and 0.1: --dropout reads one
    dropout for all, --own-best each group at the dropout its shape's analysis recorded
    (results.json's tuning_choice); the command writes the figure files of the view it is given."""
    from oelm_core.__main__ import main

    base = {"gpt_base": 10.0, "oelm_nofreeze": 10.2, "oelm_freeze": 11.0}
    lift = {0.0: 1.05, 0.1: 1.0}  # dropout 0.1 helps every group here
    choice = {128: {"gpt_base": 0.1, "oelm_nofreeze": 0.1, "oelm_freeze": 0.0}, 256: dict.fromkeys(base, 0.1)}
    studies = []
    for d_model, own in choice.items():
        study = tmp_path / f"d{d_model}"
        for variant, p in base.items():
            for dropout in (0.0, 0.1):
                for seed, f in enumerate((0.99, 1.0, 1.01)):
                    value = p * lift[dropout] * f * (1.2 if variant == "oelm_freeze" and dropout == 0.1 else 1.0)
                    make_run(
                        study / "runs",
                        variant,
                        value,
                        seed=seed,
                        name=f"{variant}_drop{dropout:g}",
                        preset="mini",
                        report=value,
                        model={"d_model": d_model, "n_layer": 2, "n_head": d_model // 64, "dropout": dropout},
                    )
        (study / "results.json").write_text(json.dumps({"tuning_choice": own}))
        studies.append(study)
    zero = A.scaling_table(studies, dropout=0.0)
    assert zero["view"] == "dropout 0" and [r["oelm_freeze_gap_pct"] for r in zero["rows"]] == pytest.approx([10.0] * 2)
    own = A.scaling_table(studies, own_best=True)["rows"]
    # d128: Freeze at its own dropout 0 (11 x 1.05) against GPT-Base at 0.1; d256: Freeze at 0.1 (11 x 1.2)
    assert [r["oelm_freeze_gap_pct"] for r in own] == pytest.approx(
        [100 * (11 * 1.05 / 10 - 1), 100 * (11 * 1.2 / 10 - 1)]
    )
    assert [r["oelm_nofreeze_gap_pct"] for r in own] == pytest.approx([2.0, 2.0])
    assert [r["dropouts"] for r in own] == ["0.1/0.1/0", "0.1/0.1/0.1"] and zero["rows"][0]["dropouts"] == "0/0/0"
    assert "| Dropout (GPT-Base/NoFreeze/Freeze) | Learning rate (same order) |" in zero["markdown"]
    with pytest.raises(ConfigError, match="holds 2 of GPT-Base"):
        A.scaling_table(studies)
    (studies[1] / "results.json").unlink()
    with pytest.raises(ConfigError, match=r"d256/results.json records no tuning_choice"):
        A.scaling_table(studies, own_best=True)
    (studies[1] / "results.json").write_text(json.dumps({"tuning_choice": choice[256]}))
    out = tmp_path / "scaling"
    assert main(["report", *map(str, studies), "--scaling", "--own-best", "--out", str(out)]) == 0
    table = json.loads((out / "scaling.json").read_text())
    assert table["view"] == "each at its own best dropout" and table["which"] == "report"
    assert [r["oelm_freeze_gap_pct"] for r in table["rows"]] == pytest.approx([r["oelm_freeze_gap_pct"] for r in own])
    assert (out / "scaling.png").stat().st_size > 1000
    assert main(["report", *map(str, studies), "--scaling", "--dropout", "0.1"]) == 2
    assert "--scaling writes scaling.md, .json and .png into --out DIR" in capsys.readouterr().err
    assert main(["report", *map(str, studies)]) == 2
    assert "several folders, --dropout and --own-best go with --scaling only" in capsys.readouterr().err


# --- figures: readable axes, dropout noted, wall-clock named ----------------------------------


def test_the_training_panel_has_readable_log_ticks_and_notes_unequal_dropout(tmp_path):
    for variant, dropout in (("gpt_base", 0.1), ("oelm_nofreeze", 0.1), ("oelm_freeze", 0.0)):
        for seed in (0, 1):
            d = make_run(
                tmp_path / "runs", variant, 10.0, seed=seed, model={"dropout": dropout}, train={"lr": LR[variant]}
            )
            summary = json.loads((d / "summary.json").read_text())
            summary["val_windows"] = {"selection": 100, "report": 100}
            (d / "summary.json").write_text(json.dumps(summary))
    runs = A.load_runs(tmp_path / "runs")
    fig = A.plot_study_curves(runs)
    fig.canvas.draw()
    assert fig._suptitle is None
    assert A.plot_study_curves(runs, title="All groups at dropout 0")._suptitle.get_text() == "All groups at dropout 0"
    train, val, zoom, wall = fig.axes[:4]
    low, high = train.get_ylim()
    labels = [
        (t.get_position()[1], t.get_text()) for t in train.get_yticklabels() if low <= t.get_position()[1] <= high
    ]
    # make_run's training loss runs from 5.0 down to 2.0: ticks 2, 2.5, 3, 4, 5 (matplotlib's own: none)
    assert [text for _, text in labels] == ["2", "2.5", "3", "4", "5"]
    assert all(float(text) == pytest.approx(y) for y, text in labels)
    assert A.log_ticks(2.0, 5.0) == [2.0, 2.5, 3.0, 4.0, 5.0]
    assert A.log_ticks(1.8, 11.0) == [2.0, 3.0, 5.0, 7.0, 10.0]  # a whole run's: from ~11 at step 1
    note = " ".join(t.get_text().replace("\n", " ") for t in train.texts)
    assert "groups differ in dropout (GPT-Base 0.1, OELM-NoFreeze 0.1, OELM-Freeze 0)" in note
    assert "training loss is measured with dropout on" in note
    assert val.get_title() == "validation loss (selection half)"
    assert wall.get_title() == "validation loss (selection half) vs wall-clock training time"
    assert [line.get_label() for line in wall.lines] == ["GPT-Base (n=2)", "OELM-NoFreeze (n=2)", "OELM-Freeze (n=2)"]
    # one dropout: no note
    same = [r for r in runs if r.variant != "oelm_freeze"]
    assert len(A.plot_study_curves(same).axes[0].texts) == 0


def test_an_empty_wall_clock_panel_says_why(tmp_path):
    for variant in ("gpt_base", "oelm_freeze"):
        make_run(tmp_path / "old", variant, 10.0, timed_alone=None)  # before the record
    wall = A.plot_study_curves(A.load_runs(tmp_path / "old")).axes[3]
    text = wall.texts[0].get_text().replace("\n", " ")
    assert len(wall.lines) == 0 and text.startswith(
        "not drawn: 2 of 2 runs do not record whether they had their device alone"
    )
    forced = A.plot_study_curves(A.load_runs(tmp_path / "old"), timed_alone=False).axes[3]
    assert "timed_alone=False" in forced.texts[0].get_text().replace("\n", " ")


def test_the_results_table_leaves_out_tokens_per_s_of_runs_that_shared_their_device(tmp_path):
    """The protocol's study trained ten runs on one GPU at once: their 83k-98k tokens/s were shares
    of a device (an H200 trains one alone at about 1.1M) and stood in the table as if measured."""
    make_run(tmp_path / "shared", "gpt_base", 10.0, tok_s=83_000.0, timed_alone=False)
    make_run(tmp_path / "shared", "oelm_freeze", 11.0, tok_s=97_000.0, timed_alone=False)
    make_run(tmp_path / "alone", "gpt_base", 10.0, tok_s=1_100_000.0)
    make_run(tmp_path / "alone", "oelm_freeze", 11.0, tok_s=1_150_000.0)
    shared = A.results_table(A.load_runs(tmp_path / "shared"))
    alone = A.results_table(A.load_runs(tmp_path / "alone"))
    assert [r["tokens_per_s"] for r in shared["rows"]] == [None, None]
    assert [r["tokens_per_s"] for r in alone["rows"]] == [1_100_000.0, 1_150_000.0]


def test_ablations_meet_a_study_at_both_dropouts_at_their_own(tmp_path):
    """The protocol's study holds every group at dropout 0 and 0.1 (each at its own learning rate):
    an ablation trained like OELM-Freeze at 0.1 is set against Freeze and GPT-Base at 0.1, and
    only those comparator groups are tabulated (two unnamed rows per variant read as one)."""
    from oelm_core.analysis.ablations import ablation_gaps

    study, root = tmp_path / "study", tmp_path / "ablations"
    losses = {  # (variant, dropout) -> the five seeds' losses
        ("gpt_base", 0.0): [2.50, 2.51, 2.49, 2.50, 2.52],
        ("gpt_base", 0.1): [2.41, 2.42, 2.40, 2.41, 2.43],
        ("oelm_nofreeze", 0.0): [2.53, 2.52, 2.54, 2.53, 2.52],
        ("oelm_nofreeze", 0.1): [2.43, 2.42, 2.44, 2.43, 2.42],
        ("oelm_freeze", 0.0): [2.59, 2.60, 2.58, 2.59, 2.61],
        ("oelm_freeze", 0.1): [2.53, 2.54, 2.52, 2.53, 2.55],
    }
    lrs = {"gpt_base": 1e-3, "oelm_nofreeze": 2e-3, "oelm_freeze": 4e-3}
    for (variant, dropout), values in losses.items():
        for seed, loss in enumerate(values):
            make_run(
                study,
                variant,
                math.exp(loss),
                seed=seed,
                name=f"{variant}_drop{dropout:g}",
                model={"dropout": dropout},
                train={"lr": lrs[variant] if dropout else 1e-3},
            )
    illcond = [2.50, 2.51, 2.49, 2.52, 2.50]
    for seed, loss in enumerate(illcond):
        d = root / "oelm_freeze_illcond" / f"seed{seed}"
        d.mkdir(parents=True)
        run = make_run(d, "oelm_freeze", math.exp(loss), seed=seed, model={"dropout": 0.1}, train={"lr": 4e-3})
        for name in ("config.yaml", "summary.json"):
            (run / name).write_text((run / name).read_text().replace("oelm_freeze", "oelm_freeze_illcond"))
        (run / "sweep_point.json").write_text(
            json.dumps({"label": "oelm_freeze_illcond", "variant": "oelm_freeze_illcond", "seed": seed})
        )
    table = ablation_gaps(root, study, "final", A.TUNED_SETTINGS)
    rows = {r["label"]: r for r in table["rows"]}
    assert [r["label"] for r in table["rows"]] == ["oelm_freeze_illcond", "gpt_base", "oelm_nofreeze", "oelm_freeze"]
    assert rows["oelm_freeze"]["val_loss"] == pytest.approx(statistics.mean(losses["oelm_freeze", 0.1]))
    assert rows["oelm_nofreeze"]["val_loss"] == pytest.approx(statistics.mean(losses["oelm_nofreeze", 0.1]))
    gap = math.exp(statistics.mean(illcond) - statistics.mean(losses["oelm_freeze", 0.1])) - 1
    assert rows["oelm_freeze_illcond"]["oelm_freeze_gap_pct"] == pytest.approx(100 * gap)
    base_gap = math.exp(statistics.mean(illcond) - statistics.mean(losses["gpt_base", 0.1])) - 1
    assert rows["oelm_freeze_illcond"]["gpt_base_gap_pct"] == pytest.approx(100 * base_gap)
    # without the tuned settings GPT-Base (at another learning rate) is no comparator at all
    with pytest.raises(ConfigError, match="0 groups of gpt_base that the ablations could be compared with"):
        ablation_gaps(root, study, "final")
