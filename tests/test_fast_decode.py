"""The fast decoder (oelm_core.fast.decode, fast.cpu_decode) gives the reference loop's tokens.

On the CPU: the fixed-shape step against the full forward, the decoder's tokens against
``generate.reference_tokens`` with each part switched on and off, its fallbacks, and the
transposed weight copies (never stale). On a GPU (marked ``gpu``): the CUDA-graph decoder with
the Triton kernels, every switch combination, against the reference loop on the same GPU. The
Triton kernels themselves: tests/test_decode_kernels.py, tests/test_sample_kernels.py.
"""

import importlib.util
import itertools
import os

import pytest
import torch

from oelm_core import build_model
from oelm_core.fast import decode, stream_tokens
from oelm_core.fast.cpu_decode import CPUCopies
from oelm_core.fast.decode import GraphDecoder, acquire_decoder, decode_step, forget_decoder, release_decoder
from oelm_core.generate import SamplingConfig, gumbel_noise, sample, sample_from_noise, seed_tensor

CUDA = torch.cuda.is_available()
TRITON = importlib.util.find_spec("triton") is not None
requires_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

# Small CPU tensors: one thread (conftest), or a busy machine's oversubscription slows them down.
pytestmark = pytest.mark.usefixtures("one_thread")

DECODE_VARIANTS = ["gpt_base", "oelm_freeze", "synth_random", "synth_factorized", "oelm_poet"]


def _decode_model(variant, device="cpu"):
    model = build_model("tiny", variant, seed=3).eval()
    if variant == "oelm_poet":  # R, P away from the identity, as after training
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "skew_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.to(device)


def _reference(model, prompt, **kw):
    """The reference KV-cached loop's tokens (and the uncached one's, which must be the same)."""
    cached = list(stream_tokens(model, prompt, SamplingConfig(**kw, fast=False)))
    assert cached == list(stream_tokens(model, prompt, SamplingConfig(**kw, use_cache=False)))
    return cached


