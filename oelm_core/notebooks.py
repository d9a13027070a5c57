"""The notebooks' parameters and their headless execution.

Each notebook's source is ``notebooks/NN_name.py`` in jupytext's percent format (one ``# %%``
line per cell); its cell tagged ``parameters`` (``# %% tags=["parameters"]``) assigns every
parameter a literal default. The ``.ipynb`` files that JupyterLab opens and papermill runs by hand
are generated from the sources (``make notebooks``) and git-ignored: a run never puts outputs
into git.

One check serves the plan (when it is read), the runner (before papermill starts a kernel) and
each notebook's first cell, for a papermill call made by hand:

    check_notebook_parameters(name, values)    every value a parameter of the notebook, of its
                                               default's type, within the notebook's bounds
    check_kernel_parameters(name, globals())   the first cell: the values above, and every name
                                               papermill injected one the notebook declares

``execute_notebook`` runs a notebook's source through papermill's Python API, its printed output
echoed line by line. The notebooks that launch nothing (01, 02, 04) import this module, not the
runner.
"""

from __future__ import annotations

import ast
import difflib
import os
import re
import threading
from pathlib import Path
from typing import Any, Callable

from oelm_core.analysis.runs import WHICH
from oelm_core.checkout import REPO, child_env
from oelm_core.config import ConfigError

NOTEBOOKS = REPO / "notebooks"
# What papermill writes first in the cell of the parameters it injects (its Python translator).
INJECTED_HEADER = "# Parameters"
_PARAMETERS_TAG = re.compile(r"^# %%.*\btags=\[([^\]]*)\]")

# Notebook parameters whose type does not say enough: the values the notebook accepts (05_sweep's
# runner: the plan it loads checks it) ...
PARAMETER_CHOICES = {"04_analysis": {"which": WHICH}}
# ... the least values of those whose smaller values leave the notebook nothing to measure or
# its checks to chance, or nothing to run, and why ...
PARAMETER_MINIMA = {
    "01_theory": {
        "d": (32, "the JL curve needs the target dimensions 8 and d/2 >= 16"),
        "n_head": (1, "one head at least"),
        "n_vectors": (1, "the isometry check needs a vector"),
        "n_tokens": (8, "with fewer the logit statistics of one draw stray past the checked bounds"),
        "jl_points": (3, "the spread of the distances' distortion needs two pairs of points"),
        "jl_trials": (1, "one projection at least"),
        "construction_repeats": (1, "one timing at least"),
    },
    "03_training": {"nproc": (1, "one training process at least"), "cpu_threads": (1, "one thread at least")},
}
# ... parameters that must divide another one ...
PARAMETER_DIVIDES = {"01_theory": {"n_head": "d"}}
# ... parameters that name a file, and an example (relative paths: from the working directory or
# the repository root, as the notebook resolves them) ...
PARAMETER_FILES = {
    "03_training": {"params": "parameters/smoke/oelm_freeze.yaml"},
    "05_sweep": {"sweep_file": "parameters/sweeps/a6_layers.yaml"},
}
# ... and those whose default, None, names no type: the type of any other value.
NONE_DEFAULT_TYPES = {
    "03_training": {"run_dir": str, "cpu_threads": int},
    "04_analysis": {"fig_dir": str},
    "05_sweep": {"variants": list, "seeds": list, "figure_path": str},
}
_TYPE_NAMES = {
    bool: "true or false",
    int: "a whole number (int)",
    float: "a number (float)",
    str: "a string",
    list: "a list",
    dict: "a mapping",
}


class NotebookError(RuntimeError):
    """A notebook that failed: the message names its failed cell and the executed copy."""


