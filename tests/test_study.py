"""The smoke study end to end (slow), and the study file / launcher plumbing (fast).

The end-to-end study runs once per test session (``smoke_study``): the smoke study file on a tiny
story corpus, 24 steps per run. tests/test_notebooks.py checks the notebooks it executed.
"""

import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import REPO, run_smoke_study
from conftest import SMOKE_STEPS as STEPS
from conftest import SMOKE_STUDY as STUDY_FILE
from oelm_core.config import ConfigError, load_run_config, run_config_from_dict
from oelm_core.study import (StudyError, check_notebook_parameters, execute_notebook, failed_cell, load_study,
                              notebook_defaults, train_command)

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
    assert "[study] step 1/4: 01_theory" in proc.stdout
    assert "[oelm_freeze_s42] step 24: train loss" in proc.stdout


@pytest.mark.slow
def test_smoke_study_results_judge_h1_to_h4(smoke_study):
    out, _ = smoke_study
    md = (out / "results.md").read_text()
    assert "OELM-Freeze" in md and "GPT-Base" in md and "Bits/byte" in md
    results = json.loads((out / "results.json").read_text())
    hyps = {h["id"]: h for h in results["hypotheses"]}
    assert sorted(hyps) == ["H1", "H2", "H3", "H4"]
    assert all(h["holds"] in (True, False) for h in hyps.values())
    assert hyps["H1"]["holds"] is False  # 16,384 of 3.3M trainable: nowhere near 15%
    assert len(results["table"]) == 3
    # which: final, but the samples are best.pt's: results.md says so
    assert ("## Samples\n\nAttention maps and samples: each group's best.pt, the weights of its lowest "
            "validation loss (its first seed that has one). The table reads the final evaluation, which may "
            "be a later step.") in md
    for fig in ("jl_distortion.png", "curves.png", "attention.png"):
        assert (out / "figures" / fig).is_file(), fig


@pytest.mark.slow
def test_a_study_run_again_leaves_its_finished_trainings_alone(smoke_study, tmp_path):
    out, _ = smoke_study
    again = tmp_path / "study"
    shutil.copytree(out, again)  # a copy: the other tests read the first run's files
    files = {p: p.stat().st_mtime_ns for p in again.rglob("*") if p.suffix == ".pt" or p.name == "summary.json"}
    assert len([p for p in files if p.name == "summary.json"]) == 3
    proc = run_smoke_study(out.parent, again, "study.notebooks=[03_training]")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "already ended (completed at step 24)" in proc.stdout + proc.stderr
    assert {p: p.stat().st_mtime_ns for p in files} == files  # no step trained, nothing rewritten


# --- plumbing (fast) -----------------------------------------------------------------------------

def test_load_study_plans_runs_seeds_and_overrides(tmp_path):
    study = load_study(STUDY_FILE, tmp_path / "s", ["train.steps=7", "study.seeds=[1,2]"])
    assert [r.name for r in study.runs] == ["gpt_base_s1", "gpt_base_s2", "oelm_nofreeze_s1",
                                            "oelm_nofreeze_s2", "oelm_freeze_s1", "oelm_freeze_s2"]
    assert all("train.steps=7" in r.overrides for r in study.runs)
    assert study.runs[1].run_dir == tmp_path / "s" / "runs" / "gpt_base_s2"
    assert study.notebooks == ["01_theory", "02_model", "03_training", "04_analysis"]
    medium = load_study(REPO / "parameters" / "study_medium512.yaml")
    assert medium.gpus_per_run == 2 and {r.preset for r in medium.runs} == {"medium512"}


def test_load_study_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_study(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="unknown key"):
        load_study(STUDY_FILE, sets=["study.colour=red"])
    with pytest.raises(ConfigError, match="train.stepz"):
        load_study(STUDY_FILE, sets=["train.stepz=3"])
    with pytest.raises(ConfigError, match="study.notebooks"):
        load_study(STUDY_FILE, sets=["study.notebooks=[05_extra]"])
    # values the trainer cannot use fail when the study is read, before any notebook runs
    with pytest.raises(ConfigError, match="train.dtype must be one of"):
        load_study(STUDY_FILE, sets=["train.dtype=fp64"])


