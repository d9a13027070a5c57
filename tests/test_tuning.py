"""oelm_core.analysis.tuning and oelm_core.tuning: each group's setting chosen from a tuning sweep, and
the study written at it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from oelm_core.analysis.tuning import tuning_figure, tuning_table
from oelm_core.config import ConfigError
from oelm_core.runner import load_plan
from oelm_core.tuning import main, tuned_study

REPO = Path(__file__).resolve().parents[1]


def _run(
    root: Path, variant: str, lr: float, dropout: float, seed: int, losses: list[float], status: str = "completed"
) -> Path:
    """A run folder as the trainer leaves it: config.yaml, metrics.jsonl (one evaluation per
    100 steps, ``losses``) and summary.json (its best validation loss)."""
    folder = root / f"lr={lr}" / f"{variant}_drop{dropout}" / f"seed{seed}"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "variant": variant,
                "preset": "medium512",
                "model": {"dropout": dropout},
                "train": {"seed": seed, "lr": lr, "min_lr": lr / 10},
            }
        )
    )
    rows = [{"step": 100 * (k + 1), "train_loss": v + 0.5, "val_loss": v} for k, v in enumerate(losses)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "summary.json").write_text(
        json.dumps(
            {
                "name": folder.name,
                "variant": variant,
                "preset": "medium512",
                "status": status,
                "steps": rows[-1]["step"],
                "best_val_loss": min(losses),
                "final_val_loss": losses[-1],
            }
        )
    )
    return folder


@pytest.fixture
def sweep(tmp_path):
    """GPT-Base best at lr 1e-3 without dropout (mean 2.0 over two seeds), though lr 2e-3's
    seed 0 alone is lower: the choice is the mean's. OELM-Freeze best at lr 2e-3, dropout 0.1,
    reached at step 200 (it rises after: the best evaluation counts, not the last)."""
    root = tmp_path / "tune"
    _run(root, "gpt_base", 0.001, 0.0, 0, [2.5, 2.1, 2.0])
    _run(root, "gpt_base", 0.001, 0.0, 1, [2.4, 2.2, 2.0])
    _run(root, "gpt_base", 0.002, 0.0, 0, [2.3, 1.9, 1.95])
    _run(root, "gpt_base", 0.002, 0.0, 1, [2.6, 2.3, 2.2])
    _run(root, "oelm_freeze", 0.001, 0.1, 0, [2.9, 2.7, 2.6])
    _run(root, "oelm_freeze", 0.002, 0.1, 0, [2.8, 2.5, 2.55])
    # lower still, but a seed did not finish: not a candidate
    _run(root, "oelm_freeze", 0.002, 0.0, 0, [2.4, 2.3, 2.2])
    _run(root, "oelm_freeze", 0.002, 0.0, 1, [2.4, 2.3, 2.2], status="failed")
    return root


def test_each_group_gets_the_setting_with_the_lowest_mean_best_loss(sweep):
    table = tuning_table(sweep)
    base, freeze = table["chosen"]["gpt_base"], table["chosen"]["oelm_freeze"]
    assert (base["lr"], base["dropout"]) == (0.001, 0.0)
    assert base["best_val_loss"] == pytest.approx(2.0) and base["best_val_loss_std"] == pytest.approx(0.0)
    other = next(r for r in table["rows"] if r["variant"] == "gpt_base" and r["lr"] == 0.002)
    assert other["best_val_loss"] == pytest.approx((1.9 + 2.2) / 2) and not other["chosen"]
    assert (freeze["lr"], freeze["dropout"]) == (0.002, 0.1)
    assert freeze["best_val_loss"] == pytest.approx(2.5) and freeze["best_step"] == 200
    unfinished = next(r for r in table["rows"] if r["variant"] == "oelm_freeze" and r["dropout"] == 0.0)
    assert (unfinished["finished"], unfinished["candidate"]) == (1, False)
    assert freeze["settings"] == {"train.lr": 0.002, "train.min_lr": 0.0002, "model.dropout": 0.1}


def test_the_study_is_written_at_each_groups_choice_and_trains_it(sweep, tmp_path):
    template = tmp_path / "study.yaml"
    template.write_text(
        "# a study\n# of two groups\nexperiment:\n  name: tuned\n  layout: study\n  runs:\n"
        f"  - {{params: {REPO}/parameters/medium512/gpt_base.yaml, overrides: [train.lr=0.1, train.steps=7]}}\n"
        f"  - {REPO}/parameters/medium512/oelm_freeze.yaml\n"
        "  seeds: [0, 1]\n  notebooks: [03_training]\n"
    )
    out = tmp_path / "elsewhere" / "tuned.yaml"
    out.parent.mkdir()
    out.write_text(tuned_study(template, tuning_table(sweep)["chosen"], "tune", out))
    text = out.read_text()
    assert text.startswith("# a study\n# of two groups\n# Learning rate and dropout per group")
    plan = load_plan(out)
    got = {
        (r.variant, r.seed): (
            r.config["train"]["lr"],
            r.config["train"]["min_lr"],
            r.config["model"]["dropout"],
            r.config["train"]["steps"],
        )
        for r in plan.runs
    }
    assert got[("gpt_base", 1)] == (0.001, 0.0001, 0.0, 7)  # the template's other override stays
    assert got[("oelm_freeze", 0)] == (0.002, 0.0002, 0.1, 100000)


def test_a_group_the_sweep_did_not_tune_is_named(sweep, tmp_path):
    template = tmp_path / "study.yaml"
    template.write_text(f"experiment:\n  runs: [{REPO}/parameters/medium512/oelm_nofreeze.yaml]\n")
    with pytest.raises(ConfigError, match="no finished setting of oelm_nofreeze"):
        tuned_study(template, tuning_table(sweep)["chosen"])


def test_the_cli_prints_the_choice_and_refuses_an_empty_folder(sweep, tmp_path, capsys):
    assert main([str(sweep), "--markdown", str(tmp_path / "t.md")]) == 0
    out = capsys.readouterr().out
    assert "chosen for GPT-Base: lr 0.001, dropout 0.0 (best_val_loss 2.0000 over 2 seed(s))" in out
    assert "| GPT-Base | 0.001 | 0 | 2 | 2 |" in (tmp_path / "t.md").read_text()
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "train the tuning sweep first" in capsys.readouterr().err


def test_the_figure_has_a_panel_per_dropout_and_rings_the_choice(sweep, tmp_path):
    fig = tuning_figure(tuning_table(sweep), tmp_path / "tuning.png")
    assert (tmp_path / "tuning.png").stat().st_size > 0
    (no_dropout, dropout) = fig.axes
    assert (no_dropout.get_title(), dropout.get_title()) == ("dropout 0.0", "dropout 0.1")
    # GPT-Base's line without dropout: mean best losses at lr 1e-3 and 2e-3, then its ring at the choice
    line, ring = (
        no_dropout.lines[0],
        next(line for line in no_dropout.lines if line.get_marker() == "o" and line.get_markersize() == 13),
    )
    assert list(line.get_xdata()) == [0.001, 0.002]
    assert list(line.get_ydata()) == pytest.approx([2.0, 2.05])
    assert (list(ring.get_xdata()), list(ring.get_ydata())) == ([0.001], [pytest.approx(2.0)])
    # the swept rates label the log axis, nothing between them (its minor labels overlapped)
    assert [t.get_text() for t in no_dropout.get_xticklabels()] == ["0.001", "0.002"]
    assert list(no_dropout.get_xticks(minor=True)) == []


def test_cautions_name_an_edge_rate_a_budget_that_ended_too_soon_and_a_tie(sweep, tmp_path, capsys):
    table = tuning_table(sweep)
    base, freeze = table["cautions"]["gpt_base"], table["cautions"]["oelm_freeze"]
    # GPT-Base: lr 1e-3 is the smallest it swept without dropout; lr 2e-3 (best losses 1.9 and 2.2,
    # mean 2.05) is 0.05 behind, within its seeds' std (0.212): a tie
    assert "lr 0.001 is the smallest swept at dropout 0: the best may lie below it" in base[0]
    assert "still falling" in base[1]
    assert base[2].startswith("a tie: lr 0.002, dropout 0 is 0.0500 behind, within the seeds' spread (0.2121)")
    # OELM-Freeze: lr 2e-3 the largest at dropout 0.1; its runner-up has one seed each: no spread, no tie
    assert len(freeze) == 2 and "largest swept at dropout 0.1: the best may lie above it" in freeze[0]
    # a setting whose seeds stopped early, inside its grid and well ahead: nothing to caution
    root = tmp_path / "clear"
    for lr, losses in ((0.001, [2.5, 2.4]), (0.002, [2.2, 2.1, 2.15]), (0.004, [2.6, 2.5])):
        for seed in (0, 1):
            _run(root, "gpt_base", lr, 0.0, seed, [v + 0.001 * seed for v in losses], status="stopped_early")
    assert tuning_table(root)["cautions"]["gpt_base"] == []
    assert main([str(sweep), "--markdown", str(tmp_path / "t.md")]) == 0
    assert "cautions:\n- GPT-Base: lr 0.001 is the smallest" in capsys.readouterr().out
    assert "Cautions about the choice:\n\n- GPT-Base: lr 0.001" in (tmp_path / "t.md").read_text()


def test_each_dropout_gets_its_best_rate_and_the_study_trains_each_group_at_both(sweep, tmp_path):
    """Equal footing (issue 42): per group and dropout the learning rate with the lowest mean;
    --min-seeds 2 leaves out settings of one seed (OELM-Freeze at dropout 0.1 has only those);
    --per-dropout writes an entry per dropout, named for it."""
    table = tuning_table(sweep)
    assert table["per_dropout"][("gpt_base", 0.0)] is table["chosen"]["gpt_base"]
    assert table["per_dropout"][("oelm_freeze", 0.1)]["lr"] == 0.002
    assert ("oelm_freeze", 0.0) not in table["per_dropout"]  # its only setting has an unfinished seed
    strict = tuning_table(sweep, min_seeds=2)
    assert set(strict["chosen"]) == {"gpt_base"} and set(strict["per_dropout"]) == {("gpt_base", 0.0)}
    _run(sweep, "gpt_base", 0.001, 0.1, 0, [2.6, 2.2, 2.1])
    _run(sweep, "gpt_base", 0.004, 0.1, 0, [2.5, 2.15, 2.05])
    template = tmp_path / "study.yaml"
    template.write_text(
        f"experiment:\n  name: equal\n  layout: study\n  runs:\n"
        f"  - {REPO}/parameters/medium512/gpt_base.yaml\n  seeds: [0]\n  notebooks: [03_training]\n"
    )
    out = tmp_path / "equal.yaml"
    table = tuning_table(sweep)
    out.write_text(tuned_study(template, table["chosen"], "tune", out, table["per_dropout"]))
    got = {r.name: (r.config["train"]["lr"], r.config["model"]["dropout"]) for r in load_plan(out).runs}
    assert got == {"gpt_base_drop0_s0": (0.001, 0.0), "gpt_base_drop0.1_s0": (0.004, 0.1)}


def test_a_per_dropout_study_rewritten_in_place_is_the_same_and_tells_the_analysis_the_choice(sweep, tmp_path):
    """The protocol's study file is its own template (tune --study S --write S): a second rewrite
    doubled every entry (gpt_base_drop0_drop0, ...) and its note line. 04_analysis gets each
    group's own best dropout, the view it reports as "own best"."""
    _run(sweep, "gpt_base", 0.001, 0.1, 0, [2.6, 2.2, 2.1])
    _run(sweep, "gpt_base", 0.004, 0.1, 0, [2.5, 2.15, 2.05])
    study = tmp_path / "study.yaml"
    study.write_text(
        "# the protocol's study\nexperiment:\n  name: equal\n  layout: study\n  runs:\n"
        f"  - {REPO}/parameters/medium512/gpt_base.yaml\n  seeds: [0]\n  notebooks: [03_training, 04_analysis]\n"
        "  parameters:\n    04_analysis: {which: report}\n"
    )
    table = tuning_table(sweep)
    study.write_text(tuned_study(study, table["chosen"], "tune", study, table["per_dropout"]))
    first = study.read_text()
    study.write_text(tuned_study(study, table["chosen"], "tune", study, table["per_dropout"]))
    assert study.read_text() == first
    assert first.count("# Learning rate and dropout per group") == 1
    plan = load_plan(study)
    assert [r.name for r in plan.runs] == ["gpt_base_drop0_s0", "gpt_base_drop0.1_s0"]
    # GPT-Base's choice: dropout 0 (best loss 2.0 at lr 1e-3) over 0.1 (2.05 at 4e-3)
    assert plan.parameters["04_analysis"] == {"which": "report", "tuning_choice": {"gpt_base": 0.0}}


