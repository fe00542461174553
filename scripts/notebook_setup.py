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
# On Google Colab this cell fetches the course and installs what Colab lacks. The
# packages Colab ships (torch, transformers, torchao, matplotlib, ipywidgets, ...) keep their
# versions: an upgrade under a running kernel breaks it. Elsewhere this cell does nothing.
import os, subprocess, sys
REPO_URL = "{url}"
if "google.colab" in sys.modules:
    from importlib.metadata import distributions, version
    repo = "/content/course"
    if not os.path.isdir(repo):
        subprocess.run(["git", "clone", "--quiet", "--depth", "1", REPO_URL, repo], check=True)
    def installed():   # name -> version of every package in the runtime
        return {{(d.metadata["Name"] or "").lower().replace("_", "-"): d.version
                for d in distributions()}}
    before = installed()
    keep = ["torch", "torchvision", "torchaudio", "torchao", "transformers", "tokenizers",
            "safetensors", "huggingface-hub", "accelerate", "peft", "numpy", "matplotlib",
            "ipywidgets", "ipython", "ipykernel"]
    pins = [f"{{name}}=={{version(name)}}" for name in keep if name in before]
    with open(os.path.join(repo, "colab-constraints.txt"), "w") as f:
        f.write("\\n".join(pins))              # pip may add packages but not change these
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "-c", f.name]
    extra = "" if "torchao" in before else "[quant]"   # Colab's own torchao when it has one
    subprocess.run(pip + [repo + extra], check=True)
    subprocess.run(pip + ["--no-deps", "lorax-client==0.6.3"], check=True)  # its pins clash
    added = [f"{{n}} {{v}}" for n, v in sorted(installed().items()) if before.get(n) != v]
    print(f"Installed {{', '.join(added) or 'nothing'}}; kept Colab's {{', '.join(pins)}}.")
    sys.path.insert(0, repo)
    os.chdir(os.path.join(repo, "lessons"))'''


def colab_cell(url: str | None = None) -> str:
    """Source of the first code cell of every lesson. Its first line is a Colab form title, so
    that Colab shows the title alone; JupyterLab hides the code by COLAB_CELL_METADATA."""
    return COLAB_CELL.format(url=url or repo_url())


#: The setup cell's metadata: collapsed in Colab (form view) and in JupyterLab (input hidden).
COLAB_CELL_METADATA = {"cellView": "form", "jupyter": {"source_hidden": True}}
