"""The one config schema: parameter files, --set overrides, and errors that name the fix."""

import pytest

from oelm_core.config import (
    REMOVED_TRAIN_KEYS,
    ConfigError,
    SamplingConfig,
    TrainConfig,
    model_config,
    run_config_from_dict,
)
from oelm_core.parameter_files import apply_overrides, load_run_config, read_yaml


def test_defaults_are_the_original_study():
    cfg = load_run_config()
    t = cfg.train
    assert (t.lr, t.min_lr, t.warmup_steps, t.steps) == (3e-4, 3e-5, 2000, 100_000)
    assert (t.beta1, t.beta2, t.eps, t.weight_decay, t.grad_clip) == (0.9, 0.95, 1e-8, 0.1, 1.0)
    assert (t.batch_size, t.eval_every, t.ckpt_every, t.keep_last) == (8, 1000, 5000, 3)
    m = cfg.model_config()
    assert (m.n_layer, m.d_model, m.n_head, m.d_ff, m.block_size, m.vocab_size) == (6, 512, 8, 2048, 512, 50257)


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("name: x\npreset: medium512\nvariant: oelm_freeze\nmodel:\n  n_layer: 2\ntrain:\n  steps: 10\n")
    cfg = load_run_config(path, ["train.lr=0.001", "model.freeze_qk=[0]", "data.source=/tmp/d"])
    assert cfg.train.steps == 10 and cfg.train.lr == 1e-3 and cfg.data.source == "/tmp/d"
    m = cfg.model_config()
    assert m.n_layer == 2 and m.frozen_layers() == [0] and m.qk_init == "qr"


def test_unknown_key_lists_the_valid_ones():
    with pytest.raises(
        ConfigError,
        match=r"unknown key\(s\) params\.train\.stepz; valid keys in "
        r"params\.train: .*steps",
    ):
        run_config_from_dict({"train": {"stepz": 5}})


def test_wrong_type_names_key_and_expected_type():
    with pytest.raises(ConfigError, match=r"params\.train\.steps should be int, got str 'abc'"):
        run_config_from_dict({"train": {"steps": "abc"}})
    with pytest.raises(ConfigError, match=r"params\.train should be a mapping|must be a mapping"):
        run_config_from_dict({"train": 5})


def test_the_sampling_settings_are_checked_by_the_same_builder():
    """SamplingConfig is checked by the builder of every other section: the same wording (dotted
    key, expected type, value, fix) and the same reading of numbers (a NumPy integer is a whole
    number; a whole number is stored as a Python int, so the config dumps to YAML)."""
    np = pytest.importorskip("numpy")
    with pytest.raises(ConfigError) as file_error:
        run_config_from_dict({"train": {"steps": 2.5}})
    with pytest.raises(ConfigError) as sampling_error:
        SamplingConfig(max_new_tokens=2.5).validate()
    assert str(file_error.value) == (
        "params.train.steps should be int, got float 2.5; fix the value in the parameter file or --set"
    )
    assert str(sampling_error.value) == (
        "sampling.max_new_tokens should be int, got float 2.5; pass one as SamplingConfig(max_new_tokens=...)"
    )
    cfg = run_config_from_dict({"train": {"steps": np.int64(7), "lr": np.float32(0.5)}})
    assert type(cfg.train.steps) is int and cfg.train.steps == 7 and type(cfg.train.lr) is float
    with pytest.raises(ConfigError, match=r"^sampling\.seed should be int or None, got str 'x'"):
        SamplingConfig(seed="x").validate()
    assert SamplingConfig(seed=np.int64(3), top_k=np.int32(5)).validate().top_k == 5


def test_invalid_model_fails_at_load_time():
    with pytest.raises(ConfigError, match="does not divide"):
        run_config_from_dict({"model": {"n_head": 5}})


