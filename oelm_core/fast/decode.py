"""The fast decoder: the reference generation loop's tokens with fewer launches and host waits.

``oelm_core.fast.decoder`` answers with ``decode_tokens`` here when ``SamplingConfig.fast`` and
the KV cache are on and ``supports(model)``. After the prompt's prefill (the model's
own growing-cache path), tokens come from a ``GraphDecoder``: the fixed-shape one-token step
(``decode_step``: keys and values written at a position held in a device tensor, attention over
the whole block_size cache under a position mask), then the draw, ``CHUNK`` steps at a time with
every bit of state on the device. Its parts, each with its keyword switch (``GraphDecoder``,
``acquire_decoder``, ``stream_tokens`` here take them; all on by default, and a part that cannot
run on the model or device is left out by itself):

    graph           CUDA: the CHUNK steps captured once as a CUDA graph and replayed, so the host
                    launches one replay and reads CHUNK token ids back instead of launching every
                    kernel and reading the logits per token
    decode_kernels  CUDA (plain Q/K projections): the step as the fused Triton kernels of
                    ``fast.decode_kernels``, checked against ``decode_step`` before first use
    sample_kernels  CUDA: the draw as the two Triton kernels of ``fast.sample_kernels`` (the
                    reference's draw, bit for bit)
    cpu_copies      CPU: one-row products from transposed weight copies (``fast.cpu_decode``)

Elsewhere, and with every part off, the steps run eagerly in PyTorch; on the CPU each step
attends over the keys in use only. Every combination gives the reference loop's tokens, greedy
and seeded (tests/test_fast_decode.py; on a GPU, the tests marked ``gpu``). What each part saves
is in benchmarks/README.md (``benchmarks/bench_generate.py`` times each one switched off).

Nothing here imports Triton until a decoder runs on CUDA (or under ``TRITON_INTERPRET=1``), nor
``fast.cpu_decode`` (and its optimizer-step hook) until a decoder on the CPU uses copies.
"""

from __future__ import annotations

import math
import os
import threading
import warnings
import weakref
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from oelm_core.generate import EOT, SamplingConfig, prepare, seed_tensor
from oelm_core.generate import sample as reference_sample
from oelm_core.model import GPT, Block, CausalSelfAttention, KVCache

CHUNK = 16  # decoding steps per run (and CUDA-graph replay): one host round trip per 16 tokens


def supports(model: GPT) -> bool:
    """Whether the fast decoder runs ``model``: any model in eval mode, on any device (a model
    in training mode, with its dropout, decodes through the reference loop)."""
    return not model.training