# --------------------------------------------------------------------------------------------
# The fixed-shape one-token step
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("copies", [False, True])
@pytest.mark.parametrize("fixed_shape", [True, False])
@pytest.mark.parametrize("variant", DECODE_VARIANTS)
def test_decode_step_equals_the_full_forward_at_every_step(variant, fixed_shape, copies):
    """Both ways of attending (the whole cache under a mask, as CUDA graphs need, or the keys
    up to pos only), with and without the CPU's transposed copies, give the full forward's
    logits."""
    model = _decode_model(variant)
    copies = CPUCopies(model) if copies else None
    block = model.cfg.block_size
    idx = torch.randint(0, 128, (1, block), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(idx)[0]
        cache = model.new_cache()
        for layer in range(model.cfg.n_layer):  # stale, finite junk past the prefix: masked out
            cache.k[layer].normal_(0, 50)
            cache.v[layer].normal_(0, 50)
        prefix = model(idx[:, :5], cache=cache)[0]
        assert (prefix - full[:5]).abs().max().item() < 1e-5
        for t in range(5, block):  # up to the last position of the context
            logits = decode_step(model, idx[:, t : t + 1], torch.tensor([t]), cache, fixed_shape, copies)
            assert logits.shape == (1, model.cfg.vocab_size)
            assert (logits[0] - full[t]).abs().max().item() < 1e-5, t
        # From an empty cache too (a one-token prompt starts at position 0).
        cache = model.new_cache()
        for t in range(block):
            logits = decode_step(model, idx[:, t : t + 1], torch.tensor([t]), cache, fixed_shape, copies)
            assert (logits[0] - full[t]).abs().max().item() < 1e-5, t


# --------------------------------------------------------------------------------------------
# The decoder's tokens against the reference loop (CPU)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", DECODE_VARIANTS)
def test_decoder_tokens_equal_the_reference_past_the_context(variant):
    """Greedy and seeded sampling (top-k and top-p), three windows long (two restarts), with
    and without the CPU's transposed copies."""
    model = _decode_model(variant)
    for sampling in (dict(temperature=0.0), dict(temperature=0.9, top_k=40, top_p=0.95, seed=7)):
        kw = dict(max_new_tokens=3 * model.cfg.block_size, stop_at_eot=False, **sampling)
        for prompt in ([5], list(range(7, 20))):
            expect = list(stream_tokens(model, prompt, SamplingConfig(**kw, fast=False)))
            assert len(expect) == kw["max_new_tokens"]
            if not sampling["temperature"]:  # and the uncached path (test_generate.py: sampling too)
                assert expect == list(stream_tokens(model, prompt, SamplingConfig(**kw, use_cache=False)))
            for cpu_copies in (True, False):
                fast = list(decode.stream_tokens(model, prompt, SamplingConfig(**kw), cpu_copies=cpu_copies))
                assert fast == expect, (sampling, prompt, cpu_copies)
    for cpu_copies in (True, False):
        decoder = acquire_decoder(model, cpu_copies=cpu_copies)
        release_decoder(decoder)
        assert (decoder.copies is not None) == cpu_copies and decoder.mode == "eager" and decoder.kernels == "torch"


def test_generate_uses_the_fast_decoder_with_its_defaults():
    model = build_model("tiny", "gpt_base", seed=10).eval()
    forget_decoder(model)
    kw = dict(max_new_tokens=20, temperature=0.0, stop_at_eot=False)
    tokens = list(stream_tokens(model, [1, 2], SamplingConfig(**kw)))
    decoder = acquire_decoder(model)  # the one stream_tokens made, reused: the same switches
    release_decoder(decoder)
    assert decoder.copies is not None and tokens == _reference(model, [1, 2], **kw)
    other = acquire_decoder(model, cpu_copies=False)  # other switches, another decoder
    release_decoder(other)
    assert other is not decoder and other.copies is None
    assert acquire_decoder(model) is decoder  # both kept
    release_decoder(decoder)


def test_unknown_switches_are_refused_by_name():
    model = build_model("tiny", "gpt_base").eval()
    with pytest.raises(TypeError, match="cuda_graph"):
        list(decode.stream_tokens(model, [1], SamplingConfig(max_new_tokens=2), cuda_graph=False))
    with pytest.raises(ValueError, match=r"eval mode: call model.eval\(\)"):
        list(decode.stream_tokens(model.train(), [1], SamplingConfig(max_new_tokens=2)))


def test_sample_on_the_cpu_is_the_torch_draw():
    """Without CUDA (and outside Triton's interpreter) the fast decoder's sample() is the
    reference draw; GPUs draw the same tokens through fast.sample_kernels (its tests)."""
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    for cfg in (SamplingConfig(temperature=1.0, top_k=5), SamplingConfig(temperature=0.0)):
        for step in range(5):
            seed_t, step_t = seed_tensor(9, "cpu"), torch.tensor([step])
            expect = (
                sample_from_noise(logits, cfg, gumbel_noise(seed_t, step_t, 1, 10)[0])
                if not cfg.greedy
                else logits.argmax(-1)
            )
            assert torch.equal(decode.sample(logits, cfg, seed_t, step_t), expect)
            assert torch.equal(sample(logits, cfg, seed_t, step_t), expect)
    if os.environ.get("TRITON_INTERPRET") != "1":
        from oelm_core.fast import sample_kernels

        assert not sample_kernels.supports(logits, 5, 1.0)
        decoder = GraphDecoder(build_model("tiny", "gpt_base").eval())
        assert decoder.sampler(SamplingConfig(temperature=1.0, top_k=5)) == "torch"
        assert decoder.sampler(SamplingConfig(temperature=0.0)) == "argmax"


def test_decoder_is_reused_across_calls_and_replaced_when_the_weights_move():
    model = build_model("tiny", "oelm_freeze", seed=4).eval()
    kw = dict(max_new_tokens=40, temperature=0.0, stop_at_eot=False)
    a = acquire_decoder(model)
    release_decoder(a)
    first = list(stream_tokens(model, [1, 2, 3], SamplingConfig(**kw)))
    b = acquire_decoder(model)
    release_decoder(b)
    assert a is b and a.mode == "eager"  # CPU: the same fixed-shape step, not captured
    assert list(stream_tokens(model, [1, 2, 3], SamplingConfig(**kw))) == first
    model.unfreeze_qk()  # new weight tensors: the old decoder must not be used
    c = acquire_decoder(model)
    release_decoder(c)
    assert c is not a
    plain = list(stream_tokens(model, [1, 2, 3], SamplingConfig(**kw, use_cache=False)))
    assert list(stream_tokens(model, [1, 2, 3], SamplingConfig(**kw))) == plain == first


def test_interleaved_streams_of_one_model_do_not_share_a_cache():
    model = build_model("tiny", "gpt_base", seed=5).eval()
    kw = dict(max_new_tokens=50, temperature=0.0, stop_at_eot=False)
    expect = [list(stream_tokens(model, p, SamplingConfig(**kw, use_cache=False))) for p in ([1, 2], [9])]
    s1, s2 = (stream_tokens(model, p, SamplingConfig(**kw)) for p in ([1, 2], [9]))
    got = [[], []]
    for t1, t2 in zip(s1, s2):
        got[0].append(t1)
        got[1].append(t2)
    assert got == expect


def test_seeded_sampling_through_the_decoder_matches_the_plain_paths():
    model = build_model("tiny", "oelm_freeze", seed=6).eval()
    kw = dict(temperature=1.0, top_k=20, top_p=0.9, seed=11, stop_at_eot=False)
    # Within the context (2 + 29 < 32 tokens) the uncached path sees the same tokens.
    cached = list(stream_tokens(model, [3, 4], SamplingConfig(**kw, max_new_tokens=29)))
    plain = list(stream_tokens(model, [3, 4], SamplingConfig(**kw, max_new_tokens=29, use_cache=False)))
    assert cached == plain
    # Past it too (the window keeps its most recent half on every path), and the same as the
    # plain cached path (model(x, cache=cache) per token).
    cached = list(stream_tokens(model, [3, 4], SamplingConfig(**kw, max_new_tokens=100)))
    assert cached == _reference(model, [3, 4], **kw, max_new_tokens=100)
    decoder = acquire_decoder(model)
    release_decoder(decoder)
    decoder.mode = "legacy"
    legacy = list(stream_tokens(model, [3, 4], SamplingConfig(**kw, max_new_tokens=100)))
    assert acquire_decoder(model) is decoder and cached == legacy
    release_decoder(decoder)


def test_decoder_falls_back_when_the_fixed_shape_step_or_the_capture_fails(monkeypatch):
    model = build_model("tiny", "gpt_base", seed=7).eval()
    kw = dict(max_new_tokens=70, temperature=0.0, stop_at_eot=False)
    plain = list(stream_tokens(model, [1], SamplingConfig(**kw, use_cache=False)))
    # A failed capture (here: no CUDA at all) leaves the eager fixed-shape step.
    decoder = GraphDecoder(model)
    greedy = SamplingConfig(temperature=0.0)
    decoder.prefill(model, [1], 0, greedy)
    with pytest.warns(UserWarning, match="capture"):
        decoder._capture(model, 4, greedy)
    assert decoder.mode == "eager" and not decoder.graphs
    assert decoder.out[:4].tolist() == plain[1:5]  # the eager fallback ran this call's steps
    # A device where even the eager step fails: the plain cached path, same tokens.
    monkeypatch.setattr(decode, "decode_step", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("x")))
    fresh = build_model("tiny", "gpt_base", seed=7).eval()
    with pytest.warns(UserWarning, match="plain cached path"):
        cached = list(stream_tokens(fresh, [1], SamplingConfig(**kw)))
    assert cached == plain


