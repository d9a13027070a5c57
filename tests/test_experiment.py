"""oelm_core.runner: plans (studies, sweeps, the ablations), their schedulers, the launcher; and
oelm_core.notebooks: the papermill call and the notebook-parameter check. The smoke study end to
end (slow); the rest fast, or on tiny models in a few seconds.

The end-to-end study runs once per test session (``smoke_study``): the smoke study file on a tiny
story corpus, 24 steps per run, through ``python -m oelm_core run``. tests/test_notebooks.py
checks the notebooks it executed; tests/test_sweep.py the tables read back from run folders.
"""

import copy
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, run_smoke_study
from conftest import SMOKE_STEPS as STEPS
from conftest import SMOKE_STUDY as STUDY_FILE

import oelm_core.notebooks as N
import oelm_core.runner.cli as CLI
import oelm_core.runner.launch as LAUNCH
import oelm_core.runner.local as LOCAL
import oelm_core.runner.plan as PLAN
import oelm_core.runner.run as RUN
import oelm_core.runner.scheduler as SCHED
from oelm_core import VARIANTS
from oelm_core.analysis.ablations import ablation_table
from oelm_core.analysis.sweeps import run_rows, sweep_results
from oelm_core.config import ConfigError, run_config_from_dict
from oelm_core.notebooks import (
    NotebookError,
    check_notebook_parameters,
    execute_notebook,
    failed_cell,
    notebook_defaults,
)
from oelm_core.parameter_files import load_run_config, save_run_config
from oelm_core.runner import LocalScheduler, check_run_folder, load_plan, run_trainings, train_command
from oelm_core.sweep import main as sweep_main

load_study = load_plan
SWEEPS = sorted((REPO / "parameters" / "sweeps").glob("*.yaml"))
ABLATIONS = REPO / "parameters" / "ablations.yaml"


def ablation_plan(out="runs/ablations", seeds=None, only=None, overrides=None):
    """parameters/ablations.yaml as a plan: every variant x seed into OUT/<name>/seed<S>."""
    return load_plan(ABLATIONS, out, seeds=seeds, only=only, overrides=overrides)


# --- end to end -------------------------------------------------------------------------------


@pytest.mark.slow
def test_smoke_study_writes_study_json_and_runs(smoke_study):
    out, proc = smoke_study
    study = json.loads((out / "study.json").read_text())
    assert study["name"] == "smoke" and study["status"] == "completed" and study["created"]
    assert [n["name"] for n in study["notebooks"]] == ["01_theory", "02_model", "03_training", "04_analysis"]
    assert all((out / n["output"]).is_file() for n in study["notebooks"] if n["name"] != "03_training")
    assert [r["variant"] for r in study["runs"]] == ["gpt_base", "oelm_nofreeze", "oelm_freeze"]
    for r in study["runs"]:
        run_dir = out / r["run_dir"]
        assert not Path(r["run_dir"]).is_absolute() and r["seed"] == 42 and r["preset"] == "smoke"
        assert (run_dir / "best.pt").is_file() and (run_dir / "03_training.ipynb").is_file()
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["steps"] == STEPS and summary["variant"] == r["variant"]
        assert (run_dir / "loss_curve.png").is_file()
    # progress and streamed training logs reached the study's output
    assert "[smoke] step 1/4: 01_theory" in proc.stdout
    assert "[oelm_freeze_s42] step 24: train loss" in proc.stdout


@pytest.mark.slow
def test_smoke_study_results_judge_h1_to_h4_and_say_they_are_no_evidence(smoke_study):
    out, _ = smoke_study
    md = (out / "results.md").read_text()
    assert "OELM-Freeze" in md and "GPT-Base" in md and "Bits/byte" in md
    results = json.loads((out / "results.json").read_text())
    hyps = {h["id"]: h for h in results["hypotheses"]}
    assert sorted(hyps) == ["H1", "H2", "H3", "H3t", "H4"]
    assert all(hyps[h]["holds"] in (True, False) for h in ("H1", "H2", "H4"))
    # speed only where every run's summary.json records that it had its device alone
    assert all((hyps[h]["holds"] is not None) == (results["timed_alone"] is True) for h in ("H3", "H3t"))
    assert hyps["H1"]["holds"] is False  # 16,384 of 3.3M trainable: nowhere near 15%
    # 150 steps of the smoke preset: its verdicts are no evidence, and results.md says so first
    assert results["smoke_budget"] and all(h["note"] for h in hyps.values())
    assert md.splitlines()[2].startswith("**A smoke budget (a preset made for tests")
    assert len(results["table"]) == 3
    # which: final, but the samples are best.pt's: results.md says so
    assert (
        "## Samples\n\nAttention maps and samples: each group's best.pt, the weights of its lowest "
        "validation loss (its first seed that has one). The table reads the final evaluation, which may "
        "be a later step."
    ) in md
    for fig in ("jl_distortion.png", "curves.png", "attention.png"):
        assert (out / "figures" / fig).is_file(), fig


@pytest.mark.slow
def test_a_study_run_again_leaves_its_finished_trainings_alone(smoke_study, tmp_path):
    out, _ = smoke_study
    again = tmp_path / "study"
    shutil.copytree(out, again)  # a copy: the other tests read the first run's files
    files = {p: p.stat().st_mtime_ns for p in again.rglob("*") if p.suffix == ".pt" or p.name == "summary.json"}
    assert len([p for p in files if p.name == "summary.json"]) == 3
    proc = run_smoke_study(out.parent, again, "experiment.notebooks=[03_training]")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "already ended (completed at step 24)" in proc.stdout + proc.stderr
    assert {p: p.stat().st_mtime_ns for p in files} == files  # no step trained, nothing rewritten


# --- plumbing (fast) -----------------------------------------------------------------------------


def test_load_study_plans_runs_seeds_and_overrides(tmp_path):
    """Seed-major, as every plan: each run at the first seed before any at the second."""
    study = load_study(STUDY_FILE, tmp_path / "s", ["train.steps=7", "experiment.seeds=[1,2]"])
    assert [r.name for r in study.runs] == [
        "gpt_base_s1",
        "oelm_nofreeze_s1",
        "oelm_freeze_s1",
        "gpt_base_s2",
        "oelm_nofreeze_s2",
        "oelm_freeze_s2",
    ]
    assert all("train.steps=7" in r.overrides for r in study.runs)
    assert study.runs[3].run_dir == tmp_path / "s" / "runs" / "gpt_base_s2"
    assert [(r.variant, r.seed) for r in study.runs[3:]] == [("gpt_base", 2), ("oelm_nofreeze", 2), ("oelm_freeze", 2)]
    for run in study.runs:  # what each run trains (its params.yaml): the file, the sets, its folder
        trained = load_run_config(run.params, run.overrides + [f"out_dir={run.run_dir}"])
        assert run_config_from_dict(run.config) == trained and trained.name == run.name
    assert study.notebooks == ["01_theory", "02_model", "03_training", "04_analysis"]
    medium = load_study(REPO / "parameters" / "study_medium512.yaml")
    assert medium.gpus_per_run == 2 and {r.preset for r in medium.runs} == {"medium512"}


def test_load_study_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_study(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="unknown key"):
        load_study(STUDY_FILE, sets=["experiment.colour=red"])
    with pytest.raises(ConfigError, match="train.stepz"):
        load_study(STUDY_FILE, sets=["train.stepz=3"])
    with pytest.raises(ConfigError, match="experiment.notebooks"):
        load_study(STUDY_FILE, sets=["experiment.notebooks=[05_extra]"])
    # values the trainer cannot use fail when the study is read, before any notebook runs
    with pytest.raises(ConfigError, match="train.dtype must be one of"):
        load_study(STUDY_FILE, sets=["train.dtype=fp64"])


