"""Every lesson's slide deck (`make slides`), opened in Chromium with the network off.

The decks are exported afresh into a temporary folder by scripts/slides.py. Each one is opened
from the disk in a browser context that is offline and refuses any request that is not a
file, then stepped through slide by slide with reveal.js's own API. Every slide must show
something (text, an image or a formula), every image on it must have loaded, MathJax must have
typeset the formulas of the decks that have them, and the page must raise no error.

Set SLIDES_SCREENSHOTS=folder to keep a picture of every slide.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LESSON_FILES = sorted((ROOT / "lessons").glob("[0-9]*.ipynb"))
SCREENSHOTS = os.environ.get("SLIDES_SCREENSHOTS")

SLIDE_STATE = """() => {
  const s = Reveal.getCurrentSlide();
  const images = [...s.querySelectorAll('img')];
  return {
    indices: Reveal.getIndices(),
    text: s.innerText.trim().length,
    images: images.length,
    broken: images.filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src.slice(0, 60)),
    formulas: s.querySelectorAll('mjx-container').length,
    rawMath: /\\$[^$\\n]+\\$/.test(s.innerText),
    last: Reveal.isLastSlide(),
  };
}"""


@pytest.fixture(scope="module")
def decks(tmp_path_factory):
    out = tmp_path_factory.mktemp("slides")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "slides.py"), "--out", str(out)],
                   check=True, cwd=ROOT)
    return out


@pytest.mark.parametrize("lesson", LESSON_FILES, ids=[p.stem for p in LESSON_FILES])
def test_deck_offline(lesson, decks, browser):
    deck = decks / f"{lesson.stem}.slides.html"
    context = browser.new_context(offline=True, viewport={"width": 1280, "height": 800})
    outside, errors = [], []

    def only_files(route):
        if route.request.url.startswith(("file:", "data:", "blob:")):
            route.continue_()
        else:
            outside.append(route.request.url)
            route.abort()

    context.route("**/*", only_files)
    page = context.new_page()
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    try:
        page.goto(deck.as_uri())
        page.wait_for_function("() => window.Reveal && Reveal.isReady()", timeout=30_000)
        has_maths = "MathJax" in page.content()[:20_000]
        if has_maths:
            page.wait_for_function("() => MathJax.startup && MathJax.startup.promise",
                                   timeout=30_000)
            page.evaluate("() => MathJax.startup.promise")
        page.evaluate("() => Reveal.configure({transition: 'none'})")
        total = page.evaluate("() => Reveal.getTotalSlides()")
        assert total >= 5, f"{deck.name}: only {total} slides"
        seen, formulas = [], 0
        for number in range(total):
            state = page.evaluate(SLIDE_STATE)
            where = f"{deck.name}, slide {number + 1} of {total} {state['indices']}"
            assert state["text"] or state["images"] or state["formulas"], f"{where} is empty"
            assert not state["broken"], f"{where}: images not loaded: {state['broken']}"
            assert not state["rawMath"], f"{where}: a formula was not typeset"
            formulas += state["formulas"]
            seen.append((state["indices"]["h"], state["indices"]["v"]))
            if SCREENSHOTS:
                folder = Path(SCREENSHOTS) / lesson.stem
                folder.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(folder / f"{number + 1:02d}.png"))
            if number < total - 1:
                page.evaluate("() => Reveal.next()")
        assert state["last"], f"{deck.name}: stepping {total} times did not reach the last slide"
        assert len(set(seen)) == total, f"{deck.name}: a slide came twice, one never"
        assert not has_maths or formulas > 0, f"{deck.name}: MathJax typeset no formula"
        assert not outside, f"{deck.name} asked the network for {outside[:3]}"
        assert not errors, f"{deck.name}: errors in the page: {errors[:3]}"
    finally:
        context.close()


@pytest.mark.parametrize("lesson", LESSON_FILES, ids=[p.stem for p in LESSON_FILES])
def test_rise_in_jupyterlab(lesson, lab, browser):
    """RISE (jupyterlab-rise, the lab extra) presents the lesson with the cells' slide types."""
    kinds = [c["metadata"].get("slideshow", {}).get("slide_type")
             for c in json.loads(lesson.read_text())["cells"]]
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    try:
        page.goto(f"{lab.url}/rise/{lesson.name}?token={lab.token}")
        page.wait_for_function("() => document.querySelectorAll('.reveal .slides section').length",
                               timeout=120_000)
        page.wait_for_timeout(1000)
        top, inner = page.evaluate("""() => [
            document.querySelectorAll('.reveal .slides > section').length,
            document.querySelectorAll('.reveal .slides > section > section').length]""")
        assert top == kinds.count("slide"), f"{lesson.name}: RISE shows {top} slides"
        assert inner == kinds.count("slide") + kinds.count("subslide"), \
            f"{lesson.name}: RISE shows {inner} slides and sub-slides"
    finally:
        page.close()
        lab.stop_kernels()
