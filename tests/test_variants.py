"""The issue-7 variants: exact parameter accounting, and each variant's defining property.

Counts are hand-computed. The small shape (4 layers, 4 heads, d 32, d_ff 64, T 24, vocab 128)
is chosen so that no two components coincide in size:

    embeddings  128*32 + 24*32                                        =  4,864
    per layer   ln_1 64 + v 1024 + out 1024 + ln_2 64
                + fc 32*64+64 + proj 64*32+32                          =  6,368   (without Q/K)
    Q/K         2 * 32*32 per layer                                    =  2,048
    ln_f        64
    GPT-Base    4,864 + 4*(6,368 + 2,048) + 64                         = 38,592
    synth_random      4 heads * 24*24 = 2,304 per layer instead of Q/K -> 39,616
    synth_factorized  2 * 4 heads * 24*8 = 1,536 per layer             -> 36,544
    POET (block 32 = d: one block)  4 factors * 32*31/2 = 1,984 per layer trainable
"""

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from oelm_core import VARIANTS, ConfigError, build_model, count_parameters, model_config
from oelm_core.config import run_config_from_dict
from oelm_core.model import GPT, QKProjection
from oelm_core.orthogonal import attention_logit_stats
from oelm_core.poet import POETProjection
from oelm_core.runner import load_plan

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(n_layer=4, n_head=4, d_model=32, d_ff=64, block_size=24, vocab_size=128)

NEW_VARIANTS = [
    "oelm_freeze_gaussian",
    "oelm_freeze_svd",
    "oelm_freeze_householder",
    "oelm_freeze_cayley",
    "synth_random",
    "synth_random_fixed",
    "synth_factorized",
    "oelm_freeze_shallow",
    "oelm_freeze_deep",
    "oelm_poet",
]
ALL_VARIANTS = ["gpt_base", "oelm_nofreeze", "oelm_freeze"] + NEW_VARIANTS
SYNTH = ["synth_random", "synth_random_fixed", "synth_factorized"]

# variant -> (trainable, frozen) at SMALL
SMALL_COUNTS = {
    "gpt_base": (38_592, 0),
    "oelm_nofreeze": (38_592, 0),
    "oelm_freeze": (38_592 - 8_192, 8_192),
    "oelm_freeze_gaussian": (30_400, 8_192),
    "oelm_freeze_svd": (30_400, 8_192),
    "oelm_freeze_householder": (30_400, 8_192),
    "oelm_freeze_cayley": (30_400, 8_192),
    "synth_random": (39_616, 0),
    "synth_random_fixed": (39_616 - 4 * 2_304, 4 * 2_304),
    "synth_factorized": (36_544, 0),
    "oelm_freeze_shallow": (38_592 - 4_096, 4_096),
    "oelm_freeze_deep": (38_592 - 4_096, 4_096),
    "oelm_poet": (30_400 + 4 * 1_984, 8_192),
}

MEDIUM_TRAINABLE, MEDIUM_QK = 41_751_040, 3_145_728  # OELM-Freeze at medium512


pytestmark = pytest.mark.usefixtures("one_thread")


def small(variant: str, seed: int = 0, **overrides):
    return build_model(model_config("tiny", variant, **{**SMALL, **overrides}), seed=seed)


def batch(cfg, n: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.vocab_size, (n, cfg.block_size), generator=g)
    return x, torch.roll(x, 1, dims=1)


def train_steps(model, steps: int = 3, lr: float = 1e-2, optimizer=None):
    opt = optimizer or torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)
    for s in range(steps):
        x, y = batch(model.cfg, seed=s)
        opt.zero_grad(set_to_none=True)
        model(x, y).backward()
        opt.step()
        for m in model.modules():
            if hasattr(m, "after_optimizer_step"):
                m.after_optimizer_step(s + 1)
    return opt


# ---------------------------------------------------------------------------------------------
# Registration and accounting
# ---------------------------------------------------------------------------------------------


def test_every_variant_is_registered_with_a_description():
    assert set(ALL_VARIANTS) <= set(VARIANTS)
    for name in ALL_VARIANTS:
        assert isinstance(VARIANTS[name], str) and 20 < len(VARIANTS[name]) < 120, name


