"""The registry of the answers the tests know (tests/answers.py): every exercise of every lesson
is in it with right and wrong answers, and the answers that only a GPU shows wrong (a tensor
left on the CPU) are right on the CPU, where every tensor is on the same device."""

import pathlib

import pytest

from tests.answers import answer, exercises
from tests.checking import assert_passes

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


@pytest.mark.parametrize("number", NUMBERS)
def test_answers_only_a_gpu_shows_wrong_pass_on_the_cpu(number, bundled):
    model, tokenizer = bundled
    ctx = {"model": model, "tokenizer": tokenizer, "device": model.device}
    for exercise in exercises(number):
        for cpu_right in exercise.wrong_on_gpu:
            assert_passes(exercise.check, cpu_right, *[ctx[a] for a in exercise.args])
