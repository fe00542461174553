"""A check's ✓ is never followed by an error or a contradiction in the workbook.

Every answer the tests of the checks know (``tests/answers.py``: the ``EXERCISES`` of each
``tests/test_checks_lessonNN.py``), wrong ones and right ones written in other ways, goes
through its exercise's check, on the bundled model as the lesson has it. (The check tests of
this session already did; their lines are read from ``tests.checking.LINES``, and only answers
they did not run are run here.)

- An answer the check flags hands the course's version to the rest of the lesson (the check
  tests assert that it is returned), so the cells after it run exactly as in the workbook with
  its stubs, which ``tests/test_workbooks.py`` runs to its end.
- An answer the check passes is put into the workbook in place of its stub, the other stubs left
  as they are, and the workbook runs in a fresh kernel, up to the end of the section of the last
  cell that uses it: no cell may fail, the check must print its ✓ there too, and every later cell
  whose output the lesson records (not a timing, not a check) must print what the lesson
  printed. A wrong answer that passed would be tried this way too (and the check tests fail).

To stay cheap, each workbook runs once per answer it must try at the same exercise: every
exercise's last right answer (the one written most unlike the lesson's) goes into one run, with
the others' (10 runs, two at a time, each cut as above: about four fifths of the workbooks'
cells, so about what tests/test_workbooks.py's run of them takes).
"""

import json
import pathlib
import re
import sys

import nbformat
import pytest

from tests.answers import exercises
from tests.checking import LINES, run

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKBOOKS = ROOT / "workbooks"
LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))
NUMBERS = [path.name[:2] for path in LESSONS]
CHECK_CALL = re.compile(r"\bcheck_\w+\(")
IGNORED = {"nbval-ignore-output", "nbval-skip", "raises-exception"}


def _sanitizers():
    """The regular expressions of tests/sanitize.cfg: nbval applies them before comparing."""
    text = (ROOT / "tests" / "sanitize.cfg").read_text()
    pairs = re.findall(r"regex: (.*)\nreplace: (.*)", text)
    return [(re.compile(regex), replace) for regex, replace in pairs]


SANITIZE = _sanitizers()


def _output(cell) -> str:
    """What nbval compares, for the parts a contradiction shows in: stdout and text results."""
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream" and out["name"] == "stdout":
            parts.append("".join(out["text"]))
        elif out["output_type"] == "execute_result":
            parts.append("".join(out["data"].get("text/plain", "")))
    text = "".join(parts)
    for regex, replace in SANITIZE:
        text = regex.sub(replace, text)
    return text


def _line(exercise, answer, ctx) -> str:
    line = LINES.get((exercise.check, answer))
    if line is None:
        line, _ = run(exercise.check, answer, *[ctx[a] for a in exercise.args])
    return line


def _passing(number, ctx) -> dict:
    """{exercise name: [(kind, index), ...]}: the answers of lesson ``number`` to try in its
    workbook: any wrong answer its check passes, and the last right answer."""
    chosen = {}
    for exercise in exercises(number):
        picked = [("wrong", i) for i, answer in enumerate(exercise.wrong)
                  if _line(exercise, answer, ctx).startswith("✓")]
        if exercise.right and _line(exercise, exercise.right[-1], ctx).startswith("✓"):
            picked.append(("right", len(exercise.right) - 1))
        if picked:
            chosen[exercise.name] = picked
    return chosen


def _defines(cell, name: str) -> bool:
    return re.search(rf"^(async def|def|class) {re.escape(name)}\b", cell.source, re.M) is not None


def _sections(cells) -> list[int]:
    """For each cell, the index of the first cell of the next section (a "## " heading)."""
    ends, end = [len(cells)] * len(cells), len(cells)
    for i in range(len(cells) - 1, -1, -1):
        ends[i] = end
        if cells[i].cell_type == "markdown" and cells[i].source.startswith("## "):
            end = i
    return ends


