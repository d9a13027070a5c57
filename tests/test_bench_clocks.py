"""benchmarks/common.py's CardClocks: the card's SM clock and power while a benchmark times it,
read from nvidia-smi. The parsing and the summary on nvidia-smi's own output format; the sampler
itself on a GPU (skipped without one), where it must see the clock rise under a matmul loop."""

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from common import CardClocks, clocks_text, parse_smi_sample, summarise_clocks  # noqa: E402

# Lines as nvidia-smi 580 wrote them on an H200 during a training step at 64 x 512 and at idle.
CAPPED = "1680, 696.89, 700.00, 100, 0x0000000000000004"
IDLE = "345, 80.42, 700.00, 0, 0x0000000000000001"


def test_a_sample_line_parses_to_numbers():
    assert parse_smi_sample(CAPPED) == {
        "sm_clock_mhz": 1680.0,
        "power_w": 696.89,
        "power_limit_w": 700.0,
        "utilization": 100.0,
        "throttle": 4,
    }
    assert parse_smi_sample("[N/A], 80.1, 700.00, 0, 0x0") is None  # a card that does not report a field
    assert parse_smi_sample("No devices were found") is None


def test_the_summary_is_over_the_busy_samples():
    busy = [parse_smi_sample(f"{mhz}, 695.0, 700.00, 100, 0x0000000000000004") for mhz in (1515, 1680, 1800)]
    free = parse_smi_sample("1980, 450.0, 700.00, 95, 0x0000000000000000")
    s = summarise_clocks([parse_smi_sample(IDLE), *busy, free])  # the idle sample is start-up: left out
    assert s == {
        "sm_clock_mhz": 1740.0,  # the median of 1515, 1680, 1800, 1980
        "sm_clock_range_mhz": [1515.0, 1980.0],
        "power_w": 695.0,
        "power_limit_w": 700.0,
        "power_capped": 0.75,
        "samples": 4,
    }
    assert clocks_text(s) == "1,740 MHz 695 W*"
    assert summarise_clocks([parse_smi_sample(IDLE)])["sm_clock_mhz"] == 345.0  # no busy one: all of them
    assert summarise_clocks([]) is None and clocks_text(None) == "-"


def test_without_a_gpu_there_is_nothing_to_sample():
    with CardClocks("cpu") as clocks:
        torch.ones(8).sum()
    assert clocks.summary() is None


@pytest.mark.gpu
def test_the_sampler_sees_a_busy_card():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    with CardClocks("cuda", every_ms=100) as clocks:
        if clocks.proc is None:
            pytest.skip("nvidia-smi is not on the PATH")
        start = time.monotonic()
        # GEMMs until nvidia-smi (which takes a while to start) has sampled them a few times
        while len(clocks.samples) < 8 and time.monotonic() - start < 30:
            for _ in range(50):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
    s = clocks.summary()
    assert s is not None, "nvidia-smi ran but wrote no sample line in 30 s"
    assert s["samples"] >= 1 and 300 <= s["sm_clock_mhz"] <= 3500 and 0 < s["power_w"] <= 2 * s["power_limit_w"]
