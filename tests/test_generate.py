"""The reference generation (oelm_core.generate): the KV cache changes speed, not results;
seeds, filters, limits and streaming, through ``oelm_core.fast.stream_tokens`` with each of the
decoders it may pick (the switches in PATHS). The fast decoder's parts against the reference:
tests/test_fast_decode.py."""

import functools
import itertools
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oelm_core import build_model
from oelm_core.config import ConfigError
from oelm_core.data import get_tokenizer
from oelm_core.fast import stream_tokens
from oelm_core.generate import (
    EOT,
    SamplingConfig,
    _uniform,
    detokenize,
    generate,
    gumbel_noise,
    sample,
    sample_from_noise,
    seed_tensor,
    stream,
)

REPO = Path(__file__).resolve().parents[1]

# Small CPU tensors: one thread (conftest), or a busy machine's oversubscription slows them down.
pytestmark = pytest.mark.usefixtures("one_thread")

# The three ways fast.stream_tokens decodes: the fast decoder (the default), the reference
# KV-cached loop, the uncached reference.
PATHS = {"fast": dict(use_cache=True), "cached": dict(use_cache=True, fast=False), "uncached": dict(use_cache=False)}


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
    steps = [model(idx[:, t : t + 1], cache=cache) for t in range(10, 24)]
    cached = torch.cat([prefix] + steps, dim=1)
    assert (cached - full).abs().max().item() < 1e-5


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, top_k=50, top_p=0.9, seed=5)])
def test_generation_is_the_same_with_and_without_cache_past_the_context(smoke_model, sampling):
    # 100 new tokens with a 64-token context: the window slides, and every path must agree.
    prompt = list(range(1000, 1010))
    kw = dict(max_new_tokens=100, stop_at_eot=False, **sampling)
    tokens = {
        name: list(stream_tokens(smoke_model, prompt, SamplingConfig(**kw, **path))) for name, path in PATHS.items()
    }
    assert len(tokens["uncached"]) == 100 and tokens["fast"] == tokens["cached"] == tokens["uncached"]


@pytest.mark.parametrize("path", list(PATHS))
def test_a_full_window_restarts_from_its_most_recent_half(path):
    """tiny: a context of 32. After a one-token prompt, step 31 sees all 32 tokens; step 32
    would see 33, so it sees the last 16 (ids[17:33]) and the window grows from there until
    step 49, which again sees the last 16 (ids[34:50])."""
    model = build_model("tiny", "gpt_base", seed=8).eval()
    cfg = SamplingConfig(max_new_tokens=60, temperature=0.0, stop_at_eot=False, **PATHS[path])
    ids = [5] + list(stream_tokens(model, [5], cfg))
    with torch.no_grad():
        for step, window in [(31, slice(0, 32)), (32, slice(17, 33)), (48, slice(17, 49)), (49, slice(34, 50))]:
            expect = model(torch.tensor([ids[window]]))[0, -1].argmax().item()
            assert ids[1 + step] == expect, (step, window)


def test_seed_makes_sampling_reproducible(smoke_model):
    cfg = dict(max_new_tokens=30, temperature=1.0, top_k=50, stop_at_eot=False)
    a = generate(smoke_model, "Once upon a time", SamplingConfig(**cfg, seed=7))
    b = generate(smoke_model, "Once upon a time", SamplingConfig(**cfg, seed=7))
    c = generate(smoke_model, "Once upon a time", SamplingConfig(**cfg, seed=8))
    assert a == b and a != c


def test_stream_pieces_join_to_the_decoded_tokens(smoke_model):
    enc = get_tokenizer()
    cfg = SamplingConfig(max_new_tokens=25, temperature=1.0, seed=3, stop_at_eot=False)
    tokens = list(stream_tokens(smoke_model, enc.encode_ordinary("The cat"), cfg))
    pieces = list(stream(smoke_model, "The cat", cfg))
    assert len(pieces) > 1 and "".join(pieces) == enc.decode(tokens) == generate(smoke_model, "The cat", cfg)


