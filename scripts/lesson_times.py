"""Print the lessons' recorded run times (from `make execute`) as a markdown table.

    python scripts/lesson_times.py
"""

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def table() -> str:
    rows = ["| lesson | run, seconds (CPU, 2 cores, 1 thread) |", "|---|---:|"]
    for path in sorted((ROOT / "lessons").glob("*.ipynb")):
        meta = json.loads(path.read_text())["metadata"].get("course", {})
        rows.append(f"| {path.stem} | {meta.get('execution_seconds', 'not recorded')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
