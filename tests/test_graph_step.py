"""The CUDA-graph step (oelm_core.fast.graph_step) against the plain step: on a GPU, and on the
CPU what its replays are fed."""

import dataclasses

import pytest
import torch
from train_helpers import losses, params, run

from oelm_core import fast
from oelm_core.config import TrainConfig
from oelm_core.fast.graph_step import GraphStep, capturable, feed
from oelm_core.model import build_model
from oelm_core.step import TrainStep, configure_optimizer, lr_at

pytestmark = pytest.mark.usefixtures("no_data_override")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.fixture
def full_float32_matmuls():
    """float32 matmuls without TF32 (which a CUDA training earlier in the session switched on)."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


@pytest.mark.gpu
@needs_cuda
def test_make_step_captures_where_the_switch_says():
    """train.cuda_graph on a GPU: the CUDA-graph step, which replays after two eager steps the
    same losses as the plain step gives (float32); off: the plain step."""
    cuda = torch.device("cuda")
    x = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0)).to(cuda)
    batches = [(x[:, :-1], x[:, 1:])]
    curves = {}
    for graph in (True, False):
        model = build_model("smoke", "oelm_nofreeze", block_size=32, vocab_size=256).to(cuda)
        tc = TrainConfig(cuda_graph=graph, dtype="float32", lr=1e-3, compile=False)
        step = fast.make_step(model, configure_optimizer(model, tc, cuda), tc, cuda)
        assert type(step) is (GraphStep if graph else TrainStep)
        curves[graph] = [float(step(batches, tc.lr, n)[0]) for n in range(1, 7)]
        if graph:
            assert step.graph is not None  # captured at the third step, replayed since
    assert curves[True] == pytest.approx(curves[False], rel=1e-4)
    tc = TrainConfig(cuda_graph=True)
    model = build_model("smoke", "gpt_base", block_size=32, vocab_size=256)
    assert (
        type(fast.make_step(model, configure_optimizer(model, tc, torch.device("cpu")), tc, torch.device("cpu")))
        is TrainStep
    )  # the CPU: no graphs


def applied_lr(optimizer: torch.optim.Optimizer, before: list[torch.Tensor], tc: TrainConfig) -> float:
    """The learning rate an AdamW step applied, read back from what it did to the tensors of the
    group without weight decay (biases and LayerNorm parameters; ``before``: their values before
    the step): it moved each by lr m^ / (sqrt(v^) + eps), m^ and v^ the bias-corrected moments it
    left in its state. The median over the elements whose m^ / (sqrt(v^) + eps) is not small,
    in float64."""
    ratios = []
    for p, p0 in zip(optimizer.param_groups[1]["params"], before, strict=True):
        state = optimizer.state[p]
        t = float(state["step"])
        m = state["exp_avg"].double() / (1 - tc.beta1**t)
        v = state["exp_avg_sq"].double() / (1 - tc.beta2**t)
        u = m / (v.sqrt() + tc.eps)
        keep = u.abs() > 0.1
        ratios.append((p0.double() - p.detach().double())[keep] / u[keep])
    ratios = torch.cat(ratios)
    assert ratios.numel() >= 100
    return float(ratios.median())


@pytest.mark.gpu
@needs_cuda
def test_the_captured_step_follows_the_learning_rate_schedule(full_float32_matmuls):
    """Through the warm-up, where the learning rate changes at every step: the rate the optimizer
    applied (read back from its update and moments) is lr_at's at each step, in the two eager
    steps before the capture and in every replay after it, and the weights stay the eager step's
    (float32). A rate set in the param groups as a Python float, not filled into the tensors the
    graph was captured with, leaves every replay at the rate of the capture (step 3's)."""
    cuda = torch.device("cuda")
    tc = TrainConfig(dtype="float32", lr=1e-2, min_lr=1e-3, warmup_steps=8, steps=20, grad_clip=1.0)
    data = torch.randint(0, 256, (10, 4, 33), generator=torch.Generator().manual_seed(0)).to(cuda)
    models, steps = {}, {}
    for graph in (True, False):
        step_tc = dataclasses.replace(tc, cuda_graph=graph)
        models[graph] = build_model("smoke", "oelm_nofreeze", block_size=32, vocab_size=256).to(cuda)
        steps[graph] = fast.make_step(models[graph], configure_optimizer(models[graph], step_tc, cuda), step_tc, cuda)
    assert type(steps[True]) is GraphStep
    # Every rate after the capture's differs from it by 10% or more: a frozen one cannot pass.
    assert all(abs(lr_at(n, tc) / lr_at(2, tc) - 1) > 0.1 for n in range(3, 10))
    applied = []
    for n, x in enumerate(data, start=1):
        before = [p.detach().clone() for p in steps[True].optimizer.param_groups[1]["params"]]
        for graph in (True, False):
            steps[graph]([(x[:, :-1], x[:, 1:])], lr_at(n - 1, tc), n)
        torch.cuda.synchronize()
        applied.append(applied_lr(steps[True].optimizer, before, tc))
        if n == 3:
            assert steps[True].graph is not None  # captured here; replayed from now on
    assert applied == pytest.approx([lr_at(n, tc) for n in range(10)], rel=1e-3)
    for (name, a), b in zip(models[True].named_parameters(), models[False].parameters()):
        # AdamW moves each element by about lr g / (|g| + eps), so where two kernels round a
        # gradient differently an element may move apart by a fraction of lr; a rate frozen at the
        # capture's moves them apart by a third of lr or more from step 4 on.
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-2 * tc.lr, msg=name)


