"""The GPT: exact parameter counts, frozen Q/K, the two attention paths, the FLOP account."""

import pytest
import torch

from oelm_core import ConfigError, build_model, count_parameters, flops_per_token, memory_account, model_config
from oelm_core.generate import SamplingConfig, stream_tokens
from oelm_core.orthogonal import orthogonality_error

MEDIUM_TOTAL = 44_896_768
QK_FROZEN = 6 * 2 * 512 * 512  # 3,145,728


@pytest.fixture(scope="module")
def medium():
    return {v: build_model("medium512", v) for v in ("gpt_base", "oelm_nofreeze", "oelm_freeze")}


def test_medium512_counts_match_the_study(medium):
    base = count_parameters(medium["gpt_base"])
    assert (base["trainable"], base["frozen"], base["total"]) == (MEDIUM_TOTAL, 0, MEDIUM_TOTAL)
    assert count_parameters(medium["oelm_nofreeze"]) == base  # orthogonal init changes no count
    freeze = count_parameters(medium["oelm_freeze"])
    assert freeze["trainable"] == 41_751_040
    assert freeze["frozen"] == QK_FROZEN
    assert freeze["total"] == MEDIUM_TOTAL
    assert freeze["by_component"]["attn_qk"] == {"trainable": 0, "frozen": QK_FROZEN}
    # The padded vocabulary rows exist for speed but are not parameters.
    assert medium["gpt_base"].wte.weight.shape[0] == 50_304
    assert base["by_component"]["embedding"]["trainable"] == 50_257 * 512


def test_orthogonal_qk_is_orthogonal_in_every_layer(medium):
    d = 512
    for block in medium["oelm_freeze"].blocks:
        w = block.attn.qk.weight
        assert orthogonality_error(w[:d]) < 1e-5 and orthogonality_error(w[d:]) < 1e-5
    # GPT-2's N(0, 0.02) is far from orthogonal.
    assert orthogonality_error(medium["gpt_base"].blocks[0].attn.qk.weight[:d]) > 0.5


def test_frozen_qk_are_buffers_that_survive_training():
    model = build_model("tiny", "oelm_freeze", freeze_qk=[0])
    assert "blocks.0.attn.qk.weight" in dict(model.named_buffers())
    assert "blocks.1.attn.qk.weight" in dict(model.named_parameters())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    assert all(p is not model.blocks[0].attn.qk.weight for g in opt.param_groups for p in g["params"])
    x = torch.randint(0, 128, (4, 16))
    for _ in range(3):
        opt.zero_grad()
        model(x, x.roll(-1, 1)).backward()
        opt.step()
    after = model.state_dict()
    assert torch.equal(after["blocks.0.attn.qk.weight"], before["blocks.0.attn.qk.weight"])
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert "blocks.1.attn.qk.weight" in changed and "blocks.0.attn.v.weight" in changed
    # Saved and restored with the model.
    clone = build_model("tiny", "oelm_freeze", freeze_qk=[0], seed=123)
    clone.load_state_dict(after)
    assert torch.equal(clone.blocks[0].attn.qk.weight, after["blocks.0.attn.qk.weight"])


def test_unfreeze_turns_buffers_into_parameters():
    model = build_model("tiny", "oelm_freeze")
    frozen = count_parameters(model)["frozen"]
    new = model.unfreeze_qk([1])
    assert len(new) == 1 and new[0].requires_grad
    assert count_parameters(model)["frozen"] == frozen // 2
    assert model.unfreeze_qk([1]) == []  # already trainable


@pytest.mark.parametrize("variant", ["gpt_base", "oelm_freeze"])
def test_attention_path_matches_sdpa(variant):
    torch.manual_seed(0)
    model = build_model("tiny", variant, seed=3).eval()
    idx = torch.randint(0, 128, (2, 20))
    fast = model(idx)
    slow, maps = model.forward_with_attention(idx)
    assert torch.allclose(fast, slow, atol=1e-5)
    assert len(maps) == 2 and maps[0].shape == (2, 2, 20, 20)
    assert torch.allclose(maps[0].sum(-1), torch.ones(2, 2, 20), atol=1e-5)
    assert torch.all(maps[0].triu(1) == 0)  # causal


