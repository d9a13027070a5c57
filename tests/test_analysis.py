"""oelm_core.analysis on hand-made run folders and known numbers: reading runs, groups of seeds,
the results table, the hypotheses, results.md and the curves. The theory, accounts, statistics
and attention modules have their own test_analysis_*.py files."""

import json
import math
import shutil
from pathlib import Path

import pytest
import yaml

from oelm_core import analysis as A
from oelm_core import build_model, config, count_parameters
from oelm_core.analysis import groups as groups_module
from oelm_core.config import ConfigError

MEDIUM = {"gpt_base": (44_896_768, 0), "oelm_nofreeze": (44_896_768, 0), "oelm_freeze": (41_751_040, 3_145_728)}


def make_run(
    root: Path,
    variant: str,
    ppl: float,
    tok_s: float = 1000.0,
    seed: int = 42,
    preset: str = "medium512",
    train_loss: float = 2.0,
    summary: bool = True,
    best: float | None = None,
    name: str | None = None,
    model: dict | None = None,
    train: dict | None = None,
    report: float | None = None,
    timed_alone: bool | None = True,
) -> Path:
    """A run folder as oelm_core.train writes it, with the given figures: final validation PPL
    ``ppl``, and ``best`` (default: ``ppl``) at the evaluation before; ``model`` and ``train``
    settings in its config.yaml. ``best`` <= ``ppl``: it is the lower of the two. ``report``: the
    held-out PPL at the best checkpoint (summary.json's report_val_*; None: a run trained before
    train.report_holdout, without them). ``timed_alone``: summary.json's record (None: none)."""
    d = root / f"{name or variant}_s{seed}"
    d.mkdir(parents=True)
    trainable, frozen = MEDIUM[variant]
    loss = math.log(ppl)
    best_loss = math.log(best) if best is not None else loss
    (d / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "name": d.name,
                "variant": variant,
                "preset": preset,
                "model": model or {},
                "train": {"seed": seed, **(train or {})},
            }
        )
    )
    rows = []
    for step in (10, 20, 30, 40):
        row = {
            "step": step,
            "train_loss": train_loss + (40 - step) / 10,
            "lr": 1e-3,
            "grad_norm": 1.0,
            "tokens_per_s": tok_s,
            "mfu": None,
            "peak_mem_mb": None,
            "tokens_seen": step * 512,
            "epochs": step / 100,
        }
        if step % 20 == 0:
            val = loss if step == 40 else (best_loss if best is not None else loss + 1)
            row.update(val_loss=val, val_ppl=math.exp(val), val_bpb=val / 3)
        rows.append(row)
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary:
        (d / "summary.json").write_text(
            json.dumps(
                {
                    "name": d.name,
                    "variant": variant,
                    "preset": preset,
                    "status": "completed",
                    "params": {"trainable": trainable, "frozen": frozen, "total": trainable + frozen},
                    "steps": 40,
                    "final_val_loss": loss,
                    "final_val_ppl": ppl,
                    "final_val_bpb": loss / 3,
                    "best_val_loss": best_loss,
                    "best_val_ppl": best if best is not None else ppl,
                    "best_val_bpb": best_loss / 3,
                    "final_train_loss": train_loss,
                    "tokens_per_s": tok_s,
                    "wall_time_s": 12.0,
                    "epochs": 0.4,
                    "checkpoint_bytes": 2**20 * 500,
                    **({} if timed_alone is None else {"timed_alone": timed_alone}),
                    **(
                        {}
                        if report is None
                        else {
                            "report_val_loss": math.log(report),
                            "report_val_ppl": report,
                            "report_val_bpb": math.log(report) / 3,
                        }
                    ),
                }
            )
        )
    return d


def study_runs(tmp_path, base=10.0, nofreeze=10.2, freeze=10.5, tok=(1000, 1000, 1010)):
    make_run(tmp_path, "gpt_base", base, tok[0])
    make_run(tmp_path, "oelm_nofreeze", nofreeze, tok[1])
    make_run(tmp_path, "oelm_freeze", freeze, tok[2])
    return A.load_runs(tmp_path)


def verdicts(hyps):
    return {h["id"]: h["holds"] for h in hyps}


def geometric_gap(ppl_a, ppl_b) -> float:
    """The gap H2 and H4 judge: of the seeds' geometric-mean PPLs, exp(mean log a - mean log b) - 1."""
    return math.exp(sum(map(math.log, ppl_a)) / len(ppl_a) - sum(map(math.log, ppl_b)) / len(ppl_b)) - 1


# --- reading runs -----------------------------------------------------------------------------


def test_load_run_reads_summary_metrics_and_config(tmp_path):
    run = A.load_run(make_run(tmp_path, "oelm_freeze", 12.0, seed=7))
    assert (run.variant, run.preset, run.seed, run.label) == ("oelm_freeze", "medium512", 7, "OELM-Freeze")
    assert len(run.train_rows()) == 4 and [r["step"] for r in run.eval_rows()] == [20, 40]
    assert run.value("final_val_ppl") == 12.0 and run.value("trainable") == 41_751_040
    assert run.value("wall_time_s") == 12.0 and run.value("steps") == 40 and run.value("epochs") == 0.4