@pytest.mark.parametrize(
    "sets,message",
    [
        (["experiment.parameters.05_extra.d=3"], r"experiment.parameters names the notebook '05_extra'; choose from"),
        (
            ["experiment.parameters.01_theory.dd=3"],
            r"experiment.parameters.01_theory.dd is not a parameter of 01_theory \(did you mean d\?\); its parameters "
            r"are d, n_head",
        ),
        (
            ["experiment.parameters.04_analysis.fig_dir=3"],
            r"04_analysis.fig_dir must be None or a string \(the notebook's default is None\); got 3",
        ),
        (
            ["experiment.parameters.03_training.params=x.yaml"],
            r"03_training.params is set by the plan itself; use experiment.runs instead",
        ),
        # with GPUs per run, the plan gives each run its processes and GPUs: the smoke file's nproc
        # and cuda_visible_devices would be overwritten without a word
        (
            ["experiment.gpus_per_run=1"],
            r"experiment.parameters.03_training.nproc is set by the plan itself where experiment.gpus_per_run > 0 "
            r"\(each run gets experiment.gpus_per_run processes, one per GPU\); leave it out of "
            r"experiment.parameters.03_training",
        ),
        (
            ["experiment.gpus_per_run=2", "experiment.parameters.03_training={cuda_visible_devices: '2,3'}"],
            r"03_training.cuda_visible_devices is set by the plan itself where experiment.gpus_per_run > 0 \(each run "
            r"gets experiment.gpus_per_run GPUs of its own, of those in the experiment's CUDA_VISIBLE_DEVICES\)",
        ),
        (["experiment.gpus_per_run=two"], r"experiment.gpus_per_run should be int, got str 'two'; fix the value"),
        (["experiment.runs_per_gpu=0"], r"experiment.runs_per_gpu must be a whole number of at least 1"),
        (
            ["experiment.runs_per_gpu=3"],
            r"experiment.runs_per_gpu must be .* above 1 only with experiment.gpus_per_run "
            r">= 1 and the local launcher; got 3",
        ),
        (
            ["experiment.gpus_per_run=-1"],
            r"experiment.gpus_per_run must be a whole number of GPUs per run \(0 for "
            r"CPU\), got -1",
        ),
        (
            ["experiment.overrides=train.steps=3"],
            r"experiment.overrides should be list or dict, got str 'train.steps=3'",
        ),
        (["experiment.overrides=[3]"], r"experiment.overrides must be a list of key=value strings"),
        (["experiment.runs=[{name: a}]"], r"experiment.runs\[0\] needs a parameter file"),
        (
            ["experiment.runs=[{params: smoke/gpt_base.yaml, overide: [train.steps=3]}]"],
            r"unknown key\(s\) experiment.runs\[0\].overide; valid keys in experiment.runs\[0\]: "
            r"name, overrides, params",
        ),
        (
            ["experiment.runs=[{params: smoke/gpt_base.yaml, overrides: [3]}]"],
            r"experiment.runs\[0\].overrides must be a list of key=value strings",
        ),
        # notebook parameters of the wrong type or value: they used to pass, train every run, and
        # fail in the notebook (04_analysis.which) or name no parameter at all (01_theory.d)
        (
            ["experiment.parameters.04_analysis.which=bestt"],
            r"experiment.parameters.04_analysis.which must be one of final, best, report; got 'bestt'",
        ),
        (
            ["experiment.parameters.01_theory.d=abc"],
            r"experiment.parameters.01_theory.d must be a whole number \(int\) \(the notebook's default is 512\); "
            r"got 'abc'",
        ),
        (["experiment.parameters.01_theory.d=2.5"], r"01_theory.d must be a whole number \(int\).*got 2.5"),
        (
            ["experiment.parameters.04_analysis.max_new_tokens=true"],
            r"04_analysis.max_new_tokens must be a whole number",
        ),
        (
            ["experiment.parameters.04_analysis.max_new_tokens=null"],
            r"04_analysis.max_new_tokens must be a whole number.*got None",
        ),
        (
            ["experiment.parameters.02_model.all_variants=1"],
            r"02_model.all_variants must be true or false \(the notebook's default is True\); got 1",
        ),
        (
            ["experiment.parameters.02_model.preset=[medium512]"],
            r"02_model.preset must be a string.*got \['medium512'\]",
        ),
        (
            ["experiment.parameters.03_training.nproc=0"],
            r"03_training.nproc must be at least 1 \(one training process "
            r"at least\); got 0",
        ),
        # the plan's own keys of the wrong type: an empty notebook list used to run all four
        (["experiment.notebooks=[]"], r"experiment.notebooks must be a non-empty list of notebooks to run.*got \[\]"),
        (["experiment.notebooks=03_training"], r"experiment.notebooks should be list, got str '03_training'"),
        (["experiment.notebooks=[03_training, 03_training]"], r"experiment.notebooks lists a notebook twice"),
        (
            ["experiment.runs=smoke/gpt_base.yaml"],
            r"experiment.runs should be list or None, got str 'smoke/gpt_base.yaml'",
        ),
        (
            ["experiment.runs=[]", "experiment.notebooks=[04_analysis]"],
            r"lists no runs under experiment.runs for 04_analysis",
        ),
        (["experiment.runs=[{params: 3}]"], r"experiment.runs\[0\] needs a parameter file"),
        (
            ["experiment.runs=[{params: smoke/gpt_base.yaml, name: [a]}]"],
            r"experiment.runs\[0\].name should be str or None, got list \['a'\]",
        ),
        (
            ["experiment.seeds=[]"],
            r"experiment.seeds must be a non-empty list of whole numbers.*each parameter file's "
            r"train.seed\); got \[\]",
        ),
        (["experiment.seeds=[1, x]"], r"experiment.seeds must be a non-empty list of whole numbers.*got \[1, 'x'\]"),
        (["experiment.parameters=[]"], r"experiment.parameters should be dict, got list \[\]"),
        (
            ["experiment.parameters={01_theory: [1]}"],
            r"experiment.parameters.01_theory must map parameter names to values",
        ),
        (["experiment.name=[a]"], r"experiment.name should be str or None, got list \['a'\]"),
        (
            ["experiment.runner=thread"],
            r"experiment.runner must be one of inprocess, subprocess, notebook; got 'thread'",
        ),
        (["experiment.launcher=pbs"], r"experiment.launcher must be one of local, slurm; got 'pbs'"),
        (["experiment.layout=flat"], r"experiment.layout must be one of axes, study; got 'flat'"),
        (["experiment.keep_checkpoints=1"], r"experiment.keep_checkpoints should be bool, got int 1"),
        (
            ["experiment.variants=[gpt_base]"],
            r"experiment.layout study names each run folder runs/<run>_s<seed>: it "
            r"crosses runs and seeds alone",
        ),
        (["experiment.slurm.nodes=0"], r"experiment.slurm.nodes must be a whole number of at least 1, got 0"),
        (["experiment.slurm.poll_s=0"], r"experiment.slurm.poll_s must be a positive number of seconds, got 0"),
        (["experiment.slurm.sbatch_args=[qos=high]"], r"experiment.slurm.sbatch_args must be a list of sbatch options"),
        (
            ["experiment.slurm.partiton=gpu"],
            r"unknown key\(s\) experiment.slurm.partiton; valid keys in experiment.slurm",
        ),
    ],
)
def test_load_study_rejects_wrong_keys_and_values(sets, message):
    """Every message names the plan file, the key and what it must be."""
    with pytest.raises(ConfigError, match=message) as err:
        load_study(STUDY_FILE, sets=sets)
    assert str(STUDY_FILE) in str(err.value) or "lists no runs" in str(err.value)


def test_an_older_plan_section_is_read_as_experiment_and_says_what_to_change(tmp_path, capsys):
    """`study:` and `sweep:` files load as `experiment:` with their own defaults (a study's four
    notebooks and run folders runs/<run>_s<seed>; a sweep's three groups, seed 0, in-process
    trainings, runs/sweeps/<name>); a line says what to write instead. So do --set strings
    that name an older section."""
    old = tmp_path / "study_old.yaml"
    text = "\n".join(line for line in STUDY_FILE.read_text().splitlines() if "layout:" not in line)
    old.write_text(text.replace("experiment:", "study:").replace("    - smoke/", f"    - {REPO}/parameters/smoke/"))
    plan = load_plan(old, tmp_path / "o", ["study.seeds=[3]"])
    new = load_plan(STUDY_FILE, tmp_path / "o", ["experiment.seeds=[3]"])
    assert [(r.name, r.run_dir, r.config) for r in plan.runs] == [(r.name, r.run_dir, r.config) for r in new.runs]
    assert (plan.notebooks, plan.layout, plan.section, plan.name) == (new.notebooks, "study", "study", "smoke")
    err = capsys.readouterr().err
    assert (
        f"deprecated: {old}: the `study:` section is read as `experiment:`; rename it `experiment:` and add "
        "{layout: study} (the defaults it had)" in err
    )
    assert "deprecated: --set 'study.seeds=[3]': the plan section is `experiment:`; write experiment.seeds=[3]" in err
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        yaml.safe_dump({"sweep": {"name": "s", "key": "n_layer", "points": [{"value": 1}]}, "preset": "smoke"})
    )
    plan = load_plan(sweep)
    assert (plan.variants, plan.seeds, plan.runner, plan.out) == (
        ["gpt_base", "oelm_nofreeze", "oelm_freeze"],
        [0],
        "inprocess",
        Path("runs/sweeps/s"),
    )
    assert (
        "add {out: runs/sweeps/s, runner: inprocess, seeds: [0], variants: [gpt_base, oelm_nofreeze, "
        "oelm_freeze]} (the defaults it had)" in capsys.readouterr().err
    )
    with pytest.raises(ConfigError, match=r"needs one plan section, `experiment:`.*it has \['experiment', 'study'\]"):
        both = tmp_path / "both.yaml"
        both.write_text("experiment: {}\nstudy: {}\n")
        load_plan(both)


def test_load_study_takes_notebook_parameters_of_the_defaults_types(monkeypatch):
    study = load_study(
        STUDY_FILE,
        sets=[
            "experiment.parameters.04_analysis.which=best",
            "experiment.parameters.04_analysis.fig_dir=/tmp/figs",
            "experiment.parameters.01_theory.d=128",
            "experiment.seeds=7",
            "experiment.notebooks=[01_theory, 04_analysis]",
        ],
    )
    assert study.parameters["04_analysis"] == {"which": "best", "max_new_tokens": 30, "fig_dir": "/tmp/figs"}
    assert study.parameters["01_theory"]["d"] == 128
    assert study.notebooks == ["01_theory", "04_analysis"] and {r.seed for r in study.runs} == {7}
    # a float parameter takes a whole number too, not a string
    defaults = N.notebook_defaults
    monkeypatch.setattr(N, "notebook_defaults", lambda nb: {**defaults(nb), "scale": 0.5})
    assert (
        load_study(STUDY_FILE, sets=["experiment.parameters.01_theory.scale=2"]).parameters["01_theory"]["scale"] == 2
    )
    with pytest.raises(ConfigError, match=r"01_theory.scale must be a number \(float\)"):
        load_study(STUDY_FILE, sets=["experiment.parameters.01_theory.scale=big"])


@pytest.mark.parametrize("per_run, expected", [(1, {"0", "1"}), (2, {"0,1"})])
def test_trainings_run_side_by_side_on_the_gpus_this_process_sees(monkeypatch, tmp_path, per_run, expected):
    """Slots are GPU indices as the study numbers them; launch_training maps them for the child."""
    monkeypatch.setattr(LOCAL, "gpu_count", lambda: 2)
    monkeypatch.setattr(SCHED, "prepare_data", lambda plan, log: None)
    given = []
    monkeypatch.setattr(
        LOCAL,
        "execute_notebook",
        lambda name, out, params, prefix="", cwd=None, echo=None: given.append(
            (params["nproc"], params["cuda_visible_devices"])
        ),
    )
    study = load_study(
        STUDY_FILE, tmp_path, [f"experiment.gpus_per_run={per_run}", "experiment.parameters.03_training={}"]
    )
    rows = run_trainings(study, log=lambda line: None)
    assert len(given) == 3 and all(nproc == per_run for nproc, _ in given)
    assert {devices for _, devices in given} == expected  # 3 runs on 2 slots of 1 GPU use both
    # nothing trained here: no summary.json, each run named as failed
    assert [r["status"] for r in rows] == ["failed"] * 3 and all("no summary.json" in r["error"] for r in rows)