def _triton_may_run(device: torch.device) -> bool:
    """Whether the Triton parts may apply: on CUDA, or on the CPU under Triton's interpreter."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


# --------------------------------------------------------------------------------------------
# The fixed-shape one-token step, in PyTorch
# --------------------------------------------------------------------------------------------


def _cache_write(cache: KVCache, layer: int, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """Store one position's k, v (B, H, 1, d_head) at ``pos`` (a 1-element LongTensor on the
    cache's device) and return the layer's whole (B, H, block_size, d_head) buffers. Leaves
    ``cache.length`` alone (the caller keeps it)."""
    kc, vc = cache.k[layer], cache.v[layer]
    kc.index_copy_(2, pos, k.to(kc.dtype))
    vc.index_copy_(2, pos, v.to(vc.dtype))
    return kc, vc


def _qkv(attn: CausalSelfAttention, x: torch.Tensor, copies):
    """x (B, 1, d_model) -> q, k, v (B, 1, d_model); q and k None for the Synthesizer. Two
    products, not the model's one over concatenated weights: without gradients the
    concatenation would copy the weights at every step."""
    if copies is not None and copies.applies(x):
        qkv = copies.qkv(attn, x)
        if qkv is not None:
            return qkv
    if attn.qk is None:
        return None, None, attn.v(x)
    q, k = attn.qk(x).split(attn.cfg.d_model, dim=-1)
    return q, k, attn.v(x)


def _attend(
    attn: CausalSelfAttention, x: torch.Tensor, cache: KVCache, pos: torch.Tensor, mask: torch.Tensor, copies
) -> torch.Tensor:
    """One new token at position ``pos``: x (B, 1, d_model); k, v written into the cache at
    ``pos``; attention over the cache's first t positions with the additive ``mask`` (1, 1, 1,
    t), 0 at positions <= pos and -inf after. Returns the heads' output (B, 1, d_model) before
    the output projection (``_block`` folds that into the residual add)."""
    b = x.size(0)
    q, k, v = _qkv(attn, x, copies)
    v = attn.heads(v)
    # The Synthesizer has no keys; its key slot in the cache holds the values again.
    k_all, v_all = _cache_write(cache, attn.layer, pos, v if k is None else attn.heads(k), v)
    t = mask.size(-1)
    k_all, v_all = k_all[:, :, :t], v_all[:, :, :t]
    if attn.qk is not None:
        # One query per head: a batched GEMV with the mask added (baddbmm), a softmax and a
        # second GEMV; SDPA's fused kernels are built for many queries.
        h, dh = attn.cfg.n_head, attn.cfg.d_head
        logits = torch.baddbmm(
            mask.to(q.dtype).view(1, 1, t),
            attn.heads(q).reshape(b * h, 1, dh),
            k_all.reshape(b * h, t, dh).transpose(1, 2),
            alpha=1.0 / math.sqrt(dh),
        )
        logits = logits.view(b, h, 1, t)
    else:
        rows = attn.synth_0.index_select(1, pos)  # (H, 1, block_size) or (H, 1, rank)
        logits = rows[..., :t] if attn.cfg.attention == "synth_random" else rows @ attn.synth_1[:, :t].transpose(1, 2)
        logits = logits.unsqueeze(0) + mask
    att = torch.softmax(logits.float(), dim=-1).to(v_all.dtype)
    return (att @ v_all).transpose(1, 2).reshape(b, 1, attn.cfg.d_model)


def _add_linear(residual: torch.Tensor, h: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """residual + layer(h) for one token, (B, 1, d) each, as one GEMM that accumulates into the
    residual (addmm): one kernel fewer than a linear layer and an add."""
    b = residual.size(0)
    acc = residual.view(b, -1) if layer.bias is None else residual.view(b, -1) + layer.bias
    return torch.addmm(acc, h.reshape(b, -1), layer.weight.t()).view_as(residual)


def _block(
    block: Block, x: torch.Tensor, cache: KVCache, pos: torch.Tensor, mask: torch.Tensor, copies
) -> torch.Tensor:
    """``block(x, cache)`` for one token at ``pos`` (eval mode), the fixed-shape way."""
    x = _add_linear(x, _attend(block.attn, block.ln_1(x), cache, pos, mask, copies), block.attn.proj)
    h = block.ln_2(x)
    mlp = block.mlp
    fc = copies.fc(mlp, block.attn.layer, h) if copies is not None and copies.applies(h) else mlp.fc(h)
    return _add_linear(x, F.gelu(fc, approximate="tanh"), mlp.proj)


def _logits(model: GPT, h: torch.Tensor, copies) -> torch.Tensor:
    """h (..., d_model) -> ``model.logits(h)``, from the transposed copy for one row on the CPU."""
    if copies is not None and copies.applies(h):
        return copies.logits(model, h)
    return model.logits(h)


def decode_step(
    model: GPT, idx: torch.Tensor, pos: torch.Tensor, cache: KVCache, fixed_shape: Optional[bool] = None, copies=None
) -> torch.Tensor:
    """One token per sequence through ``model`` in eval mode (no dropout).

    idx: (B, 1) token ids at position ``pos`` (a 1-element LongTensor on the model's device,
    < block_size); cache: a ``KVCache`` whose positions < pos hold the earlier tokens. Writes
    this token's keys/values at ``pos``. With ``fixed_shape`` (the default on CUDA, for CUDA
    graphs) it attends over the whole block_size cache through one additive mask (0 where
    ``arange(block_size) <= pos``, -inf after), so no shape depends on the position; otherwise
    (the default elsewhere; ``pos`` is read on the host) over positions <= pos only.
    ``copies``: a ``fast.cpu_decode.CPUCopies`` of this model for the one-row products, or None.
    Returns logits (B, vocab_size): the numbers of ``model(idx, cache=cache)[:, -1]`` with
    ``cache.length == pos``. Neither reads nor updates ``cache.length``.
    """
    x = model.wte(idx) + model.wpe(pos)
    fixed_shape = idx.is_cuda if fixed_shape is None else fixed_shape
    t = model.cfg.block_size if fixed_shape else int(pos) + 1
    future = torch.arange(t, device=idx.device) > pos
    mask = torch.zeros(future.shape, dtype=model.wte.weight.dtype, device=idx.device)
    mask = mask.masked_fill_(future, float("-inf")).view(1, 1, 1, -1)  # built once for all layers
    for block in model.blocks:
        x = _block(block, x, cache, pos, mask, copies)
    return _logits(model, model.ln_f(x)[:, 0], copies)


# --------------------------------------------------------------------------------------------
# The draw
# --------------------------------------------------------------------------------------------


def sample(
    logits: torch.Tensor,
    cfg: SamplingConfig,
    seed: Optional[torch.Tensor] = None,
    step: Optional[torch.Tensor] = None,
    kernels: bool = True,
) -> torch.Tensor:
    """``generate.sample``'s draw (the same token ids): with ``kernels``, through the two Triton
    kernels of ``fast.sample_kernels`` where they apply (CUDA, or the CPU under Triton's
    interpreter; greedy only inside a CUDA graph, where they are one launch fewer than argmax;
    eagerly one argmax costs the host less), else the reference's torch ops."""
    if kernels and (logits.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"):
        from oelm_core.fast import sample_kernels

        if cfg.greedy:
            if logits.is_cuda and torch.cuda.is_current_stream_capturing() and sample_kernels.supports(logits, 0, 1.0):
                return sample_kernels.sample(logits, 1.0, 0, 1.0, None, None)
        else:
            top_k = cfg.top_k_for(logits.size(-1))
            if sample_kernels.supports(logits, top_k, cfg.top_p):
                return sample_kernels.sample(logits, cfg.inv_temperature, top_k, cfg.top_p, seed, step)
    return reference_sample(logits, cfg, seed, step)


# --------------------------------------------------------------------------------------------
# The decoder
# --------------------------------------------------------------------------------------------


def _switches(
    graph: bool = True, decode_kernels: bool = True, sample_kernels: bool = True, cpu_copies: bool = True
) -> dict:
    """``GraphDecoder``'s switches as a dict (an unknown one is a TypeError that names it)."""
    return dict(graph=graph, decode_kernels=decode_kernels, sample_kernels=sample_kernels, cpu_copies=cpu_copies)


def _state_signature(model: GPT) -> tuple:
    """What a captured decode step depends on: where every weight lives, the mode, autocast."""
    dev = model.wte.weight.device
    tensors = [t for _, t in model.named_parameters()] + [t for _, t in model.named_buffers()]
    autocast = (
        (torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type))
        if dev.type in ("cuda", "cpu")
        else (False, None)
    )
    return (str(dev), model.training, autocast, tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in tensors))


