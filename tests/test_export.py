"""oelm_core.export: the safetensors folder reloads every variant bit for bit without pickle; the
transformers folder is a GPT-2 whose logits, greedy tokens and tokenizer are ours; the
Synthesizer and anything else that is no GPT-2 are refused with the reason; the CLI's errors."""

import dataclasses
import json
import os
import pickle
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import tiktoken
import torch
from safetensors import safe_open

from oelm_core.accounting import count_parameters
from oelm_core.checkpoint import save_checkpoint
from oelm_core.data import EOT
from oelm_core.export import (
    ExportError,
    find_gpt2_tokenizer,
    load_export,
    load_safetensors,
    load_transformers,
    main,
    to_safetensors,
    to_transformers,
)
from oelm_core.generate import SamplingConfig, stream_tokens
from oelm_core.model import build_model

REPO = Path(__file__).resolve().parents[1]
STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "sunshine. One day, she saw a big, red ball in the park."
)
# Unicode, digits, contractions and whitespace runs: where BPE pre-tokenisers differ.
SAMPLE = (
    "Tom's dog isn't big -- it's   tiny!\n\n  He said: \"Ça va?\" 3.14159 apples 🍎🐶, naïve "
    "café\t\ttabs  and  spaces\r\nend.   "
)


def perturbed(preset: str, variant: str, **overrides):
    """A model whose every float tensor, frozen buffers and POET's rotation generators included,
    is moved off its initialisation: biases become non-zero and R, P of POET differ from I, so a
    wrong transpose or a dropped tensor changes the outputs."""
    model = build_model(preset, variant, seed=3, **overrides)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.randn(t.shape, generator=g) * 0.05)
    return model.eval()


@pytest.fixture(scope="module")
def gpt2_bpe():
    if "TIKTOKEN_CACHE_DIR" not in os.environ:
        pytest.skip("TIKTOKEN_CACHE_DIR is not set: no offline GPT-2 tokenizer files")
    return tiktoken.get_encoding("gpt2")


# --------------------------------------------------------------------------------------------
# safetensors
# --------------------------------------------------------------------------------------------


def refuse_pickle(*args, **kwargs):
    raise AssertionError("load_safetensors unpickled something")


@pytest.mark.parametrize("variant", ["gpt_base", "oelm_freeze", "oelm_poet", "synth_factorized", "oelm_freeze_deep"])
def test_safetensors_round_trip_is_bit_exact_without_pickle(tmp_path, monkeypatch, variant):
    model = perturbed("tiny", variant)
    folder = to_safetensors(model, tmp_path / "export")
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    for name in ("load", "loads", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse_pickle)
    monkeypatch.setattr(torch, "load", refuse_pickle)
    loaded = load_safetensors(folder)
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert list(theirs) == list(ours)
    assert all(theirs[k].dtype == ours[k].dtype and torch.equal(theirs[k], ours[k]) for k in ours)
    # frozen Q/K come back as buffers, trainable ones as parameters
    assert [n for n, _ in loaded.named_buffers()] == [n for n, _ in model.named_buffers()]
    assert count_parameters(loaded) == count_parameters(model)
    x = torch.randint(0, model.cfg.vocab_size, (2, 16))
    assert torch.equal(loaded(x), model(x)) and not loaded.training
    info = json.loads((folder / "config.json").read_text())
    assert (info["format"], info["format_version"], info["preset"], info["variant"]) == (
        "oelm-core/safetensors",
        1,
        "tiny",
        variant,
    )
    assert info["parameters"] == {k: count_parameters(model)[k] for k in ("trainable", "frozen", "total")}
    card = (folder / "README.md").read_text()
    assert f"| variant | `{variant}`" in card and f"{count_parameters(model)['total']:,} total" in card


