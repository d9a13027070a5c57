"""The Gradio demo (app/): loading, side-by-side streaming generation, attention maps, input
checks and the error page, driven through gradio_client against a live server on a free port."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

gr = pytest.importorskip("gradio")
gradio_client = pytest.importorskip("gradio_client")

from oelm_core import build_model, model_config  # noqa: E402
from oelm_core.checkpoint import save_checkpoint  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GROUPS = ("gpt_base", "oelm_nofreeze", "oelm_freeze")
PROMPT = "Once upon a time there was a little cat"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_checkpoints(folder: Path, variants=GROUPS) -> dict[str, Path]:
    """Smoke-sized checkpoints (real GPT-2 vocabulary, 2 layers, 4 heads, context 64) per variant."""
    paths = {}
    for i, variant in enumerate(variants):
        model = build_model("smoke", variant, seed=i)
        paths[variant] = save_checkpoint(
            {
                "model": model.state_dict(),
                "model_config": dataclasses.asdict(model.cfg),
                "step": 100 * (i + 1),
                "metrics": {"val_loss": 3.0 + i, "val_ppl": 20.0 + i},
            },
            folder / f"{variant}.pt",
        )
    return paths


def start_app(lab):
    """Build and serve the page on a free port in this process; returns (demo, url)."""
    from app.demo import build_demo, launch

    demo = build_demo(lab)
    port = free_port()
    launch(demo, port=port, prevent_thread_lock=True, quiet=True)
    return demo, f"http://127.0.0.1:{port}/"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    return make_checkpoints(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def served(checkpoints):
    from app.lab import load_lab

    demo, url = start_app(load_lab(checkpoints, "cpu", "test checkpoints"))
    client = gradio_client.Client(url, verbose=False)
    yield demo, client
    demo.close()


def served_image(plot: dict) -> "np.ndarray":
    """A gr.Plot as the client receives it (a matplotlib figure as an image data URL), in grey
    levels 0-255 (height, width)."""
    import base64
    import io

    from PIL import Image

    assert plot["type"] == "matplotlib" and plot["plot"].startswith("data:image/"), str(plot)[:80]
    data = base64.b64decode(plot["plot"].split(",", 1)[1])
    return np.asarray(Image.open(io.BytesIO(data)).convert("L"), dtype=np.float64)


def generate(client, prompt=PROMPT, max_new=16, temperature=0.9, top_k=50, top_p=0.95, seed=7):
    return client.predict(prompt, max_new, temperature, top_k, top_p, seed, api_name="/generate")


# ---- loading and the model cards ------------------------------------------------------------


def test_cards_show_shape_parameters_and_metrics(served, checkpoints):
    demo, _ = served
    from app.demo import model_card

    lab = demo.oelm.lab
    assert [m.group for m in lab.models] == list(GROUPS) and lab.device == "cpu"
    frozen = lab.models[2]
    assert frozen.counts["frozen"] == 2 * 2 * 64 * 64  # W_q and W_k of both layers
    card = model_card(frozen, lab.device)
    for text in (
        "OELM-Freeze",
        "2 layers",
        "d_model 64",
        "4 heads",
        "context 64",
        f"{frozen.counts['total']:,}",
        f"{frozen.counts['trainable']:,}",
        "16,384",
        "22.00",
        "| step | 300",
    ):
        assert text in card, text


# ---- generation -----------------------------------------------------------------------------


def test_generation_streams_three_deterministic_texts(served):
    _, client = served
    job = client.submit(PROMPT, 16, 0.9, 50, 0.95, 7, api_name="/generate")
    final = job.result(timeout=120)
    steps = job.outputs()
    assert len(final) == 3 and all(isinstance(t, str) and t for t in final)
    assert len(steps) > 3, "the texts should arrive in several updates, not at once"
    assert all(len(s) == 3 for s in steps)
    # Round-robin: every model's text grows over the updates (none is finished before another starts).
    mid = steps[len(steps) // 2]
    assert all(0 < len(mid[i]) <= len(final[i]) for i in range(3))

    again = generate(client, seed=7)
    other = generate(client, seed=8)
    assert tuple(again) == tuple(final)
    assert tuple(other) != tuple(final)
    assert all(a != b for a, b in zip(other, final))


def test_generation_matches_oelm_core(served):
    """The app adds nothing to sampling: each column is oelm_core.generate's text for that model."""
    demo, client = served
    from oelm_core.generate import SamplingConfig
    from oelm_core.generate import generate as core_generate

    texts = generate(client, max_new=12, seed=3)
    for m, text in zip(demo.oelm.lab.models, texts):
        cfg = SamplingConfig(max_new_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=3)
        assert core_generate(m.model, PROMPT, cfg) == text


def test_the_pages_sampling_defaults_draw_the_analysis_samples(served):
    """Temperature and top-p are SamplingConfig's and top-k the analysis' (the page offered top-k
    50, the 04 notebook sampled with 40): with the sliders untouched, each column is the text
    analysis.sample_generations draws from that model with the same seed."""
    from oelm_core import analysis as A
    from oelm_core.generate import SamplingConfig

    demo, client = served
    sliders = {c.label: c.value for c in demo.blocks.values() if isinstance(c, gr.Slider)}
    assert sliders["temperature"] == SamplingConfig.temperature and sliders["top-p"] == SamplingConfig.top_p
    assert sliders["top-k"] == A.SAMPLE_TOP_K
    texts = generate(
        client, max_new=12, temperature=sliders["temperature"], top_k=sliders["top-k"], top_p=sliders["top-p"], seed=3
    )
    models = {m.label: m.model for m in demo.oelm.lab.models}
    assert [s["text"] for s in A.sample_generations(models, PROMPT, 12, seed=3)] == list(texts)


# ---- attention ------------------------------------------------------------------------------


