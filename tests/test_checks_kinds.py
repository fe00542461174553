"""Five kinds of wrong answer that give the right result on a laptop and still break the lesson,
each refused by the checks on a CPU with a hint that names the cause:

- a tensor made on the CPU (or in float where the lesson's is an integer mask), which a GPU
  refuses or runs slower: the checks run the learner's code as if its inputs were on a GPU
  (``helpers.checks.core.OnTheGpu``);
- an input changed in place, which the lesson uses again: compared deep, before and after;
- more model passes than the lesson promises: counted;
- a case the exercise's text names (the pad token inside a prompt, a lookup match that
  overlaps the tail): tried;
- a stream timer that measures something else: timed on a fake clock that moves on every
  reading.

The answers live in each lesson's tests (and in the registry, ``tests/answers.py``); here they
are grouped by kind.
"""

import pytest

from tests import test_checks_lesson01 as l01
from tests import test_checks_lesson02 as l02
from tests import test_checks_lesson03 as l03
from tests import test_checks_lesson06 as l06
from tests import test_checks_lesson07 as l07
from tests import test_checks_lesson09 as l09
from tests.answers import exercises
from tests.checking import assert_caught, assert_passes

pytestmark = pytest.mark.usefixtures("one_thread")

KINDS = {
    "made on the CPU or in another dtype": {**l01.ON_A_GPU, **l02.ON_A_GPU, **l06.ON_A_GPU,
                                            **l09.ON_A_GPU},
    "an input changed in place": {**l01.IN_PLACE, **l03.IN_PLACE, **l07.IN_PLACE},
    "more model passes than promised": l09.COSTS,
    "a case the text names": {**l02.NAMED_CASES, **l09.NAMED_CASES},
    "timing measured from the wrong moment": l07.TIMING,
}


def _exercise_of(answer):
    for lesson in ("01", "02", "03", "06", "07", "09"):
        for exercise in exercises(lesson):
            if answer in exercise.wrong or answer in exercise.right:
                return exercise
    raise LookupError(f"{answer.__name__} is in no exercise of the registry")


def _args(exercise, bundled):
    model, tokenizer = bundled
    ctx = {"model": model, "tokenizer": tokenizer, "device": model.device}
    return [ctx[name] for name in exercise.args]


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_has_two_wrong_answers_refused_with_their_cause(kind, bundled):
    answers = KINDS[kind]
    assert len(answers) >= 2, kind
    for answer, symptom in answers.items():
        exercise = _exercise_of(answer)
        assert exercise.wrong[answer] == symptom
        assert_caught(exercise.check, answer, *_args(exercise, bundled), symptom=symptom,
                      fallback=exercise.fallback)


@pytest.mark.parametrize("answer", [l01.prefill_then_the_loop, l02.batched_with_the_encoding_moved],
                         ids=lambda f: f.__name__)
def test_right_answers_near_these_kinds_pass(answer, bundled):
    exercise = _exercise_of(answer)
    assert answer in exercise.right
    assert_passes(exercise.check, answer, *_args(exercise, bundled))
