"""Shared test set-up: the offline GPT-2 BPE files, and tiny corpora the tests write themselves."""

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
_SHARED_TOKENIZER = REPO.parent / "shared" / "data" / "tokenizer" / "tiktoken_cache"

# tiktoken reads TIKTOKEN_CACHE_DIR when it first loads an encoding; CI sets it, and a developer
# checkout beside ../shared gets it here so `pytest` alone works too.
if "TIKTOKEN_CACHE_DIR" not in os.environ and _SHARED_TOKENIZER.is_dir():
    os.environ["TIKTOKEN_CACHE_DIR"] = str(_SHARED_TOKENIZER)

STORIES = [
    "Once upon a time there was a little cat named Tom. Tom liked to play in the sun.",
    "Lily had a red ball. She threw it high and her dog ran to get it. They were happy.",
    "The big tree was very old. One day a bird made a nest in it and sang every morning.",
    "Ben wanted to fly a kite. The wind was strong, so the kite went up and up.",
    "Sue found a shiny stone by the river. She gave it to her mom, who smiled.",
    "A small boat sailed on the lake. A fish jumped out of the water and said hello.",
]


@pytest.fixture
def story_folder(tmp_path: Path) -> Path:
    """A corpus in the TinyStories text layout: train/ and validation/ with <|endoftext|> separators."""
    root = tmp_path / "stories"
    (root / "train").mkdir(parents=True)
    (root / "validation").mkdir()
    train = (STORIES * 20)
    (root / "train" / "part.txt").write_text("\n<|endoftext|>\n".join(train) + "\n<|endoftext|>\n")
    (root / "validation" / "part.txt").write_text("<|endoftext|>".join(STORIES[:3] * 10))
    return root


@pytest.fixture
def one_thread():
    """Small CPU tensors: one thread is faster, and immune to a busy machine's oversubscription."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