def test_checkpoint_mb_is_the_size_of_best_pt(tmp_path):
    """summary.json's checkpoint_bytes (500 MiB here) is the newest training checkpoint, AdamW
    moments included; the table's checkpoint is best.pt, the weights, in MB of 10^6 bytes,
    whether summary.json exists or not."""
    import dataclasses

    from oelm_core.checkpoint import load_model, save_checkpoint

    model = build_model("tiny", "oelm_freeze")
    with_summary = make_run(tmp_path, "oelm_freeze", 12.0)
    save_checkpoint(
        {"model": model.state_dict(), "model_config": dataclasses.asdict(model.cfg)}, with_summary / "best.pt"
    )
    assert load_model(with_summary / "best.pt")[0].cfg == model.cfg
    size = (with_summary / "best.pt").stat().st_size
    assert size != 500 * 2**20
    assert A.load_run(with_summary).value("checkpoint_mb") == pytest.approx(size / 1e6)
    without_summary = make_run(tmp_path, "gpt_base", 10.0, summary=False)
    (without_summary / "best.pt").write_bytes(b"\0" * 2_500_000)
    assert A.load_run(without_summary).value("checkpoint_mb") == 2.5
    runs = A.load_runs(tmp_path)
    rows = {r["variant"]: r for r in A.results_table(runs)["rows"]}
    assert rows["oelm_freeze"]["checkpoint_mb"] == pytest.approx(size / 1e6)
    assert rows["gpt_base"]["checkpoint_mb"] == 2.5
    # no best.pt: no checkpoint size, not the training checkpoint's
    assert A.load_run(make_run(tmp_path, "oelm_nofreeze", 11.0)).value("checkpoint_mb") is None


def test_committed_results_load_with_the_trainers_keys():
    """The committed run folders (summary.json as oelm_core.train writes it) give every figure."""
    runs = A.load_runs(Path(__file__).resolve().parents[1] / "results" / "ablations")
    assert len(runs) == 30
    for run in runs:
        for key in (
            "final_val_loss",
            "final_val_ppl",
            "final_val_bpb",
            "best_val_loss",
            "best_val_ppl",
            "final_train_loss",
            "tokens_per_s",
            "trainable",
            "total",
            "wall_time_s",
            "epochs",
            "steps",
        ):
            assert run.value(key) is not None, (run.path, key)
        assert run.value("final_val_ppl") == pytest.approx(math.exp(run.value("final_val_loss")))
        assert run.value("steps") == run.metrics[-1]["step"]


def test_values_fall_back_to_metrics_without_summary(tmp_path):
    d = make_run(tmp_path, "gpt_base", 10.0, tok_s=500, summary=False)
    (d / "metrics.jsonl").write_text((d / "metrics.jsonl").read_text() + '{"step": 50, "train_lo')  # torn line
    run = A.load_run(d)
    assert run.value("final_val_loss") == pytest.approx(math.log(10.0))
    assert run.value("final_val_ppl") == pytest.approx(10.0)
    assert run.value("best_val_loss") == pytest.approx(math.log(10.0))
    assert run.value("final_train_loss") == pytest.approx(2.0)
    assert run.value("tokens_per_s") == pytest.approx(500)


def test_best_without_summary_is_the_lowest_evaluation(tmp_path):
    run_ = A.load_run(make_run(tmp_path, "gpt_base", 10.0, best=9.0, summary=False))
    assert run_.value("best_val_ppl") == pytest.approx(9.0) and run_.value("final_val_ppl") == pytest.approx(10.0)


def test_tokens_per_s_without_a_summary_is_the_median_of_the_windows(tmp_path):
    """summary.json holds the median over the log windows; a run without one gave a trimmed mean."""
    run_dir = make_run(tmp_path, "gpt_base", 10.0, summary=False)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for r, rate in zip(rows, [100.0, 1000.0, 1100.0, 5000.0]):
        r["tokens_per_s"] = rate
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert A.load_run(run_dir).value("tokens_per_s") == 1050.0


def test_load_runs_finds_run_folders_below_a_study(tmp_path):
    study_runs(tmp_path / "study" / "runs")
    runs = A.load_runs(tmp_path / "study")
    assert sorted(r.variant for r in runs) == ["gpt_base", "oelm_freeze", "oelm_nofreeze"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no run folders"):
        A.load_runs(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        A.load_run(tmp_path / "missing")


def test_a_broken_config_yaml_names_the_file(tmp_path):
    run_dir = make_run(tmp_path, "gpt_base", 10.0)
    (run_dir / "config.yaml").write_text("train: {seed: 1\n")
    with pytest.raises(ConfigError, match=r"config.yaml is not valid YAML"):
        A.load_run(run_dir)


def test_missing_preset_and_variant_and_the_explorer_follow_runconfig(tmp_path, monkeypatch):
    """A run folder without variant or preset, and the shape explorer, take RunConfig's defaults,
    not copies of them."""
    from oelm_core.config import RunConfig

    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "train_loss": 3.0}) + "\n")
    monkeypatch.setattr(RunConfig, "preset", "smoke")
    monkeypatch.setattr(RunConfig, "variant", "oelm_freeze")
    run = A.load_run(d)
    assert (run.variant, run.preset) == ("oelm_freeze", "smoke")
    rows = A.shape_account()
    assert [r["total"] for r in rows] == [count_parameters(build_model("smoke", v))["total"] for v in A.GROUP_LABELS]


# --- groups of seeds --------------------------------------------------------------------------

SMOKE = Path(__file__).resolve().parents[1] / "parameters" / "smoke"