@pytest.mark.parametrize("sets,message", [
    (["study.parameters.05_extra.d=3"], r"study.parameters names the notebook '05_extra'; choose from"),
    (["study.parameters.01_theory.dd=3"],
     r"study.parameters.01_theory.dd is not a parameter of 01_theory.ipynb; its parameters are d, n_head"),
    (["study.parameters.04_analysis.fig_dir=3"],
     r"04_analysis.fig_dir must be None or a string \(the notebook's default is None\); got 3"),
    (["study.parameters.03_training.params=x.yaml"], r"03_training.params is set by the study.*study.runs"),
    # with GPUs per run, the study gives each run its processes and GPUs: the smoke file's nproc
    # and cuda_visible_devices would be overwritten without a word
    (["study.gpus_per_run=1"], r"study.parameters.03_training.nproc is set by the study itself where "
                               r"study.gpus_per_run > 0 \(each run gets study.gpus_per_run processes, one "
                               r"per GPU\); leave it out of study.parameters.03_training"),
    (["study.gpus_per_run=2", "study.parameters.03_training={cuda_visible_devices: '2,3'}"],
     r"03_training.cuda_visible_devices is set by the study itself where study.gpus_per_run > 0 \(each run "
     r"gets study.gpus_per_run GPUs of its own, of those in the study's CUDA_VISIBLE_DEVICES\)"),
    (["study.gpus_per_run=two"], r"study.gpus_per_run must be a whole number of GPUs.*'two'"),
    (["study.overrides=train.steps=3"], r"study.overrides must be a list of key=value strings"),
    (["study.runs=[{name: a}]"], r"study.runs\[0\] needs a parameter file"),
    (["study.runs=[{params: smoke/gpt_base.yaml, overide: [train.steps=3]}]"],
     r"study.runs\[0\] has unknown key\(s\) overide; valid keys: name, overrides, params"),
    # notebook parameters of the wrong type or value: they used to pass, train every run, and
    # fail in the notebook (04_analysis.which) or name no parameter at all (01_theory.d)
    (["study.parameters.04_analysis.which=bestt"],
     r"study.parameters.04_analysis.which must be one of final, best; got 'bestt'"),
    (["study.parameters.01_theory.d=abc"],
     r"study.parameters.01_theory.d must be a whole number \(int\) \(the notebook's default is 512\); got 'abc'"),
    (["study.parameters.01_theory.d=2.5"], r"01_theory.d must be a whole number \(int\).*got 2.5"),
    (["study.parameters.04_analysis.max_new_tokens=true"], r"04_analysis.max_new_tokens must be a whole number"),
    (["study.parameters.04_analysis.max_new_tokens=null"], r"04_analysis.max_new_tokens must be a whole number.*got None"),
    (["study.parameters.02_model.all_variants=1"],
     r"02_model.all_variants must be true or false \(the notebook's default is True\); got 1"),
    (["study.parameters.02_model.preset=[medium512]"], r"02_model.preset must be a string.*got \['medium512'\]"),
    # the study's own keys of the wrong type: an empty notebook list used to run all four
    (["study.notebooks=[]"], r"study.notebooks must be a non-empty list of notebooks to run.*got \[\]"),
    (["study.notebooks=03_training"], r"study.notebooks must be a non-empty list.*got '03_training'"),
    (["study.notebooks=[03_training, 03_training]"], r"study.notebooks lists a notebook twice"),
    (["study.runs=smoke/gpt_base.yaml"], r"study.runs must be a list of parameter files.*got 'smoke/gpt_base.yaml'"),
    (["study.runs=[]", "study.notebooks=[04_analysis]"], r"lists no runs under study.runs for 04_analysis"),
    (["study.runs=[{params: 3}]"], r"study.runs\[0\] needs a parameter file"),
    (["study.runs=[{params: smoke/gpt_base.yaml, name: [a]}]"], r"study.runs\[0\].name must be a string"),
    (["study.seeds=[]"], r"study.seeds must be a non-empty list of whole numbers.*got \[\]"),
    (["study.seeds=[1, x]"], r"study.seeds must be a non-empty list of whole numbers.*got \[1, 'x'\]"),
    (["study.parameters=[]"], r"study.parameters must map notebook names to parameters.*got \[\]"),
    (["study.name=[a]"], r"study.name must be a string, got \['a'\]"),
])
def test_load_study_rejects_wrong_keys_and_values(sets, message):
    with pytest.raises(ConfigError, match=message):
        load_study(STUDY_FILE, sets=sets)


