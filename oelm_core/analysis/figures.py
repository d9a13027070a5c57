"""How the analysis draws: matplotlib loaded on first use, a saved figure closed.

Importing ``oelm_core.analysis`` does not import matplotlib: the study runner, the sweeps and the
app import the package for its tables and names, and matplotlib alone takes longer to import than
they need. Functions that draw call ``pyplot()`` and return a matplotlib Figure; given ``path``
they save it there and close it, so that headless runs never accumulate open figures.
"""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot, switched to the Agg backend unless a notebook (IPython) chose its own:
    a headless run (papermill, CI) has no display for an interactive backend."""
    import matplotlib

    if matplotlib.get_backend().lower() != "agg" and not _in_notebook():
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        return get_ipython() is not None
    except ImportError:
        return False


def save_figure(fig, path: str | Path | None):
    """Save ``fig`` to ``path`` (folders created) and close it; returns the figure either way.

    A closed figure still renders in a notebook when it is the cell's last value.
    """
    if path is not None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110, bbox_inches="tight")
        pyplot().close(fig)
    return fig