def test_missing_file_and_bad_override(tmp_path):
    with pytest.raises(ConfigError, match="not found; pass an existing YAML file"):
        load_run_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="expects key=value"):
        apply_overrides({}, ["train.steps"])


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("train.beta1", 1.5, r"train\.beta1 must be in \[0, 1\)"),
        ("train.eps", -1, r"train\.eps must be positive"),
        ("train.lr", 0, r"train\.lr must be positive"),
        ("train.lr", float("nan"), r"train\.lr must be positive"),
        ("train.dtype", "fp64", r"train\.dtype must be one of \('auto', 'float32', 'bf16'\)"),
        (
            "train.min_lr",
            1e-3,
            r"train\.min_lr=0\.001 exceeds train\.lr=0\.0003: the cosine schedule decays "
            r"from lr to min_lr, so min_lr must be at most lr",
        ),
        (
            "train.unfreeze_schedule",
            {200: [9]},
            r"unfreeze_schedule\[200\] must be 'all' or a list of layer indices in 0\.\.5",
        ),
        ("data.num_proc", -1, r"data\.num_proc must be 0 or positive"),
        ("model.freeze_qk", ["a"], r"model\.freeze_qk must list layer indices as integers"),
        ("model.freeze_qk", [1.7], r"model\.freeze_qk must list layer indices as integers"),
        ("model.freeze_qk", True, r"model\.freeze_qk should be str or list, got bool True"),
        ("train.loss_chunk_tokens", 0, r"train\.loss_chunk_tokens must be at least 1, got 0"),
        ("train.loss_chunk_tokens", -1, r"train\.loss_chunk_tokens must be at least 1, got -1"),
        # moved from model to train: an old file's value is checked under its new name
        ("model.loss_chunk_tokens", -1, r"train\.loss_chunk_tokens must be at least 1, got -1"),
        ("model.synth_rank", 0, r"model\.synth_rank must be positive"),
        ("model.vocab_pad_multiple", 0, r"model\.vocab_pad_multiple must be positive"),
        ("model.poet_merge_every", -5, r"model\.poet_merge_every must be 0 \(off\) or positive"),
        ("model.n_head", 0, r"model\.n_head must be positive, got 0"),
        ("model.d_model", 0, r"model\.d_model must be positive, got 0"),
        ("model.qk_gain", 0, r"model\.qk_gain must be a finite positive scale"),
        ("model.qk_gain", -1.0, r"model\.qk_gain must be a finite positive scale"),
        ("model.qk_gain", float("nan"), r"model\.qk_gain must be a finite positive scale"),
        ("model.qk_gain", float("inf"), r"model\.qk_gain must be a finite positive scale"),
    ],
)
def test_unusable_values_fail_at_load_time(key, value, message):
    """Every entry point (CLI, study, sweep, notebooks) loads through here: a value the loop or
    the model cannot use fails before anything runs, naming the key."""
    values = {}
    section, name = key.split(".")
    values[section] = {name: value}
    with pytest.raises(ConfigError, match=message):
        run_config_from_dict(values)


def test_the_loss_switches_of_older_files_are_read_as_train_settings(caplog):
    """model.loss_impl and model.loss_chunk_tokens were the fused loss's switches; they are train
    settings now (the model computes the plain loss): an old parameter file, and the run config
    in an old checkpoint, load with a note; a model built with them is told where they went."""
    with caplog.at_level("INFO", logger="oelm_core.config"):
        cfg = run_config_from_dict({"model": {"loss_impl": "full", "loss_chunk_tokens": 100}})
    assert (cfg.train.fused_loss, cfg.train.loss_chunk_tokens, cfg.model) == (False, 100, {})
    assert "model.loss_impl is now train.fused_loss" in caplog.text
    assert run_config_from_dict({"model": {"loss_impl": "chunked"}}).train.fused_loss is True
    # the train section's own value wins over a moved one
    assert run_config_from_dict({"model": {"loss_impl": "full"}, "train": {"fused_loss": True}}).train.fused_loss
    with pytest.raises(
        ConfigError,
        match=r"model\.loss_impl is no longer a model setting: .* train\.fused_loss "
        r"and train\.loss_chunk_tokens \(from Python: oelm_core\.fast\.loss",
    ):
        model_config("tiny", "gpt_base", loss_impl="full")


def test_the_switches_of_removed_fast_paths_are_dropped_with_a_note(caplog):
    """train.cublaslt, train.fused_clip, train.tied_grad_split and train.compile_tuning switched
    fast paths that were removed: a run folder or parameter file that sets them still loads,
    with a note; every other unknown train key is still refused."""
    old = {
        "train": {"cublaslt": False, "fused_clip": True, "tied_grad_split": True, "compile_tuning": True, "lr": 1e-3}
    }
    with caplog.at_level("INFO", logger="oelm_core.config"):
        cfg = run_config_from_dict(old)
    assert cfg.train.lr == 1e-3 and not hasattr(cfg.train, "cublaslt")
    for key in REMOVED_TRAIN_KEYS:
        assert f"train.{key} is ignored: that fast path was removed" in caplog.text
    assert old["train"]["cublaslt"] is False  # the caller's mapping is left as it was
    with pytest.raises(ConfigError, match=r"unknown key\(s\) params\.train\.cublas;"):
        run_config_from_dict({"train": {"cublas": False}})