def test_load_study_takes_notebook_parameters_of_the_defaults_types(monkeypatch):
    study = load_study(STUDY_FILE, sets=["study.parameters.04_analysis.which=best",
                                         "study.parameters.04_analysis.fig_dir=/tmp/figs",
                                         "study.parameters.01_theory.d=128", "study.seeds=7",
                                         "study.notebooks=[01_theory, 04_analysis]"])
    assert study.parameters["04_analysis"] == {"which": "best", "max_new_tokens": 30, "fig_dir": "/tmp/figs"}
    assert study.parameters["01_theory"]["d"] == 128
    assert study.notebooks == ["01_theory", "04_analysis"] and {r.seed for r in study.runs} == {7}
    # a float parameter takes a whole number too, not a string
    import oelm_core.study as S

    defaults = S.notebook_defaults
    monkeypatch.setattr(S, "notebook_defaults", lambda nb: {**defaults(nb), "scale": 0.5})
    assert load_study(STUDY_FILE, sets=["study.parameters.01_theory.scale=2"]).parameters["01_theory"]["scale"] == 2
    with pytest.raises(ConfigError, match=r"01_theory.scale must be a number \(float\)"):
        load_study(STUDY_FILE, sets=["study.parameters.01_theory.scale=big"])


@pytest.mark.parametrize("per_run, expected", [(1, {"0", "1"}), (2, {"0,1"})])
def test_trainings_run_side_by_side_on_the_gpus_this_process_sees(monkeypatch, tmp_path, per_run, expected):
    """Slots are GPU indices as the study numbers them; launch_training maps them for the child."""
    import oelm_core.study as S

    monkeypatch.setattr(S, "_gpu_count", lambda: 2)
    given = []
    monkeypatch.setattr(S, "execute_notebook", lambda name, out, params, prefix="", cwd=None:
                        given.append((params["nproc"], params["cuda_visible_devices"])))
    study = load_study(STUDY_FILE, tmp_path, [f"study.gpus_per_run={per_run}", "study.parameters.03_training={}"])
    S._train_all(study)
    assert len(given) == 3 and all(nproc == per_run for nproc, _ in given)
    assert {devices for _, devices in given} == expected  # 3 runs on 2 slots of 1 GPU use both


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


@pytest.mark.parametrize("visible, gpus, child", [("2,3", "0", "2"), ("2,3", "1", "3"), ("5,7", "0,1", "5,7"),
                                                  ("2,3", "", ""), (None, "1", "1"), (None, "", ""),
                                                  ("GPU-aa, GPU-bb", "1", "GPU-bb")])
def test_a_training_gets_the_gpu_of_this_process_it_was_given(monkeypatch, visible, gpus, child):
    """A job confined to GPUs 2,3 (CUDA_VISIBLE_DEVICES=2,3) trained on GPUs 0 and 1: a child's
    CUDA_VISIBLE_DEVICES names the machine's devices, not this process's view of them."""
    import oelm_core.study as S

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)

    launched = fake_popen(monkeypatch)
    S.launch_training("parameters/smoke/gpt_base.yaml", cuda_visible_devices=gpus, echo=lambda line: None)
    assert launched[0][1]["env"]["CUDA_VISIBLE_DEVICES"] == child


