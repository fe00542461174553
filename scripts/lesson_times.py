"""How long each lesson takes: to run (recorded by `make execute`) and, estimated from the
notebook itself, for a learner to work through (the README's and the guide's minutes).

    python scripts/lesson_times.py            # the table
    python scripts/lesson_times.py --write    # and the README's and the guide's rows follow it

The learner's minutes add up what a lesson asks of them, counted in the notebook:
- prose: the words of its markdown at 180 words a minute (a careful reading of technical text;
  everyday reading runs at 230–300);
- code: the non-blank, non-comment lines of its code cells at 10 lines a minute (reading code
  and its printed output, and running each cell);
- figures: 1 minute for each plot or diagram it shows;
- "Your turn" exercises: 10 minutes each (reading the task, writing, running the check, a
  second try);
- the exercises at the end: 5 minutes each (trying one or reading its solution).
These rates are assumptions, stated here so that anyone can change them; they are not
measurements of learners.
"""

import json
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORDS_PER_MINUTE, CODE_LINES_PER_MINUTE = 180, 10
FIGURE_MINUTES, YOUR_TURN_MINUTES, END_EXERCISE_MINUTES = 1, 10, 5


def counts(nb: dict) -> dict:
    """What a learner meets in one lesson: words, code lines, figures, exercises."""
    words = code = figures = your_turn = end_exercises = 0
    for cell in nb["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown":
            words += len(re.findall(r"[A-Za-z0-9'’]+", source))
            if re.search(r"^#+ Exercises", source, re.M):
                after = source.split("Exercises", 1)[1].split("<details>")[0]
                end_exercises += len(re.findall(r"^\d+\.", after, re.M))
            figures += source.count("![")
        elif cell["cell_type"] == "code":
            code += sum(1 for line in source.splitlines()
                        if line.strip() and not line.strip().startswith("#"))
            # one exercise a cell, however many solution regions it holds (a class's methods)
            your_turn += any(line.strip() == "### BEGIN SOLUTION" for line in source.splitlines())
            figures += sum(1 for out in cell.get("outputs", []) if "image/png" in out.get("data", {}))
    return {"words": words, "code lines": code, "figures": figures, "your turn": your_turn,
            "end exercises": end_exercises}


def learner_minutes(c: dict) -> float:
    return (c["words"] / WORDS_PER_MINUTE + c["code lines"] / CODE_LINES_PER_MINUTE
            + c["figures"] * FIGURE_MINUTES + c["your turn"] * YOUR_TURN_MINUTES
            + c["end exercises"] * END_EXERCISE_MINUTES)


def table() -> str:
    rows = ["| lesson | words | code lines | figures | your turn | end exercises | "
            "learner, minutes | run, seconds (CPU, 2 cores, 1 thread) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for path in sorted((ROOT / "lessons").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        c = counts(nb)
        run = nb["metadata"].get("course", {}).get("execution_seconds", "not recorded")
        rows.append(f"| {path.stem} | {c['words']} | {c['code lines']} | {c['figures']} | "
                    f"{c['your turn']} | {c['end exercises']} | {learner_minutes(c):.0f} | {run} |")
    return "\n".join(rows)


def write() -> None:
    """Put each lesson's minutes and run seconds into the README's lesson table and the
    guide's time table (the rows tests/test_lesson_text.py compares with the notebooks)."""
    readme, guide = ROOT / "README.md", ROOT / "docs" / "instructors.md"
    texts = {readme: readme.read_text(), guide: guide.read_text()}
    total = 0
    for path in sorted((ROOT / "lessons").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        minutes = round(learner_minutes(counts(nb)))
        total += minutes
        seconds = nb["metadata"]["course"]["execution_seconds"]
        number = path.name[:2]
        texts[readme] = re.sub(rf"^(\| {int(number)} \| .*\| )\d+ / \d+ \|$",
                               rf"\g<1>{minutes} / {round(seconds)} |", texts[readme], flags=re.M)
        texts[guide] = re.sub(rf"^(\| {number} [^|]+\| )\d+( \| \d × 10 \| )[\d.]+ \|$",
                              rf"\g<1>{minutes}\g<2>{seconds} |", texts[guide], flags=re.M)
    for path, text in texts.items():      # the whole course's total, where a text quotes it
        path.write_text(re.sub(r"\(\d[\d,]* learner minutes, about \d+ hours\)",
                               f"({total} learner minutes, about {round(total / 60)} hours)", text))


if __name__ == "__main__":
    import sys

    print(table())
    if "--write" in sys.argv[1:]:
        write()