def _notebook(number: str, injected: dict):
    """The workbook with ``injected`` ({name: (kind, index)}) in place of those stubs, cut
    after the section of the last cell that uses one of them; also the cells of the check
    calls of the injected exercises."""
    path = WORKBOOKS / next(p.name for p in LESSONS if p.name.startswith(number))
    nb = nbformat.read(path, as_version=4)
    cells, last = nb.cells, 0
    for name, (kind, index) in injected.items():
        at = next(i for i, c in enumerate(cells) if c.cell_type == "code" and _defines(c, name))
        cells[at].source += (f"\n\nimport sys; sys.path.insert(0, {str(ROOT)!r})\n"
                             f"from tests.answers import answer\n"
                             f"{name} = answer({number!r}, {name!r}, {kind!r}, {index})\n"
                             f"{name}.__name__ = {name!r}    # as the learner's cell names it")
        uses = [i for i, c in enumerate(cells) if c.cell_type == "code"
                and re.search(rf"\b{re.escape(name)}\b", c.source)]
        last = max(last, max(uses))
    nb.cells = cells[:_sections(cells)[last]]
    return nb


def _execute(nb):
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(WORKBOOKS)}}).execute()
    return nb


def _selected(session) -> list[str]:
    """The lessons whose test this session runs (all of them, or those ``-k`` picks)."""
    test = "test_a_passing_answer_is_followed_by_the_lessons_own_outputs"
    return [item.callspec.params["number"] for item in session.items
            if getattr(item, "originalname", None) == test and hasattr(item, "callspec")]


@pytest.fixture(scope="module")
def answer_runs(bundled, request):
    """{lesson number: [(injected, executed notebook or the exception), ...]}, two kernels at
    a time, for the lessons this session tests."""
    from concurrent.futures import ThreadPoolExecutor

    model, tokenizer = bundled
    ctx = {"model": model, "tokenizer": tokenizer, "device": model.device}
    jobs = []
    for number in _selected(request.session):
        chosen = _passing(number, ctx)
        for round_ in range(max((len(v) for v in chosen.values()), default=0)):
            injected = {name: picks[round_] for name, picks in chosen.items() if round_ < len(picks)}
            jobs.append((number, injected))

    def execute(job):
        number, injected = job
        try:
            return number, injected, _execute(_notebook(number, injected))
        except Exception as error:              # reported by the test of that lesson
            return number, injected, error

    runs: dict = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for number, injected, result in pool.map(execute, jobs):
            runs.setdefault(number, []).append((injected, result))
    return runs


@pytest.mark.parametrize("number", NUMBERS)
def test_a_passing_answer_is_followed_by_the_lessons_own_outputs(number, answer_runs):
    lesson = json.loads(next(p for p in LESSONS if p.name.startswith(number)).read_text())
    runs = answer_runs.get(number, [])
    assert runs, f"lesson {number}: no answer of its exercises passes its check"
    for injected, nb in runs:
        said = ", ".join(f"{name} ({kind} answer {i})" for name, (kind, i) in injected.items())
        if isinstance(nb, Exception):
            raise AssertionError(f"lesson {number} with {said}: {nb}") from nb
        for i, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            errors = [o for o in cell.outputs if o.output_type == "error"]
            assert not errors, (f"lesson {number} with {said}: cell {i} failed after a ✓: "
                                f"{errors[0].ename}: {errors[0].evalue}")
            if CHECK_CALL.search(cell.source):
                for name in injected:
                    if re.search(rf"\b{re.escape(name)} = check_", cell.source):
                        text = _output(cell)
                        line = next((ln for ln in text.splitlines() if f" {name}" in ln), "")
                        assert line.startswith("✓"), (f"lesson {number}: {name}'s check says "
                                                      f"{line!r} in the workbook")
                continue
            tags = set(cell.metadata.get("tags", []))
            original = lesson["cells"][i]
            if tags & IGNORED or "BEGIN SOLUTION" in "".join(original["source"]):
                continue
            assert _output(cell) == _output(original), (
                f"lesson {number} with {said}: cell {i} printed something else than the lesson "
                f"(a contradiction after a ✓):\n{_output(cell)[:600]}\n--- the lesson:\n"
                f"{_output(original)[:600]}")
