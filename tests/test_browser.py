"""The demo in a real browser: headless Chromium (Debian's /usr/bin/chromium) through Playwright.

Install the browser with: apt-get update && apt-get install -y chromium
(Playwright's own browser download is not used: it needs the internet.)
A screenshot goes to tmp_path, and also to $OELM_SCREENSHOT_DIR when that is set.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not CHROMIUM.exists(),
        reason="needs Debian's chromium at /usr/bin/chromium (apt-get update && apt-get install -y chromium)",
    ),
]

pytest.importorskip("gradio")
sync_api = pytest.importorskip("playwright.sync_api")

from test_app import GROUPS, make_checkpoints, start_app  # noqa: E402


def _save_screenshot(page, tmp_path: Path, name: str) -> Path:
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    if os.environ.get("OELM_SCREENSHOT_DIR"):
        out = Path(os.environ["OELM_SCREENSHOT_DIR"])
        out.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, out / name)
    return shot


@pytest.fixture
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


def test_generate_and_attention_in_browser(tmp_path, browser):
    """OELM-Freeze comes from a safetensors export folder, the others from checkpoints."""
    from app.lab import load_lab
    from oelm_core.checkpoint import load_model
    from oelm_core.export import to_safetensors

    paths = make_checkpoints(tmp_path)
    paths["oelm_freeze"] = to_safetensors(
        load_model(paths["oelm_freeze"])[0], tmp_path / "freeze_export", card={"step": 300, "val_ppl": 22.0}
    )
    demo, url = start_app(load_lab(paths, "cpu", "browser test checkpoints"))
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url, wait_until="domcontentloaded", timeout=60_000)
        page.wait_for_selector("#generate-btn", timeout=60_000)
        freeze_card = page.inner_text("#card-oelm_freeze")
        assert "OELM-Freeze" in freeze_card and "freeze_export" in freeze_card
        # Smoke-sized checkpoints: the top of the page says what to expect and what to train.
        notice = page.inner_text("#undertrained")
        assert "These models are barely trained: expect gibberish." in notice
        assert "python -m oelm_core run parameters/study_tuned_mini.yaml" in notice

        prompt = page.locator("#prompt textarea")
        prompt.fill("Once upon a time there was a brave little dog")
        page.click("#generate-btn")

        outputs = [page.locator(f"#out-{g} textarea") for g in GROUPS]
        deadline = time.time() + 90
        texts = [""] * 3
        while time.time() < deadline:
            texts = [o.input_value() for o in outputs]
            if all(t.strip() for t in texts) and page.locator("#attn-plot img").count():
                break
            page.wait_for_timeout(250)
        assert all(t.strip() for t in texts), f"empty outputs: {texts}"
        # The attention map follows the generation: an image rendered by gr.Plot.
        page.wait_for_selector("#attn-plot img", timeout=60_000)
        page.wait_for_selector("#attn-compare img", timeout=60_000)
        page.wait_for_selector("#attn-summary img", timeout=60_000)
        assert page.locator("#attn-plot img").evaluate("img => img.naturalWidth") > 100
        page.wait_for_timeout(500)  # let the last streamed update settle before the picture
        shot = _save_screenshot(page, tmp_path, "oelm_app.png")
        assert shot.stat().st_size > 10_000
    finally:
        demo.close()


def test_error_page_in_browser(tmp_path, browser):
    from app.lab import load_lab

    demo, url = start_app(load_lab({"gpt_base": tmp_path / "missing.pt"}, "cpu"))
    try:
        page = browser.new_page(viewport={"width": 1200, "height": 700})
        page.goto(url, wait_until="domcontentloaded", timeout=60_000)
        page.wait_for_selector("#load-error", timeout=60_000)
        text = page.inner_text("#load-error")
        assert "The models could not be loaded" in text and "missing.pt not found" in text
        assert page.locator("#generate-btn").count() == 0
        _save_screenshot(page, tmp_path, "oelm_app_error.png")
    finally:
        demo.close()


def test_one_bad_checkpoint_in_browser(tmp_path, browser):
    """A missing checkpoint: its column says so, with the fix; the other two models generate."""
    from app.lab import load_lab

    paths = make_checkpoints(tmp_path)
    paths["gpt_base"] = tmp_path / "missing.pt"
    demo, url = start_app(load_lab(paths, "cpu", "browser test checkpoints"))
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(url, wait_until="domcontentloaded", timeout=60_000)
        page.wait_for_selector("#generate-btn", timeout=60_000)
        assert page.locator("#load-error").count() == 0
        card = page.inner_text("#card-gpt_base")
        assert "not loaded" in card and "missing.pt not found" in card and "--ckpt gpt_base=PATH" in card
        assert "OELM-Freeze" in page.inner_text("#card-oelm_freeze")
        page.click("#generate-btn")
        outputs = [page.locator(f"#out-{g} textarea") for g in GROUPS[1:]]
        deadline = time.time() + 90
        texts = ["", ""]
        while time.time() < deadline:
            texts = [o.input_value() for o in outputs]
            if all(t.strip() for t in texts) and page.locator("#attn-plot img").count():
                break
            page.wait_for_timeout(250)
        assert all(t.strip() for t in texts), f"empty outputs: {texts}"
        assert page.locator("#out-gpt_base textarea").count() == 0
        _save_screenshot(page, tmp_path, "oelm_app_one_missing.png")
    finally:
        demo.close()


# The characters of the word `word` inside the element `el` as laid out: one rectangle per line
# they fall on (a word broken across lines has two).
LINES_OF_WORD = """([el, word]) => {
    const walker = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
        const at = node.textContent.lastIndexOf(word);
        if (at < 0) continue;
        const range = document.createRange();
        range.setStart(node, at);
        range.setEnd(node, at + word.length);
        return new Set([...range.getClientRects()].map(r => Math.round(r.top))).size;
    }
    return -1;
}"""


def test_a_model_card_never_breaks_a_word_of_its_device_line(tmp_path, browser):
    """The card's last line, `checkpoint <path> on cpu`, wrapped as "on c / pu": the whole line
    broke anywhere (word-break: break-all) so that a long path would fit. Only the path breaks
    anywhere now, the words around it at spaces; at page widths from 600 to 1600 pixels "cpu"
    stays on one line and the line fits its card."""
    from app.lab import load_lab

    paths = make_checkpoints(tmp_path / ("a_long_folder_name_for_the_checkpoints_" * 2))
    demo, url = start_app(load_lab(paths, "cpu", "browser test checkpoints"))
    try:
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(url, wait_until="domcontentloaded", timeout=60_000)
        page.wait_for_selector("#card-oelm_freeze small", timeout=60_000)
        small = page.locator("#card-oelm_freeze small")
        assert small.inner_text().endswith(" on cpu")
        assert small.evaluate("el => getComputedStyle(el).wordBreak") != "break-all"
        assert small.locator("code").evaluate("el => getComputedStyle(el).overflowWrap") == "anywhere"
        for width in range(600, 1601, 20):
            page.set_viewport_size({"width": width, "height": 900})
            lines = small.evaluate(f"el => ({LINES_OF_WORD})([el, 'cpu'])")
            assert lines == 1, f"'cpu' broken across {lines} lines at a page width of {width} px"
            assert small.evaluate("el => el.scrollWidth <= el.clientWidth + 1"), width
    finally:
        demo.close()
