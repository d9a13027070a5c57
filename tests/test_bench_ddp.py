"""benchmarks/bench_ddp.py under torchrun on two gloo CPU ranks at the smoke preset: the one-GPU
baseline, DDP with a setting of its own beside plain DDP, the NVLink row that says why it cannot
run, and what a scaling table needs in --json and --markdown. (The numbers that matter come from
GPUs; this checks that the script runs what it says.)"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from train_helpers import free_port

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_ddp_writes_the_rows_of_a_scaling_table(tmp_path):
    out = tmp_path / "ddp.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            str(REPO / "benchmarks" / "bench_ddp.py"),
            "--device",
            "cpu",
            "--preset",
            "smoke",
            "--batch",
            "2",
            "--steps",
            "2",
            "--blocks",
            "2",
            "--warmup",
            "1",
            "--exchange",
            "peer",
            "ddp",
            "ddp:ddp_bucket_mb=1",
            "--markdown",
            "--json",
            str(out),
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["meta"]["world"] == 2 and report["meta"]["card"].startswith("CPU")
    assert report["meta"]["commit"] and report["meta"]["preset"] == "smoke"
    one, ddp, tuned = report["results"]
    assert [r["exchange"] for r in (one, ddp, tuned)] == ["one GPU", "ddp", "ddp:ddp_bucket_mb=1"]
    assert (one["world"], ddp["world"], tuned["reducer"]) == (1, 2, "ddp")
    for r in (one, ddp, tuned):
        assert r["batch_per_gpu"] == 2 and r["block_size"] == 64 and r["compile"] is False
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_s_per_gpu"] * r["world"])
        assert r["efficiency"] == pytest.approx(r["tokens_per_s_per_gpu"] / one["tokens_per_s"])
    assert one["efficiency"] == 1.0
    [peer] = report["unavailable"]
    assert peer["exchange"] == "peer" and "(here on cpu)" in peer["unavailable"]
    assert f"peer       unavailable: {peer['unavailable']}" in proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| CPU")]
    assert [row.split(" | ")[1:5] for row in rows] == [
        ["1", "2 x 64", "1", "one GPU"],
        ["2", "2 x 64", "1", "ddp"],
        ["2", "2 x 64", "1", "ddp:ddp_bucket_mb=1"],
    ]