def test_progressive_unfreezing_and_untied_output_survive_the_round_trip(tmp_path):
    """The layers unfrozen during training come back trainable, those still frozen frozen; tied
    embeddings are one tensor in the file (safetensors refuses a tensor stored twice), an untied
    output layer has its own."""
    model = perturbed("tiny", "oelm_freeze")
    model.unfreeze_qk([0])
    loaded = load_safetensors(to_safetensors(model, tmp_path / "unfrozen"))
    assert [b.attn.qk.frozen for b in loaded.blocks] == [False, True]
    assert json.loads((tmp_path / "unfrozen" / "config.json").read_text())["qk"]["frozen_layers"] == [1]
    with safe_open(tmp_path / "unfrozen" / "model.safetensors", "pt") as f:
        assert "wte.weight" in f.keys() and "lm_head.weight" not in f.keys()
    untied = perturbed("tiny", "gpt_base", tie_embeddings=False)
    loaded = load_safetensors(to_safetensors(untied, tmp_path / "untied"))
    assert torch.equal(loaded.lm_head.weight, untied.lm_head.weight)
    assert loaded.lm_head.weight.data_ptr() != loaded.wte.weight.data_ptr()


def test_what_is_not_an_export_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ExportError, match=r"holds no config\.json: pass a folder that oelm_core\.export wrote"):
        load_safetensors(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ExportError, match=r"not an OELM safetensors export.*AutoModelForCausalLM"):
        load_safetensors(tmp_path)
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.md").write_text("mine")
    with pytest.raises(ExportError, match=r"holds files that no export writes \(notes\.md\)"):
        to_safetensors(build_model("tiny"), project)
    assert [p.name for p in project.iterdir()] == ["notes.md"]


def test_without_safetensors_the_error_says_what_to_install(tmp_path, monkeypatch):
    """The trainer imports oelm_core.export; a GPU image without safetensors must still train (the
    session logs this message instead of writing export/)."""
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ExportError, match=r"safetensors package is not installed: pip install safetensors"):
        to_safetensors(build_model("tiny"), tmp_path / "st")
    assert not (tmp_path / "st").exists()


# --------------------------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------------------------

# The groups, POET (R W0 P composed into one weight), and a Gaussian Q/K at gain 2 with the
# biases GPT-2 has and ours may lack (V and output projection: on; MLP and LayerNorm: off) and
# an untied output layer.
GPT2_CASES = {
    "gpt_base": ("gpt_base", {}),
    "oelm_freeze": ("oelm_freeze", {}),
    "oelm_poet": ("oelm_poet", {}),
    "gaussian_gain2_biases_untied": (
        "oelm_freeze_gaussian",
        dict(qk_gain=2.0, attn_bias=True, bias=False, tie_embeddings=False),
    ),
}


@pytest.mark.parametrize("case", GPT2_CASES)
def test_transformers_gpt2_gives_our_logits_and_greedy_tokens(tmp_path, gpt2_bpe, case):
    transformers = pytest.importorskip("transformers")
    variant, overrides = GPT2_CASES[case]
    model = perturbed("smoke", variant, **overrides)
    folder = to_transformers(model, tmp_path / "hf")
    gpt2 = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert type(gpt2).__name__ == "GPT2LMHeadModel" and gpt2.config.vocab_size == 50257
    ids = torch.tensor([gpt2_bpe.encode_ordinary(STORY)])
    with torch.no_grad():
        ours, theirs = model(ids), gpt2(ids).logits
    assert ours.shape == theirs.shape == (1, ids.shape[1], 50257)
    assert (ours - theirs).abs().max().item() < 1e-4, (ours - theirs).abs().max().item()

    prompt = ids[:, :12]
    want = list(stream_tokens(model, prompt[0].tolist(), SamplingConfig(temperature=0.0, max_new_tokens=24)))
    with torch.no_grad():
        out = gpt2.generate(
            prompt, max_new_tokens=24, do_sample=False, attention_mask=torch.ones_like(prompt), pad_token_id=EOT
        )
    got = out[0, prompt.shape[1] :].tolist()
    if got and got[-1] == EOT:  # transformers keeps the end token it stopped at; ours does not
        got = got[:-1]
    assert got == want and len(want) > 0

    # The check can see a transpose: layer 0's W_q given as (out, in) moves the logits by far more.
    with torch.no_grad():
        c_attn, d = gpt2.transformer.h[0].attn.c_attn.weight, model.cfg.d_model
        c_attn[:, :d] = c_attn[:, :d].T.clone()
        assert (gpt2(ids).logits - ours).abs().max().item() > 1e-2


