"""oelm_core.analysis.accounts: the 02 notebook's exact parameter counts, FLOPs, gradient flow."""

import pytest

from oelm_core import analysis as A
from oelm_core import build_model, config, count_parameters
from oelm_core.config import model_config

# Medium-512's exact (trainable, frozen) parameters per group.
MEDIUM = {"gpt_base": (44_896_768, 0), "oelm_nofreeze": (44_896_768, 0), "oelm_freeze": (41_751_040, 3_145_728)}


def test_parameter_table_medium512_exact():
    rows = {r["variant"]: r for r in A.parameter_table("medium512", A.GROUP_LABELS)}
    for v, (trainable, frozen) in MEDIUM.items():
        assert (rows[v]["trainable"], rows[v]["frozen"]) == (trainable, frozen)
    assert rows["oelm_freeze"]["trainable_reduction"] == pytest.approx(0.0700, abs=5e-4)


def test_parameter_and_flops_tables_take_list_overrides():
    """freeze_qk=[0] (a list of layers) is a valid override, but was unhashable for the cache."""
    rows = A.parameter_table("tiny", ["gpt_base", "oelm_freeze"], freeze_qk=[0])
    d = model_config("tiny").d_model
    assert [r["frozen"] for r in rows] == [2 * d * d, 2 * d * d]  # one layer's Q/K, whatever the variant
    flops = A.flops_table("tiny", ["oelm_freeze"], freeze_qk=[0])
    assert flops[0]["frozen_saving_flops"] > 0 and flops[0]["state_saving_mb"] > 0
    assert A.parameter_table("tiny", ["oelm_freeze"])[0]["frozen"] == 2 * 2 * d * d  # both layers


def test_the_parameter_table_follows_a_variant_registered_again(monkeypatch):
    """The models the tables count were cached by preset, variant and call overrides alone: a
    variant registered again kept the counts of its first registration."""
    monkeypatch.setattr(config, "_VARIANT_SPECS", dict(config._VARIANT_SPECS))  # undone after the test
    d = model_config("tiny").d_model
    config.register_variant("late", "Late: Q/K frozen in every layer", qk_init="qr", freeze_qk="all")
    assert A.parameter_table("tiny", ["late"])[0]["frozen"] == 2 * 2 * d * d  # both layers' Q/K
    config.register_variant("late", "Late: Q/K frozen in the first layer", qk_init="qr", freeze_qk=[0])
    assert A.parameter_table("tiny", ["late"])[0]["frozen"] == 2 * d * d


@pytest.mark.parametrize(
    "overrides", [{}, {"tie_embeddings": False}, {"bias": False, "attn_bias": True, "tie_embeddings": False}]
)
@pytest.mark.parametrize("variant", ["gpt_base", "oelm_freeze"])
def test_analytic_parameters_equal_count_parameters(variant, overrides):
    """At a vocabulary that pads (100 ids, 128 rows): the padding rows of the embedding and of an
    untied output layer are stored but are no parameters, in either count."""
    cfg = model_config("tiny", variant, vocab_size=100, **overrides)
    model = build_model(cfg)
    assert cfg.padded_vocab_size == 128 and model.output_weight.shape == (128, 32)
    counted = count_parameters(model)
    assert A.analytic_parameters(cfg) == {k: counted[k] for k in ("trainable", "frozen", "total")}
    stored = sum(p.numel() for p in model.parameters()) + sum(b.numel() for b in model.buffers())
    outputs = 1 if cfg.tie_embeddings else 2  # tables of 128 rows: the embedding, and lm_head
    assert counted["total"] == stored - outputs * 28 * 32
    assert counted["by_component"]["embedding"]["trainable"] == 100 * 32
    assert counted["by_component"].get("output", {"trainable": 0})["trainable"] == (outputs - 1) * 100 * 32
    rows = A.shape_account()  # Medium-512
    assert [r["total"] for r in rows] == [44_896_768] * 3
    assert rows[2]["trainable"] == 41_751_040 and rows[2]["trainable_reduction_pct"] == pytest.approx(7.0, abs=0.01)


@pytest.mark.parametrize(
    "variant, message",
    [
        ("oelm_poet", r"POET \(poet_block_size=32\) learns Q/K through R and P"),
        ("synth_random", "attention 'synth_random' has no Q/K"),
    ],
)
def test_analytic_parameters_refuse_what_they_do_not_count(variant, message):
    """POET trains R, P and freezes W0; the Synthesizer has logit tables instead of Q/K: the
    plain-Q/K formula gave wrong counts for both, without a word."""
    cfg = model_config("tiny", variant)
    with pytest.raises(ValueError, match=message + r".*count_parameters\(build_model\(cfg\)\)"):
        A.analytic_parameters(cfg)


def test_gradient_flow_check_frozen_qk_get_no_gradient():
    flow = A.gradient_flow_check("tiny", "oelm_freeze")
    assert len(flow["frozen_qk"]) == 2 and flow["frozen_without_grad"] and flow["qk_unchanged_by_step"]
    assert flow["trainable_with_grad"] and flow["trainable_qk_in_frozen_layers"] == []
    assert A.gradient_flow_check("tiny", "gpt_base")["frozen_qk"] == []


def test_gradient_flow_check_catches_trainable_qk_in_a_frozen_layer(monkeypatch):
    """A model whose layer-1 Q/K the config freezes but which trains them anyway must fail the
    check (the old checks looked only at the buffers, so they held by construction)."""
    import oelm_core

    def broken(*args, **kwargs):
        model = build_model(*args, **kwargs)
        model.unfreeze_qk([1])
        return model

    monkeypatch.setattr(oelm_core, "build_model", broken)
    flow = A.gradient_flow_check("tiny", "oelm_freeze")
    assert not flow["frozen_without_grad"] and not flow["qk_unchanged_by_step"]
    assert flow["frozen_qk"] == ["blocks.0.attn.qk.weight"]
    assert flow["trainable_qk_in_frozen_layers"] == ["blocks.1.attn.qk.weight"]
    assert flow["trainable_with_grad"]  # the trainable copy does get its gradient
