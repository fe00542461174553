"""The lessons' Colab cell and the installer it runs (scripts/colab_setup.py), against a stand-in
Colab that ships what Colab's GPU runtime ships (constraints-colab.txt: torch 2.11.0,
transformers 5.15.0, peft 0.20.0, torchao 0.10.0, ...). pip is not run here: the calls it would
get are recorded. `make test-colab` runs the same cell for real, in that runtime rebuilt.

Inert outside Colab; inside it, the course is installed with Colab's packages pinned, torch and
the notebook stack never changed, a library older than the course's lower bound (Colab's
torchao) raised to that bound, and one printed line says what changed."""

import importlib.metadata
import pathlib
import re
import shutil
import subprocess
import sys
import types

import pytest
from packaging.requirements import Requirement

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import colab_setup  # noqa: E402
from notebook_setup import colab_cell, pyproject, repo_url  # noqa: E402


def _colab_versions() -> dict[str, str]:
    """Name -> version of what Colab's GPU runtime ships (constraints-colab.txt)."""
    out = {}
    for line in (ROOT / "constraints-colab.txt").read_text().splitlines():
        if "==" in line and not line.startswith("#"):
            name, version = line.split("==")
            out[colab_setup.normalize(name)] = version
    return out


COLAB = _colab_versions()


def _pretend_colab(monkeypatch, ships: dict[str, str]):
    """`"google.colab" in sys.modules`, as inside Colab, and a runtime that has ``ships``."""
    google = types.ModuleType("google")
    google.colab = types.ModuleType("google.colab")
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.colab", google.colab)
    dists = [types.SimpleNamespace(metadata={"Name": name}, version=version)
             for name, version in ships.items()]
    monkeypatch.setattr(importlib.metadata, "distributions", lambda: list(dists))
    return dists


def _course(tmp_path) -> pathlib.Path:
    """What the cell's clone would hold, as far as the installer reads it."""
    (tmp_path / "lessons").mkdir()
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "colab_setup.py", tmp_path / "scripts")
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def _run_cell(monkeypatch, tmp_path, ships=None, after=None):
    """Run the Colab cell; returns the pip and git calls, each with the constraints it named.
    ``after`` (name -> version) is what pip adds to the runtime."""
    calls = []
    dists = _pretend_colab(monkeypatch, ships) if ships is not None else None

    def run(cmd, **kw):
        pins = None
        if "-c" in cmd:
            pins = dict(line.split("==") for line in
                        pathlib.Path(cmd[cmd.index("-c") + 1]).read_text().splitlines())
        calls.append((cmd, pins))
        if dists is not None and after and "--no-deps" in cmd:
            dists.extend(types.SimpleNamespace(metadata={"Name": n}, version=v)
                         for n, v in after.items())
            after.clear()

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    source = colab_cell().replace('"/content/course"', repr(str(tmp_path)))
    exec(compile(source, "colab-cell", "exec"), {})
    return calls


def test_outside_colab_the_cell_does_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    assert _run_cell(monkeypatch, tmp_path) == []
    assert pathlib.Path.cwd() == tmp_path
    assert capsys.readouterr().out == ""


def test_on_todays_colab_it_keeps_torch_and_raises_torchao_before_anything_imports_it(
        monkeypatch, tmp_path, capsys):
    calls = _run_cell(monkeypatch, _course(tmp_path), ships=COLAB,
                      after={"llguidance": "1.9.1", "efficiently-serving-llms": "0.1.0"})
    # The folder exists already, so no clone: the course's requirements, then the course and
    # lorax-client without their declared dependencies.
    assert [cmd[-1] for cmd, _ in calls[1:]] == [str(tmp_path), "lorax-client==0.6.3"]
    for cmd, pins in calls:
        assert cmd[:5] == [sys.executable, "-m", "pip", "install", "--quiet"]
        # torch, NumPy, matplotlib and the notebook stack stay what Colab ships
        for name in colab_setup.NEVER_CHANGED:
            assert pins[name] == COLAB[name], name
        assert pins["torchao"] == "0.17.0"                  # peft 0.20 refuses 0.10
        for name in ("transformers", "peft", "accelerate", "tokenizers", "huggingface-hub"):
            assert pins[name] == COLAB[name], name          # new enough: kept
    first = calls[0][0]
    requirements = first[first.index("-c") + 2:]
    assert "torchao>=0.17.0" in requirements and "torch>=2.11.0" in requirements
    assert not [a for a in requirements if a.startswith("torch==")]
    assert pathlib.Path.cwd() == tmp_path / "lessons" and sys.path[0] == str(tmp_path)
    out = capsys.readouterr().out
    assert out.count("\n") == 1, out
    assert out.startswith("Installed the course (1 packages added: llguidance 1.9.1); "
                          "upgraded torchao 0.10.0 to 0.17.0, older than the lessons need; "
                          "kept Colab's torch 2.11.0, ")
    assert "transformers 5.15.0" in out and "peft 0.20.0" in out


def test_run_again_in_the_same_runtime_it_installs_nothing(monkeypatch, tmp_path, capsys):
    ships = dict(COLAB, torchao="0.17.0", **{"efficiently-serving-llms": "0.1.0"})
    assert _run_cell(monkeypatch, _course(tmp_path), ships=ships) == []
    out = capsys.readouterr().out
    assert out.startswith("The course is installed already; kept Colab's torch 2.11.0, ")
    assert pathlib.Path.cwd() == tmp_path / "lessons"