@pytest.mark.parametrize("variant", ["gpt_base", "oelm_freeze", "synth_random"])
def test_attention_output_is_dropped_like_the_mlps(variant):
    """GPT-2's resid_dropout: in training, dropout after the attention's output projection, as
    after the MLP's. Exact zeros in the branch's output come from that dropout alone (p = 0.5:
    half of them); in eval mode nothing is dropped."""
    torch.manual_seed(0)
    model = build_model("tiny", variant, dropout=0.5)
    x = torch.randn(2, 20, 32)
    for branch in (model.blocks[0].attn, model.blocks[0].mlp):
        zeros = (branch(x) == 0).float().mean().item()
        assert 0.4 < zeros < 0.6, (type(branch).__name__, zeros)
    plain = build_model("tiny", variant, dropout=0.0).eval()
    idx = torch.randint(0, 128, (2, 20))
    assert torch.equal(model.eval()(idx), plain(idx))


def test_build_model_refuses_a_variant_or_overrides_it_would_not_apply():
    cfg = model_config("tiny", "gpt_base")
    with pytest.raises(TypeError, match=r"ModelConfig together with variant='oelm_freeze', freeze_qk"):
        build_model(cfg, "oelm_freeze", freeze_qk="all")
    with pytest.raises(TypeError, match=r"together with nonsense_key.*dataclasses\.replace"):
        build_model(cfg, nonsense_key=1)
    # Whichever variant: "gpt_base" (the default variant) was once taken as no variant at all.
    for variant in ("gpt_base", "oelm_nofreeze"):
        with pytest.raises(TypeError, match=f"ModelConfig together with variant='{variant}', which"):
            build_model(cfg, variant)
    assert build_model(cfg, seed=1).cfg is cfg


def test_build_model_leaves_the_defaults_to_the_config(monkeypatch):
    """Left out, the preset and the variant are the ones config.model_config defaults to: moved
    there (here to tiny / oelm_freeze), build_model follows, with no copy of its own."""
    monkeypatch.setattr(model_config, "__defaults__", ("tiny", "oelm_freeze"))
    model = build_model()
    assert (model.cfg.n_layer, model.cfg.vocab_size, model.cfg.frozen_layers()) == (2, 128, [0, 1])
    assert build_model("smoke").cfg.frozen_layers() == [0, 1]
    assert build_model(variant="gpt_base", n_layer=1).cfg == model_config("tiny", "gpt_base", n_layer=1)


@pytest.mark.parametrize("tie", [True, False])
def test_one_row_logits_on_the_cpu_follow_the_weight(tie):
    """A decoding step's logits come from a transposed copy of the output weight: equal to the
    plain product, and remade when the weight changes in place (as an optimiser step does)."""
    torch.manual_seed(0)
    model = build_model("tiny", "gpt_base", tie_embeddings=tie).eval()
    h = torch.randn(1, 1, model.cfg.d_model)
    vocab, weight = model.cfg.vocab_size, model.output_weight
    with torch.no_grad():
        plain = torch.nn.functional.linear(h, weight)[..., :vocab]
        assert torch.allclose(model.logits(h), plain, atol=1e-6)
        copy = model._output_t._value
        assert copy.is_contiguous() and copy.shape == (model.cfg.d_model, model.cfg.padded_vocab_size)
        weight.mul_(-2.0)
        assert torch.allclose(model.logits(h), -2.0 * plain, atol=1e-5)
        assert model._output_t._value is not copy
        h3 = torch.randn(2, 3, model.cfg.d_model)  # many rows: the plain product, no copy involved
        assert torch.allclose(model.logits(h3), torch.nn.functional.linear(h3, weight)[..., :vocab])
    grad_h = h.clone().requires_grad_()
    model.logits(grad_h).sum().backward()  # with gradients: the plain product, differentiable
    assert weight.grad is not None and grad_h.grad.shape == h.shape