def test_a_plan_asking_for_more_gpus_than_the_machine_has_is_refused_before_it_runs(monkeypatch, tmp_path):
    monkeypatch.setattr(LOCAL, "gpu_count", lambda: 1)
    study = load_study(
        STUDY_FILE, tmp_path / "s", ["experiment.gpus_per_run=2", "experiment.parameters.03_training={}"]
    )
    with pytest.raises(
        SCHED.ExperimentError,
        match=r"experiment.gpus_per_run=2, but this machine has 1 GPU\(s\); set "
        r"--set experiment.gpus_per_run=0 for CPU",
    ):
        RUN.run_plan(study, log=lambda line: None)
    assert not (tmp_path / "s" / "study.json").exists()  # refused before the first step


def test_the_inprocess_runner_trains_on_one_device_at_most():
    with pytest.raises(
        ConfigError,
        match=r"runner inprocess trains in this process, on one device at most; "
        r"for experiment.gpus_per_run=2 use the runner subprocess or notebook",
    ):
        load_plan(STUDY_FILE, sets=["experiment.gpus_per_run=2"], runner="inprocess")


def fake_popen(monkeypatch) -> list:
    """subprocess.Popen records (command, keywords) and starts nothing; the list it fills."""
    import subprocess

    class Done:
        stdout = iter(())

        def wait(self):
            return 0

    launched = []
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, **kw: launched.append((cmd, kw)) or Done())
    return launched


@pytest.mark.parametrize(
    "visible, gpus, child",
    [
        ("2,3", "0", "2"),
        ("2,3", "1", "3"),
        ("5,7", "0,1", "5,7"),
        ("2,3", "", ""),
        (None, "1", "1"),
        (None, "", ""),
        ("GPU-aa, GPU-bb", "1", "GPU-bb"),
    ],
)
def test_a_training_gets_the_gpu_of_this_process_it_was_given(monkeypatch, visible, gpus, child):
    """A job confined to GPUs 2,3 (CUDA_VISIBLE_DEVICES=2,3) trained on GPUs 0 and 1: a child's
    CUDA_VISIBLE_DEVICES names the machine's devices, not this process's view of them."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)

    launched = fake_popen(monkeypatch)
    LAUNCH.launch_training("parameters/smoke/gpt_base.yaml", cuda_visible_devices=gpus, echo=lambda line: None)
    assert launched[0][1]["env"]["CUDA_VISIBLE_DEVICES"] == child


@pytest.mark.parametrize(
    "visible, gpus, message",
    [
        ("2,3", "2", r"names GPU 2, but this process sees 2 GPU\(s\) \(CUDA_VISIBLE_DEVICES=2,3\)"),
        ("", "0", r"names GPU 0, but this process sees 0 GPU\(s\)"),
        ("2,3", "GPU-aa", r"give GPU indices such as \"0\" or \"0,1\""),
    ],
)
def test_a_gpu_this_process_does_not_see_is_refused(monkeypatch, visible, gpus, message):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(ConfigError, match=message):
        LAUNCH.launch_training("parameters/smoke/gpt_base.yaml", cuda_visible_devices=gpus, echo=lambda line: None)


def test_paths_and_names_reach_the_trainer_as_written(monkeypatch, tmp_path):
    """--set values are YAML: a study folder with " #" in its path was cut at the comment, and a
    run named off or 2024 became a bool or an int that the trainer refused."""
    study = load_study(
        STUDY_FILE,
        tmp_path / "study #2 😀",
        [
            "experiment.seeds=null",
            "experiment.runs=[{params: smoke/gpt_base.yaml, name: 'off'}, "
            "{params: smoke/oelm_freeze.yaml, name: '2024'}]",
        ],
    )
    assert [r.name for r in study.runs] == ["off", "2024"]
    for run in study.runs:
        assert load_run_config(run.params, run.overrides).name == run.name
        assert run_config_from_dict(run.config).name == run.name
        # params.yaml, what the runner launches, keeps them strings too
        assert run_config_from_dict(yaml.safe_load(yaml.safe_dump(run.config))).name == run.name

    launched = fake_popen(monkeypatch)
    run = study.runs[0]
    out = LAUNCH.launch_training(run.params, run.overrides, run_dir=run.run_dir, echo=lambda line: None)
    assert out == run.run_dir.resolve() and " #2 😀" in str(out)
    sets = [launched[0][0][k + 1] for k, arg in enumerate(launched[0][0]) if arg == "--set"]
    assert load_run_config(run.params, sets).out_dir == str(out)  # what the trainer will read


def test_every_set_flag_reaches_the_study(monkeypatch, tmp_path):
    """Like train's --set: several values after one flag, and the flag given again."""
    studies = []
    monkeypatch.setattr(CLI, "run_plan", lambda plan, **kw: studies.append(plan))
    assert (
        CLI.main(
            [
                str(STUDY_FILE),
                "--out",
                str(tmp_path / "s"),
                "--set",
                "train.steps=7",
                "experiment.seeds=[1,2]",
                "--set",
                "experiment.notebooks=[03_training]",
            ]
        )
        == 0
    )
    (study,) = studies
    assert study.notebooks == ["03_training"] and {r.seed for r in study.runs} == {1, 2}
    assert all("train.steps=7" in r.overrides for r in study.runs)


@pytest.mark.parametrize(
    "failure,code,message",
    [
        (None, 2, "[run] FAILED: plan file {tmp}/nope.yaml not found"),
        (NotebookError("notebook 04_analysis failed in code cell 3"), 1, "[run] FAILED: notebook 04_analysis failed"),
        (SCHED.ExperimentError("1 of 3 training(s) did not finish"), 1, "[run] FAILED: 1 of 3 training(s)"),
        (RuntimeError("training of p.yaml exited with status 2"), 1, "[run] FAILED: training of p.yaml exited"),
        (ConfigError("data folder /x does not exist"), 2, "[run] FAILED: data folder /x does not exist"),
    ],
)
def test_run_exit_codes_are_those_of_train(monkeypatch, tmp_path, capsys, failure, code, message):
    """2: unusable input (as train and report say it), 1: a notebook or training failed; a plan
    file not found used to exit 1."""

    def run_plan(plan, **kw):
        raise failure

    monkeypatch.setattr(CLI, "run_plan", run_plan)
    study = tmp_path / "nope.yaml" if failure is None else STUDY_FILE
    assert CLI.main([str(study), "--out", str(tmp_path / "s")]) == code
    assert capsys.readouterr().err.startswith(message.format(tmp=tmp_path))


def test_a_study_file_with_bad_yaml_names_the_file_and_line(tmp_path):
    bad = tmp_path / "study_bad.yaml"
    bad.write_text("study:\n  runs: [smoke/gpt_base.yaml\n  seeds: [1]\n")
    with pytest.raises(ConfigError) as err:
        load_study(bad)
    assert str(err.value).startswith(f"{bad} is not valid YAML: expected ',' or ']', but got ':' at line 3")
    bad.write_text("- study\n")
    with pytest.raises(ConfigError, match="must hold a YAML mapping at the top level"):
        load_study(bad)
    with pytest.raises(ConfigError, match=r"^--set 'experiment.seeds=\[1': the value is not valid YAML"):
        load_study(STUDY_FILE, sets=["experiment.seeds=[1"])


def test_study_notebook_parameters_are_those_of_the_notebooks():
    assert list(notebook_defaults("03_training")) == [
        "params",
        "overrides",
        "nproc",
        "cuda_visible_devices",
        "run_dir",
        "resume",
        "progress_bar",
        "cpu_threads",
    ]
    study = load_study(STUDY_FILE, sets=["experiment.parameters.03_training.progress_bar=true"])
    assert study.parameters["03_training"]["progress_bar"] is True


def test_parameter_files_load():
    """Every shipped parameter file and plan (study, sweep, the ablations) loads, and none
    hard-codes a local data folder: online the stories come from the hub, offline from OELM_DATA."""
    from oelm_core.data import HUB_NAME

    files = sorted((REPO / "parameters").rglob("*.yaml"))
    assert {p.parent.name for p in files} == {
        "smoke",
        "medium512",
        "shapes",
        "sweeps",
        "tuning",
        "protocol",
        "parameters",
    }
    plans = [
        p
        for p in files
        if p.parent.name in ("sweeps", "tuning", "protocol")
        or p.name.startswith("ablations")
        or p.stem.startswith("study_")
    ]
    assert len(plans) == 4 + 2 + 4 + 2 + 9  # protocol: 3 sweeps, 4 studies at shapes, orthogonality, speed
    for path in files:
        if path in plans:
            cfgs = [
                run_config_from_dict(r.config)
                for smoke in (False, True)
                if path.parent.name == "sweeps" or not smoke
                for r in load_plan(path, smoke=smoke).runs
            ]
        else:
            cfgs = [load_run_config(path)]
        assert cfgs and all(cfg.data.source == HUB_NAME for cfg in cfgs), path
    cfgs = {
        v: load_run_config(REPO / "parameters" / "medium512" / f"{v}.yaml")
        for v in ("gpt_base", "oelm_nofreeze", "oelm_freeze")
    }
    for v, cfg in cfgs.items():
        t = cfg.train
        assert (cfg.variant, cfg.preset, t.steps, t.batch_size, t.lr, t.min_lr, t.warmup_steps) == (
            v,
            "medium512",
            100_000,
            8,
            3e-4,
            3e-5,
            2000,
        )
        assert (t.weight_decay, t.grad_clip, t.eval_every, t.ckpt_every) == (0.1, 1.0, 1000, 5000)


def test_train_command_single_and_torchrun():
    assert train_command("p.yaml", ["train.steps=3"])[1:] == [
        "-m",
        "oelm_core.train",
        "--params",
        "p.yaml",
        "--set",
        "train.steps=3",
    ]
    cmd = train_command("p.yaml", nproc=2)
    assert "torch.distributed.run" in cmd and "--nproc_per_node=2" in cmd and "oelm_core.train" in cmd


