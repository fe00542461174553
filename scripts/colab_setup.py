"""The course's installer on Google Colab: the lessons' Colab cell runs this file once it has
fetched the repository (scripts/notebook_setup.py writes that cell into every notebook).

Colab ships torch, transformers, peft, torchao, NumPy, matplotlib, ipywidgets and more, and a
learner's runtime must keep most of them as they are: torch is built for Colab's CUDA (PyPI's
current torch needs a newer driver than Colab's image has), and replacing NumPy, matplotlib,
IPython or ipywidgets under a running session breaks it. So the course is installed with the
versions Colab has pinned, with one exception: a library the lessons import that is older than
the course's lower bound in pyproject.toml is installed at that bound, which is the version the
lessons ran on in Colab's runtime (`make test-colab`). This happens before any lesson imports
it. Colab's torchao 0.10 is such a library: peft 0.19 and later refuse to be imported beside a
torchao older than 0.16.1.

It prints one line: what it installed or upgraded, and what it kept. Run a second time in the
same runtime (after a restart) it installs nothing.

    python scripts/colab_setup.py        # the Colab cell runs this file (runpy)
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from importlib.metadata import distributions

from packaging.requirements import Requirement
from packaging.version import Version

try:
    import tomllib
except ModuleNotFoundError:     # Python 3.10: the same parser, as a package (the dev extra)
    import tomli as tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
DISTRIBUTION = "efficiently-serving-llms"
#: Never installed, upgraded or downgraded here: Colab's CUDA build of torch (and the packages
#: built against it), and what the running notebook server and kernel are made of.
NEVER_CHANGED = ("torch", "torchvision", "torchaudio", "numpy", "matplotlib", "ipywidgets",
                 "ipython", "ipykernel")
#: Kept at Colab's version when the course accepts it; raised to the course's lower bound when
#: it is older, or installed at that bound when Colab has none.
RAISED_WHEN_OLD = ("torchao", "transformers", "tokenizers", "safetensors", "huggingface-hub",
                   "accelerate", "peft")
#: Installed apart, without its declared dependencies (pins that would downgrade transformers).
APART = "lorax-client==0.6.3"


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    """Name (normalized) -> version of every package in this Python."""
    return {normalize(d.metadata["Name"] or ""): d.version for d in distributions()}


def requirements(root: pathlib.Path = ROOT) -> list[Requirement]:
    """The course's requirements (pyproject.toml): its dependencies and the quant extra."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["quant"]]


def lower_bound(requirement: Requirement) -> str:
    """The version of a ``>=`` in the requirement (ValueError when it has none)."""
    bounds = [s.version for s in requirement.specifier if s.operator == ">="]
    if not bounds:
        raise ValueError(f"{requirement} has no lower bound (>=) to install")
    return str(max(bounds, key=Version))


@dataclass
class Plan:
    """What the install keeps and changes."""
    pins: dict[str, str] = field(default_factory=dict)        # name -> the version pip must keep
    upgrades: dict[str, tuple[str, str]] = field(default_factory=dict)   # name -> (Colab's, new)
    short: dict[str, tuple[str, str]] = field(default_factory=dict)  # kept though too old: (have, need)
    requirements: list[str] = field(default_factory=list)     # what pip installs, the course's own

    def constraints(self) -> str:
        return "".join(f"{name}=={version}\n" for name, version in sorted(self.pins.items()))


def plan(have: dict[str, str], needs: list[Requirement]) -> Plan:
    """Which versions to keep, which to raise, and the requirements to hand to pip, for a
    runtime that has ``have`` (name -> version) and a course that ``needs`` these."""
    by_name = {normalize(r.name): r for r in needs}
    out = Plan()
    for name in NEVER_CHANGED + RAISED_WHEN_OLD:
        need = by_name.get(name)
        version = have.get(name)
        accepted = need is None or need.specifier.contains(version or "0", prereleases=True)
        if name in NEVER_CHANGED:
            if version is not None:
                out.pins[name] = version
                if not accepted:
                    out.short[name] = (version, str(need.specifier))
        elif version is not None and accepted:
            out.pins[name] = version
        elif need is not None:         # older than the course's bound, or missing
            out.pins[name] = lower_bound(need)
            if version is not None:
                out.upgrades[name] = (version, out.pins[name])
    # A kept package the course finds too old is handed to pip by name alone (satisfied by what
    # is installed), so that pip neither replaces it nor refuses the install.
    out.requirements = [name if (name := normalize(r.name)) in out.short else str(r) for r in needs]
    return out


def describe(plan: Plan, before: dict[str, str], after: dict[str, str]) -> str:
    """The one line printed at the end."""
    added = [f"{n} {v}" for n, v in sorted(after.items())
             if n not in before and n != DISTRIBUTION]
    parts = [f"Installed the course ({len(added)} packages added: {', '.join(added)})"
             if added else "Installed the course (no package added)"]
    if plan.upgrades:
        parts.append("upgraded " + ", ".join(f"{n} {old} to {new}" for n, (old, new)
                                             in sorted(plan.upgrades.items()))
                     + ", older than the lessons need")
    kept = [f"{n} {v}" for n, v in plan.pins.items() if n not in plan.upgrades and n in before]
    parts.append("kept Colab's " + ", ".join(kept))
    if plan.short:
        parts.append(", ".join(f"{n} {have} is older than the course's {need}" for n, (have, need)
                               in plan.short.items())
                     + " (left as it is: the lessons that need more say so)")
    return "; ".join(parts) + "."


def main(root: pathlib.Path = ROOT) -> None:
    before = installed()
    steps = plan(before, requirements(root))
    if before.get(DISTRIBUTION) and not steps.upgrades:
        print(f"The course is installed already; kept Colab's "
              f"{', '.join(f'{n} {v}' for n, v in steps.pins.items())}.")
        return
    with tempfile.TemporaryDirectory() as folder:
        constraints = pathlib.Path(folder, "colab-constraints.txt")
        constraints.write_text(steps.constraints())
        pip = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
               "-c", str(constraints)]
        # The requirements first, as the plan has them; then the course itself and lorax-client
        # without theirs (pip would otherwise replace a kept package the course finds too old).
        subprocess.run(pip + steps.requirements, check=True)
        subprocess.run(pip + ["--no-deps", str(root)], check=True)
        subprocess.run(pip + ["--no-deps", APART], check=True)
    print(describe(steps, before, installed()))


if __name__ == "__main__":
    main()