@pytest.mark.parametrize("case", ["gpt_base", "oelm_freeze", "gaussian_gain2_biases_untied"])
def test_a_transformers_export_loads_back_without_transformers(tmp_path, monkeypatch, case):
    """load_transformers is gpt2_weights' inverse: the same variant (frozen layers frozen again) and
    the same logits, from JSON and safetensors alone; POET, whose rotations the export composed
    away, and a GPT-2 oelm_core did not write are refused saying why."""
    pytest.importorskip("transformers")
    variant, overrides = GPT2_CASES[case]
    model = perturbed("smoke", variant, **overrides)
    folder = to_transformers(model, tmp_path / "hf", card={"step": 1234, "val_ppl": 19.5})
    poet = to_transformers(perturbed("smoke", "oelm_poet"), tmp_path / "poet")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    monkeypatch.setitem(sys.modules, "transformers", None)  # importing it now would fail
    back, card = load_export(folder)
    assert back.cfg == model.cfg and card["step"] == 1234 and card["val_ppl"] == 19.5
    assert count_parameters(back) == count_parameters(model)
    ids = torch.randint(0, 50257, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (back(ids) - model.eval()(ids)).abs().max().item() < 1e-5

    with pytest.raises(ExportError, match="POET's rotations cannot be recovered; load its safetensors export"):
        load_transformers(poet)
    foreign = json.loads((folder / "config.json").read_text())
    del foreign["oelm"]
    (folder / "config.json").write_text(json.dumps(foreign))
    with pytest.raises(ExportError, match="a transformers model that oelm_core did not export"):
        load_transformers(folder)


def test_transformers_tokenizer_is_tiktoken_gpt2(tmp_path, gpt2_bpe):
    transformers = pytest.importorskip("transformers")
    folder = to_transformers(build_model("smoke", "oelm_freeze"), tmp_path / "hf")
    assert sorted(p.name for p in folder.iterdir()) == [
        "README.md",
        "config.json",
        "generation_config.json",
        "merges.txt",
        "model.safetensors",
        "tokenizer_config.json",
        "vocab.json",
    ]
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    for text in (STORY, SAMPLE):
        assert tokenizer(text)["input_ids"] == gpt2_bpe.encode_ordinary(text)
        assert tokenizer.decode(gpt2_bpe.encode_ordinary(text)) == text
    assert tokenizer("<|endoftext|>")["input_ids"] == gpt2_bpe.encode("<|endoftext|>", allowed_special="all") == [EOT]
    assert tokenizer.eos_token_id == EOT and tokenizer.model_max_length == 64
    card = (folder / "README.md").read_text()
    assert "library_name: transformers" in card and "AutoModelForCausalLM.from_pretrained" in card


@pytest.mark.parametrize("variant", ["synth_random", "synth_factorized"])
def test_the_synthesizer_is_refused_saying_why(tmp_path, variant):
    with pytest.raises(ExportError, match=r"the Synthesizer .* has no QK\^T at inference.*--format safetensors"):
        to_transformers(build_model("smoke", variant), tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_another_vocabulary_is_refused(tmp_path):
    with pytest.raises(ExportError, match=r"its vocabulary has 128 ids, not GPT-2's 50257"):
        to_transformers(build_model("tiny"), tmp_path / "hf")


def test_tokenizer_files_come_from_a_folder_or_tiktoken_cache_or_a_clear_error(tmp_path, monkeypatch, gpt2_bpe):
    vocab, merges = find_gpt2_tokenizer()
    assert vocab.name == "6c7ea1a7e38e3a7f062df639a5b80947f075ffe6"
    assert merges.name == "6d1cbeee0f20b3d9449abfede4726ed8212e3aee"
    named = tmp_path / "gpt2"
    named.mkdir()
    shutil.copyfile(vocab, named / "vocab.json")
    shutil.copyfile(merges, named / "merges.txt")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty"))
    with pytest.raises(
        ExportError,
        match=r"no GPT-2 tokenizer files: TIKTOKEN_CACHE_DIR=.*empty lacks "
        r"6c7ea1a7e38e3a7f062df639a5b80947f075ffe6, .*--tokenizer-dir",
    ):
        find_gpt2_tokenizer()
    assert find_gpt2_tokenizer(named) == (named / "vocab.json", named / "merges.txt")
    (named / "vocab.json").write_text(json.dumps({"a": 0}))
    with pytest.raises(ExportError, match=r"is not GPT-2's vocabulary"):
        find_gpt2_tokenizer(named)


# --------------------------------------------------------------------------------------------
# The CLI
# --------------------------------------------------------------------------------------------


def run_folder(tmp_path, variant: str):
    """A run folder as the trainer leaves it: best.pt (with its run config and figures) and
    summary.json."""
    model = perturbed("smoke", variant)
    run = tmp_path / "run"
    state = {
        "model": model.state_dict(),
        "model_config": dataclasses.asdict(model.cfg),
        "run_config": {
            "name": "smoke_s0",
            "preset": "smoke",
            "variant": variant,
            "train": {"seed": 7},
            "data": {"source": "roneneldan/TinyStories"},
        },
        "step": 40,
        "data": {"train_tokens": 3_700_000},
        "metrics": {"val_loss": 3.25, "val_ppl": 25.79, "val_bpb": 1.1234, "tokens_seen": 81_920, "epochs": 0.022},
    }
    save_checkpoint(state, run / "best.pt")
    (run / "summary.json").write_text(json.dumps({"status": "completed", "steps": 50}))
    return model, run


def test_cli_exports_a_run_folder_in_both_formats(tmp_path, capsys, gpt2_bpe):
    pytest.importorskip("transformers")
    model, run = run_folder(tmp_path, "oelm_freeze")
    out = tmp_path / "exported"
    assert main([str(run), "--out", str(out), "--format", "both"]) == 0
    assert capsys.readouterr().out.split() == [str(out / "safetensors"), str(out / "transformers")]
    assert torch.equal(load_safetensors(out / "safetensors")(torch.tensor([[1, 2]])), model(torch.tensor([[1, 2]])))
    card = (out / "safetensors" / "README.md").read_text()
    for row in (
        "# smoke_s0",
        "| preset | `smoke` |",
        "| seed | `7` |",
        "datasets: [roneneldan/TinyStories]",
        "| data | roneneldan/TinyStories (3,700,000 training tokens) |",
        "| trained | 40 steps of the run's 50 (completed), 81,920 tokens seen (0.02 epochs); weights: best.pt |",
        "| validation | loss 3.2500 nats/token, PPL 25.79, 1.1234 bits/byte (the run's lowest) |",
        "frozen (buffers) in layers [0, 1]",
    ):
        assert row in card, row
    assert "| seed | `7` |" in (out / "transformers" / "README.md").read_text()
    assert main([str(run), "--out", str(out), "--format", "both"]) == 0  # an earlier export is replaced


def test_cli_errors_are_one_line_with_exit_2(tmp_path, capsys):
    _, run = run_folder(tmp_path, "synth_random")
    _, gpt = run_folder(tmp_path / "gpt", "gpt_base")
    cases = [
        ([str(tmp_path / "absent.pt")], "checkpoint .*absent.pt not found"),
        ([str(tmp_path / "empty")], "holds no best.pt"),
        ([str(tmp_path / "junk.pt")], "could not be read .* not an OELM checkpoint"),
        ([str(run), "--format", "transformers"], "cannot export .* as a transformers GPT-2: the Synthesizer"),
        ([str(gpt), "--format", "both", "--tokenizer-dir", str(tmp_path)], "no GPT-2 tokenizer files"),
    ]
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    for argv, message in cases:
        assert main([*argv, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: "), err
        assert re.search(message, err), err
    assert not (tmp_path / "out").exists()
    assert main([str(gpt), "--out", str(tmp_path)]) == 2  # a folder of other files is not replaced
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds files that no export writes (empty, gpt, junk.pt, run)" in err
    with pytest.raises(SystemExit) as exit:
        main([str(run), "--out", str(tmp_path / "out"), "--format", "onnx"])
    assert exit.value.code == 2 and "invalid choice: 'onnx'" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# Edited, interrupted and shared exports
# --------------------------------------------------------------------------------------------


def edit(path, change) -> None:
    info = json.loads(path.read_text())
    change(info)
    path.write_text(json.dumps(info, indent=2))


@pytest.mark.parametrize("field, value", [("n_head", 8), ("freeze_qk", "none"), ("qk_gain", 2.0)])
def test_a_config_json_edited_without_changing_shapes_is_refused_naming_the_field(tmp_path, field, value):
    """n_head 4 -> 8 loaded silently with other logits; freeze_qk all -> none loaded the frozen
    model as trainable. model.safetensors keeps the ModelConfig it was written with in its
    metadata, and a config.json that says otherwise is refused, the field named."""
    model = perturbed("smoke", "oelm_freeze")
    folder = to_safetensors(model, tmp_path / "st")
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert json.loads(f.metadata()["oelm_model_config"]) == dataclasses.asdict(model.cfg)
    saved = getattr(model.cfg, field)
    edit(folder / "config.json", lambda info: info["model_config"].update({field: value}))
    with pytest.raises(ExportError) as refused:
        load_safetensors(folder)
    assert str(refused.value) == (
        f"{folder}/config.json does not describe model.safetensors: model_config.{field} is {json.dumps(value)} "
        f"there, {json.dumps(saved)} in the weights. config.json was edited (or comes from another export): put "
        f"back the weights' values, or export the model again from its checkpoint"
    )
    edit(folder / "config.json", lambda info: info["model_config"].update({field: saved}))
    assert torch.equal(load_safetensors(folder)(torch.tensor([[1, 2, 3]])), model(torch.tensor([[1, 2, 3]])))


def test_a_transformers_config_json_edited_is_refused_naming_the_field(tmp_path, gpt2_bpe):
    """The transformers folder: its 'oelm' entry is checked against the weights' metadata, and
    GPT-2's own keys (what transformers builds the model from) against the 'oelm' entry."""
    pytest.importorskip("transformers")
    folder = to_transformers(perturbed("smoke", "oelm_freeze"), tmp_path / "hf")
    edit(folder / "config.json", lambda info: info["oelm"]["model_config"].update(freeze_qk="none"))
    with pytest.raises(
        ExportError,
        match=r"config\.json does not describe model\.safetensors: model_config\."
        r"freeze_qk is \"none\" there, \"all\" in the weights",
    ):
        load_transformers(folder)
    edit(folder / "config.json", lambda info: info["oelm"]["model_config"].update(freeze_qk="all"))
    edit(folder / "config.json", lambda info: info.update(n_head=8))
    with pytest.raises(
        ExportError,
        match=r"config\.json disagrees with itself: n_head is 8 there, "
        r"model_config\.n_head 4 \(its 'oelm' entry\)",
    ):
        load_transformers(folder)


def strip_config_metadata(weights) -> None:
    """model.safetensors as an export written before the ModelConfig was kept in it."""
    from safetensors.torch import load_file, save_file

    save_file(load_file(weights), weights, metadata={"format": "pt"})


@pytest.mark.parametrize(
    "field, value, shown",
    [
        ("d_model", 128, "model_config.d_model is 128 in config.json, 64 in the weights (wte.weight (50304, 64))"),
        ("n_layer", 3, "model_config.n_layer is 3 in config.json, 2 in the weights (blocks.0 .. blocks.1)"),
        ("block_size", 128, "model_config.block_size is 128 in config.json, 64 in the weights (wpe.weight (64, 64))"),
        ("d_ff", 512, "model_config.d_ff is 512 in config.json, 256 in the weights (blocks.0.mlp.fc.weight (256, 64))"),
        (
            "vocab_size",
            60000,
            "model_config.vocab_size is 60032 in config.json, 50304 in the weights (wte.weight "
            "(50304, 64): its rows are the vocabulary padded to vocab_pad_multiple)",
        ),
    ],
)
def test_config_shapes_that_disagree_with_the_tensors_name_the_key(tmp_path, field, value, shown):
    """PyTorch's load_state_dict message, cut at 300 characters, named no config key. An export
    without the ModelConfig in its weights (an earlier one) is checked against the tensors'
    shapes; the message names the key, both values and the tensor that shows it, whole."""
    folder = to_safetensors(perturbed("smoke", "oelm_freeze"), tmp_path / "st")
    strip_config_metadata(folder / "model.safetensors")
    edit(folder / "config.json", lambda info: info["model_config"].update({field: value}))
    with pytest.raises(ExportError) as refused:
        load_safetensors(folder)
    assert str(refused.value) == (
        f"{folder}/config.json does not fit the tensors of model.safetensors: {shown} (the weights are a smoke "
        f"model's). config.json was edited "
        f"(or comes from another export): put back the weights' values, or export the model again from its "
        f"checkpoint"
    )


KILLED_EXPORT = """import os, signal, sys
import safetensors.torch
from oelm_core import export

real = safetensors.torch.save_file

def killed(tensors, path, metadata=None):
    with open(path, "wb") as f:
        f.write(b"half a file")
    os.kill(os.getpid(), signal.SIGKILL)

safetensors.torch.save_file = killed
export.main(sys.argv[1:])
"""


@pytest.mark.parametrize("fmt", ["safetensors", "both"])
def test_an_export_killed_mid_way_does_not_block_the_same_command(tmp_path, capsys, fmt, gpt2_bpe):
    """Killed (SIGKILL) while writing model.safetensors, an export left `.safetensors.*.tmp` in
    --out, and the same command run again was refused for it. Now it removes what the killed one
    left and writes the export; nothing else is there."""
    if fmt == "both":
        pytest.importorskip("transformers")
    model, run = run_folder(tmp_path, "oelm_freeze")
    out = tmp_path / "exported"
    argv = [str(run), "--out", str(out), "--format", fmt]
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_EXPORT, *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    left = sorted(p.name for p in (out if fmt == "both" else tmp_path).iterdir() if p.name.startswith("."))
    assert left and all(re.fullmatch(r"\.(safetensors|exported)\.(\w+\.tmp|lock)", n) for n in left), left
    assert main(argv) == 0
    capsys.readouterr()
    everything = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.name.startswith("."))
    assert everything == []
    folder = out / "safetensors" if fmt == "both" else out
    assert torch.equal(load_safetensors(folder)(torch.tensor([[1, 2]])), model(torch.tensor([[1, 2]])))


def test_exported_files_are_readable_by_the_group_and_others(tmp_path, gpt2_bpe):
    """safetensors 0.8 writes model.safetensors owner-only (0600) while every other output is
    0644: colleagues on a shared file system could not read the weights. Every exported file is
    0644 and every folder 0755, whatever the umask."""
    pytest.importorskip("transformers")
    _, run = run_folder(tmp_path, "oelm_freeze")
    umask = os.umask(0o077)
    try:
        assert main([str(run), "--out", str(tmp_path / "exported"), "--format", "both"]) == 0
    finally:
        os.umask(umask)
    modes = {str(p.relative_to(tmp_path)): stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "exported").rglob("*")}
    assert modes["exported/safetensors/model.safetensors"] == modes["exported/transformers/model.safetensors"] == 0o644
    assert all(mode == (0o755 if (tmp_path / name).is_dir() else 0o644) for name, mode in modes.items()), modes


def test_a_typed_end_of_text_is_the_token_for_the_project_and_the_exported_tokenizer(tmp_path, gpt2_bpe):
    """`<|endoftext|>` typed into a prompt was plain text to the project (encode_ordinary: 7
    tokens) and the end-of-text token to the exported tokenizer. In a prompt it is the token
    (id 50256), the break between stories the models learned, for the demo, generate() and the
    export alike; a story file's own text still stays text (data.encode_prompt's docstring)."""
    transformers = pytest.importorskip("transformers")
    from oelm_core import data
    from oelm_core.generate import SamplingConfig, generate

    folder = to_transformers(build_model("smoke", "oelm_freeze"), tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = "The bird sang.<|endoftext|>Once upon a time"
    ids = data.encode_prompt(prompt)
    assert ids == tokenizer(prompt)["input_ids"] and ids.count(EOT) == 1
    assert ids == gpt2_bpe.encode_ordinary("The bird sang.") + [EOT] + gpt2_bpe.encode_ordinary("Once upon a time")
    assert data._encode_chunk(["a <|endoftext|> b"])[0].tolist().count(EOT) == 1  # a story's text: only its end
    model = perturbed("smoke", "oelm_freeze")
    cfg = SamplingConfig(temperature=0, max_new_tokens=8)
    assert generate(model, prompt, cfg) == gpt2_bpe.decode(list(stream_tokens(model, ids, cfg)))