def _byte_token(enc, byte: int) -> int:
    return enc.encode_single_token(bytes([byte]))


def test_a_character_split_across_tokens_is_held_back_and_an_unfinished_one_flushed():
    enc = get_tokenizer()
    e2, x82, xac = (_byte_token(enc, b) for b in (0xE2, 0x82, 0xAC))  # the bytes of "\u20ac"
    tokens = [enc.encode_single_token("H"), e2, x82, xac, e2]
    assert list(detokenize(tokens, enc)) == ["H", "\u20ac", "\ufffd"] and enc.decode(tokens) == "H\u20ac\ufffd"
    assert list(detokenize([e2, x82], enc)) == [enc.decode([e2, x82])] == ["\ufffd"]
    assert list(detokenize([], enc)) == []


def test_generated_text_ending_in_an_unfinished_character_is_not_dropped():
    enc = get_tokenizer()
    e2 = _byte_token(enc, 0xE2)
    model = build_model("smoke", "gpt_base").eval()
    with torch.no_grad():  # make the lone byte 0xE2 the most likely token everywhere
        model.ln_f.weight.zero_()
        model.ln_f.bias.copy_(model.wte.weight[e2] * 100)
    cfg = SamplingConfig(max_new_tokens=5, temperature=0.0)
    tokens = list(stream_tokens(model, enc.encode_ordinary("Hi"), cfg))
    assert tokens == [e2] * 5
    assert generate(model, "Hi", cfg) == enc.decode(tokens) == "\ufffd" * 5  # was ""


def _draws(logits, cfg, n=300, seed=0):
    noise = gumbel_noise(seed_tensor(seed, "cpu"), torch.tensor([0]), n, logits.numel())
    return [int(sample_from_noise(logits, cfg, noise[i])) for i in range(n)]


def test_top_k_and_top_p_keep_only_the_allowed_tokens():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert set(_draws(logits, SamplingConfig(top_k=2, temperature=1.0))) == {0, 1}
    # p = softmax: [0.636, 0.234, 0.086, ...]; top_p 0.8 keeps the first two only.
    assert set(_draws(logits, SamplingConfig(top_p=0.8, temperature=1.0))) == {0, 1}
    assert set(_draws(logits, SamplingConfig(temperature=1.0))) == {0, 1, 2, 3, 4}
    assert int(sample(logits, SamplingConfig(temperature=0.0))) == 0


def test_ids_tied_at_the_top_p_cut_stay_or_go_together():
    """Four tied logits of p 0.25 each: top_p 0.3 is reached inside the tie, and all four stay
    (as the GPU kernels keep them), not the two that sort happened to put first."""
    logits = torch.zeros(64)
    logits[:4] = 5.0
    assert set(_draws(logits, SamplingConfig(top_p=0.3, temperature=1.0))) == {0, 1, 2, 3}
    logits[4:] = float("-inf")
    logits[3] = 4.0  # p 0.30 each for the three tied ids, which reach 0.3 and stay; id 3 goes
    assert set(_draws(logits, SamplingConfig(top_p=0.3, temperature=1.0))) == {0, 1, 2}


def test_gumbel_max_sampling_draws_from_the_softmax():
    logits = torch.tensor([1.5, 0.5, 0.0, -1.0])
    n = 20000
    counts = torch.bincount(torch.tensor(_draws(logits, SamplingConfig(temperature=1.0), n=n, seed=3)), minlength=4)
    p = torch.softmax(logits, 0)
    sigma = (p * (1 - p) / n).sqrt()
    assert ((counts / n - p).abs() < 4 * sigma).all(), (counts / n, p)
    # Temperature 2 flattens the distribution as softmax(logits / 2) says.
    counts = torch.bincount(torch.tensor(_draws(logits, SamplingConfig(temperature=2.0), n=n, seed=4)), minlength=4)
    p = torch.softmax(logits / 2, 0)
    assert ((counts / n - p).abs() < 4 * (p * (1 - p) / n).sqrt()).all()


