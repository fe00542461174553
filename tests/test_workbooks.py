"""The workbooks (workbooks/*.ipynb): each lesson with its solutions cut to stubs.

They are generated (scripts/make_workbooks.py, `make workbooks`) and committed; these tests
check that they are current and deterministic, that every lesson has its exercises with a check
each, that the lessons' own solutions pass their checks, and that a workbook runs to its end
in a fresh kernel with every stub untouched, each check saying "not written yet".
"""

import json
import pathlib
import re
import subprocess
import sys

import nbformat
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from make_workbooks import BEGIN, END, STUB, cut_solutions, workbook, write  # noqa: E402

LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))
WORKBOOKS = ROOT / "workbooks"
CHECK_CALL = re.compile(r"\bcheck_\w+\(")


def _lesson(path):
    return json.loads(path.read_text())


def _check_cells(nb):
    return [c for c in nb["cells"] if c["cell_type"] == "code"
            and CHECK_CALL.search("".join(c["source"]))]


def _text(cell):
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", [])
                   if o["output_type"] == "stream")


def test_committed_workbooks_are_current():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_workbooks.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_make_workbooks_is_deterministic(tmp_path):
    for out in (tmp_path / "a", tmp_path / "b"):
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_workbooks.py"), "--out", str(out)],
                       check=True, capture_output=True)
    for lesson in LESSONS:
        first, second = (tmp_path / "a" / lesson.name).read_bytes(), (tmp_path / "b" / lesson.name).read_bytes()
        assert first == second, lesson.name
        assert first == (WORKBOOKS / lesson.name).read_bytes(), f"{lesson.name}: committed workbook differs"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.name[:2])
def test_every_lesson_has_two_to_four_exercises_each_with_a_passing_check(lesson):
    nb = _lesson(lesson)
    _, exercises = workbook(nb, lesson.name)
    assert 2 <= exercises <= 4, f"{lesson.name}: {exercises} exercises"
    checks = _check_cells(nb)
    assert len(checks) >= exercises
    for cell in checks:        # the committed outputs; nbval checks that a fresh run agrees
        assert _text(cell).startswith("✓"), f"{lesson.name}: {''.join(cell['source'])!r} -> {_text(cell)!r}"


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.name[:2])
def test_putting_the_solutions_back_gives_the_lesson(lesson):
    """The workbook differs from the lesson only inside the solution markers (and the title)."""
    lesson_nb = _lesson(lesson)
    book = json.loads((WORKBOOKS / lesson.name).read_text())
    assert len(book["cells"]) == len(lesson_nb["cells"])
    for i, (ours, theirs) in enumerate(zip(lesson_nb["cells"][1:], book["cells"][1:]), 1):
        source = "".join(ours["source"])
        assert cut_solutions(source, f"{lesson.name} cell {i}")[0] == "".join(theirs["source"]), i
        if ours["cell_type"] == "code":
            assert theirs["outputs"] == [] and theirs["execution_count"] is None


def test_cutting_a_solution_keeps_its_indentation_and_refuses_broken_markers():
    source = f"def f(x):\n    # doubles x\n    {BEGIN}\n    y = 2 * x\n    return y\n    {END}\n"
    cut, stubs = cut_solutions(source, "t")
    assert stubs == 1
    assert cut == f"def f(x):\n    # doubles x\n    {STUB[0]}\n    {STUB[1]}\n"
    for broken in (f"{BEGIN}\nx = 1\n", f"x = 1\n{END}\n", f"{BEGIN}\n{BEGIN}\n{END}\n"):
        with pytest.raises(ValueError, match="SOLUTION"):
            cut_solutions(broken, "t")


def test_an_exercise_without_a_check_after_it_is_refused():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# Lesson"),
                nbformat.v4.new_code_cell(f"def f():\n    {BEGIN}\n    return 1\n    {END}"),
                nbformat.v4.new_code_cell("print(f())")]
    with pytest.raises(ValueError, match="followed by a check"):
        workbook(json.loads(nbformat.writes(nb)), "00_test.ipynb")


def _execute(path):
    """The workbook at ``path`` executed in a fresh kernel (working directory workbooks/)."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(WORKBOOKS)}}).execute()
    return nb


@pytest.fixture(scope="module")
def executed_workbooks(request):
    """Every workbook this session tests (all, or those ``-k`` picks) executed, two at a time:
    each lesson runs torch on one thread, so two kernels keep both cores of a small machine
    busy. Name -> notebook, or the exception."""
    from concurrent.futures import ThreadPoolExecutor

    test = "test_workbook_runs_to_the_end_with_its_stubs"
    selected = [item.callspec.params["lesson"] for item in request.session.items
                if getattr(item, "originalname", None) == test and hasattr(item, "callspec")]

    def run(lesson):
        try:
            return lesson.name, _execute(WORKBOOKS / lesson.name)
        except Exception as error:           # reported by the test of that workbook
            return lesson.name, error

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, selected))


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda p: p.name[:2])
def test_workbook_runs_to_the_end_with_its_stubs(lesson, executed_workbooks):
    """A fresh kernel, every stub untouched: no error, and each check says "not written yet"
    while the cells after it go on with the course's version."""
    nb = executed_workbooks[lesson.name]
    if isinstance(nb, Exception):
        raise nb
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors[0]
    checks = _check_cells(nb)
    assert checks
    for cell in checks:
        lines = [ln for ln in _text(cell).splitlines() if ln.strip()]
        assert lines and all("not written yet" in ln for ln in lines), (cell.source, lines)