@pytest.mark.parametrize("visible, gpus, message", [
    ("2,3", "2", r"names GPU 2, but this process sees 2 GPU\(s\) \(CUDA_VISIBLE_DEVICES=2,3\)"),
    ("", "0", r"names GPU 0, but this process sees 0 GPU\(s\)"),
    ("2,3", "GPU-aa", r"give GPU indices such as \"0\" or \"0,1\"")])
def test_a_gpu_this_process_does_not_see_is_refused(monkeypatch, visible, gpus, message):
    import oelm_core.study as S

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    with pytest.raises(ConfigError, match=message):
        S.launch_training("parameters/smoke/gpt_base.yaml", cuda_visible_devices=gpus, echo=lambda line: None)


def test_paths_and_names_reach_the_trainer_as_written(monkeypatch, tmp_path):
    """--set values are YAML: a study folder with " #" in its path was cut at the comment, and a
    run named off or 2024 became a bool or an int that the trainer refused."""
    import oelm_core.study as S

    study = load_study(STUDY_FILE, tmp_path / "study #2 😀", [
        "study.seeds=null", "study.runs=[{params: smoke/gpt_base.yaml, name: 'off'}, "
                            "{params: smoke/oelm_freeze.yaml, name: '2024'}]"])
    assert [r.name for r in study.runs] == ["off", "2024"]
    for run in study.runs:
        assert load_run_config(run.params, run.overrides).name == run.name

    launched = fake_popen(monkeypatch)
    run = study.runs[0]
    out = S.launch_training(run.params, run.overrides, run_dir=run.run_dir, echo=lambda line: None)
    assert out == run.run_dir.resolve() and " #2 😀" in str(out)
    sets = [launched[0][0][k + 1] for k, arg in enumerate(launched[0][0]) if arg == "--set"]
    assert load_run_config(run.params, sets).out_dir == str(out)   # what the trainer will read


def test_every_set_flag_reaches_the_study(monkeypatch, tmp_path):
    """Like train's --set: several values after one flag, and the flag given again."""
    import oelm_core.study as S

    studies = []
    monkeypatch.setattr(S, "run_study", studies.append)
    assert S.main([str(STUDY_FILE), "--out", str(tmp_path / "s"), "--set", "train.steps=7", "study.seeds=[1,2]",
                   "--set", "study.notebooks=[03_training]"]) == 0
    (study,) = studies
    assert study.notebooks == ["03_training"] and {r.seed for r in study.runs} == {1, 2}
    assert all("train.steps=7" in r.overrides for r in study.runs)


@pytest.mark.parametrize("failure,code,message", [
    (None, 2, "[study] FAILED: study file {tmp}/nope.yaml not found"),
    (StudyError("notebook 04_analysis failed in code cell 3"), 1, "[study] FAILED: notebook 04_analysis failed"),
    (RuntimeError("training of p.yaml exited with status 2"), 1, "[study] FAILED: training of p.yaml exited"),
    (ConfigError("data folder /x does not exist"), 2, "[study] FAILED: data folder /x does not exist"),
])
def test_study_exit_codes_are_those_of_train(monkeypatch, tmp_path, capsys, failure, code, message):
    """2: unusable input (as train and sweep say it), 1: a notebook or training failed; a study
    file not found used to exit 1."""
    import oelm_core.study as S

    def run_study(study):
        raise failure

    monkeypatch.setattr(S, "run_study", run_study)
    study = tmp_path / "nope.yaml" if failure is None else STUDY_FILE
    assert S.main([str(study), "--out", str(tmp_path / "s")]) == code
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
    with pytest.raises(ConfigError, match=r"^--set 'study.seeds=\[1': the value is not valid YAML"):
        load_study(STUDY_FILE, sets=["study.seeds=[1"])


