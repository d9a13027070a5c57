"""Sampling from a trained GPT: KV-cached, seeded, streaming.

``stream(model, prompt)`` yields text pieces as they are produced; ``generate`` joins them.

Sampling runs on the model's device and never waits for the host. Its noise is a counter-based
hash of (seed, step, token id) (``gumbel_noise``), not a generator's state: a seed gives the
same noise on CPU and GPU, every path (cached, uncached, graph, eager) draws the k-th token with
the same noise, and a run of decoding steps, sampling included, fits in one CUDA graph. A token
is argmax(logits / T + Gumbel noise) over the ids that top-k / top-p allow (the Gumbel-max trick:
a sample of softmax(logits / T) restricted to them).

The cache and the plain path compute the same logits (tested); the cache only avoids recomputing
the keys and values of tokens already seen. After the prompt's prefill, tokens come from
``GraphDecoder``: the fixed-shape one-token step (``GPT.decode_step``: keys and values written at
a position held in a device tensor, attention over the whole block_size cache under a position
mask) followed by the sampler, ``CHUNK`` steps captured as one CUDA graph on GPUs, so the host
launches one replay and reads ``CHUNK`` token ids back instead of launching ~100 kernels and
reading 50,257 logits per token. Elsewhere the same steps run eagerly. Where
``oelm_core.decode_kernels`` supports the model (CUDA with Triton; dot attention through plain
Q/K projections), the step is its 5 fused kernels per layer instead of PyTorch's ~19, checked
against ``GPT.decode_step`` before it is used, and on CUDA the draw is the two kernels of
``oelm_core.sample_kernels`` (the same tokens as the torch ops of ``sample_from_noise``).
"""

from __future__ import annotations

import math
import numbers
import secrets
import struct
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Iterable, Iterator, Optional

import torch

from oelm_core import decode_kernels, sample_kernels
from oelm_core.data import EOT, get_tokenizer  # EOT ends every story in the training data
from oelm_core.model import GPT

CHUNK = 16  # decoding steps per CUDA-graph replay: one host round trip per 16 tokens

# Temperatures below this draw the most likely token. For them the noise (< 17) vanished in the
# float32 rounding of logits / T wherever |logit| > 1e-3 (the draw was greedy already, ties
# aside), and logits / T overflowed to +inf for every logit above 3.4e38 * T, where argmax took
# the first of those, not the largest.
GREEDY_BELOW = 1e-12


def _is_int(value) -> bool:
    """int or a NumPy integer; not bool, which would pass as 0 or 1."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass
class SamplingConfig:
    max_new_tokens: int = 200
    temperature: float = 0.8     # 0 (or below GREEDY_BELOW) picks the most likely token (greedy)
    top_k: int = 0               # 0: no top-k cut
    top_p: float = 1.0           # 1.0: no nucleus cut
    seed: Optional[int] = None
    stop_at_eot: bool = True
    use_cache: bool = True

    def validate(self) -> "SamplingConfig":
        # Types first: a float max_new_tokens (2.5) is never equal to a count of tokens, and a
        # float top_k reached torch.topk as a bare TypeError.
        for name, ok, kind in (("max_new_tokens", _is_int, "a whole number (int)"),
                               ("top_k", _is_int, "a whole number (int)"),
                               ("temperature", _is_real, "a number"),
                               ("top_p", _is_real, "a number"),
                               ("seed", lambda v: v is None or _is_int(v), "a whole number (int) or None"),
                               ("stop_at_eot", lambda v: isinstance(v, bool), "True or False"),
                               ("use_cache", lambda v: isinstance(v, bool), "True or False")):
            value = getattr(self, name)
            if not ok(value):
                raise TypeError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        return self

    @property
    def greedy(self) -> bool:
        """Whether every draw is the most likely token: temperature 0 or below ``GREEDY_BELOW``."""
        return self.temperature < GREEDY_BELOW

    def top_k_for(self, vocab: int) -> int:
        """The top-k cut over ``vocab`` ids; 0 where there is none (off, or k >= vocab)."""
        return self.top_k if 0 < self.top_k < vocab else 0


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _hash32(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixer (Mueller's hash32) on int64 tensors holding values < 2^32; its
    multiplier is below 2^27, so no product leaves int64 and every device computes the same bits."""
    h = (((h >> 16) ^ h) * 0x45D9F3B) & _M32
    h = (((h >> 16) ^ h) * 0x45D9F3B) & _M32
    return (h >> 16) ^ h


