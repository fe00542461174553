"""Where every benchmark leaves its figures: ``<name>.json`` (all numbers) and ``<name>.md``
(the table the README links), side by side in one folder."""

import json
import pathlib


def write_results(folder, name: str, result: dict, markdown: str) -> None:
    """Write ``result`` as JSON and ``markdown`` as a table, then print the table."""
    out = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown)
    print(markdown)
