"""The project's settings file, ``oelm.env``: environment variables every oelm_core command reads.

``KEY=VALUE`` lines (an ``export`` prefix, quotes and ``#`` comments allowed), written by
``python -m oelm_core.offline`` (which says what they are for). Importing ``oelm_core`` calls
``load``, so the CLIs, the app, notebook kernels and the make targets all see the same settings
without an ``export`` in each shell; a variable already set in the environment wins over the
file. The file is looked for at ``$OELM_ENV_FILE`` (empty: none), else ``./oelm.env``, else at
the root of the checkout that holds the package.

Standard library only: the package imports this module first.
"""

from __future__ import annotations

import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

NAME = "oelm.env"
VARIABLE = "OELM_ENV_FILE"
CHECKOUT = Path(__file__).resolve().parents[1]
# The first line of a file the toolkit wrote: a rewrite or removal touches no other file.
MARK = "# oelm.env: settings written by oelm_core"


def path() -> Optional[Path]:
    """The settings file the package reads (an existing one), or None."""
    if VARIABLE in os.environ:
        named = os.environ[VARIABLE]
        return Path(named) if named and Path(named).is_file() else None
    try:
        here = [Path.cwd() / NAME]
    except OSError:  # the working directory was deleted: only the checkout's file
        here = []
    return next((p for p in (*here, CHECKOUT / NAME) if p.is_file()), None)


def default_target() -> Path:
    """Where a new settings file goes: $OELM_ENV_FILE, else the checkout's root (where the
    package runs from a checkout), else ./oelm.env."""
    if os.environ.get(VARIABLE):
        return Path(os.environ[VARIABLE])
    return (CHECKOUT if (CHECKOUT / "pyproject.toml").is_file() else Path.cwd()) / NAME


def read(file: Path) -> dict[str, str]:
    """The KEY=VALUE lines of ``file``; ValueError naming the file and line of any other line."""
    settings = {}
    for lineno, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.removeprefix("export ").partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(
                f"{file}:{lineno}: not a KEY=VALUE line: {line!r}; fix the line, or write the "
                f"file again with `python -m oelm_core.offline DIR`"
            )
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        settings[key.strip()] = value
    return settings


def load() -> dict[str, str]:
    """Put the settings file's variables into os.environ where they are not set; returns those it
    set. A damaged file is a warning on stderr, not a failed import."""
    file = path()
    if file is None:
        return {}
    try:
        settings = read(file)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        print(f"warning: {NAME} not read: {exc}", file=sys.stderr)
        return {}
    added = {k: v for k, v in settings.items() if k not in os.environ}
    os.environ.update(added)
    return added


def written_here(file: Path) -> bool:
    """Whether ``file`` is one the toolkit wrote (it starts with MARK)."""
    with open(file, encoding="utf-8", errors="replace") as f:
        return f.readline().startswith(MARK)


def write(file: Path, settings: dict[str, str], comments: list[str]) -> None:
    """Write ``settings`` (after MARK, a time stamp and ``comments``) to ``file`` atomically. A
    file there that the toolkit did not write is kept: FileExistsError."""
    if file.exists() and not written_here(file):
        raise FileExistsError(f"{file} exists and was not written by oelm_core; move it away first")
    stamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    lines = [f"{MARK} on {stamp}", *(f"# {c}" for c in comments), *(f"{k}={v}" for k, v in settings.items())]
    tmp = file.with_name(f".{file.name}.tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    os.replace(tmp, file)
