"""Batches from the prepared token files, and the figures that need their bytes per token.

``TokenSampler`` draws random (x, y) windows from a .bin file (``oelm_core.data.prepare`` writes
it) through a memory map; its randomness is keyed by (seed, rank, batch number), so resuming needs
only the batch count. ``eval_batches`` gives the same validation windows on every call, from the
whole file or from one of its halves (train.report_holdout). ``bits_per_byte`` and ``perplexity``
turn a mean loss into the figures results report.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from oelm_core.config import ConfigError
from oelm_core.data import VOCAB_SIZE, prepare_hint, rebuild_hint

# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


def _open_tokens(bin_path: str | Path, block_size: int, vocab_size: int = VOCAB_SIZE) -> np.memmap:
    """The token file as a uint16 memmap, after checking that it holds whole tokens, at least one
    window of block_size + 1 of them, and no id past ``vocab_size`` (the tokenizer's: a file
    damaged in place keeps its size, and its ids reached torch.embedding as a bare IndexError).
    The largest id is one pass over the map, once per run: cheap next to the training."""
    path = Path(bin_path)
    if not path.is_file():
        raise ConfigError(f"token file {path} not found; {prepare_hint(path.parent)}")
    size = path.stat().st_size
    if size == 0 or size % 2:  # np.memmap's own errors name neither the file nor the fix
        raise ConfigError(
            f"{path} holds {size} bytes, not a whole number of 2-byte (uint16) tokens "
            f"(an interrupted or foreign write); {rebuild_hint(path.parent)}"
        )
    data = np.memmap(path, dtype=np.uint16, mode="r")
    if len(data) < block_size + 1:
        raise ConfigError(
            f"{path} holds {len(data)} tokens, fewer than block_size + 1 = "
            f"{block_size + 1}; use a smaller model.block_size or prepare more "
            f"stories (raise data.max_train_stories / data.max_val_stories)"
        )
    largest = int(data.max())
    if largest >= vocab_size:
        past = data >= vocab_size
        raise ConfigError(
            f"{path} holds {int(past.sum())} token id(s) past the {vocab_size}-token vocabulary it "
            f"was prepared with (ids 0..{vocab_size - 1}), the largest {largest}, the first at "
            f"position {int(past.argmax())}: the file was damaged or written by something else; "
            f"{rebuild_hint(path.parent)}"
        )
    return data


def _windows(data: np.ndarray, starts: np.ndarray, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x = tokens[s : s+T], y = tokens[s+1 : s+T+1] for each start s; int64, (len(starts), T)."""
    rows = torch.from_numpy(data[starts[:, None] + np.arange(block_size + 1)].astype(np.int64))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


class TokenSampler:
    """Random training windows from a flat uint16 token file.

    Batch i on rank r draws its window starts from np.random.default_rng([seed, r, i]): ranks see
    different windows, and the whole state is the batch count, so resuming is exact and O(1).
    ``vocab_size``: the vocabulary the file was prepared with (meta.json's); an id past it is a
    ConfigError on opening.
    """

    def __init__(
        self,
        bin_path: str | Path,
        block_size: int,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        vocab_size: int = VOCAB_SIZE,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1} (world_size {world_size})")
        if block_size <= 0 or batch_size <= 0:
            raise ConfigError(f"block_size and batch_size must be positive, got {block_size}, {batch_size}")
        self.data = _open_tokens(bin_path, block_size, vocab_size)
        self.block_size, self.batch_size = block_size, batch_size
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.batches_drawn = 0

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.block_size

    def next_batch(self, device: str | torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y): int64 (batch_size, block_size); y is x shifted by one token (the next-token targets)."""
        rng = np.random.default_rng([self.seed, self.rank, self.batches_drawn])
        self.batches_drawn += 1
        starts = rng.integers(0, len(self.data) - self.block_size, size=self.batch_size)
        x, y = _windows(self.data, starts, self.block_size)
        if device is not None:
            if torch.device(device).type == "cuda":
                # Page-locked memory lets the copy run asynchronously with the previous step.
                x = x.pin_memory().to(device, non_blocking=True)
                y = y.pin_memory().to(device, non_blocking=True)
            else:
                x, y = x.to(device), y.to(device)
        return x, y

    def state_dict(self) -> dict:
        return {"batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict) -> None:
        self.batches_drawn = int(state["batches_drawn"])


HALVES = {"all": None, "selection": 0, "report": 1}  # eval_batches' parts of the validation file


def eval_batches(
    bin_path: str | Path,
    block_size: int,
    batch_size: int,
    n_batches: int,
    seed: int = 1234,
    vocab_size: int = VOCAB_SIZE,
    part: str = "all",
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The same validation batches on every call: (x, y) int64 CPU tensors (<= batch_size, block_size).

    Windows are non-overlapping slots of block_size + 1 tokens; a fixed-seed draw picks
    batch_size * n_batches of them spread over the whole file, so val losses compare across steps
    and runs. A file with fewer slots gives all of them (the last batch may then be smaller).
    ``part``: "all" the file's slots; "selection" the first half of them, "report" the second
    (train.report_holdout): no window of one half overlaps the other. ``vocab_size`` as
    TokenSampler's.
    """
    data = _open_tokens(bin_path, block_size, vocab_size)
    slots = (len(data) - 1) // block_size  # window k covers tokens [k*T, k*T + T] (T+1 tokens)
    first, end = 0, slots
    if HALVES[part] is not None:
        if slots < 2:
            raise ConfigError(
                f"{bin_path} holds {len(data)} tokens, one window of block_size + 1 = "
                f"{block_size + 1}: too few to hold out half of them for reporting. Prepare "
                f"more validation stories (data.max_val_stories) or set train.report_holdout: false"
            )
        first, end = (0, slots // 2) if HALVES[part] == 0 else (slots // 2, slots)
    want = batch_size * n_batches
    if end - first >= want:
        chosen = first + np.sort(np.random.default_rng(seed).choice(end - first, size=want, replace=False))
    else:
        chosen = np.arange(first, end)
    starts = chosen * block_size
    return [_windows(data, starts[i : i + batch_size], block_size) for i in range(0, len(starts), batch_size)]


# --------------------------------------------------------------------------------------------
# Metrics that need the data's bytes per token
# --------------------------------------------------------------------------------------------


def bits_per_byte(loss_nats: float, tokens: int, bytes_: int) -> float:
    """Mean loss (nats/token) as bits per UTF-8 byte of text: loss * tokens / (bytes * ln 2).

    Unlike loss per token it compares across tokenisers; use the split's tokens and bytes from meta.json.
    """
    return loss_nats * tokens / (bytes_ * math.log(2))


def perplexity(loss_nats: float) -> float:
    """exp(mean loss); inf rather than an OverflowError for a diverged run."""
    try:
        return math.exp(loss_nats)
    except OverflowError:
        return float("inf")