def test_a_variant_registered_after_import_is_listed_where_the_app_and_analysis_read(monkeypatch):
    import oelm_core
    from oelm_core import analysis, config

    monkeypatch.setattr(config, "_VARIANT_SPECS", dict(config._VARIANT_SPECS))  # undone after the test
    config.register_variant("late_svd", "Late: frozen SVD Q/K, registered after import", qk_init="svd", freeze_qk="all")
    assert oelm_core.VARIANTS["late_svd"].startswith("Late:") and list(oelm_core.VARIANTS)[-1] == "late_svd"
    assert dict(oelm_core.VARIANTS) == config.variants()
    with pytest.raises(TypeError):
        oelm_core.VARIANTS["x"] = "read-only"
    assert analysis.parameter_table("tiny")[-1]["variant"] == "late_svd"
    assert analysis.flops_table("tiny")[-1]["variant"] == "late_svd"
    # The app (its import costs gradio's, seconds) reads the descriptions through that very
    # object: imported from oelm_core, never rebound or copied.
    tree = ast.parse((REPO / "app" / "demo.py").read_text())
    imports = [
        n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and any(a.name == "VARIANTS" for a in n.names)
    ]
    assert [(n.module, [a.asname for a in n.names if a.name == "VARIANTS"]) for n in imports] == [("oelm_core", [None])]
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == "VARIANTS"]
    assert uses and all(isinstance(n.ctx, ast.Load) for n in uses)


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_counts_at_a_small_shape(variant):
    c = count_parameters(small(variant))
    trainable, frozen = SMALL_COUNTS[variant]
    assert (c["trainable"], c["frozen"], c["total"]) == (trainable, frozen, trainable + frozen)
    # The count is what the optimizer would actually update.
    model = small(variant)
    assert sum(p.numel() for p in model.parameters() if p.requires_grad) == trainable


def test_synth_counts_by_component():
    c = count_parameters(small("synth_random_fixed"))["by_component"]
    assert c["attn_synth"] == {"trainable": 0, "frozen": 4 * 4 * 24 * 24}
    assert "attn_qk" not in c
    c = count_parameters(small("synth_factorized"))["by_component"]
    assert c["attn_synth"] == {"trainable": 4 * 2 * 4 * 24 * 8, "frozen": 0}


@pytest.mark.parametrize(
    "variant,trainable,frozen",
    [
        ("oelm_freeze_gaussian", MEDIUM_TRAINABLE, MEDIUM_QK),
        ("oelm_freeze_svd", MEDIUM_TRAINABLE, MEDIUM_QK),
        ("oelm_freeze_householder", MEDIUM_TRAINABLE, MEDIUM_QK),
        ("oelm_freeze_cayley", MEDIUM_TRAINABLE, MEDIUM_QK),
        # 3 of 6 layers frozen: 3 * 2 * 512^2 = 1,572,864 move from trainable to frozen.
        ("oelm_freeze_shallow", MEDIUM_TRAINABLE + 1_572_864, 1_572_864),
        # POET: 6 layers * 4 factors * 16 blocks * 32*31/2 = 190,464 skew entries, W0 frozen.
        ("oelm_poet", MEDIUM_TRAINABLE + 190_464, MEDIUM_QK),
    ],
)
def test_counts_at_medium512(variant, trainable, frozen):
    c = count_parameters(build_model("medium512", variant))
    assert (c["trainable"], c["frozen"], c["total"]) == (trainable, frozen, trainable + frozen)
    assert c["by_component"]["attn_qk"]["frozen"] == frozen


# ---------------------------------------------------------------------------------------------
# Freezing
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant,frozen_layers",
    [
        ("oelm_freeze", [0, 1, 2, 3]),
        ("oelm_freeze_gaussian", [0, 1, 2, 3]),
        ("oelm_freeze_svd", [0, 1, 2, 3]),
        ("oelm_freeze_householder", [0, 1, 2, 3]),
        ("oelm_freeze_cayley", [0, 1, 2, 3]),
        ("oelm_freeze_shallow", [0, 1]),
        ("oelm_freeze_deep", [2, 3]),
        ("oelm_nofreeze", []),
    ],
)
def test_frozen_qk_stay_frozen_and_the_rest_trains(variant, frozen_layers):
    model = small(variant)
    before = [b.attn.qk.weight.detach().clone() for b in model.blocks]
    assert [i for i, b in enumerate(model.blocks) if b.attn.qk.frozen] == frozen_layers
    train_steps(model)
    for i, block in enumerate(model.blocks):
        w = block.attn.qk.weight
        if i in frozen_layers:
            assert not isinstance(w, torch.nn.Parameter) and w.grad is None and not w.requires_grad
            assert torch.equal(w, before[i]), f"layer {i} frozen Q/K changed"
        else:
            assert w.grad is not None and not torch.equal(w, before[i]), f"layer {i} Q/K did not train"


@pytest.mark.parametrize(
    "n_layer,first,last", [(4, [0, 1], [2, 3]), (5, [0, 1], [3, 4]), (6, [0, 1, 2], [3, 4, 5]), (1, [], [])]
)
def test_layer_wise_freezing_any_depth(n_layer, first, last):
    assert model_config("tiny", "oelm_freeze_shallow", n_layer=n_layer).frozen_layers() == first
    assert model_config("tiny", "oelm_freeze_deep", n_layer=n_layer).frozen_layers() == last
    model = build_model("tiny", "oelm_freeze_deep", n_layer=n_layer)
    assert [i for i, b in enumerate(model.blocks) if b.attn.qk.frozen] == last