def test_a_sweep_at_another_shape_writes_a_study_of_its_own_from_the_medium512_template(tmp_path, capsys):
    """The shapes' sweep (tune_shapes.yaml) tunes each group at d_model 256; the protocol's
    Medium-512 study is the template. Without --name the study would train d_model 512 at rates
    chosen at 256: refused, naming the shape. With --name it is a plan of its own: each run at its
    group's rates per dropout and the sweep's shape, every other setting the template's."""
    sweep = tmp_path / "shape=d256"
    shape = {"d_model": 256, "n_head": 4, "d_ff": 1024}
    for variant, best in (("gpt_base", 0.002), ("oelm_nofreeze", 0.002), ("oelm_freeze", 0.004)):
        for dropout in (0.0, 0.1):
            for lr in (best / 2, best):
                for seed in (100, 101):
                    run = _run(sweep, variant, lr, dropout, seed, [2.5, 2.2 if lr == best else 2.3])
                    config = yaml.safe_load((run / "config.yaml").read_text())
                    config["model"].update(shape)
                    (run / "config.yaml").write_text(yaml.safe_dump(config))
    template = REPO / "parameters" / "protocol" / "study_medium512.yaml"
    out = tmp_path / "study_d256.yaml"
    argv = [str(sweep), "--min-seeds", "2", "--per-dropout", "--study", str(template), "--write", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "trained model.d_ff=1024, model.d_model=256, model.n_head=4, which" in err and "pass --name" in err
    assert not out.exists()
    assert main([*argv, "--name", "protocol_d256"]) == 0
    plan = load_plan(out)
    assert plan.name == "protocol_d256" and {r.seed for r in plan.runs} == {0, 1, 2, 3, 4}
    medium = {r.name: r for r in load_plan(template).runs}
    for r in plan.runs:
        model, train = r.config["model"], r.config["train"]
        assert {k: model[k] for k in shape} == shape
        best = {"gpt_base": 0.002, "oelm_nofreeze": 0.002, "oelm_freeze": 0.004}[r.variant]
        assert (train["lr"], train["min_lr"]) == (best, best / 10)
        twin = medium[r.name]  # the same entry and seed of the template: all else equal
        assert {k: v for k, v in train.items() if k not in ("lr", "min_lr")} == {
            k: v for k, v in twin.config["train"].items() if k not in ("lr", "min_lr")
        }
        assert model["dropout"] == twin.config["model"]["dropout"]
    assert len(plan.runs) == len(medium) == 30
    # written again in place, the study is the same
    first = out.read_text()
    assert main([str(sweep), "--min-seeds", "2", "--per-dropout", "--study", str(out), "--write", str(out)]) == 0
    assert out.read_text() == first
    assert first.count("# Model shape: the tuning runs' (model.d_ff=1024, model.d_model=256, model.n_head=4)") == 1
    # the template's comments and description named its own shape; this study's name its
    assert "Medium-512" not in first.split("experiment:")[0]
    description = yaml.safe_load(first)["experiment"]["description"]
    assert "(model.d_ff=1024, model.d_model=256, model.n_head=4)" in description and "5 seeds" in description
    assert "Medium-512" not in description


def test_a_diverged_rate_sits_on_the_figures_top_edge_with_its_value():
    """A diverged rate (3.5 nats beside contenders within 0.2) would squeeze the contenders into a
    sliver: more than a nat above the lowest point, it is drawn as a triangle on the top edge, just
    above the highest contender's error bar, labelled with its value. A point 0.6 above is a curve's, kept."""

    def row(lr, loss, chosen=False):
        return {"variant": "gpt_base", "dropout": 0.0, "lr": lr, "best_val_loss": loss,
                "best_val_loss_std": 0.01, "chosen": chosen}  # fmt: skip

    table = {"metric": "best_val_loss", "rows": [row(1e-3, 2.0, True), row(2e-3, 2.2), row(4e-3, 3.5)]}
    (ax,) = tuning_figure(table).axes
    top = 2.21 + 0.1 * 0.21  # the highest error bar's end, and a tenth of the shown range
    assert top < ax.get_ylim()[1] < 2.3
    assert list(ax.lines[0].get_ydata()) == pytest.approx([2.0, 2.2, top])  # the line runs to the edge
    triangles = [line for line in ax.lines if line.get_marker() == "^"]
    assert [(list(t.get_xdata()), list(t.get_ydata())) for t in triangles] == [([4e-3], [pytest.approx(top)])]
    assert [a.get_text() for a in ax.texts] == ["3.50"]
    assert "triangles" in ax.get_ylabel()
    (ax,) = tuning_figure({"metric": "best_val_loss", "rows": [row(1e-3, 2.0, True), row(2e-3, 2.6)]}).axes
    assert not [line for line in ax.lines if line.get_marker() == "^"] and "triangles" not in ax.get_ylabel()
    assert ax.get_ylim()[1] > 2.6