@pytest.mark.slow
def test_failed_notebook_names_the_cell(tmp_path, monkeypatch):
    # OELM_DATA (the Makefile exports it) overrides data.source: the run would find stories and
    # fail somewhere else, for another reason
    monkeypatch.delenv("OELM_DATA", raising=False)
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {
                "name": "bad",
                "preset": "tiny",
                "variant": "gpt_base",
                "data": {"source": str(tmp_path / "no_such_folder"), "out_dir": str(tmp_path / "data")},
            }
        )
    )
    out = tmp_path / "03.ipynb"
    with pytest.raises(NotebookError) as err:
        execute_notebook("03_training", out, {"params": str(bad), "run_dir": str(tmp_path / "run")}, cwd=REPO)
    msg = str(err.value)
    assert "notebook 03_training failed in code cell" in msg and "launch_training" in msg
    assert "RuntimeError" in msg and str(out) in msg
    assert f"data folder {tmp_path / 'no_such_folder'} does not exist" in msg
    assert failed_cell(out).startswith("code cell")


@pytest.mark.parametrize("progress, expected", [(None, True), (False, False), (True, True)])
def test_launch_training_sets_the_progress_bar_only_when_asked(monkeypatch, progress, expected):
    """Notebook 03 turns the bar off (it streams badly there); None keeps the parameter file's."""
    launched = fake_popen(monkeypatch)
    LAUNCH.launch_training("parameters/smoke/gpt_base.yaml", progress=progress, echo=lambda line: None)
    sets = [launched[0][0][k + 1] for k, arg in enumerate(launched[0][0]) if arg == "--set"]
    assert load_run_config("parameters/smoke/gpt_base.yaml", sets).train.progress is expected


# --- notebook parameters given to papermill directly ----------------------------------------------


@pytest.mark.parametrize(
    "name,values,message",
    [
        # papermill -p passes text: a list became its characters, a count a string deep in a call
        (
            "03_training",
            {"overrides": "train.steps=20"},
            r"^notebook 03_training: parameter overrides must be a list \(the notebook's default is \[\]\); got "
            r"'train.steps=20'; give a list or mapping to papermill as YAML with -y, e.g. -y 'overrides: \[...\]'$",
        ),
        (
            "03_training",
            {"nproc": "two"},
            r"^notebook 03_training: parameter nproc must be a whole number \(int\) "
            r"\(the notebook's default is 1\); got 'two'$",
        ),
        (
            "03_training",
            {"run_dir": 3},
            r"parameter run_dir must be None or a string \(the notebook's default is None\)",
        ),
        ("01_theory", {"d": "abc"}, r"^notebook 01_theory: parameter d must be a whole number \(int\).*got 'abc'$"),
        (
            "05_sweep",
            {"overrides": "train.steps=20"},
            r"parameter overrides must be a mapping \(the notebook's default is \{\}\); got 'train.steps=20'; give a "
            r"list or mapping to papermill as YAML with -y, e.g. -y 'overrides: \{...\}'",
        ),
        (
            "05_sweep",
            {"smoke": "no"},
            r"parameter smoke must be true or false \(the notebook's default is True\); got 'no'",
        ),
        ("05_sweep", {"seeds": 3}, r"parameter seeds must be None or a list \(the notebook's default is None\); got 3"),
        (
            "03_training",
            {"nproc": 0},
            r"^notebook 03_training: parameter nproc must be at least 1 \(one training process "
            r"at least\); got 0$",
        ),
        (
            "03_training",
            {"params": "missing.yaml"},
            r"^notebook 03_training: parameter params names no file: 'missing.yaml' is neither in .* "
            r"nor in .*; pass an "
            r"existing file, e.g. parameters/smoke/oelm_freeze.yaml$",
        ),
        (
            "03_training",
            {"param": "parameters/smoke/gpt_base.yaml"},
            r"^notebook 03_training: parameter param is not a parameter of 03_training \(did you mean params\?\); its "
            r"parameters are params, overrides,",
        ),
        ("04_analysis", {"which": "last"}, r"parameter which must be one of final, best, report; got 'last'"),
        # values of the right type that leave 01's checks nothing to measure, or to chance
        (
            "01_theory",
            {"d": 16},
            r"^notebook 01_theory: parameter d must be at least 32 \(the JL curve needs the target "
            r"dimensions 8 and d/2 >= 16\); got 16$",
        ),
        ("01_theory", {"n_tokens": 2}, r"parameter n_tokens must be at least 8 .*; got 2$"),
        ("01_theory", {"jl_points": 2}, r"parameter jl_points must be at least 3 .*; got 2$"),
        (
            "01_theory",
            {"d": 64, "n_head": 3},
            r"parameter n_head must divide d \(d = 64 is split into n_head equal "
            r"parts\); got n_head = 3$",
        ),
        ("01_theory", {"n_head": 5}, r"n_head must divide d \(d = 512 .*got n_head = 5$"),
        (
            "02_model",
            {"presets": "tiny"},
            r"parameter presets is not a parameter of 02_model \(did you mean preset\?\); "
            r"its parameters are preset, grad_check_preset, all_variants",
        ),
        ("02_model", {"foo": 1}, r"parameter foo is not a parameter of 02_model; its parameters are preset,"),
    ],
)
def test_notebook_parameters_of_the_wrong_type_are_named(name, values, message):
    with pytest.raises(ConfigError, match=message):
        check_notebook_parameters(name, values)


@pytest.mark.parametrize("name", ["01_theory", "02_model", "03_training", "04_analysis", "05_sweep"])
def test_a_notebooks_defaults_and_values_of_their_types_pass(name):
    defaults = notebook_defaults(name)
    check_notebook_parameters(name, defaults)
    given = {
        "03_training": {"run_dir": "/tmp/run", "overrides": ["train.steps=20"], "nproc": 2},
        "04_analysis": {"fig_dir": "figs", "which": "best"},
        "05_sweep": {"seeds": [0, 1], "variants": ["gpt_base"], "runner": "notebook", "figure_path": "f.png"},
        "01_theory": {"d": 64},
        "02_model": {"all_variants": False},
    }[name]
    assert all(defaults[key] != value for key, value in given.items())  # other values than the defaults
    check_notebook_parameters(name, given)


# --- a study run again in part ---------------------------------------------------------------------


def test_a_partial_rerun_keeps_the_record_of_the_notebooks_run_before(monkeypatch, tmp_path, capsys):
    """--set 'experiment.notebooks=[03_training]' rewrote study.json with that notebook alone, and its
    last line named results.md, the earlier call's, as if it had written it."""
    clock = iter(f"2026-01-0{day}T00:00:00+00:00" for day in range(1, 10))
    monkeypatch.setattr(RUN, "_now", lambda: next(clock))
    monkeypatch.setattr(LocalScheduler, "ready", lambda self, plan, log=None: None)
    monkeypatch.setattr(LocalScheduler, "train", lambda self, plan, **kw: [])

    written = {}

    def execute(name, out_path, parameters, prefix="", cwd=None, echo=None):
        written[name] = out_path
        if name == "04_analysis":
            (Path(parameters["out_dir"]) / "results.md").write_text("# Results\n")

    monkeypatch.setattr(RUN, "execute_notebook", execute)
    out = tmp_path / "study"
    RUN.run_plan(load_study(STUDY_FILE, out))
    assert capsys.readouterr().out.endswith(f"[smoke] done: {out}/study.json, {out}/results.md\n")
    first = json.loads((out / "study.json").read_text())["notebooks"]
    assert [(n["name"], n["executed"]) for n in first] == [
        ("01_theory", "2026-01-02T00:00:00+00:00"),
        ("02_model", "2026-01-03T00:00:00+00:00"),
        ("03_training", "2026-01-04T00:00:00+00:00"),
        ("04_analysis", "2026-01-05T00:00:00+00:00"),
    ]
    assert all(out / n["output"] == written[n["name"]] for n in first if n["name"] != "03_training")

    data = RUN.run_plan(load_study(STUDY_FILE, out, ["experiment.notebooks=[03_training]"]))
    assert capsys.readouterr().out.endswith(f"[smoke] done: {out}/study.json\n")
    assert data == json.loads((out / "study.json").read_text())
    assert data["status"] == "completed" and data["created"] == "2026-01-06T00:00:00+00:00"
    assert [(n["name"], n["executed"]) for n in data["notebooks"]] == [
        ("01_theory", "2026-01-02T00:00:00+00:00"),
        ("02_model", "2026-01-03T00:00:00+00:00"),
        ("03_training", "2026-01-07T00:00:00+00:00"),
        ("04_analysis", "2026-01-05T00:00:00+00:00"),
    ]


def test_an_older_study_json_lists_the_notebooks_it_completed_by_name(tmp_path):
    study = load_study(STUDY_FILE, tmp_path)
    (tmp_path / "study.json").write_text(
        json.dumps(
            {
                "name": "smoke",
                "created": "2025-12-01T00:00:00+00:00",
                "status": "completed",
                "notebooks": ["03_training", "04_analysis"],
            }
        )
    )
    assert RUN._earlier_notebooks(study) == {
        n: {"name": n, "executed": "2025-12-01T00:00:00+00:00"} for n in ("03_training", "04_analysis")
    }
    (tmp_path / "study.json").write_text(
        json.dumps({"name": "other", "status": "completed", "notebooks": ["03_training"]})
    )
    assert RUN._earlier_notebooks(study) == {}  # another study's folder: nothing of this one ran there


def test_the_smoke_parameter_files_train_outside_the_smoke_studys_folder():
    """`python -m oelm_core.train --params parameters/smoke/oelm_freeze.yaml` trained into
    runs/smoke/oelm_freeze, where an analysis of the smoke study folder took it for a study run."""
    study = load_study(STUDY_FILE)
    assert study.out == Path("runs/smoke")
    for path in sorted((REPO / "parameters" / "smoke").glob("*.yaml")):
        out = Path(load_run_config(path).out_dir)
        assert out == Path("runs/train") / f"smoke_{path.stem}", path
        assert study.out not in out.parents


