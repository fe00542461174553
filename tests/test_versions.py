"""helpers.versions: the line of versions every lesson's setup cell prints, and the line it adds
when a library is too old for the lesson (or missing)."""

import json
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from helpers import versions
from helpers.versions import LESSON_NEEDS, show_versions, older, version_problems
from scripts.notebook_setup import pyproject

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "lessons").glob("[0-9]*.ipynb")) + sorted(
    (ROOT / "workbooks").glob("[0-9]*.ipynb"))
GOOD = {"torch": "2.13.0", "transformers": "5.23.0", "peft": "0.21.2", "torchao": "0.18.0"}


def _setup_cell(path: Path) -> dict:
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"][1]


def _lower_bounds() -> dict[str, str]:
    project = pyproject()["project"]
    out = {}
    for text in project["dependencies"] + project["optional-dependencies"]["quant"]:
        req = Requirement(text)
        out[req.name] = next(s.version for s in req.specifier if s.operator == ">=")
    return out


@pytest.mark.parametrize("a, b, expected", [
    ("2.9.1", "2.11", True), ("2.11.0", "2.11", False), ("2.11", "2.11.0", False),
    ("2.13.0", "2.11", False), ("0.10.0", "0.17", True), ("5.15.0", "5.15", False),
    ("5.4.0", "5.15", True), ("2.12.0rc1", "2.12", False), ("2.10.0.dev20260101", "2.11", True),
])
def test_older_compares_releases_as_numbers(a, b, expected):
    assert older(a, b) is expected


def test_enough_everywhere_says_nothing():
    for lesson in LESSON_NEEDS:
        assert version_problems(lesson, GOOD) == []


def test_a_torchao_older_than_peft_accepts_is_named_with_what_to_do():
    """Colab's torchao 0.10 beside peft 0.20: lessons 05 and 06 (peft) and 04 (torchao) say so."""
    colab = dict(GOOD, torch="2.11.0", transformers="5.15.0", peft="0.20.0", torchao="0.10.0")
    for lesson in (4, 5, 6):
        [line] = version_problems(lesson, colab)
        assert line.startswith(f"Lesson {lesson:02d} needs torchao 0.17 or newer and this runtime "
                               "has 0.10.0: on Colab run the first cell again"), line
        assert 'pip install "torchao>=0.17", then restart the kernel' in line
    for lesson in (1, 2, 3, 7, 8, 9, 10):       # no torchao, no peft there
        assert version_problems(lesson, colab) == []


def test_an_old_torch_is_named_with_what_to_do_on_colab_and_elsewhere():
    [line] = version_problems(10, dict(GOOD, torch="2.9.0"))
    assert line.startswith("Lesson 10 needs torch 2.11 or newer and this runtime has 2.9.0: ")
    assert "Runtime > Change runtime type" in line and 'pip install "torch>=2.11"' in line
    assert "\n" not in line


def test_a_missing_library_is_named_unless_it_is_optional():
    [line] = version_problems(5, dict(GOOD, peft=None))
    assert "needs peft 0.20 or newer and it is not installed" in line
    assert version_problems(4, dict(GOOD, torchao=None)) == []   # lesson 04 says so itself
    assert len(version_problems(1, dict(GOOD, torch=None, transformers="5.4.0"))) == 2


def test_an_unknown_lesson_is_a_value_error():
    with pytest.raises(ValueError, match="no lesson 99"):
        version_problems(99, GOOD)


def test_show_versions_prints_the_installed_release_and_the_problems(monkeypatch, capsys):
    found = {"torch": "2.11.0+cu128", "transformers": "5.15.0", "peft": "0.20.0"}

    def version(name):
        if name not in found:
            raise versions.importlib.metadata.PackageNotFoundError(name)
        return found[name]

    monkeypatch.setattr(versions.importlib.metadata, "version", version)
    problems = show_versions(5)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "torch 2.11.0, transformers 5.15.0, peft 0.20.0, torchao not installed"
    assert out[1:] == problems == []
    found["peft"] = "0.18.1"
    show_versions(6)
    assert capsys.readouterr().out.splitlines()[1].startswith("Lesson 06 needs peft 0.20 or newer")


def test_the_table_is_the_package_lower_bounds():
    """What a lesson needs is what the package asks for: the versions the lessons ran on."""
    bounds = _lower_bounds()
    for lesson, needs in LESSON_NEEDS.items():
        for name, need in needs.items():
            assert not older(need, bounds[name]) and not older(bounds[name], need), \
                (lesson, name, need, bounds[name])
    used = {name for needs in LESSON_NEEDS.values() for name in needs}
    assert used == set(versions.LIBRARIES)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[f"{p.parent.name}/{p.stem}" for p in NOTEBOOKS])
def test_every_setup_cell_checks_its_own_lesson_first(path):
    lesson = int(path.name[:2])
    assert lesson in LESSON_NEEDS, f"{path.name}: add lesson {lesson} to LESSON_NEEDS"
    source = "".join(_setup_cell(path)["source"])
    calls = re.findall(r"^show_versions\((\d+)\)", source, re.M)
    assert calls == [str(lesson)], f"{path.name}: its setup cell must call show_versions({lesson})"
    check = source.index("\nshow_versions(")
    for call in ("seed_everything(", "load_model("):
        at = source.find(call)
        assert at == -1 or check < at, f"{path.name}: check the versions before {call}...)"


def test_the_saved_line_is_what_the_pins_print():
    """nbval compares the setup cell's first line with the saved one: under constraints.txt it
    is the same on every machine (no build tag such as +cpu)."""
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    expected = ", ".join(f"{name} {pins[name]}" for name in versions.LIBRARIES) + "\n"
    for path in sorted((ROOT / "lessons").glob("[0-9]*.ipynb")):
        out = _setup_cell(path)["outputs"][0]
        assert out["name"] == "stdout" and out["text"][0] == expected, path.name