# --------------------------------------------------------------------------------------------
# The CPU's transposed weight copies: the plain products' numbers, never stale
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
def test_one_row_logits_on_the_cpu_follow_the_weight(tie):
    """A decoding step's logits come from a transposed copy of the output weight: equal to the
    plain product, and remade when the weight changes in place (as an optimiser step does)."""
    torch.manual_seed(0)
    model = build_model("tiny", "gpt_base", tie_embeddings=tie, vocab_size=100).eval()  # 128 rows
    copies = CPUCopies(model)
    h = torch.randn(1, 1, model.cfg.d_model)
    vocab, weight = model.cfg.vocab_size, model.output_weight
    with torch.no_grad():
        plain = torch.nn.functional.linear(h, weight)[..., :vocab]
        assert copies.applies(h) and torch.allclose(copies.logits(model, h), plain, atol=1e-6)
        copy = copies._out._value
        assert copy.is_contiguous() and copy.shape == (model.cfg.d_model, model.cfg.padded_vocab_size)
        weight.mul_(-2.0)
        assert torch.allclose(copies.logits(model, h), -2.0 * plain, atol=1e-5)
        assert copies._out._value is not copy
        h3 = torch.randn(2, 3, model.cfg.d_model)  # many rows: the plain product, no copy involved
        assert not copies.applies(h3)
        assert torch.allclose(decode._logits(model, h3, copies), torch.nn.functional.linear(h3, weight)[..., :vocab])
    assert not copies.applies(h)  # with gradients: the plain product, differentiable
    grad_h = h.clone().requires_grad_()
    decode._logits(model, grad_h, copies).sum().backward()
    # d(sum of logits)/dW: h in every row that is a logit, 0 in the padding; d/dh: those rows' sum.
    assert torch.allclose(weight.grad[:vocab], h.view(1, -1).expand(vocab, -1))
    assert not weight.grad[vocab:].any()
    assert torch.allclose(grad_h.grad, weight[:vocab].sum(0).view_as(h), atol=1e-6)