# --- sweeps and the ablations as plans ------------------------------------------------------------


def run_sweep(path, out_root, *, smoke=False, overrides=None, runner=None, log=lambda *_: None) -> list[dict]:
    """Every run of a sweep file into out_root/<sweep>[_smoke]: the runner's rows."""
    return run_trainings(load_plan(path, out_root=out_root, smoke=smoke, overrides=overrides, runner=runner), log=log)


def test_the_four_sweeps_exist():
    assert {p.stem for p in SWEEPS} == {"a3_heads", "a4_head_dim", "a5_context", "a6_layers"}


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.stem)
def test_sweep_files_plan_valid_runs(path, tmp_path):
    sweep = load_plan(path, out_root=tmp_path)  # validates every run
    assert (sweep.section, sweep.runner, sweep.variants) == (
        "experiment",
        "inprocess",
        ["gpt_base", "oelm_nofreeze", "oelm_freeze"],
    )
    runs = sweep.runs
    assert len(runs) == len(sweep.points) * 3 * len(sweep.seeds)
    assert len({r.run_dir for r in runs}) == len(runs)
    key = {"a3_heads": "n_head", "a4_head_dim": "d_head", "a5_context": "block_size", "a6_layers": "n_layer"}[path.stem]
    for r in runs:
        cfg = run_config_from_dict(r.config).model_config()
        assert getattr(cfg, key) == r.info["value"]
        assert cfg.qk_init == ("normal" if r.info["variant"] == "gpt_base" else "qr")
        assert r.run_dir == tmp_path / path.stem / f"{key}={r.info['value']}" / r.info["variant"] / "seed0"
    smoke = load_plan(path, out_root=tmp_path, smoke=True).runs
    assert len(smoke) == 6 and all(run_config_from_dict(r.config).train.steps <= 10 for r in smoke)
    assert all(r.run_dir.parts[-4] == f"{path.stem}_smoke" and r.info["smoke"] for r in smoke)
    if path.stem == "a5_context":  # tokens per step constant along the context sweep
        assert len({r.config["train"]["batch_size"] * r.info["value"] for r in runs}) == 1


def _sweep_file(tmp_path: Path, **sweep) -> Path:
    spec = {
        "experiment": {
            "name": "t",
            "key": "n_layer",
            "variants": ["gpt_base"],
            "seeds": [0],
            "points": [{"value": 1, "set": {"model.n_layer": 1}}],
            "runner": "inprocess",
            **sweep,
        },
        "preset": "smoke",
        "out_dir": "x",
    }
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize(
    "sweep,message",
    [
        (
            {"variant": ["oelm_freeze"]},
            r"unknown key\(s\) experiment.variant; valid keys in experiment: description, "
            r"gpus_per_run, keep_checkpoints, key, launcher, layout, name, notebooks, out",
        ),
        (
            {"points": [{"value": 1, "set": {"model.n_layer": 1}}, {"value": 2, "sett": {"model.n_layer": 2}}]},
            r"unknown key\(s\) experiment.points\[1\].sett; valid keys in experiment.points\[1\]: set, value",
        ),
        ({"points": [{"value": 2, "set": "model.n_layer=2"}]}, r"experiment.points\[0\].set should be dict, got str"),
        ({"points": [{"set": {"model.n_layer": 2}}]}, r"experiment.points must be a non-empty list of \{value: v"),
        ({"points": []}, r"experiment.points must be a non-empty list of \{value: v"),
        ({"key": None}, r"a sweep axis needs both experiment.key \(the swept value's name\) and experiment.points"),
        (
            {"smoke": {"sets": {"train.steps": 2}}},
            r"unknown key\(s\) experiment.smoke.sets; valid keys in experiment.smoke: points, set",
        ),
        ({"smoke": {"points": [{"value": 1, "st": {}}]}}, r"unknown key\(s\) experiment.smoke.points\[0\].st"),
        ({"smoke": "yes"}, r"experiment.smoke must be a mapping of keys to values, got str"),
        # values the trainer cannot use fail when the file is read, before the first run
        ({"points": [{"value": 1, "set": {"train.dtype": "fp64"}}]}, r"train.dtype must be one of"),
    ],
)
def test_load_sweep_rejects_wrong_keys_and_values(tmp_path, sweep, message):
    with pytest.raises(ConfigError, match=message):
        load_plan(_sweep_file(tmp_path, **sweep))


@pytest.mark.parametrize(
    "sweep,message",
    [
        (
            {"seeds": ["a"]},
            r"experiment.seeds must be a non-empty list of whole numbers, e.g. \[0\] or \[0, 1\] "
            r"\(leave the key out for each parameter file's train.seed\); got \['a'\]",
        ),
        ({"seeds": [True]}, r"experiment.seeds must be a non-empty list of whole numbers"),
        ({"seeds": []}, r"experiment.seeds must be a non-empty list of whole numbers"),
        ({"seeds": "0"}, r"experiment.seeds should be list or int or None, got str '0'"),
        ({"variants": "gpt_base"}, r"experiment.variants should be list or None, got str 'gpt_base'"),
        (
            {"variants": [3]},
            r"experiment.variants\[0\] needs a variant name: write it as one, or as \{name: NAME, "
            r"variant: VARIANT, set: \{...\}\}; got 3",
        ),
        ({"variants": []}, r"experiment.variants must be a non-empty list of variant names"),
        ({"variants": [{"name": "x"}]}, r"experiment.variants\[0\] needs a variant name"),
        (
            {"variants": ["gpt_base", "oelm_frezee"]},
            r"experiment.variants has unknown variant\(s\) \['oelm_frezee'\]; choose from",
        ),
        ({"variants": ["gpt_base", {"variant": "gpt_base"}]}, r"experiment.variants names a variant twice"),
    ],
)
def test_load_sweep_requires_lists_of_seeds_and_variants(tmp_path, sweep, message):
    path = _sweep_file(tmp_path, **sweep)
    with pytest.raises(ConfigError, match=message) as err:
        load_plan(path)
    assert str(path) in str(err.value)


def test_one_seed_may_be_given_as_a_whole_number(tmp_path):
    assert [r.seed for r in load_plan(_sweep_file(tmp_path, seeds=3)).runs] == [3]


def test_load_sweep_from_the_notebooks_folder(monkeypatch):
    """05_sweep's default sweep_file is relative to the repository root; a caller elsewhere (a
    kernel in notebooks/ before its setup cell) finds it too."""
    monkeypatch.chdir(REPO / "notebooks")
    assert load_plan("parameters/sweeps/a6_layers.yaml").name == "a6_layers"


def test_ablation_plan_is_seed_major_and_complete(tmp_path):
    plan = ablation_plan(out=tmp_path)
    runs = plan.runs
    stems = [r.info["label"] for r in runs]
    assert len(runs) == 30 and stems[:15] == stems[15:] and [r.info["seed"] for r in runs[:15]] == [0] * 15
    # every variant but the orthogonality study's ill-conditioned control, which came after them
    assert {r.info["variant"] for r in runs} == set(VARIANTS) - {"oelm_freeze_illcond"}
    assert (plan.runner, plan.keep_checkpoints, plan.records) == ("inprocess", False, False)
    for r in runs:
        cfg = run_config_from_dict(r.config)
        assert cfg.preset == "mini" and cfg.train.batch_size == 32 and not cfg.train.compile
        assert Path(cfg.out_dir) == r.run_dir == tmp_path / r.info["label"] / f"seed{r.info['seed']}"
        schedule = {"progressive": {400: "all"}, "progressive_layerwise": {200: [3], 400: [2], 600: [0, 1]}}
        assert cfg.train.unfreeze_schedule == schedule.get(r.info["label"], {}), r.name
    assert [r.name for r in ablation_plan(out=tmp_path, seeds=[3], only=["oelm_poet", "progressive"]).runs] == [
        "progressive/seed3",
        "oelm_poet/seed3",
    ]
    with pytest.raises(
        ConfigError,
        match=r"--only names \['nope'\], which .*ablations.yaml does not plan; its "
        r"variants are \['gpt_base', 'oelm_nofreeze'",
    ):
        ablation_plan(out=tmp_path, only=["nope"])
    with pytest.raises(ConfigError, match="train.dtype must be one of"):
        ablation_plan(out=tmp_path, overrides={"train.dtype": "fp64"})


# results/<folder> -> the plans that trained its runs (results/README.md names the same)
RESULT_PLANS = {
    "ablations": "parameters/ablations.yaml",
    "ablations_medium512": "parameters/ablations_medium512.yaml",
    "protocol_medium512": "parameters/protocol/study_medium512.yaml",
    "protocol_orthogonality_medium512": "parameters/protocol/orthogonality_medium512.yaml",
    "protocol_speed_medium512": "parameters/protocol/speed_medium512.yaml",
    "protocol_tune_medium512": "parameters/protocol/tune_medium512.yaml",
    "protocol_d256": "parameters/protocol/study_d256.yaml",
    "protocol_d384": "parameters/protocol/study_d384.yaml",
    "protocol_d768": "parameters/protocol/study_d768.yaml",
    "protocol_tune_shapes": ("parameters/protocol/tune_shapes.yaml", "parameters/protocol/tune_d768.yaml"),
    "tune_medium512": "parameters/tuning/medium512.yaml",
    "tune_mini": "parameters/tuning/mini.yaml",
    "tuned_medium512": "parameters/study_tuned_medium512.yaml",
    "tuned_mini": "parameters/study_tuned_mini.yaml",
}
# results/ folders of reports over other folders' runs, holding no runs of their own
REPORT_FOLDERS = {"protocol_scaling"}


