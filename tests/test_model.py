"""The GPT: exact parameter counts, frozen Q/K, the two attention paths, the KV cache, agreement with
benchmarks/reference.py's nanoGPT-style model, the FLOP account."""

import sys
from pathlib import Path

import pytest
import torch

from oelm_core import ConfigError, build_model, count_parameters, flops_per_token, memory_account, model_config
from oelm_core.orthogonal import orthogonality_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from reference import ReferenceGPT, copy_from, reference_grads_as_model  # noqa: E402

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


def test_over_long_input_errors_say_what_helps():
    """Without a cache the input is too long; with one, the cache is what fills the context
    (the tiny preset holds 32 positions), and only a reset and a new prefill help."""
    model = build_model("tiny", "gpt_base").eval()
    with pytest.raises(ValueError, match="sequence of 33 tokens exceeds the context of 32; crop the input"):
        model(torch.zeros(1, 33, dtype=torch.long))
    cache = model.new_cache()
    model(torch.zeros(1, 30, dtype=torch.long), cache=cache)
    with pytest.raises(
        ValueError,
        match=r"the KV cache holds 30 of 32 positions, no room for 3 more tokens; "
        r"reset it .* and prefill again with at most the last 32 tokens",
    ):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    cache.length = 0  # the advice works
    assert model(torch.zeros(1, 32, dtype=torch.long), cache=cache).shape == (1, 32, 128)


def _batch(cfg, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (b, cfg.block_size), generator=g)
    y[0, :5] = -1  # ignored positions
    return x, y


def _assert_close(a, b, tol=1e-5):
    assert float((a - b).abs().max()) <= tol * max(1.0, float(b.abs().max()))


@pytest.mark.parametrize("variant", ["gpt_base", "oelm_freeze"])
@pytest.mark.parametrize("pad_vocab", [True, False])
def test_the_model_matches_the_nanogpt_reference(variant, pad_vocab):
    """benchmarks/reference.py's nanoGPT-style GPT with the same weights (one fused QKV linear,
    frozen Q/K simply not trained): the same loss, gradients and logits, within 1e-5."""
    model = build_model("tiny", variant, vocab_size=100)
    ref = copy_from(ReferenceGPT(model.cfg, pad_vocab=pad_vocab), model)
    assert ref.wte.num_embeddings == (128 if pad_vocab else 100)
    x, y = _batch(model.cfg, seed=1)
    loss = model(x, y)
    loss.backward()
    ref_loss = ref(x, y)
    ref_loss.backward()
    ref_grads = reference_grads_as_model(ref, model)
    assert abs(loss.item() - ref_loss.item()) <= 1e-5
    for name, p in model.named_parameters():  # frozen Q/K have no gradient in the model: nothing to compare
        _assert_close(p.grad[: ref_grads[name].size(0)], ref_grads[name])
    with torch.no_grad():
        _assert_close(model(x), ref(x))


# One token at a time after a 4-token prefill (attends without a mask), and chunks of several
# new tokens after cached ones (each attends to the cache and causally to the others of its
# chunk: the one case with an explicit mask in the SDPA path).
@pytest.mark.parametrize("chunks", [[4] + [1] * 8, [4, 5, 3]], ids=["one_token", "chunks"])
@pytest.mark.parametrize("variant", ["gpt_base", "oelm_freeze"])
def test_cached_decoding_matches_the_full_forward(variant, chunks):
    model = build_model("tiny", variant).eval()
    x, _ = _batch(model.cfg, b=2, seed=3)
    x = x[:, : sum(chunks)]
    ends = [sum(chunks[: i + 1]) for i in range(len(chunks))]
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache(batch=2)
        steps = [model(x[:, a:b], cache=cache) for a, b in zip([0] + ends[:-1], ends)]
    assert cache.length == x.size(1)
    _assert_close(torch.cat(steps, dim=1), full, tol=1e-4)


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


@pytest.mark.parametrize("frozen, overrides", [("all", {}), ([1], {}), ("all", {"tie_embeddings": False})])
def test_freezing_removes_exactly_the_frozen_weight_gradients_from_the_backward(frozen, overrides):
    """The backward's FLOPs, counted by torch, of GPT-Base minus OELM-Freeze's (same shape, one
    batch) are the frozen W_q, W_k weight gradients that the accounting says freezing saves. A
    frozen weight computed in one matmul with a trained one (torch.cat of the Q/K buffer and W_v)
    gets its gradient computed anyway: that costs the saving and fails here."""
    from torch.utils.flop_counter import FlopCounterMode

    idx = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0))
    measured, account = {}, {}
    for variant in ("gpt_base", "oelm_freeze"):
        model = build_model("tiny", variant, **overrides, **({} if variant == "gpt_base" else {"freeze_qk": frozen}))
        loss = model(idx, idx.roll(-1, 1))
        with FlopCounterMode(display=False) as counter:
            loss.backward()
        measured[variant] = counter.get_total_flops()
        account[variant] = flops_per_token(model.cfg)
    tokens = idx.numel()
    saving = account["oelm_freeze"]["frozen_saving"]["flops"]
    frozen_layers = len(model.cfg.frozen_layers())
    assert saving == frozen_layers * 2 * (2 * 32 * 32) > 0  # W_q and W_k: 2 FLOPs a weight a token
    assert account["gpt_base"]["total_backward"] - account["oelm_freeze"]["total_backward"] == saving
    assert measured["gpt_base"] - measured["oelm_freeze"] == tokens * saving, measured


def test_presets_have_the_roadmap_shapes():
    for preset, shape in {
        "small": (6, 512, 8, 2048),
        "base": (12, 768, 12, 3072),
        "large": (24, 1024, 16, 4096),
        "medium512": (6, 512, 8, 2048),
    }.items():
        cfg = model_config(preset)
        assert (cfg.n_layer, cfg.d_model, cfg.n_head, cfg.d_ff) == shape
        assert cfg.vocab_size == 50_257 and cfg.tie_embeddings


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(preset="nope"), "unknown preset 'nope'"),
        (dict(variant="nope"), "unknown variant 'nope'"),
        (dict(n_head=7), "n_head=7 does not divide d_model=512"),
        (dict(freeze_qk=[9]), "layers 0..5"),
        (dict(qk_init="lu"), "unknown model.qk_init"),
    ],
)
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
