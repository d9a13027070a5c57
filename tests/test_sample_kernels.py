"""The Triton sampler (oelm_core.fast.sample_kernels) draws the tokens of ``generate.sample_from_noise``,
and the fast decoder's ``sample`` picks it where it applies.

On a GPU the checks run in this process; without one, under Triton's CPU interpreter in a
subprocess (as tests/test_decode_kernels.py; `make test` installs a Triton for it beside a CPU
torch). Skipped without Triton, and with a Triton whose interpreter cannot run these kernels
(conftest.triton_interpreter_unusable).
"""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
# CUDA's kernels here; on the CPU the interpreter runs them
pytestmark = [pytest.mark.gpu, pytest.mark.interpreter]

from conftest import run_in_triton_interpreter, run_interpreter_checks  # noqa: E402

from oelm_core.fast import sample_kernels  # noqa: E402
from oelm_core.fast.decode import sample  # noqa: E402
from oelm_core.generate import SamplingConfig, gumbel_noise, sample_from_noise, seed_tensor  # noqa: E402

CUDA = torch.cuda.is_available()

# (vocab, temperature, top_k, top_p): no cut; top-k small and large (20,000 / 2,048-column chunks
# x 1,024 candidates would pass one sort's 8,192: the chunks widen); top-k then top-p; a hot
# temperature, where the noise decides; top-k 1. (Small vocabularies: the interpreter is slow.)
CONFIGS = [
    (3000, 0.8, 0, 1.0),
    (3000, 1.0, 50, 1.0),
    (20000, 0.7, 1000, 1.0),
    (3000, 0.7, 40, 0.9),
    (3000, 5.0, 0, 1.0),
    (3000, 1.0, 1, 1.0),
]


def check_draws_equal_torch(device: str) -> None:
    g = torch.Generator().manual_seed(0)
    for vocab, temperature, top_k, top_p in CONFIGS:
        cfg = SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p)
        assert sample_kernels.supports(torch.empty(1, vocab, device=device), top_k, top_p)
        for dtype in (torch.float32, torch.bfloat16):
            logits = (torch.randn(3, vocab, generator=g) * 3).to(device, dtype)
            for seed, step in [(0, 0), (7, 1), (2**40 + 5, 123)]:
                seed_t, step_t = seed_tensor(seed, device), torch.tensor([step], device=device)
                noise = gumbel_noise(seed_t, step_t, 1, vocab)[0]
                got = sample(logits, cfg, seed_t, step_t)
                assert got.shape == (3,) and got.dtype == torch.int64
                expect = sample_from_noise(logits, cfg, noise)
                assert torch.equal(got, expect), (vocab, temperature, top_k, top_p, dtype, seed, got, expect)
    # One row, shaped as the decoder's logits (1, vocab), and a batch of (2, 2, vocab).
    logits = torch.randn(2, 2, 300, generator=g).to(device)
    cfg = SamplingConfig(temperature=1.0, top_k=20, top_p=0.8)
    seed_t, step_t = seed_tensor(3, device), torch.tensor([4], device=device)
    expect = sample_from_noise(logits, cfg, gumbel_noise(seed_t, step_t, 1, 300)[0])
    assert torch.equal(sample(logits, cfg, seed_t, step_t), expect)
    assert torch.equal(sample(logits[:1, 0], cfg, seed_t, step_t), expect[:1, 0])


