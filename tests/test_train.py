"""The training engine on CPU: learning, freezing, DDP equivalence, exact resume, progressive
unfreezing, clear errors and divergence handling.

Corpora come from the `story_folder` fixture. Except where the real GPT-2 vocabulary matters, the
prepared tokens are folded into a 256-token vocabulary (id % 256, same files, meta.json saying
so) so that the CPU time goes to the trainer rather than to a 50,257-way output layer.
"""

import ctypes
import dataclasses
import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import yaml

from conftest import STORIES
from oelm_core.accounting import count_parameters, flops_per_token
from oelm_core.checkpoint import load_checkpoint, model_from_state, save_checkpoint
from oelm_core.config import ConfigError, DataConfig, TrainConfig, run_config_from_dict
from oelm_core.data import eval_batches, prepare
from oelm_core.model import GPT, build_model
from oelm_core.train import (Trainer, configure_optimizer, keep_large_blocks_in_heap, lr_at, main, make_step,
                             resolve_device, train)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_data_override(monkeypatch):
    monkeypatch.delenv("OELM_DATA", raising=False)  # the tests name their own corpora
    monkeypatch.delenv("OELM_PEAK_FLOPS", raising=False)  # no MFU unless a test gives a peak


FOLDED_VOCAB = 256


@pytest.fixture
def folded(tmp_path, story_folder) -> Path:
    """story_folder prepared into tmp_path/data, its token ids folded to FOLDED_VOCAB. The token
    files keep their sizes and meta.json its content hash, so `prepare` in train() keeps them;
    its vocabulary becomes FOLDED_VOCAB, which the trainer checks the model against."""
    data = DataConfig(source=str(story_folder), out_dir=str(tmp_path / "data"), num_proc=1)
    meta = prepare(data, progress=False)
    for split in ("train", "val"):
        path = tmp_path / "data" / f"{split}.bin"
        (np.fromfile(path, dtype=np.uint16) % FOLDED_VOCAB).astype(np.uint16).tofile(path)
    (tmp_path / "data" / "meta.json").write_text(json.dumps({**meta, "vocab_size": FOLDED_VOCAB}))
    return story_folder


def params(tmp_path: Path, source: Path, variant: str = "oelm_freeze", out: str = "run",
           vocab: int = FOLDED_VOCAB, **train) -> dict:
    """A small CPU run: preset smoke at context 32, 4 sequences per step, every step logged."""
    return {
        "name": "test", "out_dir": str(tmp_path / out), "preset": "smoke", "variant": variant,
        "model": {"block_size": 32, "vocab_size": vocab},
        "data": {"source": str(source), "out_dir": str(tmp_path / "data"), "num_proc": 1},
        "train": {"steps": 10, "batch_size": 4, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2,
                  "eval_every": 5, "eval_batches": 2, "ckpt_every": 5, "keep_last": 10,
                  "log_every": 1, "progress": False, "device": "cpu", **train},
    }


def run(values: dict, resume: bool = False) -> dict:
    return train(run_config_from_dict(values), resume=resume)


def losses(out_dir: str) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    assert len(steps) == len(set(steps)), f"duplicate metric rows: {steps}"
    return {r["step"]: r["train_loss"] for r in rows}


def qk_weights(model: GPT) -> list[torch.Tensor]:
    return [b.attn.qk.weight.detach().clone() for b in model.blocks]


def outputs(out: Path) -> dict[str, int]:
    """The run folder's files and their mtimes (ns), without .lock: each session writes its pid there."""
    return {p.name: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file() and p.name != ".lock"}


def write_params(path: Path, values: dict) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_train(tmp_path: Path, values: dict, entry: tuple = ("-m", "oelm_core.train"),
                   **env: str) -> subprocess.CompletedProcess:
    """The CLI (or the script ``entry`` names) under torchrun, 2 processes on a free local port,
    with ``env`` added."""
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr",
         "127.0.0.1", "--master_port", str(free_port()), *entry,
         "--params", str(write_params(tmp_path / "ddp.yaml", values))],
        cwd=REPO, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)


def test_throughput_window_ends_after_waiting_for_the_device(tmp_path, folded, monkeypatch):
    """On a GPU a captured step returns before it has run; reading the loss at a log step waits
    for it. The reported tokens/s must count that wait (it once did not: a CUDA-graph run logged
    23.8M tokens/s on two GPUs that did 1.7M). Here the read is made to take 0.25 s."""
    from oelm_core.train import Trainer

    read = Trainer._mean_across_ranks

    def slow_read(self, t):
        time.sleep(0.25)
        return read(self, t)

    monkeypatch.setattr(Trainer, "_mean_across_ranks", slow_read)
    values = params(tmp_path, folded, steps=4, log_every=2, eval_every=4, ckpt_every=4)
    run(values)
    rows = [json.loads(line) for line in (Path(values["out_dir"]) / "metrics.jsonl").read_text().splitlines()]
    tokens_per_step = 4 * 32
    for row in rows:  # windows of 1 (step 1) and 2 steps, each with one 0.25 s read
        steps = 1 if row["step"] == 1 else 2
        assert row["tokens_per_s"] <= steps * tokens_per_step / 0.25, row


def test_lr_schedule():
    tc = TrainConfig(steps=100, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, tc) == pytest.approx(0.1) and lr_at(9, tc) == pytest.approx(1.0)
    assert lr_at(55, tc) == pytest.approx(0.55) and lr_at(100, tc) == pytest.approx(0.1)


def test_loss_falls_and_run_folder(tmp_path, story_folder):
    """The real GPT-2 vocabulary: the loss starts near ln(50257) and falls."""
    values = params(tmp_path, story_folder, variant="gpt_base", vocab=50257, steps=30,
                    eval_every=15, ckpt_every=15, keep_last=1)
    summary = run(values)
    curve = losses(values["out_dir"])
    assert curve[1] > 10.0                      # ~ln(50257) at the start
    assert curve[30] < curve[1] - 4.0, curve    # the tiny corpus is learned fast
    out = Path(values["out_dir"])
    assert sorted(p.name for p in (out / "ckpt").iterdir()) == ["step_0000030.pt"]  # keep_last=1
    assert {"config.yaml", "metrics.jsonl", "summary.json", "best.pt"} <= {p.name for p in out.iterdir()}
    assert summary == json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 30
    assert summary["final_val_loss"] < 8.0 and summary["best_val_loss"] <= summary["final_val_loss"]
    assert summary["final_val_bpb"] > 0 and summary["mfu"] is None and summary["tokens_per_s"] > 0
    assert summary["gradients_by"] == "none"
    assert summary["checkpoint_bytes"] == (out / "ckpt" / "step_0000030.pt").stat().st_size
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"lr", "grad_norm", "tokens_per_s", "tokens_seen", "epochs", "val_ppl", "val_bpb"} <= set(row)
    assert row["tokens_seen"] == 30 * 4 * 32


def test_validation_loss_is_the_models_without_dropout(tmp_path, folded):
    """With dropout 0.5 the training forward is noisy; the reported val_loss must be the eval-mode
    loss of the checkpointed weights over the validation batches."""
    values = params(tmp_path, folded, steps=2, eval_every=2, ckpt_every=2)
    values["model"]["dropout"] = 0.5
    summary = run(values)
    model = model_from_state(load_checkpoint(tmp_path / "run" / "ckpt" / "step_0000002.pt")).eval()
    batches = eval_batches(tmp_path / "data" / "val.bin", 32, 4, 2)
    with torch.no_grad():
        expected = sum(model(x, y).item() * y.numel() for x, y in batches) / sum(y.numel() for _, y in batches)
    assert abs(summary["final_val_loss"] - expected) < 1e-6, (summary["final_val_loss"], expected)


def test_frozen_qk_stay_fixed(tmp_path, folded):
    values = params(tmp_path, folded, variant="oelm_freeze")
    summary = run(values)
    cfg = run_config_from_dict(values)
    initial = build_model(cfg.model_config(), seed=cfg.train.seed)
    state = load_checkpoint(Path(values["out_dir"]) / "ckpt" / "step_0000010.pt")
    trained = model_from_state(state)
    for before, after in zip(qk_weights(initial), qk_weights(trained)):
        assert torch.equal(before, after)
    assert not torch.allclose(initial.blocks[0].attn.v.weight, trained.blocks[0].attn.v.weight)
    # The optimiser holds exactly the parameters: its state covers no Q/K element.
    n_opt = sum(s["exp_avg"].numel() for s in state["optimizer"]["state"].values())
    assert n_opt == sum(p.numel() for p in trained.parameters())
    assert not any("qk" in n for n, _ in trained.named_parameters())
    assert summary["params"] == json.loads(json.dumps(count_parameters(trained)))
    assert summary["params"]["frozen"] == 2 * 2 * 64 * 64


PEAK = 1e9  # FLOP/s per device, given to the trainer through OELM_PEAK_FLOPS (the CPU has no table entry)


def assert_mfu(values: dict, world_size: int, unfreeze_at: int) -> None:
    """Every logged MFU is flops_per_token * tokens_per_s / (PEAK * world_size) from the row's
    own tokens/s (global: all ranks' tokens), with the accounting's FLOPs of the model as it was
    then (Q/K frozen until the step ``unfreeze_at``), and the summary's is their median."""
    import statistics

    cfg = run_config_from_dict(values).model_config()
    fpt = {True: flops_per_token(cfg)["total"],
           False: flops_per_token(dataclasses.replace(cfg, freeze_qk="none"))["total"]}
    assert fpt[True] < fpt[False]
    rows = metric_rows(values["out_dir"])
    for step, row in rows.items():
        expected = fpt[step <= unfreeze_at] * row["tokens_per_s"] / (PEAK * world_size)
        assert row["mfu"] == pytest.approx(expected, rel=1e-12), (world_size, step, row)
    summary = json.loads((Path(values["out_dir"]) / "summary.json").read_text())
    assert summary["world_size"] == world_size
    assert summary["mfu"] == pytest.approx(statistics.median(r["mfu"] for r in rows.values()), rel=1e-12)


