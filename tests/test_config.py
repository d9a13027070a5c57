"""The one config schema: parameter files, --set overrides, and errors that name the fix."""

import pytest

from oelm_core.config import ConfigError, apply_overrides, load_run_config, run_config_from_dict


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
    path.write_text("name: x\nvariant: oelm_freeze\nmodel:\n  n_layer: 2\ntrain:\n  steps: 10\n")
    cfg = load_run_config(path, ["train.lr=0.001", "model.freeze_qk=[0]", "data.source=/tmp/d"])
    assert cfg.train.steps == 10 and cfg.train.lr == 1e-3 and cfg.data.source == "/tmp/d"
    m = cfg.model_config()
    assert m.n_layer == 2 and m.frozen_layers() == [0] and m.qk_init == "qr"


def test_unknown_key_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) params\.train\.stepz; valid keys in "
                                          r"params\.train: .*steps"):
        run_config_from_dict({"train": {"stepz": 5}})


def test_wrong_type_names_key_and_expected_type():
    with pytest.raises(ConfigError, match=r"params\.train\.steps should be int, got str 'abc'"):
        run_config_from_dict({"train": {"steps": "abc"}})
    with pytest.raises(ConfigError, match=r"params\.train should be a mapping|must be a mapping"):
        run_config_from_dict({"train": 5})


def test_invalid_model_fails_at_load_time():
    with pytest.raises(ConfigError, match="does not divide"):
        run_config_from_dict({"model": {"n_head": 5}})


def test_missing_file_and_bad_override(tmp_path):
    with pytest.raises(ConfigError, match="not found; pass an existing YAML file"):
        load_run_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="expects key=value"):
        apply_overrides({}, ["train.steps"])
