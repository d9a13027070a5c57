"""Processes, devices and data parallelism (oelm_core.distributed): DDP on gloo ranks equals one
process, DDP's settings, the exchanges that step aside where they cannot run, the NVLink
exchange and the captured DDP step on two GPUs, device names refused with what to choose."""

import dataclasses
import json
import statistics
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from train_helpers import REPO, losses, metric_rows, outputs, params, run, torchrun_nodes, torchrun_train, write_params

from oelm_core import fast
from oelm_core.accounting import flops_per_token
from oelm_core.config import ConfigError, TrainConfig, run_config_from_dict
from oelm_core.distributed import resolve_device
from oelm_core.model import build_model
from oelm_core.step import configure_optimizer
from oelm_core.train import main

pytestmark = pytest.mark.usefixtures("no_data_override")


PEAK = 1e9  # FLOP/s per device, given to the trainer through OELM_PEAK_FLOPS (the CPU has no table entry)


def assert_mfu(values: dict, world_size: int, unfreeze_at: int) -> None:
    """Every logged MFU is flops_per_token * tokens_per_s / (PEAK * world_size) from the row's
    own tokens/s (global: all ranks' tokens), with the accounting's FLOPs of the model as it was
    then (Q/K frozen until the step ``unfreeze_at``), and the summary's is their median."""
    cfg = run_config_from_dict(values).model_config()
    fpt = {
        True: flops_per_token(cfg)["total"],
        False: flops_per_token(dataclasses.replace(cfg, freeze_qk="none"))["total"],
    }
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
    unfreeze mid-run checks that DDP is re-wrapped around the new parameters. Both runs are given
    a peak FLOP figure: their MFU is per device (``assert_mfu``)."""
    common = dict(steps=6, unfreeze_schedule={3: "all"}, eval_every=3, ckpt_every=3, batch_size=batch)
    single = params(tmp_path, folded, out="single", grad_accum=2 * accum, **common)
    monkeypatch.setenv("OELM_PEAK_FLOPS", str(PEAK))
    run(single)
    assert_mfu(single, world_size=1, unfreeze_at=3)
    ddp = params(tmp_path, folded, out="ddp", grad_accum=accum, **common)
    proc = torchrun_train(tmp_path, ddp, OMP_NUM_THREADS="1", OELM_PEAK_FLOPS=str(PEAK))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_mfu(ddp, world_size=2, unfreeze_at=3)
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


def test_two_nodes_match_single_process(tmp_path, folded):
    """A multi-node job, as two nodes of one gloo process each on this host (two torchrun agents
    that meet by c10d rendezvous; both processes have LOCAL_RANK 0) == one process with the same
    global batch (grad_accum 2). Both nodes see one run folder, as on a shared file system: only
    global rank 0 writes there, so it holds what the single process's holds, one metrics row a
    step, and the summary counts both nodes."""
    common = dict(steps=4, eval_every=2, ckpt_every=2, batch_size=4)
    single = params(tmp_path, folded, out="single", grad_accum=2, **common)
    run(single)
    nodes = params(tmp_path, folded, out="nodes", grad_accum=1, **common)
    procs = torchrun_nodes(tmp_path, nodes, OMP_NUM_THREADS="1")
    for i, proc in enumerate(procs):
        assert proc.returncode == 0, f"node {i} (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    # The same tolerance as test_ddp_matches_single_process, for the same reason: float32 on the
    # CPU, where only the order of the gradient sums differs (two ranks' halves all-reduced, one
    # process's accumulated); a wrong exchange moves the loss by far more within a step or two.
    a, b = metric_rows(single["out_dir"]), metric_rows(nodes["out_dir"])
    assert a.keys() == b.keys() == set(range(1, 5))  # metric_rows would hide a row written twice:
    losses(nodes["out_dir"])  # losses() refuses duplicate steps
    for step in a:
        assert abs(a[step]["train_loss"] - b[step]["train_loss"]) < 1e-5, (step, a[step], b[step])
    for step in (2, 4):
        assert abs(a[step]["val_loss"] - b[step]["val_loss"]) < 1e-5, (step, a[step], b[step])
    assert outputs(Path(single["out_dir"])).keys() == outputs(Path(nodes["out_dir"])).keys()
    summary = json.loads((Path(nodes["out_dir"]) / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["gradients_by"] == "ddp"
    assert (
        summary["global_batch_tokens"]
        == json.loads((Path(single["out_dir"]) / "summary.json").read_text())["global_batch_tokens"]
    )
    # Rank 0 alone prints the summary; the other node's worker prints nothing on stdout.
    assert sorted('"world_size": 2' in proc.stdout for proc in procs) == [False, True]


def test_ddp_on_one_rank(tmp_path):
    """DDP on one rank leaves no hook on the fused loss. DDP gets train.ddp_bucket_mb as its bucket
    size, does not sync buffers before each forward, and is built without a deprecation warning on
    the installed torch. The NVLink exchange (grad_exchange auto) steps aside on the CPU; asked for
    by name (peer), it says why not."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    cpu = torch.device("cpu")
    try:
        tc = TrainConfig(ddp_bucket_mb=12.5)
        model = fast.apply(build_model("tiny", "gpt_base"), tc)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            step = fast.make_step(model, configure_optimizer(model, tc, cpu), tc, cpu, ddp=True)
        assert step.exchange is None and model.output_loss.grad_hook is None and step.gradients_by == "ddp"
        assert step.module.bucket_bytes_cap == 12.5 * 2**20
        assert step.module.broadcast_buffers is False
        tc = TrainConfig(grad_exchange="peer")
        with pytest.raises(
            ConfigError,
            match=r"grad_exchange: peer needs CUDA GPUs of one host with "
            r"peer access \(NVLink\) under NCCL \(here on cpu\)",
        ):
            fast.make_step(model, configure_optimizer(model, tc, cpu), tc, cpu, ddp=True)
        fresh = fast.apply(build_model("tiny", "gpt_base"), tc)
        assert [type(m) for m in model.modules()] == [type(m) for m in fresh.modules()]
    finally:
        dist.destroy_process_group()


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
@pytest.mark.parametrize(
    "exchange, one_rank_fails, batch, accum, compile, unfreeze",
    [
        ("ddp", False, 4, 1, False, {}),
        # the tied weight's rows; the sends inside the compiled backward; a new exchange for the
        # parameters that unfreezing adds at step 5 (captured after 11 more eager steps)
        ("peer", False, 4, 1, True, {5: "all"}),
        ("peer", True, 8, 2, False, {}),  # the tied weight dense; accumulated micro-steps
        ("peer", False, 8, 2, False, {}),  # the same, captured: no side-stream work to wait for
    ],
)
def test_ddp_on_two_gpus_captures_its_step_and_matches_one_process(
    tmp_path, folded, exchange, one_rank_fails, batch, accum, compile, unfreeze
):
    """2 NCCL ranks x grad_accum A == 1 GPU x grad_accum 2A (float32), both with the whole step in
    a CUDA graph: on two ranks the gradient exchange (DDP's all-reduce, or the NVLink copies) is
    captured after 11 eager steps, and the later steps replay it. If one rank cannot capture,
    neither replays (no hang): both go on eagerly, with the same losses."""
    common = dict(
        steps=20,
        eval_every=10,
        ckpt_every=10,
        device="cuda",
        dtype="float32",
        batch_size=batch,
        compile=compile,
        unfreeze_schedule=unfreeze,
    )
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


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 3, reason="needs three or more GPUs")
def test_the_nvlink_exchange_on_every_gpu_of_the_host_matches_one_process(tmp_path, folded):
    """grad_exchange: peer on all of the host's GPUs (N >= 3: each rank copies to every other and
    sums in rank order) == 1 GPU x grad_accum N, float32, the exchange captured after 11 eager
    steps; auto on as many GPUs keeps DDP (the copies are measured on two only)."""
    n = torch.cuda.device_count()
    common = dict(steps=20, eval_every=10, ckpt_every=10, device="cuda", dtype="float32", batch_size=2)
    single = params(tmp_path, folded, out="single", grad_accum=n, **common)
    run(single)
    for exchange, by in (("peer", "nvlink copies"), ("auto", "ddp")):
        ddp = params(tmp_path, folded, out=exchange, grad_exchange=exchange, **common)
        proc = torchrun_train(tmp_path, ddp, nproc=n, NCCL_NVLS_ENABLE="0", PYTHONPATH=str(REPO))
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert json.loads((Path(ddp["out_dir"]) / "summary.json").read_text())["gradients_by"] == by
        a, b = losses(single["out_dir"]), losses(ddp["out_dir"])
        assert a.keys() == b.keys() == set(range(1, 21))
        for step in a:  # the tolerance of the two-GPU test above, and why
            assert abs(a[step] - b[step]) <= 5e-5 * abs(a[step]), (exchange, step, a[step], b[step])


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
    with pytest.raises(
        ConfigError,
        match=r"^train.device is 'cuda:2', but this machine has 2 CUDA GPU\(s\), "
        r"cuda:0..cuda:1: choose one of them, or auto$",
    ):
        resolve_device("cuda:2")
    with pytest.raises(
        ConfigError,
        match=r"^train.device 'cuda' puts local rank 2 on cuda:2, but this machine "
        r"has 2 CUDA GPU\(s\), .*: start at most 2 processes per node$",
    ):
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


