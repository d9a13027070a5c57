"""Memory account and card peaks (the parameter and FLOP counts are tested with the model)."""

import pytest
import torch

from oelm_core import ConfigError, build_model, count_parameters, memory_account
from oelm_core.accounting import peak_flops


@pytest.mark.parametrize("variant", ["gpt_base", "oelm_freeze"])
def test_memory_account_is_the_bytes_the_tensors_take(variant):
    """The vocabulary padding is stored and trained: 28 padded rows of 32 here, with AdamW state."""
    model = build_model("tiny", variant, vocab_size=100)  # padded to 128 rows
    stored = sum(t.numel() for t in {id(t): t for t in [*model.parameters(), *model.buffers()]
                                     if t.is_floating_point()}.values())
    trained = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    mem = memory_account(model)
    assert mem["weights"] == 4 * stored and mem["grads"] == 4 * trained and mem["adam_state"] == 8 * trained
    counts = count_parameters(model)
    assert 4 * counts["total"] == mem["weights"] - 4 * 28 * 32  # parameters exclude the padding
    assert mem["frozen_saving"] == 12 * counts["frozen"]
    assert (mem["frozen_saving"] > 0) == (variant == "oelm_freeze")


@pytest.mark.parametrize("name, peak", [("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12),
                                        ("NVIDIA H100 NVL", 835e12), ("NVIDIA H200", 989e12),
                                        ("Some Future GPU", None)])
def test_peak_flops_takes_the_longest_matching_card_name(monkeypatch, name, peak):
    monkeypatch.delenv("OELM_PEAK_FLOPS", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert peak_flops("cuda:0") == peak
    assert peak_flops("cpu") is None


def test_flops_per_token_medium512_exact():
    from oelm_core import flops_per_token, model_config
    b = flops_per_token(model_config("medium512", "gpt_base"))
    assert b["attn_scores"] == {"forward": 6_291_456, "backward": 12_582_912}
    assert b["mlp"] == {"forward": 25_165_824, "backward": 50_331_648}
    assert b["total"] == 286_510_080
    f = flops_per_token(model_config("medium512", "oelm_freeze"))
    assert f["frozen_saving"]["flops"] == 6_291_456
    assert f["frozen_saving"]["fraction"] == pytest.approx(6_291_456 / 286_510_080)


def test_a_peak_given_in_the_environment_is_every_devices(monkeypatch):
    """OELM_PEAK_FLOPS: a card the table lacks, or the CPU (where the MFU tests give one)."""
    monkeypatch.setenv("OELM_PEAK_FLOPS", "2.5e12")
    assert peak_flops("cpu") == peak_flops() == 2.5e12
    monkeypatch.setenv("OELM_PEAK_FLOPS", "")
    assert peak_flops("cpu") is None
    for bad in ("fast", "0", "-1e12", "nan", "inf"):
        monkeypatch.setenv("OELM_PEAK_FLOPS", bad)
        with pytest.raises(ConfigError, match=rf"OELM_PEAK_FLOPS='{bad}' is not a peak: .*positive number"):
            peak_flops("cpu")
