"""Which cells are slides (scripts/slides.py, written into the lessons by sync_notebooks.py).

The decks themselves are opened in Chromium by tests/browser/test_slides.py (make test-browser);
here: the rules that place the slides, the cut of markdown cells at headings, and that every
lesson and workbook carries the slide types the rules give.
"""

import importlib.util
import json
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
slides = importlib.import_module("slides")
sync_notebooks = importlib.import_module("sync_notebooks")

LESSONS = sorted((ROOT / "lessons").glob("[0-9]*.ipynb"))
WORKBOOKS = sorted((ROOT / "workbooks").glob("[0-9]*.ipynb"))


def md(text):
    return nbformat.v4.new_markdown_cell(text)


def code(text, outputs=()):
    cell = nbformat.v4.new_code_cell(text)
    cell.outputs = list(outputs)
    return cell


def stream(n_lines):
    return nbformat.v4.new_output("stream", name="stdout", text="x\n" * n_lines)


PLOT = nbformat.v4.new_output("display_data", data={"image/png": "iVBOR", "text/plain": "<Figure>"})
WIDGET = nbformat.v4.new_output("display_data", data={
    "application/vnd.jupyter.widget-view+json": {"model_id": "m"}, "text/plain": "VBox()"})


def test_rules_on_a_small_lesson():
    cells = [
        md("# Lesson 0 · Title\n\nWhat it is about."),                    # slide
        code("import google.colab  # setup"),                             # skip: Colab cell
        md("## Setup"),                                                   # skip
        code("import torch", [stream(1)]),                                # skip: setup section
        md("## 1 · The idea"),                                            # slide
        md("A short paragraph."),                                         # same slide
        code("x = 1\nprint(x)", [stream(1)]),                             # same slide
        code("plot()", [PLOT]),                                           # its own sub-slide
        md("### Your turn: `f`"),                                         # sub-slide
        code("def f():\n    return 1"),                                   # same slide
        code("from helpers.checks import check_f\ncheck_f(f)", [stream(1)]),  # skip: a check
        code("rerun_controls()", [WIDGET]),                               # skip: widget only
        code("\n".join(["y = 2"] * 10), [stream(12)]),                    # overflows: sub-slide
        md("## Summary\n\n- one\n- two"),                                 # slide
    ]
    assert slides.slide_types(cells) == [
        "slide", "skip", "skip", "skip", "slide", "-", "-", "subslide", "subslide", "-", "skip",
        "skip", "subslide", "slide"]


def test_a_cell_taller_than_a_slide_opens_a_sub_slide_and_a_short_one_does_not():
    tall = "\n".join(["b = 2"] * (slides.SLIDE_LINES - 4))
    cells = [md("## 1 · A"), code("a = 1", [stream(3)]), code(tall, [stream(3)])]
    assert slides.slide_types(cells) == ["slide", "-", "subslide"]
    cells = [md("## 1 · A"), code("a = 1", [stream(3)]), code("b = 2", [stream(3)])]
    assert slides.slide_types(cells) == ["slide", "-", "-"]


def test_mark_writes_the_metadata_rise_reads():
    nb = nbformat.v4.new_notebook(cells=[md("# T"), code("1"), md("## 1 · A")])
    slides.mark(nb)
    assert [c.metadata["slideshow"] for c in nb.cells] == [
        {"slide_type": "slide"}, {"slide_type": "-"}, {"slide_type": "slide"}]


def test_markdown_cells_are_cut_at_headings_but_not_inside_code_blocks():
    cell = md("Text before.\n\n## 2 · Next\nMore.\n```python\n# a comment, not a heading\n```\n"
              "### Your turn\nDo it.")
    cell.id = "abc"
    out = sync_notebooks.split_at_headings([cell, code("x")])
    sources = ["".join(c["source"]) for c in out]
    assert sources[:3] == ["Text before.",
                           "## 2 · Next\nMore.\n```python\n# a comment, not a heading\n```",
                           "### Your turn\nDo it."]
    assert [c["id"] for c in out[:3]] == ["abc", "abc-2", "abc-7"]
    assert out[3]["cell_type"] == "code"
    # already cut: nothing changes
    again = sync_notebooks.split_at_headings(out)
    assert ["".join(c["source"]) for c in again] == sources


def kinds_of(path):
    cells = json.loads(path.read_text())["cells"]
    return cells, [c["metadata"].get("slideshow", {}).get("slide_type") for c in cells]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_every_lesson_carries_the_slide_types_of_the_rules(path):
    cells, kinds = kinds_of(path)
    assert kinds == slides.slide_types(cells), f"{path.name}: run scripts/sync_notebooks.py"
    assert kinds.count("slide") >= 5
    for cell, kind in zip(cells, kinds):
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and source.startswith("## ") \
                and source.strip() != "## Setup":
            assert kind == "slide", f"{path.name}: {source[:40]!r} should open a slide"
        lines = source.split("\n")
        assert not any(line.startswith(("# ", "## ", "### ")) for line in lines[1:]
                       if cell["cell_type"] == "markdown" and "```" not in source), \
            f"{path.name}: a heading inside {lines[0][:40]!r}"


def test_a_workbook_presents_as_its_lesson():
    """Workbooks have no outputs (no plots to place slides by): they keep the lesson's types."""
    assert [p.name for p in WORKBOOKS] == [p.name for p in LESSONS]
    for lesson, workbook in zip(LESSONS, WORKBOOKS):
        assert kinds_of(workbook)[1] == kinds_of(lesson)[1], f"{workbook.name}: make workbooks"


def test_the_story_is_kept_only_setup_checks_and_widgets_are_skipped():
    for path in LESSONS:
        cells = json.loads(path.read_text())["cells"]
        section = ""
        for cell, kind in zip(cells, slides.slide_types(cells)):
            source = "".join(cell["source"])
            if source.startswith(("# ", "## ")):
                section = source.split("\n")[0]
            if cell["cell_type"] == "markdown" and section != "## Setup":
                assert kind != "skip", f"{path.name}: {source[:40]!r} left out of the deck"