def study_folders(tmp_path, runs: list, ppl: dict, seeds=(42,)) -> list[Path]:
    """The run folders a study of ``runs`` (study.runs entries) leaves, with the config.yaml
    the trainer writes for each planned run and its final validation PPL from ``ppl`` (by run
    name without the seed)."""
    from oelm_core.parameter_files import load_run_config, save_run_config
    from oelm_core.runner import load_plan as load_study

    tmp_path.mkdir(parents=True, exist_ok=True)
    study_file = tmp_path / "study.yaml"
    study_file.write_text(
        yaml.safe_dump(
            {"study": {"name": "s", "runs": runs, "seeds": list(seeds), "notebooks": ["03_training", "04_analysis"]}}
        )
    )
    dirs = []
    for planned in load_study(study_file, tmp_path / "out").runs:
        cfg = load_run_config(planned.params, planned.overrides)
        planned.run_dir.mkdir(parents=True)
        save_run_config(cfg, planned.run_dir / "config.yaml")
        value = ppl[planned.name.rsplit("_s", 1)[0]]
        (planned.run_dir / "summary.json").write_text(
            json.dumps(
                {
                    "name": cfg.name,
                    "variant": cfg.variant,
                    "preset": cfg.preset,
                    "status": "completed",
                    "params": {"trainable": 1000, "frozen": 0, "total": 1000},
                    "final_val_loss": math.log(value),
                    "final_val_ppl": value,
                    "tokens_per_s": 1.0,
                    "final_train_loss": 1.0,
                }
            )
        )
        dirs.append(planned.run_dir)
    return dirs


def test_runs_of_one_variant_with_other_overrides_are_not_seeds(tmp_path):
    """The reviewer's study: two OELM-Freeze runs with other learning rates (one seed each) were
    averaged as two seeds (PPL 25.5 +- 6.4) and judged H4 on the mixture."""
    entries = [
        str(SMOKE / "gpt_base.yaml"),
        {"params": str(SMOKE / "oelm_freeze.yaml"), "name": "freeze_lr_low", "overrides": ["train.lr=0.0005"]},
        {"params": str(SMOKE / "oelm_freeze.yaml"), "name": "freeze_lr_high", "overrides": ["train.lr=0.005"]},
    ]
    ppl = {"gpt_base": 20.0, "freeze_lr_low": 30.0, "freeze_lr_high": 21.0, "oelm_freeze": 21.5}
    runs = A.load_runs(study_folders(tmp_path / "a", entries, ppl))
    rows = A.results_table(runs)["rows"]
    assert [(r["model"], r["seeds"], r["val_ppl"], r["val_ppl_std"]) for r in rows] == [
        ("GPT-Base", 1, 20.0, None),
        ("OELM-Freeze (freeze_lr_low)", 1, 30.0, None),
        ("OELM-Freeze (freeze_lr_high)", 1, 21.0, None),
    ]
    assert [r["ppl_gap_pct"] for r in rows] == [0, pytest.approx(50.0), pytest.approx(5.0)]  # the one GPT-Base
    hyps = {h["id"]: h for h in A.hypotheses(runs)}
    assert all(h["holds"] is None for h in hyps.values())
    assert hyps["H4"]["evidence"] == (
        "not judged: no OELM-Freeze and GPT-Base groups at preset smoke were trained with the same settings "
        "apart from the variant (OELM-Freeze (freeze_lr_low), OELM-Freeze (freeze_lr_high), GPT-Base): "
        "they would compare more than the variant"
    )
    assert A.significance_tests(runs) == []
    # An OELM-Freeze run with GPT-Base's settings is what H1 and H4 compare, and it alone.
    runs = A.load_runs(study_folders(tmp_path / "b", entries + [str(SMOKE / "oelm_freeze.yaml")], ppl))
    assert [r["model"] for r in A.results_table(runs)["rows"]] == [
        "GPT-Base",
        "OELM-Freeze (freeze_lr_low)",
        "OELM-Freeze (freeze_lr_high)",
        "OELM-Freeze (oelm_freeze)",
    ]
    hyps = {h["id"]: h for h in A.hypotheses(runs)}
    assert hyps["H4"]["value"] == pytest.approx(21.5 / 20.0 - 1) and hyps["H4"]["holds"] is True
    assert hyps["H4"]["evidence"].startswith("validation PPL 21.500 (Freeze (oelm_freeze)) vs 20.000 (GPT-Base)")
    assert hyps["H1"]["holds"] is False
    for h in ("H2", "H3", "H3t"):  # H3 as the seeds state it: against OELM-NoFreeze
        assert hyps[h]["evidence"] == "not judged: needs runs of OELM-Freeze and OELM-NoFreeze at preset smoke"


def test_the_same_setup_twice_is_refused_and_a_folder_read_twice_is_one_run(tmp_path):
    dirs = study_folders(tmp_path, [str(SMOKE / "gpt_base.yaml")], {"gpt_base": 20.0})
    runs = A.load_runs([tmp_path / "out", dirs[0]])  # a study folder and one of its runs
    assert len(runs) == 1
    copy = tmp_path / "elsewhere" / "gpt_base_s42"
    shutil.copytree(dirs[0], copy)
    with pytest.raises(
        ConfigError,
        match=r"gpt_base_s42 and .*elsewhere/gpt_base_s42 trained the same settings "
        r"with the same seed \(42\): the same run twice, not two seeds",
    ):
        A.results_table(A.load_runs([tmp_path / "out", tmp_path / "elsewhere"]))
    # the seeds of one setup are one group
    dirs = study_folders(tmp_path / "seeds", [str(SMOKE / "gpt_base.yaml")], {"gpt_base": 20.0}, seeds=(1, 2))
    (group,) = A.group_runs(A.load_runs(dirs))
    assert (group.label, group.seeds, len(group.runs)) == ("GPT-Base", [1, 2], 2)


