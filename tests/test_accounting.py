"""Memory account and card peaks (the parameter and FLOP counts are tested with the model)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oelm_core import VARIANTS, ConfigError, build_model, count_parameters, memory_account
from oelm_core.accounting import peak_flops


@pytest.mark.parametrize("variant", ["gpt_base", "oelm_freeze"])
def test_memory_account_is_the_bytes_the_tensors_take(variant):
    """The vocabulary padding is stored and trained: 28 padded rows of 32 here, with AdamW state."""
    model = build_model("tiny", variant, vocab_size=100)  # padded to 128 rows
    stored = sum(
        t.numel() for t in {id(t): t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()}.values()
    )
    trained = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    mem = memory_account(model)
    assert mem["weights"] == 4 * stored and mem["grads"] == 4 * trained and mem["adam_state"] == 8 * trained
    counts = count_parameters(model)
    assert 4 * counts["total"] == mem["weights"] - 4 * 28 * 32  # parameters exclude the padding
    assert mem["frozen_saving"] == 12 * counts["frozen"]
    assert (mem["frozen_saving"] > 0) == (variant == "oelm_freeze")


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),
        ("Some Future GPU", None),
    ],
)
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


# ---- the memory of a training step ------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_state_bytes_from_the_shape_are_the_built_models(variant):
    """Costed without building (a Synthesizer at a long context would not fit to be measured)."""
    from oelm_core import model_config
    from oelm_core.accounting import state_bytes

    for shape in (dict(), dict(tie_embeddings=False, attn_bias=True, bias=False, vocab_size=300)):
        cfg = model_config("smoke", variant, block_size=48, **shape)
        built = memory_account(build_model(cfg))
        assert state_bytes(cfg) == {k: built[k] for k in ("weights", "grads", "adam_state", "total")}


def saved_for_backward(model, batch: int) -> int:
    """Bytes of the tensors autograd keeps for one training forward of ``batch`` sequences, as
    its saved-tensor hooks see them: every storage once, the weights (already counted) left out."""
    weights = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    idx = torch.randint(
        0, model.cfg.vocab_size, (batch, model.cfg.block_size), generator=torch.Generator().manual_seed(0)
    )
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(idx, idx)
    return sum(seen.values())


# (batch, context, model settings, the fused loss or the reference's)
SHAPES = [
    (8, 128, {}, True),
    (4, 256, {}, False),
    (3, 32, {"dropout": 0.1}, True),
    (2, 64, {"tie_embeddings": False, "attn_bias": True}, True),
    (4, 512, {}, True),
]


def smoke_model(variant: str, block: int, fused_loss: bool = True, **shape):
    """The smoke preset at a 256-token vocabulary (the activations, not the output layer's
    gradient, dominate), in training mode, with the trainer's fused loss or the reference's."""
    model = build_model("smoke", variant, block_size=block, vocab_size=256, **shape).train()
    if fused_loss:
        from oelm_core.fast import loss

        loss.install(model)
    return model


@pytest.mark.parametrize(
    "variant, batch, block, shape, fused_loss",
    [(v, *SHAPES[0]) for v in VARIANTS]
    + [
        (v, *shape)
        for v in ("gpt_base", "oelm_freeze", "synth_random", "synth_random_fixed", "oelm_poet")
        for shape in SHAPES[1:]
    ],
)
def test_the_activation_estimate_is_what_autograd_saves(variant, batch, block, shape, fused_loss, one_thread):
    """activation_bytes' 'saved' against the tensors the model's backward really keeps."""
    from oelm_core.accounting import activation_bytes

    model = smoke_model(variant, block, fused_loss, **shape)
    measured = saved_for_backward(model, batch)
    estimate = activation_bytes(model.cfg, batch, fused_loss=fused_loss)["saved"]
    assert estimate == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("variant", ["gpt_base", "synth_random"])
def test_the_estimate_grows_with_context_and_batch_as_the_saved_tensors_do(variant, one_thread):
    """Twice the batch, twice the tokens; twice the context, twice the tokens and for the
    Synthesizer each token's T x T row twice as long: the estimate's growth is the measured one."""
    from oelm_core.accounting import activation_bytes

    def both(batch, block):
        model = smoke_model(variant, block)
        return activation_bytes(model.cfg, batch)["saved"], saved_for_backward(model, batch)

    (e0, m0), (e_batch, m_batch), (e_block, m_block) = both(4, 256), both(8, 256), both(4, 512)
    assert e_batch / e0 == pytest.approx(m_batch / m0, rel=0.03)
    assert e_block / e0 == pytest.approx(m_block / m0, rel=0.03)
    assert m_block / m0 > (3.0 if variant == "synth_random" else 1.9)


def test_bf16_activations_take_about_half():
    from oelm_core import model_config
    from oelm_core.accounting import activation_bytes

    cfg = model_config("medium512", "gpt_base")
    bf16, f32 = (activation_bytes(cfg, 64, dtype, "cuda")["saved"] for dtype in ("bf16", "float32"))
    assert 0.5 < bf16 / f32 < 0.7  # the residual stream and LayerNorm inputs stay float32


STEP_PEAK = """
import json, sys
import torch
from oelm_core import build_model
from oelm_core.config import TrainConfig
from oelm_core import fast
from oelm_core.step import configure_optimizer
torch.set_num_threads(1)
fast.prepare_process(TrainConfig(), torch.device("cpu"))  # the CPU heap, as the trainer keeps it