class GraphDecoder:
    """KV-cached decoding of one sequence with fixed shapes.

    Switches (keyword arguments, all on by default; see the module docstring): ``graph``,
    ``decode_kernels``, ``sample_kernels``, ``cpu_copies``. A part that cannot run here is off
    whatever its switch says (``kernels``, ``copies`` and ``mode`` tell what runs).

    Device state: ``token`` (1, 1), the last sampled id, not yet fed to the model; ``state`` =
    [pos, step], the position that token takes in the cache and the index of the next draw
    (which picks its noise); ``seed``; ``out`` (CHUNK,), the ids of the last ``run``.
    ``prefill(model, ids, step, cfg)`` runs ids through the model's growing-cache path
    (``model.hidden(x, cache)``) and draws the next token; ``run(model, n, cfg)`` feeds the
    token and draws the next one, n times (the fused Triton step where it applies, else
    ``decode_step``; then ``sample``), and returns the n new ids. With ``graph`` on CUDA each
    (n, sampling setting) is captured once as a CUDA graph (after a warm-up on a side stream,
    checked against the eager run) and replayed; elsewhere, or if the capture fails or
    disagrees, the same steps run eagerly ("eager"); if even that fails, one token at a time
    through the growing-cache path ("legacy").

    The decoder holds no reference to the model (it is passed in), so ``_DECODERS`` can keep one
    per model (weakly) and switches across calls: capture happens once, not once per generation.
    """

    # Normal tensors even when made under torch.inference_mode: the decoder outlives the call
    # (``_DECODERS``), and inference tensors cannot be written in place outside that mode.
    @torch.inference_mode(False)
    def __init__(
        self,
        model: GPT,
        *,
        graph: bool = True,
        decode_kernels: bool = True,
        sample_kernels: bool = True,
        cpu_copies: bool = True,
    ):
        self.signature = _state_signature(model)
        self.block, self.vocab = model.cfg.block_size, model.cfg.vocab_size
        self.cache = model.new_cache()
        dev = model.wte.weight.device
        self.token = torch.zeros((1, 1), dtype=torch.long, device=dev)
        self.state = torch.zeros(2, dtype=torch.long, device=dev)
        self.seed = torch.zeros(1, dtype=torch.long, device=dev)
        self.out = torch.zeros(CHUNK, dtype=torch.long, device=dev)
        # None: a capture not tried yet; "graph", "eager", "legacy": what runs the steps.
        self.mode = None if graph and dev.type == "cuda" else "eager"
        self.copies = None
        if cpu_copies and dev.type == "cpu":
            from oelm_core.fast.cpu_decode import CPUCopies

            self.copies = CPUCopies(model)
        self.scratch = None  # the fused step's buffers, where it applies
        if decode_kernels and _triton_may_run(dev):
            from oelm_core.fast import decode_kernels as fused

            if fused.supports(model):
                self.scratch = fused.DecodeScratch(model)
        self.fused_checked = False
        self.sample_kernels = sample_kernels
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.busy = False

    @property
    def kernels(self) -> str:
        """What computes a decoding step: "triton" (fast.decode_kernels) or "torch"."""
        return "triton" if self.scratch is not None else "torch"

    def sampler(self, cfg: SamplingConfig) -> str:
        """What draws the tokens for ``cfg`` here: "triton" (fast.sample_kernels), "torch" or
        "argmax" (greedy outside CUDA graphs)."""
        if self.sample_kernels and _triton_may_run(self.out.device):
            from oelm_core.fast import sample_kernels

            if cfg.greedy:
                if self.mode in (None, "graph") and sample_kernels.supports(self.out, 0, 1.0):
                    return "triton"
            elif sample_kernels.supports(self.out, cfg.top_k_for(self.vocab), cfg.top_p):
                return "triton"
        return "argmax" if cfg.greedy else "torch"

    @property
    def length(self) -> int:
        """Positions of the cache in use (the host's copy of ``state[0]``)."""
        return self.cache.length

    def reset(self) -> None:
        """Forget the context (positions past ``length`` are masked, so nothing is cleared)."""
        self.cache.length = 0

    def set_seed(self, seed: int) -> None:
        self.seed.copy_(seed_tensor(seed, "cpu"))

    def _logits(self, model: GPT, h: torch.Tensor) -> torch.Tensor:
        return _logits(model, h, self.copies)

    def prefill(self, model: GPT, ids: list[int], step: int, cfg: SamplingConfig) -> int:
        """Run ``ids`` from position ``length`` and draw token number ``step`` after them."""
        x = torch.tensor([ids], device=self.token.device)
        logits = self._logits(model, model.hidden(x, self.cache)[:, -1])  # the last position's only
        self.state.copy_(torch.tensor([self.cache.length, step]))
        self.token.copy_(sample(logits, cfg, self.seed, self.state[1:], self.sample_kernels).view(1, 1))
        self.state[1] += 1
        return int(self.token)

    def _steps(self, model: GPT, n: int, cfg: SamplingConfig, decode=None) -> None:
        """n decoding steps on the device state; fixed shapes throughout. ``decode(model)`` gives
        the logits (1, vocab) of ``token`` at ``state[0]``; by default the fixed-shape step."""
        decode = decode or self._decode
        for i in range(n):
            logits = decode(model)
            self.out[i : i + 1].copy_(sample(logits, cfg, self.seed, self.state[1:], self.sample_kernels))
            self.token.copy_(self.out[i : i + 1].view(1, 1))
            self.state += 1

    def _decode(self, model: GPT) -> torch.Tensor:
        if self.scratch is not None:
            from oelm_core.fast import decode_kernels as fused

            return fused.decode_step(model, self.token, self.state[:1], self.cache, self.scratch)
        return decode_step(model, self.token, self.state[:1], self.cache, copies=self.copies)

    def _check_fused(self, model: GPT) -> None:
        """Compare one fused step with ``decode_step`` on the current state (both write the same
        keys and values at pos); on a mismatch or an error, decode with PyTorch instead."""
        from oelm_core.fast import decode_kernels as fused

        try:
            got = fused.decode_step(model, self.token, self.state[:1], self.cache, self.scratch)
            ref = decode_step(model, self.token, self.state[:1], self.cache).float()
            # float32 agrees to ~1e-6; bfloat16 to ~1e-2, the fused path keeping float32 inside.
            tol = (1e-3 if model.wte.weight.dtype == torch.float32 else 5e-2) * max(1.0, float(ref.abs().max()))
            err = float((got - ref).abs().max())
            if not err <= tol:
                raise RuntimeError(f"max |difference| {err:.2e} > {tol:.2e}")
        except Exception as e:
            warnings.warn(f"the fused decode kernels disagree with decode_step or failed ({e}); decoding with PyTorch")
            self.scratch = None

    def _legacy_steps(self, model: GPT, n: int, cfg: SamplingConfig) -> None:
        """The steps through the growing-cache path, ``model.hidden(x, cache)``."""
        self._steps(model, n, cfg, lambda m: self._logits(m, m.hidden(self.token, self.cache)[:, -1]))
        self.cache.length -= n  # model.hidden advanced it; run() advances it for every mode

    def _capture(self, model: GPT, n: int, cfg: SamplingConfig) -> None:
        """Warm up on a side stream, capture ``_steps(n)`` and check one replay against the
        warm-up (same start state, so the same ids). Leaves this run's result in ``out``."""
        key = (n, cfg.temperature, cfg.top_k, cfg.top_p)
        start = (self.token.clone(), self.state.clone())
        try:
            s = torch.cuda.Stream(device=self.token.device)
            s.wait_stream(torch.cuda.current_stream(self.token.device))
            with torch.cuda.stream(s):
                self._steps(model, n, cfg)
                expected = self.out[:n].clone()
                self.token.copy_(start[0])
                self.state.copy_(start[1])
            torch.cuda.current_stream(self.token.device).wait_stream(s)
            self.pool = self.pool or torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self._steps(model, n, cfg)
            graph.replay()
            if not torch.equal(self.out[:n], expected):
                raise RuntimeError("the replayed decode steps disagree with the eager ones")
            self.graphs[key] = graph
            self.mode = "graph"
        except Exception as e:  # keep generating: the eager fixed-shape step is the same math
            warnings.warn(f"CUDA graph capture of the decode step failed ({e}); decoding eagerly")
            self.token.copy_(start[0])
            self.state.copy_(start[1])
            self.graphs.clear()
            self.mode = "eager"
            self._steps(model, n, cfg)

    def run(self, model: GPT, n: int, cfg: SamplingConfig) -> list[int]:
        """Feed the pending token and draw n more (positions length .. length + n - 1)."""
        if not 1 <= n <= CHUNK:
            raise ValueError(f"run() takes 1 to {CHUNK} steps, got {n}")
        if self.length + n > self.block:
            raise ValueError(f"the context of {self.block} tokens is full; reset and prefill")
        key = (n, cfg.temperature, cfg.top_k, cfg.top_p)
        if self.scratch is not None and not self.fused_checked:
            self._check_fused(model)
            self.fused_checked = True
        if self.mode in (None, "graph") and key not in self.graphs:
            self._capture(model, n, cfg)
        elif self.mode in (None, "graph"):
            self.graphs[key].replay()
        elif self.mode == "legacy":
            self._legacy_steps(model, n, cfg)
        else:
            try:
                self._steps(model, n, cfg)
            except Exception as e:  # a device without index_copy_ or baddbmm, say
                warnings.warn(f"fixed-shape decode step failed ({e}); using the plain cached path")
                self.mode = "legacy"
                self._legacy_steps(model, n, cfg)
        self.cache.length += n
        return self.out[:n].tolist()