def test_committed_ablations_keep_progressive_runs_apart_from_oelm_freeze():
    """The ablation folder's progressive runs record variant oelm_freeze: averaged with the
    OELM-Freeze runs as six "seeds" (29.46 PPL), they turned H4 from "does not hold" (+12.8%)
    into "holds" (+9.7%). With two seeds a side the 95% interval of +12.8% spans 10%: not
    decided at this n."""
    runs = A.load_runs(Path(__file__).resolve().parents[1] / "results" / "ablations")
    by_name = {}
    for r in runs:
        by_name.setdefault(r.name, []).append(r.value("final_val_ppl"))
    rows = {r["model"]: r for r in A.results_table(runs)["rows"]}
    for name in ("oelm_freeze", "progressive", "progressive_layerwise"):
        row = rows[f"OELM-Freeze ({name})"]
        assert row["seeds"] == 2 and row["val_ppl"] == pytest.approx(sum(by_name[name]) / 2)
    assert rows["GPT-Base"]["seeds"] == 2 and "OELM-Freeze" not in rows
    hyps = {h["id"]: h for h in A.hypotheses(runs)}
    assert (
        hyps["H4"]["value"]
        == pytest.approx(geometric_gap(by_name["oelm_freeze"], by_name["gpt_base"]))
        == pytest.approx(0.1283, abs=1e-4)
    )
    low, high = hyps["H4"]["interval"]
    assert low < 0.10 < high and hyps["H4"]["verdict"] == A.UNDECIDED and hyps["H4"]["holds"] is None
    assert "trains 15,529,728 of GPT-Base's 16,054,016 parameters" in hyps["H1"]["evidence"]
    sig = A.significance_tests(runs)
    assert [(t["a"], t["b"], t["n_a"]) for t in sig] == [
        ("OELM-Freeze (oelm_freeze)", "GPT-Base", 2),
        ("OELM-Freeze (oelm_freeze)", "OELM-NoFreeze", 2),
        ("OELM-NoFreeze", "GPT-Base", 2),
    ]


def test_the_variant_alone_is_what_the_hypotheses_compare(tmp_path):
    """An override that restates the variant's own value keeps it that variant; one that
    changes its freezing does not. Two comparisons in one folder are not judged as one."""
    make_run(tmp_path / "a", "gpt_base", 10.0)
    make_run(tmp_path / "a", "oelm_freeze", 10.5, model={"qk_init": "qr"})
    assert verdicts(A.hypotheses(A.load_runs(tmp_path / "a")))["H4"] is True
    make_run(tmp_path / "b", "gpt_base", 10.0)
    make_run(tmp_path / "b", "oelm_freeze", 10.5, model={"freeze_qk": [0]})
    assert verdicts(A.hypotheses(A.load_runs(tmp_path / "b")))["H4"] is None
    for lr, name in ((1e-3, "low"), (1e-2, "high")):
        make_run(tmp_path / "c", "gpt_base", 10.0, name=f"base_{name}", train={"lr": lr})
        make_run(tmp_path / "c", "oelm_freeze", 10.5, name=f"freeze_{name}", train={"lr": lr})
    runs = A.load_runs(tmp_path / "c")
    h4 = A.hypotheses(runs)[4]
    assert h4["holds"] is None and h4["evidence"].startswith(
        "not judged: 2 pairs of OELM-Freeze and GPT-Base groups at preset medium512 differ in the variant alone "
        "(OELM-Freeze (freeze_high) vs GPT-Base (base_high); OELM-Freeze (freeze_low) vs GPT-Base (base_low))"
    )
    # each OELM-Freeze row's gaps are to the GPT-Base of its learning rate
    rows = A.results_table(runs)["rows"]
    assert [r["model"] for r in rows] == [
        "GPT-Base (base_high)",
        "GPT-Base (base_low)",
        "OELM-Freeze (freeze_high)",
        "OELM-Freeze (freeze_low)",
    ]
    assert all(r["ppl_gap_pct"] == pytest.approx(5.0 if r["variant"] == "oelm_freeze" else 0) for r in rows)
    assert len(A.significance_tests(runs)) == 2


@pytest.fixture
def cold_variant_models():
    """variant_alone's cache of the variants' models, empty before the test and after it."""
    groups_module._variant_model.cache_clear()
    yield
    groups_module._variant_model.cache_clear()


def settings_group(variant: str, preset: str = "mini", model: dict | None = None, train: dict | None = None):
    """A Group of one seed of ``variant`` trained with the ``model`` and ``train`` settings given."""
    params = {"model": model or {}, "train": {"seed": 0, **(train or {})}}
    settings = A.Run(Path("x"), "x", variant, preset, 0, params, {}).settings()
    del settings["train.seed"]
    return A.Group("x", variant, preset, settings)


def test_variant_alone_builds_each_variants_model_once(monkeypatch, cold_variant_models):
    """variant_alone rebuilt both groups' ModelConfig for every pair it was given. Its answers
    are those it gave then: an override restating the variant's own value keeps it the variant;
    one changing it (freezing one layer, GPT-Base with orthogonal Q/K), another learning rate or
    another preset does not. The cache starts cold, so that a second run of this test in one
    session still counts the builds."""
    built = []
    real = groups_module.model_config
    monkeypatch.setattr(
        groups_module, "model_config", lambda preset, variant: built.append((preset, variant)) or real(preset, variant)
    )
    group = settings_group
    groups = {
        "base": group("gpt_base"),
        "nofreeze": group("oelm_nofreeze"),
        "freeze": group("oelm_freeze"),
        "freeze_qr": group("oelm_freeze", model={"qk_init": "qr"}),
        "gaussian": group("oelm_freeze_gaussian"),
        "synth": group("synth_random"),
        "freeze_layer0": group("oelm_freeze", model={"freeze_qk": [0]}),
        "base_lr": group("gpt_base", train={"lr": 1e-2}),
        "base_small": group("gpt_base", preset="small"),
        "base_qr": group("gpt_base", model={"qk_init": "qr"}),
    }
    alone = {(a, b) for a in groups for b in groups if a != b and A.variant_alone(groups[a], groups[b])}
    same = ("base", "nofreeze", "freeze", "freeze_qr", "gaussian", "synth")
    assert alone == {(a, b) for a in same for b in same if a != b}
    # "small" is never built: a pair of two presets differs in more than the variant
    assert sorted(built) == [
        ("mini", "gpt_base"),
        ("mini", "oelm_freeze"),
        ("mini", "oelm_freeze_gaussian"),
        ("mini", "oelm_nofreeze"),
        ("mini", "synth_random"),
    ]


