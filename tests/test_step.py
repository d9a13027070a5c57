"""The training step (oelm_core.step): the schedule, the step fast.make_step gives on the CPU,
re-wrapping, the compile fallback, the clip, gradients that hold a sum over ranks. The CUDA-graph
step: test_graph_step.py."""

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch
from conftest import FOLDED_VOCAB

from oelm_core import fast
from oelm_core.config import TrainConfig
from oelm_core.model import build_model
from oelm_core.step import TrainStep, configure_optimizer, lr_at


def test_lr_schedule():
    tc = TrainConfig(steps=100, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, tc) == pytest.approx(0.1) and lr_at(9, tc) == pytest.approx(1.0)
    assert lr_at(55, tc) == pytest.approx(0.55) and lr_at(100, tc) == pytest.approx(0.1)


def test_step_hook_and_make_step():
    """fast.make_step is the loop's step; modules with after_optimizer_step(step) are called after it."""
    model = build_model("smoke", "gpt_base", block_size=16, vocab_size=FOLDED_VOCAB)
    calls = []
    model.blocks[0].mlp.after_optimizer_step = calls.append
    tc = TrainConfig(grad_clip=1.0, lr=1e-3)
    step = fast.make_step(model, configure_optimizer(model, tc, torch.device("cpu")), tc, torch.device("cpu"))
    x = torch.randint(0, FOLDED_VOCAB, (2, 17))
    batches = [(x[:, :-1], x[:, 1:])]
    assert type(step) is TrainStep  # train.cuda_graph is on, but this is the CPU: the plain step
    first, norm = step(batches, 1e-3, 1)
    for n in range(2, 6):
        loss, _ = step(batches, 1e-3, n)
    assert calls == [1, 2, 3, 4, 5] and norm > 0 and loss < first