def test_attention_endpoint_returns_t_by_t_maps(served):
    """Over the prompt's ids and the ids the model sampled (kept in the session), not the text
    encoded again."""
    from oelm_core.analysis.heatmaps import token_label
    from oelm_core.generate import SamplingConfig, stream_tokens

    demo, client = served
    texts = generate(client, max_new=10, seed=11)
    enc = demo.oelm.enc
    for group, layer, head in (("oelm_freeze", 1, "2"), ("gpt_base", 0, "mean")):
        heat, compare, summary, table, details = client.predict(
            PROMPT, group, layer, head, *texts, api_name="/attention"
        )
        cfg = SamplingConfig(max_new_tokens=10, temperature=0.9, top_k=50, top_p=0.95, seed=11)
        ids = enc.encode_ordinary(PROMPT)
        ids += list(stream_tokens(demo.oelm.lab.by_group(group).model, ids, cfg))
        t = len(ids)
        assert details["tokens"] == [token_label(enc.decode([i])) for i in ids]
        assert details["n_tokens"] == t and details["shape"] == [t, t]
        assert details["layer"] == layer and details["model"] == group
        images = [served_image(plot) for plot in (heat, compare, summary)]
        for image in images:  # drawn figures, not blank canvases
            assert min(image.shape) > 200 and image.std() > 10, image.shape
        assert not any(a.shape == b.shape and np.array_equal(a, b) for a, b in itertools.combinations(images, 2))
        # 3 models x 2 layers x 4 heads of per-head summaries
        rows = table["data"] if isinstance(table, dict) else table
        assert len(rows) == 24
        qk = {(r[0], r[3]) for r in rows}
        assert ("OELM-Freeze", "frozen") in qk and ("GPT-Base", "trainable") in qk


def test_attention_figure_content_and_no_leak(served):
    """The heatmap's image is the T x T map of the chosen head; figures never pile up in pyplot."""
    import matplotlib.pyplot as plt

    demo, _ = served
    h = demo.oelm
    texts = ("", " a", " dog and a cat")
    before = len(plt.get_fignums())
    for _ in range(3):  # text from elsewhere (no generation behind it): the text is encoded
        heat, compare, summary, table, details = h.attention(PROMPT, "oelm_nofreeze", 1, "3", None, *texts)
    t = len(h.enc.encode_ordinary(PROMPT + texts[1]))
    image = heat.axes[0].images[0].get_array()
    assert image.shape == (t, t) and details["shape"] == [t, t]
    rows = np.asarray(image)
    assert np.allclose(rows.sum(1), 1.0, atol=1e-4) and np.allclose(np.triu(rows, 1), 0.0)  # causal softmax
    assert [len(ax.images) for ax in compare.axes if ax.images] == [1, 1, 1]
    assert len(table) == 24
    assert len(plt.get_fignums()) == before  # built without pyplot: nothing to accumulate


@pytest.mark.parametrize("head", ["3", "mean"])
def test_attention_figures_show_the_chosen_layer_and_head_of_each_model(served, head):
    """The heatmap is the chosen model's map of that layer and head (or their mean), and each
    panel of the comparison is its own model's, over the same tokens."""
    from oelm_core.analysis import attention_maps

    h = served[0].oelm
    texts = ("", " a", " dog and a cat")
    heat, compare, _, _, details = h.attention(PROMPT, "oelm_nofreeze", 1, head, None, *texts)
    ids = h.enc.encode_ordinary(PROMPT + texts[1])

    def expected(m):
        att = attention_maps(m.model, ids)[1][1]
        return (att.mean(0) if head.startswith("mean") else att[int(head)]).numpy()

    chosen = h.lab.by_group("oelm_nofreeze")
    np.testing.assert_allclose(np.asarray(heat.axes[0].images[0].get_array()), expected(chosen), atol=1e-6)
    panels = [np.asarray(ax.images[0].get_array()) for ax in compare.axes if ax.images]
    for panel, m in zip(panels, h.lab.models, strict=True):
        np.testing.assert_allclose(panel, expected(m), atol=1e-6)
    assert not np.allclose(panels[0], panels[1])  # the models differ, so a mix-up would show


def test_one_attention_request_reads_each_models_attention_once(served, monkeypatch):
    """The maps drawn and the per-head summary come from one attention forward per model."""
    from oelm_core.model import GPT

    calls = []
    real = GPT.forward_with_attention
    monkeypatch.setattr(GPT, "forward_with_attention", lambda self, *a, **k: calls.append(self) or real(self, *a, **k))
    served[0].oelm.attention(PROMPT, "gpt_base", 0, "0", None, " a", " b", " c")
    assert len(calls) == 3 and len({id(m) for m in calls}) == 3


def test_attention_over_a_text_longer_than_the_context_maps_its_last_tokens(served):
    from oelm_core.analysis.heatmaps import token_label

    h = served[0].oelm
    long = " and the cat ran" * 30
    ids = h.enc.encode_ordinary(PROMPT + long)
    assert len(ids) > h.context == 64
    *_, details = h.attention(PROMPT, "gpt_base", 0, "0", None, long, "", "")
    assert details["n_tokens"] == 64
    assert details["tokens"] == [token_label(h.enc.decode([i])) for i in ids[-64:]]


def test_attention_maps_the_sampled_ids_where_encoding_the_text_again_merges_otherwise(served, monkeypatch):
    """' ape' 'rote' decode to ' aperote', which encodes as ' a' 'per' 'ote': the map of the text
    encoded again showed tokens (and a length) the model never read."""
    import app.demo

    demo, _ = served
    h, enc = demo.oelm, demo.oelm.enc
    forced = [enc.encode_single_token(t) for t in (" Feng", " ape", "rote")]
    monkeypatch.setattr(app.demo, "stream_tokens", lambda model, ids, cfg: iter(forced))
    *texts, generated = list(h.generate(PROMPT, 3, 0.8, 50, 1.0, 1))[-1]
    assert texts == [" Feng aperote"] * 3
    prompt_ids = enc.encode_ordinary(PROMPT)
    assert len(enc.encode_ordinary(PROMPT + texts[2])) == len(prompt_ids) + 4  # encoding again differs
    *_, details = h.attention(PROMPT, "oelm_freeze", 0, "mean", generated, *texts)
    assert details["n_tokens"] == len(prompt_ids) + 3 and details["shape"] == [len(prompt_ids) + 3] * 2
    assert details["tokens"][-3:] == ["\u00b7Feng", "\u00b7ape", "rote"]
    # The prompt edited after generating: the kept ids no longer belong to it, the text is encoded.
    *_, details = h.attention(PROMPT + "!", "oelm_freeze", 0, "mean", generated, *texts)
    assert details["n_tokens"] == len(enc.encode_ordinary(PROMPT + "!" + texts[2]))


