"""Mutation test of the learners' checks: does each check catch the slips a learner can make?

    python scripts/mutate_checks.py                     # every exercise; writes the report
    python scripts/mutate_checks.py --exercise 03:merge_batches --exercise 10   # some of them
    python scripts/mutate_checks.py --list               # the exercises it knows
    python scripts/mutate_checks.py --render             # the report again from the results

For every exercise of the registry (``scripts/check_exercises.py``), it takes the solution out
of the lesson (the lines between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` of the cell
that defines the exercise's function or class), makes every mutant of it (``scripts/mutants.py``:
a comparison, an operator, a number off by one, swapped operands, a dtype, a dropped keyword,
call, copy or statement, a tensor made without the input's device, a model pass repeated, ...), runs the exercise's check on each mutant, on the bundled model on the
CPU, and records whether the check flagged it (✗), passed it (✓), or never returned (a mutant
that loops forever, stopped after a time limit: the learner sees a cell that never ends).

A mutant the check passes is either harmless, listed in the registry with the reason it changes
nothing the lesson relies on, or missed: a hole in the check. The results go to
``docs/check-mutations.json`` (what each mutant did, with a fingerprint of what the results
depend on: the solution, the check's module, the mutator) and the report to
``docs/check-mutations.md``. ``tests/test_check_mutations.py`` checks that both are current and
reruns a few mutants. A full run takes a few minutes (2 to 4 on a busy 2-core machine).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import io
import json
import pathlib
import signal
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT))

from check_exercises import EXERCISES, Exercise  # noqa: E402
from mutants import mutants  # noqa: E402

RESULTS = ROOT / "docs" / "check-mutations.json"
REPORT = ROOT / "docs" / "check-mutations.md"
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
TIME_LIMIT = 20           # seconds a mutant's check may run before it counts as never ending


# ---- the exercise's cell --------------------------------------------------------------------

def lesson_path(exercise: Exercise) -> pathlib.Path:
    found = sorted((ROOT / "lessons").glob(f"{exercise.lesson}_*.ipynb"))
    if not found:
        raise SystemExit(f"no lesson {exercise.lesson} in lessons/")
    return found[0]


def exercise_cell(exercise: Exercise) -> str:
    """The source of the code cell that defines ``exercise.name`` and holds its solution."""
    import ast

    nb = json.loads(lesson_path(exercise).read_text())
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] != "code" or BEGIN not in source:
            continue
        tree = ast.parse(source)
        if any(isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
               and node.name == exercise.name for node in tree.body):
            return source
    raise SystemExit(f"{exercise.key}: no cell of {lesson_path(exercise).name} defines "
                     f"{exercise.name} with a solution in it")


def solution_lines(source: str, name: str) -> list[int]:
    """The line numbers (1-based) between the markers inside ``name``'s definition."""
    import ast

    tree = ast.parse(source)
    node = next(n for n in tree.body if getattr(n, "name", None) == name)
    lines, inside = [], False
    for number, line in enumerate(source.split("\n"), 1):
        if not node.lineno <= number <= node.end_lineno:
            continue
        if line.strip() == BEGIN:
            inside = True
        elif line.strip() == END:
            inside = False
        elif inside:
            lines.append(number)
    return lines


def fingerprint(exercise: Exercise) -> str:
    """What the mutants' outcomes depend on: the cell, the check's module and the machinery."""
    parts = [exercise_cell(exercise), exercise.setup, repr(exercise.args), repr(exercise.needs)]
    module = exercise.check_module()
    for path in (ROOT / "helpers" / "checks" / f"{module}.py",
                 ROOT / "helpers" / "checks" / "core.py",
                 ROOT / "helpers" / "checks" / "counting.py",
                 ROOT / "scripts" / "mutants.py"):
        parts.append(path.read_text() if path.exists() else "")
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


# ---- running a check on a mutant ------------------------------------------------------------

class NeverEnds(BaseException):
    """Raised by the timer in a mutant that runs past TIME_LIMIT (a BaseException, so that the
    check's own ``except Exception`` does not turn it into a hint)."""


def _alarm(signum, frame):
    raise NeverEnds()


def context(device: str = "cpu"):
    """What the checks take after the learner's answer, as the lessons pass it."""
    from helpers import load_model

    model, tokenizer = load_model(device=device)
    return {"model": model, "tokenizer": tokenizer, "device": model.device}