def test_variant_alone_follows_a_variant_registered_again(monkeypatch, cold_variant_models):
    """variant_alone cached each variant's model by its name alone: a variant registered again
    (config.register_variant) kept the settings it had first, so runs of its first settings
    still counted as the variant, and runs of its new ones did not."""
    monkeypatch.setattr(config, "_VARIANT_SPECS", dict(config._VARIANT_SPECS))  # undone after the test
    config.register_variant("late", "Late: frozen SVD Q/K", qk_init="svd", freeze_qk="all")
    base, svd = settings_group("gpt_base"), settings_group("late")
    assert A.variant_alone(svd, base)
    config.register_variant("late", "Late: frozen Cayley Q/K", qk_init="cayley", freeze_qk="all")
    cayley = settings_group("late")
    assert (svd.settings["model.qk_init"], cayley.settings["model.qk_init"]) == ("svd", "cayley")
    assert not A.variant_alone(svd, base)
    assert A.variant_alone(cayley, base)


def test_groups_whose_run_names_coincide_are_told_apart_by_their_settings(tmp_path):
    make_run(tmp_path / "x", "oelm_freeze", 10.5, train={"lr": 1e-3})
    make_run(tmp_path / "y", "oelm_freeze", 11.0, train={"lr": 1e-2})
    labels = [g.label for g in A.group_runs(A.load_runs(tmp_path))]
    assert labels == ["OELM-Freeze (train.lr=0.001)", "OELM-Freeze (train.lr=0.01)"]


def test_seeds_without_config_yaml_are_one_group_of_unknown_seeds(tmp_path):
    """Folders with summary.json only: the seed is unknown, not two runs of the default seed."""
    for seed, ppl in ((1, 20.0), (2, 21.0)):
        (make_run(tmp_path, "gpt_base", ppl, seed=seed) / "config.yaml").unlink()
    runs = A.load_runs(tmp_path)
    (group,) = A.group_runs(runs)
    assert group.seeds == [None, None] and len(group.runs) == 2
    assert [line.get_label() for line in A.plot_curves(runs).axes[0].lines] == ["GPT-Base", "GPT-Base"]


def test_a_run_of_unknown_seed_is_a_seed_of_the_setup_it_trained(tmp_path):
    """A folder without config.yaml kept the default train.seed among its settings: it never
    joined the seeds of its setup, and comparing its group with another variant's raised
    KeyError 'train.seed' (results table, hypotheses, significance tests)."""
    make_run(tmp_path, "gpt_base", 10.0, seed=1)
    make_run(tmp_path, "gpt_base", 10.4, seed=2)
    make_run(tmp_path, "oelm_freeze", 10.5, seed=1)
    (make_run(tmp_path, "oelm_freeze", 10.9, seed=2) / "config.yaml").unlink()
    runs = A.load_runs(tmp_path)
    assert [(g.label, g.seeds) for g in A.group_runs(runs)] == [("GPT-Base", [1, 2]), ("OELM-Freeze", [1, None])]
    h4 = A.hypotheses(runs)[4]
    assert h4["id"] == "H4" and h4["value"] == pytest.approx(geometric_gap([10.5, 10.9], [10.0, 10.4]))


def test_the_global_batch_is_grad_accum_times_the_processes(tmp_path):
    """Two processes with grad_accum 1 train what one with grad_accum 2 does (seeds of one
    setup); one process with grad_accum 1 trains half the batch (another setup)."""
    for name, seed, accum, world in (("two_gpus", 1, 1, 2), ("one_gpu", 2, 2, 1), ("half", 3, 1, 1)):
        d = make_run(tmp_path, "gpt_base", 20.0, seed=seed, name=name, train={"grad_accum": accum})
        summary = json.loads((d / "summary.json").read_text())
        (d / "summary.json").write_text(json.dumps({**summary, "world_size": world}))
    groups = A.group_runs(A.load_runs(tmp_path))
    assert sorted(sorted(r.path.name for r in g.runs) for g in groups) == [["half_s3"], ["one_gpu_s2", "two_gpus_s1"]]


# --- results table and tests between groups ---------------------------------------------------


def test_results_table_gaps_and_per_parameter(tmp_path):
    table = A.results_table(study_runs(tmp_path))
    rows = {r["variant"]: r for r in table["rows"]}
    assert [r["variant"] for r in table["rows"]] == ["gpt_base", "oelm_nofreeze", "oelm_freeze"]
    assert rows["gpt_base"]["ppl_gap_pct"] == pytest.approx(0.0)
    assert rows["oelm_freeze"]["ppl_gap_pct"] == pytest.approx(5.0)
    assert rows["oelm_freeze"]["loss_gap_pct"] == pytest.approx(100 * (math.log(10.5) / math.log(10) - 1))
    assert rows["oelm_freeze"]["ppl_per_m_trainable"] == pytest.approx(10.5 / 41.75104)
    assert rows["oelm_freeze"]["trainable_params"] == 41_751_040
    assert "| OELM-Freeze |" in table["markdown"] and "41,751,040" in table["markdown"]