def test_a_section_with_every_key_commented_out_is_empty(tmp_path):
    """YAML reads such a section as null: it is an empty section, which --set can fill."""
    path = tmp_path / "p.yaml"
    path.write_text("name: x\npreset: medium512\nvariant: gpt_base\ntrain:\n  # steps: 10\nmodel:\n")
    assert load_run_config(path).train == TrainConfig()
    cfg = load_run_config(path, ["train.steps=5", "model.n_layer=2"])
    assert cfg.train.steps == 5 and cfg.model_config().n_layer == 2


def test_exponent_floats_without_a_dot_are_numbers():
    # YAML 1.1 reads 3e-4 as a string; the value meant is the number.
    cfg = load_run_config(None, ["train.lr=3e-4", "train.min_lr=1E-5"])
    assert cfg.train.lr == 3e-4 and cfg.train.min_lr == 1e-5
    with pytest.raises(ConfigError, match=r"params\.train\.lr should be a number, got the string 'fast'"):
        load_run_config(None, ["train.lr=fast"])


def test_overrides_leave_the_callers_mapping_alone():
    values = {"train": {"steps": 1}}
    assert apply_overrides(values, ["train.steps=2"]) == {"train": {"steps": 2}}
    assert values == {"train": {"steps": 1}}


def test_yaml_syntax_errors_name_the_file_or_the_override(tmp_path):
    """PyYAML's own error is a multi-line traceback that names neither the file nor the --set."""
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ntrain:\n  lr: [1\n  steps: 3\n")
    with pytest.raises(ConfigError) as exc:
        load_run_config(bad)
    message = str(exc.value)
    assert message.startswith(f"{bad} is not valid YAML: expected ',' or ']', but got ':' at line 4")
    assert "flow sequence from line 3" in message and "\n" not in message
    with pytest.raises(ConfigError) as exc:
        load_run_config(None, ["train.steps=5", "train.lr=[1"])
    message = str(exc.value)
    assert message.startswith("--set 'train.lr=[1': the value is not valid YAML (expected ',' or ']'")
    assert "complete it" in message and "\n" not in message


def test_a_tab_in_yaml_gets_the_tab_hint(tmp_path):
    """An editor's tab before a key got the hint "an unclosed bracket or quote is the usual
    cause"; the tab has its own."""
    tabbed = tmp_path / "tabbed.yaml"
    tabbed.write_text("name: x\ntrain:\n\tsteps: 3\n")
    with pytest.raises(ConfigError) as exc:
        load_run_config(tabbed)
    assert str(exc.value) == (
        f"{tabbed} is not valid YAML: found character '\\t' that cannot start any token at "
        f"line 3, column 1; fix the syntax there (YAML indents with spaces, never tabs: "
        f"replace the tab with spaces)"
    )
    bracket = tmp_path / "bracket.yaml"
    bracket.write_text("name: x\ntrain: {steps: 3\n")
    with pytest.raises(ConfigError, match=r"\(an unclosed bracket or quote is the usual cause\)$"):
        load_run_config(bracket)


def test_read_yaml_names_the_file_and_what_is_wrong(tmp_path):
    """Study, sweep and ablation files are read by read_yaml too: PyYAML's own error was a
    traceback naming neither the file nor the fix."""
    path = tmp_path / "f.yaml"
    path.write_text("study:\n  runs: [a.yaml\n  seeds: [1]\n")
    with pytest.raises(ConfigError) as exc:
        read_yaml(path)
    assert str(exc.value).startswith(
        f"{path} is not valid YAML: expected ',' or ']', but got ':' at line 3, "
        f"column 8 (while parsing a flow sequence from line 2, column 9)"
    )
    path.write_text("- train.steps: 3\n")
    with pytest.raises(ConfigError, match=r"f.yaml must hold a YAML mapping at the top level .*got a list"):
        read_yaml(path)
    path.write_bytes(b"\x80\x81 not text")
    with pytest.raises(ConfigError, match=r"f.yaml is not a UTF-8 text file"):
        read_yaml(path)
    path.write_text("# all commented out\n")
    assert read_yaml(path) == {}
    path.write_text("train:\n  lr: 3e-4\n")
    assert read_yaml(path) == {"train": {"lr": "3e-4"}}  # as PyYAML reads it: _build makes it a number


def test_overrides_as_set_strings_or_a_mapping_are_the_same():
    base = {"model": {"n_layer": 2}, "train": None}
    as_sets = apply_overrides(
        base, ["model.n_layer=4", "train.lr=1e-3", "model.freeze_qk=[0, 1]", "data.source='2024'"]
    )
    as_mapping = apply_overrides(
        base, {"model.n_layer": 4, "train.lr": "1e-3", "model.freeze_qk": [0, 1], "data.source": "2024"}
    )
    assert (
        as_sets
        == as_mapping
        == {"model": {"n_layer": 4, "freeze_qk": [0, 1]}, "train": {"lr": "1e-3"}, "data": {"source": "2024"}}
    )
    assert base == {"model": {"n_layer": 2}, "train": None}


def test_trained_settings_compare_what_a_run_learns():
    """The one comparison of sweep folders and analysis groups: the model as it resolves, the
    seed and schedule, not where or how fast the run executes."""
    from oelm_core.run_settings import EXECUTION_KEYS, trained_settings

    freeze = trained_settings({"preset": "tiny", "variant": "oelm_freeze"})
    # the same model written as GPT-Base with OELM-Freeze's overrides
    assert trained_settings({"preset": "tiny", "model": {"qk_init": "qr", "freeze_qk": "all"}}) == freeze
    assert freeze["train.seed"] == 42 and freeze["model.freeze_qk"] == "all" and freeze["train.steps"] == 100_000
    executed = {
        "preset": "tiny",
        "variant": "oelm_freeze",
        "train": {"device": "cpu", "compile": True, "stop_after": 3},
        "data": {"source": "/elsewhere"},
    }
    assert trained_settings(executed) == freeze
    assert not EXECUTION_KEYS & set(freeze)
    assert trained_settings({"preset": "tiny", "variant": "oelm_freeze", "train": {"lr": 1e-3}}) != freeze
    with pytest.raises(ConfigError, match="unknown key"):
        trained_settings({"train": {"stepz": 1}})


def test_compile_auto_compiles_long_cuda_runs_only():
    """train.compile: "auto" (the default) compiles on CUDA from COMPILE_AUTO_MIN_STEPS steps (the
    presets' runs), never on the CPU nor for a short run (the protocol's, the tests'); true and
    false are what they say; anything else is refused naming the choices."""
    from oelm_core.config import COMPILE_AUTO_MIN_STEPS, TrainConfig

    assert TrainConfig().compile == "auto" and TrainConfig().steps >= COMPILE_AUTO_MIN_STEPS
    assert TrainConfig().compiles("cuda") and not TrainConfig().compiles("cpu")
    assert not TrainConfig(steps=3000).compiles("cuda")
    assert TrainConfig(steps=COMPILE_AUTO_MIN_STEPS).compiles("cuda")
    assert TrainConfig(compile=True, steps=10).compiles("cpu") and not TrainConfig(compile=False).compiles("cuda")
    assert load_run_config(None, ["train.compile=false"]).train.compiles("cuda") is False
    with pytest.raises(ConfigError, match="train.compile must be true, false or auto, got 'sometimes'"):
        load_run_config(None, ["train.compile=sometimes"]).validate()


def test_min_lr_may_equal_lr():
    """min_lr = lr is the constant schedule after warm-up; only a min_lr above lr, whose "decay"
    would raise the learning rate, is refused (above, in test_unusable_values_fail_at_load_time)."""
    cfg = load_run_config(None, ["train.lr=0.002", "train.min_lr=0.002"])
    assert cfg.train.min_lr == cfg.train.lr == 0.002


def test_preset_and_variant_inside_model_name_the_top_level_keys(tmp_path):
    """model.preset reached model_config(preset, variant, **model) as a second `preset`: a raw
    TypeError. They are top-level keys, and the error says where to write them."""
    path = tmp_path / "p.yaml"
    path.write_text("name: x\nmodel:\n  preset: smoke\n  variant: oelm_freeze\n")
    with pytest.raises(
        ConfigError,
        match=r"^model\.preset is not a model key: preset and variant are top-level "
        r"keys; write `preset: smoke` beside `model:` \(or --set preset=smoke\)$",
    ):
        load_run_config(path)
    with pytest.raises(ConfigError, match=r"model\.preset is not a model key.*`preset: smoke` beside `model:`"):
        load_run_config(None, ["model.preset=smoke"])
    with pytest.raises(ConfigError, match=r"model\.variant is not a model key.*`variant: oelm_freeze` beside"):
        load_run_config(None, ["model.variant=oelm_freeze"])
    path.write_text("name: x\npreset: smoke\nvariant: oelm_freeze\nmodel:\n  n_layer: 3\n")
    m = load_run_config(path).model_config()
    assert (m.n_layer, m.d_model, m.freeze_qk) == (3, 64, "all")


def test_a_key_given_twice_is_refused_naming_it_and_its_lines(tmp_path):
    """PyYAML keeps the last of two equal keys: a second train: section silently dropped the
    first one's steps."""
    path = tmp_path / "p.yaml"
    path.write_text("name: x\ntrain:\n  steps: 5\nmodel:\n  n_layer: 2\ntrain:\n  lr: 0.001\n")
    with pytest.raises(
        ConfigError,
        match=r"^.*p\.yaml: the key 'train' appears twice in one mapping \(on lines 2 "
        r"and 6\); YAML would keep only the second silently: merge the two",
    ):
        load_run_config(path)
    path.write_text("train:\n  steps: 5\n  lr: 0.001\n  steps: 6\n")
    with pytest.raises(ConfigError, match=r"the key 'steps' appears twice in one mapping \(on lines 2 and 4\)"):
        read_yaml(path)
    with pytest.raises(
        ConfigError,
        match=r"^--set 'model=\{n_layer: 2, n_layer: 3\}': the key 'n_layer' appears "
        r"twice in one mapping \(on line 1\)",
    ):
        load_run_config(None, ["model={n_layer: 2, n_layer: 3}"])
    # A merge key's values may be overridden: that is what it is for, not a repeated key.
    path.write_text("base: &b {steps: 5, lr: 0.001}\ntrain:\n  <<: *b\n  steps: 7\n")
    assert read_yaml(path)["train"] == {"steps": 7, "lr": 0.001}
    assert apply_overrides({}, ["model={n_layer: 2, d_model: 64}"]) == {"model": {"n_layer": 2, "d_model": 64}}


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("model.dropout", 1.0, r"model\.dropout must be in \[0, 1\)"),  # K2
        ("train.beta2", 1.0, r"train\.beta2 must be in \[0, 1\)"),  # K3
        ("train.steps", 0, r"train\.steps must be at least 1, got 0"),  # K4
        ("train.batch_size", 0, r"train\.batch_size must be at least 1"),  # K4
        ("train.steps", True, r"params\.train\.steps should be int, got bool True"),  # K5
    ],
)
def test_more_unusable_values(key, value, message):
    from oelm_core.config import run_config_from_dict

    section, name = key.split(".")
    with pytest.raises(ConfigError, match=message):
        run_config_from_dict({section: {name: value}})