def check_greedy_is_argmax(device: str) -> None:
    """Greedy through the kernels (as the decoder's CUDA graphs run it): the first index of the
    largest logit, as torch.argmax."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 5000, generator=g).to(device)
    logits[1, [7, 4000]] = 100.0  # a tie in two chunks: the first wins
    logits[2, [2100, 2101]] = 100.0  # a tie inside one chunk
    logits[3] = 0.0  # all equal
    for dtype in (torch.float32, torch.bfloat16):
        got = sample_kernels.sample(logits.to(dtype), 1.0, 0, 1.0, None, None)
        assert torch.equal(got, logits.to(dtype).argmax(-1)) and got.tolist()[1:] == [7, 2100, 0]


def check_ties_at_the_cut_are_kept(device: str) -> None:
    """torch keeps every x equal to the k-th largest or to the top-p cut; so must the kernels
    (tied logits: every tied token stays, and the noise alone picks one)."""
    logits = torch.zeros(1, 3000, device=device)
    logits[0, :3] = 1.0
    tied_at_the_p_cut = torch.zeros(1, 64, device=device)
    tied_at_the_p_cut[0, :4] = 5.0  # p 0.25 each: top_p 0.3 is reached inside the tie
    cases = [(logits, SamplingConfig(temperature=1.0, top_k=k)) for k in (2, 3, 5, 100)]
    cases.append((tied_at_the_p_cut, SamplingConfig(temperature=1.0, top_k=8, top_p=0.3)))
    for row, cfg in cases:
        expect = {}  # step -> torch's draw, over enough steps to draw every tied token of the cuts
        for step in range(40):
            seed_t, step_t = seed_tensor(11, device), torch.tensor([step], device=device)
            expect[step] = sample_from_noise(row, cfg, gumbel_noise(seed_t, step_t, 1, row.size(-1))[0])
        if cfg.top_k in (2, 3, 8):
            assert {int(x) for x in expect.values()} == set(range(3 if cfg.top_k < 8 else 4)), (cfg, expect)
        # The CPU interpreter is slow: there the kernels draw only at the first step that draws each
        # token (six at most), which still catches a kernel that drops a tied token.
        steps = list(expect)
        if device != "cuda":
            first = {}
            for step, x in expect.items():
                first.setdefault(int(x), step)
            steps = sorted(first.values())[:6]
        for step in steps:
            seed_t, step_t = seed_tensor(11, device), torch.tensor([step], device=device)
            assert torch.equal(sample(row, cfg, seed_t, step_t), expect[step]), (cfg, step)


def check_supports(device: str) -> None:
    row = torch.empty(1, 5000, device=device)
    assert sample_kernels.supports(row, 0, 1.0) and sample_kernels.supports(row, 1024, 0.5)
    assert not sample_kernels.supports(row, 0, 0.9)  # top-p alone sorts the whole vocabulary
    assert not sample_kernels.supports(row, 1025, 1.0)
    # Where they do not apply, the decoder's sample() is the torch draw.
    logits = torch.randn(1, 5000, generator=torch.Generator().manual_seed(2)).to(device)
    seed_t, step_t = seed_tensor(5, device), torch.tensor([6], device=device)
    for cfg in (SamplingConfig(temperature=1.0, top_p=0.9), SamplingConfig(temperature=1.0, top_k=1025)):
        expect = sample_from_noise(logits, cfg, gumbel_noise(seed_t, step_t, 1, 5000)[0])
        assert torch.equal(sample(logits, cfg, seed_t, step_t), expect)


def _run(check: str) -> None:
    if CUDA:
        globals()[check]("cuda")
        return
    run_in_triton_interpreter(Path(__file__), check, bool_scalar_masks=True)


def test_fused_draws_equal_the_torch_draws():
    _run("check_draws_equal_torch")


def test_greedy_through_the_kernels_is_argmax():
    _run("check_greedy_is_argmax")


def test_ties_at_the_top_k_cut_are_kept_as_torch_keeps_them():
    _run("check_ties_at_the_cut_are_kept")


def test_supports_plain_temperature_and_top_k_only():
    _run("check_supports")


# What the CPU runs under the interpreter, in one process (conftest.run_in_triton_interpreter).
INTERPRETER_CHECKS = [
    ("check_draws_equal_torch",),
    ("check_greedy_is_argmax",),
    ("check_ties_at_the_cut_are_kept",),
    ("check_supports",),
]

if __name__ == "__main__":  # the interpreter subprocess: python test_sample_kernels.py RESULTS.json
    run_interpreter_checks(globals(), sys.argv[1])