@pytest.mark.parametrize("accum, batch", [(1, 4), (2, 2)])
def test_ddp_matches_single_process(tmp_path, folded, accum, batch, monkeypatch):
    """2 gloo ranks x grad_accum A == 1 process x grad_accum 2A, through torchrun and the CLI; an
    unfreeze mid-run checks that DDP is re-wrapped around the new parameters. 128 tokens per
    rank and step: TiedGradReducer sends the embedding's rows (2 x 128 <= 256 rows). Both runs
    are given a peak FLOP figure: their MFU is per device (``assert_mfu``)."""
    common = dict(steps=6, unfreeze_schedule={3: "all"}, eval_every=3, ckpt_every=3, batch_size=batch)
    single = params(tmp_path, folded, out="single", grad_accum=2 * accum, **common)
    monkeypatch.setenv("OELM_PEAK_FLOPS", str(PEAK))
    run(single)
    assert_mfu(single, world_size=1, unfreeze_at=3)
    ddp = params(tmp_path, folded, out="ddp", grad_accum=accum, **common)
    proc = torchrun_train(tmp_path, ddp, OMP_NUM_THREADS="1", OELM_PEAK_FLOPS=str(PEAK))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_mfu(ddp, world_size=2, unfreeze_at=3)
    # The tied weight goes through TiedGradReducer, before and after DDP is re-wrapped.
    assert proc.stderr.count("reduced in two shares (TiedGradReducer)") == 2, proc.stderr[-3000:]
    a, b = metric_rows(single["out_dir"]), metric_rows(ddp["out_dir"])
    assert a.keys() == b.keys() == set(range(1, 7))
    for step in a:
        assert abs(a[step]["train_loss"] - b[step]["train_loss"]) < 1e-5, (step, a[step], b[step])
    # The validation batches are shared out across the ranks and their losses all-reduced.
    assert [s for s in a if "val_loss" in a[s]] == [s for s in b if "val_loss" in b[s]] == [3, 6]
    for step in (3, 6):
        assert abs(a[step]["val_loss"] - b[step]["val_loss"]) < 1e-5, (step, a[step], b[step])
    summary = json.loads((Path(ddp["out_dir"]) / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["params"]["frozen"] == 0
    assert summary["gradients_by"] == "ddp"  # the NVLink exchange steps aside on the CPU


# Two micro-steps per rank with repeated tokens; the reduced tied-weight gradient against the
# mean of the ranks' plain gradients, and bitwise the same on both ranks.
TIED_REDUCER = """import sys, torch, torch.distributed as dist
from oelm_core.model import build_model
from oelm_core.train import TiedGradReducer
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
seq = int(sys.argv[1])
split, plain = (build_model("tiny", "gpt_base", block_size=64, loss_chunk_tokens=48) for _ in range(2))
reducer = TiedGradReducer.for_model(split)
gen = torch.Generator().manual_seed(rank)
batches = [torch.randint(0, 40, (2, seq + 1), generator=gen) for _ in range(2)]
reducer.begin([b[:, :-1] for b in batches])
for i, b in enumerate(batches):
    reducer.sync = i == 1
    (split(b[:, :-1], b[:, 1:]) / 2).backward()
    (plain(b[:, :-1], b[:, 1:]) / 2).backward()
    # the rows leave during the last micro-step's backward, once the embedding's share is written
    assert (reducer._rows_work is not None) == (i == 1 and reducer._ids is not None), i
reducer.finish()
got, mine = split.wte.weight.grad, plain.wte.weight.grad
everyone, expected = [torch.empty_like(got) for _ in range(world)], torch.empty_like(mine)
dist.all_gather(everyone, got)
dist.all_reduce(mine)
assert all(torch.equal(g, got) for g in everyone), "ranks differ"
err = ((got - mine / world).abs().max() / mine.abs().max()).item()
assert err < 1e-6, err
if rank == 0:
    print("rows" if world * 4 * seq <= got.size(0) else "dense", err)
dist.destroy_process_group()
"""


def test_one_rank_needs_no_tied_gradient_reducer(tmp_path):
    """With one rank there is nothing to reduce: DDP keeps the tied weight, no hook is left.
    DDP gets train.ddp_bucket_mb as its bucket size, does not sync buffers before each forward,
    and is built without a deprecation warning on the installed torch. The NVLink exchange
    (grad_exchange auto) steps aside on the CPU; asked for by name (peer), it says why not."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = build_model("tiny", "gpt_base")
        tc = TrainConfig(ddp_bucket_mb=12.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            step = make_step(model, configure_optimizer(model, tc, torch.device("cpu")),
                             tc, torch.device("cpu"), ddp=True)
        assert step.grads is None and model._tied_grad_hook is None and step.gradients_by == "ddp"
        assert step.module.bucket_bytes_cap == 12.5 * 2**20
        assert step.module.broadcast_buffers is False
        tc = TrainConfig(grad_exchange="peer")
        with pytest.raises(ConfigError, match="grad_exchange: peer needs two CUDA GPUs of one host"):
            make_step(model, configure_optimizer(model, tc, torch.device("cpu")), tc, torch.device("cpu"), ddp=True)
        assert [type(m) for m in model.modules()] == [type(m) for m in build_model("tiny", "gpt_base").modules()]
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("seq, path", [(8, "rows"), (48, "dense")])
def test_tied_gradient_reducer_equals_the_mean_gradient(tmp_path, seq, path):
    """Two gloo ranks: the tied weight's gradient from TiedGradReducer (output share all-reduced,
    embedding share as gathered rows, or dense when the tokens outnumber the rows) equals the
    mean of the ranks' plain gradients, over two micro-steps, and is the same on both ranks."""
    script = tmp_path / "tied.py"
    script.write_text(TIED_REDUCER)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                           str(script), str(seq)],
                          cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[0] == path, proc.stdout