# ---- input checks ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(prompt="   "), "The prompt is empty"),
        (dict(prompt="dog " * 80), "shorten it to fewer than 64 tokens"),
        (dict(prompt=123), "prompt must be text, got int 123"),
        (dict(temperature=5.0), "temperature must be between 0.0 and 2.0, got 5.0"),
        (dict(top_p=0.0), "top_p must be between 0.01 and 1.0, got 0.0"),
        (dict(max_new=0), "max_new_tokens must be between 1 and 512, got 0"),
        (dict(seed=-1), "seed must be between 0 and 2147483647, got -1"),
        (dict(top_k=2.5), "top_k must be a whole number between 0 and 1000, got 2.5"),
        (dict(max_new="abc"), "max_new_tokens must be a number between 1 and 512, got 'abc'"),
        (dict(top_k=[3]), "top_k must be a number between 0 and 1000, got [3]"),
        (dict(seed=True), "seed must be a number between 0 and 2147483647, got True"),
        (dict(temperature=None), "temperature is empty: enter a number between 0.0 and 2.0"),
    ],
)
def test_bad_generation_inputs_get_clear_messages(served, args, message):
    """Through the API every value reaches the app's own checks, whose message names the setting,
    the value and its range: Gradio's slider check answered first ("Value 0 is less than minimum
    value 1."), and a value of the wrong type got "Could not preprocess input component at index 1"."""
    _, client = served
    with pytest.raises(Exception) as err:
        generate(client, **args)
    assert message in str(err.value)
    assert "minimum value" not in str(err.value) and "preprocess" not in str(err.value)


@pytest.mark.parametrize(
    "args, message",
    [
        (dict(prompt=""), "prompt is empty"),
        (dict(temperature=-1), "temperature must be between 0.0 and 2.0"),
        (dict(top_p=1.5), "top_p must be between 0.01 and 1.0"),
        (dict(top_k=2.5), "top_k must be a whole number"),
        (dict(max_new_tokens=None), "max_new_tokens is empty"),
        (dict(seed="x"), "seed must be a number"),
    ],
)
def test_handler_names_the_bad_value(served, args, message):
    """Called directly (scripts, other front ends), the handler checks every value by name."""
    demo, _ = served
    values = dict(prompt=PROMPT, max_new_tokens=5, temperature=0.8, top_k=0, top_p=1.0, seed=1) | args
    with pytest.raises(gr.Error, match=message):
        next(demo.oelm.generate(*values.values()))


@pytest.mark.parametrize(
    "model, layer, head, message",
    [
        ("gpt_base", 2, "mean", "GPT-Base has layers 0..1; layer 2 does not exist"),
        ("gpt_base", -1, "mean", "GPT-Base has layers 0..1; layer -1 does not exist"),
        ("gpt_base", "x", "mean", "layer must be a layer number 0..1, got 'x'"),
        ("gpt_base", 0, "4", "GPT-Base has heads 0..3; head 4 does not exist"),
        ("gpt_base", 0, "x", "head must be 'mean' or a head number 0..3, got 'x'"),
        ("gpt2", 0, "mean", "unknown model 'gpt2'; choose one of gpt_base, oelm_nofreeze, oelm_freeze"),
    ],
)
def test_bad_attention_inputs(served, model, layer, head, message):
    """The handler names the setting, the value and the range, called directly and through the
    API (where the slider's and the dropdowns' own checks answered first, naming neither)."""
    demo, client = served
    with pytest.raises(gr.Error, match=re.escape(message)):
        demo.oelm.attention(PROMPT, model, layer, head, None, "", "", "")
    with pytest.raises(Exception) as err:
        client.predict(PROMPT, model, layer, head, "", "", "", api_name="/attention")
    assert message in str(err.value) and "list of choices" not in str(err.value)


def test_stop_cancels_generation_from_the_button_and_from_enter(served):
    demo, _ = served
    config = demo.get_config_file()
    elem = {c["id"]: c.get("props", {}).get("elem_id") for c in config["components"]}
    by_trigger = {}
    for i, dep in enumerate(config["dependencies"]):
        for target, event in dep["targets"]:
            by_trigger.setdefault((elem.get(target), event), []).append(dep.get("id", i))
    [click] = by_trigger[("generate-btn", "click")]
    [submit] = by_trigger[("prompt", "submit")]
    stops = [
        dep
        for dep in config["dependencies"]
        if ("stop-btn", "click") in {(elem.get(t), e) for t, e in dep["targets"]} and dep.get("cancels")
    ]
    assert [sorted(dep["cancels"]) for dep in stops] == [sorted([click, submit])]


def test_a_concurrency_below_one_is_refused(capsys):
    from app.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--concurrency", "0"])
    assert "--concurrency must be at least 1 (requests served at once), got 0" in capsys.readouterr().err
    assert parse_args(["--concurrency", "3"]).concurrency == 3


def test_queue_limits_concurrency(served):
    demo, _ = served
    gen = next(f for f in demo.fns.values() if f.api_name == "generate")
    assert gen.concurrency_limit == "default"  # the queue's default below
    assert demo._queue.default_concurrency_limit == 2 and demo._queue.max_size == 32


# ---- where checkpoints come from, and the error page ----------------------------------------


