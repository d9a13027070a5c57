"""oelm_core.sweep: the sweep and ablation plans, and the tables/figures read back from run folders."""

import copy
import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from oelm_core import VARIANTS
from oelm_core.config import ConfigError, run_config_from_dict, save_run_config
from oelm_core.sweep import (
    ablation_figure,
    ablation_runs,
    ablation_table,
    load_sweep,
    main,
    run_ablations,
    run_rows,
    run_sweep,
    sweep_figure,
    sweep_results,
    sweep_runs,
)

REPO = Path(__file__).resolve().parents[1]
SWEEPS = sorted((REPO / "parameters" / "sweeps").glob("*.yaml"))


def test_the_four_sweeps_exist():
    assert {p.stem for p in SWEEPS} == {"a3_heads", "a4_head_dim", "a5_context", "a6_layers"}


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_sweep_files_plan_valid_runs(path, tmp_path):
    sweep = load_sweep(path)  # validates every run of the full and the smoke plan
    assert sweep.variants == ["gpt_base", "oelm_nofreeze", "oelm_freeze"]
    runs = sweep_runs(sweep, tmp_path)
    assert len(runs) == len(sweep.points) * 3 * len(sweep.seeds)
    assert len({r.out_dir for r in runs}) == len(runs)
    key = {"a3_heads": "n_head", "a4_head_dim": "d_head", "a5_context": "block_size", "a6_layers": "n_layer"}[path.stem]
    for r in runs:
        cfg = run_config_from_dict(r.params).model_config()
        assert getattr(cfg, key) == r.info["value"]
        assert cfg.qk_init == ("normal" if r.info["variant"] == "gpt_base" else "qr")
    smoke = sweep_runs(sweep, tmp_path, smoke=True)
    assert len(smoke) == 6 and all(run_config_from_dict(r.params).train.steps <= 10 for r in smoke)
    if path.stem == "a5_context":  # tokens per step constant along the context sweep
        assert len({r.params["train"]["batch_size"] * r.info["value"] for r in runs}) == 1


