"""docs/memory-planning.md cannot drift: every ```python block of the page runs, in order and in
one namespace (the bundled model, on the CPU), and prints exactly the ```text block written
under it. A block with no ```text block under it must print nothing."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

import pytest

from helpers.models import MODEL_ENV_VAR

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "memory-planning.md"
LESSON = ROOT / "lessons" / "04_quantization.ipynb"

# a ```python block, then (after blank lines only) the ```text block of what it prints, if any
_SNIPPET = re.compile(r"^```python\n(?P<code>.*?)^```\n(?:\s*^```text\n(?P<out>.*?)^```\n)?",
                      re.MULTILINE | re.DOTALL)


def snippets(markdown: str) -> list[tuple[str, str]]:
    """(code, expected output) of every ```python block of ``markdown``, in order."""
    return [(m["code"], m["out"] or "") for m in _SNIPPET.finditer(markdown)]


def _normalized(text: str) -> str:
    """Trailing spaces and trailing blank lines do not count."""
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def test_the_parser_pairs_each_snippet_with_the_output_under_it():
    page = ("Text.\n\n```python\nprint(1)\n```\n\n```text\n1\n```\n\nMore.\n\n"
            "```python\nx = 2\n```\n\nNo output.\n\n```python\nprint(x)\n```\n```text\n2\n```\n")
    assert snippets(page) == [("print(1)\n", "1\n"), ("x = 2\n", ""), ("print(x)\n", "2\n")]


def test_the_page_prints_what_it_says(monkeypatch):
    monkeypatch.delenv(MODEL_ENV_VAR, raising=False)   # the page's figures are the bundled model's
    found = snippets(DOC.read_text())
    assert len(found) >= 5, f"{DOC.name}: only {len(found)} python snippets found"
    namespace: dict = {"__name__": "memory_planning_doc"}
    for number, (code, expected) in enumerate(found, 1):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, f"{DOC.name}, snippet {number}", "exec"), namespace)
        assert _normalized(printed.getvalue()) == _normalized(expected), (
            f"{DOC.name}, snippet {number} printed something else than the page shows:\n"
            f"{printed.getvalue()}")


def test_lesson_04_links_the_page():
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(LESSON, as_version=4)
    assert any("../docs/memory-planning.md" in cell.source for cell in nb.cells
               if cell.cell_type == "markdown")
