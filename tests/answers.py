"""Every learner's answer the tests of the checks know, in one registry per lesson.

Each ``tests/test_checks_lessonNN.py`` lists its exercises as :class:`Exercise` records in
``EXERCISES``: the check, what it is called with, the course's version it falls back to, the
right answers written in other ways (each must pass, and the lesson's later cells must run on
it as on the course's: ``tests/test_workbook_answers.py``) and the wrong ones (each must be
flagged with a hint naming its cause). A workbook kernel reaches an answer by its place in the
registry, ``answer("01", "greedy_with_cache", "right", 0)``, so answers need no names of
their own (lesson 05's classes are made by a function).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Exercise:
    """One "Your turn" exercise as the tests know it.

    ``name`` is the name the lesson binds the learner's answer to (``greedy_with_cache``,
    ``LoraLayer``); ``args`` the names the check takes after the answer, as the lesson calls it
    (``("model", "tokenizer")``, ``("device",)``); ``right`` the answers that must pass;
    ``wrong`` maps each wrong answer to the words its hint must hold (a tensor left on the CPU
    included: the checks catch it on any device, ``helpers.checks.core.OnTheGpu``)."""

    name: str
    check: Callable
    args: tuple[str, ...]
    fallback: Any
    right: list = field(default_factory=list)
    wrong: dict = field(default_factory=dict)


def lesson_module(lesson: str):
    return importlib.import_module(f"tests.test_checks_lesson{lesson}")


def exercises(lesson: str) -> list[Exercise]:
    return lesson_module(lesson).EXERCISES


def exercise(lesson: str, name: str) -> Exercise:
    return next(e for e in exercises(lesson) if e.name == name)


def answer(lesson: str, name: str, kind: str, index: int):
    """The ``index``-th ``kind`` ("right" or "wrong") answer of exercise ``name``."""
    found = exercise(lesson, name)
    return (found.right if kind == "right" else list(found.wrong))[index]


def pick(answers: dict, *chosen) -> dict:
    """The entries of ``answers`` (answer -> symptom) for the ``chosen`` answers only."""
    return {answer: answers[answer] for answer in chosen}
