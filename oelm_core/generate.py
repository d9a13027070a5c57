"""Sampling from a trained GPT: seeded, streaming, KV-cached. The reference generation.

``stream(model, prompt)`` yields text pieces as they are produced; ``generate`` joins them;
``stream_tokens`` yields the token ids. The loop is nanoGPT's sample loop with a KV cache: run
the prompt through ``model(idx, cache=cache)`` once (the prefill), then feed one token at a
time, each drawn from the last position's logits.

A token is argmax(logits / T + Gumbel noise) over the ids that top-k / top-p allow (the
Gumbel-max trick: a sample of softmax(logits / T) restricted to them). The noise is a
counter-based hash of (seed, step, token id) (``gumbel_noise``), not a generator's state: a seed
gives the same noise on every device, the cached and uncached paths draw the k-th token with the
same noise, and so does the fast decoder, whose steps can then run inside a CUDA graph.

This file is the reference and imports no fast path. ``stream_tokens`` decodes with the
``decoder`` it is given, this loop (``reference_tokens``) by default; ``oelm_core.fast.decoder``
answers with the fast decoder (``oelm_core.fast.decode``) where ``SamplingConfig.fast`` (the
default) and the KV cache allow it, and ``oelm_core.fast.stream_tokens`` decodes with what it
answers: the same tokens (tested against this loop), fewer kernel launches and host round trips.
"""

from __future__ import annotations

import secrets
from typing import Callable, Iterable, Iterator, Optional

import torch

from oelm_core.config import SamplingConfig  # the settings, checked by the schema's builder
from oelm_core.data import EOT, EOT_TEXT, get_tokenizer  # EOT ends every story in the training data
from oelm_core.model import GPT, KVCache

# --------------------------------------------------------------------------------------------
# The sampler: counter-based Gumbel noise, the same on every path and device
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
    key = _hash32((_hash32(seed) + steps * 0x9E3779B9) & _M32)  # (n_steps,)
    ids = torch.arange(vocab, device=step.device)
    h = _hash32((key[:, None] + ids[None, :] * 0x85EBCA77) & _M32)  # (n_steps, vocab)
    return -torch.log(-torch.log(_uniform(h)))


