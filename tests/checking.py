"""What the tests of the learners' checks share: run a check, read its one line."""

import io
from contextlib import redirect_stdout

from helpers.checks.core import FAILED, NOT_WRITTEN, PASSED


#: The line each check printed for each answer in this test session, {(check, answer): line}:
#: tests/test_workbook_answers.py reads it rather than running the same checks again.
LINES: dict = {}


def run(check, candidate, *args):
    """(the line the check printed, what it returned)."""
    out = io.StringIO()
    with redirect_stdout(out):
        returned = check(candidate, *args)
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n"), f"not one line: {text!r}"
    try:
        LINES[(check, candidate)] = text.strip()
    except TypeError:                     # an answer that cannot be a key is run again later
        pass
    return text.strip(), returned


def assert_passes(check, candidate, *args):
    line, returned = run(check, candidate, *args)
    assert line.startswith(PASSED), line
    assert returned is candidate
    return line


def assert_not_written(check, *args, fallback):
    def stub(*a, **k):
        raise NotImplementedError()
    line, returned = run(check, stub, *args)
    assert NOT_WRITTEN in line, line
    assert returned is fallback
    return line


def assert_caught(check, candidate, *args, symptom: str, fallback):
    """The check flags ``candidate`` with a line that names ``symptom`` and hands back the
    course's version."""
    line, returned = run(check, candidate, *args)
    assert line.startswith(FAILED), line
    assert symptom in line, f"expected {symptom!r} in: {line}"
    assert "Traceback" not in line
    assert returned is fallback
    return line