# Rank 1 cannot capture (torch.cuda.graph raises there); rank 0 can. Then the training CLI.
REFUSE_ON_RANK_1 = """import os, sys, torch
if os.environ["RANK"] == "1":
    def refuse(*args, **kwargs):
        raise RuntimeError("capture refused on purpose")
    torch.cuda.graph = refuse
from oelm_core.train import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("exchange, one_rank_fails, batch, accum, compile, unfreeze", [
    ("ddp", False, 4, 1, False, {}),
    # the tied weight's rows; the sends inside the compiled backward; a new exchange for the
    # parameters that unfreezing adds at step 5 (captured after 11 more eager steps)
    ("peer", False, 4, 1, True, {5: "all"}),
    ("peer", True, 8, 2, False, {}),   # the tied weight dense; accumulated micro-steps
    ("peer", False, 8, 2, False, {}),  # the same, captured: no side-stream work to wait for
])
def test_ddp_on_two_gpus_captures_its_step_and_matches_one_process(tmp_path, folded, exchange, one_rank_fails,
                                                                    batch, accum, compile, unfreeze):
    """2 NCCL ranks x grad_accum A == 1 GPU x grad_accum 2A (float32), both with the whole step in
    a CUDA graph: on two ranks the gradient exchange (DDP's all-reduce, or the NVLink copies) is
    captured after 11 eager steps, and the later steps replay it. If one rank cannot capture,
    neither replays (no hang): both go on eagerly, with the same losses."""
    common = dict(steps=20, eval_every=10, ckpt_every=10, device="cuda", dtype="float32",
                  batch_size=batch, compile=compile, unfreeze_schedule=unfreeze)
    single = params(tmp_path, folded, out="single", grad_accum=2 * accum, **common)
    run(single)
    ddp = params(tmp_path, folded, out="ddp", grad_accum=accum, grad_exchange=exchange, **common)
    entry = ("-m", "oelm_core.train")
    if one_rank_fails:
        (tmp_path / "refuse.py").write_text(REFUSE_ON_RANK_1)
        entry = (str(tmp_path / "refuse.py"),)
    proc = torchrun_train(tmp_path, ddp, entry, NCCL_NVLS_ENABLE="0", PYTHONPATH=str(REPO))
    assert proc.returncode == 0, proc.stderr[-3000:]
    if one_rank_fails:
        assert "capture refused on purpose" in proc.stderr, proc.stderr[-3000:]
        assert "another rank could not capture its step" in proc.stderr, proc.stderr[-3000:]
        assert "captured the training step" not in proc.stderr
    else:
        by = "DDP's all-reduce" if exchange == "ddp" else "the NVLink gradient exchange"
        assert f"captured the training step as a CUDA graph with {by}" in proc.stderr
        assert "capture failed" not in proc.stderr, proc.stderr[-3000:]
    if exchange == "peer":  # rank 0 logs each exchange it builds: the first, and one per re-wrap
        builds = 1 + len(unfreeze) + one_rank_fails
        assert proc.stderr.count("gradients exchanged by NVLink copies") == builds, proc.stderr[-3000:]
    summary = json.loads((Path(ddp["out_dir"]) / "summary.json").read_text())
    assert summary["gradients_by"] == ("ddp" if exchange == "ddp" else "nvlink copies")
    a, b = losses(single["out_dir"]), losses(ddp["out_dir"])
    assert a.keys() == b.keys() == set(range(1, 21))
    # Relative: float32 with TF32 matmuls (the trainer's "high" precision on CUDA), and the two
    # halves of the batch summed in another order on one GPU than on two, drift apart by rounding
    # that grows with the loss (1.09e-4 at a loss of 4.63 once, on H200s). A wrong gradient (a
    # missing 1/world, a rank's share dropped) moves the loss by 1e-2 or more within a few steps.
    for step in a:
        assert abs(a[step] - b[step]) <= 5e-5 * abs(a[step]), (step, a[step], b[step])


def test_a_two_rank_run_resumes_in_one_process_with_the_same_global_batch(tmp_path, folded, capsys):
    """world size x grad_accum is the global batch: a 2-rank run paused at step 3 goes on in one
    process with grad_accum 2 along the curve of a run trained that way throughout, and a
    resume that would change the global batch is refused with the grad_accum that keeps it."""
    common = dict(steps=6, eval_every=3, ckpt_every=3)
    single = params(tmp_path, folded, out="single", grad_accum=2, **common)
    run(single)
    ddp = params(tmp_path, folded, out="ddp", grad_accum=1, stop_after=3, **common)
    proc = torchrun_train(tmp_path, ddp, OMP_NUM_THREADS="1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp["train"].pop("stop_after")
    resumed = write_params(tmp_path / "resumed.yaml", ddp)
    assert main(["--params", str(resumed), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "world size x train.grad_accum = 2" in err and "Resume with train.grad_accum: 2" in err
    assert main(["--params", str(resumed), "--resume", "--set", "train.grad_accum=2"]) == 0
    a, b = metric_rows(single["out_dir"]), metric_rows(ddp["out_dir"])
    assert a.keys() == b.keys() == set(range(1, 7))
    for step in a:
        for key in ("train_loss", "val_loss", "tokens_seen"):
            if key in a[step]:
                assert abs(a[step][key] - b[step][key]) < 1e-5, (step, key, a[step], b[step])


def test_resume_reproduces_uninterrupted_run(tmp_path, folded):
    full = params(tmp_path, folded, out="full", steps=12, ckpt_every=4)
    run(full)
    split = params(tmp_path, folded, out="split", steps=12, ckpt_every=4)
    paused = run({**split, "train": {**split["train"], "stop_after": 6}})
    assert paused["status"] == "paused" and paused["steps"] == 6
    done = run(split, resume=True)
    assert done["status"] == "completed" and done["steps"] == 12
    a, b = losses(full["out_dir"]), losses(split["out_dir"])  # losses() also rejects duplicate rows
    assert a.keys() == b.keys() == set(range(1, 13))
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-6, (step, a[step], b[step])


def metric_rows(out_dir: str) -> dict[int, dict]:
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


def test_a_killed_run_resumes_where_it_stopped(tmp_path, folded, monkeypatch):
    """Killed at step 7 (past the checkpoint of step 4, with dropout so that the restored random
    state matters, and a half-written metrics row), resumed: the same train and val figures,
    best.pt and tokens as the run that was never stopped."""
    common = dict(steps=12, ckpt_every=4, eval_every=3)
    full = params(tmp_path, folded, out="full", **common)
    full["model"]["dropout"] = 0.1
    run(full)
    killed = params(tmp_path, folded, out="killed", **common)
    killed["model"]["dropout"] = 0.1

    from oelm_core.train import TrainStep
    real_call = TrainStep.__call__

    def dies_at_step_7(self, batches, lr, step):
        if step == 7:
            raise KeyboardInterrupt("killed")
        return real_call(self, batches, lr, step)

    monkeypatch.setattr(TrainStep, "__call__", dies_at_step_7)
    with pytest.raises(KeyboardInterrupt):
        run(killed)
    monkeypatch.setattr(TrainStep, "__call__", real_call)
    with open(Path(killed["out_dir"]) / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "train_lo')  # the kill cut a row short
    done = run(killed, resume=True)

    a, b = metric_rows(full["out_dir"]), metric_rows(killed["out_dir"])
    assert a.keys() == b.keys() == set(range(1, 13))
    for step in a:
        for key in ("train_loss", "val_loss", "tokens_seen"):
            assert (a[step].get(key) is None) == (b[step].get(key) is None), (step, key)
            if a[step].get(key) is not None:
                assert abs(a[step][key] - b[step][key]) <= 1e-6, (step, key, a[step][key], b[step][key])
    first = json.loads((Path(full["out_dir"]) / "summary.json").read_text())
    assert done["best_val_loss"] == first["best_val_loss"] and done["tokens_seen"] == first["tokens_seen"]
    best = [load_checkpoint(Path(v["out_dir"]) / "best.pt") for v in (full, killed)]
    assert best[0]["step"] == best[1]["step"]
    for name, tensor in best[0]["model"].items():
        torch.testing.assert_close(best[1]["model"][name], tensor, rtol=0, atol=1e-6, msg=name)


def kill_at(monkeypatch, obj, name: str, when) -> None:
    """Make ``obj.name`` raise KeyboardInterrupt (a kill) the first time ``when(*args)`` holds."""
    real = getattr(obj, name)

    def dies(*args, **kwargs):
        if when(*args, **kwargs):
            monkeypatch.setattr(obj, name, real)
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, dies)


def test_a_run_killed_before_its_summary_reports_how_it_ended(tmp_path, folded, monkeypatch):
    """Killed after its last checkpoint but before summary.json: the earlier session's "paused"
    summary is on disk, and a resume must report the run that ended instead; so must a resume
    that finds summary.json cut short."""
    common = dict(steps=12, ckpt_every=4, eval_every=4)
    full = run(params(tmp_path, folded, out="full", **common))
    values = params(tmp_path, folded, out="killed", **common)
    assert run({**values, "train": {**values["train"], "stop_after": 6}})["status"] == "paused"
    import oelm_core.train as T
    kill_at(monkeypatch, T.Trainer, "_write_summary", lambda self, status, *a, **k: status == "completed")
    with pytest.raises(KeyboardInterrupt):
        run(values, resume=True)
    summary = Path(values["out_dir"]) / "summary.json"
    assert json.loads(summary.read_text())["status"] == "paused"
    for _ in range(2):
        again = run(values, resume=True)
        assert (again["status"], again["steps"]) == ("completed", 12)
        assert again["final_val_loss"] == full["final_val_loss"] and again["best_val_loss"] == full["best_val_loss"]
        assert json.loads(summary.read_text()) == again
        summary.write_text(summary.read_text()[:40])  # the kill cut the file short


def test_a_run_killed_while_writing_best_pt_resumes_to_the_same_best_pt(tmp_path, folded, monkeypatch):
    """An evaluation step that is also a checkpoint step writes best.pt and step_N.pt; killed
    between the two, the resumed run must still end with the uninterrupted run's best.pt."""
    common = dict(steps=12, ckpt_every=4, eval_every=4)
    run(params(tmp_path, folded, out="full", **common))
    values = params(tmp_path, folded, out="killed", **common)
    import oelm_core.train as T
    kill_at(monkeypatch, T, "save_checkpoint", lambda state, path: Path(path).name == "best.pt" and state["step"] == 12)
    with pytest.raises(KeyboardInterrupt):
        run(values)
    run(values, resume=True)
    best = [load_checkpoint(tmp_path / out / "best.pt") for out in ("full", "killed")]
    assert best[0]["step"] == best[1]["step"] == 12
    assert best[0]["metrics"]["val_loss"] == best[1]["metrics"]["val_loss"]
    for name, tensor in best[0]["model"].items():
        assert torch.equal(tensor, best[1]["model"][name]), name


def test_a_pause_changes_neither_evaluations_nor_early_stopping(tmp_path, folded):
    """A session ended by stop_after checkpoints but does not evaluate: an extra evaluation at the
    pause would move best.pt and the early stop away from the uninterrupted run's."""
    common = dict(steps=20, eval_every=5, ckpt_every=5, lr=0.03, early_stop_patience=1)
    full = params(tmp_path, folded, out="full", **common)
    straight = run(full)
    split = params(tmp_path, folded, out="split", **common)
    paused = run({**split, "train": {**split["train"], "stop_after": 7}})
    assert paused["status"] == "paused" and paused["steps"] == 7
    resumed = run(split, resume=True)
    a, b = metric_rows(full["out_dir"]), metric_rows(split["out_dir"])
    assert [s for s in a if "val_loss" in a[s]] == [s for s in b if "val_loss" in b[s]]
    assert all(s % 5 == 0 for s in a if "val_loss" in a[s])
    for key in ("status", "steps", "best_val_loss"):
        assert straight[key] == resumed[key], key
    assert (load_checkpoint(Path(full["out_dir"]) / "best.pt")["step"]
            == load_checkpoint(Path(split["out_dir"]) / "best.pt")["step"])


def test_resuming_a_run_that_ended_changes_nothing(tmp_path, folded):
    values = params(tmp_path, folded, steps=6, ckpt_every=3, eval_every=3)
    first = run(values)
    out = Path(values["out_dir"])
    before = outputs(out)
    again = run(values, resume=True)
    assert again == first and first["tokens_per_s"] > 0
    assert outputs(out) == before


def test_a_constant_schedule_run_extends_like_a_longer_run(tmp_path, folded):
    """With min_lr = lr the schedule does not read train.steps: more steps continue a finished
    run from its last checkpoint, and the curve is that of a run planned that long."""
    constant = dict(ckpt_every=3, eval_every=3, min_lr=3e-3)
    values = params(tmp_path, folded, steps=6, **constant)
    first = run(values)
    longer = run({**values, "train": {**values["train"], "steps": 9}}, resume=True)
    assert longer["status"] == "completed" and longer["steps"] == 9
    assert longer["wall_time_s"] > first["wall_time_s"]  # both sessions' time
    assert longer["tokens_seen"] == 9 * 4 * 32
    planned = params(tmp_path, folded, out="planned", steps=9, **constant)
    run(planned)
    a, b = metric_rows(planned["out_dir"]), metric_rows(values["out_dir"])
    assert a.keys() == b.keys() == set(range(1, 10))
    for step in a:
        assert a[step]["lr"] == b[step]["lr"] == 3e-3 * min(1, step / 2)  # 2 warm-up steps
        assert abs(a[step]["train_loss"] - b[step]["train_loss"]) <= 1e-6, (step, a[step], b[step])


def test_resume_refuses_a_step_count_that_moves_the_learning_rate(tmp_path, folded, capsys):
    """The cosine ends at train.steps: going on from a finished 10-step run with 20 steps would
    train step 11 at the learning rate of mid-schedule (it once did, and the curve jumped)."""
    values = params(tmp_path, folded, steps=10, ckpt_every=5)
    good = write_params(tmp_path / "p.yaml", values)
    assert main(["--params", str(good)]) == 0
    out = Path(values["out_dir"])
    before = outputs(out)
    capsys.readouterr()
    assert main(["--params", str(good), "--resume", "--set", "train.steps=20"]) == 2
    error = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("error: "))
    # Step 11 of 20 is mid-cosine (0.001884); the 10-step run ended at min_lr.
    assert "train.steps 10 -> 20 changes the learning rate of step 11 from 0.0003 to 0.001884" in error
    assert "Keep train.steps: 10" in error and "out_dir set to a new folder" in error
    assert "train.min_lr equal to train.lr" in error
    assert outputs(out) == before