def test_study_resolution(tmp_path, checkpoints):
    from app.lab import lab_from_args, newest_study, study_checkpoints

    runs = tmp_path / "runs"
    old, new = runs / "old", runs / "smoke"
    for study in (old, new):
        study.mkdir(parents=True)
    entries = []
    for group in GROUPS:
        for seed in (1, 0):
            run_dir = new / f"{group}_s{seed}"
            run_dir.mkdir()
            (run_dir / "best.pt").write_bytes(checkpoints[group].read_bytes())
            entries.append(
                {
                    "name": f"{group}_s{seed}",
                    "variant": group,
                    "preset": "smoke",
                    "seed": seed,
                    "run_dir": f"{group}_s{seed}",
                }
            )
    (old / "study.json").write_text(json.dumps({"name": "old", "runs": []}))
    (new / "study.json").write_text(json.dumps({"name": "smoke", "created": "now", "status": "done", "runs": entries}))
    os.utime(old / "study.json", (time.time() - 100, time.time() - 100))
    assert newest_study(runs) == new / "study.json"
    paths = study_checkpoints(new)
    assert paths == {g: new / f"{g}_s0" / "best.pt" for g in GROUPS}
    lab = lab_from_args(runs_root=str(runs), device="cpu")
    assert lab.ok and [m.path for m in lab.models] == [paths[g] for g in GROUPS]

    empty = lab_from_args(runs_root=str(tmp_path / "nothing"), device="cpu")
    assert not empty.ok and "no study found" in empty.errors[0]
    bad = lab_from_args(ckpt=["gpt2=x.pt"])
    assert "unknown group 'gpt2'" in bad.errors[0]
    # a variant that is not one of the three groups is refused as the message says
    poet = lab_from_args(ckpt=["oelm_poet=x.pt"])
    assert "unknown group 'oelm_poet'; choose one of gpt_base, oelm_nofreeze, oelm_freeze" in poet.errors[0]


