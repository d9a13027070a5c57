"""benchmarks/bench_train.py on the CPU at the smoke preset: the trainer's step with fast paths
switched off one at a time and the nanoGPT reference, the figures it writes and the table it prints.
(The numbers that matter come from a GPU; this checks that the script runs what it says.)"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks" / "bench_train.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(BENCH), *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_bench_train_times_the_trainers_step_with_each_fast_path_off(tmp_path):
    out = tmp_path / "train.json"
    proc = _run(
        "--preset",
        "smoke",
        "--batch",
        "2",
        "--steps",
        "2",
        "--blocks",
        "2",
        "--warmup",
        "0",
        "--groups",
        "reference",
        "gpt_base",
        "--off",
        "fused_loss",
        "fused_logits",
        "--check",
        "--json",
        str(out),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = json.loads(out.read_text())
    rows = {r["label"]: r for r in written["results"]}
    assert list(rows) == ["reference", "gpt_base", "gpt_base:fused_loss=0", "gpt_base:fused_logits=0"]
    assert all("error" not in r and r["ms_per_step"] > 0 and r["batch"] == 2 for r in rows.values())
    # What ran: the fused loss unless switched off; on the CPU never the logits GEMM nor a CUDA graph.
    assert [r["applied"]["fused_loss"] for r in rows.values()] == [False, True, False, True]
    assert not any(r["applied"]["fused_logits"] or r["applied"]["cuda_graph"] for r in rows.values())
    assert [r["train"]["fused_loss"] for r in rows.values()][1:] == [True, False, True]
    assert rows["gpt_base:fused_logits=0"]["train"]["fused_logits"] is False
    # The same weights and batches through the same steps: the fused loss trains as the reference
    # loss does (float32), to rounding.
    losses = [rows[k]["loss"] for k in ("gpt_base", "gpt_base:fused_loss=0", "gpt_base:fused_logits=0")]
    assert all(math.isfinite(x) for x in losses) and max(losses) - min(losses) < 1e-4, losses
    for name, check in written["checks"]["float32"].items():
        assert check["loss_abs_diff"] < 1e-5 and check["max_grad_rel_diff"] < 1e-5, (name, check)
    table = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(table) if line.startswith("variant"))
    assert [line.split()[0] for line in table[header + 1 :]] == list(rows)  # the table comes last
    # gpt_base against itself, all fast paths on; then the compile time and the card's clock (none on a CPU)
    assert table[header + 2].split()[-3:-1] == ["1.000", f"{rows['gpt_base']['compile_s']:.0f}"]
    assert table[header + 2].split()[-1] == "-" and rows["gpt_base"]["card_clocks"] is None


def test_bench_train_expands_the_variants_and_refuses_an_option_saying_which():
    sys.path.insert(0, str(BENCH.parent))
    import bench_train

    variants = bench_train.expand(
        ["reference", "oelm_freeze:cuda_graph=0", "gpt_base:compile=max-autotune,chunk=4096"],
        ["0", "1"],
        ["fused_logits", "cuda_graph"],
    )
    assert [v["label"] for v in variants] == [
        "reference:compile=0",
        "reference:compile=1",
        "oelm_freeze:cuda_graph=0,compile=0",
        "oelm_freeze:cuda_graph=0,compile=0,fused_logits=0",
        "oelm_freeze:cuda_graph=0,compile=1",
        "oelm_freeze:cuda_graph=0,compile=1,fused_logits=0",
        "gpt_base:compile=max-autotune,chunk=4096",
        "gpt_base:compile=max-autotune,chunk=4096,fused_logits=0",
        "gpt_base:compile=max-autotune,chunk=4096,cuda_graph=0",
    ]
    tc = bench_train.train_config(variants[-1])
    assert (tc.compile, tc.loss_chunk_tokens, tc.cuda_graph, tc.fused_loss, tc.fused_logits) == (
        True,
        4096,
        False,
        True,
        True,
    )
    reference = bench_train.train_config(variants[0])
    assert (reference.compile, reference.cuda_graph) == (False, False)
    for specs, compiles, message in (
        (["gpt_base:gemm=torch"], ["0"], r"unknown option 'gemm'; a variant's options are fused_loss, fused_logits"),
        (["reference:fused_logits=0"], ["0"], "the reference takes only compile, cuda_graph, pad"),
        (["gpt_base:chunk=0"], ["0"], "chunk=0 must be a positive integer"),
        (["gpt_base"], ["fastest"], "compile=fastest is not 0, 1 or a torch.compile mode"),
    ):
        with pytest.raises(ValueError, match=message):
            bench_train.expand(specs, compiles, [])


def test_a_profiled_step_is_told_as_kernel_families_and_the_idle_rest():
    """The profile table's rows: each kernel family's milliseconds and what the timed step spent
    outside kernels (its idle share), which sum to the step; kernels overlapping on several streams
    (their sum above the step) leave no negative idle."""
    sys.path.insert(0, str(BENCH.parent))
    from bench_train import step_shares

    row = {"ms_per_step": 10.0, "kernel_ms_per_step": {"GEMM": 6.0, "attention": 1.5, "total": 7.5}}
    shares = step_shares(row)
    assert shares == {"GEMM": 6.0, "attention": 1.5, "idle (step less kernels)": 2.5}
    assert sum(shares.values()) == pytest.approx(row["ms_per_step"])
    overlapped = {"ms_per_step": 7.0, "kernel_ms_per_step": {"GEMM": 6.0, "attention": 1.5, "total": 7.5}}
    assert step_shares(overlapped)["idle (step less kernels)"] == 0.0


def test_applied_says_whether_the_timed_step_replays_a_graph():
    """The JSON's applied.cuda_graph is what ran: a plain step never replays a graph (on the CPU
    the trainer's step is the plain one whatever train.cuda_graph says)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_train

    from oelm_core import build_model, fast
    from oelm_core.config import TrainConfig
    from oelm_core.step import configure_optimizer

    cpu, tc = torch.device("cpu"), TrainConfig(cuda_graph=True)
    model = build_model("smoke", "gpt_base", block_size=16, vocab_size=64)
    step = fast.make_step(model, configure_optimizer(model, tc, cpu), tc, cpu)
    assert bench_train.replays_a_graph(step) is False


@pytest.mark.gpu
def test_applied_sees_the_captured_graph_on_a_gpu():
    """On a GPU the trainer's step captures itself after its warm-up steps: applied.cuda_graph
    turns true (it read an attribute the step does not have, and said false for every row)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_train

    from oelm_core import build_model, fast
    from oelm_core.config import TrainConfig
    from oelm_core.step import configure_optimizer

    cuda, tc = torch.device("cuda"), TrainConfig(cuda_graph=True, compile=False)
    model = fast.apply(build_model("smoke", "gpt_base", block_size=16, vocab_size=64).to(cuda), tc)
    step = fast.make_step(model, configure_optimizer(model, tc, cuda), tc, cuda)
    x = torch.randint(0, 64, (2, 17), device=cuda)
    for n in range(1, 5):
        assert bench_train.replays_a_graph(step) is (n > 3)
        step([(x[:, :-1], x[:, 1:])], tc.lr, n)