@pytest.mark.parametrize("variant,bias", [("gpt_base", True), ("oelm_freeze", False)])
def test_one_row_layer_products_on_the_cpu_equal_the_plain_ones(variant, bias):
    """q, k, v and the MLP's first layer of one row on the CPU come from transposed copies of
    the weights (q/k/v concatenated): the same numbers as the per-weight products, also after
    the weights change in place, with and without biases."""
    torch.manual_seed(0)
    model = build_model("tiny", variant, bias=bias, attn_bias=bias).eval()
    block, copies = model.blocks[0], CPUCopies(model)
    attn, mlp = block.attn, block.mlp
    x = torch.randn(1, 1, attn.cfg.d_model)
    d = attn.cfg.d_model

    def plain():
        q, k = torch.nn.functional.linear(x, attn.qk.weight).split(d, dim=-1)
        return q, k, attn.v(x), mlp.fc(x)

    with torch.no_grad():
        for step in range(2):
            got = (*copies.qkv(attn, x), copies.fc(mlp, 0, x))
            for a, b in zip(got, plain()):
                assert a.shape == b.shape and (a - b).abs().max().item() < 1e-6
            assert copies._qkv[0]._value.shape == (d, 3 * d) and copies._fc[0]._value.shape == (d, attn.cfg.d_ff)
            for w in (attn.qk.weight, attn.v.weight, mlp.fc.weight):
                w.mul_(-1.5)  # an in-place change, as an optimiser step makes: the copies follow
    # Layers without a plain Q/K projection compute q, k, v as usual.
    assert copies.qkv(build_model("tiny", "synth_random").blocks[0].attn, x) is None


