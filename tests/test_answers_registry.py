"""The registry of the answers the tests know (tests/answers.py): every exercise of every lesson
is in it with right and wrong answers."""

import pathlib

import pytest

from tests.answers import answer, exercises

ROOT = pathlib.Path(__file__).resolve().parents[1]
NUMBERS = [p.name[:2] for p in sorted((ROOT / "lessons").glob("*.ipynb"))]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("number", NUMBERS)
def test_every_exercise_has_right_and_wrong_answers(number):
    import sys
    sys.path.insert(0, str(ROOT / "scripts"))
    from check_exercises import EXERCISES

    registered = {e.name for e in exercises(number)}
    assert registered == {e.name for e in EXERCISES if e.lesson == number}
    for exercise in exercises(number):
        assert len(exercise.right) >= 2 and exercise.wrong, exercise.name
        assert answer(number, exercise.name, "right", 0) is exercise.right[0]
