"""The glossary (docs/glossary.md): every lesson and workbook links it from its first cell, every
entry names a lesson that exists, and the terms the later lessons lean on are in it."""

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
GLOSSARY = ROOT / "docs" / "glossary.md"
LINK = "[glossary](../docs/glossary.md)"


@pytest.mark.parametrize("folder", ["lessons", "workbooks"])
def test_every_notebook_links_the_glossary_from_its_first_cell(folder):
    for path in sorted((ROOT / folder).glob("*.ipynb")):
        first = json.loads(path.read_text())["cells"][0]
        assert first["cell_type"] == "markdown" and LINK in "".join(first["source"]), path.name
        assert (path.parent / "../docs/glossary.md").resolve() == GLOSSARY


def test_every_entry_names_the_lesson_that_introduces_it():
    lessons = {p.name[:2] for p in (ROOT / "lessons").glob("*.ipynb")}
    entries = re.findall(r"^- \*\*.*?(?=^- |^#|\Z)", GLOSSARY.read_text(), re.M | re.S)
    assert len(entries) >= 40
    for entry in entries:
        named = re.findall(r"\((\d\d)\)", entry)
        assert named and set(named) <= lessons, entry


@pytest.mark.parametrize("term", ["KV cache", "prefill", "attention mask", "zero point", "LoRA",
                                  "block table", "prefix caching", "guard", "capture size",
                                  "CUDA graph", "side stream", "memory pool", "rank",
                                  "all-reduce", "ring all-reduce", "communicator", "L",
                                  "NUMA node", "bubble"])
def test_the_terms_the_lessons_lean_on_are_defined(term):
    assert f"**{term}**" in GLOSSARY.read_text(), term