def test_results_table_headers_name_the_baseline(tmp_path):
    """The gap columns said "vs GPT-Base" whatever ``baseline`` the gaps were taken to."""
    runs = study_runs(tmp_path)
    default = A.results_table(runs)["markdown"].splitlines()[0]
    assert "| Loss gap vs GPT-Base (%) | PPL gap vs GPT-Base (%) |" in default
    table = A.results_table(runs, baseline="oelm_nofreeze")
    header = table["markdown"].splitlines()[0]
    assert "| Loss gap vs OELM-NoFreeze (%) | PPL gap vs OELM-NoFreeze (%) |" in header
    assert "GPT-Base" not in header
    rows = {r["variant"]: r for r in table["rows"]}
    assert rows["oelm_nofreeze"]["ppl_gap_pct"] == pytest.approx(0.0)
    assert rows["oelm_freeze"]["ppl_gap_pct"] == pytest.approx(100 * (10.5 / 10.2 - 1))
    with pytest.raises(ConfigError, match=r"baseline='gpt-base' is not a variant; pass one of gpt_base, "):
        A.results_table(runs, baseline="gpt-base")


def test_seed_groups_give_mean_std_and_tests(tmp_path):
    for seed, (pb, pf) in enumerate([(10.0, 10.6), (10.2, 10.8), (9.8, 10.7)]):
        make_run(tmp_path, "gpt_base", pb, seed=seed)
        make_run(tmp_path, "oelm_freeze", pf, seed=seed)
    runs = A.load_runs(tmp_path)
    rows = {r["variant"]: r for r in A.results_table(runs)["rows"]}
    assert rows["gpt_base"]["seeds"] == 3
    assert rows["gpt_base"]["val_ppl"] == pytest.approx(10.0)
    assert rows["gpt_base"]["val_ppl_std"] == pytest.approx(0.2)
    sig = A.significance_tests(runs)
    assert len(sig) == 1 and sig[0]["a"] == "OELM-Freeze" and sig[0]["p"] < 0.05
    out = A.write_results(runs, tmp_path / "out")
    data = json.loads((tmp_path / "out" / "results.json").read_text())
    assert data["significance"][0]["n_a"] == 3 and len(data["hypotheses"]) == 5
    md = (tmp_path / "out" / "results.md").read_text()
    assert "Welch" in md and "H4" in md and out["table"]


def test_the_results_table_names_the_runs_whose_settings_it_assumed(tmp_path, recwarn):
    """A run that lost its config.yaml joins the seeds of its variant's default settings; one
    trained otherwise (lr=1e-2, PPL 31) moved the default seeds' mean from 10.1 to 17.07, and
    nothing said that a run's settings had been assumed."""
    for seed, ppl in ((1, 10.0), (2, 10.2)):
        make_run(tmp_path, "gpt_base", ppl, seed=seed)
    lost = make_run(tmp_path, "gpt_base", 31.0, seed=3, train={"lr": 1e-2})
    (lost / "config.yaml").unlink()
    (row,) = A.results_table(A.load_runs(tmp_path))["rows"]
    assert (row["seeds"], row["val_ppl"]) == (3, pytest.approx(51.2 / 3))
    (warning,) = [str(w.message) for w in recwarn.list if "config.yaml" in str(w.message)]
    assert warning.startswith(
        f"GPT-Base: {lost} without config.yaml, averaged as seeds of its variant's default settings"
    )


def test_a_run_without_an_evaluation_is_left_out_of_the_figures_and_named(tmp_path):
    """A seed killed before its first evaluation crashed the Welch tests (float(None)), and the
    table said 3 seeds where its mean covered 2."""
    from scipy import stats

    for seed, (base, freeze) in enumerate([(10.0, 11.0), (10.4, 11.2), (10.2, 11.4)]):
        make_run(tmp_path, "gpt_base", base, seed=seed)
        make_run(tmp_path, "oelm_freeze", freeze, seed=seed)
    cut = tmp_path / "gpt_base_s2"
    (cut / "summary.json").unlink()
    rows = [json.loads(line) for line in (cut / "metrics.jsonl").read_text().splitlines()]
    (cut / "metrics.jsonl").write_text(
        "".join(json.dumps({k: v for k, v in r.items() if not k.startswith("val_")}) + "\n" for r in rows)
    )
    runs = A.load_runs(tmp_path)
    with pytest.warns(UserWarning, match="gpt_base_s2 ended before its first evaluation"):
        table = A.results_table(runs)
    base = next(r for r in table["rows"] if r["variant"] == "gpt_base")
    assert base["seeds"] == 2 and base["val_ppl"] == pytest.approx(10.2)
    test = next(t for t in A.significance_tests(runs) if (t["a"], t["b"]) == ("OELM-Freeze", "GPT-Base"))
    assert (test["n_a"], test["n_b"]) == (3, 2) and test["mean_b"] == pytest.approx(10.2)
    expected = stats.ttest_ind([11.0, 11.2, 11.4], [10.0, 10.4], equal_var=False).statistic
    assert test["t"] == pytest.approx(expected, rel=1e-6)


def test_which_other_than_final_or_best_is_refused(tmp_path):
    """which='bestt' read no figures: an empty table and unjudged hypotheses, which only a later
    assertion in the analysis notebook caught."""
    runs = study_runs(tmp_path)
    for call in (A.results_table, A.hypotheses, lambda r, w: A.write_results(r, tmp_path / "out", w)):
        with pytest.raises(
            ConfigError, match=r"which='bestt' names no validation figures; pass one of 'final', 'best'"
        ):
            call(runs, "bestt")
    assert not (tmp_path / "out").exists()
    assert A.results_table(runs, "best")["rows"][2]["val_ppl"] == pytest.approx(10.5)