def namespace_for(exercise: Exercise, by_key: dict) -> dict:
    """A fresh namespace with what the exercise's cell needs from earlier cells."""
    ns: dict = {"__name__": "__lesson__"}
    exec(exercise.setup, ns)                                   # noqa: S102
    for other in exercise.needs:
        exec(compile(exercise_cell(by_key[other]), f"<{other}>", "exec"), ns)  # noqa: S102
    return ns


def run_check(exercise: Exercise, source: str, ctx: dict, by_key: dict) -> tuple[str, str]:
    """(outcome, the line the check printed) for the cell ``source`` (a mutant or not):
    caught, survived, never ends, or invalid (Python refuses to run the cell)."""
    import helpers.checks

    ns = namespace_for(exercise, by_key)
    try:
        exec(compile(source, f"<{exercise.key}>", "exec"), ns)   # noqa: S102
        answer = ns[exercise.name]
    except Exception as error:                                 # noqa: BLE001
        return "invalid", f"{type(error).__name__}: {error}"[:200]
    check = getattr(helpers.checks, exercise.check)
    accepted = len(inspect.signature(check).parameters) - 1     # an older check takes fewer
    args = [ctx[a] for a in exercise.args][:accepted]
    out = io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, TIME_LIMIT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            check(answer, *args)
    except NeverEnds:
        return "never ends", f"still running after {TIME_LIMIT} s"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    line = out.getvalue().strip().splitlines()
    line = line[0] if line else ""
    if line.startswith("✓"):
        return "survived", line
    return "caught", line


def mutate(exercise: Exercise, ctx: dict, by_key: dict, progress=print) -> dict:
    """Every mutant of the exercise's solution through its check: the results' record."""
    source = exercise_cell(exercise)
    outcome, line = run_check(exercise, source, ctx, by_key)
    if outcome != "survived":
        raise SystemExit(f"{exercise.key}: the lesson's own solution does not pass: {line}")
    found = mutants(source, solution_lines(source, exercise.name))
    records, start = [], time.perf_counter()
    for i, mutant in enumerate(found, 1):
        outcome, line = run_check(exercise, mutant.source, ctx, by_key)
        records.append({"key": mutant.key, "line": mutant.line, "outcome": outcome,
                        "says": line[:240]})
        if progress and (i % 20 == 0 or i == len(found)):
            progress(f"  {exercise.key}: {i}/{len(found)} mutants, "
                     f"{time.perf_counter() - start:.0f} s")
    return {"fingerprint": fingerprint(exercise), "mutants": records}


# ---- the report -----------------------------------------------------------------------------

def classify(exercise: Exercise, record: dict) -> str:
    """caught, harmless, never ends, invalid or missed."""
    if record["outcome"] == "survived":
        return "harmless" if record["key"] in exercise.harmless else "missed"
    return record["outcome"]