def test_a_fresh_runtime_clones_the_configured_address(monkeypatch, tmp_path):
    target = tmp_path / "course"
    calls = []

    def run(cmd, **kw):           # a clone that makes the folder, as git would
        calls.append(cmd)
        if cmd[:2] == ["git", "clone"]:
            _course(target.mkdir() or target)

    _pretend_colab(monkeypatch, COLAB)
    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    source = colab_cell().replace('"/content/course"', repr(str(target)))
    exec(compile(source, "colab-cell", "exec"), {})
    assert calls[0][:2] == ["git", "clone"] and repo_url() in calls[0]
    assert len(calls) == 4 and pathlib.Path.cwd() == target / "lessons"


def _needs():
    return colab_setup.requirements(ROOT)


def test_plan_on_todays_colab():
    plan = colab_setup.plan(COLAB, _needs())
    assert plan.upgrades == {"torchao": ("0.10.0", "0.17.0")}
    assert plan.short == {}
    assert plan.pins["torch"] == "2.11.0" and plan.pins["torchvision"] == COLAB["torchvision"]


def test_plan_raises_an_old_library_to_the_course_bound_and_installs_a_missing_one_there():
    have = dict(COLAB, transformers="5.10.0", peft="0.18.1")
    del have["torchao"]
    plan = colab_setup.plan(have, _needs())
    assert plan.upgrades == {"transformers": ("5.10.0", "5.15.0"), "peft": ("0.18.1", "0.20.0")}
    assert plan.pins["torchao"] == "0.17.0"          # missing: installed at the bound


def test_plan_keeps_a_torch_the_course_finds_too_old_and_says_so():
    plan = colab_setup.plan(dict(COLAB, torch="2.9.0"), _needs())
    assert plan.pins["torch"] == "2.9.0" and "torch" not in plan.upgrades
    assert plan.short == {"torch": ("2.9.0", ">=2.11.0")}
    assert "torch" in plan.requirements               # by name: satisfied as it is
    assert not [r for r in plan.requirements if r.startswith("torch>")]
    line = colab_setup.describe(plan, COLAB, COLAB)
    assert line.endswith("torch 2.9.0 is older than the course's >=2.11.0 (left as it is: the "
                         "lessons that need more say so).")


def test_lower_bound_needs_a_lower_bound():
    assert colab_setup.lower_bound(Requirement("x>=1.2,<2")) == "1.2"
    with pytest.raises(ValueError, match="no lower bound"):
        colab_setup.lower_bound(Requirement("x<2"))


def test_lower_bounds_are_what_the_colab_runtime_runs():
    """Each lower bound of a package Colab ships is Colab's version, or the version the Colab
    cell installs there: `make test-colab` runs every lesson on exactly these."""
    installs = colab_setup.plan(COLAB, _needs()).pins
    checked = []
    for req in _needs():
        name = colab_setup.normalize(req.name)
        if name in COLAB:
            assert colab_setup.lower_bound(req) == installs.get(name, COLAB[name]), name
            checked.append(name)
    assert {"torch", "transformers", "peft", "torchao", "numpy", "ipywidgets"} <= set(checked)


def test_the_course_accepts_what_colab_ships_except_what_the_cell_raises():
    deps = {colab_setup.normalize(r.name): r for r in _needs()}
    refused = {name for name, req in deps.items()
               if name in COLAB and not req.specifier.contains(COLAB[name])}
    assert refused == {"torchao"}
    lab = [Requirement(r) for r in pyproject()["project"]["optional-dependencies"]["lab"]]
    kernel = next(r for r in lab if r.name == "ipykernel")
    assert kernel.specifier.contains(COLAB["ipykernel"])


def test_what_colab_ships_is_named_in_one_place():
    """The Makefile builds the stand-in runtime from constraints-colab.txt (Python 3.13)."""
    makefile = (ROOT / "Makefile").read_text()
    assert "-c constraints-colab.txt $(COLAB_SHIPS)" in makefile
    ships = re.search(r"COLAB_SHIPS := ((?:.*\\\n)*.*)", makefile).group(1).split()
    ships = [s for s in ships if s != "\\"]
    assert set(colab_setup.NEVER_CHANGED) - {"torchvision", "torchaudio"} <= set(ships)
    assert set(colab_setup.RAISED_WHEN_OLD) <= set(ships)
    assert COLAB["torch"] == "2.11.0" and COLAB["ipywidgets"] == "7.7.1"


# --- make test-colab's runner (scripts/colab_runtime.py) -------------------------------------

def test_the_runner_points_the_real_cell_at_its_copy(tmp_path):
    import json

    import colab_runtime

    nb = colab_runtime.point_at(ROOT / "lessons" / "01_text_generation.ipynb", tmp_path)
    cell = next(c for c in nb.cells if c.cell_type == "code")
    assert cell.source.replace(json.dumps(str(tmp_path)), '"/content/course"') == colab_cell()
    assert "/content/course" not in cell.source


def test_the_runner_refuses_a_notebook_without_the_colab_cell(tmp_path):
    import nbformat

    import colab_runtime

    path = tmp_path / "x.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(1)")])
    nbformat.write(nb, path)
    with pytest.raises(SystemExit, match="not the Colab cell"):
        colab_runtime.point_at(path, tmp_path)


def test_the_runners_kernels_start_with_a_google_colab_module():
    """What the cell looks for, and what libraries look up (accelerate: find_spec)."""
    import colab_runtime

    probe = ("import importlib.util, sys\n"
             "assert 'google.colab' in sys.modules and importlib.util.find_spec('google.colab')\n"
             "import google.colab\nprint(google.colab.__name__)")
    out = subprocess.run([sys.executable, "-c", colab_runtime.STARTUP + probe],
                         capture_output=True, text=True, check=True).stdout
    assert out == "google.colab\n"
