"""The CUDA-graph step (oelm_core.fast.graph_step) against the plain step: on a GPU only."""

import pytest
import torch

from oelm_core import fast
from oelm_core.config import TrainConfig
from oelm_core.fast.graph_step import GraphStep
from oelm_core.model import build_model
from oelm_core.step import TrainStep, configure_optimizer
from train_helpers import losses, params, run

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_data_override"),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")]


def test_make_step_captures_where_the_switch_says():
    """train.cuda_graph on a GPU: the CUDA-graph step, which replays after two eager steps the
    same losses as the plain step gives (float32); off: the plain step."""
    cuda = torch.device("cuda")
    x = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0)).to(cuda)
    batches = [(x[:, :-1], x[:, 1:])]
    curves = {}
    for graph in (True, False):
        model = build_model("smoke", "oelm_nofreeze", block_size=32, vocab_size=256).to(cuda)
        tc = TrainConfig(cuda_graph=graph, dtype="float32", lr=1e-3)
        step = fast.make_step(model, configure_optimizer(model, tc, cuda), tc, cuda)
        assert type(step) is (GraphStep if graph else TrainStep)
        curves[graph] = [float(step(batches, tc.lr, n)[0]) for n in range(1, 7)]
        if graph:
            assert step.graph is not None  # captured at the third step, replayed since
    assert curves[True] == pytest.approx(curves[False], rel=1e-4)
    tc = TrainConfig(cuda_graph=True)
    model = build_model("smoke", "gpt_base", block_size=32, vocab_size=256)
    assert type(fast.make_step(model, configure_optimizer(model, tc, torch.device("cpu")), tc,
                          torch.device("cpu"))) is TrainStep  # the CPU: no graphs


def test_unfreezing_under_a_captured_step_matches_eager_steps(tmp_path, folded, caplog):
    """One GPU, float32: the captured step (two warm-up steps, captured at step 3, re-captured
    after the unfreeze at step 5) against eager steps. The first eager step after an unfreeze once
    added the last replay's gradients to its own (1.2e-3 apart at step 7)."""
    common = dict(steps=9, eval_every=10, ckpt_every=10, device="cuda", dtype="float32",
                  unfreeze_schedule={5: "all"})
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