def test_sample_is_the_draw_with_the_steps_noise():
    """sample() is sample_from_noise with the noise of its step (the fast decoder's draw on the
    CPU too, and the Triton sampler's on GPUs: tests/test_fast_decode.py, test_sample_kernels.py)."""
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    cfg = SamplingConfig(temperature=1.0, top_k=5)
    for step in range(5):
        seed_t, step_t = seed_tensor(9, "cpu"), torch.tensor([step])
        expect = sample_from_noise(logits, cfg, gumbel_noise(seed_t, step_t, 1, 10)[0])
        assert torch.equal(sample(logits, cfg, seed_t, step_t), expect)


def _hash32_reference(h: int) -> int:
    """Mueller's hash32 in plain Python integers, the definition the tensor version must match."""
    h = ((h >> 16) ^ h) * 0x45D9F3B & 0xFFFFFFFF
    h = ((h >> 16) ^ h) * 0x45D9F3B & 0xFFFFFFFF
    return (h >> 16) ^ h


def test_noise_is_a_pure_function_of_seed_step_and_token_bit_for_bit():
    seed, step, vocab = 2**40 + 12345, 7, 50257
    noise = gumbel_noise(seed_tensor(seed, "cpu"), torch.tensor([step]), 3, vocab)
    s32 = (seed ^ (seed >> 32)) & 0xFFFFFFFF
    for i, v in [(0, 0), (1, 17), (2, vocab - 1), (0, 31337)]:
        key = _hash32_reference((_hash32_reference(s32) + (step + i) * 0x9E3779B9) & 0xFFFFFFFF)
        h = _hash32_reference((key + v * 0x85EBCA77) & 0xFFFFFFFF)
        u = ((h >> 9) + 0.5) / 2**23
        assert abs(noise[i, v].item() - (-math.log(-math.log(u)))) < 1e-5
    # Steps are independent draws: the same noise again for the same (seed, step) only.
    again = gumbel_noise(seed_tensor(seed, "cpu"), torch.tensor([step + 1]), 2, vocab)
    assert torch.equal(again, noise[1:])
    other = gumbel_noise(seed_tensor(seed + 1, "cpu"), torch.tensor([step]), 1, vocab)
    assert (other[0] != noise[0]).float().mean() > 0.99
    # Finite even at the hash's extremes (24 bits made u = 1.0 and the noise +inf there).
    u = _uniform(torch.tensor([0, 2**32 - 1]))
    assert 0.0 < u[0].item() and u[1].item() < 1.0 and torch.isfinite(-torch.log(-torch.log(u))).all()
    # Gumbel(0, 1): mean = Euler's gamma, variance = pi^2 / 6.
    assert abs(noise.mean().item() - 0.5772) < 0.01 and abs(noise.var().item() - math.pi**2 / 6) < 0.03


@pytest.mark.parametrize("path", list(PATHS))
def test_generation_stops_at_end_of_text(path):
    model = build_model("smoke", "gpt_base").eval()
    with torch.no_grad():  # make <|endoftext|> the most likely token everywhere
        model.ln_f.weight.zero_()
        model.ln_f.bias.copy_(model.wte.weight[EOT] * 100)
    out = list(stream_tokens(model, [10, 11], SamplingConfig(temperature=0.0, **PATHS[path])))
    assert out == []
    out = list(
        stream_tokens(
            model, [10, 11], SamplingConfig(temperature=0.0, stop_at_eot=False, max_new_tokens=3, **PATHS[path])
        )
    )
    assert out == [EOT] * 3