def seed_tensor(seed: int, device) -> torch.Tensor:
    """A Python seed of any size folded to a one-element int64 tensor below 2^32."""
    return torch.tensor([(seed ^ (seed >> 32)) & _M32], dtype=torch.int64, device=device)


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, n_steps: int, vocab: int) -> torch.Tensor:
    """(n_steps, vocab) float32 Gumbel noise for sampling steps step, step + 1, ...

    seed, step: one-element int64 tensors on the device where the noise is wanted. Entry (i, v)
    is -log(-log(u)) with u in (0, 1) from 23 bits of a hash of (seed, step + i, v): (m + 0.5) /
    2^23 is exact in float32, so u stays below 1 (from 24 bits the top value rounded to 1.0, an
    infinite noise that picked a uniformly random token in ~0.3% of draws over 50,257 ids)."""
    steps = step + torch.arange(n_steps, device=step.device)
    key = _hash32((_hash32(seed) + steps * 0x9E3779B9) & _M32)              # (n_steps,)
    ids = torch.arange(vocab, device=step.device)
    h = _hash32((key[:, None] + ids[None, :] * 0x85EBCA77) & _M32)          # (n_steps, vocab)
    return -torch.log(-torch.log(_uniform(h)))


def _uniform(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64 tensor) -> float32 in (0, 1), strictly, from their top 23 bits."""
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def sample(logits: torch.Tensor, cfg: SamplingConfig, seed: Optional[torch.Tensor] = None,
           step: Optional[torch.Tensor] = None) -> torch.Tensor:
    """logits (..., vocab); seed, step: one-element int64 tensors on the logits' device, the
    noise of draw number ``step`` (unused when greedy) -> token ids (...,) int64 on that device.
    No host synchronisation and no data-dependent shape, so it can be captured in a CUDA graph.
    On CUDA (with Triton) the two kernels of ``sample_kernels`` where they apply (greedy only
    inside a CUDA graph), else ``sample_from_noise`` (or ``argmax``): the same draw."""
    if cfg.greedy:
        # In a CUDA graph the kernels are one launch fewer; eagerly, one argmax costs the host less.
        if logits.is_cuda and torch.cuda.is_current_stream_capturing() and sample_kernels.supports(logits, 0, 1.0):
            return sample_kernels.sample(logits, 1.0, 0, 1.0, None, None)
        return logits.argmax(-1)
    top_k = cfg.top_k_for(logits.size(-1))
    if sample_kernels.supports(logits, top_k, cfg.top_p):
        return sample_kernels.sample(logits, _inv_temperature(cfg), top_k, cfg.top_p, seed, step)
    return sample_from_noise(logits, cfg, gumbel_noise(seed, step, 1, logits.size(-1))[0])


def _inv_temperature(cfg: SamplingConfig) -> float:
    """1 / T rounded to float32: logits are scaled by one float32 multiply on every path.
    (struct, not a tensor: the uncached path asks once per token.)"""
    return struct.unpack("f", struct.pack("f", 1.0 / cfg.temperature))[0]


def sample_from_noise(logits: torch.Tensor, cfg: SamplingConfig, noise: torch.Tensor) -> torch.Tensor:
    """The draw in torch ops, given the noise (vocab,) from ``gumbel_noise``: argmax of
    logits / T + noise over the ids that top-k and then top-p keep (both keep every id tied
    with the last one kept)."""
    x = logits.float() * _inv_temperature(cfg)
    if cfg.top_k_for(x.size(-1)):
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_x = torch.sort(x, dim=-1, descending=True).values
        p = torch.softmax(sorted_x, dim=-1)
        # The smallest prefix whose mass reaches top_p (the most likely token always stays) ends
        # at the cut; every id at or above it stays, so tied ids stay or go together, whatever
        # order the sort left them in (the kernels' rule).
        n_keep = (p.cumsum(-1) - p < cfg.top_p).sum(-1, keepdim=True)
        x = x.masked_fill(x < sorted_x.gather(-1, n_keep - 1), float("-inf"))
    return (x + noise).argmax(-1)


# --------------------------------------------------------------------------------------------
# Cached decoding
# --------------------------------------------------------------------------------------------

def _state_signature(model: GPT) -> tuple:
    """What a captured decode step depends on: where every weight lives, the mode, autocast."""
    dev = model.wte.weight.device
    tensors = [t for _, t in model.named_parameters()] + [t for _, t in model.named_buffers()]
    autocast = (torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type)) \
        if dev.type in ("cuda", "cpu") else (False, None)
    return (str(dev), model.training, autocast,
            tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in tensors))


class GraphDecoder:
    """KV-cached decoding of one sequence with fixed shapes.

    Device state: ``token`` (1, 1), the last sampled id, not yet fed to the model; ``state`` =
    [pos, step], the position that token takes in the cache and the index of the next sample
    (which picks its noise); ``seed``; ``out`` (CHUNK,), the ids of the last ``run``.
    ``prefill(model, ids, step, cfg)`` runs ids through the ordinary growing-cache path
    (``model.hidden(x, cache)``) and samples the next token; ``run(model, n, cfg)`` feeds the
    token and samples the next one, n times (the fused Triton step of ``decode_kernels`` where it
    applies, else ``GPT.decode_step``; then ``sample``), and returns the n new ids. On CUDA each
    (n, sampling setting) is captured once as a CUDA graph (after a warm-up on a side stream,
    checked against the eager run) and replayed; elsewhere, in training mode, or if the capture
    fails or disagrees, the same steps run eagerly; if even that fails, one token at a time
    through the growing-cache path ("legacy").

    The decoder holds no reference to the model (it is passed in), so ``_DECODERS`` can keep one
    per model, weakly, across calls: capture happens once, not once per generation.
    """

    # Normal tensors even when made under torch.inference_mode: the decoder outlives the call
    # (``_DECODERS``), and inference tensors cannot be written in place outside that mode.
    @torch.inference_mode(False)
    def __init__(self, model: GPT):
        self.signature = _state_signature(model)
        self.block = model.cfg.block_size
        self.vocab = model.cfg.vocab_size
        self.cache = model.new_cache()
        dev = model.wte.weight.device
        self.cuda = dev.type == "cuda"
        self.token = torch.zeros((1, 1), dtype=torch.long, device=dev)
        self.state = torch.zeros(2, dtype=torch.long, device=dev)
        self.seed = torch.zeros(1, dtype=torch.long, device=dev)
        self.out = torch.zeros(CHUNK, dtype=torch.long, device=dev)
        self.mode = None            # None (untried), "graph", "eager", "legacy"
        # The fused Triton step where it applies (checked against GPT.decode_step before its first use).
        self.scratch = decode_kernels.DecodeScratch(model) if decode_kernels.supports(model) else None
        self.fused_checked = False
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.busy = False

    @property
    def kernels(self) -> str:
        """What computes a decoding step: "triton" (oelm_core.decode_kernels) or "torch"."""
        return "triton" if self.scratch is not None else "torch"

    @property
    def length(self) -> int:
        """Positions of the cache in use (the host's copy of ``state[0]``)."""
        return self.cache.length

    def reset(self) -> None:
        """Forget the context (positions past ``length`` are masked, so nothing is cleared)."""
        self.cache.length = 0

    def set_seed(self, seed: int) -> None:
        self.seed.copy_(seed_tensor(seed, "cpu"))

    def prefill(self, model: GPT, ids: list[int], step: int, cfg: SamplingConfig) -> int:
        """Run ``ids`` from position ``length`` and sample token number ``step`` after them."""
        x = torch.tensor([ids], device=self.token.device)
        logits = model.logits(model.hidden(x, self.cache)[:, -1])  # the last position's only
        self.state.copy_(torch.tensor([self.cache.length, step]))
        self.token.copy_(sample(logits, cfg, self.seed, self.state[1:]).view(1, 1))
        self.state[1] += 1
        return int(self.token)

    def _steps(self, model: GPT, n: int, cfg: SamplingConfig, decode=None) -> None:
        """n decoding steps on the device state; fixed shapes throughout. ``decode(model)`` gives
        the logits (1, vocab) of ``token`` at ``state[0]``; by default the fixed-shape step."""
        decode = decode or self._decode
        for i in range(n):
            logits = decode(model)
            self.out[i:i + 1].copy_(sample(logits, cfg, self.seed, self.state[1:]))
            self.token.copy_(self.out[i:i + 1].view(1, 1))
            self.state += 1

    def _decode(self, model: GPT) -> torch.Tensor:
        if self.scratch is not None:
            return decode_kernels.decode_step(model, self.token, self.state[:1], self.cache, self.scratch)
        return model.decode_step(self.token, self.state[:1], self.cache)

    def _check_fused(self, model: GPT) -> None:
        """Compare one fused step with ``GPT.decode_step`` on the current state (both write the
        same keys and values at pos); on a mismatch or an error, decode with PyTorch instead."""
        try:
            fused = decode_kernels.decode_step(model, self.token, self.state[:1], self.cache, self.scratch)
            ref = model.decode_step(self.token, self.state[:1], self.cache).float()
            # float32 agrees to ~1e-6; bfloat16 to ~1e-2, the fused path keeping float32 inside.
            tol = (1e-3 if model.wte.weight.dtype == torch.float32 else 5e-2) * max(1.0, float(ref.abs().max()))
            err = float((fused - ref).abs().max())
            if not err <= tol:
                raise RuntimeError(f"max |difference| {err:.2e} > {tol:.2e}")
        except Exception as e:
            warnings.warn(f"the fused decode kernels disagree with GPT.decode_step or failed ({e}); "
                          f"decoding with PyTorch")
            self.scratch = None

    def _legacy_steps(self, model: GPT, n: int, cfg: SamplingConfig) -> None:
        """The steps through the growing-cache path, ``model.hidden(x, cache)``."""
        self._steps(model, n, cfg, lambda m: m.logits(m.hidden(self.token, self.cache)[:, -1]))
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
        """Feed the pending token and sample n more (positions length .. length + n - 1)."""
        if not 1 <= n <= CHUNK:
            raise ValueError(f"run() takes 1 to {CHUNK} steps, got {n}")
        if self.length + n > self.block:
            raise ValueError(f"the context of {self.block} tokens is full; reset and prefill")
        key = (n, cfg.temperature, cfg.top_k, cfg.top_p)
        if self.scratch is not None and not self.fused_checked:
            self._check_fused(model)
            self.fused_checked = True
        if self.mode in (None, "graph") and key not in self.graphs and self.cuda and not model.training:
            self._capture(model, n, cfg)
        elif self.mode in (None, "graph") and key in self.graphs:
            self.graphs[key].replay()
        elif self.mode == "legacy":
            self._legacy_steps(model, n, cfg)
        else:
            self.mode = "eager"
            try:
                self._steps(model, n, cfg)
            except Exception as e:  # pragma: no cover - a device without index_copy_/SDPA masks
                warnings.warn(f"fixed-shape decode step failed ({e}); using the plain cached path")
                self.mode = "legacy"
                self._legacy_steps(model, n, cfg)
        self.cache.length += n
        return self.out[:n].tolist()


_DECODERS: "weakref.WeakKeyDictionary[GPT, GraphDecoder]" = weakref.WeakKeyDictionary()
_DECODERS_LOCK = threading.Lock()


def acquire_decoder(model: GPT) -> GraphDecoder:
    """The model's decoder (captured once, reused) if it is free and still matches the model's
    weights and mode; a new one otherwise. Release it with ``release_decoder``."""
    signature = _state_signature(model)
    with _DECODERS_LOCK:
        decoder = _DECODERS.get(model)
        if decoder is not None and not decoder.busy and decoder.signature == signature:
            decoder.busy = True
            decoder.reset()
            return decoder
        decoder = GraphDecoder(model)
        decoder.busy = True
        if model not in _DECODERS or not _DECODERS[model].busy:
            _DECODERS[model] = decoder  # a stale or missing one is replaced; a busy one stays
        return decoder


def release_decoder(decoder: GraphDecoder) -> None:
    with _DECODERS_LOCK:
        decoder.busy = False


@torch.no_grad()
def stream_tokens(model: GPT, prompt_ids: list[int], cfg: SamplingConfig) -> Iterator[int]:
    """Yield new token ids one by one. When the context would pass block_size it restarts from
    its most recent block_size // 2 tokens, on the cached and the uncached path alike."""
    cfg.validate()
    block, vocab = model.cfg.block_size, model.cfg.vocab_size
    if not prompt_ids:
        if EOT >= vocab:
            raise ValueError(f"an empty prompt starts from <|endoftext|> (id {EOT}), but this model's "
                             f"vocabulary has {vocab} ids (0..{vocab - 1}): give a prompt of at least "
                             f"one token id below {vocab}")
        prompt_ids = [EOT]  # an empty prompt starts a story, as after a document boundary
    outside = [i for i in prompt_ids if not 0 <= i < vocab]
    if outside:
        raise ValueError(f"prompt token ids {outside[:5]} are outside this model's vocabulary of {vocab} "
                         f"ids (0..{vocab - 1}): the prompt was encoded with another tokenizer than the "
                         f"model's (GPT-2 BPE has {EOT + 1} ids); encode it with the tokenizer the "
                         f"model was trained with")
    if len(prompt_ids) >= block:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in the context of "
                         f"{block} tokens; shorten it to fewer than {block} tokens")
    # Not torch.seed(): that would reseed the global generator the caller may rely on.
    seed = cfg.seed if cfg.seed is not None else secrets.randbits(64)
    if cfg.use_cache:
        yield from _stream_cached(model, list(prompt_ids), cfg, seed)
        return
    device = model.wte.weight.device
    seed_t = seed_tensor(seed, device)
    ids, start = list(prompt_ids), 0
    for step in range(cfg.max_new_tokens):
        if len(ids) - start > block:
            start = len(ids) - block // 2  # the window policy of the cached path (see _stream_cached)
        # The output layer for the last position only: the others' logits are never used.
        logits = model.logits(model.hidden(torch.tensor([ids[start:]], device=device))[:, -1])
        token = int(sample(logits, cfg, seed_t, torch.tensor([step], device=device)))
        if cfg.stop_at_eot and token == EOT:
            return
        ids.append(token)
        yield token