def test_study_notebook_parameters_are_those_of_the_notebooks():
    from oelm_core.study import notebook_defaults

    assert list(notebook_defaults("03_training")) == ["params", "overrides", "nproc", "cuda_visible_devices",
                                                      "run_dir", "resume", "progress_bar"]
    study = load_study(STUDY_FILE, sets=["study.parameters.03_training.progress_bar=true"])
    assert study.parameters["03_training"]["progress_bar"] is True


def test_parameter_files_load():
    """Every shipped parameter, sweep and study file loads, and none hard-codes a local data
    folder: online the stories come from the hub, offline from OELM_DATA."""
    from oelm_core.data import HUB_NAME
    from oelm_core.sweep import load_sweep, sweep_runs

    files = sorted((REPO / "parameters").glob("*/*.yaml")) + [REPO / "parameters" / "train_smoke.yaml"]
    assert {p.parent.name for p in files} == {"smoke", "medium512", "shapes", "ablations", "sweeps", "parameters"}
    for path in files:
        if path.parent.name == "sweeps":
            cfgs = [run_config_from_dict(r.params) for r in sweep_runs(load_sweep(path), "/tmp/_check")]
        else:
            cfgs = [load_run_config(path)]
        assert all(cfg.data.source == HUB_NAME for cfg in cfgs), path
    for path in sorted((REPO / "parameters").glob("study_*.yaml")):
        load_study(path)
    cfgs = {v: load_run_config(REPO / "parameters" / "medium512" / f"{v}.yaml")
            for v in ("gpt_base", "oelm_nofreeze", "oelm_freeze")}
    for v, cfg in cfgs.items():
        t = cfg.train
        assert (cfg.variant, cfg.preset, t.steps, t.batch_size, t.lr, t.min_lr, t.warmup_steps) == \
            (v, "medium512", 100_000, 8, 3e-4, 3e-5, 2000, )
        assert (t.weight_decay, t.grad_clip, t.eval_every, t.ckpt_every) == (0.1, 1.0, 1000, 5000)


def test_train_command_single_and_torchrun():
    assert train_command("p.yaml", ["train.steps=3"])[1:] == ["-m", "oelm_core.train", "--params", "p.yaml",
                                                              "--set", "train.steps=3"]
    cmd = train_command("p.yaml", nproc=2)
    assert "torch.distributed.run" in cmd and "--nproc_per_node=2" in cmd and "oelm_core.train" in cmd


@pytest.mark.slow
def test_failed_notebook_names_the_cell(tmp_path, monkeypatch):
    # OELM_DATA (the Makefile exports it) overrides data.source: the run would find stories and
    # fail somewhere else, for another reason
    monkeypatch.delenv("OELM_DATA", raising=False)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"name": "bad", "preset": "tiny", "variant": "gpt_base",
                                   "data": {"source": str(tmp_path / "no_such_folder"),
                                            "out_dir": str(tmp_path / "data")}}))
    out = tmp_path / "03.ipynb"
    with pytest.raises(StudyError) as err:
        execute_notebook("03_training", out, {"params": str(bad), "run_dir": str(tmp_path / "run")}, cwd=REPO)
    msg = str(err.value)
    assert "notebook 03_training failed in code cell" in msg and "launch_training" in msg
    assert "RuntimeError" in msg and str(out) in msg
    assert f"data folder {tmp_path / 'no_such_folder'} does not exist" in msg
    assert failed_cell(out).startswith("code cell")


@pytest.mark.parametrize("progress, expected", [(None, True), (False, False), (True, True)])
def test_launch_training_sets_the_progress_bar_only_when_asked(monkeypatch, progress, expected):
    """Notebook 03 turns the bar off (it streams badly there); None keeps the parameter file's."""
    import oelm_core.study as S

    launched = fake_popen(monkeypatch)
    S.launch_training("parameters/smoke/gpt_base.yaml", progress=progress, echo=lambda line: None)
    sets = [launched[0][0][k + 1] for k, arg in enumerate(launched[0][0]) if arg == "--set"]
    assert load_run_config("parameters/smoke/gpt_base.yaml", sets).train.progress is expected