@pytest.mark.parametrize("folder", sorted(RESULT_PLANS))
def test_each_committed_result_is_what_its_plan_trains(folder):
    """Every committed run folder of results/FOLDER is one its plan plans there, trained with the
    planned settings (the plan run into that folder would skip it): the plan file reproduces the
    result. parameters/ablations_medium512.yaml said lr 3e-4 while its runs trained at 2e-3."""
    from oelm_core.parameter_files import read_yaml
    from oelm_core.run_settings import trained_settings

    committed = REPO / "results" / folder
    plans = RESULT_PLANS[folder] if isinstance(RESULT_PLANS[folder], tuple) else (RESULT_PLANS[folder],)
    planned = {r.run_dir: r for p in plans for r in load_plan(REPO / p, committed).runs}
    folders = sorted(p.parent for p in committed.rglob("config.yaml"))
    assert folders and all(f in planned for f in folders), [str(f) for f in folders if f not in planned][:3]
    for f in folders:
        check_run_folder(planned[f])
        assert trained_settings(read_yaml(f / "config.yaml")) == trained_settings(planned[f].config)
    assert {p.name for p in (REPO / "results").iterdir() if p.is_dir()} == set(RESULT_PLANS) | REPORT_FOLDERS
    index = (REPO / "results" / "README.md").read_text()
    assert all(f"`{p}`" in index for p in plans) and f"`{folder}/`" in index
    assert all(f"`{f}/`" in index for f in REPORT_FOLDERS)


def test_the_timed_rerun_of_the_medium512_study_ended_on_its_losses_bit_for_bit():
    """results/protocol_speed_medium512 trained protocol_medium512's dropout-0.1 runs again, each alone
    on a GPU, on another host at another commit: with train.deterministic every run's losses, at every
    log window and evaluation, are the study's to the last bit, and only the timing differs."""
    rerun = REPO / "results" / "protocol_speed_medium512" / "runs"
    study = REPO / "results" / "protocol_medium512" / "runs"

    def losses(run):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
        return [{k: v for k, v in row.items() if "loss" in k} for row in rows]

    runs = sorted(p for p in rerun.iterdir() if p.is_dir())
    assert len(runs) == 15
    for run in runs:
        first, second = (
            json.loads((study / run.name / "summary.json").read_text()),
            json.loads((run / "summary.json").read_text()),
        )
        assert second["provenance"]["occupancy"]["timed_alone"] is True
        assert first["provenance"]["code"]["commit"] != second["provenance"]["code"]["commit"]
        assert losses(run) == losses(study / run.name) and len(losses(run)) > 60, run.name
        assert {k: v for k, v in second.items() if "loss" in k} == {k: v for k, v in first.items() if "loss" in k}


def test_the_committed_mini_ablations_tabulate_from_runs_with_and_without_their_place_in_the_plan():
    """results/ablations' 26 older runs have no sweep_point.json (their folders name them), its two
    progressive re-runs one of an older form (key "ablation"): the table reads both, one row per
    variant entry of parameters/ablations.yaml, two seeds each."""
    from oelm_core.parameter_files import read_yaml

    committed = REPO / "results" / "ablations"
    assert len(list(committed.rglob("sweep_point.json"))) == 4
    rows = {r["label"]: r for r in ablation_table(committed, spectrum=False)["rows"]}
    assert list(rows) == [
        v["name"] if isinstance(v, dict) else v for v in read_yaml(ABLATIONS)["experiment"]["variants"]
    ]
    assert all(r["seeds"] == 2 for r in rows.values()) and rows["gpt_base"]["loss_gap_pct"] == 0


def _tiny_sweep(tmp_path: Path, story_folder: Path, **sweep) -> Path:
    """A sweep file of one 1-layer point, 3 steps on CPU, with a smoke section of 2 steps."""
    spec = {
        "sweep": {
            "name": "t",
            "key": "n_layer",
            "variants": ["gpt_base"],
            "seeds": [0],
            "points": [{"value": 1, "set": {"model.n_layer": 1}}],
            "smoke": {"set": {"train.steps": 2, "train.eval_every": 2, "train.ckpt_every": 2}},
            **sweep,
        },
        "name": "t",
        "out_dir": "x",
        "preset": "smoke",
        "model": {"block_size": 16},
        "data": {"source": str(story_folder), "out_dir": str(tmp_path / "data")},
        "train": {
            "steps": 3,
            "batch_size": 2,
            "warmup_steps": 1,
            "eval_every": 3,
            "eval_batches": 1,
            "ckpt_every": 3,
            "log_every": 1,
            "progress": False,
            "device": "cpu",
        },
    }
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_a_full_sweep_after_the_smoke_sweep_trains_its_own_runs(tmp_path, story_folder, monkeypatch, capsys):
    """The smoke sweep into the same out_root must neither stand in for the full runs nor show
    up in the full sweep's table."""
    monkeypatch.setenv("OELM_DATA", str(story_folder))
    path, out = _tiny_sweep(tmp_path, story_folder), tmp_path / "runs"
    smoke = run_sweep(path, out, smoke=True)
    full = run_sweep(path, out)
    assert [r["status"] for r in smoke] == [r["status"] for r in full] == ["completed"], (smoke, full)
    assert Path(smoke[0]["out_dir"]) == out / "t_smoke" / "n_layer=1" / "gpt_base" / "seed0"
    assert Path(full[0]["out_dir"]) == out / "t" / "n_layer=1" / "gpt_base" / "seed0"
    assert json.loads((Path(full[0]["out_dir"]) / "summary.json").read_text())["steps"] == 3
    assert json.loads((Path(smoke[0]["out_dir"]) / "summary.json").read_text())["steps"] == 2
    res = sweep_results(out, "t", smoke=False)
    assert [(r["smoke"], r["steps"]) for r in res["runs"]] == [(False, 3)]
    # The CLI's table after a full sweep shows the full run alone (the smoke one lost 2 steps in).
    capsys.readouterr()
    assert sweep_main(["run", str(path), "--out", str(out)]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| t |")]
    assert len(rows) == 1 and (out / "t" / "sweep.png").is_file()


def test_a_run_folder_trained_with_other_settings_is_refused(tmp_path, story_folder):
    """A folder already holding a finished run of other settings must not be skipped as if it
    were the planned run; settings that only say where the run executes may differ."""
    path = _tiny_sweep(tmp_path, story_folder)
    (run,) = load_plan(path, out_root=tmp_path / "runs").runs
    run.run_dir.mkdir(parents=True)
    trained = copy.deepcopy(run.config)
    trained["train"].update(steps=2, device="cuda", stop_after=1)
    save_run_config(run_config_from_dict(trained), run.run_dir / "config.yaml")
    (run.run_dir / "summary.json").write_text(json.dumps({"status": "completed", "steps": 2}))
    with pytest.raises(ConfigError) as err:
        run_sweep(path, tmp_path / "runs")
    message = str(err.value)
    assert message.startswith(
        f"{run.run_dir} holds a run trained with other settings than planned "
        f"(train.steps: 2 -> 3); train into another folder"
    )
    assert f"delete {run.run_dir}" in message
    assert not (run.run_dir / "params.yaml").exists()  # the folder is left as it was
    # The same run, asked for with its own steps, is the finished run: skipped.
    again = run_sweep(path, tmp_path / "runs", overrides={"train.steps": 2})
    assert [r["status"] for r in again] == ["skipped"]


def test_ablations_default_to_the_ignored_runs_folder():
    """results/ holds the committed results; a default run there would skip them all and rewrite
    their table."""
    assert ablation_plan(only=["gpt_base"], seeds=(0,)).runs[0].run_dir == Path("runs/ablations/gpt_base/seed0")
    assert load_plan(ABLATIONS).out == Path("runs/ablations")


def test_an_ablation_set_cut_by_its_budget_goes_on_where_it_stopped(tmp_path, story_folder, monkeypatch):
    """The first call's time budget runs out after one run; the second call skips that finished
    run, trains the one not started, and each finished run keeps best.pt but not its ckpt/."""
    monkeypatch.setenv("OELM_DATA", str(story_folder))
    plan_file = tmp_path / "ablations.yaml"
    plan_file.write_text(
        yaml.safe_dump(
            {
                "experiment": {
                    "name": "ablations",
                    "variants": ["gpt_base", "oelm_freeze"],
                    "seeds": [0],
                    "runner": "inprocess",
                    "keep_checkpoints": False,
                },
                "preset": "smoke",
                "variant": "gpt_base",
                "model": {"n_layer": 1, "block_size": 16},
                "data": {"out_dir": str(tmp_path / "data")},
                "train": {
                    "steps": 3,
                    "batch_size": 2,
                    "warmup_steps": 1,
                    "eval_every": 3,
                    "eval_batches": 1,
                    "ckpt_every": 3,
                    "log_every": 1,
                    "progress": False,
                    "device": "cpu",
                },
            }
        )
    )
    out = tmp_path / "runs"
    lines: list[str] = []
    first = run_trainings(load_plan(plan_file, out), budget_s=1e-3, log=lines.append)
    assert [(r["label"], r["status"]) for r in first] == [("gpt_base", "completed"), ("oelm_freeze", "not started")]
    # each training's end is logged with the process's whole time, as its row has it
    ends = [line for line in lines if ": completed after " in line]
    assert [line.split("] ", 1)[1] for line in ends] == [f"gpt_base/seed0: completed after {first[0]['wall_s']:.0f}s"]
    again = run_trainings(load_plan(plan_file, out), log=lambda *_: None)
    assert [(r["label"], r["status"]) for r in again] == [("gpt_base", "skipped"), ("oelm_freeze", "completed")]
    for label in ("gpt_base", "oelm_freeze"):
        run_dir = out / label / "seed0"
        assert (run_dir / "best.pt").is_file() and not (run_dir / "ckpt").exists()
        assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3


@pytest.mark.parametrize("budget", [-1, float("nan"), float("inf")])
def test_a_budget_that_is_no_number_of_seconds_is_refused(budget):
    with pytest.raises(
        ConfigError,
        match=r"--budget-s must be a number of seconds after which no training starts, "
        r"or 0 for no budget; got",
    ):
        LocalScheduler(budget)


def test_a_tiny_sweep_really_trains(tmp_path, story_folder, monkeypatch):
    """One point, two variants, a few steps of a tiny model: in-process training end to end."""
    monkeypatch.setenv("OELM_DATA", str(story_folder))
    _tiny_sweep(tmp_path, story_folder, variants=["gpt_base", "oelm_poet"])
    status = run_sweep(tmp_path / "t.yaml", tmp_path / "runs")
    assert [r["status"] for r in status] == ["completed", "completed"], status
    res = sweep_results(tmp_path / "runs", "t")
    assert len(res["rows"]) == 2 and all(r["val_loss"] and r["val_loss"] > 0 for r in res["rows"])
    # A second call skips the completed runs.
    again = run_sweep(tmp_path / "t.yaml", tmp_path / "runs")
    assert [r["status"] for r in again] == ["skipped", "skipped"]
    # The POET run's best checkpoint still has an orthogonal spectrum.
    poet = [r for r in run_rows(tmp_path / "runs") if r["variant"] == "oelm_poet"]
    assert poet and poet[0]["spectrum_err"] is not None and poet[0]["spectrum_err"] < 1e-4


@pytest.mark.parametrize(
    "runner",
    ["inprocess", pytest.param("subprocess", marks=pytest.mark.slow), pytest.param("notebook", marks=pytest.mark.slow)],
)
def test_an_interrupted_sweep_resumes_and_finished_runs_are_skipped(tmp_path, story_folder, monkeypatch, runner):
    """A run cut short (here: paused by stop_after, leaving a checkpoint as a killed run does)
    continues from its checkpoint on the next call; an early-stopped run counts as done."""
    monkeypatch.setenv("OELM_DATA", str(story_folder))
    spec = {
        "sweep": {
            "name": "t",
            "key": "n_layer",
            "variants": ["gpt_base"],
            "seeds": [0],
            "points": [{"value": 1, "set": {"model.n_layer": 1}}],
        },
        "name": "t",
        "out_dir": "x",
        "preset": "smoke",
        "model": {"block_size": 16},
        "data": {"out_dir": str(tmp_path / "data")},
        "train": {
            "steps": 4,
            "batch_size": 2,
            "warmup_steps": 1,
            "eval_every": 2,
            "eval_batches": 1,
            "ckpt_every": 2,
            "log_every": 1,
            "progress": False,
            "device": "cpu",
        },
    }
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(spec))
    quiet = {"runner": runner}
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


