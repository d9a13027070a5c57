"""Sampling from a trained GPT: KV-cached, seeded, streaming.

``stream(model, prompt)`` yields text pieces as they are produced; ``generate`` joins them.
The cache and the plain path compute the same logits (tested); the cache only avoids
recomputing the keys and values of tokens already seen. After the prompt's prefill, each new
token goes through ``GraphDecoder``: a fixed-shape one-token step (``GPT.decode_step``: keys and
values written at a position held in a device tensor, attention over the whole block_size cache
under a position mask), replayed as one CUDA graph on GPUs and run eagerly elsewhere.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from oelm_core.data import EOT, get_tokenizer  # EOT ends every story in the training data
from oelm_core.model import GPT


@dataclass
class SamplingConfig:
    max_new_tokens: int = 200
    temperature: float = 0.8     # 0 picks the most likely token (greedy)
    top_k: int = 0               # 0: no top-k cut
    top_p: float = 1.0           # 1.0: no nucleus cut
    seed: Optional[int] = None
    stop_at_eot: bool = True
    use_cache: bool = True

    def validate(self) -> "SamplingConfig":
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        return self


def sample_next(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator) -> int:
    """logits: (vocab,) of the last position -> the next token id."""
    if cfg.temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / cfg.temperature
    if cfg.top_k:
        kth = torch.topk(logits, min(cfg.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if cfg.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        # Keep the smallest set whose mass reaches top_p (the first token always stays).
        drop = sorted_p.cumsum(0) - sorted_p >= cfg.top_p
        sorted_p[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    # Sampling on the CPU with a CPU generator makes a seed give the same text on any device.
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def _state_signature(model: GPT) -> tuple:
    """What a captured decode step depends on: where every weight lives, the mode, autocast."""
    dev = model.wte.weight.device
    tensors = [t for _, t in model.named_parameters()] + [t for _, t in model.named_buffers()]
    autocast = (torch.is_autocast_enabled(dev.type), torch.get_autocast_dtype(dev.type)) \
        if dev.type in ("cuda", "cpu") else (False, None)
    return (str(dev), model.training, autocast,
            tuple((t.data_ptr(), t.dtype, tuple(t.shape)) for t in tensors))


class GraphDecoder:
    """KV-cached decoding for one sequence with a fixed-shape one-token step.

    ``prefill(model, ids)`` runs the prompt through the ordinary cached path
    (``model(x, cache=cache)``); ``step(model, token)`` runs ``GPT.decode_step`` for one token at
    position ``cache.length``: the token id and the position go into static device tensors, so
    on CUDA the step is captured once in a CUDA graph (after a warm-up on a side stream) and
    every later token is one graph replay instead of ~100 kernel launches from Python.
    Elsewhere, in training mode, or if the capture fails or disagrees with the eager step, the
    same step runs eagerly; if even that fails it falls back to ``model(x, cache=cache)``.
    Both return the logits of the last position as a CPU float tensor (vocab,), ready for
    ``sample_next``.

    The decoder holds no reference to the model (it is passed in), so ``_DECODERS`` can keep one
    per model, weakly, across calls: capture happens once, not once per generation.
    """

    def __init__(self, model: GPT):
        self.signature = _state_signature(model)
        self.block = model.cfg.block_size
        self.cache = model.new_cache()
        dev = model.wte.weight.device
        self.cuda = dev.type == "cuda"
        self.idx = torch.zeros((1, 1), dtype=torch.long, device=dev)  # static inputs
        self.pos = torch.zeros((1,), dtype=torch.long, device=dev)
        self.mode = None            # None (untried), "graph", "eager", "legacy"
        self.graph = None
        self.graph_out = None
        self.host = None
        if self.cuda:
            try:  # pinned, so the per-token copy of the logits is one fast DMA
                self.host = torch.empty(model.cfg.vocab_size, dtype=torch.float32, pin_memory=True)
            except Exception:  # pragma: no cover - depends on the machine
                self.host = None
        self.busy = False

    @property
    def length(self) -> int:
        return self.cache.length

    def reset(self) -> None:
        """Forget the context (positions past ``length`` are masked, so nothing is cleared)."""
        self.cache.length = 0

    def _to_host(self, logits: torch.Tensor) -> torch.Tensor:
        """(vocab,) logits -> float32 on the CPU (one small copy, which waits for the step)."""
        if self.host is not None and logits.is_cuda:
            self.host.copy_(logits.float(), non_blocking=True)
            torch.cuda.current_stream(logits.device).synchronize()
            return self.host
        return logits.float().cpu()

    def prefill(self, model: GPT, ids: list[int]) -> torch.Tensor:
        x = torch.tensor([ids], device=self.idx.device)
        logits = model(x, cache=self.cache)[0, -1]
        return self._to_host(logits)

    def _eager(self, model: GPT) -> torch.Tensor:
        return model.decode_step(self.idx, self.pos, self.cache)

    def _capture(self, model: GPT) -> None:
        """Warm up on a side stream, capture, and check one replay against the eager step."""
        try:
            s = torch.cuda.Stream(device=self.idx.device)
            s.wait_stream(torch.cuda.current_stream(self.idx.device))
            with torch.cuda.stream(s):
                for _ in range(2):  # the same token at the same position: idempotent writes
                    ref = self._eager(model)
                ref = ref.clone()
            torch.cuda.current_stream(self.idx.device).wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = self._eager(model)
            graph.replay()
            if not torch.allclose(out.float(), ref.float(), rtol=1e-4, atol=1e-4, equal_nan=True):
                raise RuntimeError("the replayed decode step disagrees with the eager one")
            self.graph, self.graph_out, self.mode = graph, out, "graph"
        except Exception as e:  # keep generating: the eager fixed-shape step is the same math
            warnings.warn(f"CUDA graph capture of the decode step failed ({e}); decoding eagerly")
            self.graph, self.graph_out = None, None
            self.mode = "eager"

    def step(self, model: GPT, token: int) -> torch.Tensor:
        """Feed ``token`` at position ``length`` (< block_size) -> CPU logits (vocab,)."""
        pos = self.cache.length
        if pos >= self.block:
            raise ValueError(f"the context of {self.block} tokens is full; reset and prefill")
        if self.mode == "legacy":
            return self.prefill(model, [token])
        self.idx.fill_(token)
        self.pos.fill_(pos)
        if self.mode is None:
            if self.cuda and not model.training:
                self._capture(model)  # leaves this step's result in graph_out, or mode "eager"
            else:
                self.mode = "eager"
            if self.mode == "eager":
                try:
                    out = self._eager(model)
                except Exception as e:  # pragma: no cover - a device without index_copy_/SDPA masks
                    warnings.warn(f"fixed-shape decode step failed ({e}); using the plain cached path")
                    self.mode = "legacy"
                    return self.prefill(model, [token])
            else:
                out = self.graph_out
        elif self.mode == "graph":
            self.graph.replay()
            out = self.graph_out
        else:
            out = self._eager(model)
        self.cache.length = pos + 1
        return self._to_host(out[0])


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
    """Yield new token ids one by one. Context past block_size keeps its most recent tokens."""
    cfg.validate()
    block = model.cfg.block_size
    if not prompt_ids:
        prompt_ids = [EOT]  # an empty prompt starts a story, as after a document boundary
    if len(prompt_ids) >= block:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens leaves no room in the context of "
                         f"{block} tokens; shorten it to fewer than {block} tokens")
    generator = torch.Generator().manual_seed(cfg.seed if cfg.seed is not None else torch.seed())
    if cfg.use_cache:
        yield from _stream_cached(model, prompt_ids, cfg, generator)
        return
    device = model.wte.weight.device
    ids = list(prompt_ids)
    for _ in range(cfg.max_new_tokens):
        logits = model(torch.tensor([ids[-block:]], device=device))[0, -1]
        token = sample_next(logits, cfg, generator)
        if cfg.stop_at_eot and token == EOT:
            return
        ids.append(token)
        yield token


def _stream_cached(model: GPT, prompt_ids: list[int], cfg: SamplingConfig,
                   generator: torch.Generator) -> Iterator[int]:
    block = model.cfg.block_size
    ids = list(prompt_ids)
    decoder = acquire_decoder(model)
    try:
        pending = ids  # tokens the model has not seen yet
        for _ in range(cfg.max_new_tokens):
            if decoder.length + len(pending) > block:
                decoder.reset()  # window full: start again from the most recent tokens
                pending = ids[-(block - 1):]
            if len(pending) == 1:
                logits = decoder.step(model, pending[0])
            else:
                logits = decoder.prefill(model, pending)
            token = sample_next(logits, cfg, generator)
            if cfg.stop_at_eot and token == EOT:
                return
            ids.append(token)
            pending = [token]
            yield token
    finally:
        release_decoder(decoder)


def stream(model: GPT, prompt: str, cfg: SamplingConfig | None = None, tokenizer=None) -> Iterator[str]:
    """Yield pieces of text as they are produced (whole characters only: a multi-byte
    character split across tokens is held back until it is complete)."""
    enc = tokenizer or get_tokenizer()
    cfg = cfg or SamplingConfig()
    new: list[int] = []
    emitted = 0
    for token in stream_tokens(model, enc.encode_ordinary(prompt), cfg):
        new.append(token)
        text = enc.decode(new)
        if not text.endswith("\ufffd"):
            yield text[emitted:]
            emitted = len(text)


def generate(model: GPT, prompt: str, cfg: SamplingConfig | None = None, tokenizer=None) -> str:
    """The prompt's continuation as one string."""
    return "".join(stream(model, prompt, cfg, tokenizer))