def _sweep_file(tmp_path: Path, **sweep) -> Path:
    spec = {"sweep": {"name": "t", "key": "n_layer", "variants": ["gpt_base"], "seeds": [0],
                      "points": [{"value": 1, "set": {"model.n_layer": 1}}], **sweep},
            "preset": "smoke", "out_dir": "x"}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("sweep,message", [
    ({"variant": ["oelm_freeze"]}, r"unknown key\(s\) sweep.variant; valid keys of sweep: key, name, points"),
    ({"points": [{"value": 1, "set": {"model.n_layer": 1}}, {"value": 2, "sett": {"model.n_layer": 2}}]},
     r"unknown key\(s\) sweep.points\[1\].sett; valid keys of sweep.points\[1\]: set, value"),
    ({"points": [{"value": 2, "set": "model.n_layer=2"}]}, r"sweep.points\[0\].set must map dotted keys"),
    ({"smoke": {"sets": {"train.steps": 2}}}, r"unknown key\(s\) sweep.smoke.sets; valid keys of sweep.smoke: points, set"),
    ({"smoke": {"points": [{"value": 1, "st": {}}]}}, r"unknown key\(s\) sweep.smoke.points\[0\].st"),
    # values the trainer cannot use fail when the file is read, before the first run
    ({"points": [{"value": 1, "set": {"train.dtype": "fp64"}}]}, r"train.dtype must be one of"),
])
def test_load_sweep_rejects_wrong_keys_and_values(tmp_path, sweep, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(_sweep_file(tmp_path, **sweep))


@pytest.mark.parametrize("sweep,message", [
    ({"seeds": 0}, r"sweep.seeds must be a list of integers, e.g. \[0\] or \[0, 1\]; got 0"),
    ({"seeds": ["a"]}, r"sweep.seeds must be a list of integers.*got \['a'\]"),
    ({"seeds": [True]}, r"sweep.seeds must be a list of integers"),
    ({"seeds": []}, r"sweep.seeds must be a list of integers"),
    ({"variants": "gpt_base"}, r"sweep.variants must be a list of variant names, e.g. \[gpt_base\].*got 'gpt_base'"),
    ({"variants": ["gpt_base", "oelm_frezee"]}, r"sweep.variants has unknown variant\(s\) \['oelm_frezee'\]; choose from"),
])
def test_load_sweep_requires_lists_of_seeds_and_variants(tmp_path, sweep, message):
    path = _sweep_file(tmp_path, **sweep)
    with pytest.raises(ConfigError, match=message) as err:
        load_sweep(path)
    assert str(path) in str(err.value)


def test_load_sweep_from_the_notebooks_folder(monkeypatch):
    """05_sweep's default sweep_file is relative to the repository root; a caller elsewhere (a
    kernel in notebooks/ before its setup cell) finds it too."""
    monkeypatch.chdir(REPO / "notebooks")
    assert load_sweep("parameters/sweeps/a6_layers.yaml").name == "a6_layers"


def test_ablation_plan_is_seed_major_and_complete(tmp_path):
    runs = ablation_runs(REPO / "parameters" / "ablations", tmp_path, seeds=(0, 1))
    stems = [r.info["label"] for r in runs]
    assert len(runs) == 30 and stems[:15] == stems[15:] and [r.info["seed"] for r in runs[:15]] == [0] * 15
    assert {r.info["variant"] for r in runs} == set(VARIANTS)
    for r in runs:
        cfg = run_config_from_dict(r.params)
        assert cfg.preset == "mini" and cfg.train.batch_size == 32 and not cfg.train.compile
        assert Path(cfg.out_dir) == tmp_path / r.info["label"] / f"seed{r.info['seed']}"
    with pytest.raises(ConfigError, match="no ablation file"):
        ablation_runs(REPO / "parameters" / "ablations", tmp_path, only=["nope"])
    with pytest.raises(ConfigError, match="train.dtype must be one of"):
        ablation_runs(REPO / "parameters" / "ablations", tmp_path, overrides={"train.dtype": "fp64"})


def _fake_run(folder: Path, label: str, variant: str, seed: int, loss: float, params=(100, 10), extra=None,
              model=None):
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(yaml.safe_dump({"variant": variant, "preset": "mini", "model": model or {},
                                                         "train": {"seed": seed}}))
    (folder / "summary.json").write_text(json.dumps({
        "name": label, "variant": variant, "preset": "mini", "status": "completed", "steps": 800,
        "final_val_loss": loss, "final_val_ppl": 2.718281828 ** loss, "best_val_loss": loss,
        "params": {"trainable": params[0], "frozen": params[1], "total": sum(params)}, "tokens_per_s": 1e6}))
    (folder / "sweep_point.json").write_text(json.dumps({"label": label, "variant": variant, "seed": seed,
                                                         **(extra or {})}))


def test_ablation_table_and_figure(tmp_path):
    root = tmp_path / "abl"
    for seed, (a, b) in enumerate([(3.0, 3.2), (3.1, 3.4)]):
        _fake_run(root / "gpt_base" / f"seed{seed}", "gpt_base", "gpt_base", seed, a, (110, 0))
        _fake_run(root / "progressive" / f"seed{seed}", "progressive", "oelm_freeze", seed, b)
    table = ablation_table(root)
    rows = {r["label"]: r for r in table["rows"]}
    assert rows["gpt_base"]["val_loss"] == pytest.approx(3.05) and rows["gpt_base"]["seeds"] == 2
    assert rows["progressive"]["loss_gap_pct"] == pytest.approx(100 * (3.3 / 3.05 - 1))
    assert rows["progressive"]["variant"] == "oelm_freeze"   # grouped by file, not by variant
    assert "| progressive |" in table["markdown"] and len(table["runs"]) == 4
    fig = ablation_figure(table, tmp_path / "abl.png")
    assert (tmp_path / "abl.png").stat().st_size > 1000
    # what is drawn: a bar at each ablation's mean loss, a dot at each seed's, on the loss axis
    (ax,) = fig.axes
    assert ax.get_ylabel() == "final validation loss (nats/token)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["gpt_base", "progressive"]
    assert [p.get_height() for p in ax.patches] == pytest.approx([3.05, 3.3])
    dots = [list(c.get_offsets()) for c in ax.collections]
    assert [[tuple(xy) for xy in d] for d in dots] == [[(0, 3.0), (0, 3.1)], [(1, 3.2), (1, 3.4)]]


def test_the_ablation_table_refuses_a_sweeps_runs(tmp_path, capsys):
    """`table runs/sweeps` without --sweep averaged the points n_head=2 and n_head=4 of one
    variant, both seed 0, as "2 seeds" of one ablation."""
    for value, loss in ((2, 3.0), (4, 3.4)):
        _fake_run(tmp_path / "a3_heads" / f"n_head={value}" / "gpt_base" / "seed0", "gpt_base", "gpt_base", 0,
                  loss, extra={"sweep": "a3_heads", "key": "n_head", "value": value}, model={"n_head": value})
    message = (f"{tmp_path} holds runs of the sweep(s) a3_heads: tabulate a sweep with --sweep "
               f"(python -m oelm_core.sweep table {tmp_path} --sweep --name NAME)")
    with pytest.raises(ConfigError, match=re.escape(message)):
        ablation_table(tmp_path)
    assert main(["table", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {message}")
    assert [r["seeds"] for r in sweep_results(tmp_path, "a3_heads")["rows"]] == [1, 1]


def test_ablation_runs_trained_otherwise_are_not_seeds_of_one_row(tmp_path):
    """Runs of one label are seeds only where their settings differ in train.seed alone."""
    root = tmp_path / "abl"
    for folder, seed, heads, loss in (("a", 0, 2, 3.0), ("b", 0, 4, 3.4), ("c", 1, 4, 3.6)):
        _fake_run(root / folder / "gpt_base" / f"seed{seed}", "gpt_base", "gpt_base", seed, loss,
                  model={"n_head": heads})
    table = ablation_table(root)
    rows = {r["label"]: (r["seeds"], r["val_loss"], r["val_loss_std"]) for r in table["rows"]}
    assert rows == {"gpt_base (model.n_head=2)": (1, 3.0, None),
                    "gpt_base (model.n_head=4)": (2, pytest.approx(3.5), pytest.approx(0.1414, abs=1e-4))}
    assert sorted(r["label"] for r in table["runs"]) == ["gpt_base (model.n_head=2)"] + ["gpt_base (model.n_head=4)"] * 2
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
    for folder, seed, model, loss in (("a", 0, {"n_head": 2}, 3.0), ("b", 0, None, 3.4), ("c", 1, None, 3.6),
                                      ("d", 2, None, 3.5)):
        _fake_run(root / folder / "gpt_base" / f"seed{seed}", "gpt_base", "gpt_base", seed, loss, model=model)
    (root / "d" / "gpt_base" / "seed2" / "config.yaml").unlink()
    with pytest.warns(UserWarning, match="without config.yaml"):
        rows = {r["label"]: (r["seeds"], r["val_loss"]) for r in ablation_table(root)["rows"]}
    assert rows == {"gpt_base (model.n_head=2)": (1, 3.0), "gpt_base (model.n_head=4)": (3, pytest.approx(3.5))}
    assert [(g.label, g.seeds) for g in group_runs(load_runs(root))] == [
        ("GPT-Base (model.n_head=2)", [0]), ("GPT-Base (model.n_head=4)", [0, 1, None])]
    shutil.copytree(root / "c", root / "e")
    twice = (r"c/gpt_base/seed1 and .*e/gpt_base/seed1 trained the same settings with the same seed \(1\): "
             r"the same run twice, not two seeds of one; leave one of them out of the runs read$")
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
    assert warning.startswith(f"gpt_base: {lost} without config.yaml, averaged as seeds of its variant's "
                              f"default settings")


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
    assert row["val_ppl"] == pytest.approx(2.718281828 ** 3.2)


def test_sweep_results_and_figure(tmp_path):
    for value, losses in ((2, (3.5, 3.6, 3.7)), (4, (3.2, 3.3, 3.4))):
        for variant, loss in zip(("gpt_base", "oelm_nofreeze", "oelm_freeze"), losses):
            _fake_run(tmp_path / "a6" / f"n_layer={value}" / variant / "seed0", variant, variant, 0, loss,
                      extra={"sweep": "a6", "key": "n_layer", "value": value})
    res = sweep_results(tmp_path, "a6")
    assert [(r["value"], r["variant"]) for r in res["rows"]][:3] == [(2, "gpt_base"), (2, "oelm_nofreeze"),
                                                                      (2, "oelm_freeze")]
    assert res["rows"][-1]["val_loss"] == pytest.approx(3.4)
    fig = sweep_figure(res, tmp_path / "s.png")
    assert (tmp_path / "s.png").stat().st_size > 1000
    # what is drawn: one line per variant through its loss at each swept value, on the loss axis
    (ax,) = fig.axes
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("n_layer", "final validation loss (nats/token)")
    assert ax.get_title() == "a6: validation loss vs n_layer"
    lines = {c.get_label(): (list(c.lines[0].get_xdata()), list(c.lines[0].get_ydata())) for c in ax.containers}
    assert lines == {"GPT-Base": ([2, 4], [3.5, 3.2]), "OELM-NoFreeze": ([2, 4], [3.6, 3.3]),
                     "OELM-Freeze": ([2, 4], [3.7, 3.4])}


def test_several_sweeps_in_one_folder_are_not_one_curve(tmp_path, capsys):
    """runs/sweeps, the default --out of every sweep, holds several: `table --sweep` drew the
    points of a3_heads and a6_layers as one line, under a3_heads' axis."""
    for sweep, key, values in (("a3_heads", "n_head", (1, 8)), ("a6_layers", "n_layer", (2, 4))):
        for value in values:
            _fake_run(tmp_path / sweep / f"{key}={value}" / "gpt_base" / "seed0", "gpt_base", "gpt_base", 0,
                      3.0 + value / 10, extra={"sweep": sweep, "key": key, "value": value})
    with pytest.raises(ConfigError, match=r"holds the sweeps a3_heads, a6_layers; name one: "
                                          r"sweep_results\(root, sweep_name\) \(CLI: table --sweep --name NAME\)"):
        sweep_results(tmp_path)
    assert main(["table", str(tmp_path), "--sweep"]) == 2
    assert "holds the sweeps a3_heads, a6_layers" in capsys.readouterr().err
    figure = tmp_path / "a6.png"
    assert main(["table", str(tmp_path), "--sweep", "--name", "a6_layers", "--figure", str(figure)]) == 0
    assert figure.is_file()
    assert [(r["key"], r["value"]) for r in sweep_results(tmp_path, "a6_layers")["rows"]] == [("n_layer", 2),
                                                                                              ("n_layer", 4)]


def test_sweep_results_keep_smoke_and_full_runs_apart(tmp_path):
    for smoke, loss in ((True, 9.0), (False, 3.0)):
        _fake_run(tmp_path / f"a6{'_smoke' * smoke}" / "n_layer=2" / "gpt_base" / "seed0", "gpt_base", "gpt_base",
                  0, loss, extra={"sweep": "a6", "key": "n_layer", "value": 2, "smoke": smoke})
    assert [r["val_loss"] for r in sweep_results(tmp_path, "a6", smoke=False)["rows"]] == [3.0]
    assert [r["val_loss"] for r in sweep_results(tmp_path, "a6", smoke=True)["rows"]] == [9.0]
    with pytest.raises(ConfigError, match="holds both smoke and full runs of a6; pass smoke=True or smoke=False"):
        sweep_results(tmp_path, "a6")


def _planned_params(monkeypatch) -> list[dict]:
    """The parameters of every run the CLI starts; nothing trains."""
    import oelm_core.sweep as S

    planned = []

    def run_one(run, runner="inprocess", skip_done=True, log=print):
        planned.append(run.params)
        return {**run.info, "status": "completed", "wall_s": 0.0, "out_dir": str(run.out_dir)}

    monkeypatch.setattr(S, "run_one", run_one)
    return planned


@pytest.mark.parametrize("command", ["run", "ablations"])
def test_every_set_flag_reaches_the_runs(tmp_path, monkeypatch, capsys, command):
    """--set given twice kept only the second, silently; train's CLI takes both (and several
    values after one --set)."""
    planned = _planned_params(monkeypatch)
    head = ([command, str(_sweep_file(tmp_path))] if command == "run" else
            [command, "--params-dir", str(REPO / "parameters" / "ablations"), "--only", "gpt_base", "--seeds", "0"])
    sets = ["--set", "train.steps=5", "train.warmup_steps=1", "--set", "train.lr=0.01"]
    assert main(head + ["--out", str(tmp_path / "out")] + sets) == 0
    assert [{k: p["train"].get(k) for k in ("steps", "warmup_steps", "lr")} for p in planned] == \
        [{"steps": 5, "warmup_steps": 1, "lr": 0.01}]


def test_yaml_errors_in_sweep_files_and_sets_name_the_file_or_the_set(tmp_path, monkeypatch, capsys):
    """PyYAML's traceback named neither the file nor the --set."""
    _planned_params(monkeypatch)
    bad = tmp_path / "bad.yaml"
    bad.write_text("sweep:\n  name: t\n  variants: [gpt_base\n  key: n_layer\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(bad))} is not valid YAML: expected ',' or ']', but "
                                          rf"got ':' at line 4"):
        load_sweep(bad)
    assert main(["run", str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad} is not valid YAML")
    assert main(["run", str(_sweep_file(tmp_path)), "--out", str(tmp_path / "out"), "--set", "train.lr=[1"]) == 2
    assert capsys.readouterr().err.startswith("error: --set 'train.lr=[1': the value is not valid YAML "
                                              "(expected ',' or ']'")
    ablations = tmp_path / "ablations"
    ablations.mkdir()
    (ablations / "a.yaml").write_text("variant: gpt_base\nmodel: {n_layer: 2\n")
    assert main(["ablations", "--params-dir", str(ablations), "--out", str(tmp_path / "abl")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {ablations / 'a.yaml'} is not valid YAML")
    # a run folder whose config.yaml is broken is refused, naming it
    (run,) = sweep_runs(load_sweep(_sweep_file(tmp_path)), tmp_path / "out")
    run.out_dir.mkdir(parents=True)
    (run.out_dir / "config.yaml").write_text("train: {steps: 3\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(run.out_dir))} holds a run whose config.yaml cannot "
                                          rf"be read \({re.escape(str(run.out_dir / 'config.yaml'))} is not valid"):
        run_sweep(_sweep_file(tmp_path), tmp_path / "out", log=lambda *_: None)


def test_an_unreadable_poet_checkpoint_leaves_its_cell_empty(tmp_path, capsys):
    """One truncated best.pt crashed `table` for every run; now that run's spectrum is empty
    and a warning names the file."""
    root = tmp_path / "abl"
    _fake_run(root / "gpt_base" / "seed0", "gpt_base", "gpt_base", 0, 3.0)
    _fake_run(root / "oelm_poet" / "seed0", "oelm_poet", "oelm_poet", 0, 3.1)
    best = root / "oelm_poet" / "seed0" / "best.pt"
    best.write_bytes(b"not a checkpoint")
    with pytest.warns(UserWarning, match=rf"no POET spectrum error for {re.escape(str(best.parent))}: "
                                         rf"checkpoint {re.escape(str(best))} could not be read"):
        assert main(["table", str(root)]) == 0
    rows = {r["label"]: r for r in json.loads((root / "ablations.json").read_text())["rows"]}
    assert rows["oelm_poet"]["spectrum_err"] is None and rows["oelm_poet"]["val_loss"] == pytest.approx(3.1)
    assert "| oelm_poet |" in capsys.readouterr().out


def _tiny_sweep(tmp_path: Path, story_folder: Path, **sweep) -> Path:
    """A sweep file of one 1-layer point, 3 steps on CPU, with a smoke section of 2 steps."""
    spec = {"sweep": {"name": "t", "key": "n_layer", "variants": ["gpt_base"], "seeds": [0],
                      "points": [{"value": 1, "set": {"model.n_layer": 1}}],
                      "smoke": {"set": {"train.steps": 2, "train.eval_every": 2, "train.ckpt_every": 2}}, **sweep},
            "name": "t", "out_dir": "x", "preset": "smoke", "model": {"block_size": 16},
            "data": {"source": str(story_folder), "out_dir": str(tmp_path / "data")},
            "train": {"steps": 3, "batch_size": 2, "warmup_steps": 1, "eval_every": 3, "eval_batches": 1,
                      "ckpt_every": 3, "log_every": 1, "progress": False, "device": "cpu"}}
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_full_sweep_after_the_smoke_sweep_trains_its_own_runs(tmp_path, story_folder, monkeypatch, capsys):
    """The smoke sweep into the same out_root must neither stand in for the full runs nor show
    up in the full sweep's table."""
    monkeypatch.setenv("OELM_DATA", str(story_folder))
    path, out = _tiny_sweep(tmp_path, story_folder), tmp_path / "runs"
    smoke = run_sweep(path, out, smoke=True, log=lambda *_: None)
    full = run_sweep(path, out, log=lambda *_: None)
    assert [r["status"] for r in smoke] == [r["status"] for r in full] == ["completed"], (smoke, full)
    assert Path(smoke[0]["out_dir"]) == out / "t_smoke" / "n_layer=1" / "gpt_base" / "seed0"
    assert Path(full[0]["out_dir"]) == out / "t" / "n_layer=1" / "gpt_base" / "seed0"
    assert json.loads((Path(full[0]["out_dir"]) / "summary.json").read_text())["steps"] == 3
    assert json.loads((Path(smoke[0]["out_dir"]) / "summary.json").read_text())["steps"] == 2
    res = sweep_results(out, "t", smoke=False)
    assert [(r["smoke"], r["steps"]) for r in res["runs"]] == [(False, 3)]
    # The CLI's table after a full sweep shows the full run alone (the smoke one lost 2 steps in).
    capsys.readouterr()
    assert main(["run", str(path), "--out", str(out)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| t |")]
    assert len(rows) == 1 and (out / "t" / "sweep.png").is_file()


def test_a_run_folder_trained_with_other_settings_is_refused(tmp_path, story_folder):
    """A folder already holding a finished run of other settings must not be skipped as if it
    were the planned run; settings that only say where the run executes may differ."""
    path = _tiny_sweep(tmp_path, story_folder)
    (run,) = sweep_runs(load_sweep(path), tmp_path / "runs")
    run.out_dir.mkdir(parents=True)
    trained = copy.deepcopy(run.params)
    trained["train"].update(steps=2, device="cuda", stop_after=1)
    save_run_config(run_config_from_dict(trained), run.out_dir / "config.yaml")
    (run.out_dir / "summary.json").write_text(json.dumps({"status": "completed", "steps": 2}))
    with pytest.raises(ConfigError) as err:
        run_sweep(path, tmp_path / "runs", log=lambda *_: None)
    message = str(err.value)
    assert message.startswith(f"{run.out_dir} holds a run trained with other settings than planned "
                              f"(train.steps: 2 -> 3); train into another folder")
    assert f"delete {run.out_dir}" in message
    assert not (run.out_dir / "params.yaml").exists()   # the folder is left as it was
    # The same run, asked for with its own steps, is the finished run: skipped.
    again = run_sweep(path, tmp_path / "runs", overrides={"train.steps": 2}, log=lambda *_: None)
    assert [r["status"] for r in again] == ["skipped"]


def test_ablations_default_to_the_ignored_runs_folder():
    """results/ablations holds the committed results; a default run there would skip them all
    and rewrite their table."""
    runs = ablation_runs(REPO / "parameters" / "ablations", only=["gpt_base"], seeds=(0,))
    assert runs[0].out_dir == Path("runs/ablations/gpt_base/seed0")


def test_an_ablation_set_cut_by_its_budget_goes_on_where_it_stopped(tmp_path, story_folder, monkeypatch):
    """The first call's time budget runs out after one run; the second call skips that finished
    run, trains the one not started, and each finished run keeps best.pt but not its ckpt/."""
    monkeypatch.setenv("OELM_DATA", str(story_folder))
    params_dir = tmp_path / "ablations"
    params_dir.mkdir()
    for variant in ("gpt_base", "oelm_freeze"):
        (params_dir / f"{variant}.yaml").write_text(yaml.safe_dump({
            "preset": "smoke", "variant": variant, "model": {"n_layer": 1, "block_size": 16},
            "data": {"out_dir": str(tmp_path / "data")},
            "train": {"steps": 3, "batch_size": 2, "warmup_steps": 1, "eval_every": 3, "eval_batches": 1,
                      "ckpt_every": 3, "log_every": 1, "progress": False, "device": "cpu"}}))
    out = tmp_path / "runs"
    first = run_ablations(params_dir, out, seeds=(0,), budget_s=1e-3, log=lambda *_: None)
    assert [(r["label"], r["status"]) for r in first] == [("gpt_base", "completed"), ("oelm_freeze", "not started")]
    again = run_ablations(params_dir, out, seeds=(0,), log=lambda *_: None)
    assert [(r["label"], r["status"]) for r in again] == [("gpt_base", "skipped"), ("oelm_freeze", "completed")]
    for label in ("gpt_base", "oelm_freeze"):
        run_dir = out / label / "seed0"
        assert (run_dir / "best.pt").is_file() and not (run_dir / "ckpt").exists()
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3


def test_a_tiny_sweep_really_trains(tmp_path, story_folder, monkeypatch):
    """One point, two variants, a few steps of a tiny model: in-process training end to end."""
    monkeypatch.setenv("OELM_DATA", str(story_folder))
    spec = {"sweep": {"name": "t", "key": "n_layer", "variants": ["gpt_base", "oelm_poet"], "seeds": [0],
                      "points": [{"value": 1, "set": {"model.n_layer": 1}}]},
            "name": "t", "out_dir": "x", "preset": "smoke", "model": {"block_size": 16},
            "data": {"source": str(story_folder), "out_dir": str(tmp_path / "data")},
            "train": {"steps": 3, "batch_size": 2, "warmup_steps": 1, "eval_every": 3, "eval_batches": 1,
                      "ckpt_every": 3, "log_every": 1, "progress": False, "device": "cpu"}}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(spec))
    status = run_sweep(tmp_path / "t.yaml", tmp_path / "runs", log=lambda *_: None)
    assert [r["status"] for r in status] == ["completed", "completed"], status
    res = sweep_results(tmp_path / "runs", "t")
    assert len(res["rows"]) == 2 and all(r["val_loss"] and r["val_loss"] > 0 for r in res["rows"])
    # A second call skips the completed runs.
    again = run_sweep(tmp_path / "t.yaml", tmp_path / "runs", log=lambda *_: None)
    assert [r["status"] for r in again] == ["skipped", "skipped"]
    # The POET run's best checkpoint still has an orthogonal spectrum.
    poet = [r for r in run_rows(tmp_path / "runs") if r["variant"] == "oelm_poet"]
    assert poet and poet[0]["spectrum_err"] is not None and poet[0]["spectrum_err"] < 1e-4


@pytest.mark.parametrize("runner", ["inprocess", pytest.param("subprocess", marks=pytest.mark.slow),
                                    pytest.param("notebook", marks=pytest.mark.slow)])
def test_an_interrupted_sweep_resumes_and_finished_runs_are_skipped(tmp_path, story_folder, monkeypatch,
                                                                    runner):
    """A run cut short (here: paused by stop_after, leaving a checkpoint as a killed run does)
    continues from its checkpoint on the next call; an early-stopped run counts as done."""
    monkeypatch.setenv("OELM_DATA", str(story_folder))
    spec = {"sweep": {"name": "t", "key": "n_layer", "variants": ["gpt_base"], "seeds": [0],
                      "points": [{"value": 1, "set": {"model.n_layer": 1}}]},
            "name": "t", "out_dir": "x", "preset": "smoke", "model": {"block_size": 16},
            "data": {"out_dir": str(tmp_path / "data")},
            "train": {"steps": 4, "batch_size": 2, "warmup_steps": 1, "eval_every": 2, "eval_batches": 1,
                      "ckpt_every": 2, "log_every": 1, "progress": False, "device": "cpu"}}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(spec))
    quiet = {"runner": runner, "log": lambda *_: None}
    first = run_sweep(tmp_path / "t.yaml", tmp_path / "runs", overrides={"train.stop_after": 2}, **quiet)
    out = Path(first[0]["out_dir"])
    assert first[0]["status"] == "paused" and (out / "ckpt" / "step_0000002.pt").is_file(), first
    again = run_sweep(tmp_path / "t.yaml", tmp_path / "runs", **quiet)
    assert again[0]["status"] == "completed", again
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[0] == 1 and steps[-1] == 4  # one curve, continued
    (out / "summary.json").write_text(json.dumps({**summary, "status": "stopped_early"}))
    assert [r["status"] for r in run_sweep(tmp_path / "t.yaml", tmp_path / "runs", **quiet)] == ["skipped"]


def test_sweep_notebook_is_committed_without_outputs():
    import nbformat

    nb = nbformat.read(REPO / "notebooks" / "05_sweep.ipynb", as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    assert sum("parameters" in c.metadata.get("tags", []) for c in code) == 1
    # No library logic in the notebook: it only calls oelm_core.sweep.
    assert not any(line.lstrip().startswith(("def ", "class ")) for c in code for line in c.source.splitlines())


@pytest.mark.slow
def test_sweep_notebook_runs_the_smoke_sweep(tmp_path, story_folder, monkeypatch):
    import nbformat
    import papermill as pm

    monkeypatch.setenv("OELM_DATA", str(story_folder))
    out = tmp_path / "05.ipynb"
    pm.execute_notebook(str(REPO / "notebooks" / "05_sweep.ipynb"), str(out),
                        parameters={"smoke": True, "out_root": str(tmp_path / "runs"),
                                    "overrides": {"data.out_dir": str(tmp_path / "data"), "train.device": "cpu"}},
                        cwd=str(REPO / "notebooks"), progress_bar=False, kernel_name="python3")
    nb = nbformat.read(out, as_version=4)
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                if o.get("output_type") == "error"]
    # A smoke sweep's figure sits with its runs, apart from the full sweep's folder.
    assert (tmp_path / "runs" / "a6_layers_smoke" / "sweep.png").is_file()
    assert not (tmp_path / "runs" / "a6_layers").exists()
