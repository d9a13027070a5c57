"""Sampling: the KV cache changes speed, not results; seeds, filters, limits and streaming."""

import pytest
import torch

from oelm_core import build_model
from oelm_core.generate import EOT, SamplingConfig, generate, sample_next, stream, stream_tokens


@pytest.fixture(scope="module")
def smoke_model():
    return build_model("smoke", "oelm_freeze", seed=1).eval()


@pytest.mark.parametrize("variant", ["gpt_base", "oelm_freeze"])
def test_cached_logits_equal_uncached(variant):
    model = build_model("tiny", variant, seed=2).eval()
    idx = torch.randint(0, 128, (1, 24))
    full = model(idx)
    cache = model.new_cache()
    prefix = model(idx[:, :10], cache=cache)  # a prefill, then one token at a time
    steps = [model(idx[:, t:t + 1], cache=cache) for t in range(10, 24)]
    cached = torch.cat([prefix] + steps, dim=1)
    assert (cached - full).abs().max().item() < 1e-5


def test_greedy_generation_is_the_same_with_and_without_cache_past_the_context(smoke_model):
    # 100 new tokens with a 64-token context: the window slides, and both paths must agree.
    prompt = list(range(1000, 1010))
    kw = dict(max_new_tokens=100, temperature=0.0, stop_at_eot=False)
    cached = list(stream_tokens(smoke_model, prompt, SamplingConfig(**kw, use_cache=True)))
    plain = list(stream_tokens(smoke_model, prompt, SamplingConfig(**kw, use_cache=False)))
    assert len(cached) == 100 and cached == plain


def test_seed_makes_sampling_reproducible(smoke_model):
    cfg = dict(max_new_tokens=30, temperature=1.0, top_k=50, stop_at_eot=False)
    a = generate(smoke_model, "Once upon a time", SamplingConfig(**cfg, seed=7))
    b = generate(smoke_model, "Once upon a time", SamplingConfig(**cfg, seed=7))
    c = generate(smoke_model, "Once upon a time", SamplingConfig(**cfg, seed=8))
    assert a == b and a != c


def test_stream_pieces_join_to_the_whole_text(smoke_model):
    cfg = SamplingConfig(max_new_tokens=25, temperature=1.0, seed=3, stop_at_eot=False)
    pieces = list(stream(smoke_model, "The cat", cfg))
    assert len(pieces) > 1 and "".join(pieces) == generate(smoke_model, "The cat", cfg)


def test_top_k_and_top_p_keep_only_the_allowed_tokens():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    top2 = {sample_next(logits, SamplingConfig(top_k=2, temperature=1.0), g) for _ in range(300)}
    assert top2 == {0, 1}
    # p = softmax: [0.636, 0.234, 0.086, ...]; top_p 0.8 keeps the first two only.
    nucleus = {sample_next(logits, SamplingConfig(top_p=0.8, temperature=1.0), g) for _ in range(300)}
    assert nucleus == {0, 1}
    assert sample_next(logits, SamplingConfig(temperature=0.0), g) == 0


def test_generation_stops_at_end_of_text():
    model = build_model("smoke", "gpt_base").eval()
    with torch.no_grad():  # make <|endoftext|> the most likely token everywhere
        model.ln_f.weight.zero_()
        model.ln_f.bias.copy_(model.wte.weight[EOT] * 100)
    out = list(stream_tokens(model, [10, 11], SamplingConfig(temperature=0.0)))
    assert out == []
    out = list(stream_tokens(model, [10, 11], SamplingConfig(temperature=0.0, stop_at_eot=False,
                                                             max_new_tokens=3)))
    assert out == [EOT] * 3


def test_limits_give_clear_errors(smoke_model):
    with pytest.raises(ValueError, match="shorten it to fewer than 64 tokens"):
        list(stream_tokens(smoke_model, list(range(64)), SamplingConfig()))
    with pytest.raises(ValueError, match="top_p must be in"):
        list(stream_tokens(smoke_model, [1], SamplingConfig(top_p=0.0)))
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        list(stream_tokens(smoke_model, [1], SamplingConfig(max_new_tokens=0)))
