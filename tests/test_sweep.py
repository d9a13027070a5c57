"""oelm_core.analysis.sweeps and .ablations: the tables and figures read back from a plan's run
folders, and ``python -m oelm_core report``.

Training sweeps and ablations (plans of oelm_core.runner) and the older sweep CLI's run and
ablations commands are tested in tests/test_experiment.py.
"""

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from oelm_core.__main__ import report
from oelm_core.analysis.ablations import ablation_figure, ablation_table
from oelm_core.analysis.sweeps import sweep_figure, sweep_results
from oelm_core.config import ConfigError
from oelm_core.sweep import main as sweep_main


def _fake_run(folder: Path, label: str, variant: str, seed: int, loss: float, params=(100, 10), extra=None, model=None):
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(
        yaml.safe_dump({"variant": variant, "preset": "mini", "model": model or {}, "train": {"seed": seed}})
    )
    (folder / "summary.json").write_text(
        json.dumps(
            {
                "name": label,
                "variant": variant,
                "preset": "mini",
                "status": "completed",
                "steps": 800,
                "final_val_loss": loss,
                "final_val_ppl": 2.718281828**loss,
                "best_val_loss": loss,
                "params": {"trainable": params[0], "frozen": params[1], "total": sum(params)},
                "tokens_per_s": 1e6,
            }
        )
    )
    (folder / "sweep_point.json").write_text(
        json.dumps({"label": label, "variant": variant, "seed": seed, **(extra or {})})
    )


def test_ablation_table_and_figure(tmp_path):
    root = tmp_path / "abl"
    for seed, (a, b) in enumerate([(3.0, 3.2), (3.1, 3.4)]):
        _fake_run(root / "gpt_base" / f"seed{seed}", "gpt_base", "gpt_base", seed, a, (110, 0))
        _fake_run(root / "progressive" / f"seed{seed}", "progressive", "oelm_freeze", seed, b)
    table = ablation_table(root)
    rows = {r["label"]: r for r in table["rows"]}
    assert rows["gpt_base"]["val_loss"] == pytest.approx(3.05) and rows["gpt_base"]["seeds"] == 2
    assert rows["progressive"]["loss_gap_pct"] == pytest.approx(100 * (3.3 / 3.05 - 1))
    assert rows["progressive"]["variant"] == "oelm_freeze"  # grouped by file, not by variant
    assert "| progressive |" in table["markdown"] and len(table["runs"]) == 4
    fig = ablation_figure(table, tmp_path / "abl.png")
    assert (tmp_path / "abl.png").stat().st_size > 1000
    # what is drawn: a line at each ablation's mean loss, a dot at each seed's, GPT-Base's mean
    # across, on the loss axis; no bars (the axis is cut to the losses, where heights mislead)
    (ax,) = fig.axes
    assert ax.get_ylabel() == "final validation loss (nats/token)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["gpt_base", "progressive"]
    assert len(ax.patches) == 0 and ax.get_ylim()[0] > 2.5
    assert [sum(line.get_xdata()) / 2 for line in ax.lines[:2]] == pytest.approx([0, 1])
    assert [line.get_ydata()[0] for line in ax.lines[:2]] == pytest.approx([3.05, 3.3])
    assert list(ax.lines[2].get_ydata()) == pytest.approx([3.05, 3.05])  # the baseline's mean, dashed
    dots = [list(c.get_offsets()) for c in ax.collections]
    assert [[tuple(xy) for xy in d] for d in dots] == [[(0, 3.0), (0, 3.1)], [(1, 3.2), (1, 3.4)]]