def test_limits_give_clear_errors(smoke_model):
    """Out of range: a ConfigError naming the setting, its value and the fix, as for every setting."""
    with pytest.raises(ValueError, match="shorten it to fewer than 64 tokens"):
        list(stream_tokens(smoke_model, list(range(64)), SamplingConfig()))
    with pytest.raises(ConfigError, match=r"^sampling\.top_p must be in \(0, 1\], got 0\.0; use e\.g\. 0\.9"):
        list(stream_tokens(smoke_model, [1], SamplingConfig(top_p=0.0)))
    with pytest.raises(ConfigError, match=r"^sampling\.max_new_tokens must be at least 1, got 0; ask for 1 or more"):
        list(stream_tokens(smoke_model, [1], SamplingConfig(max_new_tokens=0)))
    with pytest.raises(ConfigError, match=r"^sampling\.top_k must be >= 0 \(0 disables it\), got -1; use e\.g\. 50"):
        list(stream_tokens(smoke_model, [1], SamplingConfig(top_k=-1)))
    for bad in (math.nan, math.inf, -math.inf, -0.5):  # NaN passed every comparison
        with pytest.raises(
            ConfigError,
            match=rf"^sampling\.temperature must be a finite number >= 0 \(0 is greedy\), "
            rf"got {re.escape(repr(bad))}; use e\.g\. 0\.8",
        ):
            list(stream_tokens(smoke_model, [1], SamplingConfig(temperature=bad)))
    for bad in (math.nan, math.inf):
        with pytest.raises(ConfigError, match=r"^sampling\.top_p must be in \(0, 1\]"):
            list(stream_tokens(smoke_model, [1], SamplingConfig(top_p=bad)))


@pytest.mark.parametrize(
    "name, value, kind",
    [
        ("max_new_tokens", 2.5, "int"),  # the cached path never stopped: no count equals 2.5
        ("max_new_tokens", True, "int"),
        ("top_k", 2.5, "int"),  # a bare TypeError from torch.topk
        ("top_k", "50", "int"),
        ("temperature", "0.8", "float"),  # a string is no number here (a YAML file's 3e-4 is read as one)
        ("top_p", None, "float"),
        ("seed", 1.5, "int or None"),
        ("stop_at_eot", 1, "bool"),
        ("use_cache", "no", "bool"),
        ("fast", 0, "bool"),
    ],
)
@pytest.mark.parametrize("path", list(PATHS))
def test_sampling_settings_of_the_wrong_type_are_refused_by_name(smoke_model, name, value, kind, path):
    """The schema's builder checks the sampling settings as it checks every other: a ConfigError
    naming the setting, the value and the fix."""
    cfg = SamplingConfig(temperature=1.0, seed=1, stop_at_eot=False, **PATHS[path])
    setattr(cfg, name, value)
    message = (
        f"sampling.{name} should be {kind}, got {type(value).__name__} {value!r}; "
        f"pass one as SamplingConfig({name}=...)"
    )
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        list(itertools.islice(stream_tokens(smoke_model, [1, 2], cfg), 50))


def test_numpy_integers_are_whole_numbers(smoke_model):
    np = pytest.importorskip("numpy")
    cfg = SamplingConfig(
        max_new_tokens=np.int64(7), top_k=np.int32(5), temperature=np.float32(0.9), seed=np.int64(2), stop_at_eot=False
    )
    assert len(list(stream_tokens(smoke_model, [1, 2], cfg))) == 7


