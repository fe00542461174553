"""Every lesson and workbook in Colab's runtime, as a learner who opens them from their badges.

Run by `make test-colab` with the Python of .venv-colab, the environment pinned to Colab's GPU
runtime (constraints-colab.txt: Python 3.13, torch 2.11, transformers 5.15, peft 0.20,
torchao 0.10, ipywidgets 7.7.1, IPython 7.34, ...). It

1. puts the environment back as Colab ships it, when an earlier run changed it, and copies
   the repository (its files as git sees them, uncommitted changes included) to a
   temporary folder, the stand-in for Colab's /content/course;
2. runs the lessons' Colab cell (the first code cell of every notebook) in a fresh kernel with a
   stand-in `google.colab` imported at start-up, as Colab's kernel has it: the real cell, with
   only its folder changed to the copy. It installs the course into this environment and
   prints one line, shown here;
3. runs every lesson and workbook of the copy in a fresh kernel, JOBS at a time, from its
   first cell (the Colab cell again, which now finds the course installed) to its last. Outputs
   are not compared: a cell that raises fails the notebook. Each notebook's version line (its
   setup cell's first line) is shown;
4. judges the course's claims (scripts/claims.py) on the lessons it executed: every sentence
   on counts, sizes and tokens must hold on this run's figures too (its times are not judged:
   two notebooks share the cores, see ``claims.NOT_TIMES``).

Exits 1 when a notebook failed or a claim does not hold. Step 2 changes the environment (it installs the course and
upgrades torchao); the next run's step 1 undoes that.

    .venv-colab/bin/python scripts/colab_runtime.py [--jobs 2] [NOTEBOOK ...]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import claims  # noqa: E402

SNAPSHOT = Path(sys.prefix) / "as-colab-ships.txt"      # written by make test-colab's build
COLAB_FOLDER = '"/content/course"'          # the cell's folder, replaced by the copy's
CELL_TIMEOUT = 900
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# What Colab's kernel has imported before the first cell runs, as far as the course can tell:
# a module named google.colab (the cell tests `"google.colab" in sys.modules`).
STARTUP = '''\
import importlib.machinery, sys, types
try:
    import google
except ImportError:
    google = sys.modules["google"] = types.ModuleType("google")
    google.__path__ = []
colab = types.ModuleType("google.colab", "A stand-in for Colab's own module (make test-colab)")
colab.__spec__ = importlib.machinery.ModuleSpec("google.colab", None, is_package=True)
colab.__path__ = []
google.colab = sys.modules["google.colab"] = colab
'''


def as_colab_ships() -> None:
    """Put this environment back as it was built (`make test-colab` wrote its pip freeze to
    SNAPSHOT): what an earlier run's Colab cell installed is removed, what it upgraded goes
    back, so that the cell meets Colab's versions again."""
    shipped = dict(line.split("==") for line in SNAPSHOT.read_text().splitlines() if "==" in line)
    shipped = {normalize(name): version for name, version in shipped.items()}
    now = {normalize(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    added = sorted(set(now) - set(shipped))
    changed = [f"{name}=={version}" for name, version in sorted(shipped.items())
               if now.get(name) != version]
    pip = [sys.executable, "-m", "pip", "--quiet", "--disable-pip-version-check"]
    if added:
        subprocess.run(pip + ["uninstall", "--yes"] + added, check=True)
    if changed:
        subprocess.run(pip + ["install", "--no-deps"] + changed, check=True)
    if added or changed:
        print(f"Back to Colab's versions: removed {', '.join(added) or 'nothing'}, "
              f"reinstalled {', '.join(changed) or 'nothing'}", flush=True)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def copy_repository(dest: Path) -> None:
    """The repository's files as git sees them (tracked, and untracked but not ignored)."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, check=True, capture_output=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def point_at(notebook: Path, course: Path) -> nbformat.NotebookNode:
    """The notebook with its Colab cell fetching nothing: the course is at ``course``."""
    nb = nbformat.read(notebook, as_version=4)
    cell = next(c for c in nb.cells if c.cell_type == "code")
    if cell.source.count(COLAB_FOLDER) != 1:
        raise SystemExit(f"{notebook.name}: its first code cell is not the Colab cell "
                         f"(no {COLAB_FOLDER}): run make sync-notebooks")
    cell.source = cell.source.replace(COLAB_FOLDER, json.dumps(str(course)))
    return nb


def kernel_env(folder: Path) -> dict:
    """The kernels' environment: IPython's start-up folder with the stand-in google.colab."""
    startup = folder / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    (startup / "00-google-colab.py").write_text(STARTUP)
    env = dict(os.environ, IPYTHONDIR=str(folder / "ipython"))
    env.pop("MPLBACKEND", None)     # Colab's kernel draws inline
    env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"   # no debugger notice on every kernel start
    return env


def execute(nb: nbformat.NotebookNode, cwd: Path, env: dict) -> tuple[bool, str]:
    """Run ``nb`` in a fresh kernel from ``cwd``: (ran to its end, the error or '')."""
    client = NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(cwd)}})
    try:
        client.execute(env=env)
    except CellExecutionError as error:
        lines = [ANSI.sub("", ln) for ln in str(error).splitlines() if ln.strip()]
        return False, "\n     ".join(lines[-6:])
    except Exception as error:                      # a timeout, a dead kernel
        return False, f"{type(error).__name__}: {error}"
    return True, ""


def _children_cpu() -> float:
    """CPU seconds (user and system) of this process's finished child processes: the kernels."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def stdout_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.output_type == "stream" and o.name == "stdout")


def claims_failures(executed: dict) -> tuple[list[str], int]:
    """The claims judged on the lessons this run executed ({"01": notebook, ...}): a line for
    each that does not hold (the claim, its sentence, the figures), and how many were judged."""
    verdicts = claims.run_verdicts(executed, "colab")
    return [v.line() for v in verdicts if v.status != claims.HOLDS], len(verdicts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2, help="notebooks run at once (default 2)")
    ap.add_argument("notebooks", nargs="*", type=Path,
                    help="lessons/ or workbooks/ notebooks (default: all of both)")
    args = ap.parse_args()
    # The longest first (lesson 10 compiles), so that the last to finish is a short one.
    names = [p.resolve().relative_to(ROOT) for p in args.notebooks] or sorted(
        [p.relative_to(ROOT) for p in (ROOT / "lessons").glob("[0-9]*.ipynb")]
        + [p.relative_to(ROOT) for p in (ROOT / "workbooks").glob("[0-9]*.ipynb")],
        key=lambda p: (p.name, p.parent.name), reverse=True)
    if not SNAPSHOT.exists():
        raise SystemExit(f"{SNAPSHOT} is missing: build the environment with make test-colab")
    as_colab_ships()
    with tempfile.TemporaryDirectory(prefix="colab-runtime-") as tmp:
        tmp = Path(tmp)
        course = tmp / "course"
        copy_repository(course)
        env = kernel_env(tmp)
        print(f"Colab's runtime: Python {sys.version.split()[0]} ({sys.executable}); "
              f"the course copied to {course}", flush=True)

        # The Colab cell alone, in a fresh kernel: it installs the course.
        t0 = time.monotonic()
        setup = point_at(ROOT / names[0], course)
        setup.cells = [next(c for c in setup.cells if c.cell_type == "code")]
        ok, error = execute(setup, course / "lessons", env)
        print(f"Colab cell ({time.monotonic() - t0:.0f} s): "
              f"{stdout_text(setup.cells[0]).strip() or error}", flush=True)
        if not ok:
            print("0 passed, 1 failed")
            return 1

        def run(name: Path) -> tuple[Path, bool, str, float, str, nbformat.NotebookNode]:
            nb = point_at(course / name, course)
            start = time.monotonic()
            ok, error = execute(nb, course / name.parent, env)
            code = [c for c in nb.cells if c.cell_type == "code"]
            versions = stdout_text(code[1]).splitlines()[:1] if len(code) > 1 else []
            return name, ok, error, time.monotonic() - start, (versions or [""])[0], nb

        t0, cpu0 = time.monotonic(), _children_cpu()
        failed, executed = [], {}
        with ThreadPoolExecutor(max_workers=args.jobs) as pool:
            for name, ok, error, seconds, versions, nb in pool.map(run, names):
                if ok and name.parent.name == "lessons":
                    executed[name.name.split("_", 1)[0]] = nb
                print(f"{'ok  ' if ok else 'FAIL'} {str(name):42} {seconds:5.0f} s  {versions}"
                      + ("" if ok else f"\n     {error}"), flush=True)
                if not ok:
                    failed.append(name)
        # The kernels' CPU time: on an idle machine with N cores, about what one notebook at a
        # time takes, and N at a time about 1/N of it (each lesson sets torch to one thread).
        print(f"{len(names)} notebooks in {time.monotonic() - t0:.0f} s, {args.jobs} at a time; "
              f"their kernels used {_children_cpu() - cpu0:.0f} s of CPU")
    print(f"{len(names) - len(failed)} passed, {len(failed)} failed")
    wrong, judged = claims_failures(executed)
    print(f"claims: {judged} judged on this run's lessons ({claims.git_commit()}), "
          f"{len(wrong)} do not hold" + "".join(f"\n  {line}" for line in wrong))
    return 1 if failed or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
