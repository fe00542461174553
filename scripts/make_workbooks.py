"""Write the workbooks: each lesson with its solutions cut to stubs (`make workbooks`).

    python scripts/make_workbooks.py            # (re)write workbooks/*.ipynb from lessons/
    python scripts/make_workbooks.py --check    # exit 1 if a workbook is out of step

A lesson is the complete edition: an exercise's solution sits between two marker lines,

    ### BEGIN SOLUTION
    ...
    ### END SOLUTION

(nbgrader's markers), and the cell right after it is a check (`... = check_...(...)`). The
workbook keeps everything else and replaces each marked region by a stub at the same
indentation, `# YOUR CODE HERE` and `raise NotImplementedError()`, which the checks report as
"not written yet". Outputs and execution counts are cleared, the Colab badge points at the
workbook, and the title says where the complete lesson is. The same lessons always give the
same workbooks, byte for byte.
"""

import argparse
import copy
import json
import pathlib
import re
import sys

import nbformat

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from notebook_setup import ROOT, colab_badge  # noqa: E402

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = ("# YOUR CODE HERE", "raise NotImplementedError()")
CHECK_CALL = re.compile(r"\bcheck_\w+\(")
WORKBOOK_NOTE = (
    "**This is the workbook.** Each *Your turn* cell is left for you to write; run the check "
    "under it and it tells you at once whether your code is right. An exercise you skip or get "
    "wrong does not stop the notebook: the cells after it go on with the course's version. "
    "Stuck? In a new cell, `from helpers.checks import hint`, then `hint(\"{first}\")` (or the name "
    "of another exercise): the first call gives the idea, the second the tools, the third the "
    "shape of the answer. The complete lesson, solutions included, is "
    "[`lessons/{name}`](../lessons/{name}).")


def cut_solutions(source: str, where: str) -> tuple[str, int]:
    """``source`` with every marked solution replaced by a stub; also the number of stubs."""
    out, inside, stubs = [], False, 0
    for number, line in enumerate(source.split("\n"), 1):
        marker = line.strip()
        if marker == BEGIN:
            if inside:
                raise ValueError(f"{where}, line {number}: {BEGIN} inside another solution")
            inside, indent = True, line[:len(line) - len(line.lstrip())]
            out += [indent + STUB[0], indent + STUB[1]]
            stubs += 1
        elif marker == END:
            if not inside:
                raise ValueError(f"{where}, line {number}: {END} without a {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{where}: {BEGIN} is never closed by {END}")
    return "\n".join(out), stubs


def exercise_names(source: str) -> list[str]:
    """The function or class each solution of a cell belongs to: the nearest ``def`` or
    ``class`` above its marker that starts a line (a method's solution belongs to its class)."""
    names, last = [], None
    for line in source.split("\n"):
        top = re.match(r"(?:async\s+)?(?:def|class)\s+(\w+)", line)
        last = top.group(1) if top else last
        if line.strip() == BEGIN and last:
            names.append(last)
    return names


def workbook(lesson: dict, name: str) -> tuple[dict, int]:
    """The workbook of one lesson (a notebook as a dict) and its number of exercises."""
    nb = copy.deepcopy(lesson)
    cells, exercises, names = nb["cells"], 0, []
    for i, cell in enumerate(cells):
        source = "".join(cell["source"])
        if cell["cell_type"] == "code":
            names += exercise_names(source)
            new, stubs = cut_solutions(source, f"{name} cell {i}")
            if stubs:
                follower = next((c for c in cells[i + 1:] if c["cell_type"] == "code"), None)
                if follower is None or not CHECK_CALL.search("".join(follower["source"])):
                    raise ValueError(f"{name} cell {i}: an exercise must be followed by a check "
                                     f"cell (one that calls check_...)")
                exercises += 1
            cell["source"] = new
            cell["outputs"] = []
            cell["execution_count"] = None
        else:
            cell["source"] = source
        metadata = cell.get("metadata", {})
        metadata.pop("execution", None)
        cell["metadata"] = metadata
    title = cells[0]["source"].split("\n")
    title = [colab_badge(name, folder="workbooks") if "colab-badge.svg" in line else line
             for line in title]
    note = WORKBOOK_NOTE.format(name=name, first=names[0] if names else "name")
    cells[0]["source"] = "\n".join(title[:1] + ["", note] + title[1:])
    nb["metadata"].pop("course", None)
    return nb, exercises


def write(nb: dict) -> str:
    return nbformat.writes(nbformat.from_dict(nb)) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--check", action="store_true", help="report stale workbooks, write nothing")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "workbooks")
    args = ap.parse_args()
    stale, counts = [], {}
    if not args.check:
        args.out.mkdir(exist_ok=True)
    for path in sorted((ROOT / "lessons").glob("*.ipynb")):
        nb, counts[path.name] = workbook(json.loads(path.read_text()), path.name)
        if not counts[path.name]:
            raise SystemExit(f"{path.name} has no exercise ({BEGIN} ... {END})")
        text, target = write(nb), args.out / path.name
        if not target.exists() or target.read_text() != text:
            stale.append(path.name)
            if not args.check:
                target.write_text(text)
    if args.check:
        print("out of step: " + (", ".join(stale) or "none"))
        return 1 if stale else 0
    print("exercises per workbook: " + ", ".join(f"{n} {c}" for n, c in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