def test_resume_refuses_settings_that_shape_the_curve(tmp_path, folded, capsys):
    values = params(tmp_path, folded, steps=8, ckpt_every=2)
    good = write_params(tmp_path / "p.yaml", values)
    assert main(["--params", str(good), "--set", "train.stop_after=4"]) == 0
    capsys.readouterr()
    data = Path(values["data"]["out_dir"])
    prepared = {p.name: p.stat().st_mtime_ns for p in data.iterdir()}
    assert main(["--params", str(good), "--resume", "--set", "train.batch_size=2", "train.seed=7",
                 "data.max_train_stories=5"]) == 2
    err = capsys.readouterr().err
    assert "train.seed: 42 -> 7" in err and "train.batch_size: 4 -> 2" in err and "config.yaml" in err
    assert "data.max_train_stories: 0 -> 5" in err
    # Refused before the data is prepared: the token files the run trained on are untouched.
    assert {p.name: p.stat().st_mtime_ns for p in data.iterdir()} == prepared
    assert yaml.safe_load((Path(values["out_dir"]) / "config.yaml").read_text())["train"]["seed"] == 42
    # How often it reports may change.
    assert main(["--params", str(good), "--resume", "--set", "train.log_every=2"]) == 0
    assert json.loads((Path(values["out_dir"]) / "summary.json").read_text())["steps"] == 8


def test_progressive_unfreezing_and_resume_across_it(tmp_path, folded):
    values = params(tmp_path, folded, out="full", steps=8, ckpt_every=1,
                    unfreeze_schedule={5: "all"})
    run(values)
    cfg = run_config_from_dict(values)
    initial = qk_weights(build_model(cfg.model_config(), seed=cfg.train.seed))
    ckpt = Path(values["out_dir"]) / "ckpt"
    before, after = load_checkpoint(ckpt / "step_0000005.pt"), load_checkpoint(ckpt / "step_0000006.pt")
    assert before["model_config"]["freeze_qk"] == "all" and after["model_config"]["freeze_qk"] == "none"
    for w0, w5, w6 in zip(initial, qk_weights(model_from_state(before)), qk_weights(model_from_state(after))):
        assert torch.equal(w0, w5) and not torch.equal(w5, w6)
    assert len(before["optimizer"]["param_groups"]) == 2
    groups = after["optimizer"]["param_groups"]
    assert len(groups) == 3 and len(groups[2]["params"]) == 2 and groups[2]["weight_decay"] == 0.1

    # Paused before the unfreeze (step 3) and after it (step 7), each resumed to the end.
    for stop in (3, 7):
        split = params(tmp_path, folded, out=f"split{stop}", steps=8, ckpt_every=1,
                       unfreeze_schedule={5: "all"})
        run({**split, "train": {**split["train"], "stop_after": stop}})
        run(split, resume=True)
        a, b = losses(values["out_dir"]), losses(split["out_dir"])
        assert a.keys() == b.keys()
        assert all(abs(a[s] - b[s]) <= 1e-6 for s in a), (stop, a, b)


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
        step = make_step(model, configure_optimizer(model, tc, torch.device("cpu")), tc, torch.device("cpu"))
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
        step = make_step(model, configure_optimizer(model, step_tc, torch.device("cpu")), step_tc, torch.device("cpu"))
        step(batches, 1e-3, 1)
        assert not step.compile  # the failed one fell back to eager
    for a, b in zip(*(m.state_dict().values() for m in models)):
        assert torch.equal(a, b)


def test_compile_tuning_reaches_torch_compile_on_cuda_only(monkeypatch):
    """train.compile_tuning asks inductor for coordinate-descent tuning of its Triton kernels; CPU
    code has none to tune, so a CPU step compiles plainly."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda module, **kwargs: seen.append(kwargs) or module)
    model = build_model("smoke", "gpt_base", block_size=16, vocab_size=FOLDED_VOCAB)
    tc = TrainConfig(compile=True)
    assert tc.compile_tuning  # the default
    make_step(model, configure_optimizer(model, tc, torch.device("cpu")), tc, torch.device("cpu"))
    step = make_step(model, configure_optimizer(model, tc, torch.device("cpu")), tc, torch.device("cuda"))
    tuning_off = dataclasses.replace(tc, compile_tuning=False)
    make_step(model, configure_optimizer(model, tc, torch.device("cpu")), tuning_off, torch.device("cuda"))
    assert seen == [{"options": None}, {"options": {"coordinate_descent_tuning": True}}, {"options": None}]
    assert step.compile


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_unfreezing_under_a_captured_step_matches_eager_steps(tmp_path, folded, caplog):
    """One GPU, float32: the captured step (two warm-up steps, captured at step 3, re-captured
    after the unfreeze at step 5) against eager steps. The first eager step after an unfreeze once
    added the last replay's gradients to its own (1.2e-3 apart at step 7)."""
    common = dict(steps=9, eval_every=10, ckpt_every=10, device="cuda", dtype="float32",
                  unfreeze_schedule={5: "all"})
    graph = params(tmp_path, folded, out="graph", cuda_graph=True, **common)
    eager = params(tmp_path, folded, out="eager", cuda_graph=False, **common)
    with caplog.at_level("INFO", logger="oelm_core.train"):
        run(graph)
    assert caplog.text.count("captured the training step as a CUDA graph") == 2, caplog.text
    run(eager)
    a, b = losses(graph["out_dir"]), losses(eager["out_dir"])
    assert a.keys() == b.keys() == set(range(1, 10))
    for step in a:
        assert abs(a[step] - b[step]) < 1e-4, (step, a[step], b[step])


def test_step_hook_and_make_step():
    """make_step is the loop's step; modules with after_optimizer_step(step) are called after it."""
    model = build_model("smoke", "gpt_base", block_size=16, vocab_size=FOLDED_VOCAB)
    calls = []
    model.blocks[0].mlp.after_optimizer_step = calls.append
    tc = TrainConfig(grad_clip=1.0, lr=1e-3)
    step = make_step(model, configure_optimizer(model, tc, torch.device("cpu")), tc, torch.device("cpu"))
    x = torch.randint(0, FOLDED_VOCAB, (2, 17))
    batches = [(x[:, :-1], x[:, 1:])]
    first, norm = step(batches, 1e-3, 1)
    for n in range(2, 6):
        loss, _ = step(batches, 1e-3, n)
    assert calls == [1, 2, 3, 4, 5] and norm > 0 and loss < first


@pytest.mark.parametrize("grad_clip", [0.05, 0.0])
def test_clip_inside_the_fused_optimizer_equals_clip_grad_norm(grad_clip):
    """The step divides the gradients by the clip factor inside fused AdamW (its grad_scale):
    the same norms and weights as clip_grad_norm_ then the same fused step, over 4 steps with
    the clip binding (0.05 is far below this model's norm) and with it off."""
    x = torch.randint(0, FOLDED_VOCAB, (4, 17), generator=torch.Generator().manual_seed(0))
    batches = [(x[:, :-1], x[:, 1:])]
    tc = TrainConfig(grad_clip=grad_clip, lr=1e-2)
    models = [build_model("smoke", "oelm_nofreeze", block_size=16, vocab_size=FOLDED_VOCAB, seed=3)
              for _ in range(2)]
    opts = [configure_optimizer(model, tc, torch.device("cpu")) for model in models]
    assert all(group["fused"] for opt in opts for group in opt.param_groups)

    step = make_step(models[0], opts[0], tc, torch.device("cpu"))
    inside = [float(step(batches, tc.lr, n)[1]) for n in range(1, 5)]
    outside = []
    for _ in range(4):
        opts[1].zero_grad(set_to_none=True)
        models[1](*batches[0]).backward()
        outside.append(float(torch.nn.utils.clip_grad_norm_(models[1].parameters(), grad_clip or float("inf"))))
        opts[1].step()

    assert inside == pytest.approx(outside, rel=1e-5)
    assert min(inside) > 10 * 0.05  # the 0.05 clip binds on every step
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert (a - b).abs().max() <= 1e-6 * (1 + b.abs().max()), name
    # The step leaves no stale divisor behind for a later use of its optimizer.
    assert not hasattr(opts[0], "grad_scale")