def _planned_params(monkeypatch) -> list[dict]:
    """The parameters of every run the sweep CLI starts; nothing trains."""
    import oelm_core.sweep as S

    planned = []

    def run_trainings(plan, **kw):
        planned.extend(run.config for run in plan.runs)
        return [{**run.info, "status": "completed", "wall_s": 0.0, "out_dir": str(run.run_dir)} for run in plan.runs]

    monkeypatch.setattr(S, "run_trainings", run_trainings)
    return planned


@pytest.mark.parametrize("command", ["run", "ablations"])
def test_every_set_flag_reaches_the_runs(tmp_path, monkeypatch, capsys, command):
    """--set given twice kept only the second, silently; train's CLI takes both (and several
    values after one --set)."""
    planned = _planned_params(monkeypatch)
    head = (
        [command, str(_sweep_file(tmp_path))] if command == "run" else [command, "--only", "gpt_base", "--seeds", "0"]
    )
    sets = ["--set", "train.steps=5", "train.warmup_steps=1", "--set", "train.lr=0.01"]
    assert sweep_main(head + ["--out", str(tmp_path / "out")] + sets) == 0
    assert [{k: p["train"].get(k) for k in ("steps", "warmup_steps", "lr")} for p in planned] == [
        {"steps": 5, "warmup_steps": 1, "lr": 0.01}
    ]


def test_yaml_errors_in_sweep_files_and_sets_name_the_file_or_the_set(tmp_path, monkeypatch, capsys):
    """PyYAML's traceback named neither the file nor the --set."""
    _planned_params(monkeypatch)
    bad = tmp_path / "bad.yaml"
    bad.write_text("experiment:\n  name: t\n  variants: [gpt_base\n  key: n_layer\n")
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(str(bad))} is not valid YAML: expected ',' or ']', but "
        rf"got ':' at line 4",
    ):
        load_plan(bad)
    assert sweep_main(["run", str(bad)]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"error: {bad} is not valid YAML")
    assert sweep_main(["run", str(_sweep_file(tmp_path)), "--out", str(tmp_path / "out"), "--set", "train.lr=[1"]) == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .startswith("error: --set 'train.lr=[1': the value is not valid YAML (expected ',' or ']'")
    )
    broken, plan_file = tmp_path / "a.yaml", tmp_path / "plan.yaml"
    broken.write_text("variant: gpt_base\nmodel: {n_layer: 2\n")
    plan_file.write_text(yaml.safe_dump({"experiment": {"runs": [str(broken)]}}))
    assert sweep_main(["ablations", "--plan", str(plan_file), "--out", str(tmp_path / "abl")]) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith(f"error: {broken} is not valid YAML")
    assert CLI.main([str(plan_file)]) == 2
    assert capsys.readouterr().err.startswith(f"[run] FAILED: {broken} is not valid YAML")
    # a run folder whose config.yaml is broken is refused, naming it
    (run,) = load_plan(_sweep_file(tmp_path), out_root=tmp_path / "out").runs
    run.run_dir.mkdir(parents=True)
    (run.run_dir / "config.yaml").write_text("train: {steps: 3\n")
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(str(run.run_dir))} holds a run whose config.yaml cannot "
        rf"be read \({re.escape(str(run.run_dir / 'config.yaml'))} is not valid",
    ):
        run_sweep(_sweep_file(tmp_path), tmp_path / "out")


def test_an_experiment_plan_crosses_every_axis_seed_first(tmp_path):
    """runs x variants x a sweep axis x seeds, seed outermost; a folder part per axis; the
    settings in their order: the plan's, the run's, the point's, the variant's, the caller's."""
    plan_file = tmp_path / "plan.yaml"
    plan_file.write_text(
        yaml.safe_dump(
            {
                "experiment": {
                    "name": "grid",
                    "runs": [
                        str(REPO / "parameters" / "smoke" / "gpt_base.yaml"),
                        {
                            "params": str(REPO / "parameters" / "smoke" / "oelm_freeze.yaml"),
                            "name": "lr",
                            "overrides": ["train.lr=0.0005", "train.steps=7"],
                        },
                    ],
                    "variants": [
                        "gpt_base",
                        {
                            "name": "late",
                            "variant": "oelm_freeze",
                            "set": {"train.unfreeze_schedule": {4: "all"}, "train.steps": 9},
                        },
                    ],
                    "key": "n_layer",
                    "points": [
                        {"value": 1, "set": {"model.n_layer": 1, "train.steps": 5}},
                        {"value": 2, "set": {"model.n_layer": 2}},
                    ],
                    "seeds": [3, 4],
                    "overrides": ["train.steps=3", "train.batch_size=2"],
                }
            }
        )
    )
    plan = load_plan(plan_file, tmp_path / "out", ["train.batch_size=4"])
    assert (plan.section, plan.runner, plan.notebooks, plan.records) == (
        "experiment",
        "notebook",
        ["03_training"],
        True,
    )
    assert len(plan.runs) == 2 * 2 * 2 * 2 and [r.seed for r in plan.runs] == [3] * 8 + [4] * 8
    assert [r.name for r in plan.runs[:4]] == [
        "n_layer=1/gpt_base/gpt_base/seed3",
        "n_layer=1/gpt_base/late/seed3",
        "n_layer=1/lr/gpt_base/seed3",
        "n_layer=1/lr/late/seed3",
    ]
    assert plan.runs[-1].run_dir == tmp_path / "out" / "n_layer=2" / "lr" / "late" / "seed4"
    by_name = {(r.name, r.seed): run_config_from_dict(r.config) for r in plan.runs}
    first = by_name[("n_layer=1/gpt_base/gpt_base/seed3", 3)]
    assert (first.model_config().n_layer, first.train.steps, first.train.batch_size, first.variant) == (
        1,
        5,
        4,
        "gpt_base",
    )
    late = by_name[("n_layer=2/lr/late/seed4", 4)]
    assert (late.model_config().n_layer, late.train.steps, late.train.lr, late.variant, late.train.seed) == (
        2,
        9,
        0.0005,
        "oelm_freeze",
        4,
    )
    assert late.train.unfreeze_schedule == {4: "all"} and late.out_dir == str(plan.runs[-1].run_dir)
    assert plan.runs[-1].info == {
        "sweep": "grid",
        "key": "n_layer",
        "value": 2,
        "variant": "oelm_freeze",
        "seed": 4,
        "label": "late",
        "smoke": False,
    }


@pytest.mark.parametrize("value", ["off", "2024", "a #b", "x: y", "", None, True, 3, 0.5, [1, "2"], {400: "all"}])
def test_set_strings_carry_values_as_written(value):
    """A value of a plan's {dotted key: value} reaches the run as itself: YAML would read a bare
    off as false, 2024 as a number and cut "a #b" at the comment."""
    from oelm_core.parameter_files import apply_overrides

    assert apply_overrides({}, [f"k={PLAN.yaml_value(value)}"]) == {"k": value}


def test_the_run_cli_hands_its_options_to_the_plan(monkeypatch, tmp_path):
    plans = []
    monkeypatch.setattr(CLI, "run_plan", lambda plan, **kw: plans.append((plan, kw)))
    assert (
        CLI.main(
            [
                str(REPO / "parameters" / "ablations.yaml"),
                "--out",
                str(tmp_path),
                "--only",
                "oelm_poet",
                "gpt_base",
                "--set",
                "experiment.seeds=[5]",
                "train.steps=4",
                "--runner",
                "subprocess",
                "--keep-checkpoints",
                "--budget-s",
                "60",
            ]
        )
        == 0
    )
    ((plan, kw),) = plans
    assert [r.name for r in plan.runs] == ["gpt_base/seed5", "oelm_poet/seed5"] and kw == {"budget_s": 60.0}
    assert (plan.runner, plan.keep_checkpoints, plan.out) == ("subprocess", True, tmp_path)
    assert all(run_config_from_dict(r.config).train.steps == 4 for r in plan.runs)