# Per model (weakly) and per combination of switches, the decoder kept for the next generation.
_DECODERS: "weakref.WeakKeyDictionary[GPT, dict[tuple, GraphDecoder]]" = weakref.WeakKeyDictionary()
_DECODERS_LOCK = threading.Lock()


def acquire_decoder(model: GPT, **options: bool) -> GraphDecoder:
    """The model's decoder for these ``options`` (``GraphDecoder``'s switches; captured once,
    reused) if it is free and still matches the model's weights and mode; a new one otherwise.
    Release it with ``release_decoder``."""
    switches = _switches(**options)
    key = tuple(switches.items())
    signature = _state_signature(model)
    with _DECODERS_LOCK:
        kept = _DECODERS.setdefault(model, {})
        decoder = kept.get(key)
        if decoder is not None and not decoder.busy and decoder.signature == signature:
            decoder.busy = True
            decoder.reset()
            return decoder
        decoder = GraphDecoder(model, **switches)
        decoder.busy = True
        if key not in kept or not kept[key].busy:
            kept[key] = decoder  # a stale or missing one is replaced; a busy one stays
        return decoder


def release_decoder(decoder: GraphDecoder) -> None:
    with _DECODERS_LOCK:
        decoder.busy = False


def forget_decoder(model: GPT) -> None:
    """Drop the decoders kept for ``model`` (their captured graphs and CPU weight copies): the
    next generation builds a new one. Needed only after a write to the weights that neither a
    version counter nor a torch.optim step shows, e.g. ``weight.data.copy_(...)``."""
    with _DECODERS_LOCK:
        kept = _DECODERS.pop(model, {})
    for decoder in kept.values():
        if decoder.copies is not None:
            decoder.copies.clear()  # a stream still running on it remakes them from the weights