# What weight decay applies to, by name (the rule of configure_optimizer's docstring, written
# out rather than derived from the tensors' shapes as the optimiser does): the matrices of the
# mapping, embeddings, trainable Q/K and their POET generators, the Synthesizer's logit tables.
DECAYED = (r"wte\.weight", r"wpe\.weight", r"lm_head\.weight", r"blocks\.\d+\.attn\.(qk|v|proj)\.weight",
           r"blocks\.\d+\.mlp\.(fc|proj)\.weight", r"blocks\.\d+\.attn\.qk\.skew_[qk]_(left|right)",
           r"blocks\.\d+\.attn\.synth_[01]")
# Never decayed: biases and LayerNorm gains and shifts.
UNDECAYED = (r"blocks\.\d+\.ln_[12]\.(weight|bias)", r"ln_f\.(weight|bias)",
             r"blocks\.\d+\.(attn\.(v|proj)|mlp\.(fc|proj))\.bias")


@pytest.mark.parametrize("variant, overrides", [
    ("gpt_base", {}), ("gpt_base", {"tie_embeddings": False, "attn_bias": True}),
    ("oelm_freeze", {}), ("oelm_freeze", {"tie_embeddings": False}), ("oelm_freeze", {"freeze_qk": [1]}),
    ("oelm_poet", {}), ("synth_random", {}), ("synth_factorized", {})])
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