def test_best_and_final_figures_are_told_apart(tmp_path):
    """Every run's validation loss turned up after its best evaluation: the table, hypotheses and
    tests of which='best' read the best figures, those of 'final' the last evaluation's (a
    version reading the final figures for both passed every other test)."""
    figures = {
        "gpt_base": [(10.0, 9.0), (10.4, 9.2)],
        "oelm_nofreeze": [(10.2, 9.1), (10.6, 9.3)],
        "oelm_freeze": [(11.6, 9.5), (11.8, 9.7)],
    }  # per seed: (final PPL, best PPL)
    for variant, seeds in figures.items():
        for seed, (final, best) in enumerate(seeds):
            make_run(tmp_path / "runs", variant, final, seed=seed, best=best)
    runs = A.load_runs(tmp_path / "runs")
    for which, i in (("final", 0), ("best", 1)):
        ppl = {v: [f[i] for f in seeds] for v, seeds in figures.items()}
        mean = {v: sum(p) / 2 for v, p in ppl.items()}
        rows = {r["variant"]: r for r in A.results_table(runs, which)["rows"]}
        for v in figures:
            assert rows[v]["val_ppl"] == pytest.approx(mean[v]), (which, v)
            assert rows[v]["val_loss"] == pytest.approx(sum(map(math.log, ppl[v])) / 2), (which, v)
            assert rows[v]["val_bpb"] == pytest.approx(sum(map(math.log, ppl[v])) / 6), (which, v)
        hyps = {h["id"]: h for h in A.hypotheses(runs, which)}
        assert hyps["H4"]["value"] == pytest.approx(geometric_gap(ppl["oelm_freeze"], ppl["gpt_base"]))
        assert hyps["H2"]["value"] == pytest.approx(geometric_gap(ppl["oelm_freeze"], ppl["oelm_nofreeze"]))
        sig = A.significance_tests(runs, f"{which}_val_ppl")
        assert [(t["a"], t["mean_a"], t["mean_b"]) for t in sig][0] == (
            "OELM-Freeze",
            pytest.approx(mean["oelm_freeze"]),
            pytest.approx(mean["gpt_base"]),
        )
        written = A.write_results(runs, tmp_path / which, which)
        assert written["table"][0]["val_ppl"] == pytest.approx(mean["gpt_base"])
        assert written["significance"][0]["metric"] == f"{which}_val_ppl"
        assert written["significance"][0]["mean_a"] == pytest.approx(mean["oelm_freeze"])
        assert verdicts(written["hypotheses"]) == verdicts(hyps.values())
    # +14.7% and +12.5% at the last evaluation, +5.5% and +4.3% at the best: at two seeds a side
    # the 95% intervals of either span the thresholds, and of final's lie higher
    final, best = ({h["id"]: h for h in A.hypotheses(runs, w)} for w in ("final", "best"))
    for hyps in (final, best):
        assert {k: h["verdict"] for k, h in hyps.items()} == {
            "H1": A.FAILS,
            "H2": A.UNDECIDED,
            "H3": A.HOLDS,
            "H3t": A.HOLDS,
            "H4": A.UNDECIDED,
        }
    assert final["H4"]["interval"][1] > best["H4"]["interval"][1] > 0.10


# --- hypotheses -------------------------------------------------------------------------------


def test_hypotheses_judged_honestly_and_flip_with_the_data(tmp_path):
    hyps = A.hypotheses(study_runs(tmp_path / "a"))
    assert [h["id"] for h in hyps] == ["H1", "H2", "H3", "H3t", "H4"]
    assert set(hyps[0]) >= {"id", "claim", "value", "threshold", "holds", "evidence"}
    # H1: 7.0% is not ~15%
    assert hyps[0]["value"] == pytest.approx(3_145_728 / 44_896_768) and hyps[0]["holds"] is False
    assert "7.0%" in hyps[0]["evidence"]
    assert verdicts(hyps) == {"H1": False, "H2": True, "H3": True, "H3t": True, "H4": True}
    # Freeze 8% worse than NoFreeze, 12% worse than Base, 10% slower: H2, H3, H3t, H4 flip
    bad = A.hypotheses(study_runs(tmp_path / "b", base=10.0, nofreeze=10.37, freeze=11.2, tok=(1000, 1000, 900)))
    assert verdicts(bad) == {"H1": False, "H2": False, "H3": False, "H3t": False, "H4": False}
    # one run a side: no interval, the point estimates decide, and the evidence says so
    assert bad[2]["interval"] is None and "one run a side" in bad[2]["evidence"]
    assert bad[3]["value"] == pytest.approx(1000 / 900)  # seconds to the same evaluation at 900 vs 1000 tokens/s
    assert bad[1]["value"] == pytest.approx(11.2 / 10.37 - 1)
    # H1 holds with a claim that matches the data
    assert A.hypotheses(study_runs(tmp_path / "c"), h1_claim=0.07)[0]["holds"] is True


def test_hypotheses_judgeable_only_for_the_three_groups_trained_alike(tmp_path):
    """The 04 notebook requires a verdict on every hypothesis exactly when this holds."""
    runs = study_runs(tmp_path / "all")
    assert A.hypotheses_judgeable(runs) and all(h["holds"] is not None for h in A.hypotheses(runs))
    make_run(tmp_path / "two", "gpt_base", 10.0)
    make_run(tmp_path / "two", "oelm_freeze", 10.5)
    assert not A.hypotheses_judgeable(A.load_runs(tmp_path / "two"))
    for v, ppl in (("gpt_base", 10.0), ("oelm_nofreeze", 10.2)):
        make_run(tmp_path / "lr", v, ppl)
    make_run(tmp_path / "lr", "oelm_freeze", 10.5, train={"lr": 2e-3})  # another learning rate
    runs = A.load_runs(tmp_path / "lr")
    assert not A.hypotheses_judgeable(runs)
    assert all(h["holds"] is None for h in A.hypotheses(runs))


