"""The hints on demand (helpers/checks/hints.py): every exercise the lessons hold has three
steps, given one after the other (the idea, the tools, the shape of the answer), and a name that
is no exercise gets one line that names the exercises there are."""

import importlib
import json
import pathlib
import re
import sys

import pytest

import helpers.checks
from helpers.checks import hint
from helpers.checks import hints as hints_module
from helpers.checks.hints import HINTS, STEPS

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fresh_steps(monkeypatch):
    monkeypatch.setattr(hints_module, "_given", {})


def exercises_of_the_lessons() -> dict[str, str]:
    """Every exercise the lessons hold, by the name its cell defines, with its lesson's number
    (the registry the mutation test of the checks keeps)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    registry = importlib.import_module("check_exercises")
    return {e.name: e.lesson for e in registry.EXERCISES}


def test_every_exercise_has_three_steps_and_no_other_name_has_any():
    known = exercises_of_the_lessons()
    assert set(HINTS) == set(known)
    for name, entry in HINTS.items():
        assert entry.lesson == known[name], name
        assert len(entry.steps) == len(STEPS) == 3, name
        assert all(len(step.split()) >= 8 for step in entry.steps), name
        assert len(set(entry.steps)) == 3, name


def test_every_check_of_the_package_has_its_exercise_hints():
    checks = {n for n in dir(helpers.checks) if n.startswith("check_")}
    assert {entry.check for entry in HINTS.values()} == checks


def test_every_exercise_is_in_the_lesson_its_hints_name():
    for name, entry in HINTS.items():
        lesson = next((ROOT / "lessons").glob(f"{entry.lesson}_*.ipynb"))
        cells = json.loads(lesson.read_text())["cells"]
        code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
        assert any(re.search(rf"\b(def|class) {name}\b", c) and "### BEGIN SOLUTION" in c
                   for c in code), (name, lesson.name)
        assert any(f"{entry.check}(" in c for c in code), (entry.check, lesson.name)


@pytest.mark.parametrize("name", list(HINTS))
def test_the_steps_come_one_after_the_other(name, capsys):
    entry = HINTS[name]
    for number, step in enumerate(entry.steps, 1):
        hint(name)
        said = capsys.readouterr().out
        assert said.startswith(f"hint {number} of 3 for {name} ({STEPS[number - 1]}):")
        assert " ".join(said.split()).count(" ".join(step.split()[:8])) == 1
    hint(name)                       # past the last step: the last step again, and where to look
    said = capsys.readouterr().out
    assert said.startswith(f"hint 3 of 3 for {name}") and f"lesson {entry.lesson}" in said


def test_a_step_can_be_asked_for_again_and_each_exercise_counts_its_own(capsys):
    hint("replay")
    hint("replay")
    hint("replay", 1)
    assert capsys.readouterr().out.count("hint 1 of 3 for replay") == 2
    hint("pad_batch")
    assert capsys.readouterr().out.startswith("hint 1 of 3 for pad_batch")
    hint("replay")
    assert capsys.readouterr().out.startswith("hint 3 of 3 for replay")


def test_the_answer_itself_or_its_checks_name_finds_the_exercise(capsys):
    def replay():
        pass

    class LoraLayer:
        pass

    for name, exercise in ((replay, "replay"), (LoraLayer, "LoraLayer"),
                           ("check_break_even", "break_even_tokens"), ("sharded_mlp", "ShardedMLP")):
        hint(name)
        assert capsys.readouterr().out.startswith(f"hint 1 of 3 for {exercise} ")


def test_an_unknown_name_gets_one_line_naming_the_exercises(capsys):
    hint("rplay")
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and said.startswith("✗ hint: no exercise is called 'rplay'")
    assert "did you mean 'replay'?" in said
    assert all(name in said for name in HINTS)
    hint("replay", 4)
    said = capsys.readouterr().out
    assert said.count("\n") == 1 and "steps are 1, 2 and 3" in said


def test_every_solution_of_the_lessons_has_hints_and_every_workbook_says_how_to_ask():
    sys.path.insert(0, str(ROOT / "scripts"))
    from make_workbooks import exercise_names

    found = set()
    for lesson in sorted((ROOT / "lessons").glob("*.ipynb")):
        cells = json.loads(lesson.read_text())["cells"]
        names = [n for c in cells if c["cell_type"] == "code"
                 for n in exercise_names("".join(c["source"]))]
        assert all(HINTS[n].lesson == lesson.name[:2] for n in names), lesson.name
        found |= set(names)
        first = "".join(json.loads((ROOT / "workbooks" / lesson.name).read_text())
                        ["cells"][0]["source"])
        assert f'`hint("{names[0]}")`' in first and "from helpers.checks import hint" in first
    assert found == set(HINTS)