def test_clear_errors(tmp_path, folded, capsys):
    # Unknown key, through a real subprocess: exit code 2, one line that names the key and the fix.
    good = write_params(tmp_path / "p.yaml", params(tmp_path, folded, steps=4, ckpt_every=2))
    proc = subprocess.run([sys.executable, "-m", "oelm_core.train", "--params", str(good),
                           "--set", "train.stepz=5"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "train.stepz" in proc.stderr and "valid keys" in proc.stderr and "steps" in proc.stderr

    # YAML that does not parse, in the file or in --set: exit code 2 and one line naming where.
    broken = tmp_path / "broken.yaml"
    broken.write_text("train:\n  lr: [1\n")
    assert main(["--params", str(broken)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {broken} is not valid YAML") and err.count("\n") == 1
    assert main(["--params", str(good), "--set", "train.lr=[1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --set 'train.lr=[1': the value is not valid YAML") and err.count("\n") == 1

    # Wrong type.
    assert main(["--params", str(good), "--set", "train.steps=abc"]) == 2
    err = capsys.readouterr().err
    assert "train.steps should be int" in err and "'abc'" in err

    # A value the loop cannot use.
    assert main(["--params", str(good), "--set", "train.ddp_bucket_mb=0"]) == 2
    assert "train.ddp_bucket_mb must be positive, got 0" in capsys.readouterr().err

    # Missing data folder.
    missing = dict(params(tmp_path, tmp_path / "nowhere"), out_dir=str(tmp_path / "other"))
    missing["data"]["out_dir"] = str(tmp_path / "data2")
    assert main(["--params", str(write_params(tmp_path / "m.yaml", missing))]) == 2
    err = capsys.readouterr().err
    assert "nowhere does not exist" in err and "data.source" in err

    # Truncated newest checkpoint on --resume: names the file and how to fall back.
    assert main(["--params", str(good)]) == 0
    capsys.readouterr()
    last = tmp_path / "run" / "ckpt" / "step_0000004.pt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    assert main(["--params", str(good), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "step_0000004.pt" in err and "truncated" in err
    assert f"To resume from the checkpoint before it (step_0000002.pt), delete {last}" in err

    # A second fresh start into the same folder refuses to overwrite the run.
    assert main(["--params", str(good)]) == 2
    assert "--resume" in capsys.readouterr().err


def test_a_gpu_index_past_the_machines_gpus_is_a_config_error(tmp_path, monkeypatch, capsys):
    """train.device: cuda:2 on a machine with 2 GPUs (or a third torchrun process there) was
    torch's raw error from set_device, a traceback out of main; now a ConfigError naming
    train.device and the GPUs there are. This machine's CUDA is simulated: 2 GPUs."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)

    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert resolve_device("cuda", local_rank=1) == torch.device("cuda", 1)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert chosen == [torch.device("cuda", 1), torch.device("cuda", 1), torch.device("cuda", 0)]
    with pytest.raises(ConfigError, match=r"^train.device is 'cuda:2', but this machine has 2 CUDA GPU\(s\), "
                                          r"cuda:0..cuda:1: choose one of them, or auto$"):
        resolve_device("cuda:2")
    with pytest.raises(ConfigError, match=r"^train.device 'cuda' puts local rank 2 on cuda:2, but this machine "
                                          r"has 2 CUDA GPU\(s\), .*: start at most 2 processes per node$"):
        resolve_device("cuda", local_rank=2)
    with pytest.raises(ConfigError, match=r"^train.device 'auto' puts local rank 3 on cuda:3"):
        resolve_device("auto", local_rank=3)
    assert len(chosen) == 3  # nothing was made current for the refused ones

    # Through the CLI: exit code 2 and one line, before any data or model is touched.
    values = params(tmp_path, tmp_path / "nowhere", device="cuda:7")
    assert main(["--params", str(write_params(tmp_path / "p.yaml", values))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: train.device is 'cuda:7', but this machine has 2 CUDA GPU(s)")
    assert err.count("\n") == 1


def test_a_model_vocabulary_smaller_than_the_datas_is_refused(tmp_path, story_folder):
    """The tiny preset (128 tokens) on GPT-2 token files: once a bare IndexError from
    torch.embedding at the first step; now a ConfigError before the model is built."""
    values = params(tmp_path, story_folder)
    values["preset"], values["model"] = "tiny", {}
    with pytest.raises(ConfigError) as exc:
        run(values)
    message = str(exc.value)
    assert "gpt2 ids up to 50256 (a 50257-token vocabulary), but model.vocab_size is 128 (preset tiny)" in message
    assert "a preset with the gpt2 vocabulary (medium512, small, base, large, mini, smoke)" in message
    assert "model.vocab_size: 50257" in message
    assert not (tmp_path / "run" / "ckpt").exists()


def test_divergence_stops_and_keeps_last_good_checkpoint(tmp_path, folded, monkeypatch, capsys):
    forward = GPT.forward
    calls = {"n": 0}

    def poisoned(self, idx, targets=None, cache=None):
        loss = forward(self, idx, targets, cache)
        if self.training:
            calls["n"] += 1
            if calls["n"] >= 8:  # training step 8 onwards
                return loss * float("nan")
        return loss

    monkeypatch.setattr(GPT, "forward", poisoned)
    values = params(tmp_path, folded, steps=20, ckpt_every=5, log_every=5, eval_every=5)
    assert main(["--params", str(write_params(tmp_path / "p.yaml", values))]) == 3
    err = capsys.readouterr().err
    assert "diverged at step 10" in err and "loss nan" in err and "Lower train.lr" in err
    assert "step_0000005.pt is kept" in err
    ckpt = Path(values["out_dir"]) / "ckpt"
    assert [p.name for p in ckpt.iterdir()] == ["step_0000005.pt"]
    state = load_checkpoint(ckpt / "step_0000005.pt")
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    model_from_state(state)
    summary = json.loads((Path(values["out_dir"]) / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["steps"] == 10


def test_resume_refuses_other_stories_and_accepts_the_same_ones_moved(tmp_path, story_folder, capsys):
    """The checkpoint records the prepared data's text and content hashes and token counts. After a story
    file changed (one name: the token counts stay), --resume is refused, naming both; the same
    stories in another folder, prepared into another data folder, resume (data.source and
    data.out_dir may change)."""
    values = params(tmp_path, story_folder, variant="gpt_base", vocab=50257, steps=4, ckpt_every=2,
                    eval_every=2)
    good = write_params(tmp_path / "p.yaml", values)
    assert main(["--params", str(good), "--set", "train.stop_after=2"]) == 0
    trained = json.loads((tmp_path / "data" / "meta.json").read_text())
    identity = ("text_hash", "content_hash", "train_tokens", "val_tokens")
    assert load_checkpoint(tmp_path / "run" / "ckpt" / "step_0000002.pt")["data"] == {k: trained[k] for k in identity}
    moved = shutil.copytree(story_folder, tmp_path / "moved")

    part = story_folder / "train" / "part.txt"
    part.write_text(part.read_text().replace("Tom", "Tim"))
    capsys.readouterr()
    assert main(["--params", str(good), "--resume"]) == 2
    err = capsys.readouterr().err
    now = json.loads((tmp_path / "data" / "meta.json").read_text())  # prepared from the changed stories
    assert now["text_hash"] != trained["text_hash"] and now["train_tokens"] == trained["train_tokens"]
    assert err.startswith(f"error: cannot resume {tmp_path / 'run' / 'ckpt' / 'step_0000002.pt'}: it was "
                          f"trained on other data (text hash {trained['text_hash'][:12]}..., "
                          f"{trained['train_tokens']} train / {trained['val_tokens']} val tokens, from "
                          f"{story_folder}) than {tmp_path / 'data'} holds now (text hash "
                          f"{now['text_hash'][:12]}..., {now['train_tokens']} train / "), err
    assert "out_dir set to a new folder" in err and err.count("\n") == 1
    assert sorted(p.name for p in (tmp_path / "run" / "ckpt").iterdir()) == ["step_0000002.pt"]

    assert main(["--params", str(good), "--resume", "--set", f"data.source={moved}",
                 f"data.out_dir={tmp_path / 'moved_data'}"]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4


def hub_params(tmp_path: Path, story_folder: Path, datasets, monkeypatch) -> Path:
    """The parameter file of a 4-step run on the hub's TinyStories (into tmp_path/hub_data), a
    checkpoint every step; the hub is simulated: it serves story_folder's stories."""
    rows = {"train": STORIES * 20, "validation": STORIES[:3] * 10}  # story_folder's, see conftest
    monkeypatch.setattr(datasets, "load_dataset",
                        lambda name, split, streaming=False: iter([{"text": t} for t in rows[split]]))
    values = params(tmp_path, story_folder, variant="gpt_base", vocab=50257, steps=4, ckpt_every=1,
                    eval_every=2)
    values["data"] = {"source": "roneneldan/TinyStories", "out_dir": str(tmp_path / "hub_data"), "num_proc": 1}
    return write_params(tmp_path / "p.yaml", values)


def test_a_run_from_the_hub_resumes_from_a_local_copy_of_its_stories_and_back(tmp_path, story_folder,
                                                                            monkeypatch, capsys):
    """The content hash of hub data is one of (name, column, caps), that of a folder one of its
    texts: a run trained from the hub was refused when resumed offline from a local copy of the
    same stories. Resume compares the stories' text hash, the same from either source (the hub
    is simulated: it serves story_folder's stories); other stories are still refused. A
    checkpoint from before the text hash (content hash only) resumes on the same data."""
    datasets = pytest.importorskip("datasets")
    good = hub_params(tmp_path, story_folder, datasets, monkeypatch)
    once = ["--set", "train.stop_after=1"]
    assert main(["--params", str(good), *once]) == 0
    ckpt = tmp_path / "run" / "ckpt"
    from_hub = load_checkpoint(ckpt / "step_0000001.pt")["data"]

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'roneneldan/TinyStories' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    other = shutil.copytree(story_folder, tmp_path / "other")
    part = other / "train" / "part.txt"
    part.write_text(part.read_text().replace("Tom", "Tim"))
    capsys.readouterr()
    assert main(["--params", str(good), "--resume", "--set", f"data.source={other}",
                 f"data.out_dir={tmp_path / 'other_data'}"]) == 2
    assert f"trained on other data (text hash {from_hub['text_hash'][:12]}...," in capsys.readouterr().err

    local = ["--set", f"data.source={story_folder}", f"data.out_dir={tmp_path / 'local_data'}"]
    assert main(["--params", str(good), "--resume", *local, *once]) == 0
    from_folder = load_checkpoint(ckpt / "step_0000002.pt")["data"]
    assert from_folder["content_hash"] != from_hub["content_hash"] and from_folder == {
        **from_hub, "content_hash": from_folder["content_hash"]}
    assert main(["--params", str(good), "--resume", *once]) == 0  # back to the hub's data, cached

    # A checkpoint written before checkpoints recorded the text hash.
    state = load_checkpoint(ckpt / "step_0000003.pt")
    del state["data"]["text_hash"]
    save_checkpoint(state, ckpt / "step_0000003.pt")
    assert main(["--params", str(good), "--resume"]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4


def test_data_prepared_before_text_hashes_resumes_from_the_hub_or_a_folder(tmp_path, story_folder,
                                                                             monkeypatch):
    """Data folders prepared before meta.json held a text hash kept their meta, so a run on the
    hub's stories recorded no text hash and a resume from a local copy compared content hashes
    (one of the hub's name, one of the folder's texts): refused as "other data". prepare now adds
    the text hash to such a meta from the token files, without tokenising again."""
    datasets = pytest.importorskip("datasets")
    good = hub_params(tmp_path, story_folder, datasets, monkeypatch)
    folders = {"roneneldan/TinyStories": tmp_path / "hub_data", str(story_folder): tmp_path / "local_data"}
    for source, out in folders.items():
        prepare(DataConfig(source=source, out_dir=str(out), num_proc=1), progress=False)
        meta = json.loads((out / "meta.json").read_text())
        (out / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "text_hash"}))
    written = {out: (out / "train.bin").stat().st_mtime_ns for out in folders.values()}
    once = ["--set", "train.stop_after=1"]
    assert main(["--params", str(good), *once]) == 0
    local = ["--set", f"data.source={story_folder}", f"data.out_dir={tmp_path / 'local_data'}"]
    assert main(["--params", str(good), "--resume", *local, *once]) == 0

    hub, folder = (json.loads((out / "meta.json").read_text()) for out in folders.values())
    assert hub["content_hash"] != folder["content_hash"] and hub["text_hash"] == folder["text_hash"]
    assert {out: (out / "train.bin").stat().st_mtime_ns for out in folders.values()} == written
    ckpt = tmp_path / "run" / "ckpt"
    recorded = [load_checkpoint(ckpt / f"step_000000{n}.pt")["data"]["text_hash"] for n in (1, 2)]
    assert recorded == [hub["text_hash"]] * 2


def test_a_checkpoint_from_before_text_hashes_says_how_to_move_to_another_source(tmp_path, story_folder,
                                                                               monkeypatch, capsys):
    """A checkpoint that records only the content hash cannot tell the hub's stories from the
    same ones in a folder: the refusal said "other data". It says that the stories may be the
    same and how to go on; done as it says, the run then resumes from the folder."""
    datasets = pytest.importorskip("datasets")
    good = hub_params(tmp_path, story_folder, datasets, monkeypatch)
    once = ["--set", "train.stop_after=1"]
    assert main(["--params", str(good), *once]) == 0
    path = tmp_path / "run" / "ckpt" / "step_0000001.pt"
    state = load_checkpoint(path)
    del state["data"]["text_hash"]
    save_checkpoint(state, path)
    trained = state["data"]

    local = ["--set", f"data.source={story_folder}", f"data.out_dir={tmp_path / 'local_data'}"]
    capsys.readouterr()
    assert main(["--params", str(good), "--resume", *local, *once]) == 2
    now = json.loads((tmp_path / "local_data" / "meta.json").read_text())
    err = capsys.readouterr().err
    fix = f"--set data.source=roneneldan/TinyStories data.out_dir={tmp_path / 'hub_data'}"
    assert err == (f"error: cannot resume {path}: it predates text hashes and records only the content hash "
                   f"of its data (content hash {trained['content_hash'][:12]}..., {trained['train_tokens']} "
                   f"train / {trained['val_tokens']} val tokens, from roneneldan/TinyStories), which differs "
                   f"from that of {tmp_path / 'local_data'} (content hash {now['content_hash'][:12]}..., "
                   f"{now['train_tokens']} train / {now['val_tokens']} val tokens, prepared from "
                   f"{story_folder}). The stories may be the same (from the hub once and from a folder now, "
                   f"or the other way round), which that hash cannot tell. Resume once from the source it "
                   f"was trained on ({fix}) until it writes a checkpoint: that one records the text hash, "
                   f"which is the same from either source\n")
    assert main(["--params", str(good), "--resume", *fix.split(), *once]) == 0
    assert main(["--params", str(good), "--resume", *local]) == 0
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4


def test_a_second_training_into_a_held_folder_is_refused_at_once(tmp_path, folded, capsys):
    """Two trainings into one out_dir once both passed the "already holds a run" check and wrote
    into each other's files. A session holds out_dir/.lock (with its pid); another is refused
    before it writes anything. Sessions one after another in one process (a sweep's in-process
    runner) each take and release it, also one that fails."""
    fcntl = pytest.importorskip("fcntl")
    good = write_params(tmp_path / "p.yaml", params(tmp_path, folded, steps=2, ckpt_every=1, eval_every=2))
    out = tmp_path / "run"
    out.mkdir()
    with open(out / ".lock", "w") as held:  # another training's
        held.write("4242\n")
        held.flush()
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(["--params", str(good)]) == 2
        assert capsys.readouterr().err == (f"error: another training (pid 4242) is writing to {out}; wait "
                                           f"for it or choose another out_dir\n")
        assert [p.name for p in out.iterdir()] == [".lock"]
    assert main(["--params", str(good), "--set", "train.stop_after=1"]) == 0
    assert (out / ".lock").read_text() == f"{os.getpid()}\n"
    assert main(["--params", str(good)]) == 2  # fails inside the session: the folder holds a run
    assert "pass --resume" in capsys.readouterr().err
    assert main(["--params", str(good), "--resume"]) == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


@pytest.mark.parametrize("platform", ["no locks on the file system", "no fcntl"])
def test_a_run_folder_without_locks_is_used_with_one_warning_where_locks_could_exist(tmp_path, caplog,
                                                                                    monkeypatch, platform):
    """Where the file system has no locks (flock: ENOLCK, some network mounts) a second training
    would not be stopped: the session says so once, and removes no temporaries (one may be another
    session's live write). Without fcntl (Windows) there are no locks to miss: nothing is said."""
    from oelm_core import files
    from oelm_core.train import Dist, hold_run_folder

    fcntl = pytest.importorskip("fcntl")
    if platform == "no fcntl":
        monkeypatch.setattr(files, "fcntl", None)
    else:
        def refuses(f, operation):
            raise OSError(errno.ENOLCK, "No locks available")

        monkeypatch.setattr(fcntl, "flock", refuses)
    out = tmp_path / "run"
    live = out / "ckpt" / ".step_0000004.pt.k1l2m3.tmp"
    live.parent.mkdir(parents=True)
    live.write_bytes(b"another session's write")
    with caplog.at_level("INFO", logger="oelm_core.train"):
        with hold_run_folder(out, Dist(0, 1, torch.device("cpu"), False)):
            entered = True
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert entered and live.exists() and "removed" not in caplog.text
    if platform == "no fcntl":
        assert warned == [] and not (out / ".lock").exists()
    else:
        assert warned == [f"the file system of {out} has no locks: a second training into it would not "
                          f"be stopped"]
        assert (out / ".lock").read_text() == ""


def test_a_session_removes_what_killed_writes_left(tmp_path, folded, caplog):
    """A write killed mid-way leaves its temporary (.step_*.pt.*.tmp: 0.5 GB at medium512); the
    next session, holding the folder, removes those of out_dir and out_dir/ckpt, nothing else."""
    values = params(tmp_path, folded, steps=4, ckpt_every=2, eval_every=2)
    run({**values, "train": {**values["train"], "stop_after": 2}})
    out = tmp_path / "run"
    left = [out / "ckpt" / ".step_0000004.pt.k1l2m3.tmp", out / ".best.pt.a1b2c3.tmp",
            out / ".metrics.jsonl.x9y8z7.tmp"]
    kept = [out / "notes.tmp", out / "ckpt" / ".keep", out / "ckpt" / "step_0000002.pt.tmp"]
    for p in left + kept:
        p.write_bytes(b"\0" * 500_000)
    with caplog.at_level("INFO", logger="oelm_core.train"):
        assert run(values, resume=True)["steps"] == 4
    assert [p for p in left if p.exists()] == [] and all(p.exists() for p in kept)
    assert "removed 3 file(s) left by writes that were killed (1.5 MB)" in caplog.text


def test_stray_files_in_ckpt_are_ignored_or_named(tmp_path, folded, capsys):
    """ckpt/ is the trainer's, but people put files there. A backup under another name once
    crashed every start (ValueError); it is left alone now. A step_N.pt without the training
    state (a copy of best.pt, weights saved by hand) once failed with KeyError 'sampler' or
    'run_config'; it is named now, with what to do."""
    good = write_params(tmp_path / "p.yaml", params(tmp_path, folded, steps=4, ckpt_every=2, eval_every=2,
                                                    keep_last=1))
    ckpt = tmp_path / "run" / "ckpt"
    ckpt.mkdir(parents=True)
    (ckpt / "step_0000021.bak.pt").write_bytes(b"a backup")
    assert main(["--params", str(good), "--set", "train.stop_after=2"]) == 0
    assert main(["--params", str(good), "--resume"]) == 0
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_0000004.pt", "step_0000021.bak.pt"]

    best = load_checkpoint(tmp_path / "run" / "best.pt")
    model = model_from_state(best)
    save_checkpoint({k: v for k, v in best.items() if k != "format_version"}, ckpt / "step_0000005.pt")
    save_checkpoint({"model": model.state_dict(), "model_config": dataclasses.asdict(model.cfg)},
                    ckpt / "step_0000006.pt")
    capsys.readouterr()
    for name in ("step_0000006.pt", "step_0000005.pt"):
        assert main(["--params", str(good), "--resume", "--set", "train.steps=8", "train.min_lr=3e-3"]) == 2
        assert capsys.readouterr().err == (f"error: {ckpt / name} holds weights only, not a training "
                                           f"checkpoint (best.pt?); remove it from {ckpt}\n")
        (ckpt / name).unlink()


@pytest.mark.parametrize("name", ["mps", "xla", "meta", "xpu:0"])
def test_devices_the_trainer_does_not_run_on_are_refused(name):
    with pytest.raises(ConfigError, match=rf"^train.device '{name}' is not supported: OELM Lab runs on "
                                          rf"the CPU or on CUDA GPUs; choose auto, cpu, cuda or cuda:N$"):
        resolve_device(name)


def test_an_out_dir_that_is_a_file_is_refused_before_the_data_is_prepared(tmp_path, story_folder, capsys):
    """It was a FileExistsError traceback, after the data had been prepared."""
    (tmp_path / "run").write_text("not a folder")
    good = write_params(tmp_path / "p.yaml", params(tmp_path, story_folder, variant="gpt_base", vocab=50257))
    assert main(["--params", str(good)]) == 2
    assert capsys.readouterr().err == (f"error: out_dir {tmp_path / 'run'} is a file, not a folder: set "
                                       f"out_dir to a folder\n")
    assert not (tmp_path / "data").exists()
    assert main(["--params", str(good), "--set", f"out_dir={tmp_path / 'run' / 'inner'}"]) == 2
    assert f"out_dir {tmp_path / 'run' / 'inner'} lies under the file {tmp_path / 'run'}" in capsys.readouterr().err
    (tmp_path / "data").write_text("not a folder either")
    assert main(["--params", str(good), "--set", f"out_dir={tmp_path / 'run2'}"]) == 2
    assert capsys.readouterr().err == (f"error: data.out_dir {tmp_path / 'data'} is a file, not a folder: "
                                       f"set data.out_dir to a folder\n")


def test_an_ended_run_says_what_lets_it_go_on(tmp_path, folded, caplog, monkeypatch):
    """Resuming a run that ended once said "raise train.steps (or train.early_stop_patience)",
    which --resume refuses for a cosine that reached min_lr. Now: a new out_dir for that one,
    more steps where the schedule allows them, the patience where the run stopped early; and
    each hint works."""
    def hint(values: dict) -> str:
        caplog.clear()
        with caplog.at_level("INFO", logger="oelm_core.train"):
            run(values, resume=True)
        return next(r.getMessage() for r in caplog.records if "already ended" in r.getMessage())

    def longer(values: dict, **train) -> dict:
        return {**values, "train": {**values["train"], **train}}

    cosine = params(tmp_path, folded, out="cosine", steps=4, ckpt_every=2, eval_every=2)
    run(cosine)
    message = hint(cosine)
    assert message.endswith("already ended (completed at step 4): nothing to train; its learning rate has "
                            "decayed to train.min_lr at train.steps (4) and more steps would raise it again, "
                            "which --resume refuses: to train longer, train from step 0 with a larger "
                            "train.steps and out_dir set to a new folder"), message
    with pytest.raises(ConfigError, match="changes the learning rate of step 5"):
        run(longer(cosine, steps=6), resume=True)

    constant = params(tmp_path, folded, out="constant", steps=4, ckpt_every=2, eval_every=2, min_lr=3e-3)
    run(constant)
    assert hint(constant).endswith("(completed at step 4): nothing to train; raise train.steps to go on")
    assert run(longer(constant, steps=6), resume=True)["steps"] == 6

    # Every evaluation worse than the one before: patience 1 stops at the second (step 4).
    monkeypatch.setattr(Trainer, "evaluate", lambda self: {"val_loss": float(self.step), "val_ppl": 1.0,
                                                           "val_bpb": 1.0})
    early = params(tmp_path, folded, out="early", steps=8, ckpt_every=2, eval_every=2, early_stop_patience=1)
    assert run(early)["status"] == "stopped_early"
    assert hint(early).endswith("(stopped_early at step 4): nothing to train; raise "
                                "train.early_stop_patience above 1 (0 turns early stopping off) to go on")
    assert run(longer(early, early_stop_patience=0), resume=True)["steps"] == 8


def test_cpu_training_keeps_large_blocks_in_the_heap(tmp_path, folded, monkeypatch):
    """A CPU training raises glibc's mmap and trim thresholds through mallopt (one run spent a
    third of its CPU time faulting in the pages of freed 103 MB blocks again); where the C
    library is not glibc, or has no mallopt, nothing is called and nothing fails."""
    calls = []

    def mallopt(param, value):
        calls.append((param, value))
        return 1

    class Libc:
        pass

    libc = Libc()
    libc.mallopt = mallopt
    monkeypatch.setattr(ctypes, "CDLL", lambda name: libc)
    monkeypatch.setattr(os, "confstr", lambda name: "glibc 2.36", raising=False)
    run(params(tmp_path, folded, steps=1, ckpt_every=1, eval_every=1))
    assert calls == [(-3, 2**30), (-1, 2**30)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD: 1 GiB

    calls.clear()
    del libc.mallopt  # a C library without it
    assert keep_large_blocks_in_heap() is False

    def no_library(name):
        raise OSError("no C library to open")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    assert keep_large_blocks_in_heap() is False
    for confstr in (lambda name: "musl", lambda name: None):  # musl, macOS: not glibc
        monkeypatch.setattr(os, "confstr", confstr)
        assert keep_large_blocks_in_heap() is False
    monkeypatch.delattr(os, "confstr")  # Windows
    assert keep_large_blocks_in_heap() is False
    assert calls == []


def test_an_unreadable_only_checkpoint_says_that_deleting_it_restarts_the_run(tmp_path, folded, capsys):
    """The fallback once read "to resume from the checkpoint before it, delete ..." where there
    was none before it: deleting the only one starts the run again from step 0."""
    good = write_params(tmp_path / "p.yaml", params(tmp_path, folded, steps=4, ckpt_every=2, eval_every=2))
    assert main(["--params", str(good), "--set", "train.stop_after=2"]) == 0
    only = tmp_path / "run" / "ckpt" / "step_0000002.pt"
    only.write_bytes(only.read_bytes()[:-100])
    capsys.readouterr()
    assert main(["--params", str(good), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.endswith(f"failed finding central directory.); the file is truncated or not an OELM "
                        f"checkpoint: use another checkpoint of the run folder (best.pt or an earlier step) "
                        f"or train again. It is the run's only checkpoint: deleting {only} makes --resume "
                        f"start the run again from step 0\n"), err


def test_resume_at_the_unfreeze_step(tmp_path, folded):
    full = params(tmp_path, folded, out="full", steps=8, ckpt_every=1, unfreeze_schedule={5: "all"})
    run(full)
    split = params(tmp_path, folded, out="split", steps=8, ckpt_every=1, unfreeze_schedule={5: "all"})
    run({**split, "train": {**split["train"], "stop_after": 5}})
    run(split, resume=True)
    a, b = losses(full["out_dir"]), losses(split["out_dir"])
    assert a.keys() == b.keys() and all(abs(a[s] - b[s]) <= 1e-6 for s in a)


def test_a_pause_keeps_the_count_of_evaluations_without_improvement(tmp_path, folded, monkeypatch):
    import math

    from oelm_core.train import Trainer

    scripted = {3: 3.0, 6: 3.5, 9: 3.6, 12: 3.7, 15: 3.8}   # best at 3, then only worse

    def evaluate(self):
        v = scripted[self.step]
        return {"val_loss": v, "val_ppl": math.exp(v), "val_bpb": v}

    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    common = dict(steps=15, eval_every=3, ckpt_every=3, early_stop_patience=2)
    straight = run(params(tmp_path, folded, out="full", **common))
    split = params(tmp_path, folded, out="split", **common)
    run({**split, "train": {**split["train"], "stop_after": 7}})   # paused with one bad evaluation
    resumed = run(split, resume=True)
    assert straight["status"] == resumed["status"] == "stopped_early"
    assert straight["steps"] == resumed["steps"] == 9


def test_every_session_ends_on_a_checkpoint(tmp_path, folded):
    values = params(tmp_path, folded, steps=7, ckpt_every=4, eval_every=4)
    run({**values, "train": {**values["train"], "stop_after": 5}})
    run(values, resume=True)
    names = sorted(p.name for p in (Path(values["out_dir"]) / "ckpt").iterdir())
    assert names == ["step_0000004.pt", "step_0000005.pt", "step_0000007.pt"]


def test_one_process_may_not_change_the_global_batch_on_resume(tmp_path, folded, capsys):
    values = params(tmp_path, folded, steps=4, ckpt_every=2)
    good = write_params(tmp_path / "p.yaml", values)
    assert main(["--params", str(good), "--set", "train.stop_after=2"]) == 0
    capsys.readouterr()
    assert main(["--params", str(good), "--resume", "--set", "train.grad_accum=2"]) == 2
    assert "world size x train.grad_accum = 1" in capsys.readouterr().err


def test_tokens_seen_count_every_micro_batch(tmp_path, folded):
    summary = run(params(tmp_path, folded, steps=2, ckpt_every=2, eval_every=2, grad_accum=2))
    assert summary["global_batch_tokens"] == 2 * 4 * 32 and summary["tokens_seen"] == 2 * 2 * 4 * 32


def test_token_ids_damaged_in_place_are_refused_before_the_first_step(tmp_path, folded, capsys):
    """Ids past the vocabulary, the file's size unchanged: once a bare IndexError from the model
    at the first step; now one line naming the file, the id and the rebuild."""
    values = params(tmp_path, folded)
    run(values)  # prepares and trains: the files are good
    train_bin = tmp_path / "data" / "train.bin"
    tokens = np.fromfile(train_bin, dtype=np.uint16)
    tokens[123] = FOLDED_VOCAB + 44  # a GPT-2 id, but past this data's 256-token vocabulary
    tokens.tofile(train_bin)
    values["out_dir"] = str(tmp_path / "second")
    assert main(["--params", str(write_params(tmp_path / "p.yaml", values))]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {train_bin} holds 1 token id(s) past the 256-token vocabulary it was "
                          f"prepared with (ids 0..255), the largest 300, the first at position 123: the file was "
                          f"damaged or written by something else; rebuild with `python -m oelm_core.data")
    assert f"--out-dir {tmp_path / 'data'} --force`" in err and err.count("\n") == 1


def test_a_warmup_longer_than_the_run_is_named_with_what_it_does(tmp_path, folded, caplog):
    """train.steps=10 with train.warmup_steps=50 ran without a word, its learning rate never
    reaching train.lr. Warned, not refused: a short try of a long run's parameter file
    (--set train.steps=20 on a 2000-step warm-up) is a fair thing to do."""
    values = params(tmp_path, folded, steps=10, warmup_steps=50, stop_after=2)
    with caplog.at_level("INFO", logger="oelm_core.train"):
        run(values)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == ["train.warmup_steps=50 is longer than the run (train.steps=10): the learning rate "
                      "rises to 0.0006 at the last step and never reaches train.lr=0.003, nor decays to "
                      "train.min_lr; set train.warmup_steps below train.steps (e.g. 1, a tenth of it) to train "
                      "at train.lr"], warned
    lrs = [json.loads(line)["lr"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lrs == pytest.approx([0.003 / 50, 0.003 * 2 / 50])
    caplog.clear()
    with caplog.at_level("INFO", logger="oelm_core.train"):
        run(params(tmp_path, folded, out="other", steps=10, warmup_steps=10, stop_after=1))
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_a_context_far_beyond_the_preset_is_costed_and_refused_before_anything_runs(tmp_path, story_folder,
                                                                                     monkeypatch, capsys, caplog):
    """model.block_size=100000 on the smoke preset sat at step 0 for minutes using gigabytes. The
    step's memory (accounting.step_memory) is said before starting, and a step that cannot fit
    the machine is refused, before the data is prepared."""
    import oelm_core.train as T
    from oelm_core.accounting import flops_per_token, step_memory
    from oelm_core.config import model_config

    values = params(tmp_path, story_folder, variant="gpt_base", vocab=50257, batch_size=16)
    values["model"] = {"block_size": 100_000}
    cfg = model_config("smoke", "gpt_base", block_size=100_000)
    need = step_memory(cfg, 16)
    assert 15 * 2**30 < need["total"] < 30 * 2**30  # 1.6M tokens a micro-step
    tflop = flops_per_token(cfg)["total"] * 16 * 100_000 / 1e12
    assert tflop > 100  # hours on a CPU
    path = write_params(tmp_path / "p.yaml", values)
    monkeypatch.setattr(T, "device_memory", lambda device: (8 * 2**30, "the RAM available on this machine"))
    assert main(["--params", str(path)]) == 2
    err = capsys.readouterr().err
    cost = (f"one training step of this run needs about {need['total'] / 2**30:.1f} GiB (weights, gradients "
            f"and AdamW state {need['state'] / 2**20:.1f} MiB, activations of 16 x 100000 tokens "
            f"{need['activations'] / 2**30:.1f} GiB) and {tflop:.1f} TFLOP a step")
    assert err == (f"error: {cost}, more than the RAM available on this machine (8.0 GiB): lower "
                   f"model.block_size (100000; the smoke preset's is 64) or train.batch_size (16; "
                   f"train.grad_accum keeps the tokens a step with less memory)\n"), err
    assert not (tmp_path / "data").exists() and not (tmp_path / "run").exists()

    # Close to what there is: a warning that names both, and the run goes on.
    monkeypatch.setattr(T, "device_memory", lambda device: (int(need["total"] * 1.1), "the RAM of a test"))
    monkeypatch.setattr(T, "Trainer", lambda *a: pytest.fail("stop here: the warning came before"))
    with caplog.at_level("INFO", logger="oelm_core.train"), pytest.raises(pytest.fail.Exception):
        run(values)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warned == [f"{cost}: 91% of the RAM of a test ({need['total'] * 1.1 / 2**30:.1f} GiB); it may run "
                      f"out of memory: lower model.block_size or train.batch_size (train.grad_accum keeps the "
                      f"tokens a step with less memory)"]

    # The machine's own figure: a step no machine has the memory for.
    monkeypatch.undo()
    values["model"] = {"block_size": 10_000_000}
    with pytest.raises(ConfigError, match=r"^one training step of this run needs about \d+\.\d TiB .*, more than "
                                          r"the RAM available on this machine \(\d+\.\d GiB\): lower model\.block_size"):
        run(values)


def test_every_run_logs_what_its_step_costs(tmp_path, folded, caplog):
    from oelm_core.accounting import step_memory
    from oelm_core.config import model_config

    with caplog.at_level("INFO", logger="oelm_core.train"):
        run(params(tmp_path, folded, steps=1, ckpt_every=1, eval_every=1))
    need = step_memory(model_config("smoke", "oelm_freeze", block_size=32, vocab_size=FOLDED_VOCAB), 4)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("one training step"))
    assert line.startswith(f"one training step of this run needs about {need['total'] / 2**20:.1f} MiB "
                           f"(weights, gradients and AdamW state {need['state'] / 2**20:.1f} MiB, activations "
                           f"of 4 x 32 tokens {need['activations'] / 2**20:.1f} MiB) and "), line
    assert " MFLOP a step; the RAM available on this machine: " in line and line.endswith(" GiB"), line
