"""Markdown tables: what the notebooks display and results.md holds."""

from __future__ import annotations

import math
import re
from typing import Any, Sequence


def markdown_table(
    rows: Sequence[dict], columns: Sequence[str] | None = None, headers: Sequence[str] | None = None
) -> str:
    """A GitHub markdown table of ``rows`` (dicts); floats get 4 significant digits, ints commas.
    A cell's "|" is escaped and its line breaks become <br>: either would end the row early (the
    lines of a generated story broke the Samples table of results.md)."""
    if not rows:
        return "(no rows)"
    columns = list(columns or rows[0].keys())
    headers = list(headers or columns)
    lines = ["| " + " | ".join(map(_cell, headers)) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_format(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _format(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):  # before int: True is an int
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"  # .4g writes 12,345.6 as 1.235e+04
    return _cell(str(v))


def _cell(text: str) -> str:
    return re.sub(r"\r\n?|\n", "<br>", text.replace("|", r"\|"))
