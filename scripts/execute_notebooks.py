"""Re-run lessons in place so that their committed outputs are current (`make execute`).

    python scripts/execute_notebooks.py lessons/01_text_generation.ipynb [...]

Each notebook runs in a fresh kernel with lessons/ as working directory, exactly as nbval
will run it; the wall time of each is printed and recorded in the notebook's metadata
(`course.execution_seconds`), which the README's lesson table quotes.
"""

import json
import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient


def execute(path: pathlib.Path) -> float:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()
    seconds = time.perf_counter() - start
    nb.metadata.setdefault("course", {})["execution_seconds"] = round(seconds, 1)
    nbformat.write(nb, path)
    # nbformat writes indent=1 JSON; keep a trailing newline like the sync script does.
    text = path.read_text()
    if not text.endswith("\n"):
        path.write_text(text + "\n")
    return seconds


def main(argv: list[str]) -> int:
    paths = [pathlib.Path(p) for p in argv] or sorted(pathlib.Path("lessons").glob("*.ipynb"))
    times = {}
    for path in paths:
        seconds = execute(path)
        times[path.name] = round(seconds, 1)
        print(f"{path.name}: {seconds:.1f} s", flush=True)
    print(json.dumps(times))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