def trained_checkpoints(folder: Path, step: int = 3000, ppl: float = 18.5) -> dict[str, Path]:
    """Checkpoints of a width worth comparing (d_model 128), recorded as trained ``step`` steps to ``ppl``."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for i, variant in enumerate(GROUPS):
        model = build_model("smoke", variant, d_model=128, seed=i)
        paths[variant] = save_checkpoint(
            {
                "model": model.state_dict(),
                "model_config": dataclasses.asdict(model.cfg),
                "step": step,
                "metrics": {"val_ppl": ppl},
            },
            folder / f"{variant}_trained.pt",
        )
    return paths


def test_the_page_says_when_the_models_are_barely_trained(tmp_path, checkpoints):
    """Smoke-sized or barely trained models get a notice at the top naming each one's steps and
    perplexity, and the command that trains models worth comparing; trained ones get none."""
    from app.demo import build_demo, undertrained_notice
    from app.lab import MINI_COMMAND, load_lab

    smoke = load_lab(checkpoints, "cpu")
    notice = undertrained_notice(smoke)
    assert notice.startswith("**These models are barely trained: expect gibberish.**")
    assert "GPT-Base: 100 steps, validation perplexity 20, d_model 64" in notice
    assert "OELM-Freeze: 300 steps, validation perplexity 22, d_model 64" in notice
    assert f"`{MINI_COMMAND}`" in notice and "make demo" in notice
    assert component(build_demo(smoke).get_config_file(), "undertrained")["value"] == notice

    trained = load_lab(trained_checkpoints(tmp_path), "cpu")
    assert trained.ok and undertrained_notice(trained) is None
    ids = {c.get("props", {}).get("elem_id") for c in build_demo(trained).get_config_file()["components"]}
    assert "undertrained" not in ids and "source" in ids
    short = load_lab(trained_checkpoints(tmp_path / "short", step=400), "cpu")  # wide, but 400 steps
    assert "GPT-Base: 400 steps, validation perplexity 18, d_model 128" in undertrained_notice(short)


def write_study(folder: Path, summaries: dict[str, dict], age_s: float = 0.0) -> Path:
    """A study folder with one run per group, each holding ``summaries[group]`` as summary.json."""
    entries = []
    for group, summary in summaries.items():
        (folder / group).mkdir(parents=True)
        (folder / group / "summary.json").write_text(json.dumps(summary))
        entries.append({"name": group, "variant": group, "seed": 0, "run_dir": group})
    (folder / "study.json").write_text(json.dumps({"name": folder.name, "runs": entries}))
    os.utime(folder / "study.json", (time.time() - age_s, time.time() - age_s))
    return folder


def test_make_demo_serves_the_newest_trained_study_or_trains_the_mini_one(tmp_path, monkeypatch):
    """`make demo` (--train-mini): the newest study whose runs are trained, though a smoke study is
    newer; with none, on the CPU the newest study (its page carries the notice), on a GPU one seed
    of the mini study trained first, by the command the notice shows, into runs/tuned_mini.
    (Training the mini study is GPU work: here the command is recorded, not run.)"""
    import torch

    from app.__main__ import trained_or_mini_study
    from app.lab import MINI_COMMAND, trained_study

    runs = tmp_path / "runs"
    smoke = {g: {"steps": 150, "best_val_ppl": 900.0} for g in GROUPS}
    write_study(runs / "smoke", smoke)
    assert trained_study(runs) is None
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert trained_or_mini_study(str(runs)) == (None, 0)

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    assert trained_or_mini_study(str(runs)) == (str(runs / "tuned_mini"), 0)
    (cmd,) = calls
    assert cmd[1:] == [*MINI_COMMAND.split()[1:5], "--set", "experiment.seeds=[0]", "--out", str(runs / "tuned_mini")]

    mini = write_study(runs / "mini", {g: {"steps": 1500, "best_val_ppl": 18.2} for g in GROUPS}, age_s=100)
    assert trained_study(runs) == mini / "study.json"
    assert trained_or_mini_study(str(runs)) == (str(mini), 0) and len(calls) == 1
    half = dict(smoke, gpt_base={"steps": 1500, "best_val_ppl": 18.2})  # one group trained is not enough
    write_study(runs / "half", half, age_s=-100)
    assert trained_study(runs) == mini / "study.json"


def test_models_load_from_run_folders_and_both_export_formats(tmp_path, checkpoints):
    """--ckpt takes a checkpoint, a run folder (its best.pt), a safetensors export or a transformers
    export: each gives the checkpoint's model (same generation) and the card's step and
    perplexity; a folder that is none of these is named as such."""
    pytest.importorskip("transformers")
    from app.demo import model_card
    from app.lab import load_lab
    from oelm_core.checkpoint import load_model
    from oelm_core.export import to_safetensors, to_transformers
    from oelm_core.generate import SamplingConfig
    from oelm_core.generate import generate as core_generate

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "best.pt").write_bytes(checkpoints["gpt_base"].read_bytes())
    models = {g: load_model(checkpoints[g]) for g in GROUPS}
    card = {"step": 200, "val_ppl": 21.0}
    st = to_safetensors(models["oelm_nofreeze"][0], tmp_path / "st", card=card)
    hf = to_transformers(models["oelm_freeze"][0], tmp_path / "hf", card={"step": 300, "val_ppl": 22.0})
    lab = load_lab({"gpt_base": run_dir, "oelm_nofreeze": st, "oelm_freeze": hf}, "cpu")
    assert lab.ok, lab.errors
    cfg = SamplingConfig(max_new_tokens=12, temperature=0.9, top_k=50, seed=5)
    for m in lab.models:
        assert core_generate(m.model, PROMPT, cfg) == core_generate(models[m.group][0], PROMPT, cfg)
        steps, ppl = {"gpt_base": (100, "20.00"), "oelm_nofreeze": (200, "21.00"), "oelm_freeze": (300, "22.00")}[
            m.group
        ]
        text = model_card(m, "cpu")
        assert f"| step | {steps} |" in text and f"| validation perplexity | {ppl} |" in text
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = load_lab({"gpt_base": empty}, "cpu")
    assert "is a folder without best.pt or config.json" in bad.failed["gpt_base"]


def test_checkpoint_of_another_group_is_refused(checkpoints):
    """A GPT-Base checkpoint passed as OELM-Freeze would be labelled and compared as one."""
    from app.lab import load_lab

    lab = load_lab({"gpt_base": checkpoints["gpt_base"], "oelm_freeze": checkpoints["gpt_base"]}, "cpu")
    assert not lab.ok and [m.group for m in lab.models] == ["gpt_base"] and len(lab.errors) == 1
    msg = lab.errors[0]
    assert msg.startswith("OELM-Freeze (oelm_freeze): checkpoint") and "qk_init 'normal'" in msg
    assert "frozen Q/K layers [0, 1]" in msg and "pass it as --ckpt gpt_base=PATH" in msg


def test_synthesizer_and_poet_checkpoints_do_not_pass_for_a_group(tmp_path):
    """Same Q/K init and freezing as a group, another model: a Synthesizer (normal init, nothing
    frozen) passed as GPT-Base, a POET model (QR init, nothing frozen) as OELM-NoFreeze."""
    from app.lab import load_lab

    paths = make_checkpoints(tmp_path, ("synth_random", "oelm_poet"))
    lab = load_lab({"gpt_base": paths["synth_random"], "oelm_nofreeze": paths["oelm_poet"]}, "cpu")
    assert not lab.ok and lab.models == []
    synth, poet = lab.errors
    assert synth.startswith("GPT-Base (gpt_base)")
    assert "attention 'synth_random', but gpt_base has attention 'dot'" in synth
    assert "it is the synth_random variant, which the demo does not compare" in synth
    assert poet.startswith("OELM-NoFreeze (oelm_nofreeze)") and "poet_block_size 32" in poet
    assert "oelm_nofreeze has poet_block_size 0" in poet and "it is the oelm_poet variant" in poet


def test_every_registered_variant_is_its_own_group_only():
    """The fields compared come from the variant registry: no other variant passes for a group."""
    from app.lab import group_mismatch
    from oelm_core import VARIANTS

    for group in GROUPS:
        for variant in VARIANTS:
            mismatch = group_mismatch(group, model_config("smoke", variant))
            assert (mismatch is None) == (variant == group), (group, variant, mismatch)


def test_group_labels_are_the_analysis_labels(monkeypatch, checkpoints):
    """The app read its labels off the variant descriptions: a label changed in
    analysis.GROUP_LABELS (the tables' and figures') would have left the page with the old one."""
    from app import lab as app_lab
    from oelm_core import analysis as A

    assert GROUPS == tuple(A.GROUP_LABELS)
    monkeypatch.setitem(A.GROUP_LABELS, "oelm_freeze", "Frozen-QK")
    assert app_lab.group_label("oelm_freeze") == "Frozen-QK"
    lab = app_lab.load_lab({"oelm_freeze": checkpoints["oelm_freeze"]}, "cpu")
    assert [m.label for m in lab.models] == ["Frozen-QK"]


def test_card_perplexity_from_a_loss_alone(checkpoints):
    """A checkpoint with val_loss but no val_ppl: exp(loss) on the card, inf (not an
    OverflowError that kept the page from building) for a diverged loss."""
    from app.demo import model_card
    from app.lab import load_lab

    (m,) = load_lab({"gpt_base": checkpoints["gpt_base"]}, "cpu").models
    for loss, shown in ((2.0, "| validation perplexity | 7.39 |"), (1000.0, "| validation perplexity | inf |")):
        card = model_card(dataclasses.replace(m, state={"metrics": {"val_loss": loss}, "step": 5}), "cpu")
        assert shown in card


def test_importing_the_app_turns_gradio_analytics_off():
    """app/__init__.py sets it before anything imports gradio; app.demo and app.__main__ rely on it."""
    env = {k: v for k, v in os.environ.items() if k != "GRADIO_ANALYTICS_ENABLED"}
    env["PYTHONPATH"] = str(REPO)
    code = "import os, app.demo; print(os.environ['GRADIO_ANALYTICS_ENABLED'])"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr[-2000:]


def test_a_device_this_machine_lacks_is_named_as_such(monkeypatch, checkpoints):
    """Not reported as a checkpoint that cannot be loaded."""
    import torch

    from app.lab import SetupError, lab_from_args, load_lab, pick_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device("auto") == "cpu" and pick_device("cpu") == "cpu"
    with pytest.raises(SetupError, match=r"^--device 'gpu' is not a device: choose auto, cpu, cuda or cuda:N$"):
        pick_device("gpu")
    with pytest.raises(SetupError, match=r"^--device 'mps' is not supported: OELM Lab runs on the CPU or on CUDA GPUs"):
        pick_device("mps")
    for device in ("cuda", "cuda:1"):
        with pytest.raises(
            SetupError, match=rf"^--device is '{device}', but PyTorch finds no CUDA GPU.*set --device to cpu"
        ):
            pick_device(device)
    lab = lab_from_args(ckpt=[f"gpt_base={checkpoints['gpt_base']}"], device="cuda")
    assert not lab.ok and lab.models == [] and len(lab.errors) == 1 and lab.errors[0].startswith("--device is 'cuda'")
    lab = load_lab(checkpoints, "gpu")
    assert lab.models == [] and lab.errors == ["--device 'gpu' is not a device: choose auto, cpu, cuda or cuda:N"]


@pytest.mark.parametrize("gpus", [0, 2])
def test_the_demo_checks_a_device_as_the_trainer_does(monkeypatch, gpus):
    """pick_device had its own copy of the trainer's resolve_device checks, worded apart: both now
    run config.check_device, whose message names the demo's --device instead of train.device."""
    import torch

    from app.lab import SetupError, pick_device
    from oelm_core.config import ConfigError
    from oelm_core.distributed import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    for device in ("gpu", "mps", "cuda:2", "cuda" if gpus == 0 else "cuda:7"):
        with pytest.raises(ConfigError) as trainer:
            resolve_device(device)
        with pytest.raises(SetupError) as demo:
            pick_device(device)
        assert str(demo.value) == str(trainer.value).replace("train.device", "--device")
        assert "\n" not in str(demo.value)
    assert pick_device("cuda:1" if gpus else "cpu") == ("cuda:1" if gpus else "cpu")