@pytest.mark.parametrize("variant,bias", [("gpt_base", True), ("oelm_freeze", False)])
def test_one_row_layer_products_on_the_cpu_equal_the_plain_ones(variant, bias):
    """q, k, v and the MLP's hidden layer of one row on the CPU come from transposed copies of
    the weights (q/k/v concatenated): the same numbers as the per-weight products, also after
    the weights change in place, with and without biases."""
    torch.manual_seed(0)
    block = build_model("tiny", variant, bias=bias, attn_bias=bias).eval().blocks[0]
    attn, mlp = block.attn, block.mlp
    x = torch.randn(1, 1, attn.cfg.d_model)
    d = attn.cfg.d_model

    def plain():
        q, k = torch.nn.functional.linear(x, attn.qk.weight).split(d, dim=-1)
        return q, k, attn.v(x), torch.nn.functional.gelu(mlp.fc(x), approximate="tanh")

    with torch.no_grad():
        for step in range(2):
            got = (*attn._qkv(x), mlp.hidden(x))
            for a, b in zip(got, plain()):
                assert a.shape == b.shape and (a - b).abs().max().item() < 1e-6
            assert attn._qkv_t._value.shape == (d, 3 * d) and mlp._fc_t._value.shape == (d, attn.cfg.d_ff)
            for w in (attn.qk.weight, attn.v.weight, mlp.fc.weight):
                w.mul_(-1.5)  # an in-place change, as an optimiser step makes: the copies follow
    with torch.enable_grad():  # with gradients: the plain products, no copy
        assert (mlp.hidden(x) - plain()[3]).abs().max().item() == 0.0


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
    opt = torch.optim.AdamW(model.parameters(), lr=0.5, fused=True)
    x = torch.randint(0, 128, (2, 16))
    model.train()
    model(x, x.roll(-1, 1)).backward()
    opt.step()  # torch 2.13: weight._version unchanged
    model.eval()
    with torch.no_grad():
        plain = torch.nn.functional.linear(h, weight)[..., :vocab]
        assert (model.logits(h) - plain).abs().max().item() < 1e-5
    cached = list(stream_tokens(model, [1, 2, 3], SamplingConfig(**kw)))
    assert cached == list(stream_tokens(model, [1, 2, 3], SamplingConfig(**kw, use_cache=False)))
    assert cached != before  # lr 0.5: the step did change what the model says
    # A write through .data is seen by neither key: drop_transposed_copies() makes them follow.
    with torch.no_grad():
        weight.data.mul_(-2.0)
        model.drop_transposed_copies()
        assert (model.logits(h) + 2.0 * plain).abs().max().item() < 1e-5


def test_models_made_under_inference_mode_decode_on_the_cpu():
    """Weights made under torch.inference_mode have no version counter (reading it raised
    "Inference tensors do not track version counter" at the first one-token step), and inside
    that mode load_state_dict writes them in place: decoding must follow such a write too."""
    kw = dict(max_new_tokens=40, temperature=0.0, stop_at_eot=False)
    expect = {s: list(stream_tokens(build_model("tiny", "gpt_base", seed=s).eval(), [1, 2, 3],
                                    SamplingConfig(**kw))) for s in (3, 4)}
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


