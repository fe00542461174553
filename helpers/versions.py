"""Which torch, transformers, peft and torchao a lesson runs on, and whether they are enough for
it. (Every lesson's setup cell.)

A library older than a lesson needs does not say so: the lesson stops somewhere in the middle
with a traceback that rarely names a version (peft refusing an old torchao, a config field that
does not exist yet, a compiler error). So every lesson's setup cell calls
``show_versions(lesson)`` first. It prints one line with the versions, and for each library
that is older than the lesson needs, or missing, one line that names the version the lesson
needs and what to do.

``LESSON_NEEDS`` is the table of what each lesson needs: the lowest versions the lessons have
run on, which are the lower bounds of pyproject.toml (tests/test_versions.py keeps the two in
step). They are Colab's versions, where ``make test-colab`` runs every lesson, or the version
the lessons' Colab cell installs there when Colab's is too old (torchao). The versions are read
from the installed packages' metadata: nothing is imported, so the check works even where
importing a library would fail.
"""

from __future__ import annotations

import importlib.metadata
import re

#: The libraries the line names, in its order.
LIBRARIES = ("torch", "transformers", "peft", "torchao")

_BASE = {"torch": "2.11", "transformers": "5.15"}
#: Lesson -> library -> the lowest version it runs on. A library a lesson does not use is left
#: out. torchao is optional where it appears: lesson 04 says itself when it is missing, and
#: lessons 05-06 use it only through peft, which refuses a torchao older than 0.16.1 beside
#: it (Colab's 0.10): installed, it must be at least this.
LESSON_NEEDS: dict[int, dict[str, str]] = {
    1: _BASE, 2: _BASE, 3: _BASE,
    4: {**_BASE, "torchao": "0.17"},
    5: {**_BASE, "peft": "0.20", "torchao": "0.17"},
    6: {**_BASE, "peft": "0.20", "torchao": "0.17"},
    7: _BASE, 8: _BASE, 9: _BASE, 10: _BASE, 11: _BASE,
}
#: Libraries a lesson may run without (the lesson, or the library that uses it, says so).
OPTIONAL = ("torchao",)


def installed_version(name: str) -> str | None:
    """The installed version of ``name`` without a local build tag (``2.11.0+cu128`` ->
    ``2.11.0``: the same release on every platform), or None when it is not installed."""
    try:
        return importlib.metadata.version(name).split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, ...]:
    """``2.11.0`` -> (2, 11, 0); a pre-release or dev suffix is ignored (``2.12.0rc1`` -> 2.12.0)."""
    return tuple(int(part) for part in re.findall(r"\d+", re.split(r"[a-z]", version)[0]))


def older(version: str, than: str) -> bool:
    """Whether release ``version`` comes before ``than`` (``older("2.9.1", "2.11")`` is True)."""
    a, b = _release(version), _release(than)
    width = max(len(a), len(b))
    return a + (0,) * (width - len(a)) < b + (0,) * (width - len(b))


def _what_to_do(name: str, need: str) -> str:
    if name == "torch":
        return (f'on Colab choose the latest runtime version (Runtime > Change runtime type); '
                f'elsewhere pip install "torch>={need}", then restart the kernel')
    return (f'on Colab run the first cell again, which upgrades it; elsewhere '
            f'pip install "{name}>={need}", then restart the kernel')


def version_problems(lesson: int, versions: dict[str, str | None]) -> list[str]:
    """One line for each library in ``versions`` (name -> version, None when missing) that is
    older than ``lesson`` needs, or missing; empty when all is well."""
    if lesson not in LESSON_NEEDS:
        raise ValueError(f"no lesson {lesson!r}: the lessons are {min(LESSON_NEEDS)} to "
                         f"{max(LESSON_NEEDS)}")
    problems = []
    for name, need in LESSON_NEEDS[lesson].items():
        have = versions.get(name)
        if have is None and name in OPTIONAL:
            continue
        if have is None or older(have, need):
            found = "it is not installed" if have is None else f"this runtime has {have}"
            problems.append(f"Lesson {lesson:02d} needs {name} {need} or newer and {found}: "
                            f"{_what_to_do(name, need)}.")
    return problems


def show_versions(lesson: int) -> list[str]:
    """Print the versions of torch, transformers, peft and torchao in one line, then a line for
    each one that is too old for ``lesson`` (or missing). Returns those lines. (Every lesson.)"""
    versions = {name: installed_version(name) for name in LIBRARIES}
    print(", ".join(f"{name} {version or 'not installed'}" for name, version in versions.items()))
    problems = version_problems(lesson, versions)
    for line in problems:
        print(line)
    return problems