def test_the_demo_does_not_import_the_trainer():
    """The device check lived in oelm_core.train, so the demo imported the whole trainer (its
    gradient exchange, torch.distributed) for one function; it is config.check_device now."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    trainer = ("oelm_core.train", "oelm_core.step", "oelm_core.distributed", "oelm_core.fast.peer_grads")
    code = f"import sys, app.demo; print(sorted(m for m in {trainer!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "[]", (out.stdout, out.stderr[-2000:])


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def test_error_page_replaces_the_panels_where_no_model_loads(tmp_path, checkpoints):
    from app.demo import build_demo
    from app.lab import load_lab

    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(checkpoints["oelm_freeze"].read_bytes()[:3000])
    lab = load_lab({"gpt_base": tmp_path / "missing.pt", "oelm_freeze": truncated}, "cpu")
    assert not lab.ok and lab.models == [] and len(lab.errors) == 2
    config = json.dumps(build_demo(lab).get_config_file())
    assert "The models could not be loaded" in config and "missing.pt not found" in config
    assert "truncated.pt could not be read" in config and "generate-btn" not in config


def checkpoint_of_another_shape(folder: Path, variant: str) -> Path:
    """A checkpoint whose weights (d_model 32) do not fit the model it describes (smoke: 64)."""
    narrow = build_model("smoke", variant, d_model=32, seed=5)
    return save_checkpoint(
        {"model": narrow.state_dict(), "step": 1, "model_config": dataclasses.asdict(model_config("smoke", variant))},
        folder / f"{variant}_narrow.pt",
    )


def component(config: dict, elem_id: str) -> dict:
    return next(c["props"] for c in config["components"] if c.get("props", {}).get("elem_id") == elem_id)


@pytest.mark.parametrize(
    "fault, reason",
    [
        ("missing", "missing.pt not found; train a run first"),
        (
            "another shape",
            "oelm_nofreeze_narrow.pt holds weights that do not fit its model_config: model_config."
            "d_model is 64 in the checkpoint, 32 in the weights (wte.weight (50304, 32))",
        ),
    ],
)
def test_one_bad_checkpoint_leaves_the_other_models_usable(tmp_path, checkpoints, fault, reason):
    """One of three checkpoints missing or of another shape replaced the whole page by the error
    page, and the two that loaded could not be used. Now that model's column says what went
    wrong and how to fix it, and the others generate and map attention through the API."""
    from app.lab import load_lab
    from oelm_core.generate import SamplingConfig
    from oelm_core.generate import generate as core_generate

    bad = tmp_path / "missing.pt" if fault == "missing" else checkpoint_of_another_shape(tmp_path, "oelm_nofreeze")
    lab = load_lab({**checkpoints, "oelm_nofreeze": bad}, "cpu", "test checkpoints")
    assert [m.group for m in lab.models] == ["gpt_base", "oelm_freeze"] and list(lab.failed) == ["oelm_nofreeze"]
    assert not lab.ok and reason in lab.failed["oelm_nofreeze"]
    demo, url = start_app(lab)
    try:
        client = gradio_client.Client(url, verbose=False)
        texts = generate(client, max_new=8, seed=3)
        cfg = SamplingConfig(max_new_tokens=8, temperature=0.9, top_k=50, top_p=0.95, seed=3)
        assert list(texts) == [core_generate(m.model, PROMPT, cfg) for m in lab.models]
        *_, table, details = client.predict(PROMPT, "oelm_freeze", 1, "0", *texts, api_name="/attention")
        rows = table["data"] if isinstance(table, dict) else table
        assert details["model"] == "oelm_freeze" and len(rows) == 2 * 2 * 4  # two models' heads
        with pytest.raises(Exception, match="unknown model 'oelm_nofreeze'; choose one of gpt_base, oelm_freeze"):
            client.predict(PROMPT, "oelm_nofreeze", 0, "0", *texts, api_name="/attention")

        config = demo.get_config_file()
        assert "load-error" not in {c.get("props", {}).get("elem_id") for c in config["components"]}
        card = component(config, "card-oelm_nofreeze")["value"]
        assert card.startswith("### OELM-NoFreeze\n`oelm_nofreeze` \u2014 **not loaded**") and reason in card
        assert (
            "**How to fix it:** start the demo again with a working checkpoint for oelm_nofreeze: "
            "`python -m app --ckpt oelm_nofreeze=PATH`, with `--ckpt GROUP=PATH` for each of the others. "
            "The other models work meanwhile."
        ) in card
        assert "did not load" in component(config, "out-oelm_nofreeze-missing")["value"]
        assert [component(config, f"card-{g}")["value"].startswith("### ") for g in GROUPS] == [True] * 3
    finally:
        demo.close()


@pytest.mark.slow
def test_missing_or_unreadable_checkpoint_shows_error_page(tmp_path, checkpoints):
    """`python -m app` with a missing and a truncated checkpoint still starts; the page says why,
    in those models' columns, and serves the one that loaded."""
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(checkpoints["oelm_nofreeze"].read_bytes()[:5000])
    port = free_port()
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False", PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app",
            "--ckpt",
            f"gpt_base={tmp_path / 'missing.pt'}",
            "--ckpt",
            f"oelm_nofreeze={truncated}",
            "--ckpt",
            f"oelm_freeze={checkpoints['oelm_freeze']}",
            "--port",
            str(port),
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 90
        config = None
        while time.time() < deadline and proc.poll() is None:
            try:
                config = _get(f"http://127.0.0.1:{port}/config")
                break
            except OSError:
                time.sleep(0.5)
        assert config is not None, f"the app did not start: {proc.stdout.read() if proc.poll() is not None else ''}"
        assert "The models could not be loaded" not in config  # the model that loaded is served
        assert "missing.pt not found" in config
        assert "truncated.pt could not be read" in config
        assert "generate-btn" in config and "card-oelm_freeze" in config
        assert '"title": "OELM Lab"' in config or '"title":"OELM Lab"' in config
        assert _get(f"http://127.0.0.1:{port}/").lower().startswith("<!doctype html")
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_the_ckpt_example_is_where_the_smoke_study_writes_gpt_base():
    """The example named runs/smoke/gpt_base_s0/best.pt, a file no study writes."""
    from app.lab import SetupError, parse_ckpt_args
    from oelm_core.runner import load_plan as load_study

    study = load_study(REPO / "parameters" / "study_smoke.yaml")
    best = next(r.run_dir for r in study.runs if r.variant == "gpt_base") / "best.pt"
    with pytest.raises(SetupError) as err:
        parse_ckpt_args(["runs/smoke/best.pt"])
    assert f"e.g. gpt_base={best} " in str(err.value)