def test_the_ablation_table_refuses_a_sweeps_runs(tmp_path, capsys):
    """`table runs/sweeps` without --sweep averaged the points n_head=2 and n_head=4 of one
    variant, both seed 0, as "2 seeds" of one ablation."""
    for value, loss in ((2, 3.0), (4, 3.4)):
        _fake_run(
            tmp_path / "a3_heads" / f"n_head={value}" / "gpt_base" / "seed0",
            "gpt_base",
            "gpt_base",
            0,
            loss,
            extra={"sweep": "a3_heads", "key": "n_head", "value": value},
            model={"n_head": value},
        )
    message = (
        f"{tmp_path} holds runs of the sweep(s) a3_heads: tabulate a sweep with --sweep "
        f"(python -m oelm_core report {tmp_path} --sweep --name NAME)"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        ablation_table(tmp_path)
    assert report([str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {message}")
    assert sweep_main(["table", str(tmp_path)]) == 2  # the older name of report
    first, second = capsys.readouterr().err.splitlines()
    assert first == "python -m oelm_core.sweep table is now python -m oelm_core report" and second.startswith(
        f"error: {message}"
    )
    assert [r["seeds"] for r in sweep_results(tmp_path, "a3_heads")["rows"]] == [1, 1]


def test_ablation_runs_trained_otherwise_are_not_seeds_of_one_row(tmp_path):
    """Runs of one label are seeds only where their settings differ in train.seed alone."""
    root = tmp_path / "abl"
    for folder, seed, heads, loss in (("a", 0, 2, 3.0), ("b", 0, 4, 3.4), ("c", 1, 4, 3.6)):
        _fake_run(
            root / folder / "gpt_base" / f"seed{seed}", "gpt_base", "gpt_base", seed, loss, model={"n_head": heads}
        )
    table = ablation_table(root)
    rows = {r["label"]: (r["seeds"], r["val_loss"], r["val_loss_std"]) for r in table["rows"]}
    assert rows == {
        "gpt_base (model.n_head=2)": (1, 3.0, None),
        "gpt_base (model.n_head=4)": (2, pytest.approx(3.5), pytest.approx(0.1414, abs=1e-4)),
    }
    assert (
        sorted(r["label"] for r in table["runs"]) == ["gpt_base (model.n_head=2)"] + ["gpt_base (model.n_head=4)"] * 2
    )
    # the same settings and seed twice: one training copied, not two seeds
    _fake_run(root / "d" / "gpt_base" / "seed1", "gpt_base", "gpt_base", 1, 3.6, model={"n_head": 4})
    with pytest.raises(ConfigError, match=r"trained the same settings with the same seed \(1\): the same run twice"):
        ablation_table(root)


def test_the_ablation_table_groups_seeds_as_the_analysis_does(tmp_path):
    """One grouping (analysis.seed_groups) serves the ablation table and analysis.group_runs:
    seeds of one setting together, another setting apart, a run of unknown seed (no
    config.yaml, so the default settings) with the default setting's seeds, and one setting
    and seed twice refused by both, in words that fit both (they told the table's user to
    "analyse them apart")."""
    from oelm_core.analysis import group_runs, load_runs

    root = tmp_path / "abl"
    for folder, seed, model, loss in (
        ("a", 0, {"n_head": 2}, 3.0),
        ("b", 0, None, 3.4),
        ("c", 1, None, 3.6),
        ("d", 2, None, 3.5),
    ):
        _fake_run(root / folder / "gpt_base" / f"seed{seed}", "gpt_base", "gpt_base", seed, loss, model=model)
    (root / "d" / "gpt_base" / "seed2" / "config.yaml").unlink()
    with pytest.warns(UserWarning, match="without config.yaml"):
        rows = {r["label"]: (r["seeds"], r["val_loss"]) for r in ablation_table(root)["rows"]}
    assert rows == {"gpt_base (model.n_head=2)": (1, 3.0), "gpt_base (model.n_head=4)": (3, pytest.approx(3.5))}
    assert [(g.label, g.seeds) for g in group_runs(load_runs(root))] == [
        ("GPT-Base (model.n_head=2)", [0]),
        ("GPT-Base (model.n_head=4)", [0, 1, None]),
    ]
    shutil.copytree(root / "c", root / "e")
    twice = (
        r"c/gpt_base/seed1 and .*e/gpt_base/seed1 trained the same settings with the same seed \(1\): "
        r"the same run twice, not two seeds of one; leave one of them out of the runs read$"
    )
    with pytest.raises(ConfigError, match=twice):
        ablation_table(root)
    with pytest.raises(ConfigError, match=twice):
        group_runs(load_runs(root))


def test_the_ablation_table_names_the_runs_whose_settings_it_assumed(tmp_path, recwarn):
    """A run without config.yaml is averaged with its variant's default settings (one loss 3.0,
    another 3.2, the third trained otherwise at 6.1: a mean of 4.1); nothing named it."""
    root = tmp_path / "abl"
    for seed, loss, model in ((0, 3.0, None), (1, 3.2, None), (2, 6.1, {"n_head": 2})):
        _fake_run(root / "gpt_base" / f"seed{seed}", "gpt_base", "gpt_base", seed, loss, model=model)
    lost = root / "gpt_base" / "seed2"
    (lost / "config.yaml").unlink()
    (row,) = ablation_table(root)["rows"]
    assert (row["seeds"], row["val_loss"]) == (3, pytest.approx(4.1))
    (warning,) = [str(w.message) for w in recwarn.list if "config.yaml" in str(w.message)]
    assert warning.startswith(
        f"gpt_base: {lost} without config.yaml, averaged as seeds of its variant's default settings"
    )


def test_an_ablation_seed_without_an_evaluation_is_not_counted_and_is_named(tmp_path):
    """A seed killed before its first evaluation was counted in "seeds" (2) while the mean
    covered the other seed alone."""
    root = tmp_path / "abl"
    for seed, loss in ((0, 3.2), (1, 3.6)):
        _fake_run(root / "gpt_base" / f"seed{seed}", "gpt_base", "gpt_base", seed, loss)
    cut = root / "gpt_base" / "seed1"
    (cut / "summary.json").unlink()
    (cut / "metrics.jsonl").write_text(json.dumps({"step": 10, "train_loss": 5.0}) + "\n")
    with pytest.warns(UserWarning, match=re.escape(f"gpt_base: {cut} ended before its first evaluation")):
        table = ablation_table(root)
    (row,) = table["rows"]
    assert (row["seeds"], row["val_loss"], row["val_loss_std"]) == (1, 3.2, None)
    assert row["val_ppl"] == pytest.approx(2.718281828**3.2)


def test_sweep_results_and_figure(tmp_path):
    for value, losses in ((2, (3.5, 3.6, 3.7)), (4, (3.2, 3.3, 3.4))):
        for variant, loss in zip(("gpt_base", "oelm_nofreeze", "oelm_freeze"), losses):
            _fake_run(
                tmp_path / "a6" / f"n_layer={value}" / variant / "seed0",
                variant,
                variant,
                0,
                loss,
                extra={"sweep": "a6", "key": "n_layer", "value": value},
            )
    res = sweep_results(tmp_path, "a6")
    assert [(r["value"], r["variant"]) for r in res["rows"]][:3] == [
        (2, "gpt_base"),
        (2, "oelm_nofreeze"),
        (2, "oelm_freeze"),
    ]
    assert res["rows"][-1]["val_loss"] == pytest.approx(3.4)
    fig = sweep_figure(res, tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 1000
    # what is drawn: one line per variant through its loss at each swept value, on the loss axis
    (ax,) = fig.axes
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("n_layer", "final validation loss (nats/token)")
    assert ax.get_title() == "a6: validation loss vs n_layer"
    lines = {c.get_label(): (list(c.lines[0].get_xdata()), list(c.lines[0].get_ydata())) for c in ax.containers}
    assert lines == {
        "GPT-Base": ([2, 4], [3.5, 3.2]),
        "OELM-NoFreeze": ([2, 4], [3.6, 3.3]),
        "OELM-Freeze": ([2, 4], [3.7, 3.4]),
    }


def test_several_sweeps_in_one_folder_are_not_one_curve(tmp_path, capsys):
    """runs/sweeps, the default --out of every sweep, holds several: `table --sweep` drew the
    points of a3_heads and a6_layers as one line, under a3_heads' axis."""
    for sweep, key, values in (("a3_heads", "n_head", (1, 8)), ("a6_layers", "n_layer", (2, 4))):
        for value in values:
            _fake_run(
                tmp_path / sweep / f"{key}={value}" / "gpt_base" / "seed0",
                "gpt_base",
                "gpt_base",
                0,
                3.0 + value / 10,
                extra={"sweep": sweep, "key": key, "value": value},
            )
    with pytest.raises(
        ConfigError,
        match=r"holds the sweeps a3_heads, a6_layers; name one: "
        r"sweep_results\(root, sweep_name\) \(CLI: report .* --sweep --name NAME\)",
    ):
        sweep_results(tmp_path)
    assert report([str(tmp_path), "--sweep"]) == 2
    assert "holds the sweeps a3_heads, a6_layers" in capsys.readouterr().err
    figure = tmp_path / "a6.png"
    assert report([str(tmp_path), "--sweep", "--name", "a6_layers", "--figure", str(figure)]) == 0
    assert figure.is_file()
    assert [(r["key"], r["value"]) for r in sweep_results(tmp_path, "a6_layers")["rows"]] == [
        ("n_layer", 2),
        ("n_layer", 4),
    ]


def test_sweep_results_keep_smoke_and_full_runs_apart(tmp_path):
    for smoke, loss in ((True, 9.0), (False, 3.0)):
        _fake_run(
            tmp_path / f"a6{'_smoke' * smoke}" / "n_layer=2" / "gpt_base" / "seed0",
            "gpt_base",
            "gpt_base",
            0,
            loss,
            extra={"sweep": "a6", "key": "n_layer", "value": 2, "smoke": smoke},
        )
    assert [r["val_loss"] for r in sweep_results(tmp_path, "a6", smoke=False)["rows"]] == [3.0]
    assert [r["val_loss"] for r in sweep_results(tmp_path, "a6", smoke=True)["rows"]] == [9.0]
    with pytest.raises(ConfigError, match="holds both smoke and full runs of a6; pass smoke=True or smoke=False"):
        sweep_results(tmp_path, "a6")


def test_an_unreadable_poet_checkpoint_leaves_its_cell_empty(tmp_path, capsys):
    """One truncated best.pt crashed `table` for every run; now that run's spectrum is empty
    and a warning names the file."""
    root = tmp_path / "abl"
    _fake_run(root / "gpt_base" / "seed0", "gpt_base", "gpt_base", 0, 3.0)
    _fake_run(root / "oelm_poet" / "seed0", "oelm_poet", "oelm_poet", 0, 3.1)
    best = root / "oelm_poet" / "seed0" / "best.pt"
    best.write_bytes(b"not a checkpoint")
    with pytest.warns(
        UserWarning,
        match=rf"no POET spectrum error for {re.escape(str(best.parent))}: "
        rf"checkpoint {re.escape(str(best))} could not be read",
    ):
        assert report([str(root)]) == 0
    rows = {r["label"]: r for r in json.loads((root / "ablations.json").read_text())["rows"]}
    assert rows["oelm_poet"]["spectrum_err"] is None and rows["oelm_poet"]["val_loss"] == pytest.approx(3.1)
    assert "| oelm_poet |" in capsys.readouterr().out


def test_report_on_a_folder_without_runs_says_so(tmp_path, capsys):
    """It wrote three empty tables into a folder it created."""
    assert report([str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'nope'} holds no run folders")
    assert not (tmp_path / "nope").exists()