def _stream_cached(model: GPT, ids: list[int], cfg: SamplingConfig, seed: int) -> Iterator[int]:
    block = model.cfg.block_size
    decoder = acquire_decoder(model)
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
                # Window full. Learned absolute positions mean the kept tokens must be encoded
                # again at new positions, so keep the most recent half: one prefill per block // 2
                # tokens, not one per token (the uncached path follows the same policy).
                decoder.reset()
                new = [decoder.prefill(model, ids[-(block // 2):], produced, cfg)]
            else:
                # Whole chunks while they fit; single steps at the end of the window or the text.
                n = CHUNK if room >= CHUNK and left >= CHUNK // 2 else 1
                new = decoder.run(model, n, cfg)
    finally:
        release_decoder(decoder)


def detokenize(tokens: Iterable[int], tokenizer) -> Iterator[str]:
    """Text pieces of ``tokens`` as they arrive. Whole characters only while tokens keep coming:
    a multi-byte character split across tokens is held back until it is complete. What is held
    back when they end (a character the last token left unfinished) comes out last, as the
    tokenizer decodes it, so the pieces join to ``tokenizer.decode(tokens)``."""
    new: list[int] = []
    emitted = 0
    for token in tokens:
        new.append(token)
        text = tokenizer.decode(new)
        if not text.endswith("\ufffd"):
            yield text[emitted:]
            emitted = len(text)
    rest = tokenizer.decode(new)[emitted:]
    if rest:
        yield rest


def stream(model: GPT, prompt: str, cfg: SamplingConfig | None = None, tokenizer=None) -> Iterator[str]:
    """Yield pieces of text as they are produced (``detokenize``: whole characters, but for an
    unfinished one at the very end)."""
    enc = tokenizer or get_tokenizer()
    yield from detokenize(stream_tokens(model, enc.encode_ordinary(prompt), cfg or SamplingConfig()), enc)


def generate(model: GPT, prompt: str, cfg: SamplingConfig | None = None, tokenizer=None) -> str:
    """The prompt's continuation as one string: ``tokenizer.decode`` of the new tokens."""
    return "".join(stream(model, prompt, cfg, tokenizer))
