"""The pieces every lesson notebook shares, kept in one place.

`scripts/sync_notebooks.py` writes them into the lessons; tests check the lessons agree.
The repository's public address is read from pyproject.toml ([project.urls] Repository).
"""

import pathlib
import re

try:
    import tomllib
except ModuleNotFoundError:     # Python 3.10: the same parser, as a package (the dev extra)
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def pyproject() -> dict:
    """pyproject.toml, parsed."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def repo_url() -> str:
    """The course's public address, from pyproject.toml."""
    return pyproject()["project"]["urls"]["Repository"].rstrip("/")


def github_path(url: str) -> str:
    """'owner/name' of a GitHub address."""
    m = re.fullmatch(r"https://github\.com/([^/]+/[^/]+?)(\.git)?", url)
    if not m:
        raise ValueError(f"the Repository address must be https://github.com/OWNER/NAME, got {url!r}")
    return m.group(1)


def colab_badge(notebook: str, url: str | None = None, folder: str = "lessons") -> str:
    """Markdown for an 'Open in Colab' badge of <folder>/<notebook> (lessons/ or workbooks/)."""
    path = github_path(url or repo_url())
    return (f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
            f"(https://colab.research.google.com/github/{path}/blob/main/{folder}/{notebook})")


def binder_badge(url: str | None = None) -> str:
    path = github_path(url or repo_url())
    return (f"[![Binder](https://mybinder.org/badge_logo.svg)]"
            f"(https://mybinder.org/v2/gh/{path}/main?urlpath=lab/tree/lessons)")


COLAB_CELL = '''\
#@title Colab setup: does nothing outside Colab (click to see the code) {{ display-mode: "form" }}
# On Google Colab this cell fetches the course and installs it (scripts/colab_setup.py),
# keeping the torch, NumPy, matplotlib and ipywidgets Colab ships: replacing them under a
# running session breaks it. A library the lessons need newer than Colab's (torchao) is
# upgraded before anything imports it. The cell says in one line what it changed.
# Elsewhere it does nothing.
import os, subprocess, sys
REPO_URL = "{url}"
if "google.colab" in sys.modules:
    from runpy import run_path
    repo = "/content/course"
    if not os.path.isdir(repo):
        subprocess.run(["git", "clone", "--quiet", "--depth", "1", REPO_URL, repo], check=True)
    run_path(os.path.join(repo, "scripts", "colab_setup.py"), run_name="__main__")
    sys.path.insert(0, repo)
    os.chdir(os.path.join(repo, "lessons"))'''


def colab_cell(url: str | None = None) -> str:
    """Source of the first code cell of every lesson. Its first line is a Colab form title, so
    that Colab shows the title alone; JupyterLab hides the code by COLAB_CELL_METADATA."""
    return COLAB_CELL.format(url=url or repo_url())


#: The setup cell's metadata: collapsed in Colab (form view) and in JupyterLab (input hidden).
COLAB_CELL_METADATA = {"cellView": "form", "jupyter": {"source_hidden": True}}