def test_a_replay_is_fed_its_batches_and_learning_rate_in_the_captured_tensors():
    """What a replay reads, on the CPU: ``capturable`` gives each param group the 0-dim lr tensor
    a capture records, and ``feed`` writes each step's batches and learning rate into those very
    tensors (a new object in their stead would leave the graph reading the old one: the rate of
    the capture, for good). AdamW then steps at the fed rate, as a twin given it as a number."""
    cpu, tc = torch.device("cpu"), TrainConfig(lr=0.1)
    models = [build_model("tiny", "oelm_nofreeze", seed=0) for _ in range(2)]
    optimizers = [configure_optimizer(m, tc, cpu) for m in models]
    capturable(optimizers[0], 0.5, cpu)
    captured = [group["lr"] for group in optimizers[0].param_groups]
    inputs = [(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long)) for _ in range(2)]
    static = [t for pair in inputs for t in pair]
    batches = [
        tuple(torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(i)) for _ in "xy") for i in range(2)
    ]
    for lr in (0.025, 0.0375):
        feed(inputs, optimizers[0], batches, lr)
        assert all(group["lr"] is tensor for group, tensor in zip(optimizers[0].param_groups, captured))
        assert [t.item() for t in captured] == [torch.tensor(lr).item()] * len(captured)  # float32
        assert [t for pair in inputs for t in pair] == static  # the same objects, now holding the batch
        assert all(torch.equal(s, b) for s, b in zip(static, (t for pair in batches for t in pair)))
        for model, optimizer, rate in zip(models, optimizers, (None, lr)):
            if rate is not None:
                for group in optimizer.param_groups:
                    group["lr"] = rate
            for p in model.parameters():
                p.grad = torch.ones_like(p) * 1e-2
            optimizer.step()
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)
    assert models[0].wte.weight.sub(build_model("tiny", "oelm_nofreeze", seed=0).wte.weight).abs().max() > 1e-3


@pytest.mark.gpu
@needs_cuda
def test_unfreezing_under_a_captured_step_matches_eager_steps(tmp_path, folded, caplog):
    """One GPU, float32: the captured step (two warm-up steps, captured at step 3, re-captured
    after the unfreeze at step 5) against eager steps. The first eager step after an unfreeze once
    added the last replay's gradients to its own (1.2e-3 apart at step 7)."""
    common = dict(steps=9, eval_every=10, ckpt_every=10, device="cuda", dtype="float32", unfreeze_schedule={5: "all"})
    graph = params(tmp_path, folded, out="graph", cuda_graph=True, **common)
    eager = params(tmp_path, folded, out="eager", cuda_graph=False, **common)
    with caplog.at_level("INFO", logger="oelm_core"):
        run(graph)
    assert caplog.text.count("captured the training step as a CUDA graph") == 2, caplog.text
    run(eager)
    a, b = losses(graph["out_dir"]), losses(eager["out_dir"])
    assert a.keys() == b.keys() == set(range(1, 10))
    for step in a:
        assert abs(a[step] - b[step]) < 1e-4, (step, a[step], b[step])
