"""Where every benchmark leaves its figures: ``<name>.json`` (all numbers) and ``<name>.md``
(the table the README links), side by side in one folder; and the pieces every report is
written with (one table writer, the checks line, the machine), and the options every benchmark
takes (``arguments``, ``begin``). Figures: ``plots``."""

import argparse
import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def positive_int(text: str) -> int:
    """An option's whole number, at least 1 (argparse names the option when it is not)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def arguments(doc: str, quick: str, threads: bool = True) -> argparse.ArgumentParser:
    """The options every benchmark takes: ``--quick`` (``quick`` says what it cuts), ``--out``
    and, unless ``threads`` is False, ``--threads``; the benchmark adds its own."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"a smoke run: {quick}")
    if threads:
        parser.add_argument("--threads", type=positive_int, default=1,
                            help="torch threads (default 1, as in the lessons)")
    parser.add_argument("--out", default=str(RESULTS), help="output folder (benchmarks/results)")
    return parser


def begin(args) -> pathlib.Path:
    """Start a run: its torch threads, seed 0, the output folder made; returns the folder."""
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_results(folder, name: str, result: dict, markdown: str) -> None:
    """Write ``result`` as JSON and ``markdown`` as a table, then print the table."""
    out = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown)
    print(markdown)


def machine() -> str:
    """The CPU's model name and core count, e.g. "AMD EPYC (x86_64), 2 cores"."""
    import os
    import platform

    name = platform.processor() or ""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:  # not Linux
        pass
    return f"{name or 'unknown CPU'} ({platform.machine()}), {os.cpu_count()} cores"


def run_facts() -> dict:
    """What a result records about the run: torch threads, load average before it, the
    machine, and the versions of torch and transformers."""
    import torch
    import transformers

    return {"threads": torch.get_num_threads(), "load_average": load_average(),
            "machine": machine(), "torch": torch.__version__,
            "transformers": transformers.__version__}


def facts_line(facts: dict) -> str:
    """``run_facts`` as a report says them: machine, threads, versions, load average."""
    return (f"{facts['machine']}; {facts['threads']} torch thread(s), torch {facts['torch']}, "
            f"transformers {facts['transformers']}; load average before the run "
            f"{numbers(facts['load_average'])}")


def markdown_table(header: list[str], rows, align: str = "") -> list[str]:
    """A markdown table, as lines: ``header`` holds the column titles, ``rows`` the cells
    (strings, or anything ``str()`` turns into one), ``align`` one letter a column, "l" or
    "r" (left or right; missing letters are "l")."""
    align = align.ljust(len(header), "l")
    lines = ["| " + " | ".join(header) + " |",
             "|" + "".join("---:|" if a == "r" else "---|" for a in align)]
    return lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]


def verdicts(checks: dict[str, bool]) -> str:
    """``checks`` as "name met, other MISSED", for the last line of a report."""
    return ", ".join(f"{name} {'met' if ok else 'MISSED'}" for name, ok in checks.items())


def load_average() -> list[float] | None:
    """The machine's load average (1, 5, 15 minutes), None where the system has none."""
    import os

    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def numbers(values, digits: int = 1) -> str:
    """A load average (or any few numbers) as text: "1.2, 0.9, 0.7"."""
    return ", ".join(f"{x:.{digits}f}" for x in values or [])


def min_max(figure: dict, scale: float = 1.0, digits: int = 3) -> str:
    """The spread of a figure (``timing.spread``) as "min-max"."""
    return f"{figure['min'] * scale:.{digits}f}-{figure['max'] * scale:.{digits}f}"