def test_unknown_freeze_name_is_rejected():
    with pytest.raises(ConfigError, match="first_half"):
        model_config("tiny", "oelm_freeze", freeze_qk="middle")


@pytest.mark.parametrize(
    "variant,layers", [("oelm_freeze", [1]), ("oelm_freeze_shallow", "all"), ("oelm_freeze_gaussian", "all")]
)
def test_unfrozen_qk_start_training(variant, layers):
    model = small(variant)
    opt = train_steps(model, steps=1)
    frozen_before = [i for i, b in enumerate(model.blocks) if b.attn.qk.frozen]
    before = [b.attn.qk.weight.detach().clone() for b in model.blocks]
    new = model.unfreeze_qk(layers)
    expected = frozen_before if layers == "all" else layers
    assert len(new) == len(expected)
    opt.add_param_group({"params": new})
    train_steps(model, steps=1, optimizer=opt)
    for i in expected:
        assert isinstance(model.blocks[i].attn.qk.weight, torch.nn.Parameter)
        assert not torch.equal(model.blocks[i].attn.qk.weight, before[i]), f"layer {i} did not start training"
    for i in set(range(4)) - set(expected) - set(frozen_before):
        assert not torch.equal(model.blocks[i].attn.qk.weight, before[i])  # was trainable all along
    for i in set(frozen_before) - set(expected):
        assert torch.equal(model.blocks[i].attn.qk.weight, before[i])  # still frozen


@pytest.mark.parametrize("variant", ["oelm_freeze", "oelm_freeze_shallow", "oelm_freeze_deep"])
def test_the_live_config_names_the_layers_frozen_now_and_rebuilds_the_model(variant):
    """Unfrozen in steps, a model's live_config() names the layers whose Q/K are still buffers,
    counted from the modules themselves; built from it, a model has the same parameters and
    buffers (names and shapes) and takes its state_dict. Before any unfreezing it is cfg itself
    ("first_half" stays "first_half")."""
    model = small(variant)
    assert model.live_config() is model.cfg
    frozen = model.cfg.frozen_layers()
    for layers in ([frozen[-1]], "all"):
        model.unfreeze_qk(layers)
        frozen = [] if layers == "all" else frozen[:-1]
        live = model.live_config()
        buffers = [i for i in range(4) if f"blocks.{i}.attn.qk.weight" in dict(model.named_buffers())]
        assert live.frozen_layers() == model.frozen_qk_layers() == buffers == frozen
        assert live.freeze_qk == (frozen or "none")
        assert dataclasses.replace(live, freeze_qk=model.cfg.freeze_qk) == model.cfg
        rebuilt = GPT(live)
        for kind in ("named_parameters", "named_buffers"):
            assert {n: t.shape for n, t in getattr(rebuilt, kind)()} == {
                n: t.shape for n, t in getattr(model, kind)()
            }, kind
        rebuilt.load_state_dict(model.state_dict())
        assert count_parameters(rebuilt) == count_parameters(model)


def test_fixed_synthesizer_stays_fixed_and_learned_one_trains():
    fixed, learned = small("synth_random_fixed"), small("synth_random")
    before_f = [b.attn.synth_0.clone() for b in fixed.blocks]
    before_l = [b.attn.synth_0.detach().clone() for b in learned.blocks]
    train_steps(fixed)
    train_steps(learned)
    for block, b0 in zip(fixed.blocks, before_f):
        assert "synth_0" in block.attn._buffers and torch.equal(block.attn.synth_0, b0)
    for block, b0 in zip(learned.blocks, before_l):
        assert block.attn.synth_0.grad is not None and not torch.equal(block.attn.synth_0, b0)
    fact = small("synth_factorized")
    r1 = fact.blocks[0].attn.synth_1.detach().clone()
    train_steps(fact)
    assert not torch.equal(fact.blocks[0].attn.synth_1, r1)
    assert all(b.attn.qk is None for b in fact.blocks)


# ---------------------------------------------------------------------------------------------
# Causality, attention rows, KV cache
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ALL_VARIANTS)
def test_changing_a_future_token_leaves_earlier_logits(variant):
    model = small(variant).eval()
    x, _ = batch(model.cfg, n=2)
    t = 13
    x2 = x.clone()
    x2[:, t] = (x2[:, t] + 7) % model.cfg.vocab_size
    with torch.no_grad():
        a, b = model(x), model(x2)
        (fa, _), (fb, _) = model.forward_with_attention(x), model.forward_with_attention(x2)
    assert torch.allclose(a[:, :t], b[:, :t], atol=1e-6, rtol=0)
    assert torch.allclose(fa[:, :t], fb[:, :t], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, t], b[:, t])  # the change itself is visible


