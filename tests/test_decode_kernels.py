"""The fused Triton decode step (oelm_core.fast.decode_kernels) equals the PyTorch one
(``oelm_core.fast.decode.decode_step``), and the decoder uses it.

On a GPU the checks run in this process. Without one they run in a subprocess under Triton's CPU
interpreter (``TRITON_INTERPRET=1`` must be set before the kernels are defined, i.e. before
oelm_core is imported) on the ``tiny`` preset; `make test` installs a Triton for it beside a CPU
torch. Skipped without Triton, and with a Triton whose interpreter cannot run these kernels
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

from oelm_core import build_model  # noqa: E402
from oelm_core.fast.decode import decode_step as torch_step  # noqa: E402
from oelm_core.fast.decode_kernels import DecodeScratch, decode_step, supports  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CUDA = torch.cuda.is_available()

# name -> (variant, model overrides): the Q/K kinds, and every optional bias and the untied head.
CASES = {
    "gpt_base": ("gpt_base", {}),
    "oelm_freeze": ("oelm_freeze", {}),
    "biases": ("gpt_base", {"bias": True, "attn_bias": True}),
    "no_bias_untied": ("gpt_base", {"bias": False, "tie_embeddings": False}),
}
PREFIX = 5
# Consecutive early positions (with 4-key blocks: partial and whole last blocks) and, after a
# prefill up to it, the last position of the context.
POSITIONS = [5, 6, 7, 8]


def _model(name: str, device: str):
    variant, overrides = CASES[name]
    model = build_model("tiny", variant, seed=3, **overrides).eval().to(device)
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():  # LayerNorms and biases start at 1 and 0: move them so they count
        for pname, p in model.named_parameters():
            if pname.endswith("bias") or "ln_" in pname:
                p.add_(torch.randn(p.shape, generator=g).to(device) * 0.3)
    return model


def check_equal_to_reference(name: str, device: str) -> None:
    model = _model(name, device)
    block = model.cfg.block_size
    idx = torch.randint(0, model.cfg.vocab_size, (1, block), generator=torch.Generator().manual_seed(1))
    idx = idx.to(device)
    ref_cache, cache = model.new_cache(), model.new_cache()
    for c in (ref_cache, cache):  # the same stale, large junk past the prefix in both
        g = torch.Generator().manual_seed(2)
        for layer in range(model.cfg.n_layer):
            c.k[layer].copy_(torch.randn(c.k[layer].shape, generator=g) * 50)
            c.v[layer].copy_(torch.randn(c.v[layer].shape, generator=g) * 50)
    scratch = DecodeScratch(model, attn_block_t=4)  # several key blocks even in 32 positions

    def step(t: int) -> None:
        pos = torch.tensor([t], device=device)
        expect = torch_step(model, idx[:, t : t + 1], pos, ref_cache)
        got = decode_step(model, idx[:, t : t + 1], pos, cache, scratch)
        assert got.shape == (1, model.cfg.vocab_size) and got.dtype == torch.float32
        assert (got - expect).abs().max().item() < 1e-4, (name, t)
        for layer in range(model.cfg.n_layer):  # written at t, and nowhere else
            assert (cache.k[layer] - ref_cache.k[layer]).abs().max().item() < 1e-5, (name, t, layer)
            assert (cache.v[layer] - ref_cache.v[layer]).abs().max().item() < 1e-5, (name, t, layer)

    with torch.no_grad():
        for c in (ref_cache, cache):
            model(idx[:, :PREFIX], cache=c)
        for t in POSITIONS:
            step(t)
        for c in (ref_cache, cache):  # fill up to the last position through the ordinary path
            c.length = POSITIONS[-1] + 1
            model(idx[:, c.length : block - 1], cache=c)
        step(block - 1)
        # A new scratch per call, and a one-token prompt at position 0 (no cached keys at all).
        zero = torch.tensor([0], device=device)
        got = decode_step(model, idx[:, :1], zero, cache)
        assert (got - torch_step(model, idx[:, :1], zero, ref_cache)).abs().max().item() < 1e-4


def check_supports(device: str) -> None:
    assert supports(_model("gpt_base", device))
    assert supports(_model("oelm_freeze", device))
    assert not supports(build_model("tiny", "synth_random").eval().to(device))
    assert not supports(build_model("tiny", "oelm_poet").eval().to(device))
    assert not supports(_model("gpt_base", device).train())
    assert not supports(_model("gpt_base", device).half())


def check_decoder(device: str) -> None:
    """fast.decode.GraphDecoder picks the fused step, gives the uncached path's tokens with it,
    and falls back to PyTorch, with a warning and the same tokens, when the fused step is wrong
    or switched off."""
    import warnings

    from oelm_core.fast import decode, decode_kernels, stream_tokens
    from oelm_core.fast.decode import acquire_decoder, release_decoder
    from oelm_core.generate import SamplingConfig

    model = _model("oelm_freeze", device)
    # Past the 32-position context (a restart, a prefill): on a GPU 3 + 40 tokens, 16-step graph
    # chunks among them; under the CPU interpreter, whose kernels are slow, 28 + 6 (the prompt's
    # prefill is PyTorch's, each new token a fused step).
    prompt, n_new = ([3, 4, 5], 40) if device == "cuda" else (list(range(3, 31)), 6)
    kw = dict(max_new_tokens=n_new, temperature=0.9, top_k=40, seed=5, stop_at_eot=False)
    with torch.no_grad():
        plain = list(stream_tokens(model, prompt, SamplingConfig(**kw, use_cache=False)))
        decoder = acquire_decoder(model)
        release_decoder(decoder)
        assert decoder.kernels == "triton"
        assert list(stream_tokens(model, prompt, SamplingConfig(**kw))) == plain
        assert acquire_decoder(model) is decoder and decoder.kernels == "triton"
        release_decoder(decoder)
        off = list(decode.stream_tokens(model, prompt, SamplingConfig(**kw), decode_kernels=False))
        decoder = acquire_decoder(model, decode_kernels=False)
        release_decoder(decoder)
        assert off == plain and decoder.kernels == "torch"

        model = _model("gpt_base", device)
        plain = list(stream_tokens(model, prompt, SamplingConfig(**kw, use_cache=False)))
        right = decode_kernels.decode_step
        decode_kernels.decode_step = lambda *a: right(*a) + 1.0
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                cached = list(stream_tokens(model, prompt, SamplingConfig(**kw)))
        finally:
            decode_kernels.decode_step = right
        decoder = acquire_decoder(model)
        release_decoder(decoder)
        assert any("fused decode kernels disagree" in str(w.message) for w in caught)
        assert decoder.kernels == "torch" and cached == plain


def _run(check: str, *args: str) -> None:
    """Run a check on the GPU here, or on the CPU in an interpreter subprocess."""
    if CUDA:
        globals()[check](*args, "cuda")
        return
    run_in_triton_interpreter(Path(__file__), check, *args, bool_scalar_masks=True)


@pytest.mark.parametrize("name", list(CASES))
def test_fused_decode_step_equals_the_torch_step(name):
    _run("check_equal_to_reference", name)


def test_supports_plain_qk_projections_in_eval_mode_only():
    _run("check_supports")


def test_the_decoder_uses_the_fused_step_and_falls_back_when_it_is_wrong():
    _run("check_decoder")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_fused_decode_step_replays_in_a_cuda_graph():
    model = _model("gpt_base", "cuda")
    idx = torch.randint(0, model.cfg.vocab_size, (1, 12), device="cuda")
    with torch.no_grad():
        ref_cache, cache = model.new_cache(), model.new_cache()
        for c in (ref_cache, cache):
            model(idx[:, :4], cache=c)
        token = idx[:, 4:5].clone()
        pos = torch.tensor([4], device="cuda")
        scratch = DecodeScratch(model)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # compile the kernels outside the capture
            decode_step(model, token, pos, model.new_cache(), scratch)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = decode_step(model, token, pos, cache, scratch)
        for t in range(4, 12):  # new token and position through the captured tensors only
            token.copy_(idx[:, t : t + 1])
            pos.fill_(t)
            graph.replay()
            expect = torch_step(model, idx[:, t : t + 1], torch.tensor([t], device="cuda"), ref_cache)
            assert (logits - expect).abs().max().item() < 1e-4, t


# What the CPU runs under the interpreter, in one process (conftest.run_in_triton_interpreter).
INTERPRETER_CHECKS = [*(("check_equal_to_reference", name) for name in CASES), ("check_supports",), ("check_decoder",)]

if __name__ == "__main__":  # the interpreter subprocess: python test_decode_kernels.py RESULTS.json
    run_interpreter_checks(globals(), sys.argv[1])