@pytest.mark.parametrize("path", list(PATHS))
def test_prompt_ids_outside_the_vocabulary_are_refused(smoke_model, path):
    tiny = build_model("tiny", "gpt_base").eval()  # 128 ids
    cfg = SamplingConfig(max_new_tokens=3, temperature=0.0, stop_at_eot=False, **PATHS[path])
    for ids in ([5, 500], [-1]):
        with pytest.raises(
            ValueError,
            match=r"outside this model's vocabulary of 128 ids \(0\.\.127\).*"
            r"encode it with the tokenizer the model was trained with",
        ):
            list(stream_tokens(tiny, ids, cfg))
    with pytest.raises(
        ValueError,
        match=r"empty prompt starts from <\|endoftext\|> \(id 50256\).*"
        r"at least one token id below 128",
    ):
        list(stream_tokens(tiny, [], cfg))
    assert len(list(stream_tokens(tiny, [127], cfg))) == 3
    # With the GPT-2 vocabulary an empty prompt starts after <|endoftext|>, as before.
    assert list(stream_tokens(smoke_model, [], cfg)) == list(stream_tokens(smoke_model, [EOT], cfg))


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 1e-300])
def test_tiny_temperatures_draw_the_most_likely_token(temperature):
    """1 / T overflows float32 below ~3e-39, and logits / T long before (10 / 1e-38): the draw
    took the first logit that became +inf, not the largest."""
    logits = torch.tensor([[5.0, 10.0, -1.0, 7.0], [0.5, -3.0, 2.0, 1.0]])
    cfg = SamplingConfig(temperature=temperature, top_k=3).validate()
    for step in range(5):
        assert sample(logits, cfg, seed_tensor(step, "cpu"), torch.tensor([step])).tolist() == [1, 2]
    assert cfg.greedy and not SamplingConfig(temperature=1e-6).greedy


@pytest.mark.parametrize("path", list(PATHS))
def test_unseeded_generation_leaves_the_global_generator_alone(smoke_model, path):
    cfg = SamplingConfig(max_new_tokens=20, temperature=1.0, stop_at_eot=False, **PATHS[path])
    torch.manual_seed(123)
    expect = torch.rand(4)
    torch.manual_seed(123)
    first = list(stream_tokens(smoke_model, [1, 2], cfg))
    assert torch.equal(torch.rand(4), expect)  # torch.seed() reseeded it at random
    assert list(stream_tokens(smoke_model, [1, 2], cfg)) != first  # still a fresh seed per call


@pytest.mark.parametrize("path", list(PATHS))
def test_a_model_in_training_mode_generates_through_the_reference(path):
    """Dropout on: the fast decoder (eval mode only) hands over to the reference loop, which
    applies it (no dropout, the same tokens as in eval mode; with it, other ones)."""
    model = build_model("tiny", "gpt_base", seed=9, dropout=0.0).train()
    kw = dict(max_new_tokens=40, temperature=0.0, stop_at_eot=False)
    expect = list(stream_tokens(build_model("tiny", "gpt_base", seed=9).eval(), [3], SamplingConfig(**kw)))
    assert list(stream_tokens(model, [3], SamplingConfig(**kw, **PATHS[path]))) == expect
    model = build_model("tiny", "gpt_base", seed=9, dropout=0.5).train()
    assert list(stream_tokens(model, [3], SamplingConfig(**kw, **PATHS[path]))) != expect


# --------------------------------------------------------------------------------------------
# Past the context: the sliding window, seen by a model whose next token depends on it
# --------------------------------------------------------------------------------------------

WINDOW_VOCAB = 16  # the ids the window models are trained on and generate
WINDOW_VARIANTS = ["gpt_base", "oelm_freeze", "synth_random", "synth_factorized", "oelm_poet"]


@functools.lru_cache(maxsize=None)
def _window_model(variant: str):
    """A tiny model trained (120 AdamW steps, about half a second) to continue x[p] with
    x[p] + (p odd) mod 16, p being x[p]'s position in the window: its greedy text depends on
    where the window starts. (An untrained model's greedy text repeats one token whatever the
    window; a learned pattern of the tokens alone, with no position in it, would continue the
    same way from any window that holds the pattern.) Learned to 100% on random windows, each
    argmax ahead of the runner-up by 5 logits."""
    model = build_model("tiny", variant, seed=0)
    block = model.cfg.block_size
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    odd = torch.arange(block) % 2
    for _ in range(120):
        x = torch.randint(0, WINDOW_VOCAB, (32, block), generator=gen)
        opt.zero_grad(set_to_none=True)
        model(x, (x + odd) % WINDOW_VOCAB).backward()
        opt.step()
    model.eval()
    x = torch.randint(0, WINDOW_VOCAB, (64, block), generator=gen)
    with torch.no_grad():
        assert torch.equal(model(x).argmax(-1), (x + odd) % WINDOW_VOCAB), f"{variant} did not learn the rule"
    return model