def status(key):  # bytes; VmHWM is this process's own peak (ru_maxrss keeps its parent's across exec)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

variant, batch, block, vocab, chunk = json.loads(sys.argv[1])
tc = TrainConfig(batch_size=batch, device="cpu", loss_chunk_tokens=chunk)
model = fast.apply(build_model("smoke", variant, block_size=block, vocab_size=vocab), tc)
step = fast.make_step(model, configure_optimizer(model, tc, torch.device("cpu")), tc, torch.device("cpu"))
x, y = (torch.randint(0, vocab, (batch, block)) for _ in range(2))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak starts again from the memory there is now
before = status("VmRSS")
step([(x, y)], 1e-3, 0)
print(json.dumps({"added": status("VmHWM") - before}))
"""


@pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="reads the resident set's peak from /proc (Linux 4.0 or later)"
)
@pytest.mark.parametrize(
    "variant, batch, block, vocab, chunk, lowest",
    [
        ("gpt_base", 32, 512, 256, 8192, 0.75),  # the activations dominate: 0.85-0.95 seen
        # The loss's 51 MB slices of GPT-2 logits dominate: the heap the trainer keeps on the CPU
        # holds back a number of freed slices that varies from run to run (the estimate counts
        # one): 0.5-1.05 seen.
        ("oelm_freeze", 4, 256, 50257, 256, 0.4),
    ],
)
def test_the_step_estimate_is_near_a_measured_steps_peak(variant, batch, block, vocab, chunk, lowest):
    """One real training step (the trainer's fast.make_step: forward, backward, fused AdamW) in a fresh
    process (the trainer's heap keeps freed blocks resident: a second step there would reuse
    them): what its peak resident memory added to the memory before it (weights built) against
    step_memory less the weights."""
    from oelm_core import model_config
    from oelm_core.accounting import step_memory

    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", STEP_PEAK, json.dumps([variant, batch, block, vocab, chunk])],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(repo)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    added = json.loads(out.stdout.splitlines()[-1])["added"]
    cfg = model_config("smoke", variant, block_size=block, vocab_size=vocab)
    need = step_memory(cfg, batch, loss_chunk_tokens=chunk)
    estimate = need["total"] - memory_account(build_model(cfg))["weights"]
    assert need["activations"] > 100 * 2**20 and lowest < estimate / added < 1.3, (estimate, added)


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