def test_over_long_input_errors_say_what_helps():
    """Without a cache the input is too long; with one, the cache is what fills the context
    (the tiny preset holds 32 positions), and only a reset and a new prefill help."""
    model = build_model("tiny", "gpt_base").eval()
    with pytest.raises(ValueError, match="sequence of 33 tokens exceeds the context of 32; crop the input"):
        model(torch.zeros(1, 33, dtype=torch.long))
    cache = model.new_cache()
    model(torch.zeros(1, 30, dtype=torch.long), cache=cache)
    with pytest.raises(ValueError, match=r"the KV cache holds 30 of 32 positions, no room for 3 more tokens; "
                                         r"reset it .* and prefill again with at most the last 32 tokens"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    cache.length = 0  # the advice works
    assert model(torch.zeros(1, 32, dtype=torch.long), cache=cache).shape == (1, 32, 128)


def test_chunked_loss_equals_full_logits_loss():
    torch.manual_seed(0)
    chunked = build_model("tiny", "gpt_base", loss_chunk_tokens=7)
    full = build_model("tiny", "gpt_base", loss_impl="full")
    idx, tgt = torch.randint(0, 128, (3, 32)), torch.randint(0, 128, (3, 32))
    tgt[0, :5] = -1  # ignored positions
    l1, l2 = chunked(idx, tgt), full(idx, tgt)
    l1.backward(), l2.backward()
    assert abs(l1.item() - l2.item()) < 1e-5
    for (name, p1), p2 in zip(chunked.named_parameters(), full.parameters()):
        assert torch.allclose(p1.grad, p2.grad, atol=1e-6), name


def test_counts_see_through_the_compile_and_ddp_wrappers(tmp_path):
    """The trainer counts ``torch.compile(model)`` or its DDP wrapper: the ``_orig_mod.`` and
    ``module.`` prefixes hid every component (all "other") and the vocabulary padding."""
    import torch.distributed as dist

    model = build_model("tiny", "oelm_freeze", vocab_size=100)  # padded to 128 rows
    bare = count_parameters(model)
    assert bare["by_component"]["embedding"]["trainable"] == 100 * 32
    assert bare["by_component"]["attn_qk"]["frozen"] == 2 * 2 * 32 * 32  # 2 layers of [W_q; W_k], d 32
    compiled = torch.compile(model)  # never called: only the wrapper's names matter
    assert count_parameters(compiled) == bare
    assert memory_account(compiled) == memory_account(model)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert count_parameters(torch.nn.parallel.DistributedDataParallel(compiled)) == bare
    finally:
        dist.destroy_process_group()


def test_flop_account_shows_the_small_saving_of_freezing():
    base = flops_per_token(model_config("medium512", "gpt_base"))
    freeze = flops_per_token(model_config("medium512", "oelm_freeze"))
    saved = base["total"] - freeze["total"]
    assert saved == 6 * 2 * (2 * 512 * 512)  # the W_q, W_k weight gradients of six layers
    assert 0.015 < saved / base["total"] < 0.03  # about 2%: the output layer dominates
    assert base["output"]["forward"] > 0.3 * base["total_forward"]
    mem = memory_account(build_model("tiny", "oelm_freeze"))
    assert mem["frozen_saving"] == 12 * count_parameters(build_model("tiny", "oelm_freeze"))["frozen"]


def test_presets_have_the_roadmap_shapes():
    for preset, shape in {"small": (6, 512, 8, 2048), "base": (12, 768, 12, 3072),
                          "large": (24, 1024, 16, 4096), "medium512": (6, 512, 8, 2048)}.items():
        cfg = model_config(preset)
        assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.d_ff) == shape
        assert cfg.vocab_size == 50_257 and cfg.tie_embeddings


@pytest.mark.parametrize("kwargs, message", [
    (dict(preset="nope"), "unknown preset 'nope'"),
    (dict(variant="nope"), "unknown variant 'nope'"),
    (dict(n_head=7), "n_head=7 does not divide d_model=512"),
    (dict(freeze_qk=[9]), "layers 0..5"),
    (dict(qk_init="lu"), "unknown model.qk_init"),
])
def test_bad_configs_raise_clear_errors(kwargs, message):
    preset = kwargs.pop("preset", "medium512")
    variant = kwargs.pop("variant", "gpt_base")
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        model_config(preset, variant, **kwargs)


def test_residual_projections_start_scaled_by_depth():
    import math
    model = build_model("mini", "gpt_base", vocab_size=128)  # 4 layers: 0.02 / sqrt(8) = 0.00707
    for b in model.blocks:
        assert b.attn.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.03)
        assert b.mlp.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.03)
        assert b.mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.03)


def test_synthesizer_logits_start_at_unit_row_scale():
    import math
    m = build_model("tiny", "synth_random", block_size=32)
    assert m.blocks[0].attn.synth_0.std().item() == pytest.approx(1 / math.sqrt(32), rel=0.05)