def _greedy_with_window(model, prompt: list[int], n: int, keep: int) -> list[int]:
    """n greedy tokens, each from the full forward over the window: the ids since ``start``, and
    once they would pass block_size, the most recent ``keep`` of them (stream_tokens' policy:
    keep = block_size // 2)."""
    block, ids, start = model.cfg.block_size, list(prompt), 0
    with torch.no_grad():
        for _ in range(n):
            if len(ids) - start > block:
                start = len(ids) - keep
            ids.append(int(model(torch.tensor([ids[start:]]))[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("variant", WINDOW_VARIANTS)
def test_greedy_text_past_the_context_follows_the_window(variant, one_thread):
    """Three contexts' worth of greedy tokens on every path (the fast decoder's fixed-shape steps,
    the reference cached loop, each with prefills at every restart, and the uncached reference)
    equal the full forward over the windows the policy gives;
    a window one token shorter or longer gives another text, so a path whose window is off by
    one fails here."""
    model = _window_model(variant)
    block = model.cfg.block_size
    n = 3 * block
    kw = dict(max_new_tokens=n, temperature=0.0, stop_at_eot=False)
    for prompt in ([5], [7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3]):
        expected = _greedy_with_window(model, prompt, n, keep=block // 2)
        for keep in (block // 2 - 1, block // 2 + 1):
            other = _greedy_with_window(model, prompt, n, keep=keep)
            assert other != expected and other[: block - len(prompt) + 1] == expected[: block - len(prompt) + 1]
        for path, switches in PATHS.items():
            tokens = list(stream_tokens(model, prompt, SamplingConfig(**kw, **switches)))
            wrong = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
            assert tokens == expected, (
                f"{path} path, prompt {prompt}: token {wrong} is {tokens[wrong]}, "
                f"the window's forward gives {expected[wrong]}"
            )


def test_the_reference_imports_no_fast_path():
    """The reference generation imports nothing of oelm_core.fast, whatever SamplingConfig.fast
    says, nor does the fast door without it (no Triton, no optimizer-step hook); with it, on the
    CPU, the door loads the fast decoder but still no Triton."""
    code = (
        "import sys, torch\n"
        "torch.set_num_threads(1)\n"
        "from oelm_core import build_model\n"
        "from oelm_core.generate import SamplingConfig, stream_tokens\n"
        "m = build_model('tiny', 'gpt_base').eval()\n"
        "cfg = SamplingConfig(max_new_tokens=20, temperature=0.0, stop_at_eot=False)\n"
        "list(stream_tokens(m, [1], cfg))\n"
        "assert not [n for n in sys.modules if n.startswith('oelm_core.fast') or n == 'triton'], sys.modules\n"
        "from oelm_core import fast\n"
        "cfg.fast = False\n"
        "list(fast.stream_tokens(m, [1], cfg)); list(fast.stream_tokens(m, [1], SamplingConfig(use_cache=False)))\n"
        "assert not [n for n in sys.modules if n.startswith('oelm_core.fast.') or n == 'triton'], sys.modules\n"
        "cfg.fast = True\n"
        "list(fast.stream_tokens(m, [1], cfg))\n"
        "assert 'oelm_core.fast.decode' in sys.modules and 'oelm_core.fast.cpu_decode' in sys.modules\n"
        "assert 'triton' not in sys.modules and 'oelm_core.fast.decode_kernels' not in sys.modules\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
