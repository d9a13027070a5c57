"""oelm_core.analysis.attention and .samples: attention maps and their per-head summaries on known
maps, the notebook's figure, and seeded samples."""

import math

import pytest
import torch

from oelm_core import analysis as A
from oelm_core import build_model


def test_attention_summary_rows_are_within_bounds():
    model = build_model("tiny", "oelm_freeze").eval()
    ids = list(range(10))
    rows = A.attention_summary(model, ids)
    assert len(rows) == model.cfg.n_layer * model.cfg.n_head
    for r in rows:
        assert 0 <= r["entropy"] <= math.log(10) + 1e-6 and 0 <= r["mean_distance"] <= 9


def test_attention_maps_refuse_empty_and_over_long_input():
    """An empty text was a torch indexing error; one longer than the context was silently cut
    to its first block_size tokens. max_tokens is the explicit cut, to the first tokens."""
    model = build_model("tiny", "oelm_freeze").eval()  # context of 32 tokens
    with pytest.raises(ValueError, match="no tokens to compute attention over: the text is empty"):
        A.attention_maps(model, "")
    with pytest.raises(ValueError, match=r"max_tokens=0 keeps no tokens; pass max_tokens >= 1"):
        A.attention_summary(model, [1, 2], max_tokens=0)
    long = list(range(40))
    with pytest.raises(ValueError, match=r"40 tokens exceed the model's context of 32; pass max_tokens=32"):
        A.attention_summary(model, long)
    ids, maps = A.attention_maps(model, long, max_tokens=32)
    assert ids == long[:32] and maps[0].shape == (2, 32, 32)
    with pytest.raises(ValueError, match="40 tokens exceed the model's context of 32"):
        A.attention_maps(model, long, max_tokens=100)


class UniformAttention(torch.nn.Module):
    """Stands in for a GPT whose every head attends uniformly to the past."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.cfg = type("Cfg", (), {"block_size": 16})()

    def forward_with_attention(self, idx):
        t = idx.shape[1]
        att = torch.tril(torch.ones(t, t)) / torch.arange(1, t + 1)[:, None]
        return None, [att.expand(1, 2, t, t)]


def test_attention_summary_known_values():
    t = 4
    rows = A.attention_summary(UniformAttention(), list(range(t)))
    assert len(rows) == 2
    # query i spreads over i+1 keys: entropy log(i+1), mean distance i/2
    assert rows[0]["entropy"] == pytest.approx(sum(math.log(i) for i in range(1, t + 1)) / t)
    assert rows[1]["mean_distance"] == pytest.approx(sum(i / 2 for i in range(t)) / t)


@pytest.mark.parametrize("t", [1, 7, 16])
def test_uniform_reference_is_the_summary_of_uniform_attention(t):
    """The app's dashed "uniform attention" level is what summarise_attention gives for heads
    that attend uniformly to the past, averaged over the same query positions."""
    maps = UniformAttention().forward_with_attention(torch.zeros(1, t, dtype=torch.long))[1]
    rows = A.summarise_attention([m[0] for m in maps])
    uniform = A.uniform_reference(t)
    for r in rows:
        assert r["entropy"] == pytest.approx(uniform["entropy"], abs=1e-6)
        assert r["mean_distance"] == pytest.approx(uniform["distance"], abs=1e-6)
    assert A.uniform_reference(4) == pytest.approx({"entropy": math.log(24) / 4, "distance": 0.75})


def test_attention_figure_and_samples_with_gpt2_vocab(tmp_path):
    models = {
        "GPT-Base": build_model("smoke", "gpt_base").eval(),
        "OELM-Freeze": build_model("smoke", "oelm_freeze").eval(),
    }
    fig = A.attention_figure(models, "Once upon a time there was a cat.", 1, 3, 12, tmp_path / "att.png")
    assert len(fig.axes) == 2 and (tmp_path / "att.png").is_file()
    samples = A.sample_generations(models, "Once upon a time", max_new_tokens=5, seed=1)
    assert [s["model"] for s in samples] == ["GPT-Base", "OELM-Freeze"]
    assert samples == A.sample_generations(models, "Once upon a time", max_new_tokens=5, seed=1)


def test_samples_use_the_default_temperature_and_the_shared_top_k():
    """The analysis sampled with top_k=40, the app with 50: the same models, other texts."""
    import inspect

    from oelm_core.generate import SamplingConfig

    params = inspect.signature(A.sample_generations).parameters
    assert params["temperature"].default == SamplingConfig.temperature
    assert params["top_k"].default == A.SAMPLE_TOP_K == 50
