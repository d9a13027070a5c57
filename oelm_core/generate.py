"""Sampling from a trained GPT: KV-cached, seeded, streaming.

``stream(model, prompt)`` yields text pieces as they are produced; ``generate`` joins them.
The cache and the plain path compute the same logits (tested); the cache only avoids
recomputing the keys and values of tokens already seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional

import torch

from oelm_core.model import GPT

EOT = 50256  # GPT-2's <|endoftext|>, which ends every story in the training data


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
    device = model.wte.weight.device
    ids = list(prompt_ids)
    cache = model.new_cache() if cfg.use_cache else None
    pending = ids  # tokens the model has not seen yet
    for _ in range(cfg.max_new_tokens):
        if cache is not None and cache.length + len(pending) > block:
            cache = model.new_cache()  # window full: start again from the most recent tokens
            pending = ids[-(block - 1):]
        x = torch.tensor([pending if cache is not None else ids[-block:]], device=device)
        logits = model(x, cache=cache)[0, -1]
        token = sample_next(logits, cfg, generator)
        if cfg.stop_at_eot and token == EOT:
            return
        ids.append(token)
        pending = [token]
        yield token


def stream(model: GPT, prompt: str, cfg: SamplingConfig | None = None, tokenizer=None) -> Iterator[str]:
    """Yield pieces of text as they are produced (whole characters only: a multi-byte
    character split across tokens is held back until it is complete)."""
    from oelm_core.data import get_tokenizer

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