def render(results: dict) -> str:
    rows, sections = [], []
    totals = dict.fromkeys(("mutants", "caught", "never ends", "harmless", "missed"), 0)
    for exercise in EXERCISES:
        result = results.get(exercise.key)
        if result is None:
            rows.append(f"| {exercise.key} | not run | | | | |")
            continue
        kinds = [classify(exercise, r) for r in result["mutants"]]
        counts = {k: kinds.count(k) for k in ("caught", "never ends", "harmless", "missed")}
        counted = [r for r, k in zip(result["mutants"], kinds) if k != "invalid"]
        totals["mutants"] += len(counted)
        for k, v in counts.items():
            totals[k] += v
        rows.append(f"| {exercise.key} | {len(counted)} | {counts['caught']} | "
                    f"{counts['never ends']} | {counts['harmless']} | {counts['missed']} |")
        lines = [f"### {exercise.key}", ""]
        lines.append(f"{len(counted)} mutants: {counts['caught']} caught, "
                     f"{counts['never ends']} never end, {counts['harmless']} harmless, "
                     f"{counts['missed']} missed.")
        harmless = [r for r, k in zip(result["mutants"], kinds) if k == "harmless"]
        missed = [r for r, k in zip(result["mutants"], kinds) if k == "missed"]
        endless = [r for r, k in zip(result["mutants"], kinds) if k == "never ends"]
        if missed:
            lines += ["", "Missed (the check passes a mutant that changes what the lesson "
                          "relies on):", ""]
            lines += [f"- {r['key']}" for r in missed]
        if harmless:
            lines += ["", "Harmless (the check passes them; why that is right):", ""]
            lines += [f"- {r['key']}: {exercise.harmless[r['key']]}" for r in harmless]
        if endless:
            lines += ["", f"Never end (stopped after {TIME_LIMIT} s; the learner's cell keeps "
                          f"running until interrupted):", ""]
            lines += [f"- {r['key']}" for r in endless]
        sections.append("\n".join(lines))
    table = ["| exercise | mutants | caught | never end | harmless | missed |",
             "|---|---:|---:|---:|---:|---:|"] + rows
    table.append(f"| **all** | {totals['mutants']} | {totals['caught']} | "
                 f"{totals['never ends']} | {totals['harmless']} | {totals['missed']} |")
    head = [
        "# Mutation test of the learners' checks",
        "",
        "Written by `python scripts/mutate_checks.py` (do not edit by hand). For every "
        "exercise, the lesson's solution is changed one slip at a time (`scripts/mutants.py`: "
        "comparison and arithmetic operators, numbers off by one, swapped operands, items and "
        "arguments, dtypes (integers made floats too), dropped keywords, calls, copies and "
        "statements, tensors made without the input's device, swapped statements, functions "
        "swapped for their opposite, a model pass, replay or all-reduce repeated), and the exercise's check runs on each mutant "
        "on the bundled model on the CPU. A mutant is *caught* when the check prints ✗; it "
        "*never ends* when it loops forever (stopped after "
        f"{TIME_LIMIT} s); it is *harmless* when the check passes it and it changes nothing "
        "the lesson relies on (each with its reason, from `scripts/check_exercises.py`); "
        "*missed* otherwise. Mutants Python refuses to run are not counted.",
        "",
        "The cases that stand for a GPU run the mutant as if its inputs were on one "
        "(`helpers.checks.core.OnTheGpu`), so a tensor made or left on the CPU is caught on "
        "the CPU as well.",
        "",
    ]
    return "\n".join(head + table) + "\n\n" + "\n\n".join(sections) + "\n"


def load_results() -> dict:
    return json.loads(RESULTS.read_text()) if RESULTS.exists() else {}


def save(results: dict) -> None:
    RESULTS.write_text(json.dumps(results, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
    REPORT.write_text(render(results))


def select(names: list[str]) -> list[Exercise]:
    if not names:
        return list(EXERCISES)
    chosen = []
    for name in names:
        found = [e for e in EXERCISES if e.key == name or e.lesson == name or e.name == name]
        if not found:
            raise SystemExit(f"unknown exercise {name!r}; --list shows them")
        chosen += [e for e in found if e not in chosen]
    return chosen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--exercise", action="append", default=[],
                    help="LL:name, a lesson number LL, or a name; repeat for more (default: all)")
    ap.add_argument("--list", action="store_true", help="list the exercises and stop")
    ap.add_argument("--render", action="store_true", help="write the report from the results")
    ap.add_argument("--results", type=pathlib.Path, default=None,
                    help="write the results here (and no report), e.g. to compare two versions")
    ap.add_argument("--device", default="cpu",
                    help="where the model and the cases go; the report is made on the CPU, "
                         "cuda shows which of its device mutants a GPU catches (with --results)")
    args = ap.parse_args()
    if args.list:
        for e in EXERCISES:
            print(f"{e.key:28} {e.check}")
        return 0
    results = load_results() if args.results is None else {}
    if not args.render:
        import torch

        torch.manual_seed(0)
        torch.set_num_threads(1)
        if args.device != "cpu" and args.results is None:
            raise SystemExit("--device needs --results: the committed report is the CPU's")
        ctx = context(args.device)
        by_key = {e.key: e for e in EXERCISES}
        for exercise in select(args.exercise):
            print(f"{exercise.key} ...", flush=True)
            results[exercise.key] = mutate(exercise, ctx, by_key)
            if args.results is None:
                save(results)                      # after each exercise: a stop loses little
    if args.results is not None:
        args.results.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
        return 0
    save(results)
    missed = sum(classify(e, r) == "missed" for e in EXERCISES
                 for r in results.get(e.key, {}).get("mutants", []))
    print(f"written {REPORT.relative_to(ROOT)}: {missed} missed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