def notebook_names() -> list[str]:
    """The notebooks, by the names of their sources in notebooks/ (01_theory, ...)."""
    return sorted(p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def source(name: str) -> Path:
    """notebooks/<name>.py; ConfigError naming the notebooks there when it does not exist."""
    path = NOTEBOOKS / f"{name}.py"
    if not path.is_file():
        raise ConfigError(f"no notebook {name!r}: notebooks/ holds {', '.join(notebook_names())}")
    return path


def parameters_cell(name: str) -> str:
    """The source of notebooks/<name>.py's cell tagged ``parameters`` ("" without one)."""
    lines = source(name).read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        tags = _PARAMETERS_TAG.match(line)
        if tags and '"parameters"' in tags.group(1):
            end = next((k for k in range(i + 1, len(lines)) if lines[k].startswith("# %%")), len(lines))
            return "\n".join(lines[i + 1 : end])
    return ""


def _assigned(code: str) -> list[str]:
    """The names that top-level assignments of ``code`` bind, in order."""
    return [
        t.id
        for node in ast.parse(code).body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    ]


def notebook_defaults(name: str) -> dict[str, Any]:
    """Name -> default value of what the notebook's parameters cell assigns: the parameters it
    reads. Parameters cells hold literals, so no code is run (and no notebook library needed)."""
    return {
        t.id: ast.literal_eval(node.value)
        for node in ast.parse(parameters_cell(name)).body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }


def _fits(value: Any, kind: type | None) -> bool:
    """Whether ``value`` is of type ``kind`` (any value for None, which names no type); bool is not
    taken for a number, a whole number is for a float."""
    if kind is None:
        return True
    if kind is bool or isinstance(value, bool):
        return kind is bool and isinstance(value, bool)
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


def _is_file(value: str) -> bool:
    path = Path(value).expanduser()
    return path.is_file() or (not path.is_absolute() and (REPO / path).is_file())


def check_notebook_parameters(name: str, values: dict[str, Any], where: str | None = None) -> None:
    """Raise ConfigError unless every item of ``values`` is a parameter of notebooks/<name>, of
    the type of its default there (where that is None: None or the type in
    ``NONE_DEFAULT_TYPES``) and, where listed, one of its ``PARAMETER_CHOICES``, at least its
    ``PARAMETER_MINIMA``, a divisor of its ``PARAMETER_DIVIDES`` (a parameter left out of
    ``values`` counts with its default) and an existing file for its ``PARAMETER_FILES``. The
    message names the parameter, the value and what it must be (a misspelt name: the close match).

    ``where``: what the message writes before a parameter's name (a plan:
    "experiment.parameters.NAME."); None: a notebook's own call."""
    problem = next(_problems(name, values, where), None)
    if problem is not None:
        raise ConfigError(problem)


def _problems(name: str, values: dict[str, Any], where: str | None):
    """``check_notebook_parameters``' messages, one per problem, in the order of ``values``."""
    defaults = notebook_defaults(name)
    label = where if where is not None else f"notebook {name}: parameter "
    for key, value in values.items():
        if key not in defaults:
            close = difflib.get_close_matches(key, defaults, n=1)
            yield (
                f"{label}{key} is not a parameter of {name}{f' (did you mean {close[0]}?)' if close else ''}; "
                f"its parameters are {', '.join(defaults)}"
            )
            continue
        default = defaults[key]
        kind = type(default) if default is not None else NONE_DEFAULT_TYPES.get(name, {}).get(key)
        if not (_fits(value, kind) or (value is None and default is None)):
            expected = _TYPE_NAMES.get(kind, kind.__name__)
            expected = f"None or {expected}" if default is None else expected
            # papermill's -p passes text (or a number): a list or mapping needs -y
            hint = (
                f"; give a list or mapping to papermill as YAML with -y, e.g. -y '{key}: "
                f"{'[...]' if kind is list else '{...}'}'"
                if where is None and kind in (list, dict) and isinstance(value, str)
                else ""
            )
            yield f"{label}{key} must be {expected} (the notebook's default is {default!r}); got {value!r}{hint}"
            continue
        choices = PARAMETER_CHOICES.get(name, {}).get(key)
        minimum, why = PARAMETER_MINIMA.get(name, {}).get(key, (None, ""))
        example = PARAMETER_FILES.get(name, {}).get(key)
        if choices is not None and value not in choices:
            yield f"{label}{key} must be one of {', '.join(choices)}; got {value!r}"
        elif minimum is not None and value is not None and value < minimum:
            yield f"{label}{key} must be at least {minimum} ({why}); got {value!r}"
        elif example is not None and not _is_file(value):
            yield (
                f"{label}{key} names no file: {value!r} is neither in {Path.cwd()} nor in {REPO}; "
                f"pass an existing file, e.g. {example}"
            )
    for key, other in PARAMETER_DIVIDES.get(name, {}).items():
        value, total = values.get(key, defaults[key]), values.get(other, defaults[other])
        if _fits(value, int) and _fits(total, int) and value > 0 and total % value:
            yield (
                f"{label}{key} must divide {other} ({other} = {total} is split into {key} "
                f"equal parts); got {key} = {value}"
            )


def injected_names(namespace: dict) -> list[str]:
    """The names papermill injected into the kernel whose globals are ``namespace``: those its
    injected-parameters cell (the latest input that starts with INJECTED_HEADER, in IPython's
    input history ``In``) assigns; [] outside IPython or where nothing was injected."""
    history = namespace.get("In")
    if not isinstance(history, list):
        return []
    injected = next(
        (src for src in reversed(history) if isinstance(src, str) and src.lstrip().startswith(INJECTED_HEADER)), None
    )
    return _assigned(injected) if injected else []


def check_kernel_parameters(name: str, namespace: dict) -> None:
    """A notebook's first cell after its parameters: ``check_notebook_parameters`` on what
    papermill injected into ``namespace`` (the kernel's globals()) and on every parameter's value
    there, so that a name the notebook does not declare (``-p param x`` for ``params``) is refused
    before anything runs: papermill itself only warns and injects it. ConfigError naming every
    problem, one per line."""
    values = {k: namespace[k] for k in injected_names(namespace) if k in namespace}
    values.update({k: namespace[k] for k in notebook_defaults(name) if k in namespace and k not in values})
    problems = list(_problems(name, values, None))
    if problems:
        raise ConfigError("\n".join(problems))


# --------------------------------------------------------------------------------------------
# Executing a notebook: the one papermill call
# --------------------------------------------------------------------------------------------


def say(msg: str, _lock=threading.Lock()) -> None:
    """Print one line, whole, while other threads print theirs (trainings side by side)."""
    with _lock:
        print(msg, flush=True)


class _Lines:
    """A file-like sink for papermill's stdout_file/stderr_file: whole lines, prefixed, to ``echo``."""

    def __init__(self, prefix: str, echo: Callable[[str], None]):
        self.prefix, self.echo, self.partial = prefix, echo, ""

    def write(self, text: str) -> None:
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            line = line.split("\r")[-1]  # a progress bar's redraws: keep the latest
            if line.strip():
                self.echo(self.prefix + line)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.write("\n")


def failed_cell(nb_path: str | Path) -> str | None:
    """'code cell N (`first line of source`): Error: message' of the first failed cell of an
    executed notebook (None: none failed, or no readable notebook)."""
    import nbformat

    try:
        nb = nbformat.read(str(nb_path), as_version=4)
    except Exception:
        return None
    code_index = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        code_index += 1
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                first = next((ln for ln in cell.source.splitlines() if ln.strip()), "")
                return f"code cell {code_index} (`{first[:80]}`): {out.get('ename')}: {str(out.get('evalue'))[:500]}"
    return None


def read_notebook(name: str):
    """notebooks/<name>.py as a notebook (nbformat's NotebookNode, jupytext's reading), on the
    project's kernel: what ``make notebooks`` writes to notebooks/<name>.ipynb."""
    import jupytext

    nb = jupytext.read(source(name))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def execute_notebook(
    name: str,
    out_path: Path,
    parameters: dict[str, Any],
    prefix: str = "",
    cwd: str | Path | None = None,
    echo: Callable[[str], None] = say,
) -> Path:
    """Execute notebooks/<name>.py with papermill into ``out_path`` (an .ipynb), its parameters
    checked first, its cells' printed output echoed line by line after ``prefix``; the kernel
    starts in ``cwd`` (default: this process's working directory). NotebookError names the
    failed cell."""
    import papermill as pm

    check_notebook_parameters(name, parameters)
    nb = read_notebook(name)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    # The kernel inherits this environment: it imports this checkout's oelm_core wherever it starts.
    os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]
    out, err = _Lines(prefix, echo), _Lines(prefix, echo)
    try:
        # The kernel's own log at ERROR: its start-up warning (TCP without encryption, on
        # localhost) would fill the log of a study once per notebook and run.
        pm.execute_notebook(
            nb,
            str(out_path),
            parameters=parameters,
            kernel_name="python3",
            language="python",
            cwd=str(cwd or os.getcwd()),
            progress_bar=False,
            stdout_file=out,
            stderr_file=err,
            extra_arguments=["--IPKernelApp.log_level=ERROR"],
        )
    except pm.PapermillExecutionError:
        raise NotebookError(f"notebook {name} failed in {failed_cell(out_path)}\n  executed copy: {out_path}") from None
    except Exception as exc:  # the kernel did not start or died: no cell holds the error
        raise NotebookError(
            f"notebook {name} failed before its cells ran ({type(exc).__name__}: {exc})\n  executed copy: {out_path}"
        ) from exc
    finally:
        out.close()
        err.close()
    return out_path
