"""The lessons' Colab setup cell: inert outside Colab; inside it, it installs the course with
the packages Colab ships (torch, transformers, torchao, ...) pinned at Colab's versions, and
says in one sentence what it installed."""

import importlib.metadata
import pathlib
import subprocess
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from notebook_setup import colab_cell, pyproject, repo_url  # noqa: E402

# What the cell must never reinstall; this environment stands in for Colab's.
KEPT = ("torch", "transformers", "tokenizers", "accelerate", "peft", "torchao", "numpy",
        "matplotlib", "ipywidgets", "ipython")


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


def test_outside_colab_the_cell_does_nothing(monkeypatch, tmp_path, capsys):
    assert _run_cell(monkeypatch, tmp_path, in_colab=False) == []
    assert pathlib.Path.cwd() == tmp_path
    assert capsys.readouterr().out == ""


def test_inside_colab_it_pins_what_colab_ships_and_installs_the_course(monkeypatch, tmp_path):
    calls = _run_cell(monkeypatch, tmp_path, in_colab=True)
    # The folder exists already, so no clone: the repository itself, then lorax-client alone
    # (without its declared dependencies, which would downgrade transformers).
    assert len(calls) == 2
    course, client = calls
    constraints = tmp_path / "colab-constraints.txt"
    for pip in calls:
        assert pip[:5] == [sys.executable, "-m", "pip", "install", "--quiet"]
        assert pip[5:7] == ["-c", str(constraints)]
        assert not [a for a in pip[7:] if any(a.startswith(n) for n in KEPT)], pip
    # This environment has torchao, so the [quant] extra is left out: Colab's torchao stays.
    assert course[-1] == str(tmp_path)
    assert client[-2:] == ["--no-deps", "lorax-client==0.6.3"]
    pins = dict(line.split("==") for line in constraints.read_text().splitlines())
    for name in KEPT:
        assert pins[name] == importlib.metadata.version(name), name
    assert pathlib.Path.cwd() == tmp_path / "lessons"
    assert sys.path[0] == str(tmp_path)


def test_without_torchao_it_installs_the_quant_extra(monkeypatch, tmp_path):
    real = importlib.metadata.distributions
    monkeypatch.setattr(importlib.metadata, "distributions",
                        lambda: [d for d in real() if d.metadata["Name"] != "torchao"])
    course, _ = _run_cell(monkeypatch, tmp_path, in_colab=True)
    assert course[-1] == f"{tmp_path}[quant]"
    assert "torchao==" not in (tmp_path / "colab-constraints.txt").read_text()


def test_it_says_in_one_sentence_what_it_installed(monkeypatch, tmp_path, capsys):
    real = importlib.metadata.distributions
    runs = []                     # the second look at the packages finds one more
    extra = types.SimpleNamespace(metadata={"Name": "Added_By_Pip"}, version="1.2")

    def distributions():
        runs.append(1)
        return list(real()) + ([extra] if len(runs) > 1 else [])

    monkeypatch.setattr(importlib.metadata, "distributions", distributions)
    _run_cell(monkeypatch, tmp_path, in_colab=True)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("Installed added-by-pip 1.2; kept Colab's ")
    assert f"torch=={importlib.metadata.version('torch')}" in out


def test_inside_colab_a_fresh_runtime_clones_the_configured_address(monkeypatch, tmp_path):
    target = tmp_path / "course"
    calls = []

    def run(cmd, **kw):           # a clone that makes the folder, as git would
        calls.append(cmd)
        if cmd[:2] == ["git", "clone"]:
            (target / "lessons").mkdir(parents=True)

    monkeypatch.setattr(subprocess, "run", run)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.chdir(tmp_path)
    _pretend_colab(monkeypatch)
    source = colab_cell().replace('"/content/course"', repr(str(target)))
    exec(compile(source, "colab-cell", "exec"), {})
    assert calls[0][:2] == ["git", "clone"] and repo_url() in calls[0]
    assert len(calls) == 3 and pathlib.Path.cwd() == target / "lessons"


def test_package_ranges_accept_what_colab_ships():
    """Colab's torch, matplotlib 3.10 and ipywidgets 7.7.1 satisfy the package's ranges, so
    pip can install the course with them pinned."""
    from packaging.requirements import Requirement

    deps = {Requirement(d).name: Requirement(d) for d in pyproject()["project"]["dependencies"]}
    colab = {"torch": "2.9.0", "matplotlib": "3.10.0", "ipywidgets": "7.7.1", "ipython": "7.34.0"}
    for name, version in colab.items():
        assert deps[name].specifier.contains(version), f"{name} {version} would be reinstalled"
