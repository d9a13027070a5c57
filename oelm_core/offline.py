"""Offline use: one command that points every oelm_core command at local data, and a quick
check that the Hugging Face hub answers before ``datasets`` is asked for anything.

    python -m oelm_core.offline ../shared/data      # once: writes oelm.env at the checkout's root
    python -m oelm_core.offline --off               # removes it: back to the hub

The folder is laid out like ``../shared/data``: ``tinystories/`` (train/ and validation/ story
files) and ``tokenizer/tiktoken_cache/`` (the GPT-2 BPE files under tiktoken's cache names).
The file (``oelm_core.envfile``) sets OELM_DATA, TIKTOKEN_CACHE_DIR, and HF_HUB_OFFLINE and
HF_DATASETS_OFFLINE, so that nothing of the Hugging Face libraries tries the network.

``hub_unreachable`` answers at once where a name does not resolve, and within
``PROBE_TIMEOUT_S`` where a connection goes unanswered: a missing local copy is reported
before ``datasets`` spends half a minute retrying.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from oelm_core import envfile

PROBE_TIMEOUT_S = 3.0
OFFLINE_HINT = "`python -m oelm_core.offline ../shared/data` does that once for every command"
OFFLINE_FLAGS = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", "https://huggingface.co")


def offline_flag() -> Optional[str]:
    """The variable that puts the Hugging Face libraries offline, where one is set true."""
    return next((f for f in OFFLINE_FLAGS if os.environ.get(f, "").strip().lower() in ("1", "true", "yes", "on")), None)


@functools.lru_cache(maxsize=1)
def hub_unreachable() -> Optional[str]:
    """Why the Hugging Face hub cannot be reached (asked once per process), or None where it
    answers. Any HTTP answer counts as reachable; the environment's proxies are used."""
    request = urllib.request.Request(hub_endpoint(), method="HEAD")
    try:
        urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as exc:
        return f"{hub_endpoint()} did not answer: {getattr(exc, 'reason', exc)}"
    return None


def settings_for(stories: Path, tiktoken_cache: Path) -> dict[str, str]:
    """oelm.env's variables for a story folder and a tiktoken cache; ValueError naming what is
    missing."""
    stories, tiktoken_cache = stories.expanduser().resolve(), tiktoken_cache.expanduser().resolve()
    if not (stories / "train").is_dir():
        raise ValueError(
            f"{stories} has no train/ folder: give the folder of TinyStories text "
            f"(train/ and validation/), e.g. ../shared/data/tinystories"
        )
    if not tiktoken_cache.is_dir() or not any(tiktoken_cache.iterdir()):
        raise ValueError(
            f"{tiktoken_cache} is not a folder holding the GPT-2 BPE files (tiktoken's cache), "
            f"e.g. ../shared/data/tokenizer/tiktoken_cache"
        )
    return {
        "OELM_DATA": str(stories),
        "TIKTOKEN_CACHE_DIR": str(tiktoken_cache),
        **{flag: "1" for flag in OFFLINE_FLAGS},
    }


def main(argv: Optional[list[str]] = None) -> int:
    """The CLI: 0 written (the file is printed) or removed, 2 with one error line."""
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(
        prog="python -m oelm_core.offline", description="Point every oelm_core command at local data: writes oelm.env."
    )
    p.add_argument(
        "data", nargs="?", help="a folder holding tinystories/ and tokenizer/tiktoken_cache/ (e.g. ../shared/data)"
    )
    p.add_argument("--stories", type=Path, help="the TinyStories folder (default: DATA/tinystories)")
    p.add_argument("--tiktoken-cache", type=Path, help="the GPT-2 BPE files (default: DATA/tokenizer/tiktoken_cache)")
    p.add_argument("--file", type=Path, help=f"the file to write (default: {envfile.default_target()})")
    p.add_argument("--off", action="store_true", help="remove the file: commands read the hub again")
    args = p.parse_args(argv)
    file = args.file or envfile.default_target()
    try:
        if args.off:
            if file.is_file() and not envfile.written_here(file):
                raise ValueError(f"{file} was not written by oelm_core; left as it is")
            file.unlink(missing_ok=True)
            print(f"removed {file}: commands read the Hugging Face hub (or OELM_DATA, where set) again")
            return 0
        if args.data is None and not (args.stories and args.tiktoken_cache):
            raise ValueError("give the data folder (e.g. ../shared/data), or both --stories and --tiktoken-cache")
        root = Path(args.data or ".")
        settings = settings_for(
            args.stories or root / "tinystories", args.tiktoken_cache or root / "tokenizer" / "tiktoken_cache"
        )
        envfile.write(
            file,
            settings,
            [
                f"python -m oelm_core.offline {' '.join(argv)}",
                "Every oelm_core command reads this file; a variable set in the environment wins.",
                "OELM_DATA replaces data.source; HF_*_OFFLINE keep the Hugging Face libraries off the network.",
            ],
        )
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(file.read_text(encoding="utf-8"), end="")
    print(f"(written to {file})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
