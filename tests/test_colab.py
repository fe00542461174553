"""The lessons' Colab setup cell: inert outside Colab, and inside it installs only what
Colab lacks (never torch, matplotlib or ipywidgets)."""

import pathlib
import subprocess
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from notebook_setup import colab_cell, repo_url  # noqa: E402

NEVER_REINSTALL = ("torch", "matplotlib", "ipywidgets")


def _pretend_colab(monkeypatch):
    """Make `"google.colab" in sys.modules` true, as it is inside Colab."""
    google = types.ModuleType("google")
    google.colab = types.ModuleType("google.colab")
    monkeypatch.setitem(sys.modules, "google", google)
    monkeypatch.setitem(sys.modules, "google.colab", google.colab)


def _run_cell(monkeypatch, tmp_path, in_colab: bool):
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    if in_colab:
        _pretend_colab(monkeypatch)
        (tmp_path / "lessons").mkdir()
        # The cell clones into /content/course; point it at a folder of ours instead.
        source = colab_cell().replace('"/content/course"', repr(str(tmp_path)))
    else:
        monkeypatch.delitem(sys.modules, "google.colab", raising=False)
        source = colab_cell()
    exec(compile(source, "colab-cell", "exec"), {})
    return calls


def test_outside_colab_the_cell_does_nothing(monkeypatch, tmp_path):
    assert _run_cell(monkeypatch, tmp_path, in_colab=False) == []
    assert pathlib.Path.cwd() == tmp_path


def test_inside_colab_it_installs_the_course_and_nothing_colab_has(monkeypatch, tmp_path):
    calls = _run_cell(monkeypatch, tmp_path, in_colab=True)
    # The folder exists already, so no clone: the repository itself, then lorax-client alone
    # (without its declared dependencies, which would downgrade transformers).
    assert len(calls) == 2
    course, client = calls
    assert course[1:4] == ["-m", "pip", "install"] and course[-1] == f"{tmp_path}[quant]"
    assert client[-2:] == ["--no-deps", "lorax-client==0.6.3"]
    for pip in calls:
        assert not [a for a in pip if any(a.startswith(n) for n in NEVER_REINSTALL)]
    assert pathlib.Path.cwd() == tmp_path / "lessons"
    assert sys.path[0] == str(tmp_path)


def test_inside_colab_a_fresh_runtime_clones_the_configured_address(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    monkeypatch.setattr(sys, "path", list(sys.path))
    _pretend_colab(monkeypatch)
    target = tmp_path / "course"
    source = colab_cell().replace('"/content/course"', repr(str(target)))
    source = source.replace("os.chdir(", "print(")  # the fake clone made no folder
    exec(compile(source, "colab-cell", "exec"), {})
    assert calls[0][:2] == ["git", "clone"] and repo_url() in calls[0]


def test_package_ranges_accept_what_colab_ships():
    """Colab's torch, matplotlib 3.10 and ipywidgets 7.7.1 satisfy the package's ranges, so
    `pip install <repo>` keeps them."""
    import tomllib

    from packaging.requirements import Requirement

    deps = {Requirement(d).name: Requirement(d) for d in
            tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]}
    colab = {"torch": "2.9.0", "matplotlib": "3.10.0", "ipywidgets": "7.7.1", "ipython": "7.34.0"}
    for name, version in colab.items():
        assert deps[name].specifier.contains(version), f"{name} {version} would be reinstalled"