def test_a_notebooks_parameters_are_checked_before_a_kernel_starts(tmp_path):
    with pytest.raises(ConfigError, match=r"^notebook 01_theory: parameter d must be a whole number"):
        execute_notebook("01_theory", tmp_path / "01.ipynb", {"d": "abc"})
    assert not (tmp_path / "01.ipynb").exists()


def test_notebook_output_reaches_the_log_as_whole_prefixed_lines():
    lines = []
    sink = N._Lines("  [run] ", lines.append)
    for chunk in ("step 1: loss 3", ".2\nstep 2", ": loss 3.1\n\n", "10%\r50%\r100%\n", "last"):
        sink.write(chunk)
    sink.close()
    assert lines == ["  [run] step 1: loss 3.2", "  [run] step 2: loss 3.1", "  [run] 100%", "  [run] last"]


def test_a_plan_narrowed_to_its_trainings_does_not_open_the_other_notebooks(monkeypatch):
    """On a GPU image without nbformat, --set 'experiment.notebooks=[03_training]' failed on
    04_analysis's parameters, which the narrowed plan never runs; they are still checked when
    their notebook is in the plan."""
    opened = []
    monkeypatch.setattr(PLAN, "check_notebook_parameters", lambda name, values, where=None: opened.append(name))
    plan = load_plan(REPO / "parameters/study_tuned_medium512.yaml", sets=["experiment.notebooks=[03_training]"])
    assert plan.parameters["04_analysis"] == {"which": "best", "max_new_tokens": 60} and opened == ["03_training"]
    opened.clear()
    load_plan(REPO / "parameters/study_tuned_medium512.yaml")
    assert opened == ["03_training", "04_analysis"]


# --- nothing lost, nothing silent (issue 44) ---------------------------------------------------------


def test_the_first_cell_names_what_papermill_injected_that_the_notebook_does_not_declare():
    """The kernel's globals after papermill's injected cell (IPython keeps every executed cell in
    In): a misspelt name is refused with the close match, and every problem is named at once."""
    injected = '# Parameters\nparam = "parameters/smoke/gpt_base.yaml"\nnproc = 0\nparams = "missing.yaml"\n'
    namespace = {
        **notebook_defaults("03_training"),
        "param": "parameters/smoke/gpt_base.yaml",
        "nproc": 0,
        "params": "missing.yaml",
        "In": ["", "params = 'x'", injected, "check_kernel_parameters(...)"],
    }
    assert N.injected_names(namespace) == ["param", "nproc", "params"]
    with pytest.raises(ConfigError) as err:
        N.check_kernel_parameters("03_training", namespace)
    lines = str(err.value).splitlines()
    assert lines[0].startswith(
        "notebook 03_training: parameter param is not a parameter of 03_training (did you mean params?)"
    )
    assert lines[1] == "notebook 03_training: parameter nproc must be at least 1 (one training process at least); got 0"
    assert lines[2].startswith("notebook 03_training: parameter params names no file: 'missing.yaml'")
    # run in JupyterLab (nothing injected), the declared parameters alone are checked
    N.check_kernel_parameters("03_training", {**notebook_defaults("03_training"), "In": ["", "x = 1"], "x": 1})


def _tiny_plan(tmp_path: Path, story_folder: Path, steps: int = 3) -> Path:
    """A plan of one tiny CPU training on the test corpus, in this process."""
    plan = tmp_path / "plan.yaml"
    plan.write_text(
        yaml.safe_dump(
            {
                "experiment": {"name": "tiny", "runner": "inprocess"},
                "name": "tiny",
                "preset": "smoke",
                "variant": "gpt_base",
                "model": {"n_layer": 1, "block_size": 16},
                "data": {"source": str(story_folder), "out_dir": str(tmp_path / "data")},
                "train": {
                    "steps": steps,
                    "batch_size": 2,
                    "warmup_steps": 1,
                    "eval_every": steps,
                    "eval_batches": 1,
                    "ckpt_every": steps,
                    "log_every": 1,
                    "progress": False,
                    "device": "cpu",
                },
            }
        )
    )
    return plan


def _run(*args: str, cwd: Path, env: dict | None = None, popen: bool = False):
    cmd = [sys.executable, "-m", "oelm_core", "run", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    if popen:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_a_second_runner_into_a_plans_folder_is_refused_before_anything_runs(tmp_path, story_folder):
    """Two studies started into one folder both trained, met each other's per-run locks and both
    failed, the first without its analysis. The second now stops at once, naming the first."""
    plan, out = _tiny_plan(tmp_path, story_folder, steps=6), tmp_path / "out"
    first = _run(str(plan), "--out", str(out), cwd=tmp_path, popen=True)
    lines = []
    for line in first.stdout:  # the first holds the folder once it trains
        lines.append(line)
        if "training 1/1" in line:
            break
    os.kill(first.pid, signal.SIGSTOP)  # and keeps holding it while the second starts
    try:
        second = _run(str(plan), "--out", str(out), cwd=tmp_path)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    rest, _ = first.communicate(timeout=300)
    assert first.returncode == 0, "".join(lines) + rest
    assert second.returncode == 2
    assert second.stderr.startswith(
        f"[run] FAILED: another process is writing here (pid {first.pid}): {out.resolve()} is the folder of a plan"
    ), second.stderr
    assert "preparing data" not in second.stdout and "step 1/1" not in second.stdout
    assert json.loads((out / "tiny" / "summary.json").read_text())["steps"] == 6  # the first's run, whole


@pytest.mark.parametrize("budget", ["-1", "nan"])
def test_a_budget_of_no_seconds_is_refused_before_anything_runs(tmp_path, capsys, budget):
    """--budget-s -1 was taken: the study ran its notebooks, then reported its trainings "not started"."""
    assert CLI.main([str(STUDY_FILE), "--out", str(tmp_path / "out"), "--budget-s", budget]) == 2
    assert capsys.readouterr().err.startswith(
        f"[run] FAILED: --budget-s must be a number of seconds after which "
        f"no training starts, or 0 for no budget; got {float(budget)}"
    )
    assert not (tmp_path / "out").exists()


def test_offline_without_data_a_plan_stops_before_its_first_notebook_naming_both_ways(tmp_path):
    """make study offline without a data folder ran notebooks 01 and 02 (25-37 s) and then failed
    with a message about the tokenizer alone. The data and the tokenizer are now checked before
    the first notebook, and the message names the hub (online) and OELM_DATA (offline)."""
    (tmp_path / "no_cache").mkdir()
    env = {"TIKTOKEN_CACHE_DIR": str(tmp_path / "no_cache"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    os_env = {k: v for k, v in os.environ.items() if k != "OELM_DATA"}
    cmd = [
        sys.executable,
        "-m",
        "oelm_core",
        "run",
        str(STUDY_FILE),
        "--out",
        str(tmp_path / "out"),
        "--set",
        f"data.out_dir={tmp_path / 'data'}",
    ]
    t0 = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=tmp_path, env={**os_env, **env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "step 1/4" not in proc.stdout and not (tmp_path / "out" / "notebooks").exists()
    assert "OELM_DATA" in proc.stderr and "Hugging Face hub" in proc.stderr and "TIKTOKEN_CACHE_DIR" in proc.stderr
    assert time.monotonic() - t0 < 120


def test_a_runner_the_plan_does_not_know_is_named_with_the_choices():
    """05_sweep's `runner` parameter is checked by the plan it loads (the notebook's own table no
    longer repeats the runner's choices)."""
    with pytest.raises(
        ConfigError,
        match=r"a6_layers.yaml: experiment.runner must be one of inprocess, subprocess, "
        r"notebook; got 'in-process'",
    ):
        load_plan(REPO / "parameters" / "sweeps" / "a6_layers.yaml", runner="in-process")


def test_trainings_side_by_side_share_the_cores_out(monkeypatch):
    """Twelve trainings to a 32-core host each start 2 CPU threads (not 32: twelve torches of 32
    threads made the orthogonal Q/K's QR the slowest part of a run's start-up); one training, or
    an OMP_NUM_THREADS the caller set, is left alone; the launch passes the count to the child."""
    import os

    from oelm_core.runner.local import threads_per_run

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    assert [threads_per_run(k) for k in (1, 2, 12, 32, 64)] == [None, 16, 2, 1, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert threads_per_run(12) is None
    launched = fake_popen(monkeypatch)
    LAUNCH.launch_training("parameters/smoke/gpt_base.yaml", threads=3, echo=lambda line: None)
    LAUNCH.launch_training("parameters/smoke/gpt_base.yaml", echo=lambda line: None)
    assert [kw["env"]["OMP_NUM_THREADS"] for _, kw in launched] == ["3", "4"]
    with pytest.raises(ConfigError, match=r"threads=0: give the training's CPU threads as a whole number >= 1"):
        LAUNCH.launch_training("parameters/smoke/gpt_base.yaml", threads=0, echo=lambda line: None)


def test_trainings_share_the_gpus_only_once_each_has_one():
    """runs_per_gpu: the GPU sets in turn, then again; never more slots than runs (the local
    scheduler's side-by-side slots, as launch_training gets them)."""
    from oelm_core.runner.local import gpu_slots

    assert gpu_slots(4, 1, 1, 15) == ["0", "1", "2", "3"]
    assert gpu_slots(2, 1, 3, 15) == ["0", "1", "0", "1", "0", "1"]
    assert gpu_slots(1, 1, 6, 4) == ["0"] * 4
    assert gpu_slots(4, 2, 2, 9) == ["0,1", "2,3", "0,1", "2,3"]
    assert gpu_slots(3, 2, 1, 5) == ["0,1"]
    plan = load_plan(REPO / "parameters" / "protocol" / "tune_medium512.yaml", sets=["experiment.runs_per_gpu=4"])
    assert plan.runs_per_gpu == 4