def test_an_app_that_cannot_start_says_why_in_one_line(monkeypatch, capsys, checkpoints):
    """Offline without the GPT-2 BPE files the tokenizer raises ConfigError (as a SetupError
    would): `python -m app` printed a traceback."""
    import app.demo
    import app.lab
    import oelm_core.data
    from app.__main__ import main
    from oelm_core.config import ConfigError

    def missing():
        raise ConfigError("tiktoken could not load the 'gpt2' encoding; set TIKTOKEN_CACHE_DIR")

    monkeypatch.setattr(oelm_core.data, "get_tokenizer", missing)
    monkeypatch.setattr(app.demo, "launch", lambda *a, **k: pytest.fail("launched without a tokenizer"))
    args = [f"--ckpt={g}={checkpoints[g]}" for g in GROUPS] + ["--device", "cpu", "--port", str(free_port())]
    assert main(args) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "error: tiktoken could not load the 'gpt2' encoding; set TIKTOKEN_CACHE_DIR"
    )

    def no_study(*a, **k):
        raise app.lab.SetupError("no study found under runs")

    monkeypatch.setattr(app.demo, "build_demo", no_study)
    assert main(args) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "error: no study found under runs"


# ---- the port, the start lines, the CPU route -----------------------------------------------


def test_a_port_in_use_is_named_with_the_apps_port_option(tmp_path, checkpoints):
    """The demo's port taken (a second demo) ended in Gradio's traceback naming its launch()
    argument and GRADIO_SERVER_PORT. `python -m app` now says so in one line, naming --port and
    make demo's PORT, before it loads anything; launch() says the same where the port is taken
    between the check and the start."""
    from app.demo import build_demo, launch
    from app.lab import SetupError, load_lab

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "app", "--port", str(port), "--ckpt", f"gpt_base={checkpoints['gpt_base']}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
            timeout=120,
        )
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert proc.stderr == (
            f"error: port {port} on 127.0.0.1 is in use (another demo or server is running "
            f"there): start the app with another port, python -m app --port {port + 1} (make "
            f"demo PORT={port + 1}), or stop the other one\n"
        )
        assert "oelm app: loaded" not in proc.stderr and time.monotonic() - start < 60
        demo = build_demo(load_lab({"gpt_base": checkpoints["gpt_base"]}, "cpu"))
        with pytest.raises(SetupError, match=rf"^port {port} on 127\.0\.0\.1 is in use"):
            launch(demo, port=port, prevent_thread_lock=True)


