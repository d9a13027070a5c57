"""The folder an export writes, whichever the format: which --out it may replace (at most an
earlier export, never a folder holding other files), written whole under a lock, and what an
export killed there left removed first. Both formats and ``--format both`` write through it.
"""

from __future__ import annotations

import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from oelm_core.export.errors import ExportError
from oelm_core.files import LockHeld, atomic_folder, exclusive_lock

# Every name an export writes (both formats, and the two subfolders of --format both): a folder
# holding anything else is refused as --out rather than replaced.
EXPORT_NAMES = {
    "model.safetensors",
    "config.json",
    "README.md",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer_config.json",
    "safetensors",
    "transformers",
}
# What an export killed mid-way leaves in the folder that holds its --out (``atomic_folder``'s
# temporaries, the lock of ``_writing``), as a name pattern of {name}, the folder's name.
LEFT_BY_A_KILL = r"\.{name}\.(.+\.(tmp|old)|lock)"


def _out_folder(out_dir: str | Path) -> Path:
    """``out_dir`` when writing there replaces at most an earlier export: a folder holding anything
    else (an --out mistyped as the project's root) is refused, not deleted. What an export killed
    there left (its subfolders' temporaries, with --format both) is no other file."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; pass a folder (new, empty, or an earlier export)")
    ours = [re.compile(LEFT_BY_A_KILL.format(name=re.escape(name))) for name in EXPORT_NAMES]
    other = (
        sorted(
            p.name for p in out.iterdir() if p.name not in EXPORT_NAMES and not any(o.fullmatch(p.name) for o in ours)
        )
        if out.is_dir()
        else []
    )
    if other:
        raise ExportError(
            f"{out} holds files that no export writes ({', '.join(other[:5])}); replacing "
            f"the folder would delete them: pass a new or empty folder as --out"
        )
    return out


@contextmanager
def _writing(out: Path) -> Iterator[Path]:
    """Write the folder ``out`` (``atomic_folder``) holding ``.<name>.lock`` beside it, so that one
    export at a time writes there, and remove what an export killed there left first: its
    temporary ``.<name>.*.tmp`` and ``.<name>.*.old`` folders, which blocked the same command run
    again. ExportError where another export holds the lock; ``files.DiskFull`` on a full disk."""
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with exclusive_lock(out.parent / f".{out.name}.lock"):
            left = re.compile(LEFT_BY_A_KILL.format(name=re.escape(out.name)))
            for p in out.parent.iterdir():
                if left.fullmatch(p.name) and p.is_dir():
                    shutil.rmtree(p)
            with atomic_folder(out, setting="--out") as tmp:
                yield tmp
    except LockHeld as exc:
        raise ExportError(
            f"another export (pid {exc.holder}) is writing {out}; wait for it or pass another --out"
        ) from None