@pytest.mark.parametrize(
    "text",
    [
        "",
        "# only a comment\n",
        "name: x\ntrain:\n  steps: 10\n",
        "preset: smoke\n",
        "variant: oelm_freeze\nmodel:\n  n_layer: 2\n",
    ],
)
def test_a_parameter_file_without_preset_or_variant_is_refused(tmp_path, text):
    """An empty file silently trained the Medium-512 defaults (a 539 MB checkpoint on a CPU): a
    parameter file must say which model it trains. Built from defaults or a mapping (studies,
    sweeps, notebooks, tests), a RunConfig still needs neither."""
    from oelm_core.config import PRESETS, variants
    from oelm_core.train import main

    path = tmp_path / "p.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        load_run_config(path)
    message = str(exc.value)
    given = [k for k in ("preset", "variant") if f"{k}:" in text]
    missing = [k for k in ("preset", "variant") if k not in given]
    assert message.startswith(
        f"{path} does not say which model to train: it has no {' or '.join(f'`{k}:`' for k in missing)}; "
    )
    assert "a parameter file holds at least `preset:` and `variant:`" in message
    assert f"presets: {', '.join(PRESETS)}" in message and f"variants: {', '.join(variants())}" in message
    assert "see parameters/smoke/oelm_freeze.yaml" in message and "\n" not in message
    assert main(["--params", str(path)]) == 2
    # Given with --set they count: the file and its overrides are what trains.
    cfg = load_run_config(path, ["preset=smoke", "variant=gpt_base"])
    assert (cfg.preset, cfg.variant) == ("smoke", "gpt_base")
    assert load_run_config(None).preset == "medium512" and run_config_from_dict({}).variant == "gpt_base"


def test_a_study_or_sweep_file_passed_as_a_parameter_file_names_its_runner(tmp_path):
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    with pytest.raises(
        ConfigError,
        match=r"study_smoke\.yaml is a plan file \(it has the `experiment:` section\): "
        r"run it with python -m oelm_core run ",
    ):
        load_run_config(repo / "parameters" / "study_smoke.yaml")
    sweep = tmp_path / "s.yaml"
    sweep.write_text("sweep:\n  variants: [gpt_base]\n")
    with pytest.raises(
        ConfigError,
        match=r"s\.yaml is a plan file \(it has the `sweep:` section\): run it "
        r"with python -m oelm_core run ",
    ):
        load_run_config(sweep)