# --- notebook parameters given to papermill directly ----------------------------------------------

@pytest.mark.parametrize("name,values,message", [
    # papermill -p passes text: a list became its characters, a count a string deep in a call
    ("03_training", {"overrides": "train.steps=20"},
     r"^notebook 03_training: parameter overrides must be a list \(the notebook's default is \[\]\); got "
     r"'train.steps=20'; give a list or mapping to papermill as YAML with -y, e.g. -y 'overrides: \[...\]'$"),
    ("03_training", {"nproc": "two"}, r"^notebook 03_training: parameter nproc must be a whole number \(int\) "
                                      r"\(the notebook's default is 1\); got 'two'$"),
    ("03_training", {"run_dir": 3}, r"parameter run_dir must be None or a string \(the notebook's default is None\)"),
    ("01_theory", {"d": "abc"}, r"^notebook 01_theory: parameter d must be a whole number \(int\).*got 'abc'$"),
    ("05_sweep", {"overrides": "train.steps=20"},
     r"parameter overrides must be a mapping \(the notebook's default is \{\}\); got 'train.steps=20'; give a "
     r"list or mapping to papermill as YAML with -y, e.g. -y 'overrides: \{...\}'"),
    ("05_sweep", {"smoke": "no"}, r"parameter smoke must be true or false \(the notebook's default is True\); got 'no'"),
    ("05_sweep", {"seeds": 3}, r"parameter seeds must be None or a list \(the notebook's default is None\); got 3"),
    ("05_sweep", {"runner": "in-process"},
     r"parameter runner must be one of inprocess, subprocess, notebook; got 'in-process'"),
    ("04_analysis", {"which": "last"}, r"parameter which must be one of final, best; got 'last'"),
    # values of the right type that leave 01's checks nothing to measure, or to chance
    ("01_theory", {"d": 16}, r"^notebook 01_theory: parameter d must be at least 32 \(the JL curve needs the target "
                             r"dimensions 8 and d/2 >= 16\); got 16$"),
    ("01_theory", {"n_tokens": 2}, r"parameter n_tokens must be at least 8 .*; got 2$"),
    ("01_theory", {"jl_points": 2}, r"parameter jl_points must be at least 3 .*; got 2$"),
    ("01_theory", {"d": 64, "n_head": 3}, r"parameter n_head must divide d \(d = 64 is split into n_head equal "
                                          r"parts\); got n_head = 3$"),
    ("01_theory", {"n_head": 5}, r"n_head must divide d \(d = 512 .*got n_head = 5$"),
    ("02_model", {"presets": "tiny"}, r"parameter presets is not a parameter of 02_model.ipynb; its parameters are "
                                      r"preset, grad_check_preset, all_variants"),
])
def test_notebook_parameters_of_the_wrong_type_are_named(name, values, message):
    with pytest.raises(ConfigError, match=message):
        check_notebook_parameters(name, values)


@pytest.mark.parametrize("name", ["01_theory", "02_model", "03_training", "04_analysis", "05_sweep"])
def test_a_notebooks_defaults_and_values_of_their_types_pass(name):
    defaults = notebook_defaults(name)
    check_notebook_parameters(name, defaults)
    given = {"03_training": {"run_dir": "/tmp/run", "overrides": ["train.steps=20"], "nproc": 2},
             "04_analysis": {"fig_dir": "figs", "which": "best"},
             "05_sweep": {"seeds": [0, 1], "variants": ["gpt_base"], "runner": "notebook", "figure_path": "f.png"},
             "01_theory": {"d": 64}, "02_model": {"all_variants": False}}[name]
    assert all(defaults[key] != value for key, value in given.items())  # other values than the defaults
    check_notebook_parameters(name, given)