@pytest.mark.parametrize("name", ["mps", "xla", "meta", "xpu:0"])
def test_devices_the_trainer_does_not_run_on_are_refused(name):
    with pytest.raises(
        ConfigError,
        match=rf"^train.device '{name}' is not supported: OELM Lab runs on "
        rf"the CPU or on CUDA GPUs; choose auto, cpu, cuda or cuda:N$",
    ):
        resolve_device(name)


@pytest.mark.slow
def test_a_rank_that_stops_answering_is_named_after_the_timeout(tmp_path, folded):
    """A DDP rank stopped with SIGSTOP hung the job without a word for gloo's 30 minutes. With
    train.ddp_timeout_s: 4 the other rank stops waiting after 4 s and names the silent rank, its
    host and pid, and the setting, then ends (torchrun stops the rest)."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    from train_helpers import free_port

    values = params(
        tmp_path, folded, steps=100_000, eval_every=100_000, ckpt_every=100_000, log_every=1, ddp_timeout_s=4.0
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "-m",
        "oelm_core.train",
        "--params",
        str(write_params(tmp_path / "ddp.yaml", values)),
    ]
    err = open(tmp_path / "err", "w")
    agent = subprocess.Popen(
        cmd,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=err,
        start_new_session=True,
    )
    rank_1 = None
    try:
        deadline = time.monotonic() + 180
        metrics = Path(values["out_dir"]) / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 3):
            assert agent.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()[-3000:]
            time.sleep(0.2)
        workers = subprocess.run(["pgrep", "-P", str(agent.pid)], capture_output=True, text=True).stdout.split()
        rank_1 = next(int(p) for p in workers if b"RANK=1\0" in Path(f"/proc/{p}/environ").read_bytes())
        os.kill(rank_1, signal.SIGSTOP)
        stopped = time.monotonic()
        while "did not answer" not in (tmp_path / "err").read_text() and time.monotonic() < stopped + 120:
            time.sleep(0.2)
        took = time.monotonic() - stopped
        os.kill(rank_1, signal.SIGKILL)  # torchrun would wait 30 s for the stopped one to take SIGTERM
        agent.wait(timeout=120)
    finally:
        if rank_1 is not None:
            try:
                os.kill(rank_1, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
            agent.wait()
        err.close()
    text = (tmp_path / "err").read_text()
    assert agent.returncode != 0
    assert (
        f"error: rank 1 (host {socket.gethostname()}, pid {rank_1}) did not answer for 4 s (train.ddp_timeout_s), "
        f"and rank 0 stopped waiting: the process was stopped (SIGSTOP, a debugger), hangs, or its node is "
        f"gone; the run resumes from its latest checkpoint with --resume."
    ) in text, text[-3000:]
    assert 4 < took < 60, took


@pytest.mark.parametrize("value", [0, -5, float("nan"), float("inf")])
def test_a_ddp_timeout_that_is_no_time_is_refused(tmp_path, value):
    values = params(tmp_path, tmp_path, ddp_timeout_s=value)
    with pytest.raises(ConfigError, match=rf"^train\.ddp_timeout_s must be positive, got {float(value)}$"):
        run_config_from_dict(values).validate()
    assert TrainConfig().ddp_timeout_s == 600.0  # 10 minutes, NCCL's own default, a third of gloo's
