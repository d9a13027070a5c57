"""JupyterLab in a real browser: notebook 02 opened, all its cells run, the shape explorer used, the
notebook saved, and git left clean.

A JupyterLab server (``python -m jupyterlab``, what ``make lab`` starts) on a free local port with
a token, driven by headless Chromium (Debian's /usr/bin/chromium) through Playwright, as
tests/test_browser.py drives the demo. The server's root is a throw-away git repository laid out
as this one (its .gitignore, notebooks/02_model.py and jupytext.toml committed) in which
``make notebooks`` wrote 02_model.ipynb, as ``make lab`` does: running the cells there and saving
must leave ``git status --porcelain notebooks/`` empty. A screenshot goes to tmp_path, and to
$OELM_SCREENSHOT_DIR where that is set.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium "
        "(apt-get update && apt-get install -y chromium; make test does it as root)",
    ),
]

pytest.importorskip("jupyterlab", reason="needs JupyterLab (the notebooks extra: pip install -e '.[notebooks]')")
pytest.importorskip("ipywidgets", reason="needs ipywidgets (the notebooks extra) for the shape explorer")
sync_api = pytest.importorskip("playwright.sync_api", reason="needs playwright (the dev extra)")
pytest.importorskip("jupytext", reason="needs jupytext (the notebooks extra)")
nbformat = pytest.importorskip("nbformat", reason="needs nbformat (the notebooks extra)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_server(proc: subprocess.Popen, log: Path, port: int, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"JupyterLab exited with status {proc.returncode}:\n{log.read_text()[-3000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.25)
    pytest.fail(f"JupyterLab did not listen on port {port} within {timeout:.0f}s:\n{log.read_text()[-3000:]}")


def _git(root: Path, *args: str) -> str:
    proc = subprocess.run(
        ["git", "-c", "user.name=test", "-c", "user.email=test@example.org", *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def lab(tmp_path):
    """(the url of notebooks/02_model.ipynb in a running JupyterLab, the server's root: a git
    repository whose notebooks/ holds the committed 02_model.py and the .ipynb made from it;
    its log: tmp_path/lab.log)."""
    if shutil.which("git") is None or shutil.which("make") is None:
        pytest.skip("needs git and make")
    root = tmp_path / "lab"
    (root / "notebooks").mkdir(parents=True)
    shutil.copy(REPO / ".gitignore", root)
    for name in ("02_model.py", "jupytext.toml"):
        shutil.copy(REPO / "notebooks" / name, root / "notebooks")
    # The three groups' table instead of all fifteen variants' at Medium-512 (minutes on 2 cores),
    # as papermill's -p all_variants False would: an edit of the source, committed in this copy.
    source = root / "notebooks" / "02_model.py"
    assert "\nall_variants = True " in source.read_text()
    source.write_text(source.read_text().replace("\nall_variants = True ", "\nall_variants = False"))
    _git(root, "init", "-q")
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "the notebook's source")
    venv = Path(sys.executable).parent.parent
    made = subprocess.run(
        [
            "make",
            "-f",
            str(REPO / "Makefile"),
            "-C",
            str(root),
            f"VENV={venv}",
            "-o",
            f"{venv}/.installed",
            "notebooks",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0 and (root / "notebooks" / "02_model.ipynb").is_file(), made.stdout + made.stderr
    assert _git(root, "status", "--porcelain", "notebooks/") == ""  # the made .ipynb is ignored
    port, token, log = _free_port(), secrets.token_hex(16), tmp_path / "lab.log"
    # The server's settings, workspaces and runtime files in tmp_path: none read or left in ~/.jupyter.
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "IPYTHONDIR": str(tmp_path / "ipython"),
    }
    cmd = [
        sys.executable,
        "-m",
        "jupyterlab",
        "--no-browser",
        "--ip=127.0.0.1",
        f"--port={port}",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--ServerApp.port_retries=0",
        f"--LabApp.user_settings_dir={tmp_path / 'settings'}",
        f"--LabApp.workspaces_dir={tmp_path / 'ws'}",
        "--LabApp.expose_app_in_browser=True",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    cmd += ["--allow-root"] if os.geteuid() == 0 else []  # CI runs as root
    news = tmp_path / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text('{"fetchNews": "false"}')  # no "get notified about Jupyter news?" toast over the page
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root)
    try:
        _wait_for_server(proc, log, port)
        yield f"http://127.0.0.1:{port}/lab/tree/notebooks/02_model.ipynb?token={token}", root
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


def _code_cells(page) -> list[dict]:
    """The open notebook's code cells, from JupyterLab's model (the page renders only the cells in
    view): {count: execution count, errors: the text of error outputs}."""
    return page.evaluate("""() => {
        const cells = window.jupyterapp.shell.currentWidget.content.model.cells, found = [];
        for (let i = 0; i < cells.length; i++) {
            const cell = cells.get(i);
            if (cell.type !== 'code') continue;
            const errors = [];
            for (let k = 0; k < cell.outputs.length; k++) {
                const out = cell.outputs.get(k).toJSON();
                if (out.output_type === 'error') errors.push(out.ename + ': ' + out.evalue);
            }
            found.push({count: cell.executionCount, errors});
        }
        return found;
    }""")


def _explorer_table(page) -> str:
    return page.locator(".widget-output").first.inner_text()


def test_notebook_02_runs_in_jupyterlab_and_its_explorer_follows_a_slider(lab, browser, tmp_path):
    """... and saved (its .py paired by jupytext), leaves git clean: the outputs went to the
    ignored .ipynb, and the .py was written with its cells unchanged."""
    from oelm_core.analysis import shape_account

    url, root = lab
    notebook, source = root / "notebooks" / "02_model.ipynb", root / "notebooks" / "02_model.py"
    written = source.stat().st_mtime_ns
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.goto(url, wait_until="domcontentloaded", timeout=120_000)
    kernel = (
        "() => { const nb = window.jupyterapp && window.jupyterapp.shell.currentWidget;"
        " return !!(nb && nb.sessionContext && nb.sessionContext.session && nb.sessionContext.session.kernel); }"
    )
    page.wait_for_function(kernel, timeout=120_000)
    assert len(_code_cells(page)) == 8
    # JupyterLab's own command, as Run > Run All Cells; its promise settles when every cell has run.
    assert page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')") is True
    cells = _code_cells(page)
    assert [c["count"] for c in cells] == list(range(1, 9)) and not any(c["errors"] for c in cells), cells

    # The explorer: six sliders, and a table of the three groups at the sliders' shape.
    assert page.locator(".widget-slider").count() == 6
    start, more = shape_account(), shape_account(n_layer=7)
    table = _explorer_table(page)
    assert all(f"{r['trainable']:,}" in table for r in start), table  # at 6 layers
    layers = page.locator(".widget-slider").filter(has_text="layers")
    assert layers.locator(".widget-readout").inner_text().strip() == "6"
    layers.locator(".noUi-handle").focus()
    page.keyboard.press("ArrowRight")  # one step: 7 layers
    page.wait_for_function(
        "want => document.querySelector('.widget-output').innerText.includes(want)",
        arg=f"{more[0]['trainable']:,}",
        timeout=60_000,
    )
    assert layers.locator(".widget-readout").inner_text().strip() == "7"
    table = _explorer_table(page)
    assert all(f"{r['trainable']:,}" in table for r in more) and f"{start[0]['trainable']:,}" not in table, table
    shot = tmp_path / "jupyterlab_02_model.png"
    page.screenshot(path=str(shot))
    if os.environ.get("OELM_SCREENSHOT_DIR"):
        Path(os.environ["OELM_SCREENSHOT_DIR"]).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(os.environ["OELM_SCREENSHOT_DIR"]) / shot.name)
    # Saved as a user saves (File > Save): the outputs reach the .ipynb, the cells the .py, git stays clean.
    assert page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save').then(() => true)") is True
    saved = nbformat.read(notebook, as_version=4)
    assert [c.execution_count for c in saved.cells if c.cell_type == "code"] == list(range(1, 9))
    assert any(c.outputs for c in saved.cells if c.cell_type == "code")
    assert source.stat().st_mtime_ns != written  # jupytext wrote the pair's .py too ...
    assert _git(root, "status", "--porcelain", "notebooks/") == ""  # ... which is the committed one