def test_one_row_products_follow_a_fused_optimizer_step():
    """The trainer's fused AdamW writes the weights without bumping their version counters: the
    transposed copies must follow it anyway, so cached decoding after training in the same
    process uses the trained weights (it used the old ones, and drew other tokens)."""
    torch.manual_seed(0)
    model = build_model("tiny", "gpt_base", seed=1).eval()
    h = torch.randn(1, 1, model.cfg.d_model)
    vocab, weight = model.cfg.vocab_size, model.output_weight
    kw = dict(max_new_tokens=20, temperature=0.0, stop_at_eot=False)
    before = list(stream_tokens(model, [1, 2, 3], SamplingConfig(**kw)))  # makes every copy
    decoder = acquire_decoder(model)
    release_decoder(decoder)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    x = torch.randint(0, 128, (2, 16))
    model.train()
    model(x, x.roll(-1, 1)).backward()
    versions = [p._version for p in model.parameters()]
    opt.step()
    assert [p._version for p in model.parameters()] == versions  # what the step counter is for
    model.eval()
    with torch.no_grad():
        plain = torch.nn.functional.linear(h, weight)[..., :vocab]
        assert (decoder.copies.logits(model, h) - plain).abs().max().item() < 1e-5
    cached = list(stream_tokens(model, [1, 2, 3], SamplingConfig(**kw)))
    assert acquire_decoder(model) is decoder  # the same decoder: its copies were remade
    release_decoder(decoder)
    assert cached == _reference(model, [1, 2, 3], **kw)
    assert cached != before  # lr 0.5: the step did change what the model says
    # A write through .data is seen by neither key: forget_decoder() makes decoding follow it.
    with torch.no_grad():
        weight.data.mul_(-2.0)
        forget_decoder(model)
        assert (decoder.copies.logits(model, h) + 2.0 * plain).abs().max().item() < 1e-5
    assert list(stream_tokens(model, [1, 2, 3], SamplingConfig(**kw))) == _reference(model, [1, 2, 3], **kw)


def test_decoding_follows_load_state_dict():
    """load_state_dict writes the weights in place (same tensors, same addresses): the copies
    and the kept decoder must follow it."""
    kw = dict(max_new_tokens=40, temperature=0.0, stop_at_eot=False)
    models = {s: build_model("tiny", "gpt_base", seed=s).eval() for s in (3, 4)}
    expect = {s: _reference(m, [1, 2, 3], **kw) for s, m in models.items()}
    assert expect[3] != expect[4]
    model = models[3]
    assert list(stream_tokens(model, [1, 2, 3], SamplingConfig(**kw))) == expect[3]
    decoder = acquire_decoder(model)
    release_decoder(decoder)
    model.load_state_dict(models[4].state_dict())
    assert list(stream_tokens(model, [1, 2, 3], SamplingConfig(**kw))) == expect[4]
    assert acquire_decoder(model) is decoder  # reused, its copies remade
    release_decoder(decoder)


def test_models_made_under_inference_mode_decode_on_the_cpu():
    """Weights made under torch.inference_mode have no version counter (reading it raised
    "Inference tensors do not track version counter" at the first one-token step), and inside
    that mode load_state_dict writes them in place: decoding must follow such a write too."""
    kw = dict(max_new_tokens=40, temperature=0.0, stop_at_eot=False)
    expect = {
        s: list(stream_tokens(build_model("tiny", "gpt_base", seed=s).eval(), [1, 2, 3], SamplingConfig(**kw)))
        for s in (3, 4)
    }
    assert expect[3] != expect[4]
    with torch.inference_mode():
        model = build_model("tiny", "gpt_base", seed=3).eval()
        assert model.wte.weight.is_inference()
        assert list(stream_tokens(model, [1, 2, 3], SamplingConfig(**kw))) == expect[3]
    # The decoder kept from that call is reused outside inference mode.
    assert list(stream_tokens(model, [1, 2, 3], SamplingConfig(**kw))) == expect[3]
    with torch.inference_mode():
        model.load_state_dict(build_model("tiny", "gpt_base", seed=4).state_dict())
        assert list(stream_tokens(model, [1, 2, 3], SamplingConfig(**kw))) == expect[4]


