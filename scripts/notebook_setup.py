"""The pieces every lesson notebook shares, kept in one place.

`scripts/sync_notebooks.py` writes them into the lessons; tests check the lessons agree.
The repository's public address is read from pyproject.toml ([project.urls] Repository).
"""

import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def repo_url() -> str:
    """The course's public address, from pyproject.toml."""
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return data["project"]["urls"]["Repository"].rstrip("/")


def github_path(url: str) -> str:
    """'owner/name' of a GitHub address."""
    m = re.fullmatch(r"https://github\.com/([^/]+/[^/]+?)(\.git)?", url)
    if not m:
        raise ValueError(f"the Repository address must be https://github.com/OWNER/NAME, got {url!r}")
    return m.group(1)


def colab_badge(notebook: str, url: str | None = None) -> str:
    """Markdown for an 'Open in Colab' badge of lessons/<notebook>."""
    path = github_path(url or repo_url())
    return (f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]"
            f"(https://colab.research.google.com/github/{path}/blob/main/lessons/{notebook})")


def binder_badge(url: str | None = None) -> str:
    path = github_path(url or repo_url())
    return (f"[![Binder](https://mybinder.org/badge_logo.svg)]"
            f"(https://mybinder.org/v2/gh/{path}/main?urlpath=lab/tree/lessons)")


COLAB_CELL = '''\
# Colab setup: on Google Colab this fetches the course and installs only what Colab lacks
# (torch, matplotlib and ipywidgets are kept as Colab ships them). Elsewhere it does nothing.
import os, subprocess, sys
REPO_URL = "{url}"
if "google.colab" in sys.modules:
    repo = "/content/course"
    if not os.path.isdir(repo):
        subprocess.run(["git", "clone", "--quiet", "--depth", "1", REPO_URL, repo], check=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    subprocess.run(pip + [repo + "[quant]"], check=True)
    subprocess.run(pip + ["--no-deps", "lorax-client==0.6.3"], check=True)  # its pins clash
    sys.path.insert(0, repo)
    os.chdir(os.path.join(repo, "lessons"))'''


def colab_cell(url: str | None = None) -> str:
    """Source of the first code cell of every lesson."""
    return COLAB_CELL.format(url=url or repo_url())