def test_unjudged_names_what_the_04_notebook_must_not_leave_unjudged(tmp_path):
    """Three groups trained alike: every hypothesis needs a verdict, H3 and H3t only where every
    run records that it had its device alone."""
    runs = study_runs(tmp_path / "alone")
    hyps = A.hypotheses(runs)
    assert A.unjudged(hyps, runs) == []
    dropped = [dict(h, verdict=A.NOT_JUDGED) if h["id"] in ("H2", "H3t") else h for h in hyps]
    assert [h["id"] for h in A.unjudged(dropped, runs)] == ["H2", "H3t"]
    assert [h["id"] for h in A.unjudged(dropped, runs, timed_alone=False)] == ["H2"]
    for variant, ppl in (("gpt_base", 10.0), ("oelm_nofreeze", 10.2), ("oelm_freeze", 10.5)):
        make_run(tmp_path / "old", variant, ppl, timed_alone=None)  # trained before the record
    old = A.load_runs(tmp_path / "old")
    hyps = A.hypotheses(old)
    assert [h["id"] for h in hyps if h["verdict"] == A.NOT_JUDGED] == ["H3", "H3t"] and A.unjudged(hyps, old) == []


def test_hypotheses_without_the_runs_they_need_are_not_judged(tmp_path):
    make_run(tmp_path, "gpt_base", 10.0)
    hyps = A.hypotheses(A.load_runs(tmp_path))
    assert all(h["holds"] is None and "not judged" in h["evidence"] for h in hyps)


def test_h3_uses_its_threshold(tmp_path):
    assert verdicts(A.hypotheses(study_runs(tmp_path / "a", tok=(1000, 1000, 990))))["H3"] is True
    assert verdicts(A.hypotheses(study_runs(tmp_path / "b", tok=(1000, 1000, 990)), h3_min_ratio=0.995))["H3"] is False


# --- results.md and its markdown tables -------------------------------------------------------


def test_checkpoint_note_and_samples_section_of_results_md(tmp_path):
    assert A.checkpoint_note("final").endswith("The table reads the final evaluation, which may be a later step.")
    assert A.checkpoint_note("best").endswith("The table reads the best evaluation.")
    with pytest.raises(ConfigError, match="which='last' names no validation figures"):
        A.checkpoint_note("last")
    assert A.samples_markdown([], "final") == ""
    samples = [{"model": "GPT-Base", "prompt": "Once", "text": " upon a time"}]
    section = A.samples_markdown(samples, "best")
    assert section == (
        "## Samples\n\nAttention maps and samples: each group's best.pt, the weights of its lowest "
        "validation loss (its first seed that has one). The table reads the best evaluation.\n\n"
        "| model | prompt | text |\n|---|---|---|\n| GPT-Base | Once |  upon a time |"
    )
    A.write_results(study_runs(tmp_path), tmp_path / "out", "best", extra_markdown=section)
    assert (tmp_path / "out" / "results.md").read_text().endswith("\n" + section + "\n")


def test_large_figures_are_written_in_full():
    """4 significant digits wrote 45,678.9 tokens/s as 4.568e+04."""
    row = A.markdown_table([{"tok_s": 45678.9, "x": 99999.7, "ppl": 19.4812}]).splitlines()[-1]
    assert row == "| 45,679 | 100,000 | 19.48 |"


def test_a_cells_line_breaks_and_bars_stay_inside_its_row():
    """A generated story's lines broke the Samples table of results.md: each line after the first
    began a row of its own."""
    table = A.markdown_table([{"model": "GPT-Base", "text": "They ran.\nOne day | a dog\r\nsaid hi.\rEnd"}])
    assert table.splitlines() == [
        "| model | text |",
        "|---|---|",
        r"| GPT-Base | They ran.<br>One day \| a dog<br>said hi.<br>End |",
    ]
    assert A.markdown_table([{"a|b": 1}]).splitlines()[0] == r"| a\|b |"


@pytest.mark.parametrize("path", sorted((A.REPO / "results").glob("*/results.md")), ids=lambda p: p.parent.name)
def test_committed_results_tables_have_one_line_per_row(path):
    """Every line of a table in a committed results.md is a row of as many cells as its header."""
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|---"):
            cells = lines[i - 1].count(" | ") + 1
            for row in lines[i + 1 :]:
                if not row.strip():
                    break
                assert row.startswith("| ") and row.endswith(" |"), f"{path}: {row[:80]}"
                assert row.replace(r"\|", "").count(" | ") + 1 == cells, f"{path}: {row[:80]}"


# --- curves -----------------------------------------------------------------------------------


def test_curves_name_groups_of_one_variant_apart(tmp_path):
    make_run(tmp_path, "gpt_base", 20.0)
    make_run(tmp_path, "oelm_freeze", 30.0, name="freeze_lr_low", train={"lr": 5e-4})
    make_run(tmp_path, "oelm_freeze", 21.0, name="freeze_lr_high", train={"lr": 5e-3})
    for ax in A.plot_curves(A.load_runs(tmp_path)).axes:
        assert [line.get_label() for line in ax.lines] == [
            "GPT-Base (seed 42)",
            "OELM-Freeze (freeze_lr_high) (seed 42)",
            "OELM-Freeze (freeze_lr_low) (seed 42)",
        ]
        assert len({line.get_color() for line in ax.lines}) == 3


def test_plot_curves_saves_and_closes(tmp_path):
    import matplotlib.pyplot as plt

    runs = study_runs(tmp_path / "runs")
    before = len(plt.get_fignums())
    A.plot_curves(runs, tmp_path / "fig" / "curves.png")
    assert (tmp_path / "fig" / "curves.png").stat().st_size > 1000
    assert len(plt.get_fignums()) == before