# --------------------------------------------------------------------------------------------
# On a GPU: the CUDA-graph decoder with the Triton kernels against the reference loop
# --------------------------------------------------------------------------------------------


@pytest.fixture
def float32_matmuls():
    """Full float32 GEMMs for the reference (a training run in this process may have turned
    TF32 on), so that both sides compute in float32."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(precision)


SWITCHES = [
    dict(zip(("graph", "decode_kernels", "sample_kernels"), on)) for on in itertools.product([True, False], repeat=3)
]
SAMPLINGS = {
    "greedy": dict(temperature=0.0),
    "top_k": dict(temperature=0.9, top_k=40, seed=7),
    "top_p": dict(temperature=0.8, top_k=50, top_p=0.9, seed=3),
}
_GPU_REFERENCE: dict = {}


@pytest.mark.gpu
@requires_gpu
@pytest.mark.usefixtures("float32_matmuls")
@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("switches", SWITCHES, ids=lambda s: "-".join(k for k, v in s.items() if v) or "none")
@pytest.mark.parametrize("variant", ["gpt_base", "oelm_freeze", "synth_random", "oelm_poet"])
def test_gpu_decoder_tokens_equal_the_reference_past_the_context(variant, switches, sampling):
    """Every combination of the GPU's switches, three windows long (two restarts)."""
    model = _decode_model(variant, "cuda")
    kw = dict(max_new_tokens=3 * model.cfg.block_size, stop_at_eot=False, **SAMPLINGS[sampling])
    for prompt in ([5], list(range(7, 20))):
        key = (variant, sampling, len(prompt))
        if key not in _GPU_REFERENCE:  # the same for every switch combination
            _GPU_REFERENCE[key] = _reference(model, prompt, **kw)
        for _ in range(2):  # the second time through the kept decoder's captured graphs
            fast = list(decode.stream_tokens(model, prompt, SamplingConfig(**kw), **switches))
            assert fast == _GPU_REFERENCE[key], (prompt, _)
    decoder = acquire_decoder(model, **switches)
    release_decoder(decoder)
    assert decoder.mode == ("graph" if switches["graph"] else "eager") and decoder.copies is None
    fused = switches["decode_kernels"] and TRITON and variant in ("gpt_base", "oelm_freeze")
    assert decoder.kernels == ("triton" if fused else "torch")
    cfg = SamplingConfig(**SAMPLINGS[sampling])
    assert decoder.sampler(cfg) == (
        "triton"
        if switches["sample_kernels"] and TRITON and (switches["graph"] or not cfg.greedy)
        else "argmax"
        if cfg.greedy
        else "torch"
    )


@pytest.mark.gpu
@requires_gpu
@pytest.mark.usefixtures("float32_matmuls")
def test_gpu_generation_at_medium512_equals_the_reference():
    """The preset the benchmarks time: 256 new tokens after 16, greedy and sampled, default
    switches (graph, fused step, Triton sampler) against the reference loop."""
    model = build_model("medium512", "gpt_base", seed=0).cuda().eval()
    prompt = torch.randint(0, 50000, (16,), generator=torch.Generator().manual_seed(0)).tolist()
    for sampling in (dict(temperature=0.0), dict(temperature=0.8, top_k=50, seed=0)):
        kw = dict(max_new_tokens=256, stop_at_eot=False, **sampling)
        expect = list(stream_tokens(model, prompt, SamplingConfig(**kw, fast=False)))
        assert list(stream_tokens(model, prompt, SamplingConfig(**kw))) == expect
    decoder = acquire_decoder(model)
    release_decoder(decoder)
    assert decoder.mode == "graph" and decoder.kernels == ("triton" if TRITON else "torch")
