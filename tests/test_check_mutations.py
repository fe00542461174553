"""The mutation test of the checks (``scripts/mutate_checks.py``): its committed results are those
of the current solutions, checks and mutator, no mutant is missed, every harmless one has its
reason, and a sample of mutants, run again, does what the results say.

The full run is a script (a few minutes); here only its fingerprints are compared and one
caught and one harmless mutant of every exercise are run again.
"""

import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import mutate_checks  # noqa: E402
from check_exercises import EXERCISES  # noqa: E402
from mutants import mutants  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
RESULTS = mutate_checks.load_results()


def test_every_exercise_of_the_lessons_is_in_the_registry():
    registered = {(e.lesson, e.name) for e in EXERCISES}
    for lesson in sorted((ROOT / "lessons").glob("*.ipynb")):
        import json
        import re

        for cell in json.loads(lesson.read_text())["cells"]:
            source = "".join(cell["source"])
            if cell["cell_type"] == "code" and "### BEGIN SOLUTION" in source:
                names = re.findall(r"^(?:async def|def|class) (\w+)", source, re.M)
                assert any((lesson.name[:2], n) in registered for n in names), (
                    f"{lesson.name}: an exercise ({names}) is missing from scripts/check_exercises.py")


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.key)
def test_the_committed_results_are_current(exercise):
    result = RESULTS.get(exercise.key)
    assert result is not None, f"{exercise.key}: run python scripts/mutate_checks.py --exercise {exercise.key}"
    assert result["fingerprint"] == mutate_checks.fingerprint(exercise), (
        f"{exercise.key}: the solution, its check or the mutator changed since the last run: "
        f"python scripts/mutate_checks.py --exercise {exercise.key}")
    source = mutate_checks.exercise_cell(exercise)
    keys = [m.key for m in mutants(source, mutate_checks.solution_lines(source, exercise.name))]
    assert keys == [r["key"] for r in result["mutants"]]


def test_the_report_is_the_results_rendered():
    assert mutate_checks.REPORT.read_text() == mutate_checks.render(RESULTS), \
        "python scripts/mutate_checks.py --render"


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.key)
def test_no_mutant_is_missed_and_every_reason_is_used(exercise):
    records = RESULTS.get(exercise.key, {}).get("mutants", [])
    missed = [r["key"] for r in records if mutate_checks.classify(exercise, r) == "missed"]
    assert not missed, f"{exercise.key}: the check passes these mutants: {missed}"
    survived = {r["key"] for r in records if r["outcome"] == "survived"}
    stale = [key for key in exercise.harmless if key not in survived]
    assert not stale, f"{exercise.key}: reasons for mutants that are no longer passed: {stale}"


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.key)
def test_a_sample_of_mutants_does_what_the_results_say(exercise, bundled):
    model, tokenizer = bundled
    ctx = {"model": model, "tokenizer": tokenizer, "device": model.device}
    by_key = {e.key: e for e in EXERCISES}
    source = mutate_checks.exercise_cell(exercise)
    found = {m.key: m for m in mutants(source, mutate_checks.solution_lines(source, exercise.name))}
    records = RESULTS[exercise.key]["mutants"]
    sample = [next((r for r in records if r["outcome"] == outcome), None)
              for outcome in ("caught", "survived")]
    for record in filter(None, sample):
        outcome, line = mutate_checks.run_check(exercise, found[record["key"]].source, ctx, by_key)
        assert outcome == record["outcome"], (exercise.key, record["key"], line)