def test_a_step_after_rewrapping_takes_only_its_own_gradients():
    """After a captured step the parameters' .grad hold the graph's static outputs; the step that
    follows a re-wrap (unfreezing: a new parameter set) runs eagerly and must not add to them.
    Here leftovers are planted by hand (the CPU has no graphs): the weights after the next step
    must equal those of a twin that never had them."""
    tc = TrainConfig(grad_clip=1.0, lr=1e-3)
    x = torch.randint(0, FOLDED_VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    batches = [(x[:, :-1], x[:, 1:])]
    models = [build_model("smoke", "oelm_freeze", block_size=16, vocab_size=FOLDED_VOCAB) for _ in range(2)]
    for planted, model in enumerate(models):
        step = TrainStep(model, configure_optimizer(model, tc, torch.device("cpu")), tc, torch.device("cpu"))
        step(batches, 1e-3, 1)
        if planted:
            for p in model.parameters():
                p.grad = torch.full_like(p, 10.0) if p.requires_grad else None
        step.optimizer.add_param_group({"params": model.unfreeze_qk("all"), "weight_decay": tc.weight_decay})
        step.wrap()
        step(batches, 1e-3, 2)
    for a, b in zip(*(m.state_dict().values() for m in models)):
        assert torch.equal(a, b)


def test_a_failed_compile_falls_back_to_eager_with_only_its_own_gradients(monkeypatch):
    """torch.compile fails lazily, in the first step: the step goes on eagerly. Whatever the failed
    call left in .grad (here: noise written before it raised) must not reach the update: the
    weights equal those of a twin that ran eagerly from the start."""
    tc = TrainConfig(grad_clip=1.0, lr=1e-3)
    x = torch.randint(0, FOLDED_VOCAB, (2, 17), generator=torch.Generator().manual_seed(0))
    batches = [(x[:, :-1], x[:, 1:])]

    def failing_compile(module, **kwargs):
        def call(*args, **kw):
            for p in module.parameters():
                if p.requires_grad:
                    p.grad = torch.randn_like(p)
            raise RuntimeError("inductor said no")

        return call

    models = [build_model("smoke", "gpt_base", block_size=16, vocab_size=FOLDED_VOCAB) for _ in range(2)]
    for fails, model in enumerate(models):
        step_tc = dataclasses.replace(tc, compile=bool(fails))
        if fails:
            monkeypatch.setattr(torch, "compile", failing_compile)
        step = TrainStep(model, configure_optimizer(model, step_tc, torch.device("cpu")), step_tc, torch.device("cpu"))
        step(batches, 1e-3, 1)
        assert not step.compile  # the failed one fell back to eager
    for a, b in zip(*(m.state_dict().values() for m in models)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("grad_clip", [0.05, 0.0])
def test_the_steps_clip_equals_clip_grad_norm(grad_clip):
    """The step divides the gradients by clip_grad_norm_'s factor and takes the fused AdamW step:
    the same norms and weights as clip_grad_norm_ by hand, up to rounding, over 4 steps with the
    clip binding (0.05 is far below this model's norm) and with it off."""
    x = torch.randint(0, FOLDED_VOCAB, (4, 17), generator=torch.Generator().manual_seed(0))
    batches = [(x[:, :-1], x[:, 1:])]
    models = [build_model("smoke", "oelm_nofreeze", block_size=16, vocab_size=FOLDED_VOCAB, seed=3) for _ in range(2)]
    tc = TrainConfig(grad_clip=grad_clip, lr=1e-2)
    opt = configure_optimizer(models[0], tc, torch.device("cpu"))
    assert all(group["fused"] for group in opt.param_groups)
    step = TrainStep(models[0], opt, tc, torch.device("cpu"))
    norms = [float(step(batches, tc.lr, n)[1]) for n in range(1, 5)]
    opt = configure_optimizer(models[1], tc, torch.device("cpu"))
    by_hand = []
    params = [p for group in opt.param_groups for p in group["params"]]  # the step's order
    for _ in range(4):
        opt.zero_grad(set_to_none=True)
        models[1](*batches[0]).backward()
        by_hand.append(float(torch.nn.utils.clip_grad_norm_(params, grad_clip or float("inf"))))
        opt.step()

    assert min(norms) > 10 * 0.05  # the 0.05 clip binds on every step
    assert norms == pytest.approx(by_hand, rel=1e-5)
    for (name, ours), hand in zip(models[0].named_parameters(), models[1].parameters()):
        assert (ours - hand).abs().max() <= 1e-6 * (1 + hand.abs().max()), name
    if grad_clip:  # and the clip did move the weights: unclipped steps end elsewhere
        unclipped = build_model("smoke", "oelm_nofreeze", block_size=16, vocab_size=FOLDED_VOCAB, seed=3)
        tc = TrainConfig(grad_clip=0.0, lr=1e-2)
        step = TrainStep(unclipped, configure_optimizer(unclipped, tc, torch.device("cpu")), tc, torch.device("cpu"))
        for n in range(1, 5):
            step(batches, tc.lr, n)
        assert max((a - b).abs().max() for a, b in zip(unclipped.parameters(), models[0].parameters())) > 1e-3


def test_accumulated_micro_batches_step_as_one_batch_of_them_all():
    """grad_accum k at batch b is a step of batch k*b: the micro-batches' gradients are averaged,
    not summed. The gradients before clipping, the loss and the norm equal the whole batch's, and
    so do the weights after a step whose clip binds (0.05 is far below this model's norm), to
    float rounding."""
    k, b, cpu = 3, 2, torch.device("cpu")
    x = torch.randint(0, FOLDED_VOCAB, (k * b, 17), generator=torch.Generator().manual_seed(0))
    ways = {
        "whole": [(x[:, :-1], x[:, 1:])],
        "accumulated": [(x[i * b : (i + 1) * b, :-1], x[i * b : (i + 1) * b, 1:]) for i in range(k)],
    }
    tc = TrainConfig(grad_clip=0.05, lr=1e-2)
    seen = {}
    for way, batches in ways.items():
        model = build_model("smoke", "oelm_nofreeze", block_size=16, vocab_size=FOLDED_VOCAB, seed=3)
        step = TrainStep(model, configure_optimizer(model, tc, cpu), tc, cpu)
        loss = step.forward_backward(batches)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        step.optimizer.zero_grad(set_to_none=True)
        _, norm = step(batches, tc.lr, 1)
        seen[way] = loss, grads, norm, {n: p.detach().clone() for n, p in model.named_parameters()}
    (loss, grads, norm, weights), (loss_k, grads_k, norm_k, weights_k) = seen["whole"], seen["accumulated"]
    assert norm > 10 * tc.grad_clip  # the clip binds: the step is taken at norm 0.05 either way
    torch.testing.assert_close(loss_k, loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(norm_k, norm, rtol=1e-5, atol=0)
    for name, g in grads.items():
        torch.testing.assert_close(grads_k[name], g, rtol=1e-4, atol=1e-7, msg=name)
    # AdamW's first step moves each element by about lr g / (|g| + eps): where a gradient element
    # is near eps (1e-8) the two orders of summation move it differently, by up to ~5e-4 lr.
    for name, w in weights.items():
        torch.testing.assert_close(weights_k[name], w, rtol=0, atol=1e-3 * tc.lr, msg=name)


@pytest.mark.parametrize("fused", [True, False])
def test_a_gradient_sum_over_two_ranks_steps_as_their_mean(fused):
    """The NVLink exchange leaves g0 + g1 in .grad and grad_divisor = 2; the clip and AdamW step
    then equal those of the mean (g0 + g1) / 2, bit for bit (halving is exact), with the fused
    AdamW and the foreach one."""
    tc = TrainConfig(grad_clip=0.05)
    models, steps = [], []
    for divisor in (1.0, 2.0):
        model = build_model("tiny", "gpt_base", seed=0)
        optimizer = configure_optimizer(model, tc, torch.device("cpu"))
        for group in optimizer.param_groups:
            group["fused"] = fused
        step = TrainStep(model, optimizer, tc, torch.device("cpu"))
        step.exchange = SimpleNamespace(grad_divisor=divisor)
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g) * divisor
        models.append(model)
        steps.append(step)
    norms = [step.clip_and_step() for step in steps]
    assert norms[0] > tc.grad_clip and torch.equal(norms[0], norms[1])
    for a, b in zip(*(m.parameters() for m in models)):
        assert torch.equal(a, b)


# --- the optimiser's weight decay, by parameter name ---------------------------------------------

# What weight decay applies to, by name (the rule of configure_optimizer's docstring, written
# out rather than derived from the tensors' shapes as the optimiser does): the matrices of the
# mapping, embeddings, trainable Q/K and their POET generators, the Synthesizer's logit tables.
DECAYED = (
    r"wte\.weight",
    r"wpe\.weight",
    r"lm_head\.weight",
    r"blocks\.\d+\.attn\.(qk|v|proj)\.weight",
    r"blocks\.\d+\.mlp\.(fc|proj)\.weight",
    r"blocks\.\d+\.attn\.qk\.skew_[qk]_(left|right)",
    r"blocks\.\d+\.attn\.synth_[01]",
)
# Never decayed: biases and LayerNorm gains and shifts.
UNDECAYED = (
    r"blocks\.\d+\.ln_[12]\.(weight|bias)",
    r"ln_f\.(weight|bias)",
    r"blocks\.\d+\.(attn\.(v|proj)|mlp\.(fc|proj))\.bias",
)


@pytest.mark.parametrize(
    "variant, overrides",
    [
        ("gpt_base", {}),
        ("gpt_base", {"tie_embeddings": False, "attn_bias": True}),
        ("oelm_freeze", {}),
        ("oelm_freeze", {"tie_embeddings": False}),
        ("oelm_freeze", {"freeze_qk": [1]}),
        ("oelm_poet", {}),
        ("synth_random", {}),
        ("synth_factorized", {}),
    ],
)
def test_weight_decay_groups_by_parameter_name(variant, overrides):
    model = build_model("tiny", variant, **overrides)
    names = {id(p): n for n, p in model.named_parameters()}
    opt = configure_optimizer(model, TrainConfig(weight_decay=0.1), torch.device("cpu"))
    decayed = [names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.1 for p in g["params"]]
    undecayed = [names[id(p)] for g in opt.param_groups if g["weight_decay"] == 0.0 for p in g["params"]]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert sorted(decayed + undecayed) == sorted(names.values())  # each parameter once, tied ones too
    assert sorted(decayed) == sorted(n for n in names.values() if any(re.fullmatch(r, n) for r in DECAYED))
    assert sorted(undecayed) == sorted(n for n in names.values() if any(re.fullmatch(r, n) for r in UNDECAYED))
    # Frozen tensors are buffers, out of the optimiser: Q/K of frozen layers, POET's W0.
    frozen = {f"blocks.{i}.attn.qk.weight" for i in model.cfg.frozen_layers()}
    assert frozen <= {n for n, _ in model.named_buffers()} and not frozen & set(decayed + undecayed)
    expected_untied = {"lm_head.weight"} if overrides.get("tie_embeddings") is False else set()
    assert {"wte.weight", "wpe.weight"} | expected_untied <= set(decayed)
    assert "ln_f.bias" in undecayed and ("blocks.0.attn.v.bias" in undecayed) == bool(overrides.get("attn_bias"))


@pytest.mark.parametrize("variant", ["gpt_base", "oelm_poet", "synth_factorized"])
def test_a_step_decays_the_matrices_and_leaves_biases_and_layernorms_alone(variant):
    """One optimiser step with zero gradients moves a tensor by its weight decay alone: decayed
    ones become exactly (1 - lr wd) times themselves, biases and LayerNorm parameters (set away
    from their 0 and 1 first, where a decay could not move them) stay bit for bit."""
    model = build_model("tiny", variant, tie_embeddings=False)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(0.5, 1.5)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tc = TrainConfig(lr=0.05, weight_decay=0.2)
    opt = configure_optimizer(model, tc, torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    shrink = 1 - tc.lr * tc.weight_decay  # 0.99
    moved, kept = [], []
    for n, p in model.named_parameters():
        if torch.equal(p, before[n]):
            kept.append(n)
        else:
            torch.testing.assert_close(p.detach(), before[n] * shrink, rtol=1e-6, atol=0, msg=n)
            moved.append(n)
    assert sorted(kept) == sorted(n for n in before if any(re.fullmatch(r, n) for r in UNDECAYED))
    assert sorted(moved) == sorted(n for n in before if any(re.fullmatch(r, n) for r in DECAYED))
    assert "ln_f.weight" in kept and "blocks.0.mlp.fc.bias" in kept and "lm_head.weight" in moved