def _uniform(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes (int64 tensor) -> float32 in (0, 1), strictly, from their top 23 bits."""
    return ((h >> 9).float() + 0.5) * (1.0 / (1 << 23))


def sample_from_noise(logits: torch.Tensor, cfg: SamplingConfig, noise: torch.Tensor) -> torch.Tensor:
    """The draw, given the noise (vocab,) from ``gumbel_noise``: argmax of logits / T + noise
    over the ids that top-k and then top-p keep (both keep every id tied with the last one kept).
    logits (..., vocab) -> token ids (...,) int64."""
    x = logits.float() * cfg.inv_temperature
    if cfg.top_k_for(x.size(-1)):
        kth = torch.topk(x, cfg.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_x = torch.sort(x, dim=-1, descending=True).values
        p = torch.softmax(sorted_x, dim=-1)
        # The smallest prefix whose mass reaches top_p (the most likely token always stays) ends
        # at the cut; every id at or above it stays, so tied ids stay or go together, whatever
        # order the sort left them in (the fast sampler's rule too).
        n_keep = (p.cumsum(-1) - p < cfg.top_p).sum(-1, keepdim=True)
        x = x.masked_fill(x < sorted_x.gather(-1, n_keep - 1), float("-inf"))
    return (x + noise).argmax(-1)


def sample(
    logits: torch.Tensor, cfg: SamplingConfig, seed: Optional[torch.Tensor] = None, step: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """logits (..., vocab); seed, step: one-element int64 tensors on the logits' device, the
    noise of draw number ``step`` (unused when greedy) -> token ids (...,) int64 on that device,
    without waiting for it (no host synchronisation, no data-dependent shape)."""
    if cfg.greedy:
        return logits.argmax(-1)
    return sample_from_noise(logits, cfg, gumbel_noise(seed, step, 1, logits.size(-1))[0])


# --------------------------------------------------------------------------------------------
# The generation loop
# --------------------------------------------------------------------------------------------


def prepare(model: GPT, prompt_ids: list[int], cfg: SamplingConfig) -> tuple[list[int], int]:
    """Check ``cfg`` and the prompt against ``model`` -> (the prompt's ids, the seed to draw
    with). An empty prompt starts a story: [<|endoftext|>]."""
    cfg.validate()
    block, vocab = model.cfg.block_size, model.cfg.vocab_size
    if not prompt_ids:
        if EOT >= vocab:
            raise ValueError(
                f"an empty prompt starts from <|endoftext|> (id {EOT}), but this model's "
                f"vocabulary has {vocab} ids (0..{vocab - 1}): give a prompt of at least "
                f"one token id below {vocab}"
            )
        prompt_ids = [EOT]  # as after a document boundary in the training data
    outside = [i for i in prompt_ids if not 0 <= i < vocab]
    if outside:
        raise ValueError(
            f"prompt token ids {outside[:5]} are outside this model's vocabulary of {vocab} "
            f"ids (0..{vocab - 1}): the prompt was encoded with another tokenizer than the "
            f"model's (GPT-2 BPE has {EOT + 1} ids); encode it with the tokenizer the "
            f"model was trained with"
        )
    if len(prompt_ids) >= block:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens leaves no room in the context of "
            f"{block} tokens; shorten it to fewer than {block} tokens"
        )
    # Not torch.seed(): that would reseed the global generator the caller may rely on.
    seed = cfg.seed if cfg.seed is not None else secrets.randbits(64)
    return list(prompt_ids), seed


def last_logits(model: GPT, idx: torch.Tensor, cache: Optional[KVCache] = None) -> torch.Tensor:
    """idx (1, T) -> the logits (1, vocab_size) of its last position: ``model(idx, cache=cache)
    [:, -1]`` with the output layer run on that position only (the others' are never used)."""
    return model.logits(model.hidden(idx, cache)[:, -1])


def reference_tokens(model: GPT, ids: list[int], cfg: SamplingConfig, seed: int) -> Iterator[int]:
    """The reference decoding loop: new token ids one by one after the checked prompt ``ids``
    (``prepare``). The window is ``ids[start:]``; with the cache, the model is fed only the
    window's tokens it has not seen. When the window would pass block_size it restarts from its
    most recent block_size // 2 tokens (learned absolute positions: the kept tokens must be
    encoded again at new positions; half a window means one prefill per block_size // 2 tokens,
    not one per token). The fast decoder follows the same policy."""
    block, device = model.cfg.block_size, model.wte.weight.device
    seed_t = seed_tensor(seed, device)
    cache = model.new_cache() if cfg.use_cache else None
    start = 0
    for step in range(cfg.max_new_tokens):
        if len(ids) - start > block:
            start = len(ids) - block // 2
            if cache is not None:
                cache.length = 0
        seen = cache.length if cache is not None else 0
        logits = last_logits(model, torch.tensor([ids[start + seen :]], device=device), cache)
        token = int(sample(logits, cfg, seed_t, torch.tensor([step], device=device)))
        if cfg.stop_at_eot and token == EOT:
            return
        ids.append(token)
        yield token


Decoder = Callable[[GPT, list, SamplingConfig, int], Iterator[int]]


@torch.no_grad()
def stream_tokens(
    model: GPT, prompt_ids: list[int], cfg: SamplingConfig, decoder: Decoder = reference_tokens
) -> Iterator[int]:
    """Yield new token ids one by one (at most ``cfg.max_new_tokens``; none past <|endoftext|>
    with ``cfg.stop_at_eot``), as ``decoder(model, ids, cfg, seed)`` draws them after the checked
    prompt: ``reference_tokens``, or what ``oelm_core.fast.decoder(model, cfg)`` answers. Same
    tokens either way."""
    ids, seed = prepare(model, prompt_ids, cfg)
    yield from decoder(model, ids, cfg, seed)


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
    ids = enc.encode(prompt, allowed_special={EOT_TEXT})  # <|endoftext|> typed: the token (data.encode_prompt)
    yield from detokenize(stream_tokens(model, ids, cfg or SamplingConfig()), enc)


def generate(model: GPT, prompt: str, cfg: SamplingConfig | None = None, tokenizer=None) -> str:
    """The prompt's continuation as one string: ``tokenizer.decode`` of the new tokens."""
    return "".join(stream(model, prompt, cfg, tokenizer))
