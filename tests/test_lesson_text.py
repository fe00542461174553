"""The lessons' prose does not quote figures that change from run to run.

A time, a speed-up or a rate measured by a lesson differs on the next run and on the learner's
laptop, so the lesson prints it from the run instead of writing it into its markdown. The whole
course may quote at most ``MAX_FIXED_FACTS`` fixed facts (a paper's reported figure, an assumed
constant): the cell that quotes one carries the tag ``fixed-facts`` and lists each fact in its
metadata, ``course.fixed_facts``: ``[{"figures": ["12×", "2 ms"], "source": "..."}]``. Every
other figure with a unit of time or a ratio in any markdown cell fails.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

LESSONS = sorted((Path(__file__).resolve().parents[1] / "lessons").glob("*.ipynb"))

FIXED_FACTS_TAG = "fixed-facts"
MAX_FIXED_FACTS = 3

# (not "section 2 times self.scale": a number that names a section, lesson or step)
_NUMBER = r"(?<![\w.])(?<!section )(?<!lesson )(?<!step )\d+(?:[.,]\d+)?"
# 12 ms, 0.3 s, 40 seconds, 250 tokens/s, 4.0 times; 1.7x or 3.1× as a ratio (not "3 × 256", a product)
_TIMING = re.compile(
    _NUMBER + r"(?:\s*(?:-|–|to)\s*\d+(?:\.\d+)?)?\s*"
    r"(?:(?:ms|µs|s|sec|seconds?|tokens/s|tok/s|tokens per second|times)(?![\w/])"
    r"|(?<=\d)[x×](?![\w\d]))")


def timing_figures(text: str) -> list[str]:
    """The figures in ``text`` written with a timing unit or as a ratio."""
    return [m.group(0) for m in _TIMING.finditer(text)]


def test_the_pattern_finds_times_and_ratios_but_not_products():
    found = timing_figures("a step takes 4.2 ms, the run 12 s or 3 seconds, 250 tokens/s; "
                           "1.7× faster, and 2x as fast, from 0.8× to 1.1×; 4.0 times the "
                           "tokens/s of one.")
    assert found == ["4.2 ms", "12 s", "3 seconds", "250 tokens/s", "1.7×", "2x", "0.8×",
                     "1.1×", "4.0 times"]
    assert timing_figures("768 = 3 × 256 and 2 × bytes × layers; 4 heads; lesson 3's data; "
                          "the detour of section 2 times the scale; "
                          "GPT-2 has 124 M parameters, step 5, batch 8") == []


def fixed_facts(cell) -> list[dict]:
    return cell.metadata.get("course", {}).get("fixed_facts", [])


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.stem[:2])
def test_lesson_markdown_quotes_no_run_dependent_figure(lesson):
    nb = nbformat.read(lesson, as_version=4)
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        allowed = [f for fact in fixed_facts(cell) for f in fact.get("figures", [])]
        found += [f"cell {index} ({cell.get('id')}): {figure!r}"
                  for figure in timing_figures(cell.source) if figure not in allowed]
    assert not found, (
        f"{lesson.name} writes measured-looking figures by hand ({'; '.join(found)}): print them "
        f"from the run, or, for one of the course's {MAX_FIXED_FACTS} fixed facts, tag the cell "
        f"{FIXED_FACTS_TAG!r} and list the fact with its source in the cell's metadata "
        f"(course.fixed_facts)")


def test_the_fixed_facts_are_few_tagged_and_sourced():
    facts, wrong = [], []
    for lesson in LESSONS:
        for cell in nbformat.read(lesson, as_version=4).cells:
            where = f"{lesson.name}, cell {cell.get('id')}"
            tagged = FIXED_FACTS_TAG in cell.metadata.get("tags", [])
            if tagged != bool(fixed_facts(cell)):
                wrong.append(f"{where}: the tag {FIXED_FACTS_TAG!r} and course.fixed_facts go "
                             "together")
            for fact in fixed_facts(cell):
                facts.append(where)
                if not str(fact.get("source", "")).strip() or not fact.get("figures"):
                    wrong.append(f"{where}: a fixed fact needs its figures and its source")
                wrong += [f"{where}: the fixed fact {figure!r} is not in the cell"
                          for figure in fact.get("figures", [])
                          if figure not in timing_figures(cell.source)]
    assert not wrong, "; ".join(wrong)
    assert len(facts) <= MAX_FIXED_FACTS, (
        f"{len(facts)} fixed facts ({', '.join(facts)}): the course allows {MAX_FIXED_FACTS}; "
        "print the others from a run or write them without a figure")


def _lesson_times():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "lesson_times", Path(__file__).resolve().parents[1] / "scripts" / "lesson_times.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_and_guide_quote_the_lessons_current_minutes_and_run_times():
    """The minutes are counted from the notebooks, the seconds recorded in them by `make
    execute`: after a lesson changes, the README's table and the guide's must follow."""
    import json

    times = _lesson_times()
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    guide = (root / "docs" / "instructors.md").read_text()
    for lesson in LESSONS:
        nb = json.loads(lesson.read_text())
        minutes = round(times.learner_minutes(times.counts(nb)))
        seconds = nb["metadata"]["course"]["execution_seconds"]
        number = lesson.name[:2]
        row = re.search(rf"^\| {int(number)} \| .*\| (\d+) / (\d+) \|$", readme, re.M)
        assert row, f"README: no lesson-table row for lesson {number}"
        assert (int(row.group(1)), int(row.group(2))) == (minutes, round(seconds)), (
            f"README, lesson {number}: {row.group(1)} / {row.group(2)}, the notebook gives "
            f"{minutes} / {round(seconds)} (scripts/lesson_times.py)")
        row = re.search(rf"^\| {number} [^|]+\| (\d+) \| \d × 10 \| ([\d.]+) \|$", guide, re.M)
        assert row, f"docs/instructors.md: no time-table row for lesson {number}"
        assert (int(row.group(1)), float(row.group(2))) == (minutes, seconds), (
            f"docs/instructors.md, lesson {number}: {row.group(1)} min / {row.group(2)} s, the "
            f"notebook gives {minutes} / {seconds}")