# --- a study run again in part ---------------------------------------------------------------------

def test_a_partial_rerun_keeps_the_record_of_the_notebooks_run_before(monkeypatch, tmp_path, capsys):
    """--set 'study.notebooks=[03_training]' rewrote study.json with that notebook alone, and its
    last line named results.md, the earlier call's, as if it had written it."""
    import oelm_core.study as S

    clock = iter(f"2026-01-0{day}T00:00:00+00:00" for day in range(1, 10))
    monkeypatch.setattr(S, "_now", lambda: next(clock))
    monkeypatch.setattr(S, "_prepare_data", lambda study: None)
    monkeypatch.setattr(S, "_train_all", lambda study: None)

    written = {}

    def execute(name, out_path, parameters, prefix="", cwd=None):
        written[name] = out_path
        if name == "04_analysis":
            (Path(parameters["out_dir"]) / "results.md").write_text("# Results\n")

    monkeypatch.setattr(S, "execute_notebook", execute)
    out = tmp_path / "study"
    S.run_study(load_study(STUDY_FILE, out))
    assert capsys.readouterr().out.endswith(f"[study] done: {out}/study.json, {out}/results.md\n")
    first = json.loads((out / "study.json").read_text())["notebooks"]
    assert [(n["name"], n["executed"]) for n in first] == [
        ("01_theory", "2026-01-02T00:00:00+00:00"), ("02_model", "2026-01-03T00:00:00+00:00"),
        ("03_training", "2026-01-04T00:00:00+00:00"), ("04_analysis", "2026-01-05T00:00:00+00:00")]
    assert all(out / n["output"] == written[n["name"]] for n in first if n["name"] != "03_training")

    data = S.run_study(load_study(STUDY_FILE, out, ["study.notebooks=[03_training]"]))
    assert capsys.readouterr().out.endswith(f"[study] done: {out}/study.json\n")
    assert data == json.loads((out / "study.json").read_text())
    assert data["status"] == "completed" and data["created"] == "2026-01-06T00:00:00+00:00"
    assert [(n["name"], n["executed"]) for n in data["notebooks"]] == [
        ("01_theory", "2026-01-02T00:00:00+00:00"), ("02_model", "2026-01-03T00:00:00+00:00"),
        ("03_training", "2026-01-07T00:00:00+00:00"), ("04_analysis", "2026-01-05T00:00:00+00:00")]


def test_an_older_study_json_lists_the_notebooks_it_completed_by_name(tmp_path):
    import oelm_core.study as S

    study = load_study(STUDY_FILE, tmp_path)
    (tmp_path / "study.json").write_text(json.dumps({"name": "smoke", "created": "2025-12-01T00:00:00+00:00",
                                                     "status": "completed", "notebooks": ["03_training", "04_analysis"]}))
    assert S._earlier_notebooks(study) == {n: {"name": n, "executed": "2025-12-01T00:00:00+00:00"}
                                           for n in ("03_training", "04_analysis")}
    (tmp_path / "study.json").write_text(json.dumps({"name": "other", "status": "completed",
                                                     "notebooks": ["03_training"]}))
    assert S._earlier_notebooks(study) == {}   # another study's folder: nothing of this one ran there


def test_the_smoke_parameter_files_train_outside_the_smoke_studys_folder():
    """`python -m oelm_core.train --params parameters/smoke/oelm_freeze.yaml` trained into
    runs/smoke/oelm_freeze, where an analysis of the smoke study folder took it for a study run."""
    study = load_study(STUDY_FILE)
    assert study.out == Path("runs/smoke")
    for path in sorted((REPO / "parameters" / "smoke").glob("*.yaml")):
        out = Path(load_run_config(path).out_dir)
        assert out == Path("runs/train") / f"smoke_{path.stem}", path
        assert study.out not in out.parents