def decode_tokens(model: GPT, ids: list[int], cfg: SamplingConfig, seed: int, **options: bool) -> Iterator[int]:
    """``generate.reference_tokens``' tokens through a ``GraphDecoder`` with ``options``: new
    token ids after the checked prompt ``ids`` (``generate.prepare``), extended in place. The
    same window policy: when the cache is full, restart from the most recent block_size // 2
    tokens."""
    block = model.cfg.block_size
    decoder = acquire_decoder(model, **options)
    try:
        decoder.set_seed(seed)
        new = [decoder.prefill(model, ids, 0, cfg)]
        produced = 0
        while True:
            for token in new:
                if cfg.stop_at_eot and token == EOT:
                    return
                ids.append(token)
                produced += 1
                yield token
                if produced >= cfg.max_new_tokens:
                    return
            room, left = block - decoder.length, cfg.max_new_tokens - produced
            if room == 0:
                decoder.reset()
                new = [decoder.prefill(model, ids[-(block // 2) :], produced, cfg)]
            else:
                # Whole chunks while they fit; single steps at the end of the window or the text.
                n = CHUNK if room >= CHUNK and left >= CHUNK // 2 else 1
                new = decoder.run(model, n, cfg)
    finally:
        release_decoder(decoder)


@torch.no_grad()
def stream_tokens(model: GPT, prompt_ids: list[int], cfg: SamplingConfig, **options: bool) -> Iterator[int]:
    """``generate.stream_tokens`` through the fast decoder with ``options`` (``GraphDecoder``'s
    switches, e.g. ``graph=False``), whatever ``cfg.use_cache`` and ``cfg.fast`` say: for tests
    and benchmarks that switch its parts."""
    if not supports(model):
        raise ValueError(
            "the fast decoder runs models in eval mode: call model.eval() first, or "
            "generate through oelm_core.generate.stream_tokens"
        )
    ids, seed = prepare(model, prompt_ids, cfg)
    yield from decode_tokens(model, ids, cfg, seed, **options)