@pytest.mark.parametrize("variant", SYNTH + ["oelm_freeze", "oelm_poet"])
def test_attention_rows_sum_to_one_and_are_causal(variant):
    model = small(variant).eval()
    x, _ = batch(model.cfg, n=2)
    _, maps = model.forward_with_attention(x)
    T = model.cfg.block_size
    assert len(maps) == 4
    for att in maps:
        # The Synthesizer's maps do not depend on the input: batch dimension 1, broadcast.
        assert att.shape[1:] == (4, T, T) and att.shape[0] == (1 if variant in SYNTH else 2)
        assert torch.allclose(att.sum(-1), torch.ones_like(att[..., 0]), atol=1e-5)
        upper = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        assert att[..., upper].abs().max() == 0
        assert (att[..., ~upper] > 0).all()


@pytest.mark.parametrize("variant", SYNTH + ["oelm_poet", "oelm_freeze_deep"])
def test_kv_cached_logits_equal_uncached(variant):
    model = small(variant).eval()
    train_steps(model, steps=2)  # trained weights: POET's R, P no longer the identity
    model.eval()
    x, _ = batch(model.cfg, n=2, seed=5)
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache(batch=2)
        steps = [model(x[:, i : i + 1], cache=cache) for i in range(x.size(1))]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    # A prompt chunk followed by single tokens agrees too.
    with torch.no_grad():
        cache = model.new_cache(batch=2)
        head = model(x[:, :10], cache=cache)
        tail = [model(x[:, i : i + 1], cache=cache) for i in range(10, x.size(1))]
    assert torch.allclose(torch.cat([head] + tail, dim=1), full, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# A1: the Gaussian control has the orthogonal logit scale
# ---------------------------------------------------------------------------------------------


def test_gaussian_control_matches_the_orthogonal_logit_scale():
    d, h = 256, 4
    x = torch.randn(256, d, generator=torch.Generator().manual_seed(0))
    stds = {}
    for variant in ("oelm_freeze_gaussian", "oelm_freeze"):
        model = build_model("mini", variant, n_layer=1, vocab_size=128)
        w = model.blocks[0].attn.qk.weight
        stds[variant] = attention_logit_stats(w[:d], w[d:], x, n_head=h)["std"]
    assert abs(stds["oelm_freeze_gaussian"] / stds["oelm_freeze"] - 1) < 0.2
    # GPT-2's N(0, 0.02) gives ~10x smaller logits at d 256 (0.02^2 * d = 0.1): the A1 control
    # changes the geometry (non-orthogonal) but, unlike gpt_base, not the scale.
    w = build_model("mini", "gpt_base", n_layer=1, vocab_size=128).blocks[0].attn.qk.weight
    assert attention_logit_stats(w[:d], w[d:], x, n_head=h)["std"] < 0.2 * stds["oelm_freeze"]


def test_poet_and_synth_module_types():
    assert isinstance(small("oelm_poet").blocks[0].attn.qk, POETProjection)
    assert isinstance(small("oelm_freeze_svd").blocks[0].attn.qk, QKProjection)


# ---------------------------------------------------------------------------------------------
# The ablations' plan, parameters/ablations.yaml: one run per variant entry (seed 0)
# ---------------------------------------------------------------------------------------------

ABLATIONS = {run.info["label"]: run for run in load_plan(REPO / "parameters" / "ablations.yaml").runs if run.seed == 0}


def test_there_is_an_ablation_per_variant():
    assert set(ALL_VARIANTS) <= set(ABLATIONS) and "progressive" in ABLATIONS


@pytest.mark.parametrize("name", sorted(ABLATIONS))
def test_ablations_load(name):
    cfg = run_config_from_dict(ABLATIONS[name].config)
    assert cfg.model_config().n_layer >= 2
    if name in VARIANTS:
        assert cfg.variant == name


def test_progressive_schedule_unfreezes_frozen_layers():
    cfg = run_config_from_dict(ABLATIONS["progressive"].config)
    mcfg = cfg.model_config()
    schedule = cfg.train.unfreeze_schedule
    assert schedule and all(int(step) < cfg.train.steps for step in schedule)
    unfrozen = set()
    for layers in schedule.values():
        unfrozen |= set(range(mcfg.n_layer)) if layers == "all" else set(layers)
    assert unfrozen == set(mcfg.frozen_layers())
    assert cfg.variant == "oelm_freeze"
