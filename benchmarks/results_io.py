"""Where every benchmark leaves its figures: ``<name>.json`` (all numbers) and ``<name>.md``
(the table the README links), side by side in one folder."""

import json
import pathlib
import statistics


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


def spread(values) -> dict:
    """Median, min and max of one figure over the repetitions, and the runs themselves."""
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "runs": [round(v, 6) for v in values]}


def pyplot():
    """matplotlib's pyplot on the Agg backend: figures go to files, no window opens."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, path, dpi: int = 110) -> None:
    """Lay ``fig`` out, write it as a PNG to ``path`` and free it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
