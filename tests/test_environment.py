"""The set-up files agree with each other and the lessons with the shared pieces."""

import json
import os
import pathlib
import re
import subprocess
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from notebook_setup import COLAB_CELL_METADATA, colab_badge, colab_cell, pyproject, repo_url  # noqa: E402

LESSONS = sorted((ROOT / "lessons").glob("*.ipynb"))


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def _pyproject():
    return pyproject()


def test_environment_yml_names_the_same_packages_as_pyproject():
    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    expected = set(project["dependencies"]) | set(extras["lab"]) | set(extras["quant"])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    listed = {r for r in pip if not r.startswith("-")}
    assert {_name(r) for r in listed} == {_name(r) for r in expected}
    assert listed == expected, "same packages, but the version ranges differ"
    assert "-e ." in pip, "environment.yml must install the repository itself"


def test_package_requirements_are_ranges_and_tests_are_pinned():
    deps = _pyproject()["project"]["dependencies"]
    assert not [d for d in deps if "==" in d], "the package's own requirements must be ranges"
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert pins["torch"] == "2.13.0"
    assert pins["transformers"].startswith("5.")
    for name in ("peft", "nbval", "jupyterlab", "ipywidgets", "matplotlib"):
        assert name in pins, f"{name} is not pinned in constraints.txt"


def test_readme_shows_the_commands_and_the_model_switch():
    readme = (ROOT / "README.md").read_text()
    for text in ("make lab", "make test", "COURSE_MODEL", repo_url()):
        assert text in readme
    for lesson in LESSONS:
        assert lesson.name in readme, f"README's lesson table does not list {lesson.name}"


def test_every_lesson_has_the_colab_cell_and_badge():
    assert LESSONS, "no lessons found"
    for path in LESSONS:
        nb = json.loads(path.read_text())
        first_code = next(c for c in nb["cells"] if c["cell_type"] == "code")
        assert "".join(first_code["source"]) == colab_cell(), f"{path.name}: stale Colab cell"
        for key, value in COLAB_CELL_METADATA.items():     # collapsed in Colab and JupyterLab
            assert first_code["metadata"].get(key) == value, f"{path.name}: Colab cell not collapsed"
        assert colab_badge(path.name) in "".join(nb["cells"][0]["source"])
        assert nb["metadata"]["kernelspec"]["name"] == "python3"


def test_committed_notebooks_are_clean_for_strict_nbval():
    for path in LESSONS:
        nb = json.loads(path.read_text())
        for i, cell in enumerate(nb["cells"]):
            if cell["cell_type"] != "code":
                continue
            src = "".join(cell["source"])
            assert "NBVAL" not in src, f"{path.name} cell {i}: use a cell tag, not a comment"
            assert cell["execution_count"] is not None, f"{path.name} cell {i} was not run"
            assert not [o for o in cell["outputs"] if o["output_type"] == "error"], (path.name, i)


def test_sync_script_finds_nothing_to_change():
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "sync_notebooks.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_gpu_run_stops_with_a_message_when_there_is_no_cuda_device(tmp_path):
    """`make test-gpu` on a machine without CUDA (CI, this laptop): exit status 2, a sentence
    that says why, and no lesson run, no report written."""
    report = tmp_path / "gpu-run.md"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")     # hides any GPU from torch
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_lessons_gpu.py"),
                             "--report", str(report)], capture_output=True, text=True, env=env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("No CUDA device: ") and "nothing was run" in result.stderr
    assert result.stdout == "" and not report.exists()
