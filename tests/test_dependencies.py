"""Everything the course imports at run time is declared in pyproject.toml.

The helpers package and the lessons' code cells are read with ast (every import, including
those inside functions), each imported top-level name is mapped to the distribution that
provides it, and that distribution must be one of the package's dependencies or extras.
"""

import ast
import json
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

from scripts.notebook_setup import colab_cell, pyproject

ROOT = Path(__file__).resolve().parents[1]
# Import names whose distribution is named otherwise (the rest: the name itself, normalized).
DISTRIBUTION = {"IPython": "ipython", "yaml": "pyyaml", "lorax": "lorax-client"}
# Installed beside the package, not declared by it, and why.
INSTALLED_APART = {"lorax-client": "its declared pins would downgrade transformers: the Makefile "
                                   "and the Colab cell install it with --no-deps"}


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirement_name(requirement: str) -> str:
    return _normalize(re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0])


def third_party_imports(source: str) -> set[str]:
    """Top-level names of the absolute imports in ``source`` that are not the standard library
    or the course's own package."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return {n for n in names if n not in sys.stdlib_module_names and n != "helpers"}


def distribution(import_name: str) -> str:
    return _normalize(DISTRIBUTION.get(import_name, import_name))


def _lesson_code(path: Path) -> str:
    """A lesson's code cells as one Python source (IPython's % and ! lines left out)."""
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    lines = [line for cell in cells for line in "".join(cell["source"]).splitlines()
             if not line.lstrip().startswith(("%", "!"))]
    return "\n".join(lines)


def _declared() -> dict[str, set[str]]:
    project = pyproject()["project"]
    groups = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    return {group: {_requirement_name(r) for r in reqs} for group, reqs in groups.items()}


def _runtime_imports() -> dict[str, set[str]]:
    """Import name -> the files (helpers modules and lessons) that import it."""
    found: dict[str, set[str]] = {}
    sources = [(p, p.read_text()) for p in sorted((ROOT / "helpers").rglob("*.py"))]
    sources += [(p, _lesson_code(p)) for p in sorted((ROOT / "lessons").glob("*.ipynb"))]
    for path, source in sources:
        for name in third_party_imports(source):
            found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_runtime_import_is_declared():
    declared = _declared()
    # What a user installs: the dependencies, plus the quant extra that lesson 04 names.
    runtime = declared["dependencies"] | declared["quant"]
    missing = {name: sorted(files) for name, files in _runtime_imports().items()
               if distribution(name) not in runtime | set(INSTALLED_APART)}
    assert not missing, f"imported at run time but not declared in pyproject.toml: {missing}"


def test_the_scan_sees_imports_inside_functions_and_maps_names():
    source = ("import os, torch.nn\nfrom yaml import safe_load\nfrom . import models\n"
              "def f():\n    import IPython.display\n    from helpers import load_model\n")
    assert third_party_imports(source) == {"torch", "yaml", "IPython"}
    assert {distribution(n) for n in third_party_imports(source)} == {"torch", "pyyaml",
                                                                       "ipython"}
    assert distribution("outlines_core") == "outlines-core"
    assert distribution("huggingface_hub") == "huggingface-hub"


def test_the_names_map_to_the_installed_distributions():
    """The mapping agrees with what is installed here (a wrong entry would hide a missing
    dependency)."""
    installed = packages_distributions()
    checked = 0
    for name in _runtime_imports():
        if name not in installed:
            continue  # an optional package not installed in this environment
        assert distribution(name) in {_normalize(d) for d in installed[name]}, name
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("distribution_name", sorted(INSTALLED_APART))
def test_what_is_installed_apart_is_installed_by_the_setup(distribution_name):
    assert f"--no-deps {distribution_name}" in (ROOT / "Makefile").read_text()
    assert "scripts/colab_setup.py" in colab_cell() or '"colab_setup.py"' in colab_cell()
    setup = (ROOT / "scripts" / "colab_setup.py").read_text()
    assert f'APART = "{distribution_name}==' in setup and '"--no-deps", APART' in setup