def test_the_app_says_where_it_serves_and_names_its_share_option(checkpoints):
    """Gradio's start lines told the user to "set `share=True` in `launch()`"; the app's option
    is --share. A real server: its first lines, then a page request."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "app",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--ckpt",
            f"gpt_base={checkpoints['gpt_base']}",
        ],
        cwd=REPO,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        assert lines == [
            f"* Running on local URL:  http://127.0.0.1:{port}/\n",
            "* To create a public link, start the app with --share.\n",
        ], lines
        assert "OELM Lab" in _get(f"http://127.0.0.1:{port}/", timeout=30)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_make_demo_takes_the_port_as_a_setting():
    if shutil.which("make") is None:
        pytest.skip("no make")
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", "-o", ".venv/.installed", "demo", "PORT=7999"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("-m app --train-mini --port 7999"), out.stdout


def test_on_a_cpu_make_demo_says_what_the_mini_study_would_take_here(
    tmp_path, monkeypatch, capsys, checkpoints, request
):
    """`make demo` on a CPU served the smoke study, whose page said to run make demo: a loop. It now
    says what the mini study costs: its FLOPs (the accounting's, for its three groups) at this
    CPU's measured speed, and the route to bring it from a GPU; then it serves the newest study,
    whose page says the same; with no study at all it stops and names make study."""
    import torch

    import oelm_core.preflight
    from app.__main__ import trained_or_mini_study
    from app.demo import undertrained_notice
    from app.lab import load_lab, mini_study_cost
    from oelm_core.accounting import flops_per_token

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(oelm_core.preflight, "device_flops", lambda device: (2.0e10, "a test's"))
    mini_study_cost.cache_clear()  # measured once per process: here with the speed above
    request.addfinalizer(mini_study_cost.cache_clear)
    calls = []
    monkeypatch.setattr(subprocess, "call", lambda cmd: calls.append(cmd) or 0)
    runs = tmp_path / "runs"
    runs.mkdir()
    assert trained_or_mini_study(str(runs)) == (None, 2)
    err = capsys.readouterr().err
    flops = sum(
        flops_per_token(model_config("mini", group, dropout=0.0))["total"] * 32 * 256 * 3000 for group in GROUPS
    )
    route = (
        f"The tuned mini study, whose models write readable stories, trains 3 models for up to 3,000 steps of "
        f"8,192 tokens: at least {flops / 2e10 / 3600:,.0f} h on this CPU ({flops / 1e15:.1f} PFLOP at its "
        f"measured 20.0 GFLOP/s), about two minutes on one GPU. Train it on a GPU machine (`python -m "
        f"oelm_core run parameters/study_tuned_mini.yaml --set 'experiment.seeds=[0]'`) and copy its "
        f"`runs/tuned_mini` into `runs/` here: `make demo` serves it then."
    )
    assert err.splitlines() == [
        f"oelm app: no trained study under {runs}/ and no GPU here. {route}",
        f"error: no study under {runs}/ to serve meanwhile: `make study` trains the smoke study (several minutes "
        f"on 2 cores; its models write gibberish, the page says so)",
    ]
    write_study(runs / "smoke", {g: {"steps": 150, "best_val_ppl": 900.0} for g in GROUPS})
    assert trained_or_mini_study(str(runs)) == (None, 0) and calls == []
    notice = undertrained_notice(load_lab({"gpt_base": checkpoints["gpt_base"]}, "cpu"))
    assert notice.endswith(route) and "make demo`, which does both" not in notice


def test_a_checkpoint_of_another_shape_says_which_model_it_holds_and_which_was_expected(tmp_path, checkpoints):
    """A study's run folder holding a smoke model where the study trained mini (a best.pt
    replaced), or a checkpoint whose weights do not fit its own model_config, showed PyTorch's
    `Unexpected key(s)` cut mid-word. The column now names the model it holds and the one
    expected, the keys and the tensors that show it."""
    import torch

    from app.lab import lab_from_args
    from oelm_core.config import run_config_from_dict
    from oelm_core.parameter_files import save_run_config

    study = tmp_path / "study"
    entries = []
    for group in GROUPS:
        run_dir = study / f"{group}_s0"
        run_dir.mkdir(parents=True)
        save_run_config(
            run_config_from_dict({"name": group, "preset": "mini", "variant": group}), run_dir / "config.yaml"
        )
        (run_dir / "best.pt").write_bytes(checkpoints[group].read_bytes())  # smoke models
        entries.append({"variant": group, "seed": 0, "run_dir": f"{group}_s0"})
    (study / "study.json").write_text(json.dumps({"name": "mini", "runs": entries}))
    lab = lab_from_args(study=str(study), device="cpu")
    assert lab.models == [] and sorted(lab.failed) == sorted(GROUPS)
    assert lab.failed["oelm_freeze"] == (
        f"{study / 'oelm_freeze_s0' / 'best.pt'} holds a smoke model (2 layers, d_model 64, 4 heads, context 64), "
        f"but the study trained a mini model (4 layers, d_model 256, 4 heads, context 256) there (its config.yaml): "
        f"the checkpoint was replaced or comes from another run; train the run again, or pass a checkpoint of "
        f"that shape with --ckpt oelm_freeze=PATH"
    )

    state = torch.load(checkpoints["gpt_base"], weights_only=True)
    state["model_config"] = dataclasses.asdict(model_config("mini", "gpt_base"))
    save_checkpoint({k: v for k, v in state.items() if k != "format_version"}, tmp_path / "edited.pt")
    lab = lab_from_args(ckpt=[f"gpt_base={tmp_path / 'edited.pt'}"], device="cpu")
    said = lab.failed["gpt_base"]
    assert said.startswith(
        f"{tmp_path / 'edited.pt'} holds weights that do not fit its model_config: "
        f"model_config.n_layer is 4 in the checkpoint, 2 in the weights (blocks.0 .. blocks.1); "
        f"model_config.d_model is 256 in the checkpoint, 64 in the weights (wte.weight (50304, 64))"
    ), said
    assert "(the weights are a smoke model's)" in said and "Unexpected key" not in said


def test_a_typed_end_of_text_in_the_prompt_is_the_token(served):
    demo, _ = served
    ids = demo.oelm.check_prompt("The end.<|endoftext|>Once upon a time")
    assert ids.count(50256) == 1 and ids == demo.oelm.enc.encode(
        "The end.<|endoftext|>Once upon a time", allowed_special={"<|endoftext|>"}
    )


def test_attention_over_text_with_dollar_signs(served):
    """A model that wrote "$$" ended the attention request in matplotlib's mathtext error
    (ParseException), found by 150 requests against one server: token labels are text."""
    _, client = served
    heat, compare, summary, table, details = client.predict(
        "The toy cost $5 and the ball $$ 6 $", "gpt_base", 0, "mean", "", "", "", api_name="/attention"
    )
    assert "$5" in "".join(details["tokens"]) and served_image(heat).std() > 10


RETURNS_FREED_MEMORY = """import threading
from app.demo import return_freed_memory

def rss_mb():
    return next(int(l.split()[1]) / 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))

def request():  # what a served request leaves: many blocks freed in a worker thread's heap
    blocks = [bytearray(4000) for _ in range(60_000)]
    del blocks

before = rss_mb()
worker = threading.Thread(target=request)
worker.start()
worker.join()
kept = rss_mb()
return_freed_memory()
print(before, kept, rss_mb())
"""


def test_an_idle_server_gives_back_what_its_requests_freed():
    """The server's RSS grew with its requests and was not given back when idle: glibc keeps
    what a worker thread freed in that thread's heap. After each request the app trims the heaps
    (and caps them at two: app.demo.bound_server_memory); here a thread frees 240 MB of 4 KB
    blocks in a process of its own, and trimming returns what freeing kept."""
    if not os.path.exists("/proc/self/status") or not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
        pytest.skip("glibc and /proc: the heap trimmed and the RSS read")
    out = subprocess.run(
        [sys.executable, "-c", RETURNS_FREED_MEMORY],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=120,
    )
    before, kept, trimmed = map(float, out.stdout.split())
    assert kept - before > 20, (before, kept)  # freeing alone gave little back
    assert trimmed - before < 0.25 * (kept - before), (before, kept, trimmed)
