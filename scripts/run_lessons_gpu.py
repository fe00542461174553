"""Every lesson and workbook on a CUDA GPU, and the record of that run (`make test-gpu`).

    python scripts/run_lessons_gpu.py                    # all of it: docs/gpu-run.md and .json
    python scripts/run_lessons_gpu.py --budget 540 --jobs 4 --archive gpu-run.tar.gz
    python scripts/run_lessons_gpu.py --only lessons/02,lessons/07 --no-server
    python scripts/run_lessons_gpu.py --report-from gpu-run.tar.gz   # the report again, no run
    python scripts/run_lessons_gpu.py --allow-cpu --only 01          # check this script on a CPU

In this order:
1. It imports what it and the lessons need (nbclient, nbformat, ipykernel, fastapi, uvicorn,
   llguidance, openai, lorax-client, ipywidgets, ...). If one is missing it prints one line,
   the pip command that installs the lot, and exits with status 3. Then it looks for a CUDA
   device: without one it exits with status 2 (unless --allow-cpu, which runs everything on
   the CPU to check this script; the report then says that it is no GPU's).
2. The server check (unless --no-server): ``benchmarks.gpu_server.run(out_dir,
   budget_seconds)``, in a process of its own so that its GPU memory and threads end with it.
   If that module is missing or raises, the report says so and the rest goes on.
3. Every lesson, one at a time, each in a fresh kernel with the lessons' folder as working
   directory, from a copy (results/gpu/lessons/): the lessons themselves are never written.
   A lesson gets --timeout seconds; a cell that raises ends it. Their wall times are reported.
4. Every workbook the same way (results/gpu/workbooks/), --jobs at a time: their wall times
   are not reported, since they share the machine.
5. The report, built from the executed copies: docs/gpu-run.md for people and
   docs/gpu-run.json for ``helpers.gpu_run.gpu_record`` (a lesson quotes it on a laptop).
   It gives the device and versions, each notebook's result and time beside the time of its
   committed CPU run, the headline figures of every lesson (``gpu_figures.FIGURES``) from the
   committed outputs (a laptop CPU) beside this device's, and the server check's lines.

No notebook starts after --budget seconds (it is marked "not run: time budget"), and a running
one is stopped there, so that the whole run fits a fixed slot. --only picks notebooks by part
of their path ("02", "lessons/", "workbooks/07"). --report-from DIR (or a .tar.gz that
--archive wrote) builds the report from executed copies without running anything: a GPU
machine sends back its archive, and a laptop writes docs/gpu-run.md from it.

Setup on a GPU image that has torch, transformers and peft but no Jupyter (a few seconds):

    python3 -m pip install --no-deps -r requirements-gpu.txt

On such a machine with no network: `sh scripts/gpu_wheels.sh WHEELS` on a machine with one
(Python 3.12 manylinux wheels, about 30 MB), carry the folder, then
`python3 -m pip install --no-index --no-deps --target /tmp/site WHEELS/*.whl` and
`export PYTHONPATH=/tmp/site`.

Exit status: 0 when every notebook that started ran to its end, 1 when one failed or was
stopped, 2 without a CUDA device, 3 when a package is missing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import importlib.metadata
import importlib.util
import inspect
import json
import math
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]

import claims  # noqa: E402
import gpu_figures  # noqa: E402

OUT = ROOT / "results" / "gpu"
REPORT = ROOT / "docs" / "gpu-run.md"
RECORD = ROOT / "docs" / "gpu-run.json"
KINDS = ("lessons", "workbooks")
#: (module, the pip package that has it) this script and the lessons import.
REQUIRED = [("nbclient", "nbclient"), ("nbformat", "nbformat"), ("ipykernel", "ipykernel"),
            ("IPython", "ipython"), ("ipywidgets", "ipywidgets"), ("fastapi", "fastapi"),
            ("starlette", "starlette"), ("uvicorn", "uvicorn"), ("h11", "h11"),
            ("prometheus_client", "prometheus_client"),
            ("llguidance", "llguidance"), ("openai", "openai"), ("lorax", "lorax-client"),
            ("pydantic", "pydantic"), ("httpx", "httpx"), ("tqdm", "tqdm"),
            ("matplotlib", "matplotlib"), ("peft", "peft"), ("transformers", "transformers"),
            ("torch", "torch")]
#: Imported by file only (no import: each takes seconds, and the lessons import them anyway).
HEAVY = {"matplotlib", "peft", "transformers", "torch"}
#: Lesson 04's library path; the lesson says so and goes on without it.
OPTIONAL = [("torchao", "torchao")]
REQUIREMENTS = "requirements-gpu.txt"


# --- 1. what must be installed ----------------------------------------------------------------

def missing_packages(required=None) -> list[str]:
    """The pip packages of ``required`` (default: ``REQUIRED``) whose module cannot be imported
    (for one that is there but needs a module that is not, that module's name in brackets)."""
    missing = []
    for module, package in REQUIRED if required is None else required:
        if module in HEAVY:
            if importlib.util.find_spec(module) is None:
                missing.append(package)
            continue
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            top = (exc.name or module).split(".")[0]
            missing.append(package if top == module else f"{package} (needs {top})")
        except Exception as exc:                   # there, but it breaks on import
            why = (str(exc).splitlines() or [""])[0][:120]
            missing.append(f"{package} ({type(exc).__name__}: {why})")
    return missing


def install_hint(missing: list[str]) -> str:
    """One line: what is missing, and the pip command that installs it."""
    listed = _requirements()
    names = [name.split(" (")[0] for name in missing]
    others = [name for name in names if _canonical(name) not in listed]
    command = f"python3 -m pip install --no-deps -r {REQUIREMENTS}"
    if others:
        command += " && python3 -m pip install " + " ".join(others)
    return (f"missing: {', '.join(missing)}; install with: {command}  (no network: "
            f"sh scripts/gpu_wheels.sh WHEELS where there is one, then python3 -m pip install "
            f"--no-index --no-deps WHEELS/*.whl)")


def _canonical(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


def _requirements() -> set[str]:
    """The packages requirements-gpu.txt names."""
    path = ROOT / REQUIREMENTS
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    return {_canonical(line.split("==")[0]) for line in lines
            if line.strip() and not line.startswith("#")}


# --- 2. the environment of the run ------------------------------------------------------------

def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def describe_machine() -> dict:
    """Device, date and versions, for the report."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        device = f"{props.name} ({props.total_memory / 2**30:.0f} GiB)"
    else:
        device = (f"CPU only ({platform.machine()}, {os.cpu_count()} cores): a check of the "
                  f"script, not a GPU run")
    return {"device": device, "cpu_only": not torch.cuda.is_available(),
            "date": datetime.date.today().isoformat(), "commit": claims.git_commit(),
            "versions": {"python": platform.python_version(), "torch": torch.__version__,
                         "CUDA": torch.version.cuda or "none",
                         "transformers": _version("transformers"), "peft": _version("peft"),
                         "torchao": _version("torchao")}}


def kernel_environment() -> dict:
    """The environment of every kernel and check: the course importable from its folder
    (nothing installed), no model hub, the Makefile's settings."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    for key, value in (("HF_HUB_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false"),
                       ("MPLBACKEND", "Agg"), ("OMP_NUM_THREADS", "2"),
                       ("PYDEVD_DISABLE_FILE_VALIDATION", "1"), ("PYTHONUNBUFFERED", "1")):
        env.setdefault(key, value)
    return env


# --- 3, 4. the notebooks ----------------------------------------------------------------------

def execute_copy(source: Path, target: Path, timeout: float, budget_cut: bool = False) -> dict:
    """Run the notebook ``source`` in a fresh kernel (working directory: its folder) for at
    most ``timeout`` seconds, write the executed copy to ``target`` whatever happened (the
    outputs up to the cell that failed), and return {"status", "detail", "seconds"}, which
    the copy's metadata also keeps (course.gpu_run). Status: ok, failed, timeout, or stopped
    (``budget_cut``: the timeout was what was left of the time budget)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    nb = nbformat.read(source, as_version=4)
    for cell in nb.cells:          # a cell the run does not reach must not show the saved outputs
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = NotebookClient(nb, timeout=max(1, math.ceil(timeout)), kernel_name="python3",
                            resources={"metadata": {"path": str(source.parent)}})
    start = time.perf_counter()
    deadline = time.monotonic() + timeout
    status, detail, index = "ok", "", None
    try:
        client.reset_execution_trackers()
        with client.setup_kernel():
            for index, cell in enumerate(nb.cells):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CellTimeoutError(f"no time left for cell {index}")
                client.timeout = max(1, math.ceil(left))
                client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
            client.set_widgets_metadata()
    except CellTimeoutError:
        status = "stopped" if budget_cut else "timeout"
        detail = f"in cell {index}"
    except CellExecutionError as exc:
        status, detail = "failed", f"cell {index}: {exc.ename}: {exc.evalue}"
    except DeadKernelError:
        status, detail = "failed", f"cell {index}: the kernel died"
    except Exception as exc:                          # the kernel did not start, ...
        status, detail = "failed", f"{type(exc).__name__}: {exc}"
    record = {"status": status, "detail": detail[:300],
              "seconds": round(time.perf_counter() - start, 1)}
    nb.metadata.setdefault("course", {})["gpu_run"] = record
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)
    return record


def _worker_command(source: Path, target: Path, timeout: float, budget_cut: bool) -> list[str]:
    return ([sys.executable, str(Path(__file__).resolve()), "--execute-one", str(source),
             str(target), "--timeout", f"{timeout:.0f}"] + (["--budget-cut"] if budget_cut else []))


class Runner:
    """Starts notebooks in worker processes and keeps the time budget."""

    #: Seconds a worker may take beyond its notebook's timeout (kernel start and shutdown)
    #: before it is killed.
    GRACE = 90

    def __init__(self, out: Path, timeout: float, budget: float | None, started: float):
        self.out, self.timeout, self.budget, self.started = out, timeout, budget, started
        self.env = kernel_environment()

    def left(self) -> float:
        if self.budget is None:
            return math.inf
        return self.budget - (time.monotonic() - self.started)

    def start(self, source: Path, kind: str):
        """A running worker for ``source``, or None when the budget is spent."""
        left = self.left()
        if left <= 0:
            return None
        timeout = min(self.timeout, left)
        target = self.out / kind / source.name
        target.unlink(missing_ok=True)
        log = (self.out / "logs").joinpath(f"{kind}-{source.stem}.log")
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as handle:
            process = subprocess.Popen(_worker_command(source, target, timeout, timeout < self.timeout),
                                       stdin=subprocess.DEVNULL, stdout=handle,
                                       stderr=subprocess.STDOUT, env=self.env,
                                       start_new_session=True)
        return process, target, log, time.monotonic() + timeout + self.GRACE

    @staticmethod
    def finish(process, target: Path, log: Path, kill_at: float, wait: bool = True):
        """The worker's record once it has ended (None while it runs and ``wait`` is False)."""
        try:
            process.wait(timeout=max(0.0, kill_at - time.monotonic()) if wait else 0)
        except subprocess.TimeoutExpired:
            if wait or time.monotonic() >= kill_at:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
                return {"status": "timeout", "detail": "its runner did not stop; killed"}
            return None
        nb = gpu_figures.read_notebook(target)
        record = (nb or {}).get("metadata", {}).get("course", {}).get("gpu_run")
        if record is None:
            tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.exists() else []
            record = {"status": "failed", "detail": f"its runner exited with status "
                      f"{process.returncode}: {' '.join(tail)[:200]}"}
        return record


def notebooks(kind: str, only: list[str]) -> list[Path]:
    paths = sorted((ROOT / kind).glob("*.ipynb"))
    return [p for p in paths if not only or any(o in f"{kind}/{p.stem}" for o in only)]


def run_notebooks(runner: Runner, kind: str, paths: list[Path], jobs: int) -> dict:
    """Run ``paths`` ``jobs`` at a time; {"kind/name": record}. Prints a line for each."""
    records, running, waiting = {}, [], list(paths)

    def done(path, record):
        key = f"{kind}/{path.name}"
        records[key] = record
        seconds = f"{record['seconds']:.1f} s, " if record.get("seconds") is not None else ""
        detail = f": {record['detail']}" if record.get("detail") else ""
        print(f"{key}: {seconds}{record['status']}{detail}", flush=True)

    while waiting or running:
        while waiting and len(running) < jobs:
            path = waiting.pop(0)
            started = runner.start(path, kind)
            if started is None:
                for path in [path] + waiting:
                    done(path, {"status": "not run", "detail": "time budget"})
                waiting = []
                break
            running.append((path, started))
        if jobs == 1 and running:
            path, started = running.pop()
            done(path, runner.finish(*started))
            continue
        for item in list(running):
            record = runner.finish(*item[1], wait=False)
            if record is not None:
                running.remove(item)
                done(item[0], record)
        time.sleep(0.5)
    return records


# --- 2. the server check ----------------------------------------------------------------------

def server_check(out_dir: Path, budget_seconds: float, allow_cpu: bool) -> dict:
    """``benchmarks.gpu_server.run(out_dir, budget_seconds)``: {"result": what it returned}, or
    {"error": why not}."""
    try:
        module = importlib.import_module("benchmarks.gpu_server")
    except ModuleNotFoundError as exc:
        if exc.name in ("benchmarks", "benchmarks.gpu_server"):
            return {"error": "benchmarks/gpu_server.py is not in this copy of the course"}
        return {"error": f"benchmarks.gpu_server could not be imported: "
                         f"{type(exc).__name__}: {exc}"}
    except Exception as exc:
        return {"error": f"benchmarks.gpu_server could not be imported: "
                         f"{type(exc).__name__}: {exc}"}
    kwargs = {}
    if allow_cpu and "allow_cpu" in inspect.signature(module.run).parameters:
        kwargs["allow_cpu"] = True
    try:
        result = module.run(out_dir, budget_seconds, **kwargs)
    except Exception as exc:
        return {"error": f"benchmarks.gpu_server.run raised {type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc()[-4000:]}
    return {"result": result}


def run_server_check(out: Path, budget: float, allow_cpu: bool, env: dict) -> dict:
    """The server check in a process of its own, killed 120 s past its budget."""
    record_path = out / "server-check.json"
    record_path.unlink(missing_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--server-check", str(out),
               "--server-budget", f"{budget:.0f}"] + (["--allow-cpu"] if allow_cpu else [])
    start = time.monotonic()
    log = out / "logs" / "server-check.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as handle:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=handle,
                                   stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            process.wait(timeout=budget + 120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    seconds = round(time.monotonic() - start, 1)
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        killed = ", killed 120 s past its budget" if process.returncode == -9 else ""
        record = {"error": f"the check ended without a result (status {process.returncode}"
                           f"{killed})"}
    if "error" in record:                 # what it printed before it stopped
        record["log_tail"] = log.read_text(errors="replace").strip().splitlines()[-20:]
    record.update(seconds=seconds, budget_seconds=round(budget))
    return record


# --- 5. the report ----------------------------------------------------------------------------

def open_results(path: Path, scratch: Path) -> Path:
    """The folder of a run's results: ``path`` itself, or what the .tar.gz ``path`` holds
    (unpacked into ``scratch``): the folder in it that has run.json, lessons/ or workbooks/."""
    path = Path(path)
    if path.is_file():
        with tarfile.open(path) as archive:
            try:
                archive.extractall(scratch, filter="data")
            except TypeError:                      # a Python without extraction filters
                archive.extractall(scratch)
        path = scratch
    if not path.is_dir():
        raise SystemExit(f"--report-from: {path} is neither a folder nor a .tar.gz archive")
    for folder in [path] + sorted(p.parent for p in path.rglob("run.json")) + \
            sorted({p.parent.parent for p in path.rglob("*.ipynb")}):
        if (folder / "run.json").exists() or any((folder / kind).is_dir() for kind in KINDS):
            return folder
    raise SystemExit(f"--report-from: no executed notebooks (lessons/, workbooks/) in {path}")


def collect(results: Path, lessons: Path = ROOT / "lessons", fresh: bool = False) -> dict:
    """Everything the report says, from a run's folder and the committed lessons: the data of
    docs/gpu-run.json. ``fresh``: the run has just executed this checkout's lessons, so the
    claims' verdicts are of the sentences as they are now (else they are compared with the
    run's commit, and those changed since are stale)."""
    run = {}
    if (results / "run.json").exists():
        run = json.loads((results / "run.json").read_text(encoding="utf-8"))
    records = dict(run.get("notebooks", {}))
    for kind in KINDS:                                  # copies the run.json does not list
        for copy in sorted((results / kind).glob("*.ipynb")):
            key = f"{kind}/{copy.name}"
            if key not in records:
                nb = gpu_figures.read_notebook(copy) or {}
                records[key] = nb.get("metadata", {}).get("course", {}).get(
                    "gpu_run", {"status": "unknown", "detail": "no record of its run"})
    rows = []
    for key in sorted(records, key=lambda k: (KINDS.index(k.split("/")[0]), k)):
        kind, name = key.split("/", 1)
        record = records[key]
        committed = gpu_figures.read_notebook(lessons / name) if kind == "lessons" else None
        cpu = (committed or {}).get("metadata", {}).get("course", {}).get("execution_seconds")
        rows.append({"kind": kind, "name": name, "status": record.get("status", "unknown"),
                     "detail": record.get("detail", ""),
                     "seconds": record.get("seconds") if kind == "lessons" else None,
                     "cpu_seconds": cpu})

    figures, topics = {}, {}
    for committed_path in sorted(lessons.glob("*.ipynb")):
        number = gpu_figures.lesson_number(committed_path)
        committed = gpu_figures.read_notebook(committed_path)
        copy = gpu_figures.read_notebook(results / "lessons" / committed_path.name)
        cpu = gpu_figures.headlines(committed, number)
        if not cpu:
            continue
        gpu = gpu_figures.headlines(copy, number) if copy else {k: "not run" for k in cpu}
        only = {f.label for f in gpu_figures.FIGURES if f.lesson == number and f.gpu_only}
        table = [{"label": label, "gpu_only": label in only,
                  "cpu": "GPU only" if label in only and cpu[label] == gpu_figures.NOT_FOUND
                  else cpu[label], "gpu": gpu[label]} for label in cpu]
        figures[number] = {"title": gpu_figures.lesson_title(committed), "rows": table}
        if copy:
            topics[f"lesson {number}"] = [f"{row['label']}: {row['gpu']} (laptop CPU: "
                                          f"{row['cpu']})" for row in table]
    for topic, (number, markers) in gpu_figures.TOPICS.items():
        copy = next((gpu_figures.read_notebook(p) for p in (results / "lessons").glob(
            f"{number}_*.ipynb")), None)
        lines = gpu_figures.topic_lines(copy, markers)
        if lines:
            topics[topic] = lines

    server = run.get("server", {"skipped": "no server check was recorded"})
    if "result" in server:
        result = server["result"] if isinstance(server["result"], dict) else {}
        lines = [str(line) for line in result.get("lines", [])]
        server = {"status": "ran", "lines": lines, "checks": result.get("checks", {}),
                  "seconds": server.get("seconds"), "budget_seconds": server.get("budget_seconds")}
        if lines:
            topics["server"] = lines
    elif "error" in server:
        server = {"status": "failed", "error": server["error"],
                  "log_tail": server.get("log_tail", []), "seconds": server.get("seconds")}
    else:
        server = {"status": "not run", "error": server.get("skipped", "")}

    data = {"device": run.get("device", "unknown device"), "date": run.get("date", "undated"),
            "commit": run.get("commit", "unknown"),
            "cpu_only": run.get("cpu_only", False), "versions": run.get("versions", {}),
            "command": run.get("command", ""), "budget_seconds": run.get("budget_seconds"),
            "wall_seconds": run.get("wall_seconds"), "jobs": run.get("jobs"),
            "notebooks": rows, "figures": figures, "server": server, "topics": topics}
    data["claims"] = claims.record_entries(data, fresh=fresh)
    return data


def _cell(value) -> str:
    return str(value).replace("|", "/").replace("\n", " ")


def _result(row: dict) -> str:
    status, detail = row["status"], row["detail"]
    words = {"ok": "ok", "failed": "FAILED", "timeout": "TIMED OUT",
             "stopped": "stopped: time budget", "not run": "not run"}.get(status, status)
    if status == "not run":
        return f"not run: {detail}" if detail else words
    return f"{words}: {detail}" if detail and status != "ok" else words


def markdown(data: dict) -> str:
    """docs/gpu-run.md from ``collect``'s data."""
    versions = data["versions"]
    here = "this CPU" if data["cpu_only"] else "this GPU"
    lines = ["# The course on a GPU", "",
             f"Written by `make test-gpu` (`scripts/run_lessons_gpu.py`) on {data['date']}."]
    if data["cpu_only"]:
        lines += ["", "**Not a GPU run.** This ran on a CPU (`--allow-cpu`) to check the "
                  "script; its figures are no GPU's."]
    lines += ["", f"- device: {data['device']}", f"- commit: {data.get('commit', 'unknown')}"]
    if versions:
        lines.append("- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()))
    if data["command"]:
        lines.append(f"- command: `{data['command']}`")
    if data["wall_seconds"] is not None:
        budget = (f", time budget {data['budget_seconds']:.0f} s"
                  if data["budget_seconds"] else "")
        lines.append(f"- the whole run: {data['wall_seconds']:.0f} s{budget}")

    counts = {}
    for row in data["notebooks"]:
        counts[row["status"]] = counts.get(row["status"], 0) + 1
    lines += ["", "## The notebooks", "",
              "Each notebook ran in a fresh kernel, from a copy, with its own folder as working "
              "directory. Lessons ran one at a time: their times are this device's. Workbooks "
              f"(every exercise left as a stub) ran {data['jobs'] or 'several'} at a time, so "
              "their times are not given. The CPU column is the time `make execute` recorded "
              "for the committed lesson (a 2-core laptop CPU, one torch thread).", "",
              f"Results: {', '.join(f'{n} {s}' for s, n in sorted(counts.items())) or 'none'}.",
              "", f"| notebook | result | {here} (s) | laptop CPU (s) |", "|---|---|---:|---:|"]
    for row in data["notebooks"]:
        seconds = "" if row["seconds"] is None else f"{row['seconds']:.1f}"
        cpu = "" if row["cpu_seconds"] is None else f"{row['cpu_seconds']:.1f}"
        lines.append(f"| {row['kind']}/{row['name']} | {_cell(_result(row))} | {seconds} | {cpu} |")

    lines += ["", "## Headline figures", "",
              "Each lesson's figures as its cells printed them: the committed outputs (a laptop "
              "CPU) beside the copy executed here. \"not found\": the cell did not print it "
              "(it failed, or was not reached).", ""]
    for number, lesson in data["figures"].items():
        lines += [f"### {lesson['title'] or 'Lesson ' + number}", "",
                  f"| figure | laptop CPU (committed outputs) | {here} |", "|---|---|---|"]
        lines += [f"| {_cell(r['label'])} | {_cell(r['cpu'])} | {_cell(r['gpu'])} |"
                  for r in lesson["rows"]]
        lines.append("")

    lines += claims_section(data.get("claims", []))
    server = data["server"]
    lines += ["## The server on this device (`benchmarks/gpu_server.py`)", ""]
    if server["status"] == "ran":
        took = (f" It took {server['seconds']:.0f} s of its {server['budget_seconds']} s."
                if server.get("seconds") is not None else "")
        lines += [f"What the check printed.{took}", "", "```text", *server["lines"], "```"]
        if server["checks"]:
            lines += ["", "Checks: " + "; ".join(f"{k}: {v}" for k, v in
                                                 server["checks"].items()) + "."]
    elif server["status"] == "failed":
        lines.append(f"The check did not run to its end: {server['error']}.")
        if server["log_tail"]:
            lines += ["", "Its last lines:", "", "```text", *server["log_tail"], "```"]
    else:
        lines.append(f"Not run{': ' + server['error'] if server['error'] else ''}.")

    quoted = {k: v for k, v in data["topics"].items() if k in gpu_figures.TOPICS}
    if quoted:
        lines += ["", "## Quoted by the lessons", "",
                  "What the cells that a lesson quotes from this record printed here "
                  "(`helpers.gpu_run.gpu_record(topic)`; every lesson's figures above are "
                  "topics too, \"lesson 01\" to \"lesson 10\").", ""]
        for topic, topic_lines in quoted.items():
            lines += [f"**{topic}**", "", "```text", *topic_lines, "```", ""]

    lines += ["", "## How to reproduce", "",
              "On a machine with an NVIDIA GPU and a CUDA build of torch (the course folder, "
              "nothing installed):", "", "```sh",
              f"python3 -m pip install --no-deps -r {REQUIREMENTS}   # what the image lacks, "
              "in seconds", "python3 scripts/run_lessons_gpu.py --jobs 4   # or: make test-gpu",
              "```", "",
              "With no network on that machine: `sh scripts/gpu_wheels.sh WHEELS` where there "
              "is one, carry WHEELS, install with `python3 -m pip install --no-index --no-deps "
              "WHEELS/*.whl`. With `--archive run.tar.gz` the run packs its executed copies; "
              "`python3 scripts/run_lessons_gpu.py --report-from run.tar.gz` writes this file "
              "from them anywhere."]
    return "\n".join(lines).rstrip() + "\n"


def server_table(lines: list[str]) -> list[str]:
    """The README's table of the server check: per number of clients, tokens/s, the median gap
    between tokens and the median TTFT with CUDA graphs off and on ("(tokens arrive in bursts)"
    where the median gap is under 0.1 ms: most tokens come several to a read)."""
    rows = {}
    for line in lines:
        found = re.match(r"^\s*(\d+)\s+(off|on)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+\s*$", line)
        if found:
            clients, graphs, *numbers = found.groups()
            rows.setdefault(int(clients), {})[graphs] = [float(n) for n in numbers]
    table = ["| clients | tokens/s, graphs off → on | gap between tokens p50, off → on | "
             "TTFT p50, off → on |", "|---:|---:|---:|---:|"]
    for clients, row in sorted(rows.items()):
        if set(row) != {"off", "on"}:
            continue
        (tps0, ttft0, gap0), (tps1, ttft1, gap1) = row["off"], row["on"]
        gap = ("(tokens arrive in bursts)" if min(gap0, gap1) < 0.1
               else f"{gap0:.2f} → {gap1:.2f} ms")
        ttft = " → ".join(f"{t:.1f}" if t < 10 else f"{t:.0f}" for t in (ttft0, ttft1))
        table.append(f"| {clients} | {tps0:,.0f} → {tps1:,.0f} | {gap} | {ttft} ms |")
    return table


def claims_section(entries: list[dict]) -> list[str]:
    """The claims' verdicts on this run (scripts/claims.py), as a table."""
    if not entries:
        return []
    lines = ["## The course's claims on this run", "",
             "Each sentence of the lessons, the README and the guide that states an effect on a "
             "GPU, judged on this run's figures by `scripts/claims.py`. *stale*: the sentence "
             "changed after this run, so its verdict is of an older sentence; a new run judges "
             "it.", "", "| claim | where | verdict | figures |", "|---|---|---|---|"]
    for e in entries:
        verdict = e["verdict"] + (" (stale)" if e.get("stale") else "")
        shown = "; ".join(f"{k}: {v}" for k, v in e["figures"].items())
        lines.append(f"| {e['id']} | {_cell(e['place'])} | {verdict} | {_cell(shown)} |")
    return lines + [""]


def write_claims(report: Path, record: Path) -> dict:
    """The claims' verdicts written again into an existing record (its figures, its commit)."""
    data = json.loads(record.read_text(encoding="utf-8"))
    data["claims"] = claims.record_entries(data, fresh=False)
    report.write_text(markdown(data), encoding="utf-8")
    record.write_text(json.dumps(data, indent=1) + "\n")
    return data


def write_report(results: Path, report: Path, record: Path, fresh: bool = False) -> dict:
    data = collect(results, fresh=fresh)
    report.parent.mkdir(parents=True, exist_ok=True)
    report.write_text(markdown(data), encoding="utf-8")
    record.parent.mkdir(parents=True, exist_ok=True)
    # ASCII (the rest escaped): helpers.gpu_run reads it whatever the machine's encoding
    record.write_text(json.dumps(data, indent=1) + "\n")
    return data


# --- the command line -------------------------------------------------------------------------

def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", action="append", default=[],
                    help="run only notebooks whose path contains one of these (comma-separated; "
                         "e.g. 02, lessons/, workbooks/07)")
    ap.add_argument("--jobs", type=int, default=1, help="workbooks at a time (default 1)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per notebook (300)")
    ap.add_argument("--budget", type=float, default=None,
                    help="seconds after which no notebook starts and a running one is stopped")
    ap.add_argument("--no-server", action="store_true", help="skip the server check")
    ap.add_argument("--server-budget", type=float, default=300,
                    help="seconds for the server check (300; never past --budget)")
    ap.add_argument("--out", default=str(OUT), help="executed copies and logs (results/gpu)")
    ap.add_argument("--report", default=str(REPORT), help="the report (docs/gpu-run.md)")
    ap.add_argument("--json", default=str(RECORD), help="its data (docs/gpu-run.json)")
    ap.add_argument("--archive", default=None,
                    help="also pack the results folder into this .tar.gz (for --report-from)")
    ap.add_argument("--report-from", default=None, metavar="DIR",
                    help="write the report from executed copies in DIR (or a .tar.gz); run nothing")
    ap.add_argument("--claims", action="store_true",
                    help="judge the course's claims again on the existing record (--json) and "
                         "rewrite it and the report; run nothing")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="run without a CUDA device, to check this script (the report says so)")
    # what the script's own worker processes run
    ap.add_argument("--execute-one", nargs=2, metavar=("NOTEBOOK", "COPY"), help=argparse.SUPPRESS)
    ap.add_argument("--budget-cut", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--server-check", metavar="DIR", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.only = [part.strip() for item in args.only for part in item.split(",") if part.strip()]
    if args.jobs < 1 or args.timeout <= 0:
        ap.error("--jobs must be at least 1 and --timeout positive")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.execute_one:
        source, target = (Path(p) for p in args.execute_one)
        record = execute_copy(source, target, args.timeout, args.budget_cut)
        return 0 if record["status"] == "ok" else 1
    if args.server_check:
        out = Path(args.server_check)
        record = server_check(out, args.server_budget, args.allow_cpu)
        (out / "server-check.json").write_text(json.dumps(record, indent=1, default=str),
                                               encoding="utf-8")
        return 0
    if args.claims:
        data = write_claims(Path(args.report), Path(args.json))
        stale = sum(e["stale"] for e in data["claims"])
        print(f"claims: {len(data['claims'])} judged on {args.json}, {stale} stale")
        return 0
    if args.report_from:
        with tempfile.TemporaryDirectory() as scratch:
            results = open_results(Path(args.report_from), Path(scratch))
            data = write_report(results, Path(args.report), Path(args.json))
        print(f"report: {args.report}, {args.json} ({len(data['notebooks'])} notebooks)")
        return _status(data["notebooks"])

    missing = missing_packages()
    if missing:
        print(install_hint(missing))
        return 3
    machine = describe_machine()
    if machine["cpu_only"] and not args.allow_cpu:
        import torch
        why = (f"torch {torch.__version__} is a build without CUDA" if torch.version.cuda is None
               else f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no GPU")
        print(f"No CUDA device: {why}. `make test-gpu` runs the lessons on an NVIDIA GPU with a "
              "CUDA build of torch; nothing was run. (--allow-cpu runs them here anyway, to check "
              "this script.)", file=sys.stderr)
        return 2
    print(f"device: {machine['device']}", flush=True)
    absent = [package for module, package in OPTIONAL if importlib.util.find_spec(module) is None]
    if absent:
        print(f"note: {', '.join(absent)} is not installed; lesson 04 skips its library path")

    started = time.monotonic()
    out = Path(args.out)
    for kind in KINDS:
        for old in (out / kind).glob("*.ipynb"):
            old.unlink()                      # a report is of one run only
    out.mkdir(parents=True, exist_ok=True)
    run = {**machine, "command": "python scripts/run_lessons_gpu.py " + shlex.join(argv),
           "budget_seconds": args.budget, "jobs": args.jobs, "notebooks": {}}
    runner = Runner(out, args.timeout, args.budget, started)

    if args.no_server:
        run["server"] = {"skipped": "--no-server"}
    else:
        budget = min(args.server_budget, runner.left())
        print(f"server check (at most {budget:.0f} s) ...", flush=True)
        run["server"] = run_server_check(out, budget, args.allow_cpu, runner.env)
        result = run["server"].get("result")
        said = (result.get("lines", []) if isinstance(result, dict) else []) or run[
            "server"].get("log_tail", [])
        print("\n".join(f"  {line}" for line in said))
        print(f"server check: {run['server'].get('error', 'done')} "
              f"({run['server']['seconds']:.0f} s)", flush=True)
    for kind, jobs in (("lessons", 1), ("workbooks", args.jobs)):
        run["notebooks"].update(run_notebooks(runner, kind, notebooks(kind, args.only), jobs))
    run["wall_seconds"] = round(time.monotonic() - started, 1)
    (out / "run.json").write_text(json.dumps(run, indent=1, default=str) + "\n",
                                encoding="utf-8")

    data = write_report(out, Path(args.report), Path(args.json), fresh=True)
    if args.archive:
        with tarfile.open(args.archive, "w:gz") as archive:
            archive.add(out, arcname="gpu")
        print(f"archive: {args.archive}")
    print(f"report: {args.report}, {args.json}; {run['wall_seconds']:.0f} s in all")
    return _status(data["notebooks"])


def _status(rows: list[dict]) -> int:
    bad = [f"{r['kind']}/{r['name']}" for r in rows if r["status"] not in ("ok", "not run")]
    if bad:
        print("did not run to their end:", ", ".join(bad), file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
