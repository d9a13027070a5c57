"""benchmarks/bench_cli.py on the CPU at the smoke shape: the training CLI run as a subprocess beside
bench_train.py's nanoGPT-style reference, the figures it reads from the run's metrics.jsonl, the
ratios it writes and the table it prints. (The numbers that matter come from a GPU; this checks
that the script runs what it says.)"""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks" / "bench_cli.py"
STEPS, LOG_EVERY = 8, 2  # log rows at steps 1, 2, 4, 6, 8: two warm-up windows, three timed


# The reference's shortest timing (one step a block, two blocks, no warm-up); None: its defaults.
QUICK_REFERENCE = ("--ref-steps", "1", "--ref-blocks", "2", "--ref-warmup", "0")


def _run(
    stories: Path, tmp_path: Path, *args: str, reference=QUICK_REFERENCE
) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "cli.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "OELM_DATA": str(stories)}
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--preset",
            "smoke",
            "--steps",
            str(STEPS),
            *(reference or ()),
            *args,
            "--set",
            f"train.log_every={LOG_EVERY}",
            "train.eval_batches=1",
            f"data.out_dir={tmp_path / 'data'}",
            "--json",
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text())


def _check_cli_run(run: dict, batch: int, compiled: bool) -> None:
    """The figure is the median of the windows after the two warm-up ones, read from the run's
    metrics.jsonl, of a CLI command that set what the benchmark must and no more."""
    assert "error" not in run and run["status"] == "paused" and run["fell_back"] == []
    assert run["window_steps"] == [1, 2, 4, 6, 8] and run["timed_windows"] == 3
    assert all(w > 0 for w in run["windows"])
    assert run["tokens_per_s"] == statistics.median(run["windows"][2:])
    assert run["summary_tokens_per_s"] == pytest.approx(statistics.median(run["windows"]))
    command = run["command"].split()
    assert command[:4] == ["-m", "oelm_core.train", "--params", str(REPO / "parameters/medium512/gpt_base.yaml")]
    # the run keeps its parameter file's length (train.compile's "auto" reads it), paused after STEPS
    assert f"train.batch_size={batch}" in command and f"train.stop_after={STEPS}" in command
    assert not any(c.startswith("train.steps=") for c in command)
    assert ("train.compile=true" in command) == compiled
    assert run["compiled"] is compiled  # on the CPU "auto" stays eager; true compiles


def test_bench_cli_times_the_cli_beside_the_reference(story_folder, tmp_path):
    proc, written = _run(story_folder, tmp_path, "--batch", "2", "--skip-compile", reference=None)
    meta = written["meta"]
    # By default the reference is timed as the CLI is: blocks of train.log_every steps, as many as
    # the CLI's timed windows, after one block of warm-up.
    assert meta["reference_timing"] == {"steps": LOG_EVERY, "blocks": 3, "warmup": LOG_EVERY}
    assert meta["card"].startswith("CPU") and meta["commit"] and meta["torch"] and meta["date"]
    assert (meta["preset"], meta["block_size"], meta["timed_windows"]) == ("smoke", 64, 3)
    assert meta["cli_train"]["compile"] == "auto"  # the CLI's default, shown as such
    assert (meta["vocab_size"], meta["reference_vocab_rows"]) == (50257, 50304)  # padded as nanoGPT pads it
    [row] = written["rows"]
    assert (row["batch"], row["tokens_per_step"]) == (2, 128)
    assert row["reference_eager"] > 0 and row["cli_defaults"] > 0
    assert row["defaults_over_ref_eager"] == row["cli_defaults"] / row["reference_eager"]
    # --skip-compile: neither compiled figure, nor a ratio made from one.
    for key in ("reference_compiled", "cli_compile", "defaults_over_ref_compiled", "compile_over_ref_compiled"):
        assert row[key] is None, key
    assert list(row["runs"]) == ["reference_eager", "cli_defaults"]
    assert row["runs"]["reference_eager"]["tokens_per_s"] == row["reference_eager"]
    assert row["runs"]["reference_eager"]["options"]["compile"] == "0"
    _check_cli_run(row["runs"]["cli_defaults"], 2, compiled=False)
    assert "log" not in row["runs"]["cli_defaults"]  # without --runs-dir the run folders and logs go
    # No card to sample on a CPU: each run says so, and the clock table is left out.
    assert all(run["card_clocks"] is None for run in row["runs"].values())
    assert "the card while busy" not in proc.stdout
    # The table comes last, one line a batch.
    lines = proc.stdout.splitlines()
    assert lines[-2].split()[:4] == ["batch", "x", "64", "reference"]
    assert lines[-1].split() == [
        "2",
        f"{row['reference_eager']:,.0f}",
        "-",
        f"{row['cli_defaults']:,.0f}",
        "-",
        "-",
        "-",
    ]


@pytest.mark.slow
def test_bench_cli_alternates_eager_and_compiled_runs(story_folder, tmp_path):
    proc, written = _run(story_folder, tmp_path, "--batch", "1", "--runs-dir", str(tmp_path / "runs"))
    # Each run prints a line as it ends: reference and CLI alternate.
    order = [json.loads(line)["run"] for line in proc.stdout.splitlines() if line.startswith('{"batch"')]
    assert order == ["reference_eager", "cli_defaults", "reference_compiled", "cli_compile"]
    [row] = written["rows"]
    for key in ("reference_eager", "reference_compiled", "cli_defaults", "cli_compile"):
        assert row[key] > 0 and row[key] == row["runs"][key]["tokens_per_s"], key
    assert row["defaults_over_ref_compiled"] == row["cli_defaults"] / row["reference_compiled"]
    assert row["compile_over_ref_compiled"] == row["cli_compile"] / row["reference_compiled"]
    assert row["compile_over_ref_eager"] == row["cli_compile"] / row["reference_eager"]
    assert row["runs"]["reference_compiled"]["options"]["compile"] == "1"
    _check_cli_run(row["runs"]["cli_defaults"], 1, compiled=False)
    _check_cli_run(row["runs"]["cli_compile"], 1, compiled=True)
    for name in ("cli_defaults", "cli_compile"):  # --runs-dir keeps each run's folder and log
        log = Path(row["runs"][name]["log"])
        assert log.parent.parent == tmp_path / "runs" and (log.with_suffix("") / "metrics.jsonl").is_file()
    last = proc.stdout.splitlines()[-1].split()
    assert last[-2:] == [f"{row['defaults_over_ref_compiled']:.3f}", f"{row['compile_over_ref_compiled']:.3f}"]
